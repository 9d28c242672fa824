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
4. **Proxy**: the K native channel threads post ``fi_writedata`` into the peer's window with
   imm = (source rank, generation, message id). The target threads count completions per
   (source, message) in host memory.
5. **Wait**: the receiver waits until each source's counter reaches that message's chunk count
   (known from the header), never inferring completion from order; then checks the footer.

Every header field from a peer is checked against this rank's capacities before any data moves;
a peer that breaks the protocol raises :class:`ProtocolViolation`.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..base import DispatchInputError, TransportError
from . import native
from .options import PY_TAMPER
from .ring import Rings, describe_messages, native_call
from .window import (
    ERR_BYTES, FOOTER_BYTES, H_CHUNKS, H_FORMAT, H_OP, H_ROW_BYTES, H_ROWS, H_STATUS, H_TAG,
    HDR_FIXED, OP_DISPATCH, OP_NAMES, STATUS_BAD, STATUS_OK, WindowLayout, align, as_bytes,
    row_format,
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

    def start(self, engine, gen: int) -> None:
        self.engine = engine
        self.gen = gen
        self.rings.attach(engine, self.timeout_ms)

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

    def wait(self, msg: int, srcs: List[int], expected: List[int]) -> None:
        if not srcs:
            return
        s = torch.tensor(srcs, dtype=torch.int32)
        e = torch.tensor(expected, dtype=torch.int64)
        native_call(self.engine.wait_counters, msg, s.data_ptr(), e.data_ptr(), len(srcs), True,
                    self.timeout_ms)

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
        self.wait(msg, peers, [self.rings.num_channels] * len(peers))

    # One round ------------------------------------------------------------------------------
    def round(self, op: int, planes: Dict[int, List[torch.Tensor]], widths: List[int],
              n_recv: Optional[List[int]], extra_WL: Optional[torch.Tensor],
              error: Optional[str], fmt: int = 0):
        """One header + data exchange with every peer (collective).

        Args:
            planes: dest rank (!= self) -> list of ``[n, widths[p]]`` uint8 tensors, any device (rows to
                that rank); empty when ``error``.
            widths: bytes per row of each plane (same on every rank).
            n_recv: rows expected from each rank, or None (dispatch: learned from the headers).
            extra_WL: ``[W, L]`` int64 CPU, per-destination extra header fields, or None.
            error: this rank's input error (sent with the status, then raised on every rank).
            fmt: row format (columns and dtype) every rank must share, 0 when not applicable.
        Returns:
            (headers ``[W, F]`` int64 CPU (row ``self.rank`` unset), {src: [plane views into the
            receive window]}). The views are valid until the next round: copy them out. Every
            header field was checked against this rank's capacities before the data moved.
        """
        w, me, lay = self.world, self.rank, self.layout
        peers = [r for r in range(w) if r != me]
        seq = self.seq
        self.seq += 1
        msg_hdr, msg_data = (2 * seq) & MSG_MASK, (2 * seq + 1) & MSG_MASK
        tag = (self.gen << 32) | (seq & 0xFFFFFFFF)
        row_bytes = sum(widths)
        what = OP_NAMES[op]
        self.quiesce()
        self.engine.expect(seq)  # from here on, a peer's message of another round is an error

        # 1. headers (also the "my window is free" handshake and the status carrier)
        hdr_raw = self.window_view(lay.off_hdr_send, w * lay.hdr_bytes).view(w, lay.hdr_bytes)
        hdr_raw.zero_()
        hdr = hdr_raw[:, :lay.hdr_fields * 8].view(torch.int64)
        hdr[:, H_STATUS] = STATUS_BAD if error else STATUS_OK
        hdr[:, H_OP] = op
        hdr[:, H_ROW_BYTES] = row_bytes
        hdr[:, H_TAG] = tag
        hdr[:, H_FORMAT] = fmt
        if error:
            text = error.encode("utf-8", errors="replace")[:ERR_BYTES - 1]
            error = text.decode("utf-8", errors="ignore")  # what peers will read, byte for byte
            hdr_raw[:, lay.hdr_fields * 8:lay.hdr_fields * 8 + len(text)].copy_(
                torch.frombuffer(bytearray(text), dtype=torch.uint8))
        else:
            for d, pl in planes.items():
                n = pl[0].shape[0] if pl else 0
                hdr[d, H_ROWS] = n
                hdr[d, H_CHUNKS] = lay.data_chunks(n, widths)
            if extra_WL is not None:
                hdr[:, HDR_FIXED:HDR_FIXED + extra_WL.shape[1]] = extra_WL
            self._tamper_header(op, hdr, planes, widths)
        self.window_ready()
        if peers:
            p = torch.tensor(peers, dtype=torch.int64)
            self.rings.push(describe_messages(
                p, lay.off_hdr_send + p * lay.hdr_bytes,
                torch.full_like(p, lay.hdr_recv_off(me, seq)),
                torch.full_like(p, lay.hdr_len), msg_hdr, lay.chunk_bytes))
        self.wait(msg_hdr, peers, [lay.hdr_chunks] * len(peers))
        got = torch.zeros(w, lay.hdr_fields, dtype=torch.int64)
        errs = {me: error} if error else {}
        for r in peers:
            raw = self.window_view(lay.hdr_recv_off(r, seq), lay.hdr_len).to("cpu", copy=True)
            got[r] = raw[:lay.hdr_fields * 8].view(torch.int64)
            st = int(got[r, H_STATUS])
            if st == STATUS_BAD:
                text = bytes(raw[lay.hdr_fields * 8:].tolist()).split(b"\0", 1)[0]
                errs[r] = text.decode("utf-8", errors="replace") or f"rank {r}: (no message)"
            elif st != STATUS_OK:
                self.violation(f"rank {r}'s {what} header has status {st}")
        if errs:
            # the same message on every rank: every rank read the same statuses and texts
            bad = sorted(errs)
            raise DispatchInputError(f"proxy {what}: invalid input on rank(s) {bad}: "
                                     + "; ".join(errs[r] for r in bad))
        for r in peers:
            if int(got[r, H_TAG]) != tag:
                self.violation(f"rank {r}'s {what} header carries round tag {int(got[r, H_TAG]):#x}, "
                               f"expected {tag:#x} (a stale or replayed header)")
        views = {r: (int(got[r, H_OP]), int(got[r, H_ROW_BYTES]), int(got[r, H_FORMAT]))
                 for r in peers}
        views[me] = (op, row_bytes, fmt)
        if len(set(views.values())) > 1:
            raise GroupError(
                f"proxy: ranks are in different operations or row formats: "
                + ", ".join(f"rank {r}: {OP_NAMES.get(v[0], v[0])} {v[1]} bytes/row format {v[2]}"
                            for r, v in sorted(views.items()))
                + "; every rank must call the same operations in order with rows of one "
                  "dtype and width")
        rows_from = {}
        cap = self.max_tokens_per_rank
        for r in peers:
            n, ch = int(got[r, H_ROWS]), int(got[r, H_CHUNKS])
            if not 0 <= n <= cap:
                self.violation(f"rank {r} declares {n} {what} rows; capacity is 0..{cap} "
                               f"(max_tokens_per_rank)")
            if ch != lay.data_chunks(n, widths):
                self.violation(f"rank {r} declares {n} {what} rows in {ch} chunks; {n} rows of "
                               f"{row_bytes} bytes are {lay.data_chunks(n, widths)} chunks")
            rows_from[r] = n
        if n_recv is not None:
            mism = [r for r in peers if rows_from[r] != n_recv[r]]
            if mism:
                raise TransportError(
                    f"rank {me}: {what}: ranks {mism} send {[rows_from[r] for r in mism]} rows, "
                    f"the handle expects {[n_recv[r] for r in mism]}; handles from different "
                    f"dispatches?")

        # 2-3. pack into the send slots, describe, push (each plane, then the footer)
        dests, loffs, roffs, sizes = [], [], [], []
        for d, pl in planes.items():
            n = pl[0].shape[0] if pl else 0
            if n == 0:
                continue
            base = lay.data_send_off(d)
            rbase = lay.data_recv_off(me)
            off = 0
            for t, wdt in zip(pl, widths):
                nb = n * wdt
                dst = self.window_view(base + off, nb).view(n, wdt)
                if t.data_ptr() != dst.data_ptr():
                    dst.copy_(t)
                if nb:
                    dests.append(d); loffs.append(base + off); roffs.append(rbase + off); sizes.append(nb)
                off += align(nb)
            # footer: rows and round tag, checked by the receiver against the header
            foot = self.window_view(base + off, FOOTER_BYTES)
            foot.copy_(torch.tensor([n, tag], dtype=torch.int64).view(torch.uint8))
            dests.append(d); loffs.append(base + off); roffs.append(rbase + off); sizes.append(FOOTER_BYTES)
        if dests:
            self.window_ready()
            if self.use_triton:
                self.rings.push_triton(dests, loffs, roffs, sizes, msg_data, lay.chunk_bytes,
                                       self.triton_device)
            else:
                self.rings.push(describe_messages(torch.tensor(dests), torch.tensor(loffs),
                                                  torch.tensor(roffs), torch.tensor(sizes), msg_data,
                                                  lay.chunk_bytes))

        # 5. wait for every chunk of every source's message, check its footer, hand out views
        srcs = [r for r in peers if rows_from[r]]
        self.wait(msg_data, srcs, [lay.data_chunks(rows_from[r], widths) for r in srcs])
        out = {}
        for r in peers:
            n = rows_from[r]
            base = lay.data_recv_off(r)
            views_r, off = [], 0
            for wdt in widths:
                views_r.append(self.window_view(base + off, n * wdt).view(n, wdt))
                off += align(n * wdt)
            if n:
                foot = self.window_view(base + off, FOOTER_BYTES).to("cpu", copy=True).view(torch.int64)
                if int(foot[0]) != n or int(foot[1]) != tag:
                    self.violation(
                        f"rank {r}'s {what} data says {int(foot[0])} rows (round tag "
                        f"{int(foot[1]):#x}), its header {n} rows (tag {tag:#x})")
            out[r] = views_r
        return got, out

    def _tamper_header(self, op: int, hdr: torch.Tensor, planes, widths) -> None:
        """Test-only (EFA_EP_PROXY_TAMPER): corrupts this rank's first dispatch header to a peer
        it sends rows to, once."""
        kind = self.tamper
        if kind not in PY_TAMPER or op != OP_DISPATCH:
            return
        d = next((d for d, pl in planes.items() if pl and pl[0].shape[0]), None)
        if d is None:
            return
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
        elif kind == "ids":
            ids = planes[d][1].view(torch.int64)  # the meta plane in the send slot: ids first
            ids[0, 0] = 999
        self.tamper = ""

    # Row blocks -----------------------------------------------------------------------------
    def exchange_rows(self, op: int, rows_to: Dict[int, torch.Tensor], self_rows: torch.Tensor,
                      n_recv: List[int]) -> torch.Tensor:
        """Moves ``[n, D]`` row blocks (any dtype, all on one device) to each rank and
        returns the received rows concatenated in source-rank order (this rank's block =
        ``self_rows``), on that device. Rows wider than the window's row capacity go in column
        rounds. Each block is copied once into the pinned send slot and once out of the window."""
        me, w = self.rank, self.world
        d_cols, dtype = self_rows.shape[1], self_rows.dtype
        row_bytes = d_cols * self_rows.element_size()
        fmt = row_format(self_rows)
        as_b = {d: as_bytes(t) for d, t in rows_to.items()}
        recv = {r: torch.empty(n_recv[r], row_bytes, dtype=torch.uint8, device=self_rows.device)
                for r in range(w) if r != me}
        row_cap = self.layout.row_cap
        for c0 in range(0, max(row_bytes, 1), row_cap):
            c1 = min(row_bytes, c0 + row_cap)
            planes = {d: [t[:, c0:c1]] for d, t in as_b.items()}  # round copies into the slot
            _, got = self.round(op, planes, [c1 - c0], n_recv, None, None, fmt)
            for r, views in got.items():
                recv[r][:, c0:c1].copy_(views[0])
            if row_bytes == 0:
                break
        blocks = [self_rows if r == me else recv[r].view(dtype).view(n_recv[r], d_cols) for r in range(w)]
        return torch.cat(blocks, 0) if blocks else self_rows
