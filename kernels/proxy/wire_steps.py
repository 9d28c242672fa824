"""The proxy round in Python steps, for what the native round does not cover: a device window
(``hmem='cuda'``: headers staged and copied up), the Triton descriptor producer, and the
test-only header and data tampering (``EFA_EP_PROXY_TAMPER``). Same send-area layout, messages
and header checks (``efa_wire_check_headers``) as ``efa_round.c``. A mixin of
:class:`~efa_ep.kernels.proxy.wire.Wire`, whose state it uses."""
from __future__ import annotations

from typing import List

import numpy as np
import torch

from ..base import STATUS_BAD_INPUT, STATUS_OK, TransportError, align_up
from . import native
from .options import PY_TAMPER
from .window import (
    ALIGN, FOOTER_BYTES, H_CHUNKS, H_FORMAT, H_OP, H_ROW_BYTES, H_ROWS, H_STATUS, H_TAG, HDR_FIXED,
    OP_DISPATCH,
)

MSG_MASK = native.IMM_MSG_MASK  # message ids as carried in the immediate data


class PythonRoundSteps:
    """:class:`Wire`'s round as Python steps (see the module)."""

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
            self._tamper_header(op, hdr, rt, widths)
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

    def _push_triton(self, msgs: np.ndarray, msg: int) -> None:
        dests, loffs, roffs, sizes = (a.tolist() for a in msgs)
        self.rings.push_triton(dests, loffs, roffs, sizes, msg, self.layout.chunk_bytes,
                               self.triton_device)

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

    def _tamper_data(self, op: int) -> None:
        """Test-only: "ids" puts an out-of-range expert id into the first dispatch's packed
        routing metadata (plane 1) to a peer it sends rows to, once."""
        if self.tamper != "ids" or op != OP_DISPATCH or self._round[5]:
            return
        nz = np.flatnonzero(self._rows_to)
        if not len(nz):
            return
        ids = self.slot(1, int(nz[0])).view(torch.int64)  # the meta plane in the send area: ids first
        ids[0, 0] = 999
        self.tamper = ""
