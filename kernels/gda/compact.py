"""A ``gda`` regular dispatch that stores its rows compact in the receivers' windows (option
``rows_in_window``): no gather copy; the received rows are returned as views of the window.
With ``rows_in_window=auto`` every regular dispatch starts here (:func:`planned_dispatch`):
the way is chosen per call from the sizes the ranks posted on the launch gate, inside the C++
call once the way is planned for the shape.

Two ops (kernels and protocol: :mod:`.compact_kernels`): the counts op (routing layout, every
rank's row counts and the headers its stores will carry into every rank's board, the launch
gate) and the rows op (one program waits for the counts, sums those of the ranks before this
one and hands the host the announced headers, then the stores at those rows, the launch gate
and the header read, which checks the rows against what was announced). The one count read
waits for the count wait's word, not for the stores: the host builds the result and queues
the caller's next kernels while the rows are still moving. Its count checks and handle are a
regular dispatch's, so combine, weight combine and cached dispatch take the handle unchanged.
A source that then stores other rows than it announced, or elsewhere, is raised by the
transport's next count read or error check (``ProtocolError`` naming it; the transport is
broken): the stores stay inside the window whatever the peers write. A shape's first call runs
here phase by phase (binding its programs); later calls of it run whole in one C++ call
(``efa_gda_op.cpp``, ``dispatch_compact``) with ``fast_launch=4``.

Lifetime: ``recv_x`` ``[N, H]`` and ``recv_topk_weights`` ``[N, K]`` are views of this rank's
window, complete in the order of the caller's stream (the header read precedes what the caller
queues next), overwritten once the peers run this transport's second op after this dispatch, which
they reach only after this rank issued its next op: read them (copy what must outlive that)
before the next call of the transport. ``recv_topk_idx`` is a copy (the handle keeps it for the
backward's weight combine); in the C++ call the header's program makes it on the device
(:func:`~.gather_ahead.ids_header_program`) when the rows fit the room sized by the shape's
recent calls, else the driver copies after the count read.
"""
from __future__ import annotations

import ctypes

import torch

from ..base import STATUS_BAD_INPUT
from ..native_launch import FLAG_LATE, GATE_LATE, RAN, NativeLaunchError
from . import cpp_op, gather_ahead
from .cpp_op import (
    COUNTS_GATE_LATE, NOT_PLANNED, OTHER_WAY, OTHER_WAY_STATUS, CppPlan, planned_result,
)
from .gate import GATE_SPIN_NS, KIND_OF
from .phases import MAX_PROGRAMS, _aligned, _stream

# A plan's constants, in the order of the K_* fields of efa_gda_op.cpp.
COMPACT_FIELDS = ("fn", "counts", "rows", "header", "gate", "gate_fn", "run", "world", "rank",
                  "spin_ns", "flag", "wait_ns", "shape", "rows_out", "words", "o_slot", "o_send",
                  "o_rank", "o_out", "o_offsets", "n_info", "num_local", "hidden", "topk",
                  "tokens", "data_off", "idx_off", "w_off", "copy", "ids_rows", "header_ids")


# the wait records of a compact dispatch's two ops (gate.wait_record, inline on the hot path)
_COUNTS_KIND, _DISPATCH_KIND = KIND_OF["dispatch counts"], KIND_OF["dispatch"]


def _scratch_layout(tr, t: int, k: int):
    """(total int64 words, o_slot, o_send, o_rank, o_dst, o_out, o_offsets, n_info) of a compact
    dispatch's scratch: the layout's words, the destinations' first rows ``[W]``, then the
    header read's words (at the end, where ``GdaPhases.header`` finds them)."""
    kern, w, num_local = tr._kern, tr.world_size, tr.cfg.num_local_experts
    _, _, _, o_rank, o_slot, o_send, _, words = kern._layout_offsets(t, tr.cfg.num_experts, w, k)
    n_info = 1 + w * (2 + num_local) + w + num_local
    o_out = words + kern._even(w)
    return (o_out + tr._phases.header_words(), o_slot, o_send, o_rank, words, o_out,
            o_out + kern._even(n_info), n_info)


def dispatch(tr, x, topk_idx, topk_weights, error):
    """The regular dispatch of transport ``tr`` with compact rows (see the module), phase by
    phase: ``x`` ``[T, H]``, ``topk_idx`` ``[T, K]`` int64 and ``topk_weights`` ``[T, K]``
    float32 on its device, contiguous; ``error``: this rank's refusal of its own input (the
    inputs are then empty and the op announces bad input). Returns what
    ``GdaTransport.dispatch`` returns."""
    ph, cfg, w, kern = tr._phases, tr.cfg, tr.world_size, tr._kern
    t, k = topk_idx.shape
    bad = None if error is None else STATUS_BAD_INPUT
    epoch_c = tr._begin_op("dispatch counts")
    epoch = tr._begin_op("dispatch")
    if error is not None and tr._gate is not None:
        tr._gate.post_text(epoch, error)  # before publishing: peers read it later
    pc = epoch_c % 2
    if len(ph._progs) >= MAX_PROGRAMS:  # token counts that keep changing (see dispatch_head)
        ph._progs.clear()
        ph._plans.clear()
    scratch = torch.empty(_scratch_layout(tr, t, k)[0], dtype=torch.int64, device=tr.device)
    op_c = ph._op(epoch_c)

    def counts(plan):
        status = kern.layout(topk_idx, topk_weights, cfg.num_experts, w, fast=ph.fast,
                             scratch=scratch, plan=plan)[4]
        if bad is not None:
            status.fill_(bad)
        _, _, npr, npe, st = kern.layout_views(scratch, t, cfg.num_experts, w, k)
        kern.publish_counts(npr, npe, st, tr._buf_ptrs, tr._sig_ptrs,
                            board_off=tr._offs[pc]["board_off"], me=tr.rank,
                            num_local=cfg.num_local_experts, **op_c, plan=plan)

    native = ph.native and bad is None and t and _aligned(x, topk_idx, topk_weights)
    shape = (t, k, x.dtype, x.stride(0), x.shape[1])
    prog_c = None
    if native:
        prog_c = ph._program(("compact_counts", pc) + shape, counts,
                             (topk_idx, topk_weights, scratch))
    if prog_c is None:
        counts(None)
    else:
        prog_c.run((topk_idx.data_ptr(), topk_weights.data_ptr(), scratch.data_ptr(),
                    op_c["epoch"]), _stream(ph._dev))
    tr._issued(epoch_c, "dispatch counts")  # the launch gate: every rank published its counts
    return _rows_op(tr, x, topk_idx, topk_weights, scratch, epoch_c, error, native, prog_c)


def _rows_op(tr, x, topk_idx, topk_weights, scratch, epoch_c: int, error, native=False,
             prog_c=None):
    """The rows op (number ``epoch_c + 1``) of a compact dispatch whose counts op ran and
    passed its gate: the count wait and the stores, the gate, the header read, the checked
    receive. ``scratch``: the counts op's. Returns what ``GdaTransport.dispatch`` returns."""
    ph, cfg, w, kern = tr._phases, tr.cfg, tr.world_size, tr._kern
    t, k = topk_idx.shape
    epoch = epoch_c + 1
    pc, p = epoch_c % 2, epoch % 2
    _, o_slot, o_send, _, o_dst, o_out, _, n_info = _scratch_layout(tr, t, k)
    op_c, op = ph._op(epoch_c), ph._op(epoch)
    if ph.native:  # the header's count read waits for the word the count wait writes last
        ph._host_info(n_info)

    def rows(plan):
        slot, _, npr, npe, status = kern.layout_views(scratch, t, cfg.num_experts, w, k)
        kern.count_wait(tr._my_sig, tr._err, tr._board[pc], scratch[o_dst:o_dst + w], npr,
                        scratch[o_out:], me=tr.rank, t_max=cfg.max_tokens_per_rank,
                        num_local=cfg.num_local_experts, **op_c, **tr._wait_kw,
                        host=ph._pinned if ph.native else None, plan=plan)
        kern.dispatch_store(x, topk_idx, topk_weights, slot, npr, npe, status, tr._buf_ptrs,
                            tr._sig_ptrs, tr._done[0:1], **tr._offs[p], me=tr.rank,
                            t_max=cfg.max_tokens_per_rank, num_local=cfg.num_local_experts,
                            **op, with_meta=True, num_programs=tr.num_programs, plan=plan,
                            dst_off=scratch[o_dst:o_dst + w])

    shape = (t, k, x.dtype, x.stride(0), x.shape[1])
    prog_r = None
    if native:
        prog_r = ph._program(("compact_rows", p) + shape, rows,
                             (x, topk_idx, topk_weights, scratch),
                             ("counts_epoch_delta", "epoch_delta"))
    first = None
    if prog_r is None:
        rows(None)
    else:
        first = (prog_r, (x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(),
                          scratch.data_ptr(), op_c["epoch"], op["epoch"]))
        if not ph.gated:  # launched here; the header passes the gate, then waits
            first[0].run(first[1], _stream(ph._dev))
            first = None
    vals, tokens_per_expert, offsets, blocked = ph.header(scratch, epoch, first, tr._board[p])
    tr.blocked_s += blocked
    if prog_c is not None and prog_r is not None:
        _record_plan(tr, p, shape, prog_c, prog_r)
    slot = scratch.as_strided((t, w), (w, 1), o_slot)
    head = scratch, slot, o_send, vals, tokens_per_expert, offsets, None
    return tr.dispatch_tail(x, topk_idx, topk_weights, epoch, head, error)


def _record_plan(tr, parity: int, shape, prog_c, prog_r) -> None:
    """Records the C++ plan of this shape's compact dispatch (rows op of ``parity``) once its
    programs and header are bound and the C++ extension is loaded."""
    ph = tr._phases
    header = ph._progs.get(("header_compact", parity))
    key = ("compact", parity) + shape
    if (header is None or ph._host is None or ph.cpp is None or key in ph._plans
            or getattr(ph.cpp, "COMPACT_FIELDS", None) != len(COMPACT_FIELDS)):
        return
    t, k = shape[0], shape[1]
    w, num_local = tr.world_size, tr.cfg.num_local_experts
    words, o_slot, o_send, o_rank, _, o_out, o_offsets, n_info = _scratch_layout(tr, t, k)
    # efa_launch_dispatch's shape block: capacity 0, so it reads and checks the counts only
    block = (ctypes.c_int64 * 11)(w, 2 + num_local, num_local, tr.cfg.max_tokens_per_rank, k, 0,
                                  tr.num_programs, 4, 5, n_info, 0)
    rows_out = ctypes.c_int64(-1)
    lib, gate, offs = prog_r._lib, tr._gate, tr._offs[parity]
    # the header with the ids' copy, which the C++ call runs instead when they fit its room
    ids_header = gather_ahead.ids_header_program(ph, parity, k)
    plan = CppPlan(
        COMPACT_FIELDS, fn=ctypes.cast(lib.efa_launch_dispatch, ctypes.c_void_p).value,
        counts=prog_c._addr, rows=prog_r._addr, header=header._addr,
        gate=gate.address if gate is not None else 0,
        gate_fn=ctypes.cast(lib.efa_gate_publish_wait, ctypes.c_void_p).value,
        run=ctypes.cast(lib["efa_launch_run"], ctypes.c_void_p).value, world=w, rank=tr.rank,
        spin_ns=GATE_SPIN_NS, flag=ph._host[0] + 8 * n_info, wait_ns=ph._flag_wait_ns,
        shape=ctypes.addressof(block), rows_out=ctypes.addressof(rows_out), words=words,
        o_slot=o_slot, o_send=o_send, o_rank=o_rank, o_out=o_out, o_offsets=o_offsets,
        n_info=n_info, num_local=num_local, hidden=tr.cfg.hidden, topk=k, tokens=t,
        data_off=offs["data_off"], idx_off=offs["idx_off"], w_off=offs["w_off"],
        copy=ctypes.cast(lib.efa_launch_copy, ctypes.c_void_p).value,
        ids_rows=0,  # (the C++ call sizes the room for the received ids from then on)
        header_ids=ids_header._addr if ids_header is not None else 0)
    ph._plans[key] = (plan, block, rows_out, prog_c, prog_r, ids_header, header)


def dispatch_planned(tr, x, topk_idx, topk_weights, choice: int = 0):
    """A compact dispatch of a shape seen before (its C++ plan recorded) in one C++ call, before
    the transport's own input checks (the call checks that the inputs are the plan's case).
    Returns what ``GdaTransport.dispatch`` returns, or None when not that case (nothing ran;
    the checked path takes it). ``choice``: see ``cpp_op.dispatch_planned`` (here
    ``OTHER_WAY`` when the C++ call chose the regular way)."""
    ph = tr._phases
    if tr._capturing or tr._broken is not None or ph.cpp is None:
        return None
    epoch_c = tr._epoch + 1
    epoch = epoch_c + 1
    try:
        key = ("compact", epoch & 1, *topk_idx.shape, x.dtype, x.stride(0), x.shape[1])
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None  # not tensors of two dimensions
    found = ph._plans.get(key)
    if found is None or epoch >= 2**31 - 1 or torch.cuda.is_current_stream_capturing():
        return None
    plan, header = found[0], found[-1]
    base = tr._dev_base
    res = ph.cpp.dispatch_compact(x, topk_idx, topk_weights, tr._buf, plan.address,
                                  epoch_c - base, epoch - base, epoch_c * 8 + _COUNTS_KIND,
                                  epoch * 8 + _DISPATCH_KIND, _stream(ph._dev),
                                  ph._cpp_device, choice)
    status = res[0]
    if status == NOT_PLANNED:
        return None
    if status == OTHER_WAY_STATUS:
        return OTHER_WAY
    tr._epoch = epoch_c
    if status == COUNTS_GATE_LATE:  # the counts are out: wait for the peers', then go on
        tr.blocked_s += res[1] * 1e-9
        tr._await_peers(epoch_c, "dispatch counts")
        tr._begin_op("dispatch")  # (the rows op's number, epoch)
        return _rows_op(tr, x, topk_idx, topk_weights, res[2], epoch_c, None, native=True)
    tr._epoch = epoch
    if status < 0:
        raise NativeLaunchError(res[4])
    tr.blocked_s += (res[1] + res[2]) * 1e-9
    if status == RAN:
        return planned_result(tr, res, epoch, x, topk_idx)
    scratch = res[3]
    t, k = key[2], key[3]
    _, o_slot, o_send, o_rank, _, o_out, o_offsets, n_info = _scratch_layout(tr, t, k)
    if status == GATE_LATE:  # the rows are stored and published: wait, then the header
        sp = scratch.data_ptr()
        tr._await_peers(epoch, "dispatch")
        tr.blocked_s += ph._run_wait(header, (sp + 8 * o_rank, sp + 8 * o_out, epoch - base),
                                     _stream(ph._dev), ph._host[0] + 8 * n_info, epoch,
                                     "dispatch")
    elif status == FLAG_LATE:
        tr._device_late(epoch, "dispatch", ph._flag_wait_ns * 1e-9)  # raises
    # counts the native check refused: the transport's checks name the problem
    w, num_local = tr.world_size, tr.cfg.num_local_experts
    buf_ptr, view = ph._host
    tokens_per_expert = torch.empty(num_local, dtype=torch.int64)
    ctypes.memmove(tokens_per_expert.data_ptr(), buf_ptr + 8 * (n_info - num_local),
                   8 * num_local)
    head = (scratch, scratch.as_strided((t, w), (w, 1), o_slot), o_send, view.tolist(),
            tokens_per_expert, scratch.as_strided((w + 1,), (1,), o_offsets), None)
    return tr.dispatch_tail(x, topk_idx, topk_weights, epoch, head)


def compact_now(tr, topk_idx) -> bool:
    """``rows_in_window=auto`` in Python: whether this regular dispatch of transport ``tr``
    stores its rows compact, the same answer on every rank: posts this dispatch's size on the
    launch gate, then answers from the largest size the ranks posted for the previous one (see
    :class:`~efa_ep.kernels.gda.gate.LaunchGate`; without the gate: never). Size = rows to send
    at most, ``T * min(W, K)``."""
    gate = tr._gate
    if gate is None:
        return False
    try:
        t, k = topk_idx.shape
    except (AttributeError, TypeError, ValueError):  # refused input: it sends no rows
        t = k = 0
    w = tr.world_size
    # (a rank that finds another dispatch's size stores as usual; if its peers do not,
    # the gate raises the disagreement as a ProtocolError on every rank)
    return gate.next_dispatch(t * (k if k < w else w)) >= tr._compact_rows


def _planned(tr, x, topk_idx, topk_weights, choice: int):
    """The C++ call of transport ``tr``'s way (``rows_in_window``) for this dispatch when its
    shape is planned (``choice``: the gate's choice block, or 0); see :func:`planned_dispatch`."""
    if tr.rows_in_window:
        return dispatch_planned(tr, x, topk_idx, topk_weights, choice)
    return cpp_op.dispatch_planned(tr._phases, x, topk_idx, topk_weights, choice)


def planned_dispatch(tr, x, topk_idx, topk_weights):
    """The start of every regular dispatch of transport ``tr``: with ``rows_in_window=auto``
    the way is chosen (``tr.rows_in_window`` set: compact or not) and, for a shape seen before
    with its inputs as then, the dispatch runs whole in that way's C++ call. Returns what
    ``GdaTransport.dispatch`` returns, or None (nothing ran: the checked path takes the call).

    The size is posted once per dispatch: by the C++ call of the way the last dispatch took
    when it is planned (it chooses first; ``OTHER_WAY``: nothing ran, then the other way's
    call runs as chosen), else here (:func:`compact_now`), then the chosen way's C++ call."""
    choice = tr._choice
    posted = tr._gate.dispatches_posted if choice else 0
    out = None
    if tr._phases.cpp is not None:
        out = _planned(tr, x, topk_idx, topk_weights, choice)
        if out is OTHER_WAY:
            tr.rows_in_window = not tr.rows_in_window
            out = _planned(tr, x, topk_idx, topk_weights, 0)
    if choice and tr._gate.dispatches_posted == posted:  # no C++ call chose: choose here
        way = compact_now(tr, topk_idx)
        if way != tr.rows_in_window:
            tr.rows_in_window = way
            if tr._phases.cpp is not None:
                out = _planned(tr, x, topk_idx, topk_weights, 0)
    return out
