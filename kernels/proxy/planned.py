"""Packed operations of CUDA rows in one native call each, for shapes that ran before.

The first dispatch or combine of a shape runs in Python steps (``device_path.py``,
``round_ops.py``): it checks its inputs, binds the native programs of its kernels and runs the
round in the three native calls of ``hostop.py``. Afterwards a call of the same case (the same
shapes, strides, dtypes and devices, so the same checks pass; 16-byte aligned rows; the same
wire) goes from the transport's method to one native call (``efa_devop.c``): our previous
writes waited for, the packing kernel launched, the previous op's reads waited for, the round's
begin and post, the kernel that reads what arrives (it follows the chunk marks, so it reads
while the rest is on the wire), the round's complete and the kernel's event. A dispatch takes
a second call from its reading kernel on, after Python allocated the outputs whose sizes the
headers gave. Everything else is the stepped path's: the same kernels, programs, buffers, round and
checks of the peers' data, in C, so the outputs are the same bits.

A call of any other case returns None here (nothing ran) and the stepped path takes it, whose
checks name any problem. Errors of the native call are raised as the stepped path raises them:
a flagged routing or a group's input error runs the same error round or raises the same error
on every rank; anything else breaks the transport (its ``_guarded``).

Where the proxy's C++ ops are built (:mod:`.cpp_op`), a planned dispatch or combine goes from
here to one C++ call instead, which also makes the op's tensors and writes the programs'
variables; Python keeps the plan lookup, the round's accounting, the errors and the handle.

``EFA_EP_PROXY_ONE_CALL=0`` keeps every call on the stepped path, ``EFA_EP_PROXY_EARLY_READS=0``
launches the reading kernel after the round completed, ``EFA_EP_PROXY_CPP=0`` keeps the one-call
path's Python glue (the other arms of the benchmarks' comparisons).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from ..base import DispatchInputError
from ..core.variables import raw
from ..native_launch import NativeLaunchError, Program
from ..native_launch import load as load_launch
from . import cpp_op, native
from .native import RC_LOCAL_INPUT, STEP_BEGIN, STEP_POST, STEP_WAIT_READS
from .window import OP_CACHED, OP_COMBINE, OP_DISPATCH, row_format
from .wire import Wire

_ERRLEN = 1024


def enabled() -> bool:
    """Whether packed calls of a planned case go to one native call (``EFA_EP_PROXY_ONE_CALL``,
    default on)."""
    return raw("EFA_EP_PROXY_ONE_CALL") not in ("0", "off", "false")


def early_reads() -> bool:
    """Whether a one-call op launches its reading kernel as soon as its round's data is posted
    (the kernel follows the chunk marks) rather than after the round completed
    (``EFA_EP_PROXY_EARLY_READS``, default on)."""
    return raw("EFA_EP_PROXY_EARLY_READS") not in ("0", "off", "false")


def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@dataclass
class _Plan:
    """One planned case: its own op and devop structs (constants set once), the programs."""

    op: native.OpStruct
    dev: native.DevopStruct
    op_ref: object
    dev_ref: object
    pack: Program
    reads: Optional[Program]
    event: object            # torch.cuda.Event recorded after the reads (None: the caller's)
    nw: object               # the wire's native round it was made on
    gen: int
    device: torch.device
    words: int = 0           # dispatch: scratch words
    o_send: int = 0          # dispatch: word offset of the sent rows' token indices
    k: int = 0
    num_programs: int = 0    # the packing kernels' (one per SM)
    read_programs: int = 0   # the reading kernels' readers (DevicePath._read_programs)
    row_bytes: int = 0
    send_area: int = 0       # combine, cached dispatch: bytes of the send area
    keep: tuple = ()         # the host buffers the structs and programs point at
    cuda: Optional[int] = None          # the CUDA device's index (None: the CPU stand-in)
    cpp: Optional[cpp_op.CppPlan] = None  # the C++ call's constants, where it runs


class PlannedOps:
    """The one-call operations of one :class:`~efa_ep.kernels.proxy.transport.ProxyTransport`
    (see the module). ``dispatch`` / ``combine`` / ``cached`` return None when the call is not
    a planned case; ``note_dispatch`` / ``note_combine`` / ``note_cached`` make a plan after the
    stepped path ran one (at most ``MAX_PLANS``: past that, all are dropped and made again as
    calls need them, as the stepped path's programs are). ``cpp_off``: None where planned
    dispatches and combines go to the C++ call, else why not; ``cpp_calls`` counts them."""

    MAX_PLANS = 256

    def __init__(self, tr):
        self.tr = tr
        self.plans: dict = {}
        self.calls = {"dispatch": 0, "combine": 0, "cached": 0}  # ops this path ran
        lib, launch = native.load(), load_launch()
        self._fns = (_addr(launch.efa_launch_run), _addr(launch.efa_launch_event_record),
                     _addr(launch.efa_launch_event_wait))
        self._dispatch_fn, self._rows_fn = lib.efa_devop_dispatch, lib.efa_devop_rows
        self._finish_fn = lib.efa_devop_dispatch_finish
        self._err = ctypes.create_string_buffer(_ERRLEN)
        from .device import reads_grid
        from .round_ops import ProxyHandleState

        self._state_type, self._reads_grid = ProxyHandleState, reads_grid
        self.cpp, self.cpp_off = None, "off (EFA_EP_PROXY_CPP=0)"
        if cpp_op.enabled():
            try:
                self.cpp, self.cpp_off = cpp_op.load(), None
            except RuntimeError as e:
                self.cpp_off = str(e)
        # the C++ call's plans by a short key (the call checks the rest of the case)
        self.cpp_dispatch: dict = {}
        self.cpp_combine: dict = {}
        self.cpp_calls = {"dispatch": 0, "combine": 0}

    @classmethod
    def create(cls, tr) -> Optional["PlannedOps"]:
        """The transport's planned ops, or None where they cannot run (switched off, no native
        launch library or driver)."""
        if not enabled():
            return None
        try:
            return cls(tr)
        except (NativeLaunchError, RuntimeError, AttributeError):
            return None

    # -------------------------------------------------------------------------------------
    def _structs(self, kind: int, pack: Program, reads: Optional[Program], event, dev):
        """A new plan: a copy of the transport's op struct (its arrays shared: one op at a
        time), a devop struct with the launch library's entry points and the programs."""
        tr = self.tr
        ops = tr._op_struct()
        op = native.OpStruct()
        ctypes.memmove(ctypes.byref(op), ctypes.byref(ops.st), ctypes.sizeof(op))
        d = native.DevopStruct()
        d.run, d.event_record, d.event_wait = self._fns
        d.pack, d.kind, d.early = pack._addr, kind, int(early_reads())
        d.reads = reads._addr if reads is not None else 0  # (none: the caller reads)
        d.reads_event = event.cuda_event if event is not None else 0
        return _Plan(op=op, dev=d, op_ref=ctypes.byref(op), dev_ref=ctypes.byref(d), pack=pack,
                     reads=reads, event=event, nw=tr.wire._nw, gen=tr.wire.gen, device=dev,
                     num_programs=tr._num_programs(dev), read_programs=tr._read_programs(dev),
                     cuda=dev.index if dev.type == "cuda" else None)

    def _cpp_fields(self, plan: _Plan, dtype) -> dict:
        """The constants every C++ plan of ``plan`` holds (``dtype``: its rows')."""
        from .device import _watcher

        return dict(op=ctypes.addressof(plan.op), dev=ctypes.addressof(plan.dev),
                    pack=plan.pack._addr, reads=plan.reads._addr,
                    device=-2 if plan.cuda is None else plan.cuda,
                    programs=plan.read_programs, watcher=_watcher(),
                    err=ctypes.addressof(self._err), errlen=_ERRLEN,
                    **{"dtype": self.cpp.scalar_type(torch.empty(0, dtype=dtype))})

    def _usable(self, plan: _Plan) -> bool:
        tr = self.tr
        wire = tr.wire
        return (plan.nw is wire._nw and plan.gen == wire.gen and not wire.tamper
                and tr._broken is None)

    def _event(self, dev):
        ev = self.tr._buffers.get(("event", dev.index))
        return ev if ev is not None and ev.cuda_event else None

    # -------------------------------------------------------------------------------------
    def note_dispatch(self, x, topk_idx, topk_weights, front, in_idx, in_w, recv_off) -> None:
        """After a stepped dispatch of dense ``x``, ``topk_idx``, ``topk_weights`` (CUDA) that ran
        the native round: a plan for its case when its programs are bound (``front``: the
        transport's front plan of the shape; ``in_idx`` / ``in_w`` / ``recv_off``: the host
        buffers its gather read)."""
        tr = self.tr
        dev = x.device
        t, k = topk_idx.shape
        meta, counts, _, row_x, grid, o_send, words, prog = front[:8]
        cfg, w = tr.cfg, tr.world_size
        cap = w * cfg.max_tokens_per_rank * k
        if in_idx.numel() < cap:  # the plan's bound: grown now, the next call binds for it
            tr._recv_routing(cap)
            return
        gather = tr._programs.get(tr._gather_key(dev, k, x, recv_off, in_idx, in_w))
        event = self._event(dev)
        if prog is None or gather is None or event is None or (8 * o_send) & 15:
            return
        progress, chunk_rows = tr._progress(grid, row_x)
        self.plan_dispatch(_dispatch_key(x, topk_idx, topk_weights), dev, prog, gather, event,
                           counts, meta, progress, chunk_rows, words, o_send, in_idx, in_w,
                           recv_off)

    def plan_dispatch(self, key, dev, pack, gather, event, counts, meta, progress,
                      chunk_rows: int, words: int, o_send: int, in_idx, in_w, recv_off) -> None:
        """Adds the plan of dispatch case ``key`` (:func:`_dispatch_key` of its inputs) on
        ``dev``: ``pack`` (variables: x, topk_idx, topk_weights, scratch) writes the count block
        ``counts`` (then its ready word), the routing rows ``meta`` ``[>= S * 2K]`` int64, the
        send plane and the ``progress`` words (``[grid]`` int64, ``chunk_rows`` rows a chunk);
        ``gather`` (variables: x, the sent rows' token indices at word ``o_send`` of the scratch
        of ``words`` int64, recv_x, recv_topk_idx, recv_topk_weights, own start, rows, grid)
        reads the window, the host routing ``in_idx`` / ``in_w`` and ``recv_off`` ``[W + 1]``;
        ``event`` (``.cuda_event``) is recorded after it. All host buffers stay where they are
        while the plan lives (it keeps them)."""
        k = key[5][1]
        plan = self._structs(native.DEVOP_DISPATCH, pack, gather, event, dev)
        st = plan.op
        st.dev_counts = counts.data_ptr()
        st.progress, st.progress_words = progress.data_ptr(), progress.numel()
        st.chunk_rows = chunk_rows
        st.meta, st.meta_rows = meta.data_ptr(), meta.numel() // (2 * k)
        st.topk, st.row_bytes = k, key[1][1] * key[3].itemsize
        st.recv_idx, st.recv_w = in_idx.data_ptr(), in_w.data_ptr()
        plan.dev.recv_off, plan.dev.routing_cap = recv_off.data_ptr(), min(in_idx.numel(),
                                                                          in_w.numel())
        plan.words, plan.o_send, plan.k, plan.row_bytes = words, o_send, k, st.row_bytes
        plan.keep = (meta, counts, progress, in_idx, in_w, recv_off)
        self._add(key, plan)
        if self.cpp is not None:
            f = self._cpp_fields(plan, key[3])
            plan.cpp = cpp_op.CppPlan(
                cpp_op.DISPATCH_FIELDS, fn=_addr(self._dispatch_fn), finish=_addr(self._finish_fn),
                tokens=key[1][0], hidden=key[1][1], x_stride=key[2][0], x_dtype=f.pop("dtype"),
                topk=k, words=words, o_send=o_send, num_local=self.tr.cfg.num_local_experts, **f)
            self.cpp_dispatch[key[5]] = plan  # by topk_idx's shape

    def dispatch(self, x, topk_idx, topk_weights):
        """A dispatch of a planned case in two native calls, or None (nothing ran). Returns
        what the transport's dispatch returns."""
        if self.cpp is not None:
            out = self._dispatch_cpp(x, topk_idx, topk_weights)
            if out is not None:
                return out
        try:
            plan = self.plans.get(_dispatch_key(x, topk_idx, topk_weights))
        except (AttributeError, TypeError, RuntimeError):
            return None  # not tensors
        if plan is None or not self._usable(plan):
            return None
        xp, ip, wp = x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr()
        if (xp | ip | wp) & 15:
            return None
        tr, dev = self.tr, plan.device
        t, k = topk_idx.shape
        scratch = torch.empty(plan.words, dtype=torch.int64, device=dev)  # the handle keeps a view
        sp = scratch.data_ptr()
        plan.pack.set_vars((xp, ip, wp, sp))
        tpe = torch.empty(tr.cfg.num_local_experts, dtype=torch.int64)
        plan.op.tokens_per_expert = tpe.data_ptr()
        self._run(plan, self._dispatch_fn, OP_DISPATCH, topk_idx, topk_weights)
        ops = tr._hostops
        num_recv, num_send = ops.num_recv.tolist(), ops.num_send.tolist()
        n = sum(num_recv)
        recv_x = torch.empty(n, x.shape[1], dtype=x.dtype, device=dev)
        recv_idx = torch.empty(n, k, dtype=torch.int64, device=dev)
        recv_w = torch.empty(n, k, dtype=torch.float32, device=dev)
        plan.reads.set_vars((xp, sp + 8 * plan.o_send, recv_x.data_ptr(), recv_idx.data_ptr(),
                             recv_w.data_ptr(), plan.dev.own_start, n,
                             self._tag(plan, plan.op.seq), self._reads_grid(n, plan.read_programs)))
        self._finish_dispatch(plan)
        tr._reads_done = plan.event
        self.calls["dispatch"] += 1
        send_idx = scratch[plan.o_send:plan.o_send + sum(num_send)]
        return recv_x, recv_idx, recv_w, tpe, tr._handle(t, topk_idx, send_idx, None, num_send,
                                                         num_recv, recv_idx)

    def _dispatch_cpp(self, x, topk_idx, topk_weights):
        """:meth:`dispatch` through the C++ call, or None (nothing ran)."""
        try:
            plan = self.cpp_dispatch.get(topk_idx.shape)
        except AttributeError:
            return None  # not a tensor
        if plan is None or not self._usable(plan):
            return None
        tr = self.tr
        ev = tr._reads_done
        try:
            res = self.cpp.dispatch(x, topk_idx, topk_weights, plan.cpp.address, tr.wire.seq,
                                    self._stream(plan), ev.cuda_event if ev is not None else 0)
        except TypeError:
            return None  # not tensors (nothing ran): the checked path names them
        if res[0] == cpp_op.NOT_PLANNED:
            return None
        rc, step, counts, rc_finish, out = res
        self._settle(plan, step, rc, counts, OP_DISPATCH, topk_idx, topk_weights)
        if rc_finish:
            raise Wire.error_of(rc_finish, self._text())
        tr._reads_done = plan.event
        self.calls["dispatch"] += 1
        self.cpp_calls["dispatch"] += 1
        recv_x, recv_idx, recv_w, tpe, send_idx, num_send, num_recv = out
        return recv_x, recv_idx, recv_w, tpe, tr._handle(
            x.shape[0], topk_idx, send_idx, None, num_send, num_recv, recv_idx)

    def _combine_cpp(self, y, handle, t: int):
        """:meth:`combine` through the C++ call, or None (nothing ran)."""
        plan = self.cpp_combine.get((t + 1).bit_length())
        if plan is None or not self._usable(plan):
            return None
        tr = self.tr
        ev = tr._reads_done
        try:
            res = self.cpp.combine(y, handle.send_token_idx, handle.num_send_per_rank,
                                   handle.num_recv_per_rank, t, plan.cpp.address, tr.wire.seq,
                                   self._stream(plan), ev.cuda_event if ev is not None else 0)
        except TypeError:
            return None  # not a tensor (nothing ran): the checked path names it
        if res[0] == cpp_op.NOT_PLANNED:
            return None
        rc, step, counts, out = res
        self._settle(plan, step, rc, counts, OP_COMBINE)
        tr._reads_done = plan.event
        self.calls["combine"] += 1
        self.cpp_calls["combine"] += 1
        return out

    # -------------------------------------------------------------------------------------
    def note_combine(self, yc, handle, pack_key, reduce_key) -> None:
        """After a stepped combine of dense CUDA rows ``yc`` along ``handle`` that ran the native
        round: a plan for its case when both programs are bound (their keys in the transport's
        programs)."""
        tr = self.tr
        pack, reduce = tr._programs.get(pack_key), tr._programs.get(reduce_key)
        event = self._event(yc.device)
        if pack is None or reduce is None or event is None:
            return
        self.plan_rows(_combine_key(yc, handle.num_tokens), yc, pack, reduce, event)

    def plan_rows(self, key, rows, pack, reads, event) -> None:
        """Adds the plan of a combine (``reads`` given) or cached dispatch (``reads`` None: the
        caller copies the rows out) case ``key`` of rows like ``rows``: ``pack`` (variables:
        the rows, for a cached dispatch the handle's token indices, then own start and end,
        rows, rows a chunk, grid) stores the send plane and its progress words; ``reads``
        (variables: the rows, the handle's token indices, out, own start, tokens, grid) reads
        the window and the prefix of rows per source rank; ``event`` is recorded after it."""
        tr = self.tr
        combine = reads is not None
        plan = self._structs(native.DEVOP_COMBINE if combine else native.DEVOP_CACHED, pack,
                             reads, event if combine else None, rows.device)
        row = rows.shape[1] * rows.element_size()
        progress = tr._progress(1, row)[0]
        plan.op.row_bytes, plan.op.fmt = row, row_format(rows)
        plan.op.progress = progress.data_ptr()
        plan.row_bytes, plan.keep = row, (progress,)
        if combine:
            send_off = tr._prefix_buffer("send_off")[0]
            plan.dev.send_off, plan.keep = send_off.data_ptr(), (progress, send_off)
        lay = tr.layout
        plan.send_area = lay.off_recv - lay.off_data_send
        self._add(key, plan)
        if combine and self.cpp is not None:
            from .device_path import _CHUNK_BYTES

            f = self._cpp_fields(plan, rows.dtype)
            plan.cpp = cpp_op.CppPlan(
                cpp_op.COMBINE_FIELDS, fn=_addr(self._rows_fn), hidden=rows.shape[1],
                y_stride=rows.stride(0), y_dtype=f.pop("dtype"), row_bytes=row,
                send_area=plan.send_area, chunk_bytes=_CHUNK_BYTES, **f)
            self.cpp_combine[key[-1]] = plan  # by the token count's bit length

    def _add(self, key, plan: _Plan) -> None:
        if len(self.plans) >= self.MAX_PLANS:  # shapes that keep changing (inference)
            self.plans.clear()
            self.cpp_dispatch.clear()
            self.cpp_combine.clear()
        self.plans[key] = plan

    def combine(self, y, handle):
        """A combine of a planned case in one native call, or None (nothing ran)."""
        tr = self.tr
        if not self._own_handle(handle):
            return None
        t, n = handle.num_tokens, handle.num_recv_tokens
        if self.cpp is not None:
            out = self._combine_cpp(y, handle, t)
            if out is not None:
                return out
        try:
            plan = self.plans.get(_combine_key(y, t))
            if plan is None or y.shape[0] != n or not n:
                return None
        except (AttributeError, TypeError, RuntimeError, IndexError):
            return None
        ptrs = self._addresses(plan, y, handle) if t else None
        if ptrs is None:
            return None
        yp, ip = ptrs
        num_recv, me = handle.num_recv_per_rank, tr.rank
        if (n - num_recv[me]) * plan.row_bytes > plan.send_area:
            return None  # the stepped path names it
        grid, chunk_rows = self._round_counts(plan, handle, n)
        s_me = sum(num_recv[:me])
        out = torch.empty(t, y.shape[1], dtype=y.dtype, device=plan.device)
        plan.pack.set_vars((yp, s_me, s_me + num_recv[me], n, max(1, chunk_rows), grid))
        plan.reads.set_vars((yp, ip, out.data_ptr(), s_me, t, self._tag(plan, tr.wire.seq),
                             self._reads_grid(t, plan.read_programs)))
        self._run(plan, self._rows_fn, OP_COMBINE)
        tr._reads_done = plan.event
        self.calls["combine"] += 1
        return out

    # -------------------------------------------------------------------------------------
    def note_cached(self, xd, pack_key) -> None:
        """After a stepped cached dispatch of dense CUDA rows ``xd`` that ran the native round: a
        plan for its case when its packing program is bound (its key in the transport's
        programs). Its output is copied out of the window in Python after the call."""
        pack = self.tr._programs.get(pack_key)
        if pack is not None and self._event(xd.device) is not None:
            self.plan_rows((OP_CACHED,) + _rows_key(xd), xd, pack, None, None)

    def cached(self, x, handle):
        """A cached dispatch of a planned case in one native call and the copies out of the
        window, or None (nothing ran)."""
        tr = self.tr
        if not self._own_handle(handle):
            return None
        t = handle.num_tokens
        try:
            plan = self.plans.get((OP_CACHED,) + _rows_key(x))
            if plan is None or x.shape[0] != t or not t:
                return None
        except (AttributeError, TypeError, RuntimeError, IndexError):
            return None
        ptrs = self._addresses(plan, x, handle)
        if ptrs is None:
            return None
        xp, ip = ptrs
        from .round_ops import _prefix

        num_recv, me = handle.num_recv_per_rank, tr.rank
        starts = _prefix(handle.num_send_per_rank)
        s_me, e_me, n = starts[me], starts[me + 1], starts[-1]
        if (n - (e_me - s_me)) * plan.row_bytes > plan.send_area:
            return None  # the stepped path names it
        grid, chunk_rows = self._round_counts(plan, handle, n)
        plan.pack.set_vars((xp, ip, s_me, e_me, n, max(1, chunk_rows), grid))
        self._run(plan, self._rows_fn, OP_CACHED)
        out = tr._cached_outputs(tr._hostops, x, handle.send_token_idx, num_recv, starts,
                                 _prefix(num_recv))
        self.calls["cached"] += 1
        return out

    # -------------------------------------------------------------------------------------
    def _own_handle(self, handle) -> bool:
        """Whether ``handle`` comes from this transport's device-path dispatch."""
        st = getattr(handle, "state", None)
        return (type(st) is self._state_type and st.owner == self.tr.uid
                and st.send_token_idx_cpu is None)

    def _addresses(self, plan: _Plan, rows, handle):
        """(``rows``' address, the handle's token indices' address) when a combine or cached
        dispatch along ``handle`` may run on ``plan`` (its wire, device, 16-byte alignment),
        else None."""
        idx, dev = handle.send_token_idx, plan.device
        if (not self._usable(plan) or idx.device != dev or handle.topk_idx.device != dev
                or not idx.numel()):
            return None
        rp, ip = rows.data_ptr(), idx.data_ptr()
        return None if (rp | ip) & 15 else (rp, ip)

    def _round_counts(self, plan: _Plan, handle, n: int):
        """The handle's row counts into the op struct and the packing of ``n`` send-plane rows:
        returns (grid, rows a chunk), also set as the plan's progress words and chunk."""
        from .device import pack_grid

        ops = self.tr._hostops
        ops.num_send[:] = handle.num_send_per_rank
        ops.num_recv[:] = handle.num_recv_per_rank
        grid = pack_grid(n, plan.num_programs)
        chunk_rows = self.tr._chunk_rows(grid, plan.row_bytes)
        plan.op.progress_words, plan.op.chunk_rows = grid, chunk_rows
        return grid, chunk_rows

    @staticmethod
    def _tag(plan: _Plan, seq: int) -> int:
        """The reading kernel's ``tag`` for round ``seq``: the marks' tag when it is launched
        before the round's complete, else 0 (it waits for nothing)."""
        return native.mark_tag(seq) if plan.dev.early else 0

    def _finish_dispatch(self, plan: _Plan) -> None:
        """The dispatch's second native call: its reading kernel (it reads the rows as their
        chunks arrive), the round's complete, then the kernel's event."""
        rc = self._finish_fn(plan.op_ref, plan.dev_ref, self._err, _ERRLEN)
        if rc:
            raise Wire.error_of(rc, self._text())

    def _text(self) -> str:
        return self._err.value.decode(errors="replace")

    @staticmethod
    def _stream(plan: _Plan) -> int:
        """The current stream of the plan's CUDA device (0: the CPU stand-in)."""
        return 0 if plan.cuda is None else torch._C._cuda_getCurrentRawStream(plan.cuda)

    def _run(self, plan: _Plan, fn, op_code: int, topk_idx=None, topk_weights=None) -> None:
        """Runs a plan's native call on the current stream; accounts the round as the stepped
        path does and raises what it raises."""
        tr, wire, d = self.tr, self.tr.wire, plan.dev
        d.stream = self._stream(plan)
        ev = tr._reads_done
        d.wait_event = ev.cuda_event if ev is not None else 0
        plan.op.seq = wire.seq
        d.step, rc = 0, -1
        try:
            rc = fn(plan.op_ref, plan.dev_ref, self._err, _ERRLEN)
        finally:
            wst = wire._nw.st
            counts = (wst.r_writes, wst.r_wire_bytes, wst.r_messages, wst.r_rows)
            self._account(plan, d.step, rc, counts)
        if rc:
            self._raise(plan, d.step, rc, op_code, topk_idx, topk_weights)

    def _settle(self, plan: _Plan, step: int, rc: int, counts, op_code: int, topk_idx=None,
                topk_weights=None) -> None:
        """After a plan's C++ call whose native call got to ``step`` and returned ``rc``:
        :meth:`_account`, then what the stepped path raises for a non-zero ``rc``."""
        self._account(plan, step, rc, counts)
        if rc:
            self._raise(plan, step, rc, op_code, topk_idx, topk_weights)

    def _account(self, plan: _Plan, step: int, rc: int, counts) -> None:
        """The round of a plan's native call that got to ``step`` and returned ``rc``, accounted
        as the stepped path does (``counts``: the round's writes, wire bytes, messages and
        rows)."""
        tr, wire = self.tr, self.tr.wire
        if step > STEP_WAIT_READS:
            tr._reads_done = None
        if step >= STEP_POST or (step == STEP_BEGIN and rc != RC_LOCAL_INPUT):
            wire.seq += 1  # headers may have left: this round's number is spent
        if step >= STEP_POST:
            p = wire.posted
            p["writes"] += counts[0]
            p["wire_bytes"] += counts[1]
            if step > STEP_POST:
                p["messages"] += counts[2]
                p["rows"] += counts[3]
                p["bytes"] += counts[3] * plan.row_bytes

    def _raise(self, plan: _Plan, step: int, rc: int, op_code: int, topk_idx,
               topk_weights) -> None:
        """Raises what the stepped path raises for a plan's native call that got to ``step``
        and returned ``rc`` (non-zero)."""
        tr, wire = self.tr, self.tr.wire
        st, dev = plan.op, plan.device
        text = self._text()
        if rc < 0:
            raise Wire.error_of(rc, text)
        if step == STEP_BEGIN and rc == RC_LOCAL_INPUT:  # the device flagged the routing
            tr._sync(dev)
            tr._device_routing_error(topk_idx, topk_weights, int(st.flags))
        try:
            wire.header_error(rc, st.seq, op_code, None, text)
        except DispatchInputError:
            tr._sync(dev)  # the packing kernel may still store: the next op starts from zero
            raise


def _dispatch_key(x, topk_idx, topk_weights) -> tuple:
    return (OP_DISPATCH, x.shape, x.stride(), x.dtype, x.device, topk_idx.shape, topk_idx.stride(),
            topk_idx.dtype, topk_idx.device, topk_weights.shape, topk_weights.stride(),
            topk_weights.dtype, topk_weights.device)


def _rows_key(x) -> tuple:
    return (x.shape[1], x.stride(), x.dtype, x.device)


def _combine_key(y, num_tokens: int) -> tuple:
    # the reduction's program follows the token count's bit length (its search depth)
    return (OP_COMBINE, y.shape[1], y.stride(), y.dtype, y.device, (num_tokens + 1).bit_length())
