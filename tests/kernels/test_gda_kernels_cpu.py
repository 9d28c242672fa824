"""CPU tests of the gda Triton kernels under the Triton interpreter (no GPU needed).

Each test runs this file as a subprocess with ``TRITON_INTERPRET=1`` set before triton is
imported (the interpreter is chosen when the ``@triton.jit`` functions are created, so it must not
share a process with modules that imported the kernels for the GPU). Peers are local CPU tensors:
the pointer tables hold their ``data_ptr()``, as in torchtitan's one-GPU peer-store tests.

Checked against the references: ``compute_send_layout`` (layout kernels), the brute-force
``reference_dispatch`` (store + receive permutation, ids, weights, counts) and
``reference_combine`` / ``reduce_rows_by_rank`` semantics (combine reduce), bit for bit.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKS = ["layout", "layout_errors", "layout_in_store", "dispatch_combine",
          "dispatch_combine_float32", "wait_timeout", "header_clean_rows",
          "fixed_capacity", "device_op_base", "compact_receive"]


@pytest.mark.parametrize("check", [pytest.param(c, marks=pytest.mark.slow) if c == "layout" else c
                                   for c in CHECKS])
def test_gda_kernels_interpreted(check):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), check], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{check} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert f"OK {check}" in proc.stdout


# ------------------------------------------------------------------------------------------
# Worker side (runs in the subprocess, interpreter on)
# ------------------------------------------------------------------------------------------
def _check_layout():
    import torch
    from efa_ep.kernels.gda import launches as kern
    from efa_ep.kernels.base import compute_send_layout
    from efa_ep.testing.routes import contract_route

    cases = 0
    small = kern.LAYOUT_SMALL_ELEMS
    grid = [(path, world, num_experts, topk, t, kind)
            for path in ("one program", "blocks")
            for world in (1, 2, 4, 8)
            for num_experts in ((world * 2, 64) if world in (2, 8) else (64,))
            for topk in (1, 2, 8) if topk <= num_experts
            for t in ((0, 1, 65, 130, 300) if path == "one program" else (0, 1, 65, 130))
            for kind in ("random", "hot_experts", "dropped", "one_rank")]
    for path, world, num_experts, topk, t, kind in grid:
        # the one-program kernel for small batches (t = 300 falls back to blocks), then the
        # block kernels for every size
        kern.LAYOUT_SMALL_ELEMS = small if path == "one program" else 0
        case = (path, world, num_experts, topk, t, kind)
        seed = hash((world, num_experts, topk, t, kind)) % 10_000
        idx, w = contract_route(kind, t, num_experts, topk, world, seed)
        slot, send_idx, per_rank, per_expert, status = kern.layout(idx, w, num_experts, world)
        ref = compute_send_layout(idx, num_experts, world)
        s = int(ref.num_tokens_per_rank_W.sum())
        assert torch.equal(slot, ref.send_slot_TW), case
        assert torch.equal(per_rank, ref.num_tokens_per_rank_W), case
        assert torch.equal(per_expert, ref.num_tokens_per_expert_E), case
        assert torch.equal(send_idx[:s], ref.send_token_idx_S), case
        assert int(status) == 0, case
        cases += 1
    print(f"layout cases: {cases}")


def _check_layout_errors():
    from efa_ep.kernels.gda import launches as kern

    for small in (kern.LAYOUT_SMALL_ELEMS, 0):  # one-program kernel, then the block kernels
        kern.LAYOUT_SMALL_ELEMS = small
        _layout_errors(kern)


def _layout_errors(kern):
    import torch

    idx = torch.tensor([[0, 3], [1, -1], [2, 2]], dtype=torch.int64)
    w = torch.ones(3, 2)
    slot, send_idx, per_rank, per_expert, status = kern.layout(idx, w, 4, 2)
    # The docstring example of _layout_count_kernel, written by hand.
    assert per_rank.tolist() == [2, 2] and per_expert.tolist() == [1, 1, 2, 1]
    assert slot.tolist() == [[0, 0], [1, -1], [-1, 1]]
    assert send_idx[:4].tolist() == [0, 1, 0, 2]
    bad = torch.tensor([[0, 9], [-3, 1]], dtype=torch.int64)
    *_, status = kern.layout(bad, torch.ones(2, 2), 4, 2)
    assert int(status) == 1, int(status)
    nan_w = torch.tensor([[0.5, float("nan")], [1.0, 0.0]])
    *_, status = kern.layout(torch.zeros(2, 2, dtype=torch.int64), nan_w, 4, 2)
    assert int(status) == 2, int(status)
    try:
        kern.layout(idx.int(), w, 4, 2)
        raise AssertionError("expected a dtype error")
    except ValueError as e:
        assert "torch.int64" in str(e)


class _Peers:
    """W simulated ranks in one process: windows, signal pads and pointer tables on the CPU."""

    def __init__(self, world, t_max, hidden, dtype, k_cap, num_local):
        import torch
        from efa_ep.kernels.gda import WindowLayout

        elem = torch.empty((), dtype=dtype).element_size()
        self.layout = WindowLayout(world, t_max, -(-hidden * elem // 16) * 16, k_cap, num_local)
        self.bufs = [torch.full((self.layout.total_bytes,), 0xAB, dtype=torch.uint8)
                     for _ in range(world)]
        self.sigs = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
        self.errs = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
        self.dones = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
        self.hws = [torch.zeros(2, world, dtype=torch.int64) for _ in range(world)]
        self.buf_ptrs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        self.sig_ptrs = torch.tensor([s.data_ptr() for s in self.sigs], dtype=torch.int64)
        self.win_ptrs = [self.buf_ptrs[r:r + 1] for r in range(world)]

    def hdr(self, r, hdr_off):
        n = self.layout.world * self.layout.hdr_len
        return self.bufs[r][hdr_off:hdr_off + 8 * n].view(__import__("torch").int64).view(
            self.layout.world, -1)


WAIT = dict(timeout_ns=0, max_spins=1000, use_globaltimer=False)


def _run_dispatch_combine(row_dtype_name):
    import torch
    from efa_ep.kernels.gda import launches as kern
    from efa_ep.testing.reference import reference_combine, reference_dispatch
    from efa_ep.testing.routes import contract_route

    dtype = getattr(torch, row_dtype_name)
    cases = 0
    for world, num_experts, topk, hidden, kind, progs in [
        (1, 4, 2, 16, "random", 3),
        (2, 8, 2, 24, "random", 1),
        (2, 8, 8, 32, "hot_experts", 4),
        (4, 16, 4, 24, "dropped", 2),
        (4, 8, 1, 8, "one_rank", 5),
        (3, 12, 3, 40, "random", 64),
    ]:
        t_max = 12
        peers = _Peers(world, t_max, hidden, dtype, 8, num_experts // world)
        g = torch.Generator().manual_seed(world * 100 + topk)
        ts = [(t_max - 3 * r) % (t_max + 1) for r in range(world)]  # includes 0 for some cases
        xs = [torch.randn(t, hidden, generator=g).to(dtype) for t in ts]
        routes = [contract_route(kind, t, num_experts, topk, world, 7 + r) for r, t in enumerate(ts)]
        idxs = [i for i, _ in routes]
        ws = [w for _, w in routes]
        num_local = num_experts // world
        # ---- dispatch (epoch 1, parity 1) ----
        epoch, offs = 1, peers.layout.offsets(1)
        lays = []
        for me in range(world):
            lay = kern.layout(idxs[me], ws[me], num_experts, world)
            lays.append(lay)
            slot, send_idx, per_rank, per_expert, status = lay
            kern.dispatch_store(xs[me], idxs[me], ws[me], slot, per_rank, per_expert, status,
                             peers.buf_ptrs, peers.sig_ptrs, peers.dones[me], **offs, me=me,
                             t_max=t_max, num_local=num_local, epoch=epoch, with_meta=True,
                             num_programs=progs)
        ref = reference_dispatch(xs, idxs, ws, num_experts)
        recv = []
        iv = torch.int16 if dtype != torch.float32 else torch.int32
        for me in range(world):
            assert peers.sigs[me].tolist() == [epoch] * world
            hl = 2 + num_local
            n_info = 1 + world * hl + world + num_local
            # odd ranks: info over the bus into host memory, the op's record written after it
            host = torch.full((n_info + 1,), -9, dtype=torch.int64) if me % 2 else None
            info, offsets = kern.recv_header(peers.sigs[me], peers.hdr(me, offs["hdr_off"]),
                                          peers.errs[me], lays[me][2], peers.hws[me][1],
                                          num_local=num_local, t_max=t_max, epoch=epoch,
                                          host=host, **WAIT)
            if host is not None:
                assert info.data_ptr() == host.data_ptr() and info.numel() == n_info
                assert int(host[n_info]) == kern.wait_record(epoch, "dispatch")
            assert int(info[0]) == 0
            hdr = info[1:1 + world * hl].view(world, hl)
            assert hdr[:, 0].tolist() == [0] * world
            assert info[1 + world * hl:1 + world * hl + world].tolist() == lays[me][2].tolist()
            assert info[1 + world * hl + world:].tolist() == hdr[:, 2:].sum(0).tolist()
            n = int(hdr[:, 1].sum())
            rx = torch.full((n, hidden), float("nan"), dtype=dtype)
            ri = torch.full((n, topk), -7, dtype=torch.int64)
            rw = torch.full((n, topk), float("nan"))
            kern.gather_rows(peers.win_ptrs[me], offsets, rx, ri, rw, peers.sigs[me], peers.errs[me],
                          data_off=offs["data_off"], idx_off=offs["idx_off"], w_off=offs["w_off"],
                          t_max=t_max, epoch=epoch, wait=False, num_programs=progs, **WAIT)
            ref_x, ref_i, ref_w, ref_tpe, _ = ref[me]
            assert torch.equal(rx.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               ref_x.view(torch.int16 if dtype != torch.float32 else torch.int32))
            assert torch.equal(ri, ref_i) and torch.equal(rw.view(torch.int32), ref_w.view(torch.int32))
            assert torch.equal(hdr[:, 2:].sum(0), ref_tpe)
            # the clean row count after the offsets, and the early gather that copies by it:
            # the same rows into outputs with room to spare (the rest untouched), nothing when
            # the word says the counts were not clean (-1) or exceed the outputs
            offsets2 = offsets.as_strided((world + 2,), (1,))
            assert int(offsets2[world + 1]) == n
            for word, copies in ((n, True), (-1, False), (n + 4, False)):
                offsets2[world + 1] = word
                ex = torch.full((n + 3, hidden), float("nan"), dtype=dtype)
                ei = torch.full((n + 3, topk), -7, dtype=torch.int64)
                ew = torch.full((n + 3, topk), float("nan"))
                kern.gather_rows(peers.win_ptrs[me], offsets2, ex, ei, ew, peers.sigs[me],
                                 peers.errs[me], data_off=offs["data_off"],
                                 idx_off=offs["idx_off"], w_off=offs["w_off"], t_max=t_max,
                                 epoch=epoch, wait=False, num_programs=progs, **WAIT, early=True)
                got = n if copies else 0
                assert torch.equal(ex[:got].view(iv), rx[:got].view(iv)), (world, word)
                assert torch.equal(ei[:got], ri[:got]) and torch.equal(ew[:got], rw[:got])
                assert torch.isnan(ex[got:].float()).all() and (ei[got:] == -7).all()
            offsets2[world + 1] = n
            recv.append((n, offsets, ri))
        # ---- combine (epoch 2, parity 0) ----
        epoch, offs = 2, peers.layout.offsets(0)
        ys = [torch.randn(n, hidden, generator=g).to(dtype) for n, _, _ in recv]
        for d in range(world):
            kern.combine_store(ys[d], recv[d][1], peers.buf_ptrs, peers.sig_ptrs, peers.dones[d],
                            data_off=offs["data_off"], me=d, t_max=t_max, epoch=epoch,
                            num_programs=progs)
        ref_out = reference_combine(ys, [r[4] for r in ref], ts)
        for s in range(world):
            out = torch.full((ts[s], hidden), float("nan"), dtype=dtype)
            # odd ranks: the wait inside the reduce kernel
            kern.combine_reduce(peers.win_ptrs[s], lays[s][0], out, peers.sigs[s], peers.errs[s],
                             data_off=offs["data_off"], t_max=t_max, epoch=epoch, wait=True,
                             num_programs=progs, **WAIT, wait_in_kernel=bool(s % 2))
            assert peers.errs[s].tolist() == [0, 0, 0]
            iv = torch.int16 if dtype != torch.float32 else torch.int32
            assert torch.equal(out.view(iv), ref_out[s].view(iv)), (world, kind, s)
        # ---- a weight combine (epoch 12, parity 0 again: it overwrites the rows above):
        # float32 [N, K], the slots of experts on other ranks masked by the store kernel ----
        gws = [torch.randn(n, topk, generator=g) for n, _, _ in recv]
        for d in range(world):
            gws[d][recv[d][2] < 0] = float("nan")  # what a masked slot holds must not leak
        for d in range(world):
            kern.combine_store(gws[d], recv[d][1], peers.buf_ptrs, peers.sig_ptrs, peers.dones[d],
                               data_off=offs["data_off"], me=d, t_max=t_max, epoch=12,
                               num_programs=progs, ids=recv[d][2])
        masked = [torch.where(recv[d][2] >= 0, gws[d], 0.0) for d in range(world)]
        ref_w = reference_combine(masked, [r[4] for r in ref], ts)
        for s in range(world):
            out = torch.full((ts[s], topk), float("nan"))
            kern.combine_reduce(peers.win_ptrs[s], lays[s][0], out, peers.sigs[s], peers.errs[s],
                                data_off=offs["data_off"], t_max=t_max, epoch=12, wait=True,
                                num_programs=progs, **WAIT)
            assert torch.equal(out.view(torch.int32), ref_w[s].view(torch.int32)), (world, s)
        # ---- dispatch_cached of float32 rows of another width (epoch 3, parity 1) ----
        epoch, offs = 3, peers.layout.offsets(1)
        d2 = max(1, hidden * torch.empty((), dtype=dtype).element_size() // 4 - 1)
        x2 = [torch.randn(t, d2, generator=g) for t in ts]
        for me in range(world):
            kern.dispatch_store(x2[me], None, None, lays[me][0], None, None, None, peers.buf_ptrs,
                             peers.sig_ptrs, peers.dones[me], **offs, me=me, t_max=t_max,
                             num_local=num_local, epoch=epoch, with_meta=False, num_programs=progs)
        for me in range(world):
            out = torch.full((recv[me][0], d2), float("nan"))
            kern.gather_rows(peers.win_ptrs[me], recv[me][1], out, None, None, peers.sigs[me],
                          peers.errs[me], data_off=offs["data_off"], idx_off=0, w_off=0,
                          t_max=t_max, epoch=epoch, wait=True, num_programs=progs, **WAIT,
                          wait_in_kernel=bool(me % 2))  # odd ranks: the wait in the gather
            want = torch.stack([x2[s][t] for s, t in ref[me][4]]) if ref[me][4] else out
            assert torch.equal(out, want)
            assert peers.errs[me].tolist() == [0, 0, 0]
        cases += 1
    print(f"dispatch/combine cases: {cases}")


def _check_wait_timeout():
    """An expired wait sets the missing-source bits and records the first expired op (epoch and
    kind); every later reduce/gather of the window writes NaN rows, never a partial sum."""
    import torch
    from efa_ep.kernels.gda import launches as kern

    world = 4
    peers = _Peers(world, 4, 8, torch.bfloat16, 2, 2)
    offs = peers.layout.offsets(1)
    peers.sigs[0][:] = torch.tensor([1, 0, 1, 1], dtype=torch.int32)  # rank 1 never signalled
    info, _ = kern.recv_header(peers.sigs[0], peers.hdr(0, offs["hdr_off"]), peers.errs[0],
                            torch.zeros(world, dtype=torch.int64), peers.hws[0][1],
                            num_local=2, t_max=4, epoch=1, timeout_ns=0, max_spins=5,
                            use_globaltimer=False)
    assert int(info[0]) == 0b0010, int(info[0])
    assert peers.errs[0].tolist() == [0b0010, kern.wait_record(1, "dispatch"), 0]
    # Sticky: a later wait that misses rank 3 adds its bit, but the record keeps the first op.
    peers.sigs[0][:] = torch.tensor([2, 2, 2, 1], dtype=torch.int32)
    slot = torch.tensor([[0, -1, -1, -1], [-1, -1, 0, 0]], dtype=torch.int64)
    out = torch.zeros(2, 8, dtype=torch.bfloat16)
    kern.combine_reduce(peers.win_ptrs[0], slot, out, peers.sigs[0], peers.errs[0],
                     data_off=offs["data_off"], t_max=4, epoch=2, wait=True, kind="combine",
                     timeout_ns=0, max_spins=5, use_globaltimer=False, num_programs=1)
    assert peers.errs[0].tolist() == [0b1010, kern.wait_record(1, "dispatch"), 0], peers.errs[0]
    assert torch.isnan(out.float()).all(), out
    # A fresh window whose combine wait expires: record names the combine, rows are NaN.
    peers = _Peers(world, 4, 8, torch.float32, 2, 2)
    peers.sigs[2][:] = torch.tensor([5, 5, 5, 4], dtype=torch.int32)
    out = torch.zeros(2, 8)
    kern.combine_reduce(peers.win_ptrs[2], slot, out, peers.sigs[2], peers.errs[2],
                     data_off=offs["data_off"], t_max=4, epoch=5, wait=True,
                     kind="weight combine", timeout_ns=0, max_spins=5, use_globaltimer=False,
                     num_programs=1)
    assert peers.errs[2].tolist() == [0b1000, kern.wait_record(5, "weight combine"), 0]
    assert torch.isnan(out).all()
    rows = torch.zeros(3, 8)
    kern.gather_rows(peers.win_ptrs[2], torch.tensor([0, 3, 3, 3, 3]), rows, None, None,
                  peers.sigs[2], peers.errs[2], data_off=offs["data_off"], idx_off=0, w_off=0,
                  t_max=4, epoch=6, wait=False, timeout_ns=0, max_spins=5,
                  use_globaltimer=False, num_programs=2)
    assert torch.isnan(rows).all()
    # No expiry: the same reduce is finite (all sources at epoch 5).
    peers = _Peers(world, 4, 8, torch.float32, 2, 2)
    peers.bufs[2].zero_()
    peers.sigs[2][:] = 5
    kern.combine_reduce(peers.win_ptrs[2], slot, out, peers.sigs[2], peers.errs[2],
                     data_off=offs["data_off"], t_max=4, epoch=5, wait=True, kind="combine",
                     timeout_ns=0, max_spins=5, use_globaltimer=False, num_programs=1)
    assert peers.errs[2].tolist() == [0, 0, 0] and torch.equal(out, torch.zeros(2, 8))
    # The wait inside the reduce / gather kernel (every program waits): the same bits, the
    # same first record, NaN rows; a copy of no rows still waits (its expiry is recorded).
    for grid in (1, 3):
        peers = _Peers(world, 4, 8, torch.float32, 2, 2)
        peers.sigs[2][:] = torch.tensor([5, 4, 5, 5], dtype=torch.int32)
        out = torch.zeros(2, 8)
        kern.combine_reduce(peers.win_ptrs[2], slot, out, peers.sigs[2], peers.errs[2],
                            data_off=offs["data_off"], t_max=4, epoch=5, wait=True,
                            kind="combine", timeout_ns=0, max_spins=5, use_globaltimer=False,
                            num_programs=grid, wait_in_kernel=True)
        assert peers.errs[2].tolist() == [0b0010, kern.wait_record(5, "combine"), 0], grid
        assert torch.isnan(out).all()
        peers = _Peers(world, 4, 8, torch.float32, 2, 2)
        peers.sigs[1][:] = torch.tensor([3, 3, 2, 3], dtype=torch.int32)
        kern.gather_rows(peers.win_ptrs[1], torch.tensor([0, 0, 0, 0, 0]),
                         torch.zeros(0, 8), None, None, peers.sigs[1], peers.errs[1],
                         data_off=offs["data_off"], idx_off=0, w_off=0, t_max=4, epoch=3,
                         wait=True, timeout_ns=0, max_spins=5, use_globaltimer=False,
                         num_programs=grid, wait_in_kernel=True)
        assert peers.errs[1].tolist() == [0b0100, kern.wait_record(3, "cached dispatch"), 0]


def _check_header_clean_rows():
    """The row count the header kernel leaves after the offsets for a gather launched before
    the host's count read: the rows received when the counts are clean, else -1, from one read
    of the headers. Every count the host's own check (the native library's
    efa_gda_rows_received) accepts, the kernel accepts with the same rows; what the kernel
    refuses, the host refuses too (headers a peer wrote wrong: status, rows out of bounds,
    negative per-expert counts, the error word set)."""
    import ctypes

    import torch
    from efa_ep.kernels import native_launch as nl
    from efa_ep.kernels.gda import launches as kern

    world, t_max, num_local, k = 3, 6, 2, 2
    hl = 2 + num_local
    n_info = 1 + world * hl + world + num_local
    lib = nl.load()
    check = lib.efa_gda_rows_received
    check.restype = ctypes.c_int64
    good = [[0, 3, 2, 1], [0, 0, 0, 0], [0, 6, 5, 4]]
    cases = {"clean": (good, 0), "no rows": ([[0, 0, 0, 0]] * 3, 0),
             "status": ([[0, 3, 2, 1], [2, 0, 0, 0], [0, 6, 5, 4]], 0),
             "rows over t_max": ([[0, 7, 2, 1], [0, 0, 0, 0], [0, 6, 5, 4]], 0),
             "negative rows": ([[0, -1, 0, 0], [0, 4, 2, 1], [0, 6, 5, 4]], 0),
             "negative expert": ([[0, 3, -9, 1], [0, 0, 0, 0], [0, 6, 5, 4]], 0),
             "pairs over rows x k": ([[0, 1, 9, 9], [0, 0, 0, 0], [0, 1, 0, 0]], 0),
             "error word": (good, 0b100)}
    for name, (hdr_rows, err_bits) in cases.items():
        peers = _Peers(world, t_max, 8, torch.float32, k, num_local)
        offs = peers.layout.offsets(1)
        peers.hdr(0, offs["hdr_off"])[:] = torch.tensor(hdr_rows, dtype=torch.int64)
        peers.sigs[0][:] = 1
        peers.errs[0][0] = err_bits
        host = torch.full((n_info + 1,), -9, dtype=torch.int64)
        out = torch.full((kern._even(n_info) + world + 2,), -5, dtype=torch.int64)
        info, offsets = kern.recv_header(peers.sigs[0], peers.hdr(0, offs["hdr_off"]),
                                         peers.errs[0], torch.zeros(world, dtype=torch.int64),
                                         peers.hws[0][1], num_local=num_local, t_max=t_max,
                                         epoch=1, host=host, out=out, **WAIT)
        word = int(out[kern._even(n_info) + world + 1])
        shape = (ctypes.c_int64 * 5)(world, hl, num_local, t_max, k)
        host_rows = check(ctypes.c_void_p(host.data_ptr()), shape)
        rows = sum(r[1] for r in hdr_rows)
        assert offsets.tolist() == [0] + [sum(r[1] for r in hdr_rows[:s + 1])
                                          for s in range(world)], name
        if name in ("clean", "no rows"):
            assert word == host_rows == rows, (name, word, host_rows)
        elif name == "pairs over rows x k":  # (the host's check is stricter)
            assert (word, host_rows) == (rows, -1), (name, word, host_rows)
        else:
            assert word == host_rows == -1, (name, word, host_rows)
    print(f"header clean rows cases: {len(cases)}")


def _check_device_op_base():
    """Op numbers are ``op_base[0] + epoch``: a store signals that sum at every peer, a wait
    compares against it, and an expired wait records it (what lets a CUDA graph replay with
    new op numbers by advancing the device base)."""
    import torch
    from efa_ep.kernels.gda import launches as kern

    world = 2
    peers = _Peers(world, 4, 8, torch.float32, 2, 2)
    offs = peers.layout.offsets(0)
    base = torch.tensor([40], dtype=torch.int32)
    x = torch.arange(16, dtype=torch.float32).view(2, 8)
    slot = torch.tensor([[0, 0], [1, -1]], dtype=torch.int64)
    for me in range(world):
        kern.dispatch_store(x, None, None, slot, None, None, None, peers.buf_ptrs, peers.sig_ptrs,
                         peers.dones[me], **offs, me=me, t_max=4, num_local=2, epoch=2,
                         with_meta=False, num_programs=2, op_base=base)
    for r in range(world):
        assert peers.sigs[r].tolist() == [42, 42], (r, peers.sigs[r])
    # 42 satisfies a wait for op 42 (base 40 + 2) but not for op 43 (base 41 + 2).
    kern.wait_for_sources(peers.sigs[0], peers.errs[0], epoch=2, kind="combine", timeout_ns=0,
                       max_spins=5, use_globaltimer=False, op_base=base)
    assert peers.errs[0].tolist() == [0, 0, 0], peers.errs[0]
    base += 1
    kern.wait_for_sources(peers.sigs[0], peers.errs[0], epoch=2, kind="combine", timeout_ns=0,
                       max_spins=5, use_globaltimer=False, op_base=base)
    assert peers.errs[0].tolist() == [0b11, kern.wait_record(43, "combine"), 0], peers.errs[0]


def _check_fixed_capacity():
    """Fixed-capacity receive (a fresh window is stale everywhere: ``full`` on first use): window
    rows of source s below n_s equal the reference, every
    other row has ids -1 / weights 0 (also rows a larger earlier dispatch or another top-k
    width left behind), device counts are right, and the fixed combine equals the reference."""
    import torch
    from efa_ep.kernels.gda import launches as kern
    from efa_ep.testing.reference import reference_combine, reference_dispatch
    from efa_ep.testing.routes import contract_route

    world, num_experts, hidden, t_max = 3, 12, 24, 10
    num_local = num_experts // world
    peers = _Peers(world, t_max, hidden, torch.bfloat16, 8, num_local)
    g = torch.Generator().manual_seed(5)
    epoch = 0
    # (tokens per rank, top-k): shrink after a large dispatch, then change the top-k width
    for step, (ts, topk, kind) in enumerate([([10, 7, 9], 3, "random"), ([2, 0, 4], 3, "dropped"),
                                             ([5, 3, 1], 2, "hot_experts"),
                                             ([4, 4, 4], 2, "one_rank")]):
        epoch += 2  # same parity every time: each step overwrites the previous step's rows
        offs = peers.layout.offsets(epoch % 2)
        xs = [torch.randn(t, hidden, generator=g).to(torch.bfloat16) for t in ts]
        routes = [contract_route(kind, t, num_experts, topk, world, 100 * step + r)
                  for r, t in enumerate(ts)]
        lays = []
        for me in range(world):
            lay = kern.layout(routes[me][0], routes[me][1], num_experts, world)
            lays.append(lay)
            slot, _, per_rank, per_expert, status = lay
            kern.dispatch_store(xs[me], routes[me][0], routes[me][1], slot, per_rank, per_expert,
                             status, peers.buf_ptrs, peers.sig_ptrs, peers.dones[me], **offs,
                             me=me, t_max=t_max, num_local=num_local, epoch=epoch,
                             with_meta=True, num_programs=2)
        ref = reference_dispatch(xs, [r[0] for r in routes], [r[1] for r in routes], num_experts)
        rows = world * t_max
        views = []
        for me in range(world):
            num_recv = torch.full((world,), -5, dtype=torch.int64)
            tpe = torch.full((num_local,), -5, dtype=torch.int64)
            b = peers.bufs[me]
            idx_region = b[offs["idx_off"]:offs["idx_off"] + rows * topk * 8].view(torch.int64)
            w_region = b[offs["w_off"]:offs["w_off"] + rows * topk * 4].view(torch.float32)
            kern.recv_header_fixed(peers.sigs[me], peers.hdr(me, offs["hdr_off"]), peers.errs[me],
                                peers.hws[me][epoch % 2], num_recv, tpe, idx_region, w_region,
                                num_topk=topk, t_max=t_max, epoch=epoch, full=(step in (0, 2)),
                                timeout_ns=0, max_spins=1000, use_globaltimer=False)
            ref_x, ref_i, ref_w, ref_tpe, sources = ref[me]
            want_n = [sum(1 for s, _ in sources if s == src) for src in range(world)]
            assert num_recv.tolist() == want_n, (step, me, num_recv, want_n)
            assert torch.equal(tpe, ref_tpe)
            rx = b[offs["data_off"]:offs["data_off"] + rows * hidden * 2].view(
                torch.bfloat16).view(rows, hidden)
            ri, rw = idx_region.view(rows, topk), w_region.view(rows, topk)
            used = torch.cat([torch.arange(src * t_max, src * t_max + want_n[src])
                              for src in range(world)])
            unused = torch.ones(rows, dtype=torch.bool)
            unused[used] = False
            assert torch.equal(rx[used].view(torch.int16), ref_x.view(torch.int16)), (step, me)
            assert torch.equal(ri[used], ref_i) and torch.equal(rw[used], ref_w), (step, me)
            assert bool((ri[unused] == -1).all()) and bool((rw[unused] == 0).all()), (step, me)
            assert peers.errs[me].tolist() == [0, 0, 0]
            views.append((rx, num_recv))
        # fixed combine: destination d returns y = 2 x its window rows (unused rows garbage)
        epoch += 1
        offs_c = peers.layout.offsets(epoch % 2)
        ys = []
        for d in range(world):
            y = views[d][0].float().mul(2).to(torch.bfloat16)
            y[torch.isnan(y.float())] = 0
            ys.append(y)
            kern.combine_store(y, views[d][1], peers.buf_ptrs, peers.sig_ptrs, peers.dones[d],
                            data_off=offs_c["data_off"], me=d, t_max=t_max, epoch=epoch,
                            num_programs=3, fixed=True)
        compact = [torch.cat([ys[d][src * t_max: src * t_max + int(views[d][1][src])]
                              for src in range(world)]) for d in range(world)]
        ref_out = reference_combine(compact, [r[4] for r in ref], ts)
        for s in range(world):
            out = torch.full((ts[s], hidden), float("nan"), dtype=torch.bfloat16)
            kern.combine_reduce(peers.win_ptrs[s], lays[s][0], out, peers.sigs[s], peers.errs[s],
                             data_off=offs_c["data_off"], t_max=t_max, epoch=epoch, wait=True,
                             timeout_ns=0, max_spins=1000, use_globaltimer=False,
                             num_programs=2)
            assert torch.equal(out.view(torch.int16), ref_out[s].view(torch.int16)), (step, s)
        epoch += 1  # keep the dispatch parity fixed
    # a source with bad status: every row unused, error bits set, counts 0
    epoch += 2
    offs = peers.layout.offsets(epoch % 2)
    hdr = peers.hdr(0, offs["hdr_off"])
    hdr.zero_()
    hdr[1, 0] = 4  # source 1 reported bad input
    hdr[2, 1] = 3
    peers.sigs[0][:] = epoch
    num_recv, tpe = torch.empty(world, dtype=torch.int64), torch.empty(num_local, dtype=torch.int64)
    b = peers.bufs[0]
    idx_region = b[offs["idx_off"]:offs["idx_off"] + world * t_max * 2 * 8].view(torch.int64)
    w_region = b[offs["w_off"]:offs["w_off"] + world * t_max * 2 * 4].view(torch.float32)
    kern.recv_header_fixed(peers.sigs[0], hdr, peers.errs[0], peers.hws[0][epoch % 2], num_recv,
                        tpe, idx_region, w_region, num_topk=2, t_max=t_max, epoch=epoch,
                        full=False, timeout_ns=0, max_spins=1000, use_globaltimer=False)
    assert num_recv.tolist() == [0, 0, 0] and tpe.tolist() == [0] * num_local
    assert bool((idx_region == -1).all()) and bool((w_region == 0).all())
    assert peers.errs[0].tolist() == [1 << 62, 0, 0b010], peers.errs[0]
    print("fixed-capacity steps: 4 + bad status")


def _check_layout_in_store():
    """The store kernel that computes a small batch's layout itself (``send_token_idx`` given)
    writes the layout the layout kernel writes (slots, send order, counts, status: bad ids and
    NaN weights included) and leaves every byte of every peer's window and signal pad as the
    layout launch followed by the plain store does, for grids that split the tokens unevenly."""
    import torch
    from efa_ep.kernels.gda import launches as kern
    from efa_ep.testing.routes import contract_route

    cases = 0
    for world, num_experts, topk, hidden, t, kind, progs in [
        (1, 4, 2, 16, 5, "random", 2), (2, 8, 2, 24, 12, "random", 1),
        (2, 8, 8, 32, 12, "hot_experts", 5), (4, 16, 4, 24, 9, "dropped", 4),
        (4, 8, 1, 8, 12, "one_rank", 64), (2, 8, 2, 16, 7, "bad", 3), (2, 8, 2, 16, 1, "nan", 2),
    ]:
        t_max, num_local = 12, num_experts // world
        assert kern.layout_in_store(t, topk, world)
        g = torch.Generator().manual_seed(world * 10 + t)
        peers = [_Peers(world, t_max, hidden, torch.bfloat16, 8, num_local) for _ in range(2)]
        xs = [torch.randn(t, hidden, generator=g).to(torch.bfloat16) for _ in range(world)]
        routes = [contract_route("random" if kind in ("bad", "nan") else kind, t, num_experts,
                                 topk, world, 3 + r) for r in range(world)]
        if kind == "bad":
            routes[1][0][t // 2, 0] = num_experts + 3
        if kind == "nan":
            routes[0][1][0, 1] = float("nan")
        offs = peers[0].layout.offsets(1)
        for me in range(world):
            idx, w = routes[me]
            words = kern.layout_words(t, num_experts, world, topk)
            lay = kern.layout(idx, w, num_experts, world)
            fused = kern.layout_views(torch.full((words,), -5, dtype=torch.int64), t,
                                      num_experts, world, topk)
            for p, (slot, send_idx, per_rank, per_expert, status) in zip(peers, (lay, fused)):
                kern.dispatch_store(
                    xs[me], idx, w, slot, per_rank, per_expert, status, p.buf_ptrs, p.sig_ptrs,
                    p.dones[me], **offs, me=me, t_max=t_max, num_local=num_local, epoch=1,
                    with_meta=True, num_programs=progs,
                    send_token_idx=send_idx if p is peers[1] else None, num_experts=num_experts)
            s = int(lay[2].sum())
            case = (world, kind, me)
            assert torch.equal(fused[0], lay[0]) and torch.equal(fused[1][:s], lay[1][:s]), case
            for a, b in zip(fused[2:], lay[2:]):
                assert torch.equal(a, b), case
            assert int(fused[4]) == {"bad": 1 if me == 1 else 0, "nan": 2 if me == 0 else 0}.get(
                kind, 0), case
        for r in range(world):
            assert torch.equal(peers[1].bufs[r], peers[0].bufs[r]), (world, kind, r)
            assert peers[1].sigs[r].tolist() == peers[0].sigs[r].tolist() == [1] * world
        cases += 1
    print(f"layout in the store kernel: {cases} cases")


def _check_compact_receive():
    """A compact dispatch (``rows_in_window``): the counts op publishes every rank's counts and
    the headers its stores will carry; each rank's count wait sums the ranks before it and
    hands over the announced headers (the info and offsets a regular header read writes, on
    the device and in the host buffer with the rows op's record last) before any row is
    stored; the stores at those rows leave every rank's received rows, ids and weights compact
    at the start of its window, equal to the reference; the header read then finds every
    source as announced, writes nothing for the host and moves the id region's high-water
    marks to cover rows [0, N); a source whose rows sit elsewhere or whose header differs from
    its announcement is flagged in the error word, and counts a peer inflates stay clamped
    inside the window."""
    import torch
    from efa_ep.kernels.gda import launches as kern
    from efa_ep.testing.reference import reference_combine, reference_dispatch
    from efa_ep.testing.routes import contract_route

    cases = 0
    for world, num_experts, topk, hidden, kind, progs in [
        (1, 4, 2, 16, "random", 3),
        (2, 8, 2, 24, "random", 1),
        (3, 12, 3, 40, "random", 64),
        (4, 16, 4, 24, "dropped", 2),
        (4, 8, 8, 8, "hot_experts", 5),
    ]:
        t_max, dtype = 12, torch.bfloat16
        num_local = num_experts // world
        hl = 2 + num_local
        n_info = 1 + world * hl + world + num_local
        peers = _Peers(world, t_max, hidden, dtype, 8, num_local)
        peers.errs = [torch.zeros(4, dtype=torch.int64) for _ in range(world)]
        g = torch.Generator().manual_seed(world * 10 + topk)
        ts = [(t_max - 3 * r) % (t_max + 1) for r in range(world)]
        xs = [torch.randn(t, hidden, generator=g).to(dtype) for t in ts]
        routes = [contract_route(kind, t, num_experts, topk, world, 3 + r)
                  for r, t in enumerate(ts)]
        idxs, ws = [i for i, _ in routes], [w for _, w in routes]

        def board(r, offs):
            o = offs["board_off"]
            return peers.bufs[r][o:o + 8 * peers.layout.board_words].view(torch.int64)

        # ---- op 1 (dispatch counts, parity 1) ----
        offs_c = peers.layout.offsets(1)
        lays = [kern.layout(idxs[me], ws[me], num_experts, world) for me in range(world)]
        for me in range(world):
            kern.publish_counts(lays[me][2], lays[me][3], lays[me][4], peers.buf_ptrs,
                                peers.sig_ptrs, board_off=offs_c["board_off"], me=me,
                                num_local=num_local, epoch=1)
        counts = torch.stack([lay[2] for lay in lays])  # [source, destination]
        # what each source announces to rank d: status, rows, rows per expert of d
        said = [torch.stack([torch.cat([lays[s][4].view(1), lays[s][2][d:d + 1],
                                        lays[s][3][d * num_local:(d + 1) * num_local]])
                             for s in range(world)]) for d in range(world)]
        dst, outs = [], []
        for me in range(world):
            assert peers.sigs[me].tolist() == [1] * world
            assert torch.equal(board(me, offs_c)[:world * world].view(world, world), counts)
            d = torch.full((world,), -5, dtype=torch.int64)
            out = torch.full((kern._even(n_info) + world + 2,), -7, dtype=torch.int64)
            host = torch.full((n_info + 1,), -9, dtype=torch.int64)
            info, offsets = kern.count_wait(
                peers.sigs[me], peers.errs[me], board(me, offs_c), d, lays[me][2], out, me=me,
                t_max=t_max, num_local=num_local, epoch=1, **WAIT, host=host)
            assert torch.equal(d, counts[:me].sum(0)), (world, me)
            assert peers.errs[me].tolist() == [0, 0, 0, 0]
            # the count read: the announced headers, before any row is stored
            assert torch.equal(info[1:1 + world * hl].view(world, hl), said[me]), (world, me)
            n = int(said[me][:, 1].sum())
            assert int(info[0]) == 0 and info[1 + world * hl:][:world].tolist() == \
                lays[me][2].tolist()
            assert torch.equal(info[1 + world * hl + world:], said[me][:, 2:].sum(0))
            assert offsets.tolist() == [0] + said[me][:, 1].cumsum(0).tolist()
            assert int(out[kern._even(n_info) + world + 1]) == n, (world, me)
            assert torch.equal(host[:n_info], info) and \
                int(host[n_info]) == kern.wait_record(2, "dispatch"), (world, me)
            dst.append(d)
            outs.append(out)
        # ---- op 2 (dispatch, parity 0): the compact stores and the header read ----
        offs = peers.layout.offsets(0)
        for me in range(world):
            slot, _, per_rank, per_expert, status = lays[me]
            kern.dispatch_store(xs[me], idxs[me], ws[me], slot, per_rank, per_expert, status,
                                peers.buf_ptrs, peers.sig_ptrs, peers.dones[me], **offs, me=me,
                                t_max=t_max, num_local=num_local, epoch=2, with_meta=True,
                                num_programs=progs, dst_off=dst[me])
        ref = reference_dispatch(xs, idxs, ws, num_experts)
        iv = torch.int16
        recv = []
        for me in range(world):
            before = outs[me].clone()
            host = torch.full((n_info + 1,), -9, dtype=torch.int64)
            _, offsets = kern.recv_header(
                peers.sigs[me], peers.hdr(me, offs["hdr_off"]), peers.errs[me], lays[me][2],
                peers.hws[me][0], num_local=num_local, t_max=t_max, epoch=2, **WAIT,
                out=outs[me], host=host, board=board(me, offs))
            assert peers.errs[me].tolist() == [0, 0, 0, 0], (world, me)
            assert torch.equal(outs[me], before) and host.tolist() == [-9] * (n_info + 1)
            assert torch.equal(peers.hdr(me, offs["hdr_off"]), said[me]), (world, me)
            n = int(said[me][:, 1].sum())
            ref_x, ref_i, ref_w, ref_tpe, _ = ref[me]
            rx = peers.bufs[me][offs["data_off"]:].view(dtype)[:n * hidden].view(n, hidden)
            ri = peers.bufs[me][offs["idx_off"]:].view(torch.int64)[:n * topk].view(n, topk)
            rw = peers.bufs[me][offs["w_off"]:].view(torch.float32)[:n * topk].view(n, topk)
            assert torch.equal(rx.view(iv), ref_x.view(iv)), (world, me)
            assert torch.equal(ri, ref_i) and torch.equal(rw.view(torch.int32),
                                                          ref_w.view(torch.int32))
            assert torch.equal(said[me][:, 2:].sum(0), ref_tpe)
            want_hw = [min(max(n - s * t_max, 0), t_max) for s in range(world)]
            assert peers.hws[me][0].tolist() == want_hw, (world, me)
            # the early ids copy (the C++ dispatch's header program): the received ids into a
            # room with rows to spare (the rest untouched) by the clean row count after the
            # offsets; nothing when that word says not clean (-1) or exceeds the room
            o2 = outs[me][kern._even(n_info):kern._even(n_info) + world + 2]
            for word, copies in ((n, True), (-1, False), (n + 4, False)):
                o2[world + 1] = word
                room = torch.full((n + 3, topk), -7, dtype=torch.int64)
                kern.copy_ids_early(peers.win_ptrs[me], o2, room, idx_off=offs["idx_off"])
                got = n if copies else 0
                assert torch.equal(room[:got], ri[:got]), (world, me, word)
                assert (room[got:] == -7).all(), (world, me, word)
            o2[world + 1] = n
            recv.append((n, offsets))
            # a source whose board entry names another row, or whose header differs from what
            # it announced: its bit in err[3], ROWS_MISPLACED in err[0]
            src = next((s for s in range(world) if int(said[me][s, 1]) > 0), None)
            if src is not None:
                b = board(me, offs)
                hdr = peers.hdr(me, offs["hdr_off"])
                for region, at in ((b, world * world + src), (hdr[src], 2)):
                    region[at] += 1
                    kern.recv_header(
                        peers.sigs[me], hdr, peers.errs[me], lays[me][2],
                        peers.hws[me][0].clone(), num_local=num_local, t_max=t_max, epoch=2,
                        **WAIT, out=outs[me], board=b)
                    assert peers.errs[me].tolist() == [kern.ROWS_MISPLACED, 0, 0, 1 << src]
                    region[at] -= 1
                    peers.errs[me].zero_()
        # ---- op 3 (combine, parity 1): the compact handle's offsets return the rows ----
        offs3 = peers.layout.offsets(1)
        ys = [torch.randn(n, hidden, generator=g).to(dtype) for n, _ in recv]
        for d in range(world):
            kern.combine_store(ys[d], recv[d][1], peers.buf_ptrs, peers.sig_ptrs, peers.dones[d],
                               data_off=offs3["data_off"], me=d, t_max=t_max, epoch=3,
                               num_programs=progs)
        ref_out = reference_combine(ys, [r[4] for r in ref], ts)
        for s in range(world):
            out = torch.full((ts[s], hidden), float("nan"), dtype=dtype)
            kern.combine_reduce(peers.win_ptrs[s], lays[s][0], out, peers.sigs[s], peers.errs[s],
                                data_off=offs3["data_off"], t_max=t_max, epoch=3, wait=True,
                                num_programs=progs, **WAIT)
            assert torch.equal(out.view(iv), ref_out[s].view(iv)), (world, kind, s)
        # ---- counts a peer inflates (a board op 5, parity 1): clamped to T_MAX each ----
        if world > 1:
            b = board(world - 1, offs_c)
            b[:world * world] = 10 ** 12
            b[(world + 1) * world:].view(world, hl)[:, 1] = 10 ** 12
            for r in range(world):
                peers.sigs[world - 1][r] = 5
            d = torch.full((world,), -5, dtype=torch.int64)
            out = torch.zeros(kern._even(n_info) + world + 2, dtype=torch.int64)
            kern.count_wait(peers.sigs[world - 1], peers.errs[world - 1], b, d, lays[0][2], out,
                            me=world - 1, t_max=t_max, num_local=num_local, epoch=5, **WAIT)
            assert d.tolist() == [(world - 1) * t_max] * world
            assert int(out[kern._even(n_info) + world + 1]) == -1  # not clean: the host refuses
        cases += 1
    print(f"compact receive: {cases} cases")


def _main(check):
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (sets TRITON_INTERPRET=1)"
    sys.path.insert(0, REPO)
    {
        "layout": _check_layout,
        "layout_errors": _check_layout_errors,
        "layout_in_store": _check_layout_in_store,
        "dispatch_combine": lambda: _run_dispatch_combine("bfloat16"),
        "dispatch_combine_float32": lambda: _run_dispatch_combine("float32"),
        "wait_timeout": _check_wait_timeout,
        "header_clean_rows": _check_header_clean_rows,
        "fixed_capacity": _check_fixed_capacity,
        "device_op_base": _check_device_op_base,
        "compact_receive": _check_compact_receive,
    }[check]()
    print(f"OK {check}")


if __name__ == "__main__":
    _main(sys.argv[1])
