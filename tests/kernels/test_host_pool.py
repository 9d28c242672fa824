"""``HostOutputPool``: large CPU outputs on reused blocks, never a block the caller still holds;
and the proxy's outputs on it, bit-identical to ``torch`` while earlier outputs are held.

What is pinned: a dropped output's block serves the next call of its size class; a held output
or any view of it keeps its block (the next call gets another); small outputs are plain
tensors; blocks are 64-byte aligned and the free list is bounded. Over the proxy (2 ranks,
shm): outputs large enough for the pool, three rounds in a row with every round's outputs kept,
each equal to the brute-force reference, and the kept ones unchanged after the later rounds.
"""
import gc

import pytest
import torch

from efa_ep.distributed import run_ranks
from efa_ep.kernels.core.host_pool import MAX_FREE_PER_CLASS, MIN_POOLED_BYTES, HostOutputPool

ROWS = MIN_POOLED_BYTES // (4 * 256) + 8  # float32 rows of 256: just over the threshold


def test_a_dropped_output_is_reused_a_held_one_never():
    pool = HostOutputPool()
    a = pool.empty((ROWS, 256), torch.float32)
    a.fill_(1.0)
    pa = a.data_ptr()
    assert pa % 64 == 0 and a.is_contiguous() and a.shape == (ROWS, 256)
    b = pool.empty((ROWS, 256), torch.float32)   # a is held: a new block
    assert b.data_ptr() != pa and pool.blocks_made == 2
    view = a[3:5]
    del a
    gc.collect()
    c = pool.empty((ROWS, 256), torch.float32)   # a's view still holds its block
    assert c.data_ptr() not in (pa, b.data_ptr()) and bool((view == 1.0).all())
    del view
    e = pool.empty((ROWS, 256), torch.float32)   # a's block came back with its last view
    assert e.data_ptr() == pa and pool.reused >= 1


def test_small_outputs_are_plain_tensors_and_the_free_list_is_bounded():
    pool = HostOutputPool()
    small = pool.empty((4, 8), torch.int64)
    assert small.shape == (4, 8) and pool.blocks_made == 0
    held = [pool.empty((ROWS, 256), torch.float32) for _ in range(MAX_FREE_PER_CLASS + 3)]
    made = pool.blocks_made
    del held
    gc.collect()
    assert sum(len(v) for v in pool._free.values()) == MAX_FREE_PER_CLASS
    again = [pool.empty((ROWS, 256), torch.float32) for _ in range(MAX_FREE_PER_CLASS + 1)]
    assert pool.blocks_made == made + 1 and len({t.data_ptr() for t in again}) == len(again)


H, E, K, T = 2048, 8, 2, 48  # recv rows of 8 KB: a rank's outputs exceed MIN_POOLED_BYTES


def _held_rounds(rank, world):
    from efa_ep.kernels import create_transport
    from efa_ep.testing.reference import reference_combine, reference_dispatch
    from efa_ep.testing.routes import contract_route

    torch.set_num_threads(1)
    tr = create_transport("proxy", None, E, H, T, torch.float32, provider="shm", num_channels=1,
                          timeout_s=60)
    kept, bad = [], []
    for rnd in range(6):  # rounds 0-2 keep their outputs, 3-5 drop them (their blocks return)
        xs, idxs, ws = [], [], []
        for r in range(world):
            idx, w = contract_route("random", T, E, K, world, seed=100 * rnd + r)
            xs.append(torch.randn(T, H, generator=torch.Generator().manual_seed(100 * rnd + r)))
            idxs.append(idx)
            ws.append(w)
        ref = reference_dispatch(xs, idxs, ws, E)
        rx, _, _, _, h = tr.dispatch(xs[rank], idxs[rank], ws[rank])
        out = tr.combine(rx * 2 + 1, h)
        want = reference_combine([d[0] * 2 + 1 for d in ref], [d[4] for d in ref], [T] * world)
        if not torch.equal(rx, ref[rank][0]):
            bad.append(f"round {rnd}: recv_x differs from the reference")
        if not torch.equal(out, want[rank]):
            bad.append(f"round {rnd}: combine differs from the reference")
        if rnd < 3:
            kept.append((rx, rx.clone(), out, out.clone()))
        del rx, out, h
    for rnd, (rx, rx0, out, out0) in enumerate(kept):
        if not (torch.equal(rx, rx0) and torch.equal(out, out0)):
            bad.append(f"round {rnd}: a kept output changed in later rounds")
    pool = tr._hostops.pool
    stats = (pool.blocks_made, pool.reused)
    tr.close()
    return bad, stats


def test_proxy_outputs_on_the_pool_match_the_reference_and_held_ones_stay():
    outs = run_ranks(_held_rounds, 2, timeout_s=180, pg_timeout_s=60,
                     env={"FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "1"})
    for r, (bad, (made, reused)) in enumerate(outs):
        assert not bad, f"rank {r}: {bad}"
        assert made >= 2 and reused >= 1, (r, made, reused)  # the pooled path ran, and reused
