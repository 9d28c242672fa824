"""The layout of a gda window (regions per parity) and the state a dispatch hands to the ops
that reuse its layout."""
from __future__ import annotations

import dataclasses
from typing import Optional


import torch

from ..base import HandleState, align_up

_ALIGN = 256      # bytes: every region of the window starts at a multiple of this


@dataclasses.dataclass(frozen=True)
class WindowLayout:
    """Byte layout of one rank's window (see the module docstring).

    Attributes:
        world: W. t_max: T_MAX rows per source. row_bytes: capacity of one row in bytes.
        k_cap: K_CAP top-k slots per row. num_local: L (header length is 2 + L).
    """

    world: int
    t_max: int
    row_bytes: int
    k_cap: int
    num_local: int

    @property
    def rows(self) -> int:
        return self.world * max(1, self.t_max)

    @property
    def data_bytes(self) -> int:
        return align_up(self.rows * self.row_bytes, _ALIGN)

    @property
    def idx_bytes(self) -> int:
        return align_up(self.rows * self.k_cap * 8, _ALIGN)

    @property
    def w_bytes(self) -> int:
        return align_up(self.rows * self.k_cap * 4, _ALIGN)

    @property
    def hdr_len(self) -> int:
        return 2 + self.num_local

    @property
    def hdr_bytes(self) -> int:
        return align_up(self.world * self.hdr_len * 8, _ALIGN)

    @property
    def board_words(self) -> int:
        """The count board of a dispatch that stores its rows compact (``rows_in_window``), in
        int64: ``[W, W]`` (row s: the rows source s sends to each rank), ``[W]`` (the first row
        at which each source stored its rows here), ``[W, 2 + L]`` (the header each source
        announced to this rank before its stores)."""
        return (self.world + 1) * self.world + self.world * self.hdr_len

    @property
    def board_bytes(self) -> int:
        return align_up(self.board_words * 8, _ALIGN)

    @property
    def parity_bytes(self) -> int:
        return self.data_bytes + self.idx_bytes + self.w_bytes + self.hdr_bytes + self.board_bytes

    @property
    def total_bytes(self) -> int:
        return 2 * self.parity_bytes

    def offsets(self, parity: int) -> dict:
        """Byte offsets of the regions of parity 0 or 1."""
        base = parity * self.parity_bytes
        hdr_off = base + self.data_bytes + self.idx_bytes + self.w_bytes
        return dict(data_off=base, idx_off=base + self.data_bytes,
                    w_off=base + self.data_bytes + self.idx_bytes, hdr_off=hdr_off,
                    board_off=hdr_off + self.hdr_bytes)


@dataclasses.dataclass(frozen=True)
class GdaDispatchState(HandleState):
    """``DispatchHandle.state`` of a gda dispatch.

    Attributes:
        owner: the transport object that made it (:class:`~efa_ep.kernels.base.HandleState`).
        slot_TW: ``[T, W]`` int64, device: row of (token, rank) in rank's block, -1 = not sent.
        recv_offsets: ``[W + 1]`` int64, device: first received row of each source (None for a
            fixed-capacity dispatch).
        epoch: the dispatch's op number.
        fixed: made by :meth:`GdaTransport.dispatch_fixed`; then ``num_recv_W`` ``[W]`` int64,
            device: rows received from each source (rows ``s * T_MAX + j``, ``j < n_s``).
    """

    slot_TW: torch.Tensor
    recv_offsets: Optional[torch.Tensor]
    epoch: int
    fixed: bool = False
    num_recv_W: Optional[torch.Tensor] = None
