"""``efa_ep.testing``: its routes are fixed (tests compare bit for bit and recorded results name
them), the two route families share no kind name, and importing it needs no Megatron."""
import hashlib
import subprocess
import sys

import pytest

from efa_ep.testing.routes import (BENCH_ROUTE_KINDS, CONTRACT_ROUTE_KINDS, bench_route,
                                   contract_route)


def _digest(route) -> str:
    idx, w = route
    return hashlib.sha256(idx.numpy().tobytes() + w.numpy().tobytes()).hexdigest()[:16]


# sha256 of (idx bytes + weight bytes) of T=33, E=16, K=3, W=4, seed 5 (bench: rank 1), as the
# tests' and the benchmark's route builders drew them before they moved here.
GOLDEN = {
    "random": "1afc39030f19b7b3", "hot_experts": "41b3a8077ca75e4a",
    "one_rank": "7515ed9b64cd44c2", "dropped": "30293ee5b3737444",
    "one_node": "634fed2edfebca40",
    "balanced": "a240d7d44c14ff91", "skewed": "c14fb768dc3a919d", "uniform": "9445e94c49402cb4",
}


@pytest.mark.parametrize("kind", CONTRACT_ROUTE_KINDS)
def test_contract_routes_are_fixed(kind):
    import torch

    idx, w = contract_route(kind, 33, 16, 3, 4, 5, node_size=2)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == w.shape == (33, 3)
    assert bool((w[idx < 0] == 0).all())
    assert _digest((idx, w)) == GOLDEN[kind]
    empty = contract_route(kind, 0, 16, 3, 4, 5, node_size=2)
    assert empty[0].shape == empty[1].shape == (0, 3)


@pytest.mark.parametrize("kind", BENCH_ROUTE_KINDS)
def test_bench_routes_are_fixed(kind):
    assert _digest(bench_route(kind, 33, 16, 3, 1, 4, 5)) == GOLDEN[kind]


def test_route_families_share_no_kind_name():
    assert not set(CONTRACT_ROUTE_KINDS) & set(BENCH_ROUTE_KINDS)
    for kind in BENCH_ROUTE_KINDS:
        with pytest.raises(ValueError, match="expected one of"):
            contract_route(kind, 4, 8, 2, 2, 0)
    for kind in CONTRACT_ROUTE_KINDS:
        with pytest.raises(ValueError, match="expected balanced, skewed or uniform"):
            bench_route(kind, 4, 8, 2, 0, 2, 0)
    with pytest.raises(ValueError, match="node_size"):
        contract_route("one_node", 4, 8, 2, 2, 0)


def test_importing_efa_ep_testing_imports_no_megatron():
    code = ("import sys, efa_ep.testing.routes, efa_ep.testing.moe_layer, "
            "efa_ep.testing.transports; "
            "print(any(m.startswith('megatron') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.stdout.split() == ["False"], out
