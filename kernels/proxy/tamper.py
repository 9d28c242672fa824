"""Test-only faults of the proxy's round (``EFA_EP_PROXY_TAMPER``): a rank corrupts its first
dispatch header to a peer, or the routing metadata it sends, once, so the tests can check that
every peer detects it and names this rank. Used by :class:`~efa_ep.kernels.proxy.wire.Wire`
over either window; the native engine's own faults (``native.TAMPER_KINDS``) are set in C."""
from __future__ import annotations

import numpy as np
import torch

from .options import PY_TAMPER
from .window import H_CHUNKS, H_ROWS, H_TAG, HDR_FIXED, OP_DISPATCH


def tamper_header(wire, op: int, hdr: np.ndarray, rows_to: np.ndarray, widths) -> None:
    """Test-only (EFA_EP_PROXY_TAMPER): corrupts this rank's first dispatch header to a peer
    it sends rows to, once ("ids" corrupts the data instead, see tamper_data)."""
    kind = wire.tamper
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
        hdr[d, H_CHUNKS] = wire.layout.data_chunks(int(hdr[d, H_ROWS]), widths)
    elif kind == "capacity":
        hdr[d, H_ROWS] = wire.max_tokens_per_rank + 1
    elif kind == "chunks":
        hdr[d, H_CHUNKS] += 1
    elif kind == "expert_counts":
        hdr[d, HDR_FIXED] += 1
    elif kind == "tag":
        hdr[d, H_TAG] -= 2
    wire.tamper = ""


def tamper_data(wire, op: int) -> None:
    """Test-only: "ids" puts an out-of-range expert id into the first dispatch's packed
    routing metadata (plane 1) to a peer it sends rows to, once."""
    if wire.tamper != "ids" or op != OP_DISPATCH or wire._round[5]:
        return
    nz = np.flatnonzero(wire._rows_to)
    if not len(nz):
        return
    ids = wire.slot(1, int(nz[0])).view(torch.int64)  # the meta plane in the send area: ids first
    ids[0, 0] = 999
    wire.tamper = ""
