"""Stress subset of the ``gda`` transport (GPU, marker ``stress``): randomized rounds bit-identical
to the brute-force reference at EP 2 and 4 (ranks as processes on the GPU(s); start MPS first
when they share one). The full suite, with the figures recorded in RESULTS.md, is
``scripts/gpu/gda_stress.py`` (``scripts/gpu/gpu_gda_check.sh`` runs it in one GPU call). Rounds per EP
size: ``EFA_EP_STRESS_ROUNDS`` (default 60). Skipped without a CUDA GPU."""
import os

import pytest
import torch

from efa_ep.distributed import run_ranks

pytestmark = [pytest.mark.stress,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("world", [2, 4])
def test_gda_randomized_rounds_bit_identical(world):
    from efa_ep.testing.gda_stress import stress_worker

    rounds = int(os.environ.get("EFA_EP_STRESS_ROUNDS", "60"))
    stats = run_ranks(stress_worker, world, (rounds, 7, 10, 1e9), timeout_s=900,
                      pg_timeout_s=600, env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
    assert all(s["rounds"] == rounds for s in stats), stats
