"""CPU tests of the proxy's device-path kernels (``kernels/proxy/device.py``) under the Triton
interpreter: packing of a dispatch's send side, the receive gather and combine's reduction.

Each check runs this file as a subprocess with ``TRITON_INTERPRET=1`` (set before triton is
imported). Host buffers and the window are CPU tensors; the per-source address tables hold their
``data_ptr()``, as the GPU path holds pinned host addresses. References: the torch layout
(``compute_send_layout``), the host path's metadata format (local ids, float32 bits of the
weights) and ``reduce_rows_by_rank`` followed by the cast, bit for bit. ``transport`` runs the
transport's device paths (kernels forced on for CPU tensors; the dispatch's device layout on and
off) over libfabric tcp on loopback in two ranks against the ``torch`` transport. ``late`` runs
it with a stand-in device that stores the send plane chunk by chunk after the launch returned
(rows and progress words from another thread): the host must post each chunk only once its
progress word says so, cut where the wire's descriptors end. ``shared`` runs it with both ranks
on one (stand-in) GPU: the reading kernels get half the programs and still match ``torch``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKS = ["pack", "gather", "reduce", "transport", "late", "shared"]


@pytest.mark.slow  # Triton's interpreter over randomized cases: 10-20 s each on 2 cores
@pytest.mark.parametrize("check", CHECKS)
def test_proxy_device_kernels_interpreted(check):
    if check in ("transport", "late", "shared"):
        from efa_ep.kernels import proxy as proxy_mod

        why = proxy_mod.availability()
        if why is not None:
            pytest.skip(f"proxy unavailable: {why}")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), check], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{check} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert f"OK {check}" in proc.stdout


# ------------------------------------------------------------------------------------------
# Worker side (runs in the subprocess, interpreter on)
# ------------------------------------------------------------------------------------------
def _route(t, num_experts, topk, seed, drop=True):
    """Distinct experts per token, ~25% of slots -1 (``drop``); weights in (0, 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(t, num_experts, generator=g).topk(topk, dim=1).indices
    if drop and t:
        idx = torch.where(torch.rand(t, topk, generator=g) < 0.25, torch.full_like(idx, -1), idx)
    w = torch.where(idx >= 0, torch.rand(t, topk, generator=g), torch.zeros(()))
    return idx.to(torch.int64).contiguous(), w.float().contiguous()


def _cases():
    for world in (1, 2, 4):
        for num_experts in (world * 2, 16):
            for topk in (1, 2, 4):
                if topk > num_experts:
                    continue
                for t in (0, 1, 37):
                    for dtype in ("bfloat16", "float32"):
                        for me in sorted({0, world - 1}):
                            yield world, num_experts, topk, t, dtype, me


def _reference_meta(idx, w, send_idx, num_send, L):
    """``[S, 2K]`` int64: the host layout's routing rows (local ids on the destination, -1
    elsewhere; weights' float32 bits, 0 elsewhere)."""
    import torch
    from efa_ep.kernels.base import float_bits_to_int64

    dest = torch.repeat_interleave(torch.arange(len(num_send)), torch.tensor(num_send))
    ids = idx[send_idx]
    on = (ids >= 0) & (torch.div(ids, L, rounding_mode="floor") == dest[:, None])
    loc = torch.where(on, ids - dest[:, None] * L, torch.full_like(ids, -1))
    bits = torch.where(on, float_bits_to_int64(w[send_idx]), torch.zeros_like(ids))
    return torch.cat([loc, bits], dim=1)


def _check_pack():
    import torch
    from efa_ep.kernels.gda import launches as kern
    from efa_ep.kernels.base import compute_send_layout
    from efa_ep.kernels.proxy import device as dk

    n = 0
    for world, num_experts, topk, t, dtype_name, me in _cases():
        dtype = getattr(torch, dtype_name)
        d = 24
        idx, w = _route(t, num_experts, topk, seed=n)
        x = torch.randn(t, d).to(dtype)
        lay = kern.layout(idx, w, num_experts, world)
        ref = compute_send_layout(idx, num_experts, world)
        num_send = ref.num_tokens_per_rank_W.tolist()
        s_all = sum(num_send)
        plane = torch.zeros(max(1, t * world) * d * x.element_size() + 64, dtype=torch.uint8)
        meta = torch.full((max(1, t * min(world, topk)) * 2 * topk,), 7, dtype=torch.int64)
        counts = torch.zeros(2 + world + num_experts, dtype=torch.int64)
        progress = torch.zeros(dk.pack_grid(t * min(world, topk), 3), dtype=torch.int64)
        chunk_rows = 1 + n % 4
        dk.pack_dispatch(x, idx, w, lay, me, plane, meta, counts, progress, chunk_rows,
                         num_programs=3)
        case = (world, num_experts, topk, t, dtype_name, me)
        assert counts[0] == 0, (case, counts)
        assert counts[1:1 + world].tolist() == num_send, (case, counts)
        assert torch.equal(counts[1 + world:-1], torch.bincount(idx[idx >= 0], minlength=num_experts)), case
        assert counts[-1] == 1, (case, "the ready word follows the counts")
        chunks = -(-s_all // chunk_rows) if s_all else 0
        assert progress.tolist() == [chunks] * progress.numel(), (case, chunk_rows, progress)
        send_idx = ref.send_token_idx_S
        want_meta = _reference_meta(idx, w, send_idx, num_send, num_experts // world)
        assert torch.equal(meta[:s_all * 2 * topk].view(s_all, 2 * topk), want_meta), case
        starts = [sum(num_send[:r]) for r in range(world + 1)]
        peer = torch.cat([send_idx[:starts[me]], send_idx[starts[me + 1]:]])
        got_rows = plane[:peer.numel() * d * x.element_size()].view(dtype).view(-1, d)
        assert torch.equal(got_rows.view(torch.uint8), x[peer].contiguous().view(torch.uint8)), case
        n += 1
    # a bad id and a NaN weight reach the host's status word
    idx, w = _route(5, 8, 2, seed=1, drop=False)
    idx[2, 1] = 99
    w[3, 0] = float("nan")
    counts = torch.zeros(2 + 2 + 8, dtype=torch.int64)
    lay = kern.layout(idx, w, 8, 2)
    dk.pack_dispatch(torch.zeros(5, 16), idx, w, lay, 0, torch.zeros(4096, dtype=torch.uint8),
                     torch.zeros(64, dtype=torch.int64), counts, torch.zeros(2, dtype=torch.int64),
                     4, num_programs=2)
    from efa_ep.kernels.base import STATUS_BAD_EXPERT_ID, STATUS_NON_FINITE_WEIGHT
    assert int(counts[0]) == STATUS_BAD_EXPERT_ID | STATUS_NON_FINITE_WEIGHT, counts
    assert int(counts[-1]) == 1, counts
    # combine's (no index) and a cached dispatch's (gathered) rows for the peers: every send row
    # but this rank's own block, in order
    g = torch.Generator().manual_seed(5)
    for rows, own, chunk_rows, dtype in ((11, (3, 7), 2, torch.bfloat16), (9, (0, 9), 4, torch.float32),
                                         (6, (0, 0), 1, torch.float32), (13, (13, 13), 5, torch.bfloat16)):
        for gathered in (False, True):
            src = torch.randn(rows + 3, 24, generator=g).to(dtype)
            idx = torch.randint(0, rows + 3, (rows,), generator=g) if gathered else None
            send = src[idx] if gathered else src[:rows]
            plane = torch.zeros(rows * 24 * src.element_size() + 64, dtype=torch.uint8)
            progress = torch.zeros(dk.pack_grid(rows, 3), dtype=torch.int64)
            dk.pack_rows(src if gathered else src[:rows], idx, own[0], own[1], plane, progress,
                         chunk_rows, num_programs=3)
            peer = torch.cat([send[:own[0]], send[own[1]:]])
            got = plane[:peer.numel() * src.element_size()].view(dtype).view(-1, 24)
            assert torch.equal(got.view(torch.uint8), peer.contiguous().view(torch.uint8)), (rows, own)
            assert progress.tolist() == [-(-rows // chunk_rows)] * progress.numel(), (rows, progress)
            n += 1
    print(f"OK pack ({n} cases)")


def _blocks(world, me, n_from, d, dtype, g):
    """Per-source row blocks standing in for the receive window (``me``'s own block unused)."""
    import torch

    return [torch.randn(n_from[r], d, generator=g).to(dtype) for r in range(world)]


def _check_gather():
    import torch
    from efa_ep.kernels.proxy import device as dk

    n = 0
    g = torch.Generator().manual_seed(5)
    for world, num_experts, topk, t, dtype_name, me in _cases():
        dtype = getattr(torch, dtype_name)
        d = 40
        x = torch.randn(t, d, generator=g).to(dtype)
        n_own = int(torch.randint(0, t + 1, (1,), generator=g)) if t else 0
        own_start = int(torch.randint(0, 3, (1,), generator=g))
        send_token_idx = torch.cat([torch.zeros(own_start, dtype=torch.int64),
                                    torch.randperm(t, generator=g)[:n_own].sort().values])
        n_from = [n_own if r == me else int(torch.randint(0, 9, (1,), generator=g)) for r in range(world)]
        blocks = _blocks(world, me, n_from, d, dtype, g)
        src_ptrs = torch.tensor([b.data_ptr() for b in blocks], dtype=torch.int64)
        rstarts = torch.tensor([0] + n_from, dtype=torch.int64).cumsum(0)
        n_recv = int(rstarts[-1])
        in_idx = torch.randint(-1, 4, (n_recv, topk), generator=g)
        in_w = torch.rand(n_recv, topk, generator=g)
        out_x = torch.full((n_recv, d), 3.0).to(dtype)
        out_idx = torch.full((n_recv, topk), 5, dtype=torch.int64)
        out_w = torch.full((n_recv, topk), 5.0)
        marks = torch.zeros(world * 256, dtype=torch.int32)  # (launched after the round: tag 0)
        dk.gather_dispatch(x, send_token_idx, src_ptrs, rstarts, in_idx, in_w, out_x, out_idx,
                           out_w, me=me, own_start=own_start, num_programs=4, marks=marks,
                           dev_marks=marks.clone())
        want = torch.cat([x[send_token_idx[own_start:own_start + n_own]] if r == me else blocks[r]
                          for r in range(world)])
        case = (world, topk, t, dtype_name, me, n_from)
        assert torch.equal(out_x.view(torch.uint8), want.view(torch.uint8)), case
        assert torch.equal(out_idx, in_idx) and torch.equal(out_w, in_w), case
        n += 1
    print(f"OK gather ({n} cases)")


def _check_reduce():
    import torch
    from efa_ep.kernels.base import compute_send_layout, reduce_rows_by_rank
    from efa_ep.kernels.proxy import device as dk

    n = 0
    g = torch.Generator().manual_seed(9)
    for world, num_experts, topk, t, dtype_name, me in _cases():
        dtype = getattr(torch, dtype_name)
        d = 33 if dtype == torch.float32 else 48
        idx, w = _route(t, num_experts, topk, seed=100 + n)
        ref = compute_send_layout(idx, num_experts, world)
        num_send = ref.num_tokens_per_rank_W.tolist()
        blocks = _blocks(world, me, num_send, d, dtype, g)
        own_start = int(torch.randint(0, 4, (1,), generator=g))
        y = torch.cat([torch.randn(own_start, d, generator=g).to(dtype), blocks[me],
                       torch.randn(2, d, generator=g).to(dtype)])
        src_ptrs = torch.tensor([b.data_ptr() for b in blocks], dtype=torch.int64)
        out = torch.full((t, d), 3.0).to(dtype)
        send_off = torch.tensor([0] + num_send, dtype=torch.int64).cumsum(0)
        marks = torch.zeros(world * 256, dtype=torch.int32)  # (launched after the round: tag 0)
        dk.reduce_combine(y, ref.send_token_idx_S, send_off, src_ptrs, out, me=me,
                          own_start=own_start, num_programs=5, marks=marks,
                          dev_marks=marks.clone())
        want = reduce_rows_by_rank(torch.cat(blocks), ref.send_token_idx_S, num_send, t).to(dtype)
        case = (world, num_experts, topk, t, dtype_name, me)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), case
        n += 1
    print(f"OK reduce ({n} cases)")


def _transport_rank(rank, world):
    """Both paths of the proxy transport in one rank, on the same inputs: the device kernels
    (``device_kernels="always"``: CPU tensors, interpreted kernels) and the torch reference.
    ``copies``: the window reached only through copies of the stage, as a device window's
    rounds reach theirs (the kernels write into the window, the rounds' steps copy)."""
    import torch
    from efa_ep.kernels import create_transport

    torch.set_num_threads(1)
    bad = []
    for device_layout, dtype, hidden, num_experts, topk, tokens, copies in (
            (True, torch.bfloat16, 64, 8, 2, (13, 9), False),
            (True, torch.float32, 36, 16, 4, (0, 21), False),
            (True, torch.float32, 36, 16, 4, (21, 17), False),
            (False, torch.bfloat16, 64, 8, 2, (13, 9), False),
            (False, torch.float32, 36, 16, 4, (21, 0), False),
            (True, torch.bfloat16, 64, 8, 2, (13, 9), True),
            (False, torch.float32, 36, 16, 4, (21, 17), True)):
        ref = create_transport("torch", None, num_experts, hidden, 32, dtype)
        px = create_transport("proxy", None, num_experts, hidden, 32, dtype, provider="tcp",
                              num_channels=2, timeout_s=60)
        px.device_kernels, px.device_layout = "always", device_layout
        if copies:
            px.wire.through_copies()
        t = tokens[rank]
        idx, w = _route(t, num_experts, topk, seed=rank + 3 * hidden)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(t, hidden, generator=g).to(dtype)
        for it in range(2):  # a second call reuses every buffer
            r, p = ref.dispatch(x, idx, w), px.dispatch(x, idx, w)
            for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights",
                                   "tokens_per_expert"), r[:4], p[:4]):
                if a.shape != b.shape or not torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                                         b.view(torch.uint8) if b.is_floating_point() else b):
                    bad.append((str(dtype), it, name))
            if (p[4].state.send_token_idx_cpu is None) != device_layout:
                bad.append((str(dtype), it, "device layout used" if not device_layout else "not used"))
            y = torch.randn(r[0].shape[0], hidden, generator=g).to(dtype)
            if not torch.equal(ref.combine(y, r[4]).view(torch.uint8), px.combine(y, p[4]).view(torch.uint8)):
                bad.append((str(dtype), it, "combine"))
            x2 = torch.randn(t, hidden, generator=g).to(dtype)
            if not torch.equal(ref.dispatch_cached(x2, r[4]).view(torch.uint8),
                               px.dispatch_cached(x2, p[4]).view(torch.uint8)):
                bad.append((str(dtype), it, "dispatch_cached"))
            gw = torch.randn(r[0].shape[0], topk, generator=g)
            if not torch.equal(ref.combine_topk_weights(gw, r[4]), px.combine_topk_weights(gw, p[4])):
                bad.append((str(dtype), it, "combine_topk_weights"))
        px.close()
    # a bad expert id on rank 1 only: the device layout flags it, every rank raises the same error
    from efa_ep.kernels import DispatchInputError

    px = create_transport("proxy", None, 8, 16, 8, torch.float32, provider="tcp", timeout_s=60)
    px.device_kernels, px.device_layout = "always", True
    idx = torch.tensor([[0, 5], [3, -1]])
    if rank == 1:
        idx[1, 0] = 8
    try:
        px.dispatch(torch.ones(2, 16), idx, torch.ones(2, 2))
        msg = "no error"
    except DispatchInputError as e:
        msg = str(e)
    # the refusal took no round: the same transport goes on in step on every rank
    good = torch.tensor([[0, 5], [3, -1]])
    ref = create_transport("torch", None, 8, 16, 8, torch.float32)
    x = torch.arange(32, dtype=torch.float32).view(2, 16) + rank
    r, p = ref.dispatch(x, good, torch.ones(2, 2)), px.dispatch(x, good, torch.ones(2, 2))
    if not all(torch.equal(a, b) for a, b in zip(r[:4], p[:4])):
        bad.append(("after the refusal", "dispatch"))
    px.close()
    return bad, msg


def _late_rank(rank, world):
    """Dispatches, combines and cached dispatches whose send plane a thread fills after the
    kernel "returned", chunk by chunk (plane bytes first, then the progress words), over tiny
    wire descriptors (48 bytes) and chunks of one row per program; the outputs must equal the
    ``torch`` transport's."""
    import threading
    import time

    import torch
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.proxy import device as dk, device_path

    torch.set_num_threads(1)
    real_pack, real_pack_rows = dk.pack_dispatch, dk.pack_rows
    threads = []

    def store_late(plane, mine, progress, done, chunk_rows, total, own_start, own_end, row):
        """Copies ``mine`` (what the kernel stored) into ``plane`` chunk by chunk from a thread,
        each chunk's rows before its progress word; the plane holds 0xFF until then."""
        plane.fill_(0xFF)  # what a peer would read if a chunk went out before it was stored

        def store():
            for c in range(1, max(done.tolist(), default=0) + 1):
                time.sleep(0.005)  # a slow device (pacing only: nothing waits on it)
                end = min(c * chunk_rows, total)
                peer_rows = end - min(max(end - own_start, 0), own_end - own_start)
                plane[:peer_rows * row].copy_(mine[:peer_rows * row])
                progress[:] = c

        threads.append(threading.Thread(target=store))
        threads[-1].start()

    def late_pack(x, idx, w, lay, me, plane, meta, counts, progress, chunk_rows, **kw):
        mine, done = torch.zeros_like(plane), torch.zeros_like(progress)
        real_pack(x, idx, w, lay, me, mine, meta, counts, done, chunk_rows, **kw)
        num_send = counts[1:1 + world].tolist()
        s_me = sum(num_send[:me])
        store_late(plane, mine, progress, done, chunk_rows, sum(num_send), s_me,
                   s_me + num_send[me], x.shape[1] * x.element_size())

    def late_pack_rows(src, idx, own_start, own_end, plane, progress, chunk_rows, **kw):
        mine, done = torch.zeros_like(plane), torch.zeros_like(progress)
        real_pack_rows(src, idx, own_start, own_end, mine, done, chunk_rows, **kw)
        store_late(plane, mine, progress, done, chunk_rows,
                   src.shape[0] if idx is None else idx.numel(), own_start, own_end,
                   src.shape[1] * src.element_size())

    dk.pack_dispatch, dk.pack_rows = late_pack, late_pack_rows
    device_path._CHUNK_BYTES = 1  # one row per program per chunk
    bad = []
    for hidden, tokens in ((64, (13, 9)), (40, (21, 17))):
        ref = create_transport("torch", None, 16, hidden, 32, torch.bfloat16)
        px = create_transport("proxy", None, 16, hidden, 32, torch.bfloat16, provider="tcp",
                              num_channels=2, chunk_bytes=48, timeout_s=60)
        px.device_kernels, px.device_layout = "always", True
        t = tokens[rank]
        idx, w = _route(t, 16, 4, seed=rank + hidden)
        x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        for it in range(2):
            r, p = ref.dispatch(x, idx, w), px.dispatch(x, idx, w)
            for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights",
                                   "tokens_per_expert"), r[:4], p[:4]):
                if a.shape != b.shape or not torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                                         b.view(torch.uint8) if b.is_floating_point() else b):
                    bad.append((hidden, it, name))
            y = torch.randn(r[0].shape[0], hidden, generator=torch.Generator().manual_seed(it)).to(torch.bfloat16)
            if not torch.equal(ref.combine(y, r[4]).view(torch.uint8), px.combine(y, p[4]).view(torch.uint8)):
                bad.append((hidden, it, "combine"))
            x2 = torch.randn(t, hidden, generator=torch.Generator().manual_seed(7 + it)).to(torch.bfloat16)
            if not torch.equal(ref.dispatch_cached(x2, r[4]).view(torch.uint8),
                               px.dispatch_cached(x2, p[4]).view(torch.uint8)):
                bad.append((hidden, it, "dispatch_cached"))
        px.close()
    for th in threads:
        th.join()
    return bad


# the ranks' environment: libfabric tcp on loopback, Triton's interpreter
_RANK_ENV = {"FI_TCP_IFACE": "lo", "FI_PROVIDER": "tcp", "OMP_NUM_THREADS": "1",
             "TRITON_INTERPRET": "1"}


def _shared_rank(rank, world):
    """Both ranks say they share one GPU: the transport counts them, its reading kernels run
    with the SMs (here: 4 programs on the CPU) split over them, and the outputs stay torch's."""
    import torch
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.proxy import transport as proxy_transport

    torch.set_num_threads(1)
    proxy_transport._device_identity = lambda: ("this host", "GPU-0")
    ref = create_transport("torch", None, 16, 48, 32, torch.bfloat16)
    px = create_transport("proxy", None, 16, 48, 32, torch.bfloat16, provider="tcp",
                          num_channels=2, timeout_s=60)
    px.device_kernels, px.device_layout = "always", True
    bad = []
    cpu = torch.device("cpu")
    if (px.ranks_per_device, px._num_programs(cpu), px._read_programs(cpu)) != (2, 4, 2):
        bad.append(("programs", px.ranks_per_device, px._num_programs(cpu),
                    px._read_programs(cpu)))
    idx, w = _route(21, 16, 4, seed=rank)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(21, 48, generator=g).to(torch.bfloat16)
    for it in range(2):
        r, p = ref.dispatch(x, idx, w), px.dispatch(x, idx, w)
        if not all(torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b)
                   for a, b in zip(r[:4], p[:4])):
            bad.append((it, "dispatch"))
        y = torch.randn(r[0].shape[0], 48, generator=g).to(torch.bfloat16)
        if not torch.equal(ref.combine(y, r[4]).view(torch.uint8),
                           px.combine(y, p[4]).view(torch.uint8)):
            bad.append((it, "combine"))
    px.close()
    return bad


def _check_shared():
    from efa_ep.distributed import run_ranks

    for rank, bad in enumerate(run_ranks(_shared_rank, 2, (), timeout_s=500, env=_RANK_ENV)):
        assert not bad, (rank, bad)
    print("OK shared")


def _check_late():
    from efa_ep.distributed import run_ranks

    for rank, bad in enumerate(run_ranks(_late_rank, 2, (), timeout_s=500, env=_RANK_ENV)):
        assert not bad, (rank, bad)
    print("OK late")


def _check_transport():
    from efa_ep.distributed import run_ranks

    results = run_ranks(_transport_rank, 2, (), timeout_s=500, env=_RANK_ENV)
    for rank, (bad, msg) in enumerate(results):
        assert not bad, (rank, bad)
        assert "rank 1" in msg and "expert id 8" in msg, (rank, msg)
    print("OK transport")


if __name__ == "__main__":
    {"pack": _check_pack, "gather": _check_gather, "reduce": _check_reduce,
     "transport": _check_transport, "late": _check_late,
     "shared": _check_shared}[sys.argv[1]]()
