"""The proxy's native host path against its torch references (no wire), and whole rounds in both
round implementations (native ``efa_round.c`` and the Python steps device windows use).

- ``efa_route_layout`` == ``kernels/base.py`` ``compute_send_layout`` (+ the routing rows the
  transport sends), bit for bit, and its value checks;
- ``efa_reduce_rows`` == ``reduce_rows_by_rank(...).to(dtype)``, bit for bit, and its refusals;
- ``efa_unpack_meta`` == the transport's unpacking, and it refuses what ``_check_meta`` refuses;
- dispatch / combine / dispatch_cached / combine_topk_weights with the Python round steps forced
  (``wire.native_rounds = False``) are bit-identical to ``torch``, as the native rounds are.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from efa_ep.distributed import run_ranks
from efa_ep.kernels import proxy as proxy_mod
from efa_ep.kernels.base import compute_send_layout, float_bits_to_int64, reduce_rows_by_rank

pytestmark = pytest.mark.skipif(proxy_mod.availability() is not None,
                                reason=f"proxy unavailable: {proxy_mod.availability()}")
native = proxy_mod.native
LOOPBACK = {"FI_TCP_IFACE": "lo", "FI_PROVIDER": "tcp", "OMP_NUM_THREADS": "1"}


def _layout(idx: torch.Tensor, w: torch.Tensor, num_experts: int, world: int):
    t, k = idx.shape
    cap = max(1, t * min(world, k))
    send_idx = torch.full((cap,), -7, dtype=torch.int64)
    meta = np.full(cap * 2 * k, -7, dtype=np.int64)
    num_send = np.zeros(world, dtype=np.int64)
    counts = np.zeros(num_experts, dtype=np.int64)
    scratch = np.zeros(2 * world, dtype=np.int64)
    flags = np.zeros(1, dtype=np.int64)
    s = native.route_layout(idx.data_ptr(), w.data_ptr(), t, k, num_experts, world, send_idx.data_ptr(),
                            meta.ctypes.data, cap, num_send.ctypes.data, counts.ctypes.data,
                            scratch.ctypes.data, flags.ctypes.data)
    return s, send_idx, meta, num_send, counts, int(flags[0])


@pytest.mark.parametrize("world,num_experts,topk,tokens", [
    (2, 256, 8, 128), (2, 8, 1, 5), (4, 16, 4, 33), (3, 12, 6, 0), (8, 64, 8, 17)])
@pytest.mark.parametrize("kind", ["random", "hot_experts", "dropped", "one_rank"])
def test_route_layout_matches_compute_send_layout(world, num_experts, topk, tokens, kind):
    from efa_ep.testing.routes import contract_route

    idx, w = contract_route(kind, tokens, num_experts, topk, world, 3 + tokens)
    w = w * torch.where(torch.rand(w.shape) < 0.1, -1.0, 1.0)  # negative weights and -0.0
    s, send_idx, meta, num_send, counts, flags = _layout(idx, w, num_experts, world)
    ref = compute_send_layout(idx, num_experts, world)
    assert flags == 0
    assert s == ref.send_token_idx_S.numel()
    assert torch.equal(send_idx[:s], ref.send_token_idx_S)
    assert num_send.tolist() == ref.num_tokens_per_rank_W.tolist()
    assert counts.tolist() == ref.num_tokens_per_expert_E.tolist()
    send_w = torch.where(ref.send_topk_idx_SK >= 0, w.index_select(0, ref.send_token_idx_S),
                         torch.zeros((), dtype=torch.float32))
    want = torch.cat([ref.send_topk_idx_SK, float_bits_to_int64(send_w)], dim=1)
    assert torch.equal(torch.from_numpy(meta[:s * 2 * topk].reshape(s, 2 * topk)), want)


def test_route_layout_value_checks():
    idx = torch.tensor([[0, 3], [2, 1]], dtype=torch.int64)
    w = torch.ones(2, 2)
    bad_id = idx.clone()
    bad_id[1, 0] = 4
    assert _layout(bad_id, w, 4, 2)[0] == -1 and _layout(bad_id, w, 4, 2)[5] == 1
    bad_id[1, 0] = -2
    assert _layout(bad_id, w, 4, 2)[5] == 1
    for v in (float("nan"), float("inf")):
        bad_w = w.clone()
        bad_w[0, 1] = v
        assert _layout(idx, bad_w, 4, 2)[:1] == (-1,) and _layout(idx, bad_w, 4, 2)[5] == 2


def _reduce(rows, idx_parts, num_tokens, dtype_in, dtype_out):
    w = len(rows)
    d = rows[0].shape[1]
    ptrs = np.array([r.data_ptr() for r in rows], dtype=np.int64)
    n = np.array([r.shape[0] for r in rows], dtype=np.int64)
    ips = np.array([i.data_ptr() for i in idx_parts], dtype=np.int64)
    slot = np.empty(max(1, w * num_tokens), dtype=np.int32)
    out = torch.empty(num_tokens, d, dtype=dtype_out)
    rc = native.reduce_rows(w, num_tokens, d, {torch.float32: 1, torch.bfloat16: 2}[dtype_in],
                            {torch.float32: 1, torch.bfloat16: 2}[dtype_out], ptrs.ctypes.data,
                            n.ctypes.data, ips.ctypes.data, slot.ctypes.data, out.data_ptr())
    return rc, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world,tokens,cols", [(2, 128, 7168), (3, 37, 5), (4, 9, 1000), (2, 0, 8)])
def test_reduce_rows_matches_reduce_rows_by_rank(dtype, world, tokens, cols):
    g = torch.Generator().manual_seed(world * 100 + tokens)
    parts, rows = [], []
    for r in range(world):
        keep = torch.rand(tokens, generator=g) < 0.7
        parts.append(torch.nonzero(keep).flatten()[torch.randperm(int(keep.sum()), generator=g)])
        x = torch.randn(len(parts[-1]), cols, generator=g) * torch.exp(3 * torch.randn(1, cols, generator=g))
        x.view(-1)[::97] = 0.0
        x.view(-1)[1::89] = -0.0
        rows.append(x.to(dtype))
    rc, out = _reduce(rows, parts, tokens, dtype, dtype)
    want = reduce_rows_by_rank(torch.cat(rows), torch.cat(parts), [len(p) for p in parts], tokens).to(dtype)
    assert rc == 0
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_reduce_rows_refuses_nan_sums_and_bad_indices():
    rows = [torch.ones(2, 4), torch.ones(2, 4)]
    rows[1][0, 2] = float("nan")
    parts = [torch.tensor([0, 1]), torch.tensor([1, 0])]
    assert _reduce(rows, parts, 2, torch.float32, torch.bfloat16)[0] == 1  # torch recomputes
    assert _reduce(rows, [torch.tensor([0, 2]), parts[1]], 2, torch.float32, torch.float32)[0] < 0
    assert _reduce(rows, [torch.tensor([1, 1]), parts[1]], 2, torch.float32, torch.float32)[0] < 0


def _unpack(srcs, check, hdr_counts, k, num_local):
    w = len(srcs)
    n = np.array([s.shape[0] for s in srcs], dtype=np.int64)
    total = int(n.sum())
    ptrs = np.array([s.data_ptr() for s in srcs], dtype=np.int64)
    out_idx = torch.empty(total, k, dtype=torch.int64)
    out_w = torch.empty(total, k, dtype=torch.float32)
    tpe = torch.empty(num_local, dtype=torch.int64)
    kind = np.zeros(1, dtype=np.int64)
    hdr = np.ascontiguousarray(hdr_counts, dtype=np.int64)
    bad = native.unpack_meta(w, k, num_local, ptrs.ctypes.data, n.ctypes.data,
                             np.array(check, dtype=np.int64).ctypes.data, hdr.ctypes.data,
                             hdr.shape[1], out_idx.data_ptr(), out_w.data_ptr(), tpe.data_ptr(),
                             np.zeros(num_local, dtype=np.int64).ctypes.data, kind.ctypes.data)
    return bad, int(kind[0]), out_idx, out_w, tpe


def test_unpack_meta_unpacks_and_refuses_what_check_meta_refuses():
    k, num_local = 3, 4
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, num_local, (6, k), generator=g)
    ids[:, 0] = torch.randint(0, num_local, (6,), generator=g)  # every row names one expert
    wts = torch.where(ids >= 0, torch.rand(6, k, generator=g), torch.zeros(()))
    good = torch.cat([ids, float_bits_to_int64(wts)], 1)
    counts = torch.bincount(ids[ids >= 0], minlength=num_local).numpy()
    hdr = np.stack([counts, counts])
    bad, _, out_idx, out_w, tpe = _unpack([good, good.clone()], [0, 1], hdr, k, num_local)
    assert bad == -1
    assert torch.equal(out_idx, torch.cat([ids, ids])) and torch.equal(out_w, torch.cat([wts, wts]))
    assert tpe.tolist() == (2 * counts).tolist()
    for name, edit in (("id", lambda m: m.__setitem__((0, 1), num_local)),
                       ("no expert", lambda m: m[1, :k].fill_(-1)),
                       ("weight without id", lambda m: m.__setitem__((2, 2 * k - 1), 5) if m[2, k - 1] < 0
                        else (m.__setitem__((2, k - 1), -1), m.__setitem__((2, 2 * k - 1), 5))),
                       ("nan", lambda m: m.__setitem__((3, k), float_bits_to_int64(torch.tensor([float("nan")]))[0])),
                       ("counts", lambda m: None)):
        m = good.clone()
        edit(m)
        h = hdr.copy()
        if name == "counts":
            h[1, 0] += 1
        bad, kind, *_ = _unpack([good, m], [0, 1], h, k, num_local)
        assert bad == 1 and kind > 0, name
        bad, *_ = _unpack([m, good], [0, 1], hdr, k, num_local)  # unchecked source: taken as is
        assert bad == -1, name


# --------------------------------------------------------------------------------------------
# Whole rounds: native and Python round steps, bit-identical to torch
# --------------------------------------------------------------------------------------------
def _rounds_rank(rank, world, provider, python_rounds):
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.set_num_threads(1)
    bad = []
    # (experts, hidden, top-k, dtype, tokens): rows of 16-byte multiples and of 28 bytes
    # (one send slot per destination), bf16, T = 0 on one rank
    for num_experts, hidden, topk, dtype, tokens in ((8, 32, 4, torch.float32, [24, 24]),
                                                     (8, 7, 2, torch.float32, [9, 0]),
                                                     (16, 48, 3, torch.bfloat16, [17, 5])):
        ref = create_transport("torch", None, num_experts, hidden, 32, dtype)
        px = create_transport("proxy", None, num_experts, hidden, 32, dtype, provider=provider,
                              num_channels=2, chunk_bytes=256, timeout_s=30)
        px.wire.native_rounds = not python_rounds
        for seed, kind in enumerate(("random", "dropped", "one_rank")):
            t = tokens[rank]
            idx, w = contract_route(kind, t, num_experts, topk, world, seed * 7 + rank)
            x = torch.randn(t, hidden).to(dtype)
            r, p = ref.dispatch(x, idx, w), px.dispatch(x, idx, w)
            same = lambda a, b: a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731
            names = ("recv_x", "recv_topk_idx", "recv_topk_weights", "tokens_per_expert")
            bad += [(hidden, seed, n) for n, a, b in zip(names, r[:4], p[:4]) if not same(a.contiguous(), b.contiguous())]
            y = torch.randn(r[0].shape[0], hidden).to(dtype)
            if not same(ref.combine(y, r[4]), px.combine(y, p[4])):
                bad.append((hidden, seed, "combine"))
            if not same(ref.dispatch_cached(x, r[4]), px.dispatch_cached(x, p[4])):
                bad.append((hidden, seed, "dispatch_cached"))
            gw = torch.randn(r[0].shape[0], topk)
            if not same(ref.combine_topk_weights(gw, r[4]), px.combine_topk_weights(gw, p[4])):
                bad.append((hidden, seed, "combine_topk_weights"))
        # the rounds ran where asked: the native round's own wait clock moved only for it
        assert (px.wire._nw.st.wait_ns > 0) == (not python_rounds), px.wire._nw.st.wait_ns
        px.close()
    return bad


@pytest.mark.parametrize("python_rounds", [False, True], ids=["native_rounds", "python_rounds"])
def test_rounds_bit_identical_to_torch(python_rounds):
    out = run_ranks(_rounds_rank, 2, ("tcp", python_rounds), timeout_s=200, pg_timeout_s=60,
                    env=LOOPBACK)
    for rank, bad in enumerate(out):
        assert not bad, f"rank {rank}: proxy differs from torch in {bad}"
