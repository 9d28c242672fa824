"""The proxy's operations as wire rounds (:class:`~efa_ep.kernels.proxy.wire.Wire`): dispatch,
cached dispatch, combine and the weight combine for rows on the host or in a device window
(routing on the host, packing into the send area, unpacking and reducing what arrived); CPU
rows on a host window take ``hostop.py``'s two native calls instead, CUDA rows on a host window
packed rounds (a kernel stores the rows into the send area while the native calls post them;
the dispatch's in :mod:`~efa_ep.kernels.proxy.device_path`). A mixin of
:class:`~efa_ep.kernels.proxy.transport.ProxyTransport`, whose state it uses."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import numpy as np
import torch

from ..base import (
    DispatchHandle, HandleState, TransportError, describe_value_errors, local_weight_grads,
    reduce_rows_by_rank,
)
from ..core.handles import frozen_with
from . import native
from .hostop import HostOps
from .options import PY_TAMPER
from .ring import triton_producer
from .window import HDR_FIXED, OP_CACHED, OP_COMBINE, OP_DISPATCH, dense, row_format
from .wire import ProtocolViolation


def _prefix(counts) -> list:
    """``[0, c0, c0 + c1, ...]``: where each rank's block starts (and the total, last)."""
    return [0, *itertools.accumulate(counts)]


# dtypes combine's native reduction takes (others: torch ops)
_NATIVE_DT = {torch.float32: native.DT_F32, torch.bfloat16: native.DT_BF16}


@dataclasses.dataclass(frozen=True)
class ProxyHandleState(HandleState):
    """``DispatchHandle.state`` of a proxy dispatch.

    Attributes:
        owner: the transport object that made it (:class:`~efa_ep.kernels.base.HandleState`).
        send_token_idx_cpu: ``[S]`` int64 CPU, the handle's ``send_token_idx`` on the host (the
            handle keeps it on x's device too), for CPU rows without a device copy; None when
            the layout ran on the device (the device path of a CUDA dispatch).
    """

    send_token_idx_cpu: Optional[torch.Tensor]


class RoundOps:
    """:class:`ProxyTransport`'s operations through wire rounds (see the module)."""

    def _dispatch(self, x, topk_idx, topk_weights):
        cfg, w, me, wire = self.cfg, self.world_size, self.rank, self.wire
        planned = self._planned_ops()
        if planned is not None:  # a case that ran before: one native call (planned.py)
            out = planned.dispatch(x, topk_idx, topk_weights)
            if out is not None:
                return out
        dev = x.device
        if self._device_path(x):
            return self._dispatch_device(x, topk_idx, topk_weights)
        self._wait_reads()
        error = self._checked("dispatch", lambda: self._dispatch_error(x, topk_idx, topk_weights))
        ops = self._host_ops(x, topk_idx, topk_weights) if error is None else None
        if ops is not None and (error := self._row_cap_error(x, topk_idx)) is None:
            res = ops.dispatch(dense(x), dense(topk_idx), dense(topk_weights))
            if res is not None:
                recv_x, recv_idx, recv_w, tpe, send_idx, num_send, num_recv = res
                return recv_x, recv_idx, recv_w, tpe, self._handle(
                    x.shape[0], topk_idx, send_idx, send_idx, num_send, num_recv, recv_idx)
            error = (describe_value_errors(cfg, me, topk_idx, topk_weights)
                     or f"rank {me}: the routing layout refused the routing values")
        route = None
        if error is None:
            try:
                route = self._route(topk_idx, topk_weights)
                error = route if isinstance(route, str) else self._row_cap_error(x, topk_idx)
            except Exception as e:
                # a local failure while preparing still reaches every peer through the status
                error = f"rank {me}: dispatch failed while packing rows: {type(e).__name__}: {e}"
        if error is not None:
            wire.round(OP_DISPATCH, {}, [0], None, None, error)  # raises on every rank
            raise TransportError(f"rank {me}: dispatch error round did not raise: {error}")
        send_idx_cpu, meta, num_send, counts = route
        k, H, L = topk_idx.shape[1], cfg.hidden, cfg.num_local_experts
        starts = _prefix(num_send)
        s_me, e_me = starts[me], starts[me + 1]
        self._select_producer(dev)
        send_idx = send_idx_cpu if dev.type == "cpu" else send_idx_cpu.to(dev, non_blocking=True)
        row_x = H * x.element_size()

        # 1. headers out (counts in them); our previous writes have left the send side
        wire.begin(OP_DISPATCH, [row_x, 16 * k], num_send, extras=counts.reshape(w, L), fmt=k)
        # 2. pack while the headers fly: token rows straight into the registered send area (one
        #    gather on x's device, then one D2H copy for a GPU input), routing rows from the layout
        xs, ms = wire.plane(0), wire.plane(1)
        if s_me == 0 or e_me == starts[-1]:  # the peers' rows are one run of send_idx
            peer_idx = send_idx[e_me:] if s_me == 0 else send_idx[:s_me]
        else:
            peer_idx = torch.cat([send_idx[:s_me], send_idx[e_me:]])
        if xs is not None:
            self._gather_into(xs.view(x.dtype).view(-1, H), x, peer_idx)
        else:  # rows not a multiple of 16 bytes: one slot per destination
            for d in range(w):
                if d != me and num_send[d]:
                    self._gather_into(wire.slot(0, d).view(x.dtype).view(-1, H), x,
                                      send_idx[starts[d]:starts[d + 1]])
        if ms.device.type == "cpu":
            msn = ms.numpy().view(np.int64).reshape(-1, 2 * k)
            msn[:s_me] = meta[:s_me]
            msn[s_me:] = meta[e_me:]
        elif ms.numel():  # a device window
            ms.copy_(torch.from_numpy(np.concatenate([meta[:s_me], meta[e_me:]])).view(torch.uint8).view(ms.shape))
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the D2H copies are in the window
        # 3. the peers' headers (checked), then our data out
        got = wire.exchange()
        num_recv = [num_send[me] if r == me else wire.rows_from(r) for r in range(w)]
        rstarts = _prefix(num_recv)
        n_recv = rstarts[-1]
        if self._device_kernels_for(x):  # 4-6 as one kernel after the data arrived
            wire.finish()
            recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert = self._receive_device(
                dense(x), send_idx, num_recv, s_me, self._meta_ptr + s_me * 16 * k, got, k)
            return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, self._handle(
                x.shape[0], topk_idx, send_idx, send_idx_cpu, num_send, num_recv, recv_topk_idx)
        # 4. this rank's own rows go straight into the output while the peers' rows fly
        recv_x = torch.empty(n_recv, H, dtype=x.dtype, device=dev)
        torch.index_select(x, 0, send_idx[s_me:e_me], out=recv_x[rstarts[me]:rstarts[me + 1]])
        # 5. the peers' rows: one copy each out of the window (H2D for a GPU input)
        wire.finish()
        for r in range(w):
            if r != me and num_recv[r]:
                recv_x[rstarts[r]:rstarts[r + 1]].copy_(wire.recv(r, 0).view(x.dtype).view(-1, H),
                                                         non_blocking=True)
        # 6. routing rows: checked (ids, weights, per-expert counts vs the header) and unpacked
        recv_topk_idx = torch.empty(n_recv, k, dtype=torch.int64)
        recv_topk_weights = torch.empty(n_recv, k, dtype=torch.float32)
        tokens_per_expert = self._unpack_meta(num_recv, self._meta_ptr + s_me * 16 * k, k, got,
                                              recv_topk_idx, recv_topk_weights)
        if dev.type != "cpu":
            recv_topk_idx = recv_topk_idx.to(dev, non_blocking=True)
            recv_topk_weights = recv_topk_weights.to(dev, non_blocking=True)
            torch.cuda.current_stream(dev).synchronize()  # the window is read before our next header
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, self._handle(
            x.shape[0], topk_idx, send_idx, send_idx_cpu, num_send, num_recv, recv_topk_idx)

    def _handle(self, num_tokens, topk_idx, send_idx, send_idx_cpu, num_send, num_recv,
                recv_topk_idx):
        """The dispatch's handle: rows sent per destination ``num_send [W]`` in ``send_idx``
        order (``send_idx_cpu``: its host copy, or None), rows received per source
        ``num_recv [W]``."""
        st = frozen_with(ProxyHandleState,
                         {"owner": self.uid, "send_token_idx_cpu": send_idx_cpu})
        return frozen_with(DispatchHandle, {
            "num_tokens": num_tokens, "num_recv_tokens": sum(num_recv), "topk_idx": topk_idx,
            "send_token_idx": send_idx, "num_send_per_rank": tuple(num_send),
            "num_recv_per_rank": tuple(num_recv), "recv_topk_idx": recv_topk_idx, "state": st})

    def _route(self, topk_idx, topk_weights):
        """The routing layout (native, on the host: one D2H of the routing for a GPU input, never
        of the rows), with the value checks of the contract. Returns (send_idx ``[S]`` int64 CPU,
        meta ``[S, 2K]`` int64 (scratch, valid for this call), rows per rank (W ints),
        ``[E]`` int64 (token, expert) pairs per expert), or the value error's message."""
        cfg, w = self.cfg, self.world_size
        t, k = topk_idx.shape
        if topk_idx.is_cuda:  # both to pinned staging, one sync
            idxh = self._pinned("idx", t * k, torch.int64).view(t, k)
            wh = self._pinned("w", t * k, torch.float32).view(t, k)
            idxh.copy_(topk_idx, non_blocking=True)
            wh.copy_(topk_weights, non_blocking=True)
            torch.cuda.current_stream(topk_idx.device).synchronize()
        else:
            idxh, wh = dense(topk_idx), dense(topk_weights)
        cap = t * min(w, k)
        # pinned for a GPU input: its copy to the device does not wait (torch's caching host
        # allocator reuses the block only after that copy completed)
        send_idx = torch.empty(cap, dtype=torch.int64, pin_memory=topk_idx.is_cuda)
        if self._meta_buf.shape[0] < cap * 2 * k:
            self._meta_buf = np.empty(cap * 2 * k, dtype=np.int64)
            self._meta_ptr = self._meta_buf.ctypes.data
        meta = self._meta_buf
        num_send, counts, flags, pa = self._num_send, self._counts_E, self._i64_out, self._addr
        s = native.route_layout(idxh.data_ptr(), wh.data_ptr(), t, k, cfg.num_experts, w,
                                send_idx.data_ptr(), self._meta_ptr, cap, pa["num_send"],
                                pa["counts_E"], pa["layout"], pa["i64"])
        if s < 0:
            return (describe_value_errors(cfg, self.rank, idxh, wh)
                    or f"rank {self.rank}: the routing layout failed ({s}, flags {int(flags[0])})")
        return send_idx[:s], meta[:s * 2 * k].reshape(s, 2 * k), num_send.tolist(), counts

    def _host_ops(self, *tensors) -> Optional[HostOps]:
        """The native operations (``hostop.py``) when they apply: CPU tensors on a host window
        (reached in place), the native descriptor producer, no test-only header tampering and
        no forced device kernels; else None (the round in steps, below)."""
        wire = self.wire
        if (not wire.window_in_place or wire._nw is None or wire.tamper in PY_TAMPER
                or self.producer == "triton" or self.device_kernels == "always"
                or any(t.device.type != "cpu" for t in tensors)):
            return None
        return self._op_struct()

    def _op_struct(self) -> HostOps:
        """This transport's :class:`HostOps` on its current wire (made once, again after the
        wire changed)."""
        wire, ops = self.wire, self._hostops
        if ops is None or not ops.bound_to(wire):
            cfg = self.cfg
            ops = self._hostops = HostOps(wire, cfg.num_experts, cfg.num_local_experts,
                                          cfg.max_tokens_per_rank)
        return ops

    def _gather_into(self, out: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> None:
        """``out[i] = x[idx[i]]`` into a view of the window: in place when both are on one device;
        for a GPU input and a host window one gather on the device and one D2H copy
        (asynchronous: the caller syncs)."""
        if not idx.numel():
            return
        if out.device == x.device:  # a CPU input, or a device window (hmem)
            torch.index_select(x, 0, idx, out=out)
        else:
            out.copy_(x.index_select(0, idx), non_blocking=True)

    def _unpack_meta(self, num_recv, own_meta_address: int, k: int, got: np.ndarray,
                     out_idx: torch.Tensor, out_w: torch.Tensor) -> torch.Tensor:
        """The routing rows of a round's steps, checked and unpacked (efa_unpack_meta) into
        ``out_idx`` / ``out_w`` (host, ``>= [N, K]`` int64 / float32, source order); returns
        tokens_per_expert ``[L]`` int64. ``own_meta_address``: this rank's own rows (host)."""
        w, me, wire, L = self.world_size, self.rank, self.wire, self.cfg.num_local_experts
        srcs, nr, chk = self._meta_srcs, self._meta_n, self._meta_check
        keep = []  # host copies of a device window's routing rows
        for r in range(w):
            nr[r], chk[r] = num_recv[r], r != me
            m = None if r == me else wire.recv(r, 1)
            if m is not None and m.device.type != "cpu":
                keep.append(m := m.cpu())
            srcs[r] = own_meta_address if m is None else m.data_ptr()
        tokens_per_expert = torch.empty(L, dtype=torch.int64)
        pa = self._addr
        bad = native.unpack_meta(w, k, L, pa["srcs"], pa["n"], pa["check"],
                                 wire.got_address + HDR_FIXED * 8, got.shape[1], out_idx.data_ptr(),
                                 out_w.data_ptr(), tokens_per_expert.data_ptr(), pa["counts_L"], pa["i64"])
        if bad >= 0:
            self._meta_violation(bad, wire.recv(bad, 1), k, got)
        return tokens_per_expert

    def _meta_violation(self, src: int, m: torch.Tensor, k: int, got: np.ndarray):
        """Raises the :class:`ProtocolViolation` efa_unpack_meta found in rank ``src``'s routing
        rows ``m`` (``[n, 16K]`` uint8, any device), named by C (efa_describe_meta)."""
        L = self.cfg.num_local_experts
        m = m.cpu().contiguous().view(torch.int64).view(-1, 2 * k)
        counts = np.ascontiguousarray(got[src, HDR_FIXED:HDR_FIXED + L], dtype=np.int64)
        raise ProtocolViolation(self.wire._checks.describe_meta(
            src, m.data_ptr(), m.shape[0], k, L, counts.ctypes.data))

    def _select_producer(self, dev: torch.device) -> None:
        """Who writes a round's data descriptors: the native host producer (``auto``, ``torch``),
        or the Triton kernel (``triton``). Every round synchronizes the stream before its data
        is posted (the rows are staged or written by the device first), so for ``auto`` the
        Triton producer would only add launches: about 0.5 ms of Python per round on the H200
        host, against a few microseconds for efa_post_messages."""
        wire = self.wire
        if self.producer == "triton":
            wire.use_triton = triton_producer() is not None
            if not wire.use_triton:
                raise TransportError("producer='triton' needs triton (pip install triton)")
        else:
            wire.use_triton = False
        wire.triton_device = dev

    def _send_idx(self, handle, device: torch.device) -> torch.Tensor:
        """``[S]`` int64 source token of each sent row, on ``device`` (the handle keeps both)."""
        if device.type != "cpu" or handle.state.send_token_idx_cpu is None:
            return handle.send_token_idx.to(device)
        return handle.state.send_token_idx_cpu

    def _dispatch_cached(self, x, handle):
        planned = self._planned_ops()
        if planned is not None:  # a case that ran before: one native call (planned.py)
            out = planned.cached(x, handle)
            if out is not None:
                return out
        self._wait_reads()
        error = self._checked("dispatch_cached", lambda: self._handle_error(handle)
                              or self._rows_error("dispatch_cached input x", x, handle.num_tokens, handle))
        if error is not None:
            self.wire.round(OP_CACHED, {}, [0], None, None, error)
        w, me, wire = self.world_size, self.rank, self.wire
        dev = x.device
        self._select_producer(dev)
        idx = self._send_idx(handle, dev)
        num_send, num_recv = list(handle.num_send_per_rank), list(handle.num_recv_per_rank)
        starts = _prefix(num_send)
        rstarts = _prefix(num_recv)
        d_cols = x.shape[1]
        row_bytes = d_cols * x.element_size()
        if row_bytes > self.row_cap:  # column rounds
            rows_to = {d: x.index_select(0, idx[starts[d]:starts[d + 1]]) for d in range(w) if d != me}
            self_rows = x.index_select(0, idx[starts[me]:starts[me + 1]])
            return wire.exchange_rows(OP_CACHED, rows_to, self_rows, num_recv)
        xd = dense(x)
        if self._device_kernels_for(xd) and row_bytes % 16 == 0 and xd.shape[0]:
            ops = self._packed_ops()
            if ops is not None:  # rows straight into the send area, the round in native calls
                return self._dispatch_cached_packed(ops, xd, idx, num_send, num_recv, starts,
                                                    rstarts)
        ops = self._host_ops(x, idx)
        if ops is not None:
            return ops.dispatch_cached(xd, idx, num_send, num_recv, row_format(xd))
        wire.begin(OP_CACHED, [row_bytes], num_send, n_recv=num_recv, fmt=row_format(xd))
        self._pack_rows(xd, idx, num_send, starts, gather=True)
        wire.exchange()
        out = torch.empty(rstarts[-1], d_cols, dtype=x.dtype, device=dev)
        torch.index_select(xd, 0, idx[starts[me]:starts[me + 1]], out=out[rstarts[me]:rstarts[me + 1]])
        wire.finish()
        for r in range(w):
            if r != me and num_recv[r]:
                out[rstarts[r]:rstarts[r + 1]].copy_(wire.recv(r, 0).view(x.dtype).view(-1, d_cols),
                                                     non_blocking=True)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the window is read before our next header
        return out

    def _dispatch_cached_packed(self, ops, xd, idx, num_send, num_recv, starts, rstarts):
        """A cached dispatch of device rows ``xd`` ``[T, D]`` on a host window: the handle's
        rows gathered by the device into the send area chunk by chunk, the headers while it
        stores, the rows posted as they are stored; then the output ``[N, D]`` in source order
        (this rank's rows gathered from ``xd``, the peers' copied out of the window), ending
        with the reads' event (no synchronization)."""
        dev = xd.device
        row_bytes = xd.shape[1] * xd.element_size()
        progress, chunk_rows = self._pack_send_area(xd, idx, starts)
        self._wait_reads()  # (queued before the packing: usually nothing left to wait for)
        ops.rows_packed_begin("cached_packed", num_send, num_recv, row_bytes, row_format(xd),
                              progress, chunk_rows)
        self._after_packing(dev, lambda: ops.rows_packed_finish("cached_packed"))
        out = self._cached_outputs(ops, xd, idx, num_recv, starts, rstarts)
        planned = self._planned_ops()
        if planned is not None:
            planned.note_cached(xd, self._pack_key(xd, idx, progress))
        return out

    def _cached_outputs(self, ops, xd, idx, num_recv, starts, rstarts):
        """A packed cached dispatch's output ``[N, D]`` after its round: this rank's rows
        gathered from ``xd``, the peers' copied out of the window; ends with the reads' event."""
        me, dev, d_cols = self.rank, xd.device, xd.shape[1]
        row_bytes = d_cols * xd.element_size()
        out = torch.empty(rstarts[-1], d_cols, dtype=xd.dtype, device=dev)
        torch.index_select(xd, 0, idx[starts[me]:starts[me + 1]],
                           out=out[rstarts[me]:rstarts[me + 1]])
        for r in range(self.world_size):
            if r != me and num_recv[r]:
                rows = ops.received(r, num_recv[r], row_bytes).view(xd.dtype).view(-1, d_cols)
                out[rstarts[r]:rstarts[r + 1]].copy_(rows, non_blocking=True)
        self._record_reads(dev)
        return out

    def _pack_rows(self, y: torch.Tensor, idx: torch.Tensor, rows_to, starts, gather: bool) -> None:
        """Packs the rows of every peer into plane 0 of the send area: ``y[idx[run of d]]``
        (``gather``) or ``y[run of d]`` (rows already grouped by destination), straight into the
        registered window (for a GPU input: a gather on the device, one D2H copy per run; synced
        here, before the data is posted)."""
        w, me, wire = self.world_size, self.rank, self.wire
        d_cols = y.shape[1]
        s_me, e_me = starts[me], starts[me + 1]
        plane = wire.plane(0)
        if plane is not None:
            dst = plane.view(y.dtype).view(-1, d_cols)
            runs = [(0, s_me), (e_me, starts[-1])]
            at = 0
            for a, b in runs:
                if b > a:
                    part = dst[at:at + b - a]
                    if gather:
                        self._gather_into(part, y, idx[a:b])
                    else:
                        part.copy_(y[a:b], non_blocking=True)
                    at += b - a
        else:
            for d in range(w):
                if d == me or not rows_to[d]:
                    continue
                dst = wire.slot(0, d).view(y.dtype).view(-1, d_cols)
                if gather:
                    self._gather_into(dst, y, idx[starts[d]:starts[d + 1]])
                else:
                    dst.copy_(y[starts[d]:starts[d + 1]], non_blocking=True)
        if y.device.type == "cuda":
            torch.cuda.current_stream(y.device).synchronize()

    def _combine(self, y, handle, name: str):
        planned = self._planned_ops()
        if planned is not None:  # a case that ran before: one native call (planned.py)
            out = planned.combine(y, handle)
            if out is not None:
                return out
        error = self._checked("combine", lambda: self._handle_error(handle)
                              or self._rows_error(name, y, handle.num_recv_tokens, handle))
        if error is not None:
            self._wait_reads()
            self.wire.round(OP_COMBINE, {}, [0], None, None, error)
        w, me, wire = self.world_size, self.rank, self.wire
        self._select_producer(y.device)
        yc = dense(y)  # stays on its device; rows go straight into the send area
        num_recv = list(handle.num_recv_per_rank)
        n_send = list(handle.num_send_per_rank)
        starts = _prefix(num_recv)
        sstarts = _prefix(n_send)
        idx = self._send_idx(handle, y.device)
        d_cols = yc.shape[1]
        row_bytes = d_cols * yc.element_size()
        if row_bytes > self.row_cap:  # column rounds: gather every block, then reduce
            self._wait_reads()
            rows_to = {d: yc[starts[d]:starts[d + 1]] for d in range(w) if d != me}
            back = wire.exchange_rows(OP_COMBINE, rows_to, yc[starts[me]:starts[me + 1]], n_send)
            return reduce_rows_by_rank(back, idx, handle.num_send_per_rank,
                                       handle.num_tokens).to(y.dtype)
        if self._device_kernels_for(yc) and row_bytes % 16 == 0:
            ops = self._packed_ops()
            if ops is not None:  # rows straight into the send area, the round in native calls
                progress, chunk_rows = self._pack_send_area(yc, None, starts)
                self._wait_reads()  # (queued before the packing: usually nothing left to wait for)
                # headers while the device stores the rows, the rows as they are stored
                ops.rows_packed_begin("combine_packed", n_send, num_recv, row_bytes,
                                      row_format(yc), progress, chunk_rows)
                self._after_packing(yc.device, lambda: ops.rows_packed_finish("combine_packed"))
                out = self._reduce_device(yc, idx, starts[me], sstarts, handle.num_tokens)
                if planned is not None and yc is y:
                    planned.note_combine(yc, handle, self._pack_key(yc, None, progress),
                                         self._reduce_key(yc, handle.num_tokens))
                return out
        self._wait_reads()
        ops = self._host_ops(yc, idx) if yc.dtype in _NATIVE_DT else None
        if ops is not None:
            out = ops.combine(yc, idx, n_send, num_recv, handle.num_tokens, row_format(yc))
            if out is not None:
                return out
            # a NaN sum: torch reduces the rows still in the window (NaN payloads are torch's)
            views = [yc[starts[me]:starts[me + 1]] if r == me else
                     ops.received(r, n_send[r], row_bytes).view(yc.dtype).view(-1, d_cols)
                     for r in range(w)]
            return self._reduce_torch(views, idx, n_send, sstarts, handle.num_tokens, yc)
        wire.begin(OP_COMBINE, [row_bytes], num_recv, n_recv=n_send, fmt=row_format(yc))
        self._pack_rows(yc, idx, num_recv, starts, gather=False)
        wire.exchange()
        wire.finish()
        # One pass from the receive window: float32 sum over source ranks in ascending order from
        # +0.0, rounded once (as reduce_rows_by_rank(...).to(dtype), bit for bit).
        self_rows = yc[starts[me]:starts[me + 1]]
        views = [self_rows if r == me else wire.recv(r, 0).view(yc.dtype).view(-1, d_cols)
                 for r in range(w)]
        if self._device_kernels_for(yc):
            return self._reduce_device(yc, idx, starts[me], sstarts, handle.num_tokens)
        out = self._reduce_torch(views, idx, n_send, sstarts, handle.num_tokens, yc)
        if y.device.type == "cuda":
            torch.cuda.current_stream(y.device).synchronize()  # the window is read before our next header
        return out

    def _pack_send_area(self, src: torch.Tensor, idx, starts):
        """Launches the kernel that stores the rows for the peers into the send area
        (:func:`~efa_ep.kernels.proxy.device.pack_rows`: ``src``'s rows grouped by destination,
        or with ``idx`` ``src[idx[i]]``; ``starts`` the send rows' prefix per rank): one run from
        the send area's start in rank order, as :meth:`HostOps.rows_packed_begin` expects, chunk
        by chunk (after our previous writes left). Returns (progress words, rows per chunk) for
        the round's post."""
        from . import device as dk

        me, d_cols = self.rank, src.shape[1]
        s_me, e_me, n = starts[me], starts[me + 1], starts[-1]
        row = d_cols * src.element_size()
        lay = self.layout
        if (n - (e_me - s_me)) * row > lay.off_recv - lay.off_data_send:
            raise TransportError(f"rank {me}: {n - (e_me - s_me)} rows of {row} bytes to peers "
                                 f"exceed the send area")
        self.wire.quiesce()
        dev = src.device
        plane = self.window[lay.off_data_send:lay.off_recv]
        nprog = self._num_programs(dev)
        grid = dk.pack_grid(n, nprog)
        progress, chunk_rows = self._progress(grid, row)

        def launch(plan):
            dk.pack_rows(src, idx, s_me, e_me, plane, progress, chunk_rows, num_programs=nprog,
                         plan=plan)

        # one program per row shape: the row count, the chunk size and the grid are the call's
        # (a combine's row count changes with every routing)
        key = self._pack_key(src, idx, progress)
        tensors = (src,) if idx is None else (src, idx)
        prog = self._device_program(key, launch, tensors,
                                    ("own_start", "own_end", "num_rows", "chunk_rows"),
                                    (0,)) if n else None
        if prog is None:
            launch(None)
        else:
            prog.run(tuple(t.data_ptr() for t in tensors) + (s_me, e_me, n, max(1, chunk_rows),
                                                             grid), self._cuda_stream(dev))
        return progress, chunk_rows

    def _reduce_device(self, yc, idx, own_start: int, sstarts, num_tokens: int):
        """Combine's reduction as one kernel (``device.py``) on y's device: ``[num_tokens, D]``
        from this rank's rows of ``yc`` and the peers' rows in the receive window; ends with
        the reads' event (the next op waits for it before its header)."""
        from . import device as dk

        me, d_cols = self.rank, yc.shape[1]
        dev, t = yc.device, num_tokens
        out = torch.empty(t, d_cols, dtype=yc.dtype, device=dev)
        send_off, offs = self._prefix_buffer("send_off")
        offs[:] = sstarts
        idx = idx.contiguous()
        # one native launch per shape (the kernel's search depth follows the token count)
        key = self._reduce_key(yc, t)
        prog = self._programs.get(key)
        yp, ip = yc.data_ptr(), idx.data_ptr()
        if prog is None or not t or not idx.numel() or (yp | ip) & 15:
            src_ptrs, nprog = self._src_ptrs(dev), self._read_programs(dev)

            def launch(plan):
                dk.reduce_combine(yc, idx, send_off, src_ptrs, out, me=me, own_start=own_start,
                                  num_programs=nprog, plan=plan, **self._mark_args(dev))

            prog = self._device_program(key, launch, (yc, idx, out),
                                        ("own_start", "num_tokens", "tag"),
                                        (0,)) if t else None
            if prog is None:
                launch(None)
                self._record_reads(dev)
                return out
        prog.run((yp, ip, out.data_ptr(), own_start, t, 0,
                  dk.reads_grid(t, self._read_programs(dev))),
                 self._cuda_stream(dev))
        self._record_reads(dev)
        return out

    def _reduce_torch(self, views, idx, n_send, sstarts, num_tokens: int, yc):
        """The reduction with torch ops on the output's device (GPU inputs, other dtypes)."""
        d_cols = yc.shape[1]
        out = self._scratch("acc", num_tokens, d_cols, yc.device,
                            persistent=yc.dtype != torch.float32).zero_()
        for r, rows in enumerate(views):
            n = n_send[r]
            if not n:
                continue
            if rows.device != out.device:
                rows = rows.to(out.device, non_blocking=True)
            if rows.dtype != torch.float32:  # float32 copy in a reused buffer
                rows = self._scratch("rows", n, d_cols, out.device).copy_(rows)
            out.index_add_(0, idx[sstarts[r]:sstarts[r] + n], rows)
        return out.to(yc.dtype) if yc.dtype != torch.float32 else out

    def _scratch(self, name: str, rows: int, cols: int, device, persistent: bool = True):
        """``[rows, cols]`` float32 work buffer on ``device``, reused across calls (grown when
        too small) unless not ``persistent``; its contents are undefined."""
        if not persistent:
            return torch.empty(rows, cols, dtype=torch.float32, device=device)
        key = (name, str(device), cols)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty(max(rows, 1), cols, dtype=torch.float32, device=device)
            self._buffers = {k: v for k, v in self._buffers.items() if k[:2] != key[:2]}
            self._buffers[key] = buf
        return buf[:rows]

    def _combine_topk_weights(self, g, handle):
        me = self.rank

        def check():
            err = self._handle_error(handle)
            if err:
                return err
            if not isinstance(g, torch.Tensor):
                return f"rank {me}: combine_topk_weights grad must be a tensor, got {type(g).__name__}"
            err = self._device_error(grad_recv_topk_weights=g)
            if err:
                return err
            want = tuple(handle.recv_topk_idx.shape)
            if tuple(g.shape) != want:
                return (f"rank {me}: combine_topk_weights grad_recv_topk_weights must be {list(want)} "
                        f"(received rows x the dispatch's top-k), got {list(g.shape)}")
            if not g.dtype.is_floating_point:
                return f"rank {me}: combine_topk_weights grad_recv_topk_weights must be floating point, got {g.dtype}"
            if g.device != handle.recv_topk_idx.device:
                return (f"rank {me}: combine_topk_weights grad_recv_topk_weights is on {g.device}, "
                        f"the handle on {handle.recv_topk_idx.device}")
            return None

        error = self._checked("combine_topk_weights", check)
        if error is not None:
            self._wait_reads()
            self.wire.round(OP_COMBINE, {}, [0], None, None, error)
        return self._combine(local_weight_grads(g, handle.recv_topk_idx), handle,
                             "combine_topk_weights grad_recv_topk_weights")
