"""``GdaTransport``: the transport object (op sequencing, checks, the launch gate, errors),
and its CUDA graph capture. The package docstring has the protocol."""
from __future__ import annotations

import importlib
import os
import time
from typing import Optional


import torch
import torch.distributed as dist

from ..core.hosts import device_identity
from ..base import (
    STATUS_BAD_INPUT, DispatchHandle, DispatchInputError, ProtocolError, Transport,
    TransportBroken, TransportError, TransportUnavailable, align_up, local_weight_grads,
    rows_input_error, validate_dispatch_inputs,
)

from . import compact, cpp_op, fixed, refusal
from .receive import receive
from .gate import ROWS_MISPLACED, LaunchGate
from .graph import GdaGraph, capture
from .window import GdaDispatchState, WindowLayout

_MAX_WORLD = 61   # the error word is a 64-bit mask of missing sources; bits 61, 62: see below
_BAD_INPUT_BIT = 1 << 62


def availability() -> Optional[str]:
    """None when gda can run here (CUDA GPU, triton, torch symmetric memory), else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        return f"torch symmetric memory is unavailable ({e})"
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    return None


class GdaTransport(Transport):
    """GPU-initiated transport over symmetric-memory windows; contract in ``efa_ep.kernels.base``.

    Options (``create_transport(..., **options)``, identical on every rank): declared once,
    with their defaults and meanings, in ``SCHEMAS["gda"]`` of :mod:`efa_ep.kernels.options`
    (``max_topk``, ``timeout_s``, ``num_programs``, ``check_every_call``, ``check_backward``,
    ``launch_gate``, ``fast_launch``, ``layout_in_store``, ``wait_in_reduce``,
    ``gather_early``, ``graph_launch``, ``rows_in_window``, ``rows_in_window_bytes``). Where they
    need more than a line: ``rows_in_window`` 1 returns a regular dispatch's received rows and
    weights as views of the window (:mod:`.compact`), valid until the transport's next call;
    ``auto`` does so for a dispatch whose previous dispatch was large on some rank (every rank
    decides alike from the sizes posted on the launch gate; ``compact_dispatches`` counts
    them), so a caller that keeps received rows past its next call copies them;
    ``check_backward`` makes
    :meth:`after_backward` raise deferred deadline errors before the gradients are used (one host
    sync at the end of each backward pass, however many layers it crosses); ``launch_gate`` (default
    on) launches a waiting kernel only once every source has issued its stores
    (:class:`LaunchGate`); ``fast_launch`` 2 launches each op phase's kernels in one native call
    (:mod:`efa_ep.kernels.native_launch`; ``launch_path`` says which path runs,
    ``native_launch_off`` why not), 1 each kernel through
    its compiled launcher, 0 Triton's own path, 3 launches an op's two phases and the launch
    gate between them in one native call, 4 (the default) also makes a repeated regular
    dispatch one C++ call (:mod:`efa_ep.kernels.gda.cpp_op`; ``cpp_dispatch_off`` says why not,
    and a transport that cannot build it warns once and runs as 3): same kernels, same results.

    Host time: ``blocked_s`` accumulates the seconds this transport's calls spent blocked on
    the device (the dispatch's count read) or on peers' hosts (the launch gate); a call's wall
    time minus its growth of ``blocked_s`` is the host time the call itself costs.

    Synchronization: all kernels run on the current stream. ``dispatch`` blocks the CPU once
    (until its header kernel has written the counts to host memory), so it is not CUDA-graph
    capturable; ``combine`` and
    ``dispatch_cached`` do not block. Calls are collective: every rank must make the same
    sequence of calls.

    Warning: all calls of one transport must be issued on one stream (the flag protocol relies
    on stream order between consecutive ops).
    """

    name = "gda"
    state_type = GdaDispatchState

    def __init__(self, cfg, group):
        super().__init__(cfg, group)
        why = availability()
        if why is not None:
            raise TransportUnavailable(f"rank {self.rank}: gda is not available: {why}")
        if self.world_size > _MAX_WORLD:
            raise TransportError(f"gda supports up to {_MAX_WORLD} ranks, got {self.world_size}")
        from . import launches  # triton import stays lazy
        from .phases import GdaPhases
        symm_mem = importlib.import_module("torch.distributed._symmetric_memory")

        self._kern = launches
        opts = dict(cfg.options)
        self.max_topk = int(opts.get("max_topk", 16))
        self.timeout_s = float(opts.get("timeout_s", 60.0))
        self.check_every_call = bool(int(opts.get("check_every_call", 0)))
        # after_backward(): one host sync per backward pass, at its end, that raises deferred
        # deadline errors before the optimizer can use the gradients (0 = defer to the next
        # dispatch)
        self.check_backward = bool(int(opts.get("check_backward", 1)))
        self._check_queued = False  # a check waits for the end of the running backward pass
        self.fast_launch = int(opts.get("fast_launch", 4))
        self.layout_in_store = int(opts.get("layout_in_store", 1))
        self.wait_in_reduce = int(opts.get("wait_in_reduce", 0))
        self.gather_early = int(opts.get("gather_early", 2))
        self.graph_launch = int(opts.get("graph_launch", 1))
        # a regular dispatch stores its rows compact and returns them as views (module compact):
        # always (1), never (0), or (auto) when the previous dispatch was large on some rank
        self._rows_mode = str(opts.get("rows_in_window", "0")).strip().lower()
        if self._rows_mode not in ("0", "1", "auto"):
            raise TransportError(f"rank {self.rank}: gda option rows_in_window must be 0, 1 or "
                                 f"auto, got {self._rows_mode!r}")
        compact_bytes = int(opts.get("rows_in_window_bytes", 32 << 20))
        self.rows_in_window = self._rows_mode == "1"  # this dispatch's way (auto: per call)
        self.compact_dispatches = 0  # regular dispatches that stored their rows compact
        self.blocked_s = 0.0
        gate = str(opts.get("launch_gate", "auto")).lower()
        if gate not in ("auto", "0", "1", "on", "off"):
            raise TransportError(f"rank {self.rank}: gda option launch_gate must be auto, on or "
                                 f"off, got {gate!r}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(self.device)
        me = device_identity()
        peers = [None] * self.world_size
        dist.all_gather_object(peers, me, group=group)
        hosts = sorted({h for h, _ in peers})
        if len(hosts) > 1:
            raise TransportError(
                f"rank {self.rank}: gda needs every EP rank on one host (symmetric memory over "
                f"NVLink); the group spans hosts {hosts}; use transport 'proxy' across hosts")
        self.ranks_per_device = peers.count(me)
        # auto = on: ranks sharing a GPU need it (one CUDA context under MPS; see LaunchGate),
        # and on any GPU layout it is how every rank learns a peer's bad input with its words
        self.launch_gate = gate in ("auto", "1", "on")
        self._gate = LaunchGate(group, self.rank, self.world_size) if self.launch_gate else None
        if self.ranks_per_device > 1:
            # Several ranks on one GPU (tests, benchmarks): rendezvous refuses overlapping devices
            # unless told otherwise (this also disables multicast, which gda does not use).
            os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        sms = props.multi_processor_count
        # (more programs than SMs keep more rows in flight per SM: measured on one H200, 4 x SMs
        # took ~30% off a prefill D+C against 2 x SMs / ranks, at EP 2 and 4)
        default_programs = 4 * sms
        self.num_programs = int(opts.get("num_programs", default_programs))
        # at most one waiting program per SM over the ranks sharing this GPU (wait_in_reduce)
        self.wait_programs = max(1, sms // self.ranks_per_device)
        self._elem = cfg.dtype.itemsize
        self.layout = WindowLayout(world=self.world_size, t_max=cfg.max_tokens_per_rank,
                                   row_bytes=align_up(cfg.hidden * self._elem, 16),
                                   k_cap=self.max_topk, num_local=cfg.num_local_experts)
        self._offs = (self.layout.offsets(0), self.layout.offsets(1))
        self._compact_rows = -(-compact_bytes // self.layout.row_bytes)  # auto: from this size
        # auto: the block with which the C++ dispatch posts the size and makes the choice
        self._choice = (self._gate.choice_block(self._compact_rows)
                        if self._rows_mode == "auto" and self._gate is not None else 0)
        self._buf = symm_mem.empty(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        self._hdl = symm_mem.rendezvous(self._buf, group)
        # Peers' windows at the same offset inside their allocations as ours inside ours.
        delta = self._buf.data_ptr() - int(self._hdl.buffer_ptrs[self.rank])
        self._buf_ptrs = torch.tensor([int(p) + delta for p in self._hdl.buffer_ptrs],
                                      dtype=torch.int64, device=self.device)
        self._sig_ptrs = torch.tensor(list(self._hdl.signal_pad_ptrs), dtype=torch.int64,
                                      device=self.device)
        self._win_ptr = self._buf_ptrs[self.rank:self.rank + 1]
        self._my_sig = self._hdl.get_signal_pad(self.rank, (self.world_size,), dtype=torch.int32)
        self._my_sig.zero_()
        # error word: [missing-source bits (62: bad input in a fixed-capacity dispatch, 61:
        # ROWS_MISPLACED), first expired wait's epoch * 8 + kind, bad sources, misplaced ones]
        self._err = torch.zeros(4, dtype=torch.int64, device=self.device)
        launches.check_err(self._err)
        # rows of each parity's id region written per source (fixed mode clears the rest), and
        # per parity the top-k width last written (a new width makes every row stale)
        self._hw = torch.zeros(2, self.world_size, dtype=torch.int64, device=self.device)
        self._idx_k = [0, 0]
        self._idx_full = [False, False]
        self._idx_epoch = [0, 0]
        self._done = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._epoch = 0
        # Op numbers on the device are op_base[0] + a host delta, so a captured CUDA graph
        # replays with new ones: the graph ends by advancing op_base by its op count.
        # _dev_base is the value op_base holds, in stream order, when the next op runs.
        self._op_base = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._dev_base = 0
        self._capturing = False
        self._broken: Optional[str] = None
        # per-call constants, built once: the wait arguments and the header view per parity
        self._wait_kw = dict(timeout_ns=int(self.timeout_s * 1e9), max_spins=2**31 - 1,
                             use_globaltimer=True)
        n_hdr = self.world_size * self.layout.hdr_len
        self._hdr = tuple(self._buf[o["hdr_off"]:o["hdr_off"] + 8 * n_hdr].view(torch.int64)
                          .view(self.world_size, -1) for o in self._offs)
        n_board = self.layout.board_words
        self._board = tuple(self._buf[o["board_off"]:o["board_off"] + 8 * n_board]
                            .view(torch.int64) for o in self._offs)
        self._phases = GdaPhases(self, self.fast_launch)
        self._fixed_regions = {}  # (parity, top-k) -> the fixed dispatch's receive regions
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)

    @property
    def launch_path(self) -> str:
        """How kernels are launched: ``native`` (one call per op phase), ``fast`` or ``triton``."""
        return self._phases.path

    @property
    def native_launch_off(self) -> Optional[str]:
        """Why op phases are not launched natively (None when they are)."""
        return self._phases.native_off

    @property
    def cpp_dispatch_off(self) -> Optional[str]:
        """Why a repeated regular dispatch is not one C++ call (None when it is)."""
        return self._phases.cpp_off

    # ------------------------------------------------------------------------------------
    def _wait_args(self):
        return self._wait_kw

    def _op(self, epoch: int) -> dict:
        """Kernel arguments naming op ``epoch``: the device base and the delta from it (and the
        launch path)."""
        return dict(epoch=epoch - self._dev_base, op_base=self._op_base,
                    fast=self.fast_launch >= 1)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TransportBroken(f"rank {self.rank}: gda transport unusable after an earlier "
                                 f"failure ({self._broken}); create a new one")

    def _begin_op(self, op: str) -> int:
        self._check_usable()
        if not self._capturing and torch.cuda.is_current_stream_capturing():
            raise TransportError(
                f"rank {self.rank}: gda {op} inside a CUDA graph capture that the transport "
                f"does not know of: capture with GdaTransport.capture(fn), which keeps the op "
                f"numbers of every replay in step across ranks")
        self._epoch += 1
        if self._epoch >= 2**31 - 1:
            raise TransportError(f"rank {self.rank}: gda epoch counter exhausted; recreate")
        return self._epoch

    def _break(self, msg: str, epoch: int, kind: str) -> None:
        """Marks the transport unusable here and, through the launch gate, for waiting peers."""
        self._broken = self._broken or msg
        if self._gate is not None:
            self._gate.fail(self._kern.wait_record(max(epoch, 1), kind))

    def _issued(self, epoch: int, kind: str) -> None:
        """Called right after this rank enqueued its stores of op ``epoch``; with the launch
        gate, publishes that and waits until every source did the same (see LaunchGate)."""
        if self._gate is None or self._capturing:
            # While capturing nothing is launched; a replay then issues every captured store
            # in one host call, so its waits never depend on a peer's host (see capture()).
            return
        record = self._kern.wait_record(epoch, kind)
        self._gate.publish(record)
        if self._gate.passed(record):
            return
        self._await_peers(epoch, kind)

    def _await_peers(self, epoch: int, kind: str) -> None:
        """The launch gate's wait for op ``epoch`` of ``kind`` (this rank has published it):
        returns once every source has; a deadline, a failed peer or ranks in different
        operations break the transport and raise."""
        t0 = time.perf_counter()
        try:
            self._gate.wait(self._kern.wait_record(epoch, kind), self.timeout_s, kind)
        except TransportError as e:
            self._break(str(e), epoch, kind)
            raise
        finally:
            self.blocked_s += time.perf_counter() - t0

    def _device_late(self, epoch: int, kind: str, waited_s: float) -> None:
        """Breaks the transport and raises: op ``epoch``'s last kernel did not write its host
        completion word within ``waited_s`` (its kernels, or one before them on the stream,
        never finished)."""
        msg = (f"rank {self.rank}: gda {kind} (op {epoch}): the GPU did not finish the op's "
               f"count read within {waited_s:g}s (a kernel on this stream never completed: the "
               f"device hangs or another kernel holds it); the transport is unusable")
        self._break(msg, epoch, kind)
        raise TransportBroken(msg)

    def check_errors(self, op: str = "call") -> None:
        """Blocks on the stream and raises :class:`PeerTimeoutError` if any wait expired, naming
        the first op whose wait expired (its number and kind) and the missing source ranks; or
        :class:`DispatchInputError` if a fixed-capacity dispatch received bad-input status;
        :class:`ProtocolError` if a compact dispatch's source broke its announcement."""
        t0 = time.perf_counter()
        bits, record, bad, wrong = self._err.tolist()  # waits for the stream: blocked
        self.blocked_s += time.perf_counter() - t0
        refusal.raise_missing(self, bits & ~(_BAD_INPUT_BIT | ROWS_MISPLACED), record)
        if bits & ROWS_MISPLACED:
            msg = (f"rank {self.rank}: gda dispatch (rows_in_window): source rank(s) "
                   f"{[s for s in range(self.world_size) if (wrong >> s) & 1]} stored other rows "
                   f"than they announced, or elsewhere (the ranks' count boards disagree)")
            self._break(msg, self._epoch, "dispatch")
            raise ProtocolError(msg)
        if bits & _BAD_INPUT_BIT:
            ranks = [s for s in range(self.world_size) if (bad >> s) & 1]
            msg = (f"rank {self.rank}: EP rank(s) {ranks} passed invalid inputs to a "
                   f"fixed-capacity dispatch (see their error); its rows were marked unused and "
                   f"later combines of this transport return NaN")
            self._break(msg, self._epoch, "dispatch")
            raise DispatchInputError(msg)

    def after_backward(self) -> None:
        """See ``Transport.after_backward``: with ``check_backward`` (default 1) raises
        :class:`PeerTimeoutError` if any wait of the layer (forward combine included) expired.
        Called inside a backward pass (the dispatcher's autograd nodes), the check runs once,
        when the pass ends (an autograd engine callback), for every layer over this transport:
        one host sync per pass instead of one per layer, so the host keeps queueing the other
        layers' backward while the GPU runs. Called outside one, it checks at once. Without it
        a deadline expiry in a layer's backward would leave wrong rows in the gradients and be
        raised only by the next dispatch, after the optimizer step."""
        if not self.check_backward or self._capturing:  # no host sync inside a capture
            return
        if self._check_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except RuntimeError:  # not inside a backward pass
            self.check_errors("backward")
            return
        self._check_queued = True

    def _backward_done(self) -> None:
        """The check :meth:`after_backward` queued, run by autograd when the pass ends."""
        self._check_queued = False
        self.check_errors("backward")

    def _note_idx_width(self, parity: int, k: int) -> bool:
        """Records that this op writes parity ``parity``'s id region with top-k width ``k``;
        returns (and clears) whether every row of it must be treated as stale."""
        if self._idx_k[parity] != k:
            self._idx_k[parity] = k
            self._idx_full[parity] = True
        self._idx_epoch[parity] = self._epoch
        full, self._idx_full[parity] = self._idx_full[parity], False
        return full

    def _region(self, off: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self._buf[off:off + nbytes].view(dtype)

    def _host_check(self, x, topk_idx, topk_weights) -> Optional[str]:
        """The contract's host-side checks (no sync; value checks run on the device in the
        layout kernel) plus this window's limits: top-k capacity and this rank's GPU."""
        error = validate_dispatch_inputs(self.cfg, self.rank, x, topk_idx, topk_weights,
                                         value_checks=False)
        if error is not None:
            return error
        who = f"rank {self.rank}"
        if topk_idx.shape[1] > self.max_topk:
            return (f"{who}: top-k {topk_idx.shape[1]} > the gda window's max_topk="
                    f"{self.max_topk}; create the transport with max_topk={topk_idx.shape[1]}")
        if x.device != self.device:
            return f"{who}: x, topk_idx and topk_weights must be on {self.device}, got {x.device}"
        return None

    def _check_row_fits(self, d: int, dtype: torch.dtype, what: str) -> None:
        nbytes = d * dtype.itemsize
        if nbytes > self.layout.row_bytes:
            raise DispatchInputError(
                f"rank {self.rank}: {what} rows of {d} x {dtype} ({nbytes} bytes) exceed the gda "
                f"window row capacity {self.layout.row_bytes} bytes (hidden={self.cfg.hidden} x "
                f"{self.cfg.dtype})")

    # ------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights):
        """See ``efa_ep.kernels.base``. Blocks the CPU once for the counts (not graph-safe).

        Args:
            x: ``[T, H]`` cfg.dtype, this rank's GPU. topk_idx: ``[T, K]`` int64, -1 = unused.
            topk_weights: ``[T, K]`` float32.
        Returns:
            recv_x ``[N, H]``, recv_topk_idx ``[N, K]`` int64 (local ids, -1 elsewhere),
            recv_topk_weights ``[N, K]`` float32, tokens_per_expert ``[L]`` int64 CPU, handle.
        """
        # the way (rows_in_window=auto: chosen here) and, for a shape seen before with its
        # inputs as then, the whole dispatch in one C++ call (None: not that case, nothing ran)
        out = compact.planned_dispatch(self, x, topk_idx, topk_weights)
        self.compact_dispatches += self.rows_in_window
        if out is not None:
            return out
        cfg = self.cfg
        if self._capturing:
            raise TransportError(
                f"rank {self.rank}: gda dispatch reads the receive counts on the host and "
                f"cannot be captured in a CUDA graph; use dispatch_fixed inside capture()")
        error = self._host_check(x, topk_idx, topk_weights)
        if error is not None:  # take part with no rows and a bad status: nobody waits
            x = torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=self.device)
            topk_idx = torch.empty(0, 1, dtype=torch.int64, device=self.device)
            topk_weights = torch.empty(0, 1, dtype=torch.float32, device=self.device)
        x = x.contiguous() if x.stride(-1) != 1 else x
        topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        if self.rows_in_window:
            return compact.dispatch(self, x, topk_idx, topk_weights, error)
        epoch = self._begin_op("dispatch")
        if error is not None and self._gate is not None:
            self._gate.post_text(epoch, error)  # before publishing: peers read it later
        # layout, stores, the launch gate, then the one host sync per dispatch
        head = self._phases.dispatch_head(x, topk_idx, topk_weights, epoch,
                                          None if error is None else STATUS_BAD_INPUT)
        return self.dispatch_tail(x, topk_idx, topk_weights, epoch, head, error)

    def dispatch_tail(self, x, topk_idx, topk_weights, epoch: int, head, error=None):
        """The rest of dispatch op ``epoch`` after its header ran (``head``: what
        ``GdaPhases.dispatch_head`` returns): the counts checked and the rows gathered unless
        the native call did both, then the handle. ``error``: this rank's refusal of its own
        input (it took part with no rows). Returns what :meth:`dispatch` returns."""
        k = topk_idx.shape[1]
        phases = self._phases
        scratch, slot, o_send, vals, tokens_per_expert, recv_offsets, got = head
        if self._note_idx_width(epoch % 2, k):
            self._idx_full[epoch % 2] = True  # only a fixed-capacity receive clears rows
        send_idx = None
        if got is not None:  # gathered by the native call, its counts checked there
            recv_x, recv_idx, recv_w, num_send, num_recv, send_idx = got
        else:
            recv_x, recv_idx, recv_w, num_send, num_recv = receive(
                self, vals, recv_offsets, epoch, k, error, topk_idx, topk_weights)
            phases.rows_seen(recv_x.shape[0])
        if send_idx is None:
            send_idx = scratch.as_strided((sum(num_send),), (1,), o_send)
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=recv_x.shape[0], topk_idx=topk_idx,
            send_token_idx=send_idx,
            num_send_per_rank=tuple(num_send),
            num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_idx,
            state=GdaDispatchState(owner=self.uid, slot_TW=slot, recv_offsets=recv_offsets,
                                   epoch=epoch))
        return recv_x, recv_idx, recv_w, tokens_per_expert, handle

    def dispatch_fixed(self, x, topk_idx, topk_weights):
        """Fixed-capacity dispatch: no host sync, no receive copy, static launch grids.

        Args: as :meth:`dispatch`.
        Returns:
            recv_x ``[W * T_MAX, H]`` cfg.dtype, recv_topk_idx ``[W * T_MAX, K]`` int64,
            recv_topk_weights ``[W * T_MAX, K]`` float32: **views of this transport's window**,
            rows ``s * T_MAX + j`` for ``j < num_recv_W[s]`` hold what source s sent (in its
            token order), every other row has ids -1 and weights 0 (mask with ids >= 0; its
            ``recv_x`` row is stale). num_recv_W ``[W]`` int64 and tokens_per_expert ``[L]``
            int64, on the device. handle: pass to :meth:`combine` (``y`` ``[W * T_MAX, D]``,
            rows in the same layout; rows of unused slots are ignored).

        Lifetime (the low-latency rule of DeepEP): the views are overwritten by this
        transport's op two calls later (window parity); copy what must outlive that. Bad
        inputs cannot raise on peers without a host sync: they raise here on the offending
        rank; its peers get every row marked unused and raise at :meth:`check_errors` (or the
        next ``dispatch`` / ``after_backward``), and later combines return NaN.
        Synchronization: none with the host; all work on the current stream.
        """
        return fixed.dispatch(self, x, topk_idx, topk_weights)

    def dispatch_cached(self, x, handle):
        """Replays ``handle``'s layout for ``x`` ``[T, D]`` (any dtype whose rows fit the window
        row): returns ``[N, D]``. No host sync (deadline errors are deferred, see the class)."""
        phases = self._phases
        if phases.cpp:  # as combine's
            out = cpp_op.cached_planned(phases, x, handle)
            if out is None:
                out = fixed.cached_planned(self, x, handle)
            if out is not None:
                return out
        try:
            st = self.handle_state(handle)
            error = rows_input_error(self.rank, "cached dispatch input x", x, handle.num_tokens,
                                     device=self.device)
            if error is not None:
                raise DispatchInputError(error)
            self._check_row_fits(x.shape[1], x.dtype, "cached dispatch")
        except DispatchInputError as e:
            refusal.refuse(self, str(e), "cached dispatch")
        epoch = self._begin_op("dispatch_cached")
        offs = self._offs[epoch % 2]
        x = x.contiguous() if (x.shape[1] > 1 and x.stride(1) != 1) else x
        if st.fixed:  # the receive buffer is the window: wait, then return a view of it
            fixed.cached(self, x, st.slot_TW, epoch)
            refusal.raise_if_refused(self, epoch, "cached dispatch")  # the op is whole
            rows = handle.num_recv_tokens
            return self._region(offs["data_off"], rows * x.shape[1] * x.element_size(),
                                x.dtype).view(rows, x.shape[1])
        out = self._phases.cached(x, st, handle.num_recv_tokens, epoch)  # store, gate, gather
        return self._finish(epoch, "cached dispatch", out, "dispatch_cached")

    def combine(self, y, handle):
        """``y`` ``[N, D]`` (rows received by ``handle``'s dispatch) -> ``[T, D]`` in y's dtype:
        per token the float32 sum over destination ranks ascending, bit-equal to ``torch``.
        No host sync (deadline errors are deferred, see the class)."""
        phases = self._phases
        # a shape seen before, its input as then: one C++ call that checks it and runs it all
        out = cpp_op.combine_planned(phases, y, handle) if phases.cpp else None
        if out is None:
            return self._combine(y, handle, "combine")
        return out

    def _finish(self, epoch: int, kind: str, out, op: Optional[str] = None):
        """``out`` of op ``epoch`` (of ``kind``, the call ``op``) after the group's refusal
        check (and with ``check_every_call``, the deferred errors)."""
        refusal.raise_if_refused(self, epoch, kind)
        if self.check_every_call and not self._capturing:
            self.check_errors(op or kind)
        return out

    def combine_topk_weights(self, grad_recv_topk_weights, handle):
        """See ``Transport.combine_topk_weights``; ``[N, K]`` float32 -> ``[T, K]`` float32."""
        g = grad_recv_topk_weights
        phases = self._phases
        out = cpp_op.weight_combine_planned(phases, g, handle) if phases.cpp else None
        if out is not None:  # (as combine's)
            return out
        error = self.handle_error(handle) or rows_input_error(
            self.rank, "combine_topk_weights input", g, handle.num_recv_tokens,
            width=handle.recv_topk_idx.shape[1], device=self.device)
        if error is not None:
            refusal.refuse(self, error, "weight combine")
        st = handle.state
        if st.fixed and self._idx_epoch[st.epoch % 2] != st.epoch:
            refusal.refuse(self, f"rank {self.rank}: combine_topk_weights with a fixed-capacity "
                           f"handle of op {st.epoch}: its window ids were overwritten by a later "
                           f"dispatch (views live until the op two calls later)",
                           "weight combine")
        ids = handle.recv_topk_idx
        if g.dtype == torch.float32 and g.stride() == (g.shape[1], 1) and ids.is_contiguous():
            # the store kernel returns the slots of experts elsewhere as 0: no mask kernels
            return self._combine(g, handle, "weight combine", ids=ids)
        return self._combine(local_weight_grads(g, ids), handle, "weight combine")

    def _combine(self, y, handle, kind: str, ids=None):
        try:
            st = self.handle_state(handle)
            error = rows_input_error(self.rank, "combine input y", y, handle.num_recv_tokens,
                                     device=self.device)
            if error is not None:
                raise DispatchInputError(error)
            self._check_row_fits(y.shape[1], y.dtype, kind)
        except DispatchInputError as e:
            refusal.refuse(self, str(e), kind)
        epoch = self._begin_op(kind)
        y = y.contiguous() if (y.shape[1] > 1 and y.stride(1) != 1) else y
        out = self._phases.combine(y, st, handle.num_tokens, epoch, kind, ids)  # launch gate too
        return self._finish(epoch, kind, out)

    def _barrier_op(self) -> None:
        """An op that moves no data: every rank signals every peer and waits for all of them
        (one single-program store launch and one wait). Keeps a captured op count even."""
        refusal.signal_only_op(self, self._begin_op("combine"), "combine")

    def capture(self, fn, *, warmup: int = 1, pool=None) -> GdaGraph:
        """Captures ``fn()`` in a CUDA graph of this transport's ops (collective: every rank
        captures the same sequence); see :func:`efa_ep.kernels.gda.graph.capture`."""
        return capture(self, fn, warmup=warmup, pool=pool)

    def close(self) -> None:
        """Drops the windows (idempotent). Collective in spirit: peers may still map them."""
        for name in ("_hdl", "_buf", "_buf_ptrs", "_sig_ptrs", "_win_ptr", "_my_sig"):
            if hasattr(self, name):
                delattr(self, name)
        self._broken = self._broken or "closed"
        if getattr(self, "_gate", None) is not None:
            self._gate.fail(-1)
            self._gate.close()
            self._gate, self._choice = None, 0
