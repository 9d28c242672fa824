"""The plan of a ``gda`` regular dispatch of a shape seen before (:func:`record_plan`), and its
outputs allocated before its count read, so that its one native call also gathers (see
:mod:`efa_ep.kernels.gda.phases`): how many rows, and the shape block the native call reads."""
from __future__ import annotations

import ctypes

import torch

from . import launches as kern
from .gate import GATE_SPIN_NS
from ..native_launch import FLAG_LATE, GATE_LATE, RAN

#: a regular dispatch whose outputs fit this many bytes allocates them before its count read, at
#: the rows its shape's recent calls received, so that its one native call gathers too (a
#: larger op costs the device far more than a second native call costs the host); with the C++
#: dispatch (``fast_launch=4``) a larger one gets exact outputs after the count read, in the
#: same C++ call
GATHER_AHEAD_BYTES = 16 << 20


class GatherAhead:
    """The gather of a bound dispatch plan (see :data:`GATHER_AHEAD_BYTES`): its program once
    bound, the rows the outputs are allocated at (0: none ahead), and the native call's
    ``[11]`` int64 shape block (:meth:`~efa_ep.kernels.native_launch.Program.run_dispatch`).
    With ``gather_early`` (the shape block's last word) the program is the early gather
    (``launches.gather_rows``' ``early``), which the native call launches right after the
    header, before its count read, so that its launch overlaps the device's work."""

    __slots__ = ("key", "prog", "cap", "row_bytes", "k", "shape", "shape_addr", "rows",
                 "rows_addr", "cpp")

    def __init__(self, key, row_bytes: int, k: int, shape):
        self.key, self.prog, self.cap, self.row_bytes, self.k = key, None, 0, row_bytes, k
        self.cpp = None  # the plan's constants for the C++ dispatch (cpp_op.CppPlan), once made
        self.shape = (ctypes.c_int64 * 11)(*shape)
        self.shape_addr = ctypes.addressof(self.shape)
        self.rows = ctypes.c_int64(-1)
        self.rows_addr = ctypes.addressof(self.rows)

    def fit(self, n: int) -> None:
        """Sizes the next calls' outputs after a call that received ``n`` rows: grown when
        outgrown, shrunk when a quarter of them went unused (1/8 headroom each time)."""
        if n > self.cap or 4 * n < 3 * self.cap:
            cap = n + n // 8
            self.cap = cap if cap * self.row_bytes <= GATHER_AHEAD_BYTES else 0
            self.shape[5] = self.cap


def program(ph, ahead: GatherAhead):
    """The bound gather program of ``ahead`` (``ph``: its ``GdaPhases``): the phases' own
    gather, bound by the calls before the plan, or the early gather, bound here once from
    placeholder tensors (its addresses and row counts are the call's variables); None when
    not bound (the kernels launch from Python)."""
    if ahead.prog is None:
        if not ahead.shape[10]:
            ahead.prog = ph._progs.get(ahead.key)
        else:
            tr = ph.tr
            dev, k, parity = tr.device, ahead.k, ahead.key[1]
            offsets = torch.zeros(tr.world_size + 2, dtype=torch.int64, device=dev)
            outs = (torch.empty(1, tr.cfg.hidden, dtype=tr.cfg.dtype, device=dev),
                    torch.empty(1, k, dtype=torch.int64, device=dev),
                    torch.empty(1, k, dtype=torch.float32, device=dev))
            offs = tr._offs[parity]

            def launch(plan):
                kern.gather_rows(tr._win_ptr, offsets, *outs, tr._my_sig, tr._err,
                                 data_off=offs["data_off"], idx_off=offs["idx_off"],
                                 w_off=offs["w_off"], t_max=tr.cfg.max_tokens_per_rank,
                                 **ph._op(0), wait=False, num_programs=tr.num_programs,
                                 plan=plan, **tr._wait_kw, early=True)

            ahead.prog = ph._program(ahead.key, launch, (offsets,) + outs, ("cap",), (0,))
    return ahead.prog


def header_kernel(ph, scratch, parity: int, op: dict, plan, host=None, board=None):
    """Launches (``plan``: records) the header read of a dispatch of ``parity`` (``ph``: its
    ``GdaPhases``; ``scratch``: the dispatch's, the header's output region at its end; ``op``:
    ``GdaPhases._op``'s arguments; ``host``: the page-locked counts buffer; ``board``: the
    count board of a compact dispatch). Returns what ``launches.recv_header`` returns."""
    tr = ph.tr
    w = tr.world_size
    o_rank = kern._layout_offsets(0, tr.cfg.num_experts, w, 1)[3]
    return kern.recv_header(tr._my_sig, tr._hdr[parity], tr._err, scratch[o_rank:o_rank + w],
                            tr._hw[parity], num_local=tr.cfg.num_local_experts,
                            t_max=tr.cfg.max_tokens_per_rank, **op, kind="dispatch",
                            **tr._wait_kw, out=scratch[scratch.numel() - ph.header_words():],
                            host=host, plan=plan, board=board)


def merged_program(ph, ahead: GatherAhead):
    """The header read and the early gather of ``ahead`` as one program (``gather_early=2``:
    one launch less per dispatch; the C++ dispatch runs it when it allocates outputs ahead),
    bound once per parity and row shape from placeholder tensors. Its variables, in order: the
    header's two scratch regions (the source ranks' words, the output region), the gather's
    offsets and three outputs, the op number, the gather's rows and grid. None when not bound
    (the two programs run apart)."""
    tr = ph.tr
    dev, k, parity, w = tr.device, ahead.k, ahead.key[1], tr.world_size
    key = ("header_gather",) + ahead.key[1:]
    if key in ph._progs or ph._host is None:
        return ph._progs.get(key)
    o_rank = kern._layout_offsets(0, tr.cfg.num_experts, w, 1)[3]
    scratch = torch.zeros(o_rank + w + ph.header_words(), dtype=torch.int64, device=dev)
    offsets = torch.zeros(w + 2, dtype=torch.int64, device=dev)
    outs = (torch.empty(1, tr.cfg.hidden, dtype=tr.cfg.dtype, device=dev),
            torch.empty(1, k, dtype=torch.int64, device=dev),
            torch.empty(1, k, dtype=torch.float32, device=dev))
    offs, op = tr._offs[parity], ph._op(0)
    header_steps = []
    header_kernel(ph, scratch, parity, op, header_steps, ph._pinned)

    def launch(plan):
        header_kernel(ph, scratch, parity, op, plan, ph._pinned)
        kern.gather_rows(tr._win_ptr, offsets, *outs, tr._my_sig, tr._err,
                         data_off=offs["data_off"], idx_off=offs["idx_off"], w_off=offs["w_off"],
                         t_max=tr.cfg.max_tokens_per_rank, **op, wait=False,
                         num_programs=tr.num_programs, plan=plan, **tr._wait_kw, early=True)

    regions = (scratch[o_rank:o_rank + w], scratch[o_rank + w:])
    return ph._program(key, launch, regions + (offsets,) + outs, ("epoch_delta", "cap"),
                       (len(header_steps),))


def ids_header_program(ph, parity: int, k: int):
    """The header read of a compact dispatch (``rows_in_window``) of ``parity`` and the copy of
    its received ids ``[N, K]`` out of the window (:func:`~.launches.copy_ids_early`) as one
    program, for the C++ dispatch: no copy of its own after the count read when the ids fit
    the room it gives. Bound once per parity and top-k from placeholder tensors. Its variables,
    in order: the header's two scratch regions (the source ranks' words, the output region),
    the ids' room, the op number, the rows the room holds. None when not bound."""
    tr = ph.tr
    key = ("header_compact_ids", parity, k)
    if key in ph._progs or ph._host is None:
        return ph._progs.get(key)
    dev, w = tr.device, tr.world_size
    o_rank = kern._layout_offsets(0, tr.cfg.num_experts, w, 1)[3]
    scratch = torch.zeros(o_rank + w + ph.header_words(), dtype=torch.int64, device=dev)
    o_offsets = scratch.numel() - (w + 2)  # (the header's words end with the offsets [W + 2])
    ids = torch.empty(1, k, dtype=torch.int64, device=dev)
    op, board = ph._op(0), tr._board[parity]

    def launch(plan):
        header_kernel(ph, scratch, parity, op, plan, ph._pinned, board)
        kern.copy_ids_early(tr._win_ptr, scratch[o_offsets:o_offsets + w + 2], ids,
                            idx_off=tr._offs[parity]["idx_off"], fast=ph.fast, plan=plan)

    regions = (scratch[o_rank:o_rank + w], scratch[o_rank + w:])
    return ph._program(key, launch, regions + (ids,), ("epoch_delta", "cap"))


def dispatch_gather(ph, front, values, header, values2, ahead: GatherAhead, offsets: int,
                    epoch: int, flag: int, stream: int):
    """Front, gate, header, count read and gather of a planned dispatch of ``ph`` (its
    ``GdaPhases``) in one native call (``Program.run_dispatch``) on ``stream``, into outputs
    allocated ahead at ``ahead.cap`` rows. Returns
    (recv_x ``[N, H]``, recv_topk_idx ``[N, K]``, recv_topk_weights ``[N, K]``: views of
    them) when the gather ran, else None (counts that need the transport's checks, more
    rows than the capacity, a late peer: both phases ran, the caller gathers)."""
    tr = ph.tr
    prog = program(ph, ahead)
    cap, k, dev, gate = ahead.cap, ahead.k, tr.device, tr._gate
    recv_x = torch.empty(cap, tr.cfg.hidden, dtype=tr.cfg.dtype, device=dev)
    recv_idx = torch.empty(cap, k, dtype=torch.int64, device=dev)
    recv_w = torch.empty(cap, k, dtype=torch.float32, device=dev)
    record = kern.wait_record(epoch, "dispatch")
    status, sync_s, gate_s = front.run_dispatch(
        values, header, values2, prog,
        (offsets, recv_x.data_ptr(), recv_idx.data_ptr(), recv_w.data_ptr(), cap,
         min(cap, tr.num_programs)), stream, gate.address if gate is not None else 0,
        tr.world_size, tr.rank, record, GATE_SPIN_NS, flag, record, ph._flag_wait_ns,
        ahead.shape_addr, ahead.rows_addr)
    tr.blocked_s += gate_s + sync_s
    if status == RAN:
        n = ahead.rows.value
        ahead.fit(n)
        return recv_x[:n], recv_idx[:n], recv_w[:n]
    if status == GATE_LATE:
        tr._await_peers(epoch, "dispatch")  # published already; raises on a deadline
        tr.blocked_s += ph._run_wait(header, values2, stream, flag, epoch, "dispatch")
    elif status == FLAG_LATE:
        tr._device_late(epoch, "dispatch", ph._flag_wait_ns * 1e-9)  # raises
    return None


def record_plan(ph, parity: int, t: int, k: int, x) -> None:
    """Records the plan of ``GdaPhases.dispatch_head`` (``ph``) for this shape once both of its
    programs are bound (by the call that just ran through the phase methods)."""
    tr = ph.tr
    front = ph._progs.get(("front", parity, t, k, x.dtype, x.stride(0), x.shape[1]))
    header = ph._progs.get(("header", parity))
    if front is None or header is None or ph._host is None:
        return
    w, num_local = tr.world_size, tr.cfg.num_local_experts
    _, _, _, o_rank, o_slot, o_send, _, words = kern._layout_offsets(
        t, tr.cfg.num_experts, w, k)
    n_info = 1 + w * (2 + num_local) + w + num_local
    hidden = tr.cfg.hidden
    # the gather program's variables: 4 addresses, the row count (the early gather's: the
    # rows the outputs hold), the grid (see gather)
    early = int(tr.gather_early)
    ahead = GatherAhead(("gather_early" if early else "gather", parity, k, hidden, tr.cfg.dtype),
                        hidden * tr.cfg.dtype.itemsize + 12 * k, k,
                        (w, 2 + num_local, num_local, tr.cfg.max_tokens_per_rank, k, 0,
                         tr.num_programs, 4, 5, n_info, early))
    ph._plans[("dispatch", parity, t, k, x.dtype, x.stride(0), x.shape[1])] = (
        front, header, words + ph.header_words(), o_slot, o_send, o_rank, words,
        words + kern._even(n_info), n_info, ahead)


def head_tail(ph, scratch, t: int, plan, got=None):
    """``GdaPhases.dispatch_head``'s result (``ph``: the phases) of a planned dispatch whose
    header ran (the counts are in the page-locked buffer): ``got`` the native gather's outputs,
    or None (the transport checks the counts and gathers)."""
    w, num_local = ph.tr.world_size, ph.tr.cfg.num_local_experts
    o_slot, o_send, o_offsets, n_info = plan[3], plan[4], plan[7], plan[8]
    buf_ptr, view = ph._host
    tokens_per_expert = torch.empty(num_local, dtype=torch.int64)
    ctypes.memmove(tokens_per_expert.data_ptr(), buf_ptr + 8 * (n_info - num_local),
                   8 * num_local)
    slot = scratch.as_strided((t, w), (w, 1), o_slot)
    offsets = scratch.as_strided((w + 1,), (1,), o_offsets)
    if got is not None:
        end = 1 + w * (2 + num_local)
        got += (view[end:end + w].tolist(), view[2:end:2 + num_local].tolist(), None)
        return scratch, slot, o_send, None, tokens_per_expert, offsets, got
    return scratch, slot, o_send, view.tolist(), tokens_per_expert, offsets, None
