"""The proxy's wire protocol: one *round* is a header exchange and a data exchange with every peer.

1. **Header** (the count exchange, on our own wire, not torch.distributed): every rank writes a
   small int64 header (``window.py``) into each peer's header slot (message id ``2*seq``). A rank
   with invalid input still sends its header with a bad status and its error text, so every rank
   learns of the failure and raises the same error instead of waiting. The header is also the
   handshake that makes window reuse safe: a rank sends its header for round n+1 only after it
   copied round n's data out, and nobody writes data into a peer's window before that peer's
   header for the same round arrived.
2. **Pack**: the send area holds plane p (e.g. x rows, then routing metadata) of every
   destination in rank order, then a footer ``[rows, round tag]`` per destination; the caller
   packs straight into it (one gather for all peers' rows when they are contiguous).
3. **Describe**: each message (a plane or a footer of one destination) is cut into chunks, one
   descriptor each, into the rings (native ``efa_post_messages``, or the Triton producer).
4. **Proxy**: the ``num_channels`` native channel threads post ``fi_writedata`` into the peer's
   window with imm = (source rank, generation, message id). The target threads count
   completions per (source, message) in host memory, one counter per channel.
5. **Wait**: the receiver waits until each source's arrivals reach that message's chunk count
   (known from the header), never inferring completion from order; then checks the footer. On
   the receiving side source r's planes sit at fixed offsets of its region, 16-byte aligned.

:class:`Wire` runs steps 1, 3, 5 and every check in one native call each
(``kernels/native/efa_round.c``): no per-message or per-peer Python; every problem is worded in
C. A host window is read and written in place; a device window (``hmem='cuda'``) through a
pinned host stage that the native round copies to and from the window with the CUDA driver, on
the caller's stream (headers and footers up with one wait for the stream at the round's start,
the peers' headers and footers down with one wait each; each wait bounded by the deadline).
CPU rows on a host window skip the steps altogether: ``hostop.py`` runs a whole operation in two
native calls.

Every header field from a peer is checked against this rank's capacities before its data is used;
a peer that breaks the protocol raises :class:`ProtocolViolation`.
"""
from __future__ import annotations

import errno
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from ..base import (
    STATUS_BAD_INPUT, STATUS_OK, ProtocolError, TransportError, align_up, ceil_div,
    error_for_errno, group_input_error,
)
from . import native
from .options import PY_TAMPER
from .ring import Rings, describe_messages, native_call
from .tamper import tamper_data, tamper_header
from .window import (
    ALIGN, ERR_BYTES, H_STATUS, HDR_FIXED, OP_DISPATCH, OP_NAMES, WindowLayout, as_bytes,
    row_format,
)


MSG_MASK = native.IMM_MSG_MASK  # message ids as carried in the immediate data


class GroupError(ProtocolError):
    """Ranks in different operations or row formats: every rank raises it from the same headers
    (as ``exchange_status``'s :class:`ProtocolError`); the transport is broken afterwards."""


class ProtocolViolation(ProtocolError):
    """A peer sent something the protocol forbids (counts beyond capacity, ids out of range,
    inconsistent header and data, stale round tag)."""


class Wire:
    """Rounds over one window (host or device memory), one set of rings and one engine, in
    native steps (see the module docstring).

    A round is three calls, with the caller's work in between (nothing per message or per peer
    in Python on a host window: each call is one native call, ``efa_round.c``):

    1. :meth:`begin`: wait until our previous writes left the send side, enter the round, build
       and post every peer's header, lay out the send area (:meth:`slot`, :meth:`plane`);
    2. the caller packs its rows into the send area while the headers fly;
    3. :meth:`exchange`: wait for every peer's header, check it, post the data; the caller does
       its own share while the data flies;
    4. :meth:`finish`: wait for every peer's data, check its footer; :meth:`recv` views it.

    Every rank raises the same error for any problem the native checks detect (the text comes
    from one place, ``efa_wire_check_headers``).

    Args:
        rank, world: this rank and the EP group size. max_tokens_per_rank: row capacity of a slot.
        layout: the window layout. window: ``[layout.window_bytes]`` uint8 (host or CUDA; a
            CUDA window's rounds wait for the caller's current stream, see the module).
        rings: the command rings (attached to ``engine`` before the first round).
        tamper: test-only fault kind (EFA_EP_PROXY_TAMPER) or "".
    """

    def __init__(self, rank: int, world: int, max_tokens_per_rank: int, layout: WindowLayout,
                 window: torch.Tensor, rings: Rings, timeout_ms: int, tamper: str = ""):
        self.rank, self.world = rank, world
        self.max_tokens_per_rank = max_tokens_per_rank
        self.layout = layout
        self.window = window
        self.rings = rings
        self.timeout_ms = timeout_ms
        self.tamper = tamper
        self.engine = None
        self.gen = 0
        self.seq = 0
        self.use_triton = False
        self.triton_device = None
        self._nw = self._checks = None
        w, lay = world, layout
        self._peers = np.array([r for r in range(w) if r != rank], dtype=np.int64)
        self._wait_srcs = np.zeros(max(1, w), dtype=np.int32)
        self._wait_expected = np.zeros(max(1, w), dtype=np.uint64)
        self._wait_ptrs = (self._wait_srcs.ctypes.data, self._wait_expected.ctypes.data)
        self._hdr_text: Dict[int, bytes] = {}
        # One round's arrays, allocated once (the native round reads and writes them in place).
        mp = native.MAX_PLANES
        self.num_extra = lay.hdr_fields - HDR_FIXED
        self._rows_to = np.zeros(w, dtype=np.int64)
        self._n_recv = np.zeros(w, dtype=np.int64)
        self._extras = np.zeros((w, max(1, self.num_extra)), dtype=np.int64)
        self._plan = np.full((mp + 1, w), -1, dtype=np.int64)
        self._got = np.zeros((w, lay.hdr_fields), dtype=np.int64)
        self._rows_from = np.zeros(w, dtype=np.int64)
        self._msgs = np.zeros((4, w * (mp + 1)), dtype=np.int64)
        self._extras_ptr, self._n_recv_ptr = self._extras.ctypes.data, self._n_recv.ctypes.data
        self.got_address = self._got.ctypes.data  # the peers' headers of the current round
        self._hmsgs = np.zeros((4, w), dtype=np.int64)
        self._nmsgs = 0
        self._round = None  # (seq, op, widths, fmt, tag, error, n_recv given, count_rows)
        self._dests: List[int] = []  # ranks this round sends rows to, ascending
        self._total_to = 0
        self._py_wait_ns = 0
        self._bind_window(native.WINDOW_CUDA if window.is_cuda else native.WINDOW_DIRECT)
        # What this rank handed to the engine since creation (host counts, see count_posted):
        # writes = descriptors, wire_bytes = their bytes; messages/rows/bytes = data messages,
        # their rows and the rows' payload bytes (first plane only: no routing metadata).
        self.posted = {"writes": 0, "wire_bytes": 0, "messages": 0, "rows": 0, "bytes": 0}

    def _bind_window(self, kind: int) -> None:
        """How the rounds reach the window (``native.WINDOW_*``) and the host views of the
        headers to send (``_hdr_stage``): in the window itself, or in the stage the native round
        copies up (a device window: pinned host memory)."""
        lay, w = self.layout, self.world
        self.window_kind = kind
        self._win_np = None if self.window.is_cuda else self.window.numpy()
        if kind == native.WINDOW_DIRECT:
            self._stage = self._stage_np = None
            self._hdr_stage = self._win_np[lay.off_hdr_send:lay.off_hdr_send + w * lay.hdr_bytes].reshape(
                w, lay.hdr_bytes)
        else:
            nbytes = native.wire_stage_bytes(w, lay.hdr_bytes, lay.hdr_len)
            self._stage = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.window.is_cuda)
            self._stage_np = self._stage.numpy()
            self._hdr_stage = self._stage_np[:w * lay.hdr_bytes].reshape(w, lay.hdr_bytes)
        self._hdr_stage_i64 = self._hdr_stage[:, :lay.hdr_fields * 8].view(np.int64)

    @property
    def window_in_place(self) -> bool:
        """The rounds read and write the window in place (a host window): what the native
        whole operations (``hostop.py``) need."""
        return self.window_kind == native.WINDOW_DIRECT

    def through_copies(self) -> None:
        """Test-only: from the next round on, reach this host window only through copies of
        the stage, as a device window's rounds do (the same native steps, with memcpy for the
        CUDA driver's copies), so CPU tests run the device window's steps."""
        if self.window.is_cuda:
            raise TransportError(f"rank {self.rank}: a device window is always reached through "
                                 f"copies")
        self._bind_window(native.WINDOW_COPIED)
        self._bind_native()

    def start(self, engine, gen: int) -> None:
        self.engine = engine
        self.gen = gen
        self.rings.attach(engine, self.timeout_ms)
        self._bind_native()

    def _bind_native(self) -> None:
        """The native round's struct over this wire's arrays: its steps (``_nw``) and its header
        checks (``_checks``, the same object)."""
        self._nw = self._checks = None
        if self.engine is None:
            return
        lay, w = self.layout, self.world
        st = native.WireStruct()
        st.engine = self.engine.handle
        st.window = self.window.data_ptr()
        st.window_kind = self.window_kind
        st.stage = None if self._stage is None else self._stage.data_ptr()
        st.rank, st.world = self.rank, w
        st.hdr_fields, st.num_extra = lay.hdr_fields, self.num_extra
        st.hdr_len, st.hdr_bytes, st.hdr_chunks = lay.hdr_len, lay.hdr_bytes, lay.hdr_chunks
        st.off_hdr_send, st.off_data_send = lay.off_hdr_send, lay.off_data_send
        st.send_bytes = lay.off_recv - lay.off_data_send
        st.off_recv, st.region_bytes = lay.off_recv, lay.region_bytes
        st.chunk_bytes, st.max_rows, st.timeout_ms = lay.chunk_bytes, self.max_tokens_per_rank, self.timeout_ms
        st.next_channel = self.rings._next_channel_ptr
        st.msgs, st.max_msgs = self._msgs.ctypes.data, self._msgs.shape[1]
        st.hmsgs = self._hmsgs.ctypes.data
        st.wait_srcs, st.wait_expected = self._wait_ptrs
        st.rows_to = self._rows_to.ctypes.data
        st.plan, st.got, st.rows_from = self._plan.ctypes.data, self._got.ctypes.data, self._rows_from.ctypes.data
        self._checks = native.NativeWire(st)
        self._nw = self._checks

    def wait_seconds(self) -> float:
        """Cumulative seconds the calling thread spent blocked in the engine's waits (headers,
        data, our own writes leaving the send side): the rest of an operation's wall time is its
        host part."""
        st = self._nw.st if self._nw is not None else None
        return ((st.wait_ns if st is not None else 0) + self._py_wait_ns) / 1e9

    def count_posted(self, sizes: np.ndarray, messages: int = 0, rows: int = 0,
                     payload: int = 0) -> None:
        """Adds messages of ``sizes`` bytes (``[M]`` int64) to :attr:`posted`: each is cut into
        ceil(size / chunk_bytes) writes, as the native engine and the Triton producer cut them
        (the engine's ``posted`` counter sums the same writes over its channels)."""
        cb = self.layout.chunk_bytes
        p = self.posted
        p["writes"] += int(ceil_div(sizes, cb).sum())
        p["wire_bytes"] += int(sizes.sum())
        p["messages"] += messages
        p["rows"] += rows
        p["bytes"] += payload

    def violation(self, msg: str):
        raise ProtocolViolation(f"rank {self.rank}: protocol violation: {msg}")

    # Primitives -----------------------------------------------------------------------------
    def window_view(self, off: int, nbytes: int) -> torch.Tensor:
        return self.window[off:off + nbytes]

    def window_ready(self) -> None:
        """A device window is written by kernels on the current stream: they must have finished
        before a descriptor hands the bytes to the provider, and our copies out of the receive
        side must have finished before a header lets peers overwrite it. No-op for host windows."""
        if self.window.is_cuda:
            torch.cuda.current_stream(self.window.device).synchronize()

    def wait(self, msg: int, srcs, expected) -> None:
        """Waits (native, bounded) until each source's arrivals of ``msg`` (summed over the
        channels) reach its expected chunk count, then resets those counters."""
        n = len(srcs)
        if not n:
            return
        self._wait_srcs[:n] = srcs
        self._wait_expected[:n] = expected
        t0 = time.perf_counter_ns()
        try:
            native_call(self.engine.wait_counters, msg, *self._wait_ptrs, n, True, self.timeout_ms)
        finally:
            self._py_wait_ns += time.perf_counter_ns() - t0

    def quiesce(self) -> None:
        """Waits until our previous writes completed locally, so the send side may be rewritten."""
        t0 = time.perf_counter_ns()
        try:
            native_call(self.engine.wait_idle, self.timeout_ms)
        finally:
            self._py_wait_ns += time.perf_counter_ns() - t0

    def warm_up(self) -> None:
        """Round 0: every channel writes one small message to every peer and waits for all of
        theirs, so connections (tcp/rxm connects lazily) exist before the first dispatch."""
        w, me, lay = self.world, self.rank, self.layout
        peers = [r for r in range(w) if r != me]
        msg = (2 * self.seq) & MSG_MASK
        self.engine.expect(self.seq)
        hdr_in = lay.hdr_recv_off(me, self.seq)
        self.seq += 1
        if not peers:
            return
        self.window_ready()  # torch.zeros of a device window is asynchronous
        p = torch.tensor(peers, dtype=torch.int64)
        for c in range(self.rings.num_channels):
            self.rings.push_channel(c, describe_messages(
                p, lay.off_hdr_send + p * lay.hdr_bytes, torch.full_like(p, hdr_in),
                torch.full_like(p, 16), msg, lay.chunk_bytes))
            self.count_posted(np.full(len(peers), 16, dtype=np.int64))
        self.wait(msg, peers, [self.rings.num_channels] * len(peers))

    # One round, in steps ----------------------------------------------------------------------
    def begin(self, op: int, widths: List[int], rows_to, extras: Optional[np.ndarray] = None,
              n_recv: Optional[List[int]] = None, fmt: int = 0, error: Optional[str] = None,
              count_rows: bool = True) -> None:
        """Starts a round (collective): waits until our previous writes left the send side,
        posts every peer's header and lays out the send area.

        Args:
            widths: bytes per row of each plane (same on every rank; at most 4 planes).
            rows_to: rows to each rank (``[W]`` ints; this rank's entry is ignored).
            extras: ``[W, L]`` int64, per-destination extra header fields, or None.
            n_recv: rows expected from each rank, or None (dispatch: learned from the headers).
            fmt: row format (columns and dtype) every rank must share, 0 when not applicable.
            error: this rank's input error (sent with the status, then raised on every rank by
                :meth:`exchange`); no rows move.
            count_rows: add the rows to :attr:`posted` (False for the later column rounds of
                the same rows).
        """
        seq = self.seq
        self.seq += 1
        if len(widths) > native.MAX_PLANES:
            raise TransportError(f"rank {self.rank}: a round of {len(widths)} planes (at most "
                                 f"{native.MAX_PLANES})")
        tag = (self.gen << 32) | (seq & 0xFFFFFFFF)
        rt = self._rows_to
        if error:
            rt.fill(0)
            text = error.encode("utf-8", errors="replace")[:ERR_BYTES - 1]
            error = text.decode("utf-8", errors="ignore")  # what peers will read, byte for byte
        else:
            rt[:] = rows_to
        rt[self.rank] = 0
        rl = rt.tolist()
        self._dests = [d for d in range(self.world) if rl[d] > 0]
        self._total_to = sum(rl)
        if n_recv is not None:
            self._n_recv[:] = n_recv
        self._round = (seq, op, list(widths), fmt, tag, error, n_recv is not None, count_rows)
        st = self._checks.st  # the round's inputs, for the native steps and checks
        st.seq, st.op, st.status, st.nplanes = seq, op, STATUS_BAD_INPUT if error else STATUS_OK, len(widths)
        st.tag, st.fmt, st.row_bytes = tag, fmt, sum(widths)
        for i, wd in enumerate(widths):
            st.widths[i] = wd
        if extras is not None and not error:
            self._extras[:, :extras.shape[1]] = extras
            st.extras = self._extras_ptr
        else:
            st.extras = None
        st.n_recv = self._n_recv_ptr if n_recv is not None else None
        if self.window_kind == native.WINDOW_CUDA:  # the round's copies follow the caller's work
            st.stream = torch._C._cuda_getCurrentRawStream(self.window.device.index)
        # one native call; an error text or test-only tampering goes into the headers (in the
        # window, or the stage) before they are posted
        tampering = (not error and op == OP_DISPATCH and self.tamper in PY_TAMPER
                     and self.tamper != "ids")
        self.native(self._nw.begin, not (error or tampering))
        self._nmsgs = self._nw.st.nmsgs
        if error or tampering:
            if error:
                text = error.encode("utf-8")
                f8 = self.layout.hdr_fields * 8
                self._hdr_stage[:, f8:f8 + len(text)] = np.frombuffer(text, dtype=np.uint8)
            else:
                tamper_header(self, op, self._hdr_stage_i64, self._rows_to, widths)
            self.native(self._nw.post_headers)

    def slot(self, p: int, d: int) -> torch.Tensor:
        """Writable ``[rows_to[d], widths[p]]`` uint8 view of plane ``p`` of the rows to rank
        ``d`` in the send area (valid between :meth:`begin` and :meth:`exchange`)."""
        n, wd = int(self._rows_to[d]), self._round[2][p]
        off = int(self._plan[p, d])
        if off < 0:
            return self.window[:0].view(0, wd)
        return self.window_view(off, n * wd).view(n, wd)

    def plane(self, p: int) -> Optional[torch.Tensor]:
        """Plane ``p`` of every peer's rows at once, in rank order (``[sum of rows_to, width]``
        uint8), when they are contiguous in the send area (the width a multiple of 16, as for
        token rows and routing metadata); else None (use :meth:`slot` per destination)."""
        wd = self._round[2][p]
        dests = self._dests
        if not dests:
            return self.window[:0].view(0, wd)
        if wd % ALIGN:
            return None if len(dests) > 1 else self.slot(p, dests[0])
        total = self._total_to
        return self.window_view(int(self._plan[p, dests[0]]), total * wd).view(total, wd)

    def exchange(self) -> np.ndarray:
        """Waits for every peer's header and checks it (raises the group's input error, a
        :class:`GroupError` or a :class:`ProtocolViolation` naming the peer), then posts the data.

        Returns:
            ``[W, F]`` int64, the peers' headers (row ``self.rank`` zero), valid until the next
            round; every field was checked against this rank's capacities.
        """
        seq, op, widths, fmt, tag, error, has_n_recv, count_rows = self._round
        tamper_data(self, op)
        posted_data = False
        try:
            rc = self.native(self._nw.exchange, not self.use_triton)
            if rc:  # a header is not clean: every rank raises the same error
                self.header_error(rc, seq, op, error)
            if self.use_triton and self._nmsgs:
                self._push_triton(self._msgs[:, :self._nmsgs], (2 * seq + 1) & MSG_MASK)
            posted_data = True
            return self._got
        finally:
            self._account(posted_data, widths, count_rows)

    def _push_triton(self, msgs: np.ndarray, msg: int) -> None:
        dests, loffs, roffs, sizes = (a.tolist() for a in msgs)
        self.rings.push_triton(dests, loffs, roffs, sizes, msg, self.layout.chunk_bytes,
                               self.triton_device)

    def finish(self) -> None:
        """Waits for every chunk of every peer's data, then checks each footer against its
        header (a :class:`ProtocolViolation` names the peer)."""
        self.native(self._nw.finish)  # a footer problem is named in C

    def rows_from(self, r: int) -> int:
        """Rows rank ``r`` sent this round (from its checked header; 0 for this rank)."""
        return int(self._rows_from[r])

    def recv(self, r: int, p: int) -> torch.Tensor:
        """``[rows_from(r), widths[p]]`` uint8 view of plane ``p`` of rank ``r``'s rows in our
        receive window (valid until the next round's header lets ``r`` overwrite it)."""
        widths = self._round[2]
        n = int(self._rows_from[r])
        off = self.layout.data_recv_off(r) + sum(align_up(n * wd, ALIGN) for wd in widths[:p])
        return self.window_view(off, n * widths[p]).view(n, widths[p])

    # One round, in one call (error rounds, row blocks) -----------------------------------------
    def round(self, op: int, planes: Dict[int, List[torch.Tensor]], widths: List[int],
              n_recv: Optional[List[int]], extra_WL: Optional[torch.Tensor],
              error: Optional[str], fmt: int = 0, pack: Optional[Callable[[], None]] = None,
              local: Optional[Callable[[np.ndarray], None]] = None, count_rows: bool = True):
        """:meth:`begin`, copy ``planes`` (dest -> list of ``[n, widths[p]]`` uint8 tensors, any
        device) into the send area, ``pack()``, :meth:`exchange`, ``local(headers)``,
        :meth:`finish`. Returns (headers ``[W, F]``, {src: [plane views into the receive
        window]}), the views valid until the next round."""
        rows_to = [0] * self.world
        if not error:
            for d, pl in planes.items():
                rows_to[d] = pl[0].shape[0] if pl else 0
        self.begin(op, widths, rows_to, None if extra_WL is None else np.asarray(extra_WL),
                   n_recv, fmt, error, count_rows)
        if not error:
            for d, pl in planes.items():
                for p, t in enumerate(pl):
                    if t.shape[0]:
                        self.slot(p, d).copy_(t)
            if pack is not None:
                pack()
        got = self.exchange()
        if local is not None:
            local(got)
        self.finish()
        return got, {r: [self.recv(r, p) for p in range(len(widths))] for r in self._peers.tolist()}

    # Naming problems ---------------------------------------------------------------------------
    def _account(self, posted_data: bool, widths: List[int], count_rows: bool) -> None:
        """Adds what this round handed to the engine to :attr:`posted`."""
        p = self.posted
        st = self._nw.st  # headers, and data posted by efa_post_messages
        p["writes"] += st.r_writes
        p["wire_bytes"] += st.r_wire_bytes
        if not posted_data or not self._nmsgs:
            return
        if self.use_triton:  # data posted by the Triton producer
            data = self._msgs[3, :self._nmsgs]
            p["writes"] += int(ceil_div(data, self.layout.chunk_bytes).sum())
            p["wire_bytes"] += int(data.sum())
        sent = self._total_to
        p["messages"] += len(self._dests)
        p["rows"] += sent if count_rows else 0
        p["bytes"] += sent * widths[0] if count_rows else 0

    def _got_texts(self, seq: int) -> None:
        """The error texts of peers whose header (already in ``_got``) says bad input: in the
        window, or where the native round copied the peers' headers (the stage)."""
        lay = self.layout
        f8 = lay.hdr_fields * 8
        self._hdr_text = {}
        for r in self._peers.tolist():
            if self._got[r, H_STATUS] == STATUS_BAD_INPUT:
                if self._stage_np is None:
                    off = lay.hdr_recv_off(r, seq)
                    raw = self._win_np[off + f8:off + lay.hdr_len]
                else:
                    off = self.world * lay.hdr_bytes + r * lay.hdr_len
                    raw = self._stage_np[off + f8:off + lay.hdr_len]
                self._hdr_text[r] = raw.tobytes()

    @staticmethod
    def native(fn, *args):
        """Calls a native step; a failure becomes the contract's error kind with the text from C
        (a violation named there is a :class:`ProtocolViolation`)."""
        try:
            return fn(*args)
        except native.NativeError as ex:
            raise Wire.error_of(ex.code, str(ex)) from ex

    @staticmethod
    def error_of(code: int, text: str) -> Exception:
        """The contract's error for a native step's negative return ``code`` and its text (a
        violation named there is a :class:`ProtocolViolation`)."""
        if code == -errno.EPROTO:
            return ProtocolViolation(text)
        return error_for_errno(code, text)

    def header_error(self, rc: int, seq: int, op: int, error: Optional[str],
                     text: Optional[str] = None):
        """Raises what efa_wire_check_headers' code ``rc`` says about this round's headers (the
        same error on every rank: every rank read the same headers). The input errors' texts come
        from the peers' headers; every other text from C (``text``, else the wire's last)."""
        text = self._checks.text() if text is None else text
        if rc == native.RC_GROUP_INPUT:
            self._got_texts(seq)
            errs = {self.rank: error} if error else {}
            for r in self._peers.tolist():
                if int(self._got[r, H_STATUS]) == STATUS_BAD_INPUT:
                    text = self._hdr_text.get(r, b"").split(b"\0", 1)[0]
                    errs[r] = text.decode("utf-8", errors="replace") or f"rank {r}: (no message)"
            raise group_input_error(f"proxy {OP_NAMES[op]}", errs)
        if rc == native.RC_GROUP_MISMATCH:
            raise GroupError(text)
        raise TransportError(text)

    # Row blocks -----------------------------------------------------------------------------
    def exchange_rows(self, op: int, rows_to: Dict[int, torch.Tensor], self_rows: torch.Tensor,
                      n_recv: List[int]) -> torch.Tensor:
        """Moves ``[n, D]`` row blocks (any dtype, all on one device) to each rank and
        returns the received rows concatenated in source-rank order (this rank's block =
        ``self_rows``), on that device. Rows wider than the window's row capacity go in column
        rounds. Each block is copied once into the pinned send slot and once out of the window
        (straight into the output when one round carries whole rows)."""
        me, w = self.rank, self.world
        d_cols, dtype = self_rows.shape[1], self_rows.dtype
        row_bytes = d_cols * self_rows.element_size()
        fmt = row_format(self_rows)
        as_b = {d: as_bytes(t) for d, t in rows_to.items()}
        row_cap = self.layout.row_cap
        starts = [sum(n_recv[:r]) for r in range(w)]
        out = torch.empty(sum(n_recv), d_cols, dtype=dtype, device=self_rows.device)
        if row_bytes <= row_cap:
            def local(_got):  # our own block while the peers' rows fly
                out[starts[me]:starts[me] + n_recv[me]].copy_(self_rows)

            _, got = self.round(op, {d: [t] for d, t in as_b.items()}, [row_bytes], n_recv, None,
                                None, fmt, local=local)
            for r, views in got.items():
                if n_recv[r]:
                    out[starts[r]:starts[r] + n_recv[r]].copy_(
                        views[0].view(dtype).view(n_recv[r], d_cols))
            return out
        out_b = as_bytes(out) if out.numel() else None
        for c0 in range(0, row_bytes, row_cap):
            c1 = min(row_bytes, c0 + row_cap)
            planes = {d: [t[:, c0:c1]] for d, t in as_b.items()}  # round copies into the slot
            _, got = self.round(op, planes, [c1 - c0], n_recv, None, None, fmt,
                                count_rows=c0 == 0)
            for r, views in got.items():
                if n_recv[r]:
                    out_b[starts[r]:starts[r] + n_recv[r], c0:c1].copy_(views[0])
        out[starts[me]:starts[me] + n_recv[me]].copy_(self_rows)
        return out
