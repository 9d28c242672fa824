"""The proxy round in Python steps: :class:`SteppedWire`, the wire of a device window
(``hmem='cuda'``: headers staged in host memory and copied up, the window written by kernels).
Same send-area layout, messages and header checks (``efa_wire_check_headers``) as the native
round of :class:`~efa_ep.kernels.proxy.wire.Wire` (``efa_round.c``); the tests run both kinds
over one host window and compare them."""
from __future__ import annotations

from typing import List

import numpy as np
import torch

from ..base import STATUS_BAD_INPUT, STATUS_OK, TransportError, align_up
from . import native
from .tamper import tamper_header
from .window import (
    ALIGN, FOOTER_BYTES, H_CHUNKS, H_FORMAT, H_OP, H_ROW_BYTES, H_ROWS, H_STATUS, H_TAG, HDR_FIXED,
    OP_NAMES,
)
from .wire import MSG_MASK, Wire


class SteppedWire(Wire):
    """:class:`Wire`'s round as Python steps (see the module). Same constructor."""

    native_round = False

    @classmethod
    def take_over(cls, wire: Wire) -> "SteppedWire":
        """A stepped wire that continues ``wire``'s rounds from its state (use it instead of
        ``wire`` from now on); tests run the two kinds over one host window to compare them."""
        new = cls.__new__(cls)
        new.__dict__.update(wire.__dict__)
        new._nw = None
        return new

    def _bind_native(self) -> None:
        super()._bind_native()
        self._nw = None  # only the header checks are native here

    def _begin_steps(self, op, widths, extras, fmt, tag, error, seq) -> None:
        self._py_begin(op, widths, extras, fmt, tag, error, seq)

    def _exchange_steps(self, seq, op, widths, fmt, tag, error, has_n_recv) -> None:
        self._py_exchange(seq, op, widths, fmt, tag, error, has_n_recv)

    def finish(self) -> None:
        seq, op, widths, fmt, tag, error, _, _ = self._round
        srcs = self._peers[self._rows_from[self._peers] > 0]
        if len(srcs):
            self.wait((2 * seq + 1) & MSG_MASK, srcs,
                      self._data_chunks_np(self._rows_from[srcs], widths))
        for r in srcs.tolist():
            n = int(self._rows_from[r])
            foot = self._footer(r, n, widths)
            if int(foot[0]) != n or int(foot[1]) != tag:
                self._footer_violation(r, OP_NAMES[op], widths, tag)

    def _py_plan(self, widths: List[int]) -> None:
        """The send area's layout (efa_round.c's rule): plane p of every destination in rank
        order, each destination 16-byte aligned, then the footers; and the data messages."""
        lay, me, w = self.layout, self.rank, self.world
        plan, rt = self._plan, self._rows_to
        plan.fill(-1)
        dests = [d for d in range(w) if d != me and rt[d] > 0]
        cur = lay.off_data_send
        for p, wd in enumerate(widths):
            for d in dests:
                cur = align_up(cur, ALIGN)
                plan[p, d] = cur
                cur += int(rt[d]) * wd
        cur = align_up(cur, ALIGN)
        for d in dests:
            plan[native.MAX_PLANES, d] = cur
            cur += FOOTER_BYTES
        if cur > lay.off_recv:
            raise TransportError(f"rank {me}: a round of {cur - lay.off_data_send} bytes exceeds the "
                                 f"send area of {lay.off_recv - lay.off_data_send} bytes")
        m, rbase = 0, lay.data_recv_off(me)
        for d in dests:
            n, roff = int(rt[d]), rbase
            for p, wd in enumerate(widths):
                if n * wd:
                    self._msgs[:, m] = (d, plan[p, d], roff, n * wd)
                    m += 1
                roff += align_up(n * wd, ALIGN)
            self._msgs[:, m] = (d, plan[native.MAX_PLANES, d], roff, FOOTER_BYTES)
            m += 1
        self._nmsgs = m

    def _py_begin(self, op, widths, extras, fmt, tag, error, seq) -> None:
        lay, rt = self.layout, self._rows_to
        self.quiesce()
        self.engine.expect(seq)  # from here on, a peer's message of another round is an error
        hdr_raw = self._hdr_stage
        hdr_raw.fill(0)
        hdr = self._hdr_stage_i64
        hdr[:, H_STATUS] = STATUS_BAD_INPUT if error else STATUS_OK
        hdr[:, H_OP] = op
        hdr[:, H_ROW_BYTES] = sum(widths)
        hdr[:, H_TAG] = tag
        hdr[:, H_FORMAT] = fmt
        if error:
            text = error.encode("utf-8")
            f8 = lay.hdr_fields * 8
            hdr_raw[:, f8:f8 + len(text)] = np.frombuffer(text, dtype=np.uint8)
            self._plan.fill(-1)
            self._nmsgs = 0
        else:
            hdr[:, H_ROWS] = rt
            hdr[:, H_CHUNKS] = self._data_chunks_np(rt, widths)
            if extras is not None:
                hdr[:, HDR_FIXED:HDR_FIXED + extras.shape[1]] = extras
            tamper_header(self, op, hdr, rt, widths)
            self._py_plan(widths)
        if not self._hdr_is_window:  # a device window: the header goes up from its staging buffer
            self.window_view(lay.off_hdr_send, self.world * lay.hdr_bytes).copy_(
                torch.from_numpy(hdr_raw.reshape(-1)))
        self.window_ready()
        peers = self._peers
        if len(peers):
            lens = np.full(len(peers), lay.hdr_len, dtype=np.int64)
            self.rings.post((2 * seq) & MSG_MASK, peers, lay.off_hdr_send + peers * lay.hdr_bytes,
                            np.full(len(peers), lay.hdr_recv_off(self.rank, seq), dtype=np.int64),
                            lens, lay.chunk_bytes)
            self.count_posted(lens)

    def _py_exchange(self, seq, op, widths, fmt, tag, error, has_n_recv) -> None:
        lay = self.layout
        peers = self._peers
        self.wait((2 * seq) & MSG_MASK, peers, np.full(len(peers), lay.hdr_chunks, dtype=np.int64))
        self._got[:] = self._read_headers(seq)
        rc = self.native(self._checks.check_headers)  # also sets _rows_from
        if rc:
            self.header_error(rc, seq, op, error)
        m = self._nmsgs
        if not m:
            return
        # footers: rows and round tag, checked by the receiver against the header
        for d in np.flatnonzero(self._plan[native.MAX_PLANES] >= 0).tolist():
            foot = np.array([self._rows_to[d], tag], dtype=np.int64)
            o = int(self._plan[native.MAX_PLANES, d])
            if self._win_np is not None:
                self._win_np[o:o + FOOTER_BYTES].view(np.int64)[:] = foot
            else:
                self.window_view(o, FOOTER_BYTES).copy_(torch.from_numpy(foot.view(np.uint8)))
        self.window_ready()
        msgs = np.ascontiguousarray(self._msgs[:, :m])
        if self.use_triton:
            self._push_triton(msgs, (2 * seq + 1) & MSG_MASK)
        else:
            self.rings.post((2 * seq + 1) & MSG_MASK, *msgs, lay.chunk_bytes)
