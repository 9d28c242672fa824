"""The efa dispatcher inside real Megatron MoE layers on one GPU, ranks as processes (gloo group,
MPS on): the ``gda`` transport gives forward outputs and every gradient bitwise equal to the
``torch`` transport, and in drop-and-pad mode a CUDA-graph replay of the layer equals the layer
run eagerly. The layers and workers are :mod:`efa_ep.testing.moe_layer`. Skipped without CUDA."""
import pytest
import torch

from efa_ep.distributed import run_ranks
from efa_ep.testing.moe_layer import capacity_graph_worker, gda_vs_torch_layer_worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("world,dtype", [(2, "fp32"), (2, "bf16"), (4, "fp32"), (4, "bf16"),
                                         (8, "fp32"), (8, "bf16")])
def test_gda_layer_bitwise_equals_torch_transport(world, dtype):
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    sums = run_ranks(gda_vs_torch_layer_worker, world, (dtype,), timeout_s=240, env=env)
    assert all(s > 0 for s in sums)


@pytest.mark.parametrize("world,dtype", [(2, "fp32"), (4, "bf16")])
def test_gda_capacity_layer_cuda_graph_equals_eager(world, dtype):
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    res = run_ranks(capacity_graph_worker, world, (dtype,), timeout_s=300, env=env)
    assert all(r["ops"] >= 4 and r["ops"] % 2 == 0 for r in res), res
