"""The proxy's wire protocol: one *round* is a header exchange and a data exchange with every peer.

1. **Header** (the count exchange, on our own wire, not torch.distributed): every rank writes a
   small int64 header (``window.py``) into each peer's header slot (message id ``2*seq``). A rank
   with invalid input still sends its header with ``status=1`` and its error text, so every rank
   learns of the failure and raises the same error instead of waiting. The header is also the
   handshake that makes window reuse safe: a rank sends its header for round n+1 only after it
   copied round n's data out, and nobody writes data into a peer's window before that peer's
   header for the same round arrived.
2. **Pack**: rows to each destination sit contiguously in the send slot of the registered window,
   planes back to back (e.g. x rows, then routing metadata), then a footer ``[rows, round tag]``.
3. **Describe**: each message is cut into chunks, one descriptor each, into the rings
   (``ring.py``).
4. **Proxy**: the ``num_channels`` native channel threads post ``fi_writedata`` into the peer's
   window with imm = (source rank, generation, message id). The target threads count
   completions per (source, message) in host memory.
5. **Wait**: the receiver waits until each source's counter reaches that message's chunk count
   (known from the header), never inferring completion from order; then checks the footer.

Every header field from a peer is checked against this rank's capacities before any data moves;
a peer that breaks the protocol raises :class:`ProtocolViolation`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from ..base import (
    STATUS_BAD_INPUT, STATUS_OK, TransportError, align_up, ceil_div, group_input_error,
)
from . import native
from .options import PY_TAMPER
from .ring import Rings, describe_messages, native_call
from .window import (
    ALIGN, ERR_BYTES, FOOTER_BYTES, H_CHUNKS, H_FORMAT, H_OP, H_ROW_BYTES, H_ROWS, H_STATUS, H_TAG,
    HDR_FIXED, OP_DISPATCH, OP_NAMES, WindowLayout, align, as_bytes, row_format,
)

MSG_MASK = native.IMM_MSG_MASK  # message ids as carried in the immediate data


class GroupError(TransportError):
    """Raised by every rank at the same point of a round from the same headers (the protocol stays
    in step): the transport remains usable."""


class ProtocolViolation(TransportError):
    """A peer sent something the protocol forbids (counts beyond capacity, ids out of range,
    inconsistent header and data, stale round tag)."""


class Wire:
    """Rounds over one window, one set of rings and one engine (see the module docstring).

    Args:
        rank, world: this rank and the EP group size. max_tokens_per_rank: row capacity of a slot.
        layout: the window layout. window: ``[layout.window_bytes]`` uint8 (host or CUDA).
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
        self._bind_window()
        # per-round constants, built once
        w, lay = world, layout
        self._peers = np.array([r for r in range(w) if r != rank], dtype=np.int64)
        self._hdr_send_offs = lay.off_hdr_send + self._peers * lay.hdr_bytes
        self._hdr_lens = np.full(len(self._peers), lay.hdr_len, dtype=np.int64)
        # where our header lands in each peer's window, by round parity
        self._hdr_recv_offs = [np.full(len(self._peers), lay.hdr_recv_off(rank, p), dtype=np.int64)
                               for p in (0, 1)]
        self._hdr_chunks_all = np.full(len(self._peers), lay.hdr_chunks, dtype=np.int64)
        self._data_send_offs = np.array([lay.data_send_off(d) for d in range(w)], dtype=np.int64)
        self._wait_srcs = np.zeros(max(1, w), dtype=np.int32)
        self._wait_expected = np.zeros(max(1, w), dtype=np.uint64)
        self._wait_ptrs = (self._wait_srcs.ctypes.data, self._wait_expected.ctypes.data)
        self._hdr_text: Dict[int, bytes] = {}
        # What this rank handed to the engine since creation (host counts, see count_posted):
        # writes = descriptors, wire_bytes = their bytes; messages/rows/bytes = data messages,
        # their rows and the rows' payload bytes (first plane only: no routing metadata).
        self.posted = {"writes": 0, "wire_bytes": 0, "messages": 0, "rows": 0, "bytes": 0}

    def _bind_window(self) -> None:
        """Host views of the window (a host window is read and written through numpy; a device
        window's header is staged in host memory and copied up)."""
        lay, w = self.layout, self.world
        if self.window.is_cuda:
            self._win_np = None
            self._hdr_stage = np.zeros((w, lay.hdr_bytes), dtype=np.uint8)
            self._hdr_is_window = False
        else:
            self._win_np = self.window.numpy()
            self._hdr_stage = self._win_np[lay.off_hdr_send:lay.off_hdr_send + w * lay.hdr_bytes].reshape(
                w, lay.hdr_bytes)
            self._hdr_is_window = True
        self._hdr_stage_i64 = self._hdr_stage[:, :lay.hdr_fields * 8].view(np.int64)

    def set_window(self, window: torch.Tensor) -> None:
        self.window = window
        self._bind_window()

    def start(self, engine, gen: int) -> None:
        self.engine = engine
        self.gen = gen
        self.rings.attach(engine, self.timeout_ms)

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

    def send_slot(self, d: int, off: int, n: int, width: int) -> torch.Tensor:
        """Writable ``[n, width]`` uint8 view of dest d's send slot at byte offset off."""
        return self.window_view(self.layout.data_send_off(d) + off, n * width).view(n, width)

    def window_ready(self) -> None:
        """A device window is written by kernels on the current stream: they must have finished
        before a descriptor hands the bytes to the provider, and our copies out of the receive
        side must have finished before a header lets peers overwrite it. No-op for host windows."""
        if self.window.is_cuda:
            torch.cuda.current_stream(self.window.device).synchronize()

    def wait(self, msg: int, srcs, expected) -> None:
        """Waits (native, bounded) until each source's counter of ``msg`` reaches its expected
        chunk count, then resets those counters."""
        n = len(srcs)
        if not n:
            return
        self._wait_srcs[:n] = srcs
        self._wait_expected[:n] = expected
        native_call(self.engine.wait_counters, msg, *self._wait_ptrs, n, True, self.timeout_ms)

    def quiesce(self) -> None:
        """Waits until our previous writes completed locally, so the send side may be rewritten."""
        native_call(self.engine.wait_idle, self.timeout_ms)

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

    # One round ------------------------------------------------------------------------------
    def round(self, op: int, planes: Dict[int, List[torch.Tensor]], widths: List[int],
              n_recv: Optional[List[int]], extra_WL: Optional[torch.Tensor],
              error: Optional[str], fmt: int = 0, pack: Optional[Callable[[], None]] = None,
              local: Optional[Callable[[torch.Tensor], None]] = None, count_rows: bool = True):
        """One header + data exchange with every peer (collective).

        Order: wait for our previous writes; post the headers; pack the send slots while the
        headers fly (``planes`` not already in their slot are copied, then ``pack()``); wait for
        the peers' headers and check them; post the data; run ``local(headers)`` while the data
        flies; wait for the data and check its footers.

        Args:
            planes: dest rank (!= self) -> list of ``[n, widths[p]]`` uint8 tensors, any device (rows to
                that rank); empty when ``error``. A plane may already be the send slot's view
                (``send_slot``), to be filled by ``pack``.
            widths: bytes per row of each plane (same on every rank).
            n_recv: rows expected from each rank, or None (dispatch: learned from the headers).
            extra_WL: ``[W, L]`` int64 CPU, per-destination extra header fields, or None.
            error: this rank's input error (sent with the status, then raised on every rank).
            fmt: row format (columns and dtype) every rank must share, 0 when not applicable.
            pack: fills the send-slot planes (runs after our previous writes left the slots).
            local: this rank's own work, given the checked headers, overlapping the data's flight.
            count_rows: add the rows to :attr:`posted` (False for the later column rounds of
                the same rows).
        Returns:
            (headers ``[W, F]`` int64 CPU (row ``self.rank`` unset), {src: [plane views into the
            receive window]}). The views are valid until the next round: copy them out. Every
            header field was checked against this rank's capacities before the data moved.
        """
        w, me, lay = self.world, self.rank, self.layout
        peers = self._peers
        seq = self.seq
        self.seq += 1
        msg_hdr, msg_data = (2 * seq) & MSG_MASK, (2 * seq + 1) & MSG_MASK
        tag = (self.gen << 32) | (seq & 0xFFFFFFFF)
        row_bytes = sum(widths)
        what = OP_NAMES[op]
        self.quiesce()
        self.engine.expect(seq)  # from here on, a peer's message of another round is an error

        # 1. headers (also the "my window is free" handshake and the status carrier)
        rows_to = np.zeros(w, dtype=np.int64)
        if not error:
            for d, pl in planes.items():
                rows_to[d] = pl[0].shape[0] if pl else 0
        hdr_raw = self._hdr_stage
        hdr_raw.fill(0)
        hdr = self._hdr_stage_i64
        hdr[:, H_STATUS] = STATUS_BAD_INPUT if error else STATUS_OK
        hdr[:, H_OP] = op
        hdr[:, H_ROW_BYTES] = row_bytes
        hdr[:, H_TAG] = tag
        hdr[:, H_FORMAT] = fmt
        if error:
            text = error.encode("utf-8", errors="replace")[:ERR_BYTES - 1]
            error = text.decode("utf-8", errors="ignore")  # what peers will read, byte for byte
            f8 = lay.hdr_fields * 8
            hdr_raw[:, f8:f8 + len(text)] = np.frombuffer(text, dtype=np.uint8)
        else:
            hdr[:, H_ROWS] = rows_to
            hdr[:, H_CHUNKS] = self._data_chunks_np(rows_to, widths)
            if extra_WL is not None:
                hdr[:, HDR_FIXED:HDR_FIXED + extra_WL.shape[1]] = extra_WL.numpy()
            self._tamper_header(op, hdr, rows_to, widths)
        if self._hdr_is_window:
            self.window_ready()
        else:  # a device window: the header goes up from its host staging buffer
            self.window_view(lay.off_hdr_send, w * lay.hdr_bytes).copy_(
                torch.from_numpy(hdr_raw.reshape(-1)))
            self.window_ready()
        if len(peers):
            self.rings.post(msg_hdr, peers, self._hdr_send_offs, self._hdr_recv_offs[seq % 2],
                            self._hdr_lens, lay.chunk_bytes)
            self.count_posted(self._hdr_lens)

        # 2. pack the send slots while the headers fly (each plane, then the footer)
        msgs = None
        if not error:
            msgs = self._pack_slots(planes, widths, rows_to, tag)
            if pack is not None:
                pack()
            self._tamper_data(op, planes)

        # wait for every peer's header, then check it before any data moves
        self.wait(msg_hdr, peers, self._hdr_chunks_all)
        got = self._read_headers(seq)
        got_t = torch.from_numpy(got)
        self._check_headers(got, seq, what, op, row_bytes, fmt, tag, error, widths, n_recv)
        rows_from = got[:, H_ROWS].copy()
        rows_from[me] = 0

        # 3. post the data (every chunk of every message in one native call)
        if msgs is not None and len(msgs[0]):
            self.window_ready()
            dests, loffs, roffs, sizes = msgs
            if self.use_triton:
                self.rings.push_triton(dests.tolist(), loffs.tolist(), roffs.tolist(),
                                       sizes.tolist(), msg_data, lay.chunk_bytes, self.triton_device)
            else:
                self.rings.post(msg_data, dests, loffs, roffs, sizes, lay.chunk_bytes)
            sent = int(rows_to.sum())
            self.count_posted(sizes, messages=int(np.count_nonzero(rows_to)),
                              rows=sent if count_rows else 0, payload=sent * widths[0])

        # 4. this rank's own share while the data flies
        if local is not None:
            local(got_t)

        # 5. wait for every chunk of every source's message, check its footer, hand out views
        srcs = peers[rows_from[peers] > 0]
        if len(srcs):
            self.wait(msg_data, srcs, self._data_chunks_np(rows_from[srcs], widths))
        out = {}
        for r in peers.tolist():
            n = int(rows_from[r])
            base = lay.data_recv_off(r)
            views_r, off = [], 0
            for wdt in widths:
                views_r.append(self.window_view(base + off, n * wdt).view(n, wdt))
                off += align(n * wdt)
            if n:
                foot = self._read_i64(base + off, 2)
                if int(foot[0]) != n or int(foot[1]) != tag:
                    self.violation(
                        f"rank {r}'s {what} data says {int(foot[0])} rows (round tag "
                        f"{int(foot[1]):#x}), its header {n} rows (tag {tag:#x})")
            out[r] = views_r
        return got_t, out

    def _data_chunks_np(self, rows: np.ndarray, widths: List[int]) -> np.ndarray:
        """``[n]`` int64 chunks of data messages of ``rows`` rows each (see data_chunks)."""
        cb = self.layout.chunk_bytes
        total = np.zeros(len(rows), dtype=np.int64)
        for wd in widths:
            total += ceil_div(rows * wd, cb)
        return np.where(rows > 0, total + 1, 0).astype(np.int64)

    def _read_i64(self, off: int, n: int) -> np.ndarray:
        """``n`` int64 at window offset ``off`` (copied to the host)."""
        if self._win_np is not None:
            return self._win_np[off:off + 8 * n].view(np.int64).copy()
        return self.window_view(off, 8 * n).cpu().numpy().view(np.int64)

    def _read_headers(self, seq: int) -> np.ndarray:
        """``[W, F]`` int64 copy of the peers' headers of round ``seq`` (row self.rank zero); their
        error texts go to ``self._hdr_text``."""
        lay = self.layout
        f8 = lay.hdr_fields * 8
        got = np.zeros((self.world, lay.hdr_fields), dtype=np.int64)
        self._hdr_text = {}
        for r in self._peers.tolist():
            off = lay.hdr_recv_off(r, seq)
            if self._win_np is not None:
                raw = self._win_np[off:off + lay.hdr_len]
            else:
                raw = self.window_view(off, lay.hdr_len).cpu().numpy()
            got[r] = raw[:f8].view(np.int64)
            if got[r, H_STATUS] == STATUS_BAD_INPUT:
                self._hdr_text[r] = raw[f8:].tobytes()
        return got

    def _check_headers(self, got: np.ndarray, seq: int, what: str, op: int, row_bytes: int,
                       fmt: int, tag: int, error: Optional[str], widths: List[int],
                       n_recv: Optional[List[int]]) -> None:
        """Refuses headers that break the protocol; raises the group's input errors on every rank
        (the same message everywhere: every rank read the same statuses and texts)."""
        me, peers, lay = self.rank, self._peers, self.layout
        pl = peers.tolist()
        errs = {me: error} if error else {}
        status = got[peers, H_STATUS]
        if (status != STATUS_OK).any():
            for r in pl:
                st = int(got[r, H_STATUS])
                if st == STATUS_BAD_INPUT:
                    text = self._hdr_text.get(r, b"").split(b"\0", 1)[0]
                    errs[r] = text.decode("utf-8", errors="replace") or f"rank {r}: (no message)"
                elif st != STATUS_OK:
                    self.violation(f"rank {r}'s {what} header has status {st}")
        if errs:
            raise group_input_error(f"proxy {what}", errs)
        if (got[peers, H_TAG] != tag).any():
            for r in pl:
                if int(got[r, H_TAG]) != tag:
                    self.violation(f"rank {r}'s {what} header carries round tag {int(got[r, H_TAG]):#x}, "
                                   f"expected {tag:#x} (a stale or replayed header)")
        if ((got[peers, H_OP] != op).any() or (got[peers, H_ROW_BYTES] != row_bytes).any()
                or (got[peers, H_FORMAT] != fmt).any()):
            views = {r: (int(got[r, H_OP]), int(got[r, H_ROW_BYTES]), int(got[r, H_FORMAT])) for r in pl}
            views[me] = (op, row_bytes, fmt)
            raise GroupError(
                f"proxy: ranks are in different operations or row formats: "
                + ", ".join(f"rank {r}: {OP_NAMES.get(v[0], v[0])} {v[1]} bytes/row format {v[2]}"
                            for r, v in sorted(views.items()))
                + "; every rank must call the same operations in order with rows of one "
                  "dtype and width")
        cap = self.max_tokens_per_rank
        rows, chunks = got[peers, H_ROWS], got[peers, H_CHUNKS]
        if ((rows < 0) | (rows > cap)).any() or (chunks != self._data_chunks_np(np.clip(rows, 0, None), widths)).any():
            for r in pl:
                n, ch = int(got[r, H_ROWS]), int(got[r, H_CHUNKS])
                if not 0 <= n <= cap:
                    self.violation(f"rank {r} declares {n} {what} rows; capacity is 0..{cap} "
                                   f"(max_tokens_per_rank)")
                if ch != lay.data_chunks(n, widths):
                    self.violation(f"rank {r} declares {n} {what} rows in {ch} chunks; {n} rows of "
                                   f"{row_bytes} bytes are {lay.data_chunks(n, widths)} chunks")
        if n_recv is not None:
            mism = [r for r in pl if int(got[r, H_ROWS]) != n_recv[r]]
            if mism:
                raise TransportError(
                    f"rank {me}: {what}: ranks {mism} send {[int(got[r, H_ROWS]) for r in mism]} rows, "
                    f"the handle expects {[n_recv[r] for r in mism]}; handles from different "
                    f"dispatches?")

    def _pack_slots(self, planes, widths: List[int], rows_to: np.ndarray, tag: int):
        """Copies planes that are not already their send slot into it, writes each footer, and
        returns the data messages ``(dests, local_offs, remote_offs, sizes)`` (``[M]`` int64)."""
        lay, me = self.layout, self.rank
        dests = np.flatnonzero(rows_to).astype(np.int64)
        if len(dests) == 0:
            return dests, dests, dests, dests
        n = rows_to[dests]
        base = self._data_send_offs[dests]
        rbase = lay.data_recv_off(me)
        dl, ll, rl, sl = [], [], [], []
        off = np.zeros(len(dests), dtype=np.int64)
        for p, wdt in enumerate(widths):
            nb = n * wdt
            for i, d in enumerate(dests.tolist()):
                t = planes[d][p]
                ni = int(n[i])
                dst = self.window_view(int(base[i] + off[i]), ni * wdt).view(ni, wdt)
                if t.data_ptr() != dst.data_ptr():
                    dst.copy_(t)
            if wdt:
                dl.append(dests); ll.append(base + off); rl.append(rbase + off); sl.append(nb)
            off += align_up(nb, ALIGN)
        # footer: rows and round tag, checked by the receiver against the header
        foot = np.stack([n, np.full_like(n, tag)], 1)
        if self._win_np is not None:
            for i in range(len(dests)):
                o = int(base[i] + off[i])
                self._win_np[o:o + FOOTER_BYTES].view(np.int64)[:] = foot[i]
        else:
            for i in range(len(dests)):
                o = int(base[i] + off[i])
                self.window_view(o, FOOTER_BYTES).copy_(torch.from_numpy(foot[i].view(np.uint8)))
        dl.append(dests); ll.append(base + off); rl.append(rbase + off)
        sl.append(np.full(len(dests), FOOTER_BYTES, dtype=np.int64))
        # message order: per destination, its planes then its footer (as the receiver reads them)
        order = np.argsort(np.concatenate([np.arange(len(dests))] * len(dl)), kind="stable")
        cat = [np.ascontiguousarray(np.concatenate(a)[order]) for a in (dl, ll, rl, sl)]
        return tuple(cat)

    def _tamper_header(self, op: int, hdr: np.ndarray, rows_to: np.ndarray, widths) -> None:
        """Test-only (EFA_EP_PROXY_TAMPER): corrupts this rank's first dispatch header to a peer
        it sends rows to, once ("ids" corrupts the data instead, see _tamper_data)."""
        kind = self.tamper
        if kind not in PY_TAMPER or kind == "ids" or op != OP_DISPATCH:
            return
        nz = np.flatnonzero(rows_to)
        if len(nz) == 0:
            return
        d = int(nz[0])
        if kind == "rows":
            hdr[d, H_ROWS] += 3
        elif kind == "rows_consistent":  # chunk count matching the lie: only the footer tells
            hdr[d, H_ROWS] += 3
            hdr[d, H_CHUNKS] = self.layout.data_chunks(int(hdr[d, H_ROWS]), widths)
        elif kind == "capacity":
            hdr[d, H_ROWS] = self.max_tokens_per_rank + 1
        elif kind == "chunks":
            hdr[d, H_CHUNKS] += 1
        elif kind == "expert_counts":
            hdr[d, HDR_FIXED] += 1
        elif kind == "tag":
            hdr[d, H_TAG] -= 2
        self.tamper = ""

    def _tamper_data(self, op: int, planes) -> None:
        """Test-only: "ids" puts an out-of-range expert id into the first dispatch's packed
        routing metadata to a peer it sends rows to, once."""
        if self.tamper != "ids" or op != OP_DISPATCH:
            return
        d = next((d for d, pl in planes.items() if pl and pl[0].shape[0]), None)
        if d is None:
            return
        ids = planes[d][1].view(torch.int64)  # the meta plane in the send slot: ids first
        ids[0, 0] = 999
        self.tamper = ""

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
