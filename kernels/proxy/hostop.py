"""The proxy's operations on host memory, each two native calls (``kernels/native/efa_op.c``).

CPU rows on a host window (the common case without a GPU, and the path of every CPU test) run a
whole dispatch, dispatch_cached or combine as ``post`` then ``complete``: the routing layout,
the round's headers, packing, the peers' headers checked, the data posted, the peers' data
waited for and checked, rows copied out, routing rows checked and unpacked, or combine's
reduction, all in C. Python checks the arguments (shapes, dtypes: no values), allocates the
outputs between the two calls (their sizes come from the checked headers) and maps return codes
to the contract's errors; every problem found in C is named in C.

CUDA rows on a host window use the same struct for their rounds (``dispatch_packed``,
``combine_packed``): the device packs the rows into the send area, so the calls run the round,
its checks and the routing rows only, in three steps (begin: the headers posted while the device
still stores; post: the rows chunk by chunk as the device stores them; complete); the device
reads what arrived straight from the window.

Everything the native side writes besides the outputs (routing rows, scratch, per-rank counts)
is allocated here once and reused; the outputs and the handle's ``send_token_idx`` are new
tensors per call (the caller keeps them), the large ones on blocks of a
:class:`~efa_ep.kernels.core.host_pool.HostOutputPool` that come back once the caller drops them
(a fresh megabyte-sized allocation faults in its pages on every call).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..core.host_pool import HostOutputPool
from . import native
from .window import OP_CACHED, OP_COMBINE, OP_DISPATCH
from .wire import Wire

_DTYPES = {torch.float32: native.DT_F32, torch.bfloat16: native.DT_BF16}


class HostOps:
    """The native operations of one transport's wire (host window, native rounds).

    Args:
        wire: the transport's :class:`~efa_ep.kernels.proxy.wire.Wire` (started).
        num_experts, num_local: E and L = E / W. max_tokens: rows a rank may send or receive.

    Synchronization: each call blocks the calling thread until its outputs are complete; one
    operation at a time (the arrays and the struct are shared across calls).
    """

    def __init__(self, wire: Wire, num_experts: int, num_local: int, max_tokens: int):
        w = wire.world
        self.wire = wire
        self._nw = wire._nw
        st = native.OpStruct()
        st.wire = self._nw.address
        st.gen = wire.gen
        st.num_experts, st.num_local = num_experts, num_local
        self._scratch = np.zeros(2 * w + 2 + num_local, dtype=np.int64)
        self._aux = np.zeros(3 * w, dtype=np.int64)
        self.counts = np.zeros(num_experts, dtype=np.int64)
        self.num_send = np.zeros(w, dtype=np.int64)
        self.num_recv = np.zeros(w, dtype=np.int64)
        self._slot = np.zeros(max(1, w * max_tokens), dtype=np.int32)
        self._meta = np.zeros(0, dtype=np.int64)
        self._meta_addr = self._meta.ctypes.data
        st.scratch, st.aux = self._scratch.ctypes.data, self._aux.ctypes.data
        st.counts = self.counts.ctypes.data
        st.num_send, st.num_recv = self.num_send.ctypes.data, self.num_recv.ctypes.data
        st.slot, st.slot_cap = self._slot.ctypes.data, self._slot.shape[0]
        self.st = st
        self.op = native.NativeOp(st)
        self.pool = HostOutputPool()

    def bound_to(self, wire: Wire) -> bool:
        """Whether this struct still points at ``wire``'s native round (rebuilt on a new window)."""
        return wire._nw is self._nw and self.st.gen == wire.gen

    # -----------------------------------------------------------------------------------------
    def _call(self, kind: str, step: str) -> int:
        return Wire.native(self.op.call, kind, step)  # errors as the round's steps raise them

    def _start_round(self) -> None:
        """Numbers the struct's next round ``wire.seq`` and zeroes what the round hands the
        engine (accounted by :meth:`_post`)."""
        self.st.seq = self.wire.seq
        wst = self._nw.st
        wst.r_writes = wst.r_wire_bytes = wst.r_messages = wst.r_rows = 0

    def _begin(self, kind: str) -> int:
        """Runs ``kind``'s begin (the headers posted) for round ``wire.seq``; returns its code
        (0, or ``RC_LOCAL_INPUT``: nothing sent, no round taken). :meth:`_post` with
        ``begun=True`` continues the round."""
        wire = self.wire
        self._start_round()
        try:
            return self._call(kind, "begin")
        except BaseException:
            wire.seq += 1  # headers may have left: this round's number is spent
            raise

    def _post(self, kind: str, op: int, begun: bool = False) -> int:
        """Runs ``kind``'s post for round ``wire.seq`` (after its :meth:`_begin` when ``begun``);
        accounts what the round handed to the engine (:attr:`Wire.posted`) and raises what the
        headers say (every rank the same)."""
        wire, st, wst = self.wire, self.st, self._nw.st
        if not begun:
            self._start_round()
        rc = -1
        try:
            rc = self._call(kind, "post")
        finally:
            if rc != native.RC_LOCAL_INPUT:  # that one sent nothing and takes no round
                wire.seq += 1
            p = wire.posted
            p["writes"] += wst.r_writes
            p["wire_bytes"] += wst.r_wire_bytes
            if rc == 0:
                p["messages"] += wst.r_messages
                p["rows"] += wst.r_rows
                p["bytes"] += wst.r_rows * st.row_bytes
        if rc and rc != native.RC_LOCAL_INPUT:
            wire.header_error(rc, st.seq, op, None, self.op.text())
        return rc

    # -----------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """Dispatch of CPU rows ``x`` ``[T, H]`` (dense), ``topk_idx`` ``[T, K]`` int64,
        ``topk_weights`` ``[T, K]`` float32 (dense, checked for shape and dtype by the caller).

        Returns: (recv_x ``[N, H]``, recv_topk_idx ``[N, K]`` int64, recv_topk_weights ``[N, K]``
        float32, tokens_per_expert ``[L]`` int64, send_idx ``[S]`` int64, num_send (W ints),
        num_recv (W ints)); or None when the routing values are invalid (nothing was sent: the
        caller names them and runs the error round).
        """
        st, w = self.st, self.wire.world
        t, k = topk_idx.shape
        cap = t * min(w, k)
        if self._meta.shape[0] < cap * 2 * k:
            self._meta = np.zeros(max(cap * 2 * k, 1), dtype=np.int64)
            self._meta_addr = self._meta.ctypes.data
        st.meta = self._meta_addr  # (dispatch_packed points it at the caller's rows)
        st.meta_rows = self._meta.shape[0] // (2 * k)
        send_idx = torch.empty(cap, dtype=torch.int64)
        st.tokens, st.topk, st.cap, st.row_bytes = t, k, cap, x.shape[1] * x.element_size()
        st.x, st.topk_idx, st.weights = x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr()
        st.send_idx = send_idx.data_ptr()
        if self._post("dispatch", OP_DISPATCH) == native.RC_LOCAL_INPUT:
            return None
        num_recv = self.num_recv.tolist()
        n = sum(num_recv)
        recv_x = self.pool.empty((n, x.shape[1]), x.dtype)
        recv_idx = self.pool.empty((n, k), torch.int64)
        recv_w = self.pool.empty((n, k), torch.float32)
        tpe = torch.empty(st.num_local, dtype=torch.int64)
        st.recv_x, st.recv_idx, st.recv_w = recv_x.data_ptr(), recv_idx.data_ptr(), recv_w.data_ptr()
        st.tokens_per_expert = tpe.data_ptr()
        self._call("dispatch", "complete")
        return (recv_x, recv_idx, recv_w, tpe, send_idx[:st.rows], self.num_send.tolist(),
                num_recv)

    def dispatch_cached(self, x: torch.Tensor, send_idx: torch.Tensor, num_send, num_recv,
                        fmt: int) -> torch.Tensor:
        """``x`` ``[T, D]`` dense CPU rows sent again along a handle's layout: ``send_idx`` ``[S]``
        int64 CPU, rows per rank ``num_send`` / ``num_recv``; ``fmt``: the rows' format code.
        Returns ``[sum num_recv, D]`` in source order."""
        st = self.st
        self.num_send[:] = num_send
        self.num_recv[:] = num_recv
        st.row_bytes, st.fmt, st.tokens = x.shape[1] * x.element_size(), fmt, x.shape[0]
        st.x, st.send_idx = x.data_ptr(), send_idx.data_ptr()
        self._post("cached", OP_CACHED)
        out = self.pool.empty((sum(num_recv), x.shape[1]), x.dtype)
        st.recv_x = out.data_ptr()
        self._call("cached", "complete")
        return out

    def combine(self, y: torch.Tensor, send_idx: torch.Tensor, num_send, num_recv,
                num_tokens: int, fmt: int) -> Optional[torch.Tensor]:
        """Combine of ``y`` ``[sum num_recv, D]`` dense CPU rows, float32 or bfloat16, grouped
        by the rank they came from; ``send_idx`` ``[S]`` int64 CPU (the handle's). Returns
        ``[num_tokens, D]`` of y's dtype, or None when a sum is NaN (the rows are still in the
        window: the caller reduces them with torch, see :meth:`received`)."""
        st = self.st
        self.num_send[:] = num_send
        self.num_recv[:] = num_recv
        st.row_bytes, st.fmt, st.dtype, st.tokens = y.shape[1] * y.element_size(), fmt, _DTYPES[y.dtype], num_tokens
        st.x, st.send_idx = y.data_ptr(), send_idx.data_ptr()
        self._post("combine", OP_COMBINE)
        out = self.pool.empty((num_tokens, y.shape[1]), y.dtype)
        st.out = out.data_ptr()
        return out if self._call("combine", "complete") == 0 else None

    # Rows packed into the send area by the device (CUDA inputs on a host window) --------------
    # Each round starts with its headers while the device still stores the rows (begin), then
    # posts the rows chunk by chunk as the device's progress words allow (post).
    def dispatch_packed_begin(self, dev_counts: torch.Tensor, progress: torch.Tensor,
                              chunk_rows: int, meta: torch.Tensor, k: int, row_bytes: int) -> bool:
        """Starts a dispatch whose rows the device is storing into the send area (plane 0 from
        its start, the rows to every peer in rank order, ``row_bytes`` each, a multiple of 16):
        waits (the wire's deadline) for the device's count block, then posts the headers.

        Args:
            dev_counts: host ``[2 + W + E]`` int64 (pinned) the device writes: status, rows to
                each rank (this rank's own included), (token, expert) pairs per expert, then the
                ready word, which the caller zeroed before the launch.
            progress: host ``[programs]`` int64 (pinned, zeroed before the launch): per storing
                program, the chunks of ``chunk_rows`` send rows it has stored (see
                :func:`~efa_ep.kernels.proxy.device.pack_dispatch`).
            meta: host ``[>= S * 2K]`` int64, every sent row's routing row (local ids, weights'
                float32 bits), rank-major, this rank's own rows included (read by
                :meth:`dispatch_packed_post`). k: top-k.
        Returns: False when the device flagged the routing's values (nothing sent, no round
        taken: the caller names them and runs the error round), else True.
        """
        st = self.st
        st.dev_counts = dev_counts.data_ptr()
        st.progress, st.progress_words = progress.data_ptr(), progress.numel()
        st.chunk_rows = chunk_rows
        st.meta, st.meta_rows = meta.data_ptr(), meta.numel() // (2 * k)
        st.topk, st.row_bytes = k, row_bytes
        return self._begin("dispatch_packed") != native.RC_LOCAL_INPUT

    def dispatch_packed_post(self) -> list:
        """After :meth:`dispatch_packed_begin`: the peers' headers checked, each destination's
        rows posted as the device stores them, then the routing rows (no stream synchronization:
        the progress words say what is stored). Returns the rows from each source, W ints (this
        rank's own included); :attr:`num_send` holds the rows to each rank."""
        self._post("dispatch_packed", OP_DISPATCH, begun=True)
        return self.num_recv.tolist()

    def dispatch_packed_complete(self, recv_idx: torch.Tensor, recv_w: torch.Tensor,
                                 tokens_per_expert: torch.Tensor) -> None:
        """The end of the round: the peers' data waited for, their routing rows checked and
        unpacked into ``recv_idx`` / ``recv_w`` (host, ``>= [N, K]`` int64 / float32, source
        order) and ``tokens_per_expert`` ``[L]`` int64 CPU. The peers' rows stay in the receive
        window (:meth:`received`) until the next operation."""
        st = self.st
        st.recv_idx, st.recv_w = recv_idx.data_ptr(), recv_w.data_ptr()
        st.tokens_per_expert = tokens_per_expert.data_ptr()
        self._call("dispatch_packed", "complete")

    def rows_packed_begin(self, kind: str, num_send, num_recv, row_bytes: int, fmt: int,
                          progress: torch.Tensor, chunk_rows: int) -> None:
        """Starts a round of rows the device is storing into the send area (as
        :meth:`dispatch_packed_begin`'s, ``row_bytes`` each, rank order; ``progress`` and
        ``chunk_rows`` as there): ``kind`` ``"combine_packed"`` sends ``num_recv[d]`` rows back
        to rank d and expects ``num_send[r]`` from rank r; ``"cached_packed"`` sends
        ``num_send[d]`` and expects ``num_recv[r]``. The headers posted."""
        st = self.st
        self.num_send[:] = num_send
        self.num_recv[:] = num_recv
        st.row_bytes, st.fmt = row_bytes, fmt
        st.progress, st.progress_words = progress.data_ptr(), progress.numel()
        st.chunk_rows = chunk_rows
        self._begin(kind)

    def rows_packed_finish(self, kind: str) -> None:
        """After :meth:`rows_packed_begin`: headers checked, the rows posted as the device
        stores them, the peers' data waited for (left in the receive window, :meth:`received`:
        the caller reduces or copies them out)."""
        self._post(kind, OP_COMBINE if kind == "combine_packed" else OP_CACHED, begun=True)
        self._call(kind, "complete")

    def received(self, r: int, n: int, row_bytes: int) -> torch.Tensor:
        """``[n, row_bytes]`` uint8 view of rank ``r``'s rows in the receive window (valid until
        the next operation)."""
        lay = self.wire.layout
        off = lay.data_recv_off(r)
        return self.wire.window[off:off + n * row_bytes].view(n, row_bytes)
