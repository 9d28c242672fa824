"""gda's fixed-capacity dispatch: no host sync, static launch grids, the window is the receive
buffer (what capacity mode and CUDA graph capture run).

Eager, its phases are two native programs run in one call with the launch gate between them
(the front: layout and stores; the fixed header: the wait for every source, the counts and the
unused rows marked), bound on the first call of a shape as the regular dispatch's are
(:class:`~.phases.GdaPhases`); inside a capture, or with bad input, or where programs cannot be
bound, the same kernels are launched from Python with the gate passed in Python. With
``fast_launch=4`` a shape whose programs are bound goes from the transport's method straight to
one C++ call (:func:`dispatch_planned`, ``efa_gda_op.cpp``'s ``dispatch_fixed``), which checks
that the inputs are the plan's case and otherwise leaves the call to the checked path.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from ..base import STATUS_BAD_INPUT, DispatchHandle, DispatchInputError
from ..core.handles import frozen_with
from ..native_launch import GATE_LATE, NativeLaunchError
from . import cpp_op, refusal
from . import phases as _phases
from .gate import GATE_SPIN_NS, KIND_OF
from .window import GdaDispatchState

_DISPATCH_KIND, _CACHED_KIND = KIND_OF["dispatch"], KIND_OF["cached dispatch"]

# the fixed header program's integer variables, after its tensors (num_recv, tokens_per_expert)
_HEADER_INTS = ("epoch_delta", "full")


def _regions(tr, parity: int, k: int):
    """This parity's receive regions as flat typed views of the window, made once per (parity,
    top-k): rows ``[W * T_MAX * H]`` cfg.dtype, ids ``[W * T_MAX * K]`` int64, weights
    ``[W * T_MAX * K]`` float32 (callers get fresh ``view``s of them: a tensor returned twice
    would carry the autograd history of its last use)."""
    key = (parity, k)
    got = tr._fixed_regions.get(key)
    if got is None:
        offs, rows = tr._offs[parity], tr.world_size * tr.cfg.max_tokens_per_rank
        got = (tr._region(offs["data_off"], rows * tr.cfg.hidden * tr._elem, tr.cfg.dtype),
               tr._region(offs["idx_off"], rows * k * 8, torch.int64),
               tr._region(offs["w_off"], rows * k * 4, torch.float32))
        tr._fixed_regions[key] = got
    return got


def dispatch(tr, x, topk_idx, topk_weights):
    """``GdaTransport.dispatch_fixed`` of ``tr`` (its docstring has the contract): returns
    (recv_x ``[W * T_MAX, H]``, recv_topk_idx ``[W * T_MAX, K]`` int64, recv_topk_weights
    ``[W * T_MAX, K]`` float32: views of the window; num_recv ``[W]`` and tokens_per_expert
    ``[L]`` int64 on the device; the handle). All work on the current stream, no host sync."""
    kern, cfg, world = tr._kern, tr.cfg, tr.world_size
    ph = tr._phases
    if ph.cpp is not None:  # a shape seen before, its inputs as then: one C++ call
        out = dispatch_planned(tr, x, topk_idx, topk_weights)
        if out is not None:
            return out
    error = tr._host_check(x, topk_idx, topk_weights)
    epoch = tr._begin_op("dispatch")
    parity = epoch % 2
    if error is not None:  # take part with no rows and a bad status (see dispatch)
        x = torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=tr.device)
        topk_idx = torch.empty(0, topk_idx.shape[1] if topk_idx.dim() == 2 else 1,
                               dtype=torch.int64, device=tr.device)
        topk_weights = torch.empty(0, topk_idx.shape[1], dtype=torch.float32, device=tr.device)
    x = x.contiguous() if x.stride(-1) != 1 else x
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
    k = topk_idx.shape[1]
    # the gate in the native call: not inside a capture, whose replays issue every op at once
    native = error is None and not tr._capturing
    front = ph.front(x, topk_idx, topk_weights, epoch,
                     None if error is None else STATUS_BAD_INPUT, defer=native)
    slot, send_idx = front[1], front[2]
    first = front[3] if native else None  # (program, values) to run with the gate, or None
    full = tr._note_idx_width(parity, k)
    rows = world * cfg.max_tokens_per_rank
    num_recv = torch.empty(world, dtype=torch.int64, device=tr.device)
    tokens_per_expert = torch.empty(cfg.num_local_experts, dtype=torch.int64, device=tr.device)
    data, idx_region, w_region = _regions(tr, parity, k)
    op = ph._op(epoch)

    def launch(plan):
        kern.recv_header_fixed(tr._my_sig, tr._hdr[parity], tr._err, tr._hw[parity], num_recv,
                               tokens_per_expert, idx_region, w_region, num_topk=k,
                               t_max=cfg.max_tokens_per_rank, **op, full=full, kind="dispatch",
                               **tr._wait_kw, plan=plan)

    prog = (ph._program(("header_fixed", parity, k), launch, (num_recv, tokens_per_expert),
                        _HEADER_INTS) if native and ph.native else None)
    if prog is None:
        ph._then(first, epoch, "dispatch")
        launch(None)
    else:
        values = (num_recv.data_ptr(), tokens_per_expert.data_ptr(), op["epoch"], int(full))
        if first is not None:
            ph._gated(first, prog, values, epoch, "dispatch")
            if ph.cpp is not None:
                _record_plan(tr, x, topk_idx, first[0], prog, front[0].numel())
        else:
            ph._then(None, epoch, "dispatch")
            prog.run(values, _phases._stream(ph._dev))
    if error is not None:
        raise DispatchInputError(error)
    recv_idx, recv_w = idx_region.view(rows, k), w_region.view(rows, k)
    handle = DispatchHandle(
        num_tokens=x.shape[0], num_recv_tokens=rows, topk_idx=topk_idx,
        send_token_idx=send_idx, num_send_per_rank=(), num_recv_per_rank=(),
        recv_topk_idx=recv_idx,
        state=GdaDispatchState(owner=tr.uid, slot_TW=slot, recv_offsets=None, epoch=epoch,
                               fixed=True, num_recv_W=num_recv))
    return data.view(rows, cfg.hidden), recv_idx, recv_w, num_recv, tokens_per_expert, handle


def _record_plan(tr, x, topk_idx, front, header, words: int) -> None:
    """Records the C++ plan of this shape's fixed dispatch (``front`` and ``header``: its bound
    programs; ``words``: the scratch's int64 elements) for :func:`dispatch_planned`."""
    ph, parity = tr._phases, tr._epoch & 1
    t, k = topk_idx.shape
    key = ("fixed", parity, t, k, x.dtype, x.stride(0), x.shape[1])
    if key in ph._plans:
        return
    o_slot, o_send = tr._kern._layout_offsets(t, tr.cfg.num_experts, tr.world_size, k)[4:6]
    gate = tr._gate
    ph._plans[key] = (header, cpp_op.CppPlan(
        cpp_op.FIXED_FIELDS,
        fn=ctypes.cast(front._lib.efa_launch_run_gated, ctypes.c_void_p).value,
        front=front._addr, header=header._addr, gate=gate.address if gate is not None else 0,
        world=tr.world_size, rank=tr.rank, spin_ns=GATE_SPIN_NS, words=words, o_slot=o_slot,
        o_send=o_send, num_local=tr.cfg.num_local_experts, hidden=x.shape[1], topk=k, tokens=t,
        t_max=tr.cfg.max_tokens_per_rank))


def _taken(tr, res, epoch: int) -> Optional[int]:
    """The status of a planned C++ call's result ``res`` (status, gate wait ns, ...) for op
    ``epoch``: None when its inputs were not the plan's case (nothing ran, the op's number not
    taken); else the op's number is taken and its gate wait counted, and a launch failure
    raises."""
    status = res[0]
    if status == cpp_op.NOT_PLANNED:
        return None
    tr._epoch = epoch
    tr.blocked_s += res[1] * 1e-9
    if status < 0:
        raise NativeLaunchError(res[2])
    return status


def dispatch_planned(tr, x, topk_idx, topk_weights):
    """A fixed-capacity dispatch of ``tr`` straight to its C++ call, before the transport's
    checks: when this shape has a plan (its programs bound by an earlier call) and the call
    finds the inputs the plan's case. Returns what :func:`dispatch` returns, or None when not
    that case (nothing ran, the op's number not taken; the checked path takes the call and names
    any problem)."""
    ph = tr._phases
    if tr._capturing or tr._broken is not None:
        return None
    epoch = tr._epoch + 1
    try:
        key = ("fixed", epoch & 1, *topk_idx.shape, x.dtype, x.stride(0), x.shape[1])
    except (AttributeError, IndexError, TypeError, RuntimeError, ValueError):
        return None  # not tensors of two dimensions
    plan = ph._plans.get(key)
    if plan is None or epoch >= 2**31 - 1 or torch.cuda.is_current_stream_capturing():
        return None  # (while capturing the checked path raises, naming the capture)
    header, cpp = plan
    parity, k = epoch & 1, key[3]
    full = int(tr._idx_k[parity] != k or tr._idx_full[parity])
    data, ids, weights = _regions(tr, parity, k)
    delta = epoch - tr._dev_base
    res = ph.cpp.dispatch_fixed(x, topk_idx, topk_weights, data, ids, weights, cpp.address,
                                delta, full, epoch * 8 + _DISPATCH_KIND,
                                _phases._stream(ph._dev), ph._cpp_device)
    status = _taken(tr, res, epoch)
    if status is None:
        return None
    # (the transport's _note_idx_width of this op)
    tr._idx_k[parity], tr._idx_full[parity], tr._idx_epoch[parity] = k, False, epoch
    _, _, slot, send_idx, num_recv, tokens_per_expert, recv_x, recv_idx, recv_w = res
    if status == GATE_LATE:  # the front ran and is published: wait for the peers, then header
        tr._await_peers(epoch, "dispatch")
        header.run((num_recv.data_ptr(), tokens_per_expert.data_ptr(), delta, full),
                   _phases._stream(ph._dev))
    # (the frozen handle and state made at once: the per-op hot path)
    st = frozen_with(GdaDispatchState, {"owner": tr.uid, "slot_TW": slot, "recv_offsets": None,
                                        "epoch": epoch, "fixed": True, "num_recv_W": num_recv})
    handle = frozen_with(DispatchHandle, {
        "num_tokens": x.shape[0], "num_recv_tokens": recv_x.shape[0], "topk_idx": topk_idx,
        "send_token_idx": send_idx, "num_send_per_rank": (), "num_recv_per_rank": (),
        "recv_topk_idx": recv_idx, "state": st})
    return recv_x, recv_idx, recv_w, num_recv, tokens_per_expert, handle


def cached(tr, x, slot, epoch: int) -> None:
    """Store, launch gate and wait of cached dispatch op ``epoch`` of ``x`` ``[T, D]`` along a
    fixed-capacity handle's layout ``slot`` ``[T, W]``: the rows land in this parity's data
    region of every destination's window, which the caller returns as the output. Eager, the
    store and the wait are bound programs run in one native call with the gate between them;
    inside a capture, or where they cannot be bound, launched from Python."""
    ph, kern = tr._phases, tr._kern
    op = ph._op(epoch)

    def launch(plan):
        kern.wait_for_sources(tr._my_sig, tr._err, **op, kind="cached dispatch", **tr._wait_kw,
                              plan=plan)

    first = ph.cached_store(x, slot, epoch, defer=not tr._capturing)
    prog = (ph._program(("wait", "cached dispatch"), launch, (), _phases._EPOCH)
            if first is not None else None)
    if prog is None:
        ph._then(first, epoch, "cached dispatch")
        launch(None)
        return
    ph._gated(first, prog, (op["epoch"],), epoch, "cached dispatch")
    key = cpp_op.rows_key("cached_fixed", epoch, x.shape[0], x)
    if ph.cpp is not None and key not in ph._plans:  # the next such call: one C++ call
        store, gate = first[0], tr._gate
        ph._plans[key] = (prog, cpp_op.CppPlan(
            cpp_op.FIXED_CACHED_FIELDS,
            fn=ctypes.cast(store._lib.efa_launch_run_gated, ctypes.c_void_p).value,
            store=store._addr, wait=prog._addr, gate=gate.address if gate is not None else 0,
            world=tr.world_size, rank=tr.rank, spin_ns=GATE_SPIN_NS,
            rows=tr.world_size * tr.cfg.max_tokens_per_rank))


def cached_planned(tr, x, handle):
    """A cached dispatch along a fixed-capacity ``handle`` of ``tr`` straight to its C++ call,
    before the transport's checks: when this shape has a plan (bound by an earlier call) and
    the call finds ``x`` the handle's tokens' rows, dense, on this device. Returns the rows
    ``[W * T_MAX, D]`` (a view of this parity's data region of the window, as the checked path
    returns) or None when not that case (nothing ran)."""
    ph = tr._phases
    op = cpp_op._planned_op(ph, handle, fixed_ok=True)
    if op is None or not op[1].fixed or not handle.num_tokens:
        return None
    epoch, st = op
    try:
        key = cpp_op.rows_key("cached_fixed", epoch, handle.num_tokens, x)
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None
    plan = ph._plans.get(key)
    if plan is None:
        return None
    wait, cpp = plan
    parity = epoch & 1
    data = _regions(tr, parity, handle.recv_topk_idx.shape[1])[0]
    delta, stream = epoch - tr._dev_base, _phases._stream(ph._dev)
    res = ph.cpp.cached_fixed(x, st.slot_TW, data, cpp.address, delta,
                              epoch * 8 + _CACHED_KIND, stream, handle.num_tokens,
                              ph._cpp_device)
    status = _taken(tr, res, epoch)
    if status is None:
        return None
    if status == GATE_LATE:  # the store ran and is published: wait for the peers, then the wait
        tr._await_peers(epoch, "cached dispatch")
        wait.run((delta,), stream)
    refusal.raise_if_refused(tr, epoch, "cached dispatch")  # the op is whole
    return res[2]
