"""The kernel launches of one :class:`~efa_ep.kernels.gda.GdaTransport`, one method per op phase.

An op is a few phases separated by host steps (the launch gate, the count read): a dispatch is
*front* (layout, store), *header* (wait for the sources' headers, read the counts) and
*gather*; a combine is *store* and *reduce*; a cached dispatch *store* and *gather*. Each phase
method launches its kernels on the current stream either

* natively (``fast_launch`` 2, or 3, the default where the driver allows): a
  :class:`~efa_ep.kernels.native_launch.Program` per phase and shape, bound on first use, then
  one native call per phase with only the call's addresses, op number and row counts; or
* through the Python wrappers of :mod:`efa_ep.kernels.gda.launches` (``fast_launch`` 0 or 1, a
  shape seen during CUDA graph capture, a bad-input op, a misaligned user tensor).

Between the two phases of an op whose second phase waits on the peers' stores (front and
header, combine's store and reduce, cached store and gather) sits the launch gate of ranks
sharing a GPU (:class:`~efa_ep.kernels.gda.gate.LaunchGate`). When both phases are native
programs they run in one native call with the gate's fast path between them (``run_gated``);
a late peer hands the wait back to the transport's gate wait (deadline, missing ranks named).

A regular dispatch whose shape has run before goes further: its outputs are allocated ahead at
the rows the shape's recent calls received (at most :data:`.gather_ahead.GATHER_AHEAD_BYTES`),
and the one native call also waits for the counts, checks them as the transport does and
launches the gather (:func:`.gather_ahead.dispatch_gather`); counts the check refuses, more
rows than allocated or a late peer leave the gather to the transport's own checks.

Both paths launch the same compiled kernels with the same arguments: the same bits. A program
that cannot be bound turns native launching off (the reason in :attr:`GdaPhases.native_off`).

Program keys hold everything that changes a kernel's specialization or constant arguments:
window parity, shapes, dtypes, row strides, op kind. Variable tensors are the call's own
(inputs, outputs, the per-call scratch); the transport's windows and tables are constants.
"""
from __future__ import annotations

import ctypes
import time
from typing import Optional, Tuple

import torch

from . import launches as kern
from . import cpp_op
from . import gather_ahead
from .gate import GATE_SPIN_NS
from .gather_ahead import GatherAhead
from ..native_launch import GATE_LATE, RAN, NativeLaunchError, Program, availability, bind

_EPOCH = ("epoch_delta",)


#: bound programs kept per transport: a dispatch of a token count not seen before binds new ones
#: (its front and plan); past this many, all are dropped and bound again as calls need them
MAX_PROGRAMS = 512


def _aligned(*tensors) -> bool:
    p = 0
    for t in tensors:
        p |= t.data_ptr()
    return not p & 15


def _stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


class GdaPhases:
    """Launches the phases of ``transport``'s ops (see the module). ``fast_launch``: 4 as 3 and a
    repeated regular dispatch in one C++ call (:mod:`.cpp_op`, else as 3); 3 native
    programs, an op's two phases and the gate in one call; 2 native programs (either falls
    back to 1 with the reason in :attr:`native_off`); 1 compiled launchers; 0 Triton's own
    path."""

    def __init__(self, transport, fast_launch: int):
        self.tr = transport
        self.fast = fast_launch >= 1
        self.gated = fast_launch >= 3  # an op's two native phases and the gate in one call
        self.native_off: Optional[str] = None if fast_launch >= 2 else "fast_launch < 2"
        if self.native_off is None:
            self.native_off = availability()
        self._progs = {}
        self._plans = {}  # bound plans of dispatch_head and combine, per op kind and shape
        self._dev = transport.device.index
        self._host = None  # (address of the page-locked count buffer, its int64 view)
        # how long a native call waits for a completion word: the op's own wait and any
        # waits queued before it on the stream each end at the deadline, so a GPU still
        # silent after a few of them is stuck
        self._flag_wait_ns = int((3 * transport.timeout_s + 10) * 1e9)
        self._header_words = None
        self._ahead: Optional[GatherAhead] = None  # the gather of the last planned dispatch
        # fast_launch=4: a planned dispatch in one C++ call (cpp_op), where it can be built
        self.cpp, self.cpp_off = None, None if fast_launch >= 4 else "fast_launch < 4"
        if self.cpp_off is None:
            self.cpp_off = self.native_off or cpp_op.availability()
            self.cpp = cpp_op.load() if self.cpp_off is None else None
            if self.cpp is None and self.native_off is None:
                cpp_op.warn_off(self.cpp_off)
        # the C++ input check's device: the CUDA index (-2: CPU tensors, the tests' stand-in)
        self._cpp_device = transport.device.index if transport.device.type == "cuda" else -2
        self.layout_in_store = bool(transport.layout_in_store)  # (see the options)
        # wait_in_reduce: a combine's or cached dispatch's wait inside its reduce/gather, grid
        # capped: all ranks' waiting programs on this GPU hold <= 1 slot per SM (room for the
        # peers' stores); _read_step: the step whose grid a call sets
        self.wait_in_kernel = bool(transport.wait_in_reduce)
        self.read_programs = (min(transport.num_programs, transport.wait_programs)
                              if self.wait_in_kernel else transport.num_programs)
        self._read_step = 0 if self.wait_in_kernel else 1
        self.graph_launch = bool(transport.graph_launch)  # programs as one CUDA graph launch

    @property
    def native(self) -> bool:
        return self.native_off is None

    @property
    def path(self) -> str:
        """How kernels are launched: ``native``, ``fast`` or ``triton``."""
        return "native" if self.native else ("fast" if self.fast else "triton")

    def _program(self, key, launch, tensors, ints=_EPOCH, grid_steps=()) -> Optional[Program]:
        prog = self._progs.get(key)
        if prog is None and self.native:
            if self.tr._capturing:
                return None  # programs are bound from eager calls only
            try:
                prog = bind(launch, tensors, ints, grid_steps, graph=self.graph_launch)
            except NativeLaunchError as e:
                self.native_off = f"a kernel could not be bound for native launch: {e}"
                return None
            if prog is None:
                return None
            self._progs[key] = prog
        return prog

    def _op(self, epoch: int) -> dict:
        return self.tr._op(epoch)

    def _then(self, first, epoch: int, kind: str) -> None:
        """Launches a deferred first phase (``(program, values)``; None: already launched) and
        passes the launch gate of op ``epoch``."""
        if first is not None:
            prog, values = first
            prog.run(values, _stream(self._dev))
        self.tr._issued(epoch, kind)

    def _gated(self, first, second, values2, epoch: int, kind: str, flag: int = 0) -> float:
        """The deferred first phase, the launch gate and the ``second`` program in one native
        call (the transport's gate wait when a peer is late). ``flag``: the address of the host
        completion word the second program's last kernel writes (the op's record); the call
        returns once it is there. Returns the seconds waiting for the device."""
        tr = self.tr
        gate = tr._gate
        prog, values = first
        stream = _stream(self._dev)
        record = kern.wait_record(epoch, kind)
        status, sync_s, gate_s = prog.run_gated(
            values, second, values2, stream, gate.address if gate is not None else 0,
            tr.world_size, tr.rank, record, GATE_SPIN_NS, flag, record, self._flag_wait_ns)
        tr.blocked_s += gate_s
        if status == RAN:
            return sync_s
        if status == GATE_LATE:
            tr._await_peers(epoch, kind)  # published already; raises on deadline or a failed peer
            if not flag:
                second.run(values2, stream)
                return 0.0
            return self._run_wait(second, values2, stream, flag, epoch, kind)
        tr._device_late(epoch, kind, self._flag_wait_ns * 1e-9)  # raises

    def _run_wait(self, prog, values, stream, flag: int, epoch: int, kind: str) -> float:
        """``prog`` with ``values``, then the wait for its completion word at ``flag`` (the
        record of op ``epoch`` of ``kind``). Returns the seconds waited; a word that does not
        come breaks the transport and raises."""
        waited = prog.run_wait(values, stream, flag, kern.wait_record(epoch, kind),
                               self._flag_wait_ns)
        if waited is None:
            self.tr._device_late(epoch, kind, self._flag_wait_ns * 1e-9)  # raises
        return waited

    # ---- dispatch ---------------------------------------------------------------------------
    def header_words(self) -> int:
        """int64 elements recv_header writes: info, the per-source offsets, the clean rows."""
        if self._header_words is None:
            tr = self.tr
            w, num_local = tr.world_size, tr.cfg.num_local_experts
            n_info = 1 + w * (2 + num_local) + w + num_local
            self._header_words = kern._even(n_info) + w + 2
        return self._header_words

    def front(self, x, topk_idx, topk_weights, epoch: int, bad_status: Optional[int] = None,
              defer: bool = False):
        """Layout and store of a dispatch: returns (scratch, slot [T, W], send_idx [T*W]) on the
        device; the header's output region follows the layout's in ``scratch`` (pass it to
        :meth:`header`). ``bad_status``: the status word to announce (bad input). ``defer``:
        a native program is not run but returned as a fourth item ``(program, values)`` (None
        when the phase was launched from Python) for :meth:`header` to run with the gate."""
        tr, cfg, w = self.tr, self.tr.cfg, self.tr.world_size
        t, k = topk_idx.shape
        small, nb, o_exp, o_rank, o_slot, o_send, o_blk, words = kern._layout_offsets(
            t, cfg.num_experts, w, k)
        scratch = torch.empty(words + self.header_words(), dtype=torch.int64, device=tr.device)
        parity = epoch % 2
        op = self._op(epoch)

        # a small batch: the store kernel computes the layout itself (one launch, not two)
        in_store = (self.layout_in_store and bad_status is None and t > 0
                    and kern.layout_in_store(t, k, w))

        def launch(plan):
            if in_store:
                slot, send_idx, npr, npe, status = kern.layout_views(scratch, t, cfg.num_experts,
                                                                     w, k)
            else:
                slot, send_idx, npr, npe, status = kern.layout(
                    topk_idx, topk_weights, cfg.num_experts, w, fast=self.fast, scratch=scratch,
                    plan=plan)
            if bad_status is not None:
                status.fill_(bad_status)
            kern.dispatch_store(x, topk_idx, topk_weights, slot, npr, npe, status, tr._buf_ptrs,
                                tr._sig_ptrs, tr._done[0:1], **tr._offs[parity], me=tr.rank,
                                t_max=cfg.max_tokens_per_rank, num_local=cfg.num_local_experts,
                                **op, with_meta=True, num_programs=tr.num_programs, plan=plan,
                                send_token_idx=send_idx if in_store else None,
                                num_experts=cfg.num_experts)
            return slot, send_idx

        prog = None
        if self.native and bad_status is None and t and _aligned(x, topk_idx, topk_weights):
            key = ("front", parity, t, k, x.dtype, x.stride(0), x.shape[1])
            prog = self._program(key, launch, (x, topk_idx, topk_weights, scratch))
        if prog is None:
            out = (scratch,) + launch(None)
            return out + (None,) if defer else out
        values = (x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), scratch.data_ptr(),
                  op["epoch"])
        t_w = t * w  # (views cost host time: only the two the handle keeps)
        out = scratch, scratch[o_slot:o_slot + t_w].view(t, w), scratch[o_send:o_send + t_w]
        if defer and self.gated:
            return out + ((prog, values),)
        prog.run(values, _stream(self._dev))
        return out + (None,) if defer else out

    def header(self, scratch, epoch: int, first=None,
               board=None) -> Tuple[list, torch.Tensor, torch.Tensor, float]:
        """Passes the launch gate, waits for every source's header and reads the counts (the one
        host sync of a dispatch). ``scratch`` and ``first`` (the deferred front): from
        :meth:`front` with ``defer``; ``board``: this parity's count board when the sources
        stored compact (:mod:`.compact`). Returns (info as a list of ints: error bits, headers
        ``[W, 2 + L]``, rows sent per destination ``[W]``, rows per local expert ``[L]``;
        tokens_per_expert ``[L]`` int64 CPU; offsets ``[W + 1]`` int64 device view of
        ``scratch``; seconds blocked)."""
        tr = self.tr
        w, num_local = tr.world_size, tr.cfg.num_local_experts
        n_info = 1 + w * (2 + num_local) + w + num_local
        o_out = scratch.numel() - self.header_words()
        o_offsets = o_out + kern._even(n_info)
        o_rank = kern._layout_offsets(0, tr.cfg.num_experts, w, 1)[3]
        offsets = scratch[o_offsets:o_offsets + w + 1]
        parity = epoch % 2
        op = self._op(epoch)

        def launch(plan, host=None):
            return gather_ahead.header_kernel(self, scratch, parity, op, plan, host, board)

        key = ("header" if board is None else "header_compact", parity)
        prog = self._progs.get(key)
        if prog is None and self.native:
            self._host_info(n_info)
            prog = self._program(key, lambda steps: launch(steps, self._pinned),
                                 (scratch[o_rank:o_rank + w], scratch[o_out:]))
        if prog is None:
            self._then(first, epoch, "dispatch")
            info, _ = launch(None)
            t0 = time.perf_counter()
            info = info.cpu()
            blocked = time.perf_counter() - t0
            return info.tolist(), info[n_info - num_local:], offsets, blocked
        buf_ptr, view = self._host
        base = scratch.data_ptr()
        values = (base + 8 * o_rank, base + 8 * o_out, op["epoch"])
        flag = buf_ptr + 8 * n_info
        if first is not None:
            blocked = self._gated(first, prog, values, epoch, "dispatch", flag)
        else:
            self._then(None, epoch, "dispatch")
            blocked = self._run_wait(prog, values, _stream(self._dev), flag, epoch, "dispatch")
        tokens_per_expert = torch.empty(num_local, dtype=torch.int64)
        ctypes.memmove(tokens_per_expert.data_ptr(), buf_ptr + 8 * (n_info - num_local),
                       8 * num_local)
        return view.tolist(), tokens_per_expert, offsets, blocked

    def _host_info(self, n_info: int) -> None:
        """Makes the page-locked buffer the header kernel writes the counts into over the bus:
        ``[n_info]`` int64 info, then the completion word (see ``launches.recv_header``)."""
        if self._host is None:
            self._pinned = torch.full((n_info + 1,), -1, dtype=torch.int64, pin_memory=True)
            addr = self._pinned.data_ptr()
            self._host = (addr, memoryview((ctypes.c_int64 * n_info).from_address(addr))
                          .cast("B").cast("q"))

    def dispatch_head(self, x, topk_idx, topk_weights, epoch: int, bad_status=None):
        """Front, launch gate and header of a regular dispatch (:meth:`front`, :meth:`header`):
        with a plan bound for this shape (after the first call of it, native launching with
        ``fast_launch`` >= 3, 16-byte aligned inputs, good input) straight through one native call,
        else through the two phase methods. The seconds blocked are added to the transport's
        ``blocked_s``.

        Returns:
            (scratch (the dispatch's int64 device scratch), slot ``[T, W]`` int64 view of it,
            word offset of the sent rows' token indices in scratch, header info as a list of
            ints (see :meth:`header`; None when gathered), tokens_per_expert ``[L]`` int64 CPU,
            offsets ``[W + 1]`` int64 device view of scratch, gathered: None, or when the
            native call gathered too (its counts clean, see
            :func:`~efa_ep.kernels.gda.gather_ahead.dispatch_gather`) (recv_x, recv_topk_idx,
            recv_topk_weights, rows sent per destination, rows received per source, the sent
            rows' token indices ``[S]`` int64 view of scratch or None)).
        """
        tr = self.tr
        t, k = topk_idx.shape
        parity = epoch & 1
        plan = None
        if bad_status is None and self.gated:
            plan = self._plans.get(("dispatch", parity, t, k, x.dtype, x.stride(0), x.shape[1]))
        if plan is not None:
            xp, ip, wp = x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr()
            if (xp | ip | wp) & 15:
                plan = None
        if plan is None:
            if len(self._progs) >= MAX_PROGRAMS:  # token counts that keep changing (inference)
                self._progs.clear()  # bound again on use; the plans hold programs: them too
                self._plans.clear()
            scratch, slot, _, first = self.front(x, topk_idx, topk_weights, epoch, bad_status,
                                                 defer=True)
            vals, tokens_per_expert, offsets, blocked = self.header(scratch, epoch, first)
            tr.blocked_s += blocked
            if first is not None and bad_status is None:
                gather_ahead.record_plan(self, parity, t, k, x)
            o_send = kern._layout_offsets(t, tr.cfg.num_experts, tr.world_size, k)[5]
            self._ahead = None
            return scratch, slot, o_send, vals, tokens_per_expert, offsets, None
        front, header, words, o_slot, o_send, o_rank, o_out, o_offsets, n_info, ahead = plan
        self._ahead = ahead
        bound = gather_ahead.program(self, ahead) is not None
        gathers = ahead.cap and bound
        buf_ptr = self._host[0]
        got = None
        # the whole call in C++ (fast_launch=4), outputs allocated ahead (too large: after)
        if bound and self.cpp is not None:
            return cpp_op.dispatch(self, x, topk_idx, topk_weights, plan, epoch, _stream(self._dev))
        else:
            scratch = torch.empty(words, dtype=torch.int64, device=tr.device)
            sp = scratch.data_ptr()
            delta = epoch - tr._dev_base
            values, values2 = (xp, ip, wp, sp, delta), (sp + 8 * o_rank, sp + 8 * o_out, delta)
            flag = buf_ptr + 8 * n_info
            if gathers:
                got = gather_ahead.dispatch_gather(self, front, values, header, values2, ahead,
                                                   sp + 8 * o_offsets, epoch, flag,
                                                   _stream(self._dev))
            else:
                tr.blocked_s += self._gated((front, values), header, values2, epoch, "dispatch",
                                            flag)
        return gather_ahead.head_tail(self, scratch, t, plan, got)

    def rows_seen(self, n: int) -> None:
        """The last planned dispatch received ``n`` rows and gathered them from Python: sizes
        the next calls' outputs."""
        if self._ahead is not None:
            self._ahead.fit(n)
            self._ahead = None

    def gather(self, offsets, recv_x, recv_idx, recv_w, epoch: int) -> None:
        """Copies the received rows (``offsets`` ``[W + 1]`` from :meth:`header`) out of the
        window into ``recv_x`` ``[N, H]``, ``recv_idx`` / ``recv_w`` ``[N, K]``."""
        tr = self.tr
        n = recv_x.shape[0]
        if n == 0:
            return
        parity = epoch % 2
        key = ("gather", parity, recv_idx.shape[1], recv_x.shape[1], recv_x.dtype)
        prog = self._progs.get(key)
        if prog is None:  # first call of this shape: bind the program, or launch from Python
            op = self._op(epoch)
            offs = tr._offs[parity]

            def launch(plan):
                kern.gather_rows(tr._win_ptr, offsets, recv_x, recv_idx, recv_w, tr._my_sig,
                                 tr._err, data_off=offs["data_off"], idx_off=offs["idx_off"],
                                 w_off=offs["w_off"], t_max=tr.cfg.max_tokens_per_rank, **op,
                                 wait=False, num_programs=tr.num_programs, plan=plan,
                                 **tr._wait_kw)

            if self.native:
                prog = self._program(key, launch, (offsets, recv_x, recv_idx, recv_w),
                                     ("num_rows",), (0,))
            if prog is None:
                launch(None)
                return
        prog.run((offsets.data_ptr(), recv_x.data_ptr(), recv_idx.data_ptr(), recv_w.data_ptr(),
                  n, min(n, tr.num_programs)), _stream(self._dev))

    # ---- combine ----------------------------------------------------------------------------
    def combine(self, y, state, num_tokens: int, epoch: int, kind: str, ids=None):
        """Store, launch gate and reduce of a combine (:meth:`combine_store`,
        :meth:`combine_reduce`) of ``y`` ``[N, D]`` along the dispatch state ``state`` into a
        new ``[num_tokens, D]`` tensor in y's dtype, returned (``ids``: see
        :meth:`combine_store`): with a plan bound for this shape (after the first call of it,
        ``fast_launch`` >= 3, 16-byte aligned ``y``) straight through one native call, and with
        ``fast_launch=4`` that call, the output's allocation and the programs' variables in one
        C++ call (:func:`.cpp_op.combine`)."""
        tr = self.tr
        fixed = state.fixed
        offsets = state.num_recv_W if fixed else state.recv_offsets
        parity = epoch & 1
        masked = ids is not None
        key = ("combine", parity, y.shape[1], y.dtype, y.stride(0), fixed, kind, masked)
        plan = self._plans.get(key)
        yp = y.data_ptr()
        t = num_tokens
        if plan is None or yp & 15 or not t:
            out = torch.empty(t, y.shape[1], dtype=y.dtype, device=y.device)
            first = self.combine_store(y, offsets, fixed, epoch, defer=True, ids=ids)
            self.combine_reduce(state.slot_TW, out, epoch, kind, first)
            store = self._progs.get(("cstore", parity, y.shape[1], y.dtype, y.stride(0), fixed,
                                     masked))
            reduce = self._progs.get(("creduce", parity, out.shape[1], out.dtype, kind))
            if first is not None and store is not None and reduce is not None:
                cpp = cpp_op.combine_plan(self, store, reduce, fixed) if self.cpp else None
                self._plans[key] = (store, reduce, cpp)
            return out
        store, reduce, cpp = plan
        if cpp is not None:
            return cpp_op.combine(self, y, offsets, ids, state.slot_TW, t, cpp, reduce, epoch,
                                  kind, _stream(self._dev))
        delta = epoch - tr._dev_base
        out = torch.empty(t, y.shape[1], dtype=y.dtype, device=y.device)
        n = y.shape[0]
        grid = max(1, min(tr.cfg.max_tokens_per_rank if fixed else n, tr.num_programs))
        values = (yp, offsets.data_ptr(), n, delta, grid) if not masked else \
            (yp, offsets.data_ptr(), ids.data_ptr(), n, delta, grid)
        self._gated((store, values), reduce,
                    (state.slot_TW.data_ptr(), out.data_ptr(), delta, t,
                     min(t, self.read_programs)),
                    epoch, kind)
        return out

    def combine_store(self, y, offsets, fixed: bool, epoch: int, defer: bool = False, ids=None):
        """Returns the rows of ``y`` to their sources' windows and signals (``offsets``: the
        dispatch's ``[W + 1]`` offsets, or with ``fixed`` its device ``num_recv [W]``;
        ``ids``: a weight combine's received ids, ``y``'s shape, contiguous int64: elements
        with id -1 go back as 0). ``defer``: returns the native program as ``(program,
        values)`` instead of running it (None when launched from Python), for
        :meth:`combine_reduce`."""
        tr = self.tr
        parity = epoch % 2
        op = self._op(epoch)
        t_max = tr.cfg.max_tokens_per_rank

        def launch(plan):
            kern.combine_store(y, offsets, tr._buf_ptrs, tr._sig_ptrs, tr._done[1:2],
                               data_off=tr._offs[parity]["data_off"], me=tr.rank, t_max=t_max,
                               **op, num_programs=tr.num_programs, fixed=fixed, ids=ids,
                               plan=plan)

        prog = None
        n = y.shape[0]
        tensors = (y, offsets) if ids is None else (y, offsets, ids)
        if self.native and _aligned(y):
            key = ("cstore", parity, y.shape[1], y.dtype, y.stride(0), fixed, ids is not None)
            prog = self._program(key, launch, tensors, ("num_rows", "epoch_delta"), (0,))
        if prog is None:
            launch(None)
            return None
        values = tuple(a.data_ptr() for a in tensors) + (
            n, op["epoch"], max(1, min(n if not fixed else t_max, tr.num_programs)))
        if defer and self.gated:
            return prog, values
        prog.run(values, _stream(self._dev))
        return None

    def combine_reduce(self, slot, out, epoch: int, kind: str, first=None) -> None:
        """Passes the launch gate, waits for every destination's partials and reduces them into
        ``out`` ``[T, D]``. ``first``: the deferred store of :meth:`combine_store`."""
        tr = self.tr
        parity = epoch % 2
        op = self._op(epoch)
        t = out.shape[0]

        def launch(plan):
            kern.combine_reduce(tr._win_ptr, slot, out, tr._my_sig, tr._err,
                                data_off=tr._offs[parity]["data_off"],
                                t_max=tr.cfg.max_tokens_per_rank, **op, wait=True, kind=kind,
                                num_programs=self.read_programs, plan=plan, **tr._wait_kw,
                                wait_in_kernel=self.wait_in_kernel)

        prog = self._progs.get(("creduce", parity, out.shape[1], out.dtype, kind))
        if prog is None and t and self.native:
            prog = self._program(("creduce", parity, out.shape[1], out.dtype, kind), launch,
                                 (slot, out), ("epoch_delta", "num_tokens"), (self._read_step,))
        if prog is None:
            self._then(first, epoch, kind)
            launch(None)
            return
        values = (slot.data_ptr(), out.data_ptr(), op["epoch"], t, min(t, self.read_programs))
        if first is not None:
            self._gated(first, prog, values, epoch, kind)
            return
        self._then(None, epoch, kind)
        prog.run(values, _stream(self._dev))

    # ---- cached dispatch --------------------------------------------------------------------
    def cached(self, x, state, num_rows: int, epoch: int):
        """Store, launch gate and gather of a cached dispatch (:meth:`cached_store`, the gate,
        :meth:`cached_gather`) of ``x`` ``[T, D]`` along the regular dispatch state ``state``
        into a new ``[num_rows, D]`` tensor in x's dtype, returned: with a plan bound for this
        shape (after the first call of it, ``fast_launch`` >= 3, 16-byte aligned ``x``, rows
        both ways) straight through one native call, with ``fast_launch=4`` one C++ call
        (:func:`.cpp_op.cached`)."""
        tr = self.tr
        parity = epoch & 1
        t, n = x.shape[0], num_rows
        key = cpp_op.rows_key("cached", epoch, t, x)
        plan = self._plans.get(key)
        xp = x.data_ptr()
        if plan is None or xp & 15 or not n:
            out = x.new_empty((n, x.shape[1]))
            self.cached_store(x, state.slot_TW, epoch)
            tr._issued(epoch, "cached dispatch")
            self.cached_gather(state.recv_offsets, out, epoch)
            store = self._progs.get(("cstore_x", parity, t, x.shape[1], x.dtype, x.stride(0)))
            gather = self._progs.get(("cgather", parity, out.shape[1], out.dtype))
            if self.gated and store is not None and gather is not None and t:
                cpp = cpp_op.combine_plan(self, store, gather, False) if self.cpp else None
                self._plans[key] = (store, gather, cpp)
            return out
        store, gather, cpp = plan
        if cpp is not None:
            return cpp_op.cached(self, x, state.slot_TW, state.recv_offsets, n, cpp, gather,
                                 epoch, _stream(self._dev))
        delta = epoch - tr._dev_base
        out = x.new_empty((n, x.shape[1]))
        self._gated((store, (xp, state.slot_TW.data_ptr(), delta)), gather,
                    (state.recv_offsets.data_ptr(), out.data_ptr(), delta, n,
                     min(n, self.read_programs)), epoch, "cached dispatch")
        return out

    def cached_store(self, x, slot, epoch: int, defer: bool = False):
        """Stores ``x``'s rows along a dispatch's layout ``slot`` (no ids, no header);
        ``defer``: returns the bound program as ``(program, values)`` (None: launched)."""
        tr = self.tr
        parity = epoch % 2
        op = self._op(epoch)

        def launch(plan):
            kern.dispatch_store(x, None, None, slot, None, None, None, tr._buf_ptrs,
                                tr._sig_ptrs, tr._done[0:1], **tr._offs[parity], me=tr.rank,
                                t_max=tr.cfg.max_tokens_per_rank,
                                num_local=tr.cfg.num_local_experts, **op, with_meta=False,
                                num_programs=tr.num_programs, plan=plan)

        prog = None
        t = x.shape[0]
        if self.native and t and _aligned(x):
            key = ("cstore_x", parity, t, x.shape[1], x.dtype, x.stride(0))
            prog = self._program(key, launch, (x, slot))
        if prog is None:
            launch(None)
            return None
        values = (x.data_ptr(), slot.data_ptr(), op["epoch"])
        if defer:
            return prog, values
        prog.run(values, _stream(self._dev))

    def cached_gather(self, offsets, out, epoch: int) -> None:
        """Waits for every source, then copies the received rows into ``out`` ``[N, D]``."""
        tr = self.tr
        parity = epoch % 2
        op = self._op(epoch)
        n = out.shape[0]

        def launch(plan):
            kern.gather_rows(tr._win_ptr, offsets, out, None, None, tr._my_sig, tr._err,
                             data_off=tr._offs[parity]["data_off"], idx_off=0, w_off=0,
                             t_max=tr.cfg.max_tokens_per_rank, **op, wait=True,
                             kind="cached dispatch", num_programs=self.read_programs, plan=plan,
                             **tr._wait_kw, wait_in_kernel=self.wait_in_kernel)

        key = ("cgather", parity, out.shape[1], out.dtype)
        prog = self._progs.get(key)
        if prog is None and n and self.native:
            prog = self._program(key, launch, (offsets, out), ("epoch_delta", "num_rows"),
                                 (self._read_step,))
        if prog is None:
            launch(None)
            return
        prog.run((offsets.data_ptr(), out.data_ptr(), op["epoch"], n,
                  min(n, self.read_programs)), _stream(self._dev))
