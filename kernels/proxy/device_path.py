"""CUDA rows on a host window: the routing layout and packing run as device kernels straight into
the window (``device.py``) while the host posts the round (headers once the counts are written,
rows as they are stored: no stream synchronization), one kernel for the outputs after it, and
an event that the next op waits for before peers may overwrite the window. A mixin of :class:`~efa_ep.kernels.proxy.transport.ProxyTransport`, whose state it
uses."""
from __future__ import annotations


import numpy as np
import torch

from ..base import DispatchInputError, TransportError, describe_value_errors
from ..core.variables import raw
from ..native_launch import NativeLaunchError, bind
from .options import PY_TAMPER
from .window import OP_DISPATCH, dense

from .round_ops import _prefix


_STREAMS: dict = {}  # (stream id, device index, device type) -> torch.cuda.Stream
# A dispatch's send plane goes out in chunks of about this many bytes as the device stores them
# (each chunk's end costs every storing program a system-scope release; larger chunks start
# the wire later).
_CHUNK_BYTES = 4 << 20
#: bound programs kept per transport (a new token count binds new ones); past this many, all
#: are dropped and bound again as calls need them
MAX_PROGRAMS = 512


def graph_launch() -> bool:
    """Whether bound programs go to the GPU as one CUDA graph launch each
    (``EFA_EP_PROXY_GRAPH_LAUNCH``, default on; see ``native_launch.Program``)."""
    return raw("EFA_EP_PROXY_GRAPH_LAUNCH") not in ("0", "off", "false")


def _current_stream(dev: torch.device):
    """``torch.cuda.current_stream(dev)``, the Stream object kept per stream (building one costs
    several microseconds per call on a GPU host)."""
    sid = torch._C._cuda_getCurrentStream(dev.index)
    st = _STREAMS.get(sid)
    if st is None:
        if len(_STREAMS) > 64:
            _STREAMS.clear()
        st = _STREAMS[sid] = torch.cuda.Stream(stream_id=sid[0], device_index=sid[1],
                                               device_type=sid[2])
    return st


class DevicePath:
    """:class:`ProxyTransport`'s CUDA-input path (see the module).

    Its kernels go through native programs (``native_launch``): one native call per launch
    site instead of Triton's Python launcher, bound once per shape. ``_programs`` holds them;
    ``_native_off`` says why they are off here (None: on)."""

    def _receive_device(self, x, send_token_idx, num_recv, own_start: int, own_meta_address: int,
                        got, k: int):
        """A dispatch's outputs after its round (``wire.finish``), as one kernel: the routing
        rows are checked (ids, weights, per-expert counts vs the headers) and unpacked on the
        host into pinned buffers, then :func:`~efa_ep.kernels.proxy.device.gather_dispatch`
        writes ``recv_x`` (peers' rows from the window, this rank's from ``x``), ids and
        weights on x's device. Ends with an event (the next op waits for it), no sync.

        Args:
            x: ``[T, H]`` rows (x's device). send_token_idx: ``[S]`` int64 on x's device.
            num_recv: W ints. own_start: where this rank's own rows start in the send order.
            own_meta_address: host address of this rank's own routing rows
                (``[n_me, 2K]`` int64). got: the peers' headers of this round. k: top-k.
        Returns: (recv_x ``[N, H]``, recv_topk_idx ``[N, K]`` int64, recv_topk_weights
            ``[N, K]`` float32, tokens_per_expert ``[L]`` int64 CPU).
        """
        in_idx, in_w = self._recv_routing(sum(num_recv) * k, k)
        tokens_per_expert = self._unpack_meta(num_recv, own_meta_address, k, got, in_idx, in_w)
        return self._gather_outputs(x, send_token_idx, num_recv, own_start, in_idx, in_w, k) + (
            tokens_per_expert,)

    def _gather_outputs(self, x, send_token_idx, num_recv, own_start: int, in_idx, in_w, k: int):
        """Allocates a dispatch's outputs on x's device and launches the kernel that fills them
        (peers' rows from the receive window, this rank's from ``x``, ids and weights from the
        host's checked copies ``in_idx`` / ``in_w``); ends with the reads' event. Returns
        (recv_x ``[N, H]``, recv_topk_idx ``[N, K]`` int64, recv_topk_weights ``[N, K]``
        float32)."""
        from . import device as dk

        me, dev = self.rank, x.device
        n_recv = sum(num_recv)
        recv_off, offs = self._prefix_buffer("recv_off")
        offs[:] = _prefix(num_recv)
        recv_x = torch.empty(n_recv, x.shape[1], dtype=x.dtype, device=dev)
        recv_topk_idx = torch.empty(n_recv, k, dtype=torch.int64, device=dev)
        recv_topk_weights = torch.empty(n_recv, k, dtype=torch.float32, device=dev)
        outs = (recv_x, recv_topk_idx, recv_topk_weights)
        # one native launch, bound per shape and host buffers (the received row count varies)
        key = self._gather_key(dev, k, x, recv_off, in_idx, in_w)
        prog = self._programs.get(key)
        xp, ip = x.data_ptr(), send_token_idx.data_ptr()
        if prog is None or not n_recv or (xp | ip) & 15:
            src_ptrs, nprog = self._src_ptrs(dev), self._read_programs(dev)

            def launch(plan):
                dk.gather_dispatch(x, send_token_idx, src_ptrs, recv_off,
                                   in_idx[:n_recv * k].view(-1, k) if n_recv else in_idx,
                                   in_w[:n_recv * k].view(-1, k) if n_recv else in_w,
                                   *outs, me=me, own_start=own_start, num_programs=nprog,
                                   plan=plan, **self._mark_args(dev))

            prog = self._device_program(key, launch, (x, send_token_idx) + outs,
                                        ("own_start", "num_rows", "tag"), (0,)) if n_recv else None
            if prog is None:
                launch(None)
                self._record_reads(dev)
                return outs
        prog.run((xp, ip, recv_x.data_ptr(), recv_topk_idx.data_ptr(),
                  recv_topk_weights.data_ptr(), own_start, n_recv, 0,
                  dk.reads_grid(n_recv, self._read_programs(dev))), self._cuda_stream(dev))
        self._record_reads(dev)
        return outs

    def _mark_args(self, dev: torch.device) -> dict:
        """The reading kernels' arguments for the chunk marks, launched after the round (tag 0;
        the one-call path sets its round's tag, :func:`~efa_ep.kernels.proxy.native.mark_tag`,
        as the bound program's variable ``tag``): the host marks, their copy on ``dev`` (made
        once; tags are never reset, so neither is cleared), the wire's chunk size, the deadline
        (twice the wire's: the host's waits fail first)."""
        key = ("dev_marks", dev.type, dev.index)
        dev_marks = self._buffers.get(key)
        if dev_marks is None:
            dev_marks = self._buffers[key] = torch.zeros_like(self.marks, device=dev)
        return dict(marks=self.marks, dev_marks=dev_marks, tag=0, chunk_bytes=self.chunk_bytes,
                    timeout_ns=2 * self.timeout_ms * 1_000_000)

    def _gather_key(self, dev, k: int, x, recv_off, in_idx, in_w) -> tuple:
        """The key of a dispatch's bound gather (the host buffers it reads are its constants)."""
        return ("gather", dev.index, k, x.shape[1], x.dtype, x.stride(0), recv_off.data_ptr(),
                in_idx.data_ptr(), in_w.data_ptr(), self.window.data_ptr())

    def _pack_key(self, src, idx, progress) -> tuple:
        """The key of a bound ``pack_rows`` program (one per row shape, see below)."""
        lay = self.layout
        return ("pack_rows", src.device.index, src.shape[1], src.dtype, src.stride(0), idx is None,
                progress.data_ptr(), self.window.data_ptr() + lay.off_data_send)

    def _reduce_key(self, yc, num_tokens: int) -> tuple:
        """The key of a bound reduction (its search depth follows the token count)."""
        return ("reduce", yc.device.index, yc.shape[1], yc.dtype, yc.stride(0),
                (num_tokens + 1).bit_length(), self._prefix_buffer("send_off")[0].data_ptr(),
                self.window.data_ptr())

    def _planned_ops(self):
        """This transport's :class:`~efa_ep.kernels.proxy.planned.PlannedOps`, or None where
        they cannot run (made on first use)."""
        p = self._planned
        if p is None:
            from .planned import PlannedOps

            # (no CUDA or no native launches: no bound programs, so no plans)
            p = self._planned = self._native_off is None and PlannedOps.create(self) or False
        return p or None

    def _prefix_buffer(self, name: str):
        """(``[W + 1]`` int64 pinned, its numpy view) named ``name``: rows per rank as a prefix,
        a host argument of the gather (``recv_off``) or of the reduction (``send_off``); one
        buffer each per transport, so every bound program keeps its address."""
        r = self._buffers.get(name)
        if r is None:
            t = torch.zeros(self.world_size + 1, dtype=torch.int64,
                            pin_memory=torch.cuda.is_available())
            r = self._buffers[name] = (t, t.numpy())
        return r

    def _recv_routing(self, n: int, k: int = 1):
        """(ids ``[>= n]`` int64, weights ``[>= n]`` float32, pinned): where a dispatch's
        checked routing rows (``n`` = rows x top-k ``k``) are unpacked on the host for the
        gather. Made for the most rows a dispatch can receive (W x max_tokens_per_rank) and
        grown by doubling, so their addresses (constants of the bound gathers) rarely move."""
        bufs = self._buffers.get("recv_routing")
        if bufs is None or bufs[0].numel() < n:
            bound = self.world_size * self.cfg.max_tokens_per_rank * k
            cap = max(n, 1024, bound, 2 * bufs[0].numel() if bufs is not None else 0)
            pin = torch.cuda.is_available()
            bufs = self._buffers["recv_routing"] = (
                torch.empty(cap, dtype=torch.int64, pin_memory=pin),
                torch.empty(cap, dtype=torch.float32, pin_memory=pin))
        return bufs

    def _packed_ops(self):
        """The native operations (``hostop.py``) for rows the device packed into the send area,
        when this wire reaches its window in place (a host window) with the native descriptor
        producer and no test-only header tampering; else None (the round in steps)."""
        wire = self.wire
        if (not wire.window_in_place or wire._nw is None or wire.tamper in PY_TAMPER
                or self.producer == "triton"):
            return None
        return self._op_struct()

    def _device_program(self, key, launch, tensors, ints=(), grid_steps=()):
        """The native program bound under ``key`` (:class:`~efa_ep.kernels.native_launch.Program`:
        the launches ``launch(plan)`` appends, made in one native call), bound from this call
        when new; None where this call launches from Python: no native launch library or
        driver here (:attr:`native_off` says why), CPU tensors, or a variable tensor empty or
        not 16-byte aligned (a program is compiled for aligned ones). Constant arguments (the
        window, pinned buffers, address tables) are part of ``key``."""
        if self._native_off is not None or not tensors[0].is_cuda or \
                any(t.data_ptr() & 15 or not t.numel() for t in tensors):
            return None
        prog = self._programs.get(key)
        if prog is None:
            if len(self._programs) >= MAX_PROGRAMS:  # row counts that keep changing: bound
                self._programs.clear()  # again on use (front plans keep their own)
            try:
                prog = bind(launch, tensors, ints, grid_steps, graph=graph_launch())
            except NativeLaunchError as e:
                self._native_off = f"a kernel could not be bound for native launch: {e}"
                return None
            self._programs[key] = prog  # (never None: empty tensors were refused above)
        return prog

    def _device_path(self, x) -> bool:
        """Whether a dispatch runs as the kernels of ``device.py`` (layout and packing on the
        device) rather than as torch ops around the host layout:
        ``device_layout`` on, CUDA input, a host window, rows of whole 16-byte units."""
        return (self.device_layout and self._device_kernels_for(x) and x.dim() == 2
                and (x.shape[1] * x.element_size()) % 16 == 0
                and x.shape[1] * x.element_size() <= self.row_cap)

    def _device_kernels_for(self, t) -> bool:
        """Whether ``t``'s device work runs as the kernels of ``device.py``: a CUDA tensor (or any,
        with ``device_kernels="always"``) on a host window, triton importable."""
        return (bool(self.device_kernels) and isinstance(t, torch.Tensor)
                and (t.is_cuda or self.device_kernels == "always") and not self.window.is_cuda)

    def _wait_reads(self) -> None:
        """The previous op's kernels have finished reading the receive window and the pinned
        buffers (so a header may let peers overwrite it, and the host may rewrite them)."""
        if self._reads_done is not None:
            self._reads_done.synchronize()
            self._reads_done = None

    @staticmethod
    def _cuda_stream(dev: torch.device) -> int:
        """The current CUDA stream of ``dev`` as the raw handle a native launch takes."""
        return torch._C._cuda_getCurrentRawStream(dev.index)

    @staticmethod
    def _sync(dev: torch.device) -> None:
        if dev.type == "cuda":
            _current_stream(dev).synchronize()

    def _record_reads(self, dev: torch.device) -> None:
        if dev.type != "cuda":
            return  # CPU kernels (interpreter) have finished when they return
        ev = self._buffers.get(("event", dev.index))
        if ev is None:
            ev = self._buffers[("event", dev.index)] = torch.cuda.Event()
        ev.record(_current_stream(dev))
        self._reads_done = ev

    def _src_ptrs(self, dev: torch.device) -> torch.Tensor:
        """``[W]`` int64 on ``dev``: the address of plane 0 of each source's receive region
        (pinned host memory, mapped into the GPU's address space)."""
        key = ("src_ptrs", dev.type, dev.index, self.window.data_ptr())
        t = self._buffers.get(key)
        if t is None:
            base = self.window.data_ptr()
            t = torch.tensor([base + self.layout.data_recv_off(r) for r in range(self.world_size)],
                             dtype=torch.int64).to(dev)
            self._buffers[key] = t
        return t

    def _num_programs(self, dev: torch.device) -> int:
        key = ("sms", dev.type, dev.index)
        n = self._buffers.get(key)
        if n is None:
            n = self._buffers[key] = (torch.cuda.get_device_properties(dev).multi_processor_count
                                      if dev.type == "cuda" else 4)
        return n

    def _read_programs(self, dev: torch.device) -> int:
        """Readers of :func:`~efa_ep.kernels.proxy.device.gather_dispatch` and
        ``reduce_combine`` (plus the watcher): one per SM, or, when ranks of the group share
        this GPU, the SMs split over them. A reading kernel launched before its round completes
        spins on the chunk marks; full-width spinning grids of several ranks can hold every
        SM while a peer's stores, queued behind other work on its stream (hier's local
        stage), still need one, and nothing moves until the deadline (as gda's waits)."""
        n = self._num_programs(dev)
        return max(1, n // self.ranks_per_device)

    def _dispatch_device(self, x, topk_idx, topk_weights):
        """:meth:`dispatch` of CUDA rows on a host window: layout and packing on the device
        straight into the window, the wire posted as they progress (with the host layout path's
        Python round: after one stream synchronization), then one kernel for the outputs (no
        synchronization: the next op waits for its event before its header)."""
        cfg, w, me, wire = self.cfg, self.world_size, self.rank, self.wire
        dev = x.device
        error = self._checked("dispatch", lambda: self._dispatch_error(x, topk_idx, topk_weights)
                              or self._row_cap_error(x, topk_idx))
        if error is not None:
            self._wait_reads()
            wire.round(OP_DISPATCH, {}, [0], None, None, error)  # raises on every rank
            raise TransportError(f"rank {me}: dispatch error round did not raise: {error}")
        t, k = topk_idx.shape
        L, E = cfg.num_local_experts, cfg.num_experts
        xd, idx, wts = dense(x), topk_idx.contiguous(), topk_weights.contiguous()
        front = self._front_plan(xd, idx, wts)
        meta, counts, cn, row_x, grid, o_send, words, prog = front[:8]
        progress, chunk_rows = self._progress(grid, row_x)
        scratch = torch.empty(words, dtype=torch.int64, device=dev)  # the handle keeps a view
        wire.quiesce()  # our previous writes have left the send plane the kernel overwrites
        cn[-1] = 0  # the ready word: the kernel sets it once the counts are in host memory
        xp, ip, wp = xd.data_ptr(), idx.data_ptr(), wts.data_ptr()
        if prog is None or (xp | ip | wp) & 15:
            front[8](xd, idx, wts, scratch, progress, chunk_rows)
        else:
            prog.run((xp, ip, wp, scratch.data_ptr()), self._cuda_stream(dev))
        send_token_idx = scratch[o_send:o_send + max(1, t * w)]
        ops = self._packed_ops()
        # the previous op's kernels have read the window and the pinned buffers before this
        # op's header lets peers write (queued before this op's kernels: usually done)
        self._wait_reads()
        if ops is not None:  # the round in three native calls, no stream synchronization
            # headers as soon as the counts are in host memory, then the rows chunk by chunk
            # as the device stores them
            if not ops.dispatch_packed_begin(counts, progress, chunk_rows, meta, k, row_x):
                self._sync(dev)
                self._device_routing_error(idx, wts, int(cn[0]))
            num_recv = self._after_packing(dev, ops.dispatch_packed_post)
            num_send = ops.num_send.tolist()
            s_me = sum(num_send[:me])
            in_idx, in_w = self._recv_routing(sum(num_recv) * k, k)
            tokens_per_expert = torch.empty(L, dtype=torch.int64)
            ops.dispatch_packed_complete(in_idx, in_w, tokens_per_expert)
            recv_x, recv_topk_idx, recv_topk_weights = self._gather_outputs(
                xd, send_token_idx, num_recv, s_me, in_idx, in_w, k)
            planned = self._planned_ops()
            if planned is not None and xd is x and idx is topk_idx and wts is topk_weights:
                planned.note_dispatch(x, topk_idx, topk_weights, front, in_idx, in_w,
                                      self._prefix_buffer("recv_off")[0])
            return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, self._handle(
                t, topk_idx, send_token_idx[:sum(num_send)], None, num_send, num_recv,
                recv_topk_idx)
        self._sync(dev)  # the rows, routing rows and counts are in host memory
        if cn[0]:
            self._device_routing_error(idx, wts, int(cn[0]))
        num_send = cn[1:1 + w].tolist()
        counts_E = cn[1 + w:1 + w + E].copy()
        starts = _prefix(num_send)
        s_me, e_me, s_all = starts[me], starts[me + 1], starts[-1]

        wire.begin(OP_DISPATCH, [row_x, 16 * k], num_send, extras=counts_E.reshape(w, L), fmt=k)
        xs, ms = wire.plane(0), wire.plane(1)
        if xs.numel() and xs.data_ptr() != self.window.data_ptr() + self.layout.off_data_send:
            raise TransportError(f"rank {me}: the send plane moved (at {xs.data_ptr()}, the "
                                 f"device packed at the send area's start)")
        metan = meta.numpy()[:s_all * 2 * k].reshape(s_all, 2 * k)
        msn = ms.numpy().view(np.int64).reshape(-1, 2 * k)
        msn[:s_me] = metan[:s_me]
        msn[s_me:] = metan[e_me:]
        got = wire.exchange()
        num_recv = [num_send[me] if r == me else wire.rows_from(r) for r in range(w)]
        wire.finish()
        recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert = self._receive_device(
            xd, send_token_idx, num_recv, s_me, meta.data_ptr() + s_me * 16 * k, got, k)
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, self._handle(
            t, topk_idx, send_token_idx[:s_all], None, num_send, num_recv, recv_topk_idx)

    def _front_plan(self, xd, idx, wts):
        """What a dispatch's device front (layout and packing, see :meth:`_dispatch_device`)
        needs for this shape, made once per shape: (meta, counts, counts' numpy view, row
        bytes, packing grid, word offset of the sent rows' token indices in the scratch,
        scratch words, the bound program or None, the Python launch
        ``(xd, idx, wts, scratch, progress, chunk_rows)``). Its buffers and the send plane are
        the program's constants."""
        from ..gda import launches as kern
        from . import device as dk

        dev = xd.device
        t, k = idx.shape
        key = ("front_plan", dev.index, t, k, xd.dtype, xd.stride(0), self.window.data_ptr())
        front = self._buffers.get(key)
        if front is not None:
            return front
        plans = [p for p in self._buffers if isinstance(p, tuple) and p[0] == "front_plan"]
        if len(plans) >= 64:  # token counts that keep changing (inference): keep the table small
            for p in plans:
                del self._buffers[p]
        cfg, w, me = self.cfg, self.world_size, self.rank
        E = cfg.num_experts
        meta = self._pinned("meta", max(1, t * min(w, k)) * 2 * k, torch.int64)
        counts = self._pinned("counts", 2 + w + E, torch.int64)  # then the ready word
        nsm = self._num_programs(dev)
        row_x = cfg.hidden * xd.element_size()
        grid = dk.pack_grid(t * min(w, k), nsm)
        o_send, words = kern._layout_offsets(t, E, w, k)[5::2]
        plane = self.window[self.layout.off_data_send:self.layout.off_recv]

        def run(xd, idx, wts, scratch, progress, chunk_rows, plan=None):
            lay = kern.layout(idx, wts, E, w, scratch=scratch, plan=plan)
            dk.pack_dispatch(xd, idx, wts, lay, me, plane, meta, counts, progress, chunk_rows,
                             num_programs=nsm, plan=plan)

        prog = None
        if t:  # bound from this call's tensors (a program keeps only their addresses)
            progress, chunk_rows = self._progress(grid, row_x)
            scratch = torch.empty(words, dtype=torch.int64, device=dev)
            prog = self._device_program(
                ("front", dev.index, t, k, xd.dtype, xd.stride(0), meta.data_ptr(),
                 counts.data_ptr(), progress.data_ptr(), plane.data_ptr()),
                lambda plan: run(xd, idx, wts, scratch, progress, chunk_rows, plan),
                (xd, idx, wts, scratch))
        front = (meta, counts, counts.numpy(), row_x, grid, o_send, words, prog, run)
        if prog is not None or self._native_off is not None or not t:
            self._buffers[key] = front  # (a refused binding, e.g. misaligned x: try again)
        return front

    def _after_packing(self, dev: torch.device, post):
        """Runs ``post`` (a packed round's post); when the group refuses the op for a rank's
        input (the transport stays usable) the packing kernel may still be storing: waits for
        it, so the next op's progress words start from zero (other failures break the
        transport; a hung device must not hang the raise)."""
        try:
            return post()
        except DispatchInputError:
            self._sync(dev)
            raise

    def _progress(self, grid: int, row_bytes: int):
        """(progress ``[grid]`` int64 pinned, zeroed; rows per chunk) of a packing kernel that
        stores rows of ``row_bytes`` with ``grid`` programs: ~``_CHUNK_BYTES`` a chunk, whole
        rows for every program. The words are the first ``grid`` of one buffer sized for the
        largest grid (every program bound to it keeps its address)."""
        views = self._buffers.get("progress_views")
        if views is None or grid not in views:
            cap = max(grid, 1024)
            buf = self._buffers.get("progress")
            if buf is None or buf.numel() < grid:
                buf = self._buffers["progress"] = torch.zeros(
                    cap, dtype=torch.int64, pin_memory=torch.cuda.is_available())
                views = self._buffers["progress_views"] = {}
            views[grid] = (buf[:grid], buf[:grid].numpy())
        progress, words = views[grid]
        words[:] = 0
        return progress, self._chunk_rows(grid, row_bytes)

    @staticmethod
    def _chunk_rows(grid: int, row_bytes: int) -> int:
        """Rows per progress chunk of a packing kernel of ``grid`` programs storing rows of
        ``row_bytes``: ~``_CHUNK_BYTES`` a chunk, whole rows for every program."""
        return grid * max(1, -(-_CHUNK_BYTES // (row_bytes * grid)))

    def _device_routing_error(self, idx, wts, status: int) -> None:
        """Runs the error round for routing the device layout flagged (a bad expert id or
        weight; nothing sent yet) and raises on every rank; named from a host copy (error path
        only)."""
        cfg, me = self.cfg, self.rank
        error = (describe_value_errors(cfg, me, idx.cpu(), wts.cpu())
                 or f"rank {me}: the device layout flagged the routing (status {status})")
        self.wire.round(OP_DISPATCH, {}, [0], None, None, error)
        raise TransportError(f"rank {me}: dispatch error round did not raise: {error}")

    def _pinned(self, name: str, n: int, dtype) -> torch.Tensor:
        """A flat host buffer of ``n`` elements, page-locked, reused across calls (grown when too
        small): staging of D2H copies that must not wait on pageable memory."""
        view = self._buffers.get(("pin_view", name))
        if view is not None and view.numel() == n and view.dtype == dtype:
            return view  # the same call shape as the last one: no new view
        buf = self._buffers.get(("pin", name))
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 1), dtype=dtype, pin_memory=torch.cuda.is_available())
            self._buffers[("pin", name)] = buf
        view = self._buffers[("pin_view", name)] = buf[:n]
        return view
