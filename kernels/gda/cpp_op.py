"""Planned ``gda`` ops as one C++ call each (``kernels/native/efa_gda_op.cpp``).

With ``fast_launch=4`` (the default) a regular dispatch whose plan gathers ahead
(:mod:`.gather_ahead`) makes its tensors in C++ (the scratch and the outputs carved out of one
allocation, their views, ``tokens_per_expert``) and writes its programs' variables there, then
makes the same native call as the Python path (``efa_launch_dispatch``); a planned combine,
weight combine or cached dispatch likewise allocates its output and writes both programs'
variables, then makes the gated native call (``efa_launch_run_gated``); a planned
fixed-capacity dispatch (:mod:`.fixed`) allocates its layout and device counts at once and
makes that gated call over its front and header, and a cached dispatch along its handle over
its store and wait. Same kernels with the same arguments, so the same results.

A call whose shape has such a plan goes from the transport's method straight to C++
(``GdaPhases.dispatch_planned``, ``combine_planned``, ``cached_planned``): the C++ call first
checks that the inputs are the case the plan was bound for (dimensions, dtypes, dense rows,
the handle's row counts, the device, 16-byte alignment) and otherwise returns
:data:`NOT_PLANNED` having run nothing; the transport's checked path then takes the call, so
every input error keeps its message. The extension is built once per install with torch's
extension builder, which needs a C++ compiler and ``ninja`` (``pip install ninja``); where it
cannot be built, :func:`availability` says why, the transport warns once and runs as
``fast_launch=3`` (``GdaTransport.cpp_dispatch_off`` names it).
"""
from __future__ import annotations

import ctypes
import warnings
from typing import Optional

import torch

from . import gather_ahead
from .gate import GATE_SPIN_NS, KIND_OF, wait_record
from .window import GdaDispatchState
from .. import cpp_ext
from ..base import DispatchHandle
from ..core.handles import frozen_with
from ..native_launch import FLAG_LATE, GATE_LATE, RAN, NativeLaunchError

# The plan's constants, in the order of the P_* fields of efa_gda_op.cpp.
PLAN_FIELDS = ("fn", "front", "header", "gather", "gate", "world", "rank", "spin_ns", "flag",
               "wait_ns", "shape", "rows", "words", "o_slot", "o_send", "o_rank", "o_out",
               "o_offsets", "n_info", "num_local", "hidden", "topk", "tokens", "run", "merged")
# A combine plan's constants, in the order of the C_* fields of efa_gda_op.cpp.
COMBINE_FIELDS = ("fn", "store", "reduce", "gate", "world", "rank", "spin_ns", "max_grid",
                  "fixed_rows")
# A fixed-capacity dispatch plan's constants, in the order of the F_* fields of efa_gda_op.cpp.
FIXED_FIELDS = ("fn", "front", "header", "gate", "world", "rank", "spin_ns", "words", "o_slot",
                "o_send", "num_local", "hidden", "topk", "tokens", "t_max")
# A fixed handle's cached dispatch plan, in the order of the FC_* fields of efa_gda_op.cpp.
FIXED_CACHED_FIELDS = ("fn", "store", "wait", "gate", "world", "rank", "spin_ns", "rows")

def _stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


_warned = False
# efa_gda_op.cpp's status of a dispatch whose inputs are not its plan's case (nothing ran)
NOT_PLANNED = 100
# its status of a dispatch for which rows_in_window=auto chose the other way than the plan's
# (nothing ran, the size posted); the planned calls then return OTHER_WAY
OTHER_WAY_STATUS = 102
OTHER_WAY = object()
# its status of a compact dispatch whose counts op ran but whose peers were late at its launch
# gate (the caller waits for them, then runs the rows op)
COUNTS_GATE_LATE = 101


def load():
    """The built extension module (built once per source, into the package's cache folder).
    Raises RuntimeError naming what is missing."""
    return cpp_ext.load("efa_gda_op.cpp", "gda's C++ dispatch", {
        "PLAN_FIELDS": len(PLAN_FIELDS), "COMBINE_FIELDS": len(COMBINE_FIELDS),
        "FIXED_FIELDS": len(FIXED_FIELDS), "FIXED_CACHED_FIELDS": len(FIXED_CACHED_FIELDS),
        "NOT_PLANNED": NOT_PLANNED, "OTHER_WAY": OTHER_WAY_STATUS,
        "COUNTS_GATE_LATE": COUNTS_GATE_LATE})


def warn_off(why: str) -> None:
    """Warns once per process that the C++ dispatch (the default) is off, and why."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"gda: {why}; a repeated regular dispatch runs through Python instead "
                      f"(as fast_launch=3: same results, more host time per call)", stacklevel=3)


def availability() -> Optional[str]:
    """None when the C++ dispatch can run here, else why not."""
    try:
        load()
    except RuntimeError as e:
        return str(e)
    return None


class CppPlan:
    """The constants of one plan (an int64 array the C++ call reads by address), in the order
    of ``names``: :data:`PLAN_FIELDS` for :func:`dispatch` (the native library's entry, the
    three programs, the launch gate, the completion word, the shape block and the scratch
    layout), :data:`COMBINE_FIELDS` for :func:`combine` (the entry, the two programs, the gate
    and the grid's bounds)."""

    __slots__ = ("values", "address")

    def __init__(self, names=PLAN_FIELDS, **fields):
        missing = set(names) - set(fields)
        if missing:
            raise ValueError(f"CppPlan lacks {sorted(missing)}")
        self.values = (ctypes.c_int64 * len(names))(*(int(fields[f]) for f in names))
        self.address = ctypes.addressof(self.values)


def combine_plan(ph, store, reduce, fixed: bool) -> CppPlan:
    """The constants of a combine plan of :class:`GdaPhases` ``ph`` over its bound ``store``
    and ``reduce`` programs (``fixed``: the store's grid covers max_tokens_per_rank rows)."""
    tr = ph.tr
    gate = tr._gate
    return CppPlan(COMBINE_FIELDS,
                   fn=ctypes.cast(store._lib.efa_launch_run_gated, ctypes.c_void_p).value,
                   store=store._addr, reduce=reduce._addr,
                   gate=gate.address if gate is not None else 0, world=tr.world_size,
                   rank=tr.rank, spin_ns=GATE_SPIN_NS, max_grid=ph.read_programs,
                   fixed_rows=tr.cfg.max_tokens_per_rank if fixed else 0)


def combine(ph, y, offsets, ids, slot, num_tokens: int, plan: CppPlan, reduce, epoch: int,
            kind: str, stream: int, num_rows: int = 0, device: int = -1):
    """A planned combine of ``y`` ``[N, D]`` into a new ``[num_tokens, D]`` tensor in one C++
    call: the store, the launch gate and the reduce (``reduce``: its program, run here when a
    peer was late at the gate, after the transport's wait). Returns the output. With
    ``device`` (as :func:`dispatch`'s) the call first checks that ``y`` is ``[num_rows, D]``
    with dense rows on that device, 16-byte aligned, and returns None when not (nothing ran,
    the op's number not taken)."""
    delta = epoch - ph.tr._dev_base
    res = ph.cpp.combine(y, offsets, ids, slot, num_tokens, plan.address, delta,
                         wait_record(epoch, kind), stream, num_rows, device)
    return _second_after_gate(ph, res, reduce, slot, num_tokens, epoch, kind, delta, stream)


def cached(ph, x, slot, offsets, num_rows: int, plan: CppPlan, gather, epoch: int, stream: int,
           num_tokens: int = 0, device: int = -1):
    """A planned cached dispatch of ``x`` ``[T, D]`` into a new ``[num_rows, D]`` tensor in one
    C++ call: the store, the launch gate and the gather (``gather``: its program, run here
    when a peer was late). Returns the output; with ``device``, None unless ``x`` is
    ``[num_tokens, D]`` as :func:`combine` checks ``y``."""
    delta = epoch - ph.tr._dev_base
    res = ph.cpp.cached(x, slot, offsets, num_rows, plan.address, delta,
                        wait_record(epoch, "cached dispatch"), stream, num_tokens, device)
    return _second_after_gate(ph, res, gather, offsets, num_rows, epoch, "cached dispatch",
                              delta, stream)


def _began(tr, res, epoch: int):
    """The status of a C++ call's result ``res``, or None when its inputs were not its plan's
    case (nothing ran). Otherwise op ``epoch`` began (the transport's number from now on,
    already so on the checked path); a library error raises."""
    status = res[0]
    if status == NOT_PLANNED:
        return None
    tr._epoch = epoch
    if status < 0:
        raise NativeLaunchError(res[4])
    return status


def _second_after_gate(ph, res, second, lead, rows: int, epoch: int, kind: str, delta: int,
                       stream: int):
    """The output of a C++ gated call's result ``res`` (None: its inputs were not the plan's
    case); when a peer was late at the gate, the transport's wait (deadline), then the
    ``second`` program with its variables (``lead``, the output, delta, ``rows``, grid)."""
    tr = ph.tr
    status = _began(tr, res, epoch)
    if status is None:
        return None
    out = res[3]
    tr.blocked_s += res[2] * 1e-9
    if status == GATE_LATE:  # the first program ran and is published: wait, then the second
        tr._await_peers(epoch, kind)
        second.run((lead.data_ptr(), out.data_ptr(), delta, rows, min(rows, ph.read_programs)),
                   stream)
    return out


def dispatch(ph, x, topk_idx, topk_weights, plan, epoch: int, stream: int, device: int = -1):
    """A planned regular dispatch in one C++ call, its outputs allocated ahead (or, at capacity
    0, after its count read; see the module); ``ph``: the transport's ``GdaPhases``, ``plan``:
    its bound dispatch plan for this shape, ``epoch``: the op's number. Returns what
    ``GdaPhases.dispatch_head`` returns (when the call did not gather, its header ran: the
    caller checks the counts and gathers). With ``device`` (the CUDA device index; -2: CPU
    tensors of the host-only stand-in) the C++ call first checks that the inputs are the
    plan's case (shapes, dtypes, dense rows, the device, 16-byte alignment) and returns None
    when not (nothing ran, the transport's op number is not taken); otherwise the op's number
    is the transport's from the call on."""
    tr = ph.tr
    front, header, words, o_slot, o_send, o_rank, o_out, o_offsets, n_info, ahead = plan
    w, t, num_local = tr.world_size, topk_idx.shape[0], tr.cfg.num_local_experts
    flag = ph._host[0] + 8 * n_info
    if ahead.cpp is None:
        gather = gather_ahead.program(ph, ahead)
        merged = gather_ahead.merged_program(ph, ahead) if ahead.shape[10] == 2 else None
        gate = tr._gate
        ahead.cpp = CppPlan(
            PLAN_FIELDS, fn=ctypes.cast(front._lib.efa_launch_dispatch, ctypes.c_void_p).value,
            front=front._addr, header=header._addr, gather=gather._addr,
            gate=gate.address if gate is not None else 0, world=w, rank=tr.rank,
            spin_ns=GATE_SPIN_NS, flag=flag, wait_ns=ph._flag_wait_ns, shape=ahead.shape_addr,
            rows=ahead.rows_addr, words=words, o_slot=o_slot, o_send=o_send, o_rank=o_rank,
            o_out=o_out, o_offsets=o_offsets, n_info=n_info, num_local=num_local,
            hidden=tr.cfg.hidden, topk=ahead.k, tokens=t,
            run=ctypes.cast(front._lib["efa_launch_run"], ctypes.c_void_p).value,
            merged=merged._addr if merged is not None else 0)
    res = ph.cpp.dispatch(x, topk_idx, topk_weights, ahead.cpp.address, epoch - tr._dev_base,
                          wait_record(epoch, "dispatch"), stream, device, 0)
    status = _began(tr, res, epoch)
    if status is None:
        return None
    if status == RAN:
        tr.blocked_s += (res[1] + res[2]) * 1e-9
        recv_x, recv_idx, recv_w, slot, offsets, send_idx, tpe, num_send, num_recv = res[4:]
        ahead.fit(recv_x.shape[0])
        return (res[3], slot, o_send, None, tpe, offsets,
                (recv_x, recv_idx, recv_w, num_send, num_recv, send_idx))
    return _not_gathered(ph, res, plan, epoch, t)


def _not_gathered(ph, res, plan, epoch: int, t: int):
    """What ``GdaPhases.dispatch_head`` returns for a C++ dispatch result ``res`` (op
    ``epoch``, ``t`` tokens, dispatch plan ``plan``) whose status is not RAN: the header ran
    (after the transport's gate wait when a peer was late), the gather is left to the
    transport; a completion word that never came raises."""
    tr = ph.tr
    scratch = res[3]
    tr.blocked_s += (res[1] + res[2]) * 1e-9
    status = res[0]
    sp = scratch.data_ptr()
    o_rank, o_out, n_info = plan[5], plan[6], plan[8]
    if status == GATE_LATE:  # the front ran and is published: wait (deadline), then the header
        tr._await_peers(epoch, "dispatch")
        tr.blocked_s += ph._run_wait(plan[1], (sp + 8 * o_rank, sp + 8 * o_out,
                                               epoch - tr._dev_base), _stream(ph._dev),
                                     ph._host[0] + 8 * n_info, epoch, "dispatch")
    elif status == FLAG_LATE:
        tr._device_late(epoch, "dispatch", ph._flag_wait_ns * 1e-9)  # raises
    # counts the native check refused, more rows than allocated, a late peer: the header ran,
    # the caller checks the counts and gathers
    return gather_ahead.head_tail(ph, scratch, t, plan)


# ---- straight from the transport's methods ----------------------------------------------
_DISPATCH_KIND, _COMBINE_KIND = KIND_OF["dispatch"], KIND_OF["combine"]
_CACHED_KIND, _WEIGHT_KIND = KIND_OF["cached dispatch"], KIND_OF["weight combine"]


def _handle(x, topk_idx, recv_x, recv_idx, send_idx, num_send, num_recv, owner, slot, offsets,
            epoch):
    """The :class:`DispatchHandle` of a dispatch that gathered in its C++ call: the same frozen
    objects the transport makes, their fields set at once (:func:`frozen_with`)."""
    st = frozen_with(GdaDispatchState, {"owner": owner, "slot_TW": slot, "recv_offsets": offsets,
                                        "epoch": epoch, "fixed": False, "num_recv_W": None})
    return frozen_with(DispatchHandle, {
        "num_tokens": x.shape[0], "num_recv_tokens": recv_x.shape[0], "topk_idx": topk_idx,
        "send_token_idx": send_idx, "num_send_per_rank": num_send, "num_recv_per_rank": num_recv,
        "recv_topk_idx": recv_idx, "state": st})


def dispatch_planned(ph, x, topk_idx, topk_weights, choice: int = 0):
    """A regular dispatch of ``GdaPhases`` ``ph`` straight to the C++ call, before the
    transport's own input checks: when its shape has a plan that gathers ahead and the C++
    call finds the inputs the plan's case (see :func:`dispatch`). Returns what
    ``GdaTransport.dispatch`` returns (the outputs and the handle; when the call did not gather,
    the transport's :meth:`~GdaTransport.dispatch_tail` checked the counts and gathered), or
    None when the call is not that case (nothing ran; the transport's checked path takes it
    and names any problem). ``choice``: with ``rows_in_window=auto`` the launch gate's choice
    block, and then :data:`OTHER_WAY` when the C++ call chose compact rows (nothing ran)."""
    tr = ph.tr
    if tr._capturing or tr._broken is not None:
        return None
    epoch = tr._epoch + 1
    try:
        key = ("dispatch", epoch & 1, *topk_idx.shape, x.dtype, x.stride(0), x.shape[1])
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None  # not tensors of two dimensions
    plan = ph._plans.get(key)
    if plan is None:
        return None
    ahead = plan[-1]
    if ahead.cpp is None or epoch >= 2**31 - 1 or torch.cuda.is_current_stream_capturing():
        return None  # (while capturing the checked path raises, naming the capture)
    res = ph.cpp.dispatch(x, topk_idx, topk_weights, ahead.cpp.address, epoch - tr._dev_base,
                          epoch * 8 + _DISPATCH_KIND, _stream(ph._dev), ph._cpp_device, choice)
    status = res[0]
    if status != RAN:
        if status == NOT_PLANNED:
            return None
        if status == OTHER_WAY_STATUS:
            return OTHER_WAY
        tr._epoch = epoch
        if status < 0:
            raise NativeLaunchError(res[4])
        ph._ahead = ahead  # the transport gathers, then sizes the next calls' outputs
        head = _not_gathered(ph, res, plan, epoch, key[2])
        return tr.dispatch_tail(x, topk_idx, topk_weights, epoch, head)
    tr._epoch = epoch
    tr.blocked_s += (res[1] + res[2]) * 1e-9
    n = res[4].shape[0]
    if n > ahead.cap or 4 * n < 3 * ahead.cap:  # (GatherAhead.fit's test: resize the outputs)
        ahead.fit(n)
    return planned_result(tr, res, epoch, x, topk_idx)


def planned_result(tr, res, epoch: int, x, topk_idx):
    """What ``GdaTransport.dispatch`` returns for a C++ dispatch result ``res`` of op
    ``epoch`` whose counts were clean (status RAN): the outputs and the handle, after the
    regular dispatch's bookkeeping of the id region's top-k width."""
    _, _, _, _, recv_x, recv_idx, recv_w, slot, offsets, send_idx, tpe, num_send, num_recv = res
    parity, k = epoch & 1, topk_idx.shape[1]
    if tr._idx_k[parity] != k:  # (GdaTransport._note_idx_width of a regular dispatch)
        tr._idx_k[parity] = k
        tr._idx_full[parity] = True
    tr._idx_epoch[parity] = epoch
    return recv_x, recv_idx, recv_w, tpe, _handle(x, topk_idx, recv_x, recv_idx, send_idx,
                                                  num_send, num_recv, tr.uid, slot, offsets,
                                                  epoch)


def _planned_op(ph, handle, fixed_ok: bool = False):
    """(the op's number, the handle's state) when a combine or cached dispatch along
    ``handle`` may go straight to its C++ call (``fast_launch=4``): the transport usable
    and not capturing, the handle one of this transport's regular dispatches (``fixed_ok``:
    or fixed-capacity ones); else None."""
    tr = ph.tr
    st = getattr(handle, "state", None)
    if (tr._capturing or tr._broken is not None or type(st) is not GdaDispatchState
            or st.owner != tr.uid or (st.fixed and not fixed_ok)
            or not isinstance(handle, DispatchHandle)
            or tr._epoch + 1 >= 2**31 - 1 or torch.cuda.is_current_stream_capturing()):
        return None
    return tr._epoch + 1, st


def _finished(ph, res, second, lead, rows: int, epoch: int, kind: str, stream: int,
              op: Optional[str] = None):
    """The output of op ``epoch`` from its C++ gated call's result ``res`` (as
    :func:`_second_after_gate`; None: its inputs were not the plan's case), after what
    ``GdaTransport._finish`` checks (a rank that refused the op, ``check_every_call``)."""
    status = res[0]
    tr = ph.tr
    if status == RAN:  # (the common case of _second_after_gate, inline)
        tr._epoch = epoch
        tr.blocked_s += res[2] * 1e-9
        out = res[3]
    elif status == NOT_PLANNED:
        return None
    else:
        out = _second_after_gate(ph, res, second, lead, rows, epoch, kind,
                                 epoch - tr._dev_base, stream)
    gate = tr._gate
    if tr.check_every_call or (gate is not None and gate.bad_at(epoch)):
        return tr._finish(epoch, kind, out, op)
    return out


def combine_planned(ph, y, handle):
    """A combine of ``GdaPhases`` ``ph`` straight to its C++ call, before the transport's
    checks: when this shape has a plan and the call finds ``y`` the handle's rows, dense, on
    this device (see :func:`combine`). Returns the output, checked as the transport's
    ``_finish`` checks it, or None when not that case (nothing ran; the transport's checked
    path takes it and names any problem)."""
    op = _planned_op(ph, handle, fixed_ok=True)
    if op is None or not handle.num_tokens:
        return None
    epoch, st = op
    fixed = st.fixed  # (its store reads the device's row counts, its grid covers T_MAX rows)
    try:
        key = ("combine", epoch & 1, y.shape[1], y.dtype, y.stride(0), fixed, "combine", False)
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None
    plan = ph._plans.get(key)
    if plan is None or plan[2] is None:
        return None
    tr, stream, t = ph.tr, _stream(ph._dev), handle.num_tokens
    res = ph.cpp.combine(y, st.num_recv_W if fixed else st.recv_offsets, None, st.slot_TW, t,
                         plan[2].address, epoch - tr._dev_base, epoch * 8 + _COMBINE_KIND,
                         stream, handle.num_recv_tokens, ph._cpp_device)
    return _finished(ph, res, plan[1], st.slot_TW, t, epoch, "combine", stream)


def weight_combine_planned(ph, g, handle):
    """A weight combine of ``GdaPhases`` ``ph`` (``g``: ``[N, K]`` float32, the gradient of the
    received weights) straight to its C++ call, as :func:`combine_planned`; the handle's
    received ids go with it (the store returns the slots of experts elsewhere as 0). Returns
    the output or None."""
    op = _planned_op(ph, handle, fixed_ok=True)
    if op is None or not handle.num_tokens:
        return None
    epoch, st = op
    fixed = st.fixed
    if fixed and ph.tr._idx_epoch[st.epoch & 1] != st.epoch:
        return None  # its ids in the window were overwritten: the checked path refuses it
    try:
        if g.dtype != torch.float32:
            return None
        key = ("combine", epoch & 1, g.shape[1], g.dtype, g.stride(0), fixed, "weight combine",
               True)
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None
    plan = ph._plans.get(key)
    if plan is None or plan[2] is None:
        return None
    tr, stream, t = ph.tr, _stream(ph._dev), handle.num_tokens
    res = ph.cpp.combine(g, st.num_recv_W if fixed else st.recv_offsets, handle.recv_topk_idx,
                         st.slot_TW, t, plan[2].address, epoch - tr._dev_base,
                         epoch * 8 + _WEIGHT_KIND, stream, handle.num_recv_tokens,
                         ph._cpp_device)
    return _finished(ph, res, plan[1], st.slot_TW, t, epoch, "weight combine", stream)


def rows_key(kind: str, epoch: int, num_tokens: int, x) -> tuple:
    """The plan key of a cached dispatch (``kind``: ``"cached"`` or ``"cached_fixed"``) of rows
    like ``x`` for ``num_tokens`` tokens in op ``epoch``'s window parity: the calls that bind a
    plan and the calls that look it up build it here."""
    return (kind, epoch & 1, num_tokens, x.shape[1], x.dtype, x.stride(0))


def cached_planned(ph, x, handle):
    """A cached dispatch straight to its C++ call, as :func:`combine_planned` (``x``: the
    handle's tokens' rows). Returns the output or None."""
    op = _planned_op(ph, handle)
    if op is None or not handle.num_recv_tokens:
        return None
    epoch, st = op
    try:
        key = rows_key("cached", epoch, handle.num_tokens, x)
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None
    plan = ph._plans.get(key)
    if plan is None or plan[2] is None:
        return None
    tr, stream, n = ph.tr, _stream(ph._dev), handle.num_recv_tokens
    res = ph.cpp.cached(x, st.slot_TW, st.recv_offsets, n, plan[2].address,
                        epoch - tr._dev_base, epoch * 8 + _CACHED_KIND, stream,
                        handle.num_tokens, ph._cpp_device)
    return _finished(ph, res, plan[1], st.recv_offsets, n, epoch, "cached dispatch", stream,
                     "dispatch_cached")
