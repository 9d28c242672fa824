"""The proxy's native host path against its torch references (no wire), and whole rounds over a
window reached in place and through copies (``efa_round.c``, as a host and a device window).

- ``efa_route_layout`` == ``kernels/base.py`` ``compute_send_layout`` (+ the routing rows the
  transport sends), bit for bit, and its value checks;
- ``efa_reduce_rows`` == ``reduce_rows_by_rank(...).to(dtype)``, bit for bit, and its refusals;
- ``efa_unpack_meta`` == the transport's unpacking and its refusals, each worded by
  ``efa_describe_meta``;
- dispatch / combine / dispatch_cached / combine_topk_weights with the window reached only
  through copies of the stage (the device window's round steps, over a host window) are
  bit-identical to ``torch``, as the native operations are; a rank's input error reaches every
  rank through the stage;
- a whole operation on CPU rows is two native calls (``efa_op.c``), its header errors are worded
  in C alike on every rank, its waits' deadlines name the peer, the op and the round, and idle
  channel threads block until the next operation wakes them.
"""
from __future__ import annotations

import re
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
# Whole rounds: the window in place and through copies, bit-identical to torch
# --------------------------------------------------------------------------------------------
def _rounds_rank(rank, world, provider, copies):
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.base import TransportError
    from efa_ep.kernels.proxy.window import H_TAG
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
        if copies:
            px.wire.through_copies()
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
        # the rounds ran where asked: through copies, the peer's last header (its round tag)
        # is in the stage as well as in the window; in place, there is no stage
        wire, peer = px.wire, 1 - rank
        if copies:
            lay = wire.layout
            off = world * lay.hdr_bytes + peer * lay.hdr_len
            staged = wire._stage_np[off:off + 8 * lay.hdr_fields].view(np.int64)
            tag = (wire.gen << 32) | (wire.seq - 1)
            assert staged[H_TAG] == tag, (staged, tag)
            woff = lay.hdr_recv_off(peer, wire.seq - 1)
            assert bytes(wire._win_np[woff:woff + 8 * lay.hdr_fields]) == staged.tobytes()
            # an input error on rank 1 reaches every rank with rank 1's text, from the stage
            idx = torch.zeros(2, topk, dtype=torch.int64)
            idx[0, 0] = num_experts + 5 if rank == 1 else 0
            try:
                px.dispatch(torch.zeros(2, hidden).to(dtype), idx, torch.ones(2, topk))
                bad.append((hidden, "input error", "no error"))
            except TransportError as e:
                if "rank 1" not in str(e) or str(num_experts + 5) not in str(e):
                    bad.append((hidden, "input error", str(e)[:300]))
        else:
            assert wire._stage is None and wire.window_in_place
        assert wire._checks.st.wait_ns > 0
        px.close()
    return bad


@pytest.mark.parametrize("copies", [False, True], ids=["in_place", "through_copies"])
def test_rounds_bit_identical_to_torch(copies):
    out = run_ranks(_rounds_rank, 2, ("tcp", copies), timeout_s=200, pg_timeout_s=60,
                    env=LOOPBACK)
    for rank, bad in enumerate(out):
        assert not bad, f"rank {rank}: proxy differs from torch in {bad}"


# --------------------------------------------------------------------------------------------
# Whole operations in two native calls (efa_op.c): the calls, their errors, the idle channels
# --------------------------------------------------------------------------------------------
def test_describe_meta_names_what_unpack_meta_refuses():
    """efa_describe_meta words each refusal of efa_unpack_meta (the transport's only naming)."""
    k, num_local = 3, 4
    ids = torch.tensor([[0, 1, -1], [2, -1, -1], [3, 0, 1]], dtype=torch.int64)
    wts = torch.where(ids >= 0, torch.full(ids.shape, 0.5), torch.zeros(()))
    good = torch.cat([ids, float_bits_to_int64(wts)], 1)
    counts = torch.bincount(ids[ids >= 0], minlength=num_local).numpy().astype(np.int64)
    st = native.WireStruct()
    st.rank = 5
    nw = native.NativeWire(st)
    nan = int(float_bits_to_int64(torch.tensor([float("inf")]))[0])
    for edit, want, hdr_delta in (
            (lambda m: m.__setitem__((0, 1), num_local), "rank 2 sent local expert id 4; expected -1 or 0 <= id < 4", 0),
            (lambda m: m.__setitem__((1, 0), -2), "rank 2 sent local expert id -2", 0),
            (lambda m: m[1, :k].fill_(-1), "rank 2 sent a row that names none of this rank's experts", 0),
            (lambda m: m.__setitem__((1, k + 2), 7), "non-zero weight in a slot without an expert here", 0),
            (lambda m: m.__setitem__((2, k), nan), "rank 2 sent NaN/Inf routing weights", 0),
            (lambda m: None, "rank 2's per-expert counts [3, 2, 1, 1] disagree with the expert ids "
                             "of the 3 rows it sent ([2, 2, 1, 1])", 1)):
        m = good.clone()
        edit(m)
        hdr = counts.copy()
        hdr[0] += hdr_delta
        bad, kind, *_ = _unpack([m], [1], hdr[None], k, num_local)
        assert bad == 0 and kind > 0, want  # what the op refuses, it names:
        text = nw.describe_meta(2, m.data_ptr(), m.shape[0], k, num_local, hdr.ctypes.data)
        assert text.startswith("rank 5: protocol violation: ") and want in text, (want, text)


def test_window_reached_through_copies_refuses_clearly():
    """A round over a window reached through copies checks its kind and stage before it touches
    the engine, and a device window's round without the CUDA driver says what it needs (CI has
    no driver; with one, the refusal cannot happen and that case is skipped)."""
    import ctypes.util

    st = native.WireStruct()
    st.rank, st.world, st.max_msgs = 3, 2, 2 * (native.MAX_PLANES + 1)
    stage = np.zeros(native.wire_stage_bytes(2, 64, 64), dtype=np.uint8)
    for kind, with_stage, want in ((7, True, "window kind 7 is none of 0 (in place)"),
                                   (native.WINDOW_COPIED, False,
                                    "a window reached through copies (kind 2) needs a stage")):
        st.window_kind, st.stage = kind, stage.ctypes.data if with_stage else None
        with pytest.raises(native.NativeError, match=r"rank 3: " + re.escape(want)):
            native.NativeWire(st).begin(True)
    if ctypes.util.find_library("cuda") is None:
        st.window_kind, st.stage = native.WINDOW_CUDA, stage.ctypes.data
        with pytest.raises(native.NativeError, match="rank 3: a device window's round needs the "
                                                     "CUDA driver: libcuda.so.1 cannot be loaded"):
            native.NativeWire(st).begin(True)


def _op_calls_rank(rank, world):
    """Counts native calls and Python round steps per operation of CPU rows on a host window."""
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.proxy import wire as wire_mod
    from efa_ep.kernels.base import ProtocolError, TransportBroken
    from efa_ep.testing.routes import contract_route

    torch.set_num_threads(1)
    px = create_transport("proxy", None, 8, 32, 16, torch.bfloat16, provider="tcp", num_channels=2,
                          chunk_bytes=256, timeout_s=30)
    ref = create_transport("torch", None, 8, 32, 16, torch.bfloat16)
    calls = []
    op_call = native.NativeOp.call
    native.NativeOp.call = lambda self, kind, step: (calls.append((kind, step)), op_call(self, kind, step))[1]
    steps = []
    begin = wire_mod.Wire.begin
    wire_mod.Wire.begin = lambda self, *a, **k: (steps.append(a[0]), begin(self, *a, **k))[1]
    idx, w = contract_route("random", 12, 8, 2, world, rank)
    x = torch.randn(12, 32).to(torch.bfloat16)
    per_op, same = {}, True
    for name, run in (("dispatch", lambda: px.dispatch(x, idx, w)),
                      ("combine", lambda: px.combine(out[0], out[4])),
                      ("dispatch_cached", lambda: px.dispatch_cached(x, out[4]))):
        calls.clear()
        got = run()
        per_op[name] = (list(calls), len(steps))
        if name == "dispatch":
            out, want = got, ref.dispatch(x, idx, w)
            same &= all(torch.equal(a, b) for a, b in zip(got[:4], want[:4]))
        elif name == "combine":
            same &= torch.equal(got.view(torch.int16), ref.combine(out[0], want[4]).view(torch.int16))
    # ranks in different operations: every rank raises the same ProtocolError, named in C; the
    # transport is broken afterwards (as torch's), its later calls carrying that error
    try:
        px.combine(out[0], out[4]) if rank == 0 else px.dispatch_cached(x, out[4])
        mismatch = "no error"
    except ProtocolError as e:
        mismatch = str(e)
    try:
        px.dispatch(x, idx, w)
        same = False
    except TransportBroken as e:
        same &= mismatch in str(e)
    px.wire.quiesce()
    posted = sum(c["posted"] for c in px.stats())
    accounted = px.wire.posted["writes"]
    native.NativeOp.call, wire_mod.Wire.begin = op_call, begin
    px.close()
    return per_op, same, mismatch, posted, accounted


def test_host_operation_is_post_and_complete():
    out = run_ranks(_op_calls_rank, 2, (), timeout_s=200, pg_timeout_s=60, env=LOOPBACK)
    for rank, (per_op, same, mismatch, posted, accounted) in enumerate(out):
        for name, kind in (("dispatch", "dispatch"), ("combine", "combine"),
                           ("dispatch_cached", "cached")):
            calls, python_steps = per_op[name]
            assert calls == [(kind, "post"), (kind, "complete")], (rank, name, calls)
            assert python_steps == 0, (rank, name)  # no Python round steps
        assert same, rank
        assert "ranks are in different operations or row formats" in mismatch, mismatch
        assert "rank 0: combine" in mismatch and "rank 1: dispatch_cached" in mismatch, mismatch
        assert posted == accounted, (rank, posted, accounted)
    assert out[0][2] == out[1][2]  # the same words on every rank


def _deadline_rank(rank, world):
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.base import PeerFailure, TransportBroken

    torch.set_num_threads(1)
    import torch.distributed as dist

    px = create_transport("proxy", None, 4, 8, 8, torch.float32, provider="tcp", num_channels=1,
                          timeout_s=0.5)
    idx = torch.tensor([[0, 2]] * 4, dtype=torch.int64)
    res = None
    if rank == 0:  # rank 1 never joins this dispatch
        try:
            px.dispatch(torch.randn(4, 8), idx, torch.rand(4, 2))
            res = "no error"
        except PeerFailure as e:
            res = str(e)
        try:
            px.combine(torch.randn(0, 8), None)
            after = "no error"
        except TransportBroken as e:
            after = str(e)
        res = (res, after)
    dist.barrier()
    px.close(barrier=False)
    return res


def test_wait_deadline_names_peer_op_and_round():
    out = run_ranks(_deadline_rank, 2, (), timeout_s=200, pg_timeout_s=60, env=LOOPBACK)
    err, after = out[0]
    assert "from rank 1" in err and "[dispatch headers, round 1]" in err, err
    assert "broken" in after and err[:40] in after, after


def _idle_rank(rank, world):
    import time

    import torch.distributed as dist

    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.set_num_threads(1)
    px = create_transport("proxy", None, 8, 16, 16, torch.float32, provider="tcp", num_channels=2,
                          timeout_s=30)
    ref = create_transport("torch", None, 8, 16, 16, torch.float32)
    idx, w = contract_route("random", 10, 8, 2, world, rank)
    x = torch.randn(10, 16)
    ok = True
    blocked = []
    for _ in range(3):
        out = px.dispatch(x, idx, w)
        ok &= torch.equal(px.combine(out[0], out[4]), ref.combine(*[ref.dispatch(x, idx, w)[i] for i in (0, 4)]))
        # with nothing to do and nobody waiting, every channel thread blocks (its sleeps count
        # grows): wait for that event, bounded
        before = [c["sleeps"] for c in px.stats()]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
                c["sleeps"] > b for c, b in zip(px.stats(), before)):
            pass
        blocked.append(all(c["sleeps"] > b for c, b in zip(px.stats(), before)))
        dist.barrier()  # both ranks' channels blocked: the next op must wake them
    px.close()
    return ok, blocked


def test_idle_channels_block_and_the_next_operation_wakes_them():
    for rank, (ok, blocked) in enumerate(run_ranks(_idle_rank, 2, (), timeout_s=200,
                                                    pg_timeout_s=60, env=LOOPBACK)):
        assert ok and all(blocked), (rank, ok, blocked)


def test_dispatch_packed_begin_takes_the_device_counts_and_keeps_its_deadline():
    """A packed dispatch posts its headers once the device's count block says it is complete (its
    ready word, written last): the status, rows per rank and per-expert counts come from the
    block; a flagged status sends nothing (``RC_LOCAL_INPUT``); counts outside the window are
    refused; a ready word that never comes ends at the wire's deadline with an error naming the
    rank, the round and what was awaited. (No engine: every case returns before the headers.)"""
    import ctypes
    import errno
    import threading

    world, experts = 2, 4
    ws = native.WireStruct()
    ws.rank, ws.world, ws.max_rows, ws.timeout_ms = 1, world, 16, 60_000
    st = native.OpStruct()
    st.wire = ctypes.addressof(ws)
    st.num_experts, st.num_local, st.seq = experts, experts // world, 5
    num_send, counts = np.zeros(world, np.int64), np.zeros(experts, np.int64)
    st.num_send, st.counts = num_send.ctypes.data, counts.ctypes.data
    block = np.zeros(2 + world + experts, np.int64)  # status, W rows, E counts, ready
    st.dev_counts = block.ctypes.data
    op = native.NativeOp(st)

    # written by another thread while the call waits (the device's role)
    def device():
        block[:-1] = [2, 3, 4, 1, 2, 3, 1]
        block[-1] = 1

    writer = threading.Timer(0.05, device)
    writer.start()
    assert op.call("dispatch_packed", "begin") == native.RC_LOCAL_INPUT
    writer.join()
    assert st.flags == 2 and not num_send.any()  # nothing taken from a flagged block

    block[:] = [0, 3, -1, 1, 2, 3, 1, 1]  # a negative row count is refused, naming the rank
    with pytest.raises(native.NativeError, match=r"rank 1: .* -1 rows to rank 1 outside \[0, 16\]"):
        op.call("dispatch_packed", "begin")

    block[:] = 0  # the ready word never comes
    ws.timeout_ms = 50
    with pytest.raises(native.NativeError) as e:
        op.call("dispatch_packed", "begin")
    assert e.value.code == -errno.ETIMEDOUT
    assert "rank 1: dispatch (round 5): the device did not write the routing counts within" in str(e.value)


def _front_plans_rank(rank, world):
    """The device path's per-shape dispatch fronts on one rank (CPU tensors: nothing bound or
    launched, only the plans made): the same shape returns the same plan; a stream of token
    counts keeps at most 64 plans, each with its own shape's top-k and grid."""
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.proxy import device as dk
    from efa_ep.testing.routes import contract_route

    px = create_transport("proxy", None, 8, 32, 128, torch.bfloat16, provider="tcp",
                          num_channels=1, timeout_s=30)
    seen, ok = [], True
    for t in range(1, 101):
        idx, w = contract_route("random", t, 8, 2, world, t)
        x = torch.randn(t, 32).to(torch.bfloat16)
        front = px._front_plan(x, idx, w)
        ok &= px._front_plan(x, idx, w) is front
        ok &= front[4] == dk.pack_grid(t * min(world, 2), px._num_programs(x.device))
        ok &= front[1].numel() == 2 + world + 8  # the count block: status, W, E, ready word
        seen.append(sum(isinstance(k, tuple) and k[0] == "front_plan" for k in px._buffers))
    px.close()
    return ok, max(seen), seen[-1]


def test_dispatch_fronts_are_made_once_per_shape_and_kept_bounded():
    (ok, most, last), = run_ranks(_front_plans_rank, 1, (), timeout_s=120, env=LOOPBACK)
    assert ok
    assert most == 64 and 1 <= last <= 64, (most, last)
