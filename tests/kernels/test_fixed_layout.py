"""``Transport.dispatch_fixed``'s generic default (the regular dispatch copied into the fixed
``[W * T_MAX, ...]`` layout) over the torch, proxy and hier transports: same rows as
``dispatch``, unused rows marked, and ``combine`` / ``dispatch_cached`` /
``combine_topk_weights`` accept its handle."""
import pytest
import torch

from efa_ep.distributed import run_ranks

T_MAX, EXPERTS, HIDDEN = 24, 12, 8


def _fixed_worker(rank, world, kinds, name="torch", options=None):
    from efa_ep.testing.routes import contract_route

    from efa_ep.kernels import DispatchInputError, create_transport

    t = create_transport(name, None, EXPERTS, HIDDEN, T_MAX, torch.float32, **(options or {}))
    checked = 0
    for case, (kind, k) in enumerate(kinds):
        n = 0 if (rank == 1 and case % 2) else 3 + 4 * rank + case
        idx, w = contract_route(kind, n, EXPERTS, k, world, seed=100 * case + rank)
        x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(case * 7 + rank))
        rx, ri, rw, tpe, h = t.dispatch(x, idx, w)
        fx, fi, fw, num_recv, ftpe, hf = t.dispatch_fixed(x, idx, w)
        assert fx.shape == (world * T_MAX, HIDDEN) and fi.shape == (world * T_MAX, k), fx.shape
        assert num_recv.dtype == torch.int64 and num_recv.tolist() == list(h.num_recv_per_rank)
        assert ftpe.dtype == torch.int64 and torch.equal(ftpe, tpe)
        rows = torch.cat([torch.arange(c) + s * T_MAX for s, c in enumerate(num_recv.tolist())])
        used = torch.zeros(world * T_MAX, dtype=torch.bool)
        used[rows] = True
        assert torch.equal(fx[rows], rx) and torch.equal(fi[rows], ri) and torch.equal(fw[rows], rw)
        assert bool((fi[~used] == -1).all()) and bool((fw[~used] == 0).all())
        # combine: rows in the layout; unused rows hold garbage that must be ignored
        y = torch.randn(rx.shape[0], HIDDEN, generator=torch.Generator().manual_seed(50 + case))
        fy = torch.full((world * T_MAX, HIDDEN), float("nan"))
        fy[rows] = y
        assert torch.equal(t.combine(fy, hf), t.combine(y, h)), (kind, k)
        cached = t.dispatch_cached(x, hf)
        assert torch.equal(cached[rows], rx) and bool((cached[~used] == 0).all())
        assert torch.equal(t.combine_topk_weights(fw, hf), w), (kind, k)
        checked += 1
    # A combine input in the wrong layout is refused on every rank, naming the shape.
    try:
        t.combine(torch.zeros(3, HIDDEN), hf)
        refused = None
    except DispatchInputError as e:
        refused = str(e)
    return checked, refused


def _case(name, world, **options):
    from efa_ep.kernels import transport_status

    why = transport_status().get(name)
    return pytest.param(name, world, options, id=f"{name}-{world}",
                        marks=pytest.mark.skipif(why is not None, reason=str(why)))


@pytest.mark.parametrize("name,world,options", [
    _case("torch", 3), _case("proxy", 2, provider="tcp"),
    _case("hier", 4, node_size=2, network="torch"),
])
def test_generic_dispatch_fixed_matches_dispatch(name, world, options):
    kinds = [("random", 2), ("dropped", 3), ("one_rank", 4), ("hot_experts", 1)]
    for checked, refused in run_ranks(_fixed_worker, world, (kinds, name, options), timeout_s=120):
        assert checked == len(kinds)
        assert refused is not None and "3, 8" in refused, refused  # the wrong shape named
