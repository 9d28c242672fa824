"""The proxy's registered window: what lives where, and the header and footer formats.

Memory (allocated once at setup, registered with every channel's domain, pinned when CUDA is
present): ``[hdr send W][send area: W slots][receive region per source r: header parity 0,
header parity 1, data slot, 16-byte probe pad]``; a slot holds ``max_tokens_per_rank`` rows of
``row_cap`` bytes (row_cap = H * elem + 16 * max_topk by default). A round lays the send area out
as one block (``wire.py``): plane p of every destination in rank order, then the footers, so the
rows to every peer are packed by one gather (one device-to-host copy for a GPU input). Header receive slots are
double-buffered by round parity: a peer that expects no rows from us can finish round n and send
its round n+1 header before we read its round n header; it cannot send round n+2's before we sent
ours for n+1. Source r may write only into its receive region (its own registration and key).

Header (int64 fields, then L per-expert counts, then ``ERR_BYTES`` of error text):
``[status, op, rows, row_bytes, chunks, round tag, row format]``; status is the status word of
``kernels/base.py`` (``STATUS_OK``, or ``STATUS_BAD_INPUT`` with the rank's error text). Footer
(after a data message's planes): ``[rows, round tag]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import TransportError, align_up, ceil_div, dtype_code

ALIGN = 16
OP_DISPATCH, OP_COMBINE, OP_CACHED = 1, 2, 3
OP_NAMES = {OP_DISPATCH: "dispatch", OP_COMBINE: "combine", OP_CACHED: "dispatch_cached"}
H_STATUS, H_OP, H_ROWS, H_ROW_BYTES, H_CHUNKS, H_TAG, H_FORMAT = range(7)
HDR_FIXED = 7
ERR_BYTES = 512           # an input error's message travels to every peer (truncated)
FOOTER_BYTES = 16         # [rows, round tag] after a data message's planes
NUM_COUNTER_SLOTS = 64    # counter slots per source; a peer is never more than 2 messages ahead


@dataclass(frozen=True)
class WindowLayout:
    """Byte offsets of one rank's window (every rank lays its window out the same way)."""

    world: int
    row_cap: int          # bytes per row of a data slot
    chunk_bytes: int      # bytes per descriptor
    hdr_fields: int       # int64 fields of a header: HDR_FIXED + L
    hdr_len: int          # bytes a header message carries
    hdr_bytes: int        # header slot size (aligned)
    hdr_chunks: int       # descriptors per header message
    slot_bytes: int       # data slot size
    off_hdr_send: int
    off_data_send: int
    off_recv: int
    region_bytes: int     # one source's receive region (2 header slots, data slot, probe pad)
    window_bytes: int

    @classmethod
    def build(cls, world: int, num_local_experts: int, max_tokens_per_rank: int, row_cap: int,
              chunk_bytes: int, hidden: int) -> "WindowLayout":
        hdr_fields = HDR_FIXED + num_local_experts
        hdr_len = hdr_fields * 8 + ERR_BYTES
        hdr_bytes = align_up(hdr_len, ALIGN)
        # A slot carries at most max_tokens_per_rank rows (a rank sends each token once per
        # destination), plus alignment slack for up to 4 planes and the footer.
        slot_bytes = align_up(max(1, max_tokens_per_rank) * row_cap, ALIGN) + 4 * ALIGN + FOOTER_BYTES
        off_data_send = world * hdr_bytes
        off_recv = off_data_send + world * slot_bytes
        # + a 16-byte pad at the region's end that liveness probes write into (nobody reads it)
        region_bytes = 2 * hdr_bytes + slot_bytes + ALIGN
        window_bytes = off_recv + world * region_bytes
        if window_bytes >= (1 << 36):
            raise TransportError(
                f"window of {window_bytes} bytes exceeds 64 GiB (descriptor offsets); lower "
                f"max_tokens_per_rank={max_tokens_per_rank} or hidden={hidden}")
        return cls(world=world, row_cap=row_cap, chunk_bytes=chunk_bytes, hdr_fields=hdr_fields,
                   hdr_len=hdr_len, hdr_bytes=hdr_bytes, hdr_chunks=ceil_div(hdr_len, chunk_bytes),
                   slot_bytes=slot_bytes, off_hdr_send=0, off_data_send=off_data_send,
                   off_recv=off_recv, region_bytes=region_bytes, window_bytes=window_bytes)

    def hdr_send_off(self, dest: int) -> int:
        return self.off_hdr_send + dest * self.hdr_bytes

    def hdr_recv_off(self, src: int, seq: int) -> int:
        return self.off_recv + src * self.region_bytes + (seq % 2) * self.hdr_bytes

    def data_send_off(self, dest: int) -> int:
        return self.off_data_send + dest * self.slot_bytes

    def data_recv_off(self, src: int) -> int:
        return self.off_recv + src * self.region_bytes + 2 * self.hdr_bytes

    def chunks(self, nbytes: int) -> int:
        return ceil_div(nbytes, self.chunk_bytes)

    def data_chunks(self, rows: int, widths) -> int:
        """Chunks of one data message: each plane cut into chunks, plus the footer."""
        return sum(self.chunks(rows * wd) for wd in widths) + 1 if rows else 0


def alloc_window(nbytes: int, hmem: str):
    """(window ``[nbytes]`` uint8, CUDA device index or -1): device memory for ``hmem='cuda'``,
    else host memory, pinned when CUDA is present (the NIC writes it, the GPU may read it)."""
    if hmem == "cuda":
        dev = torch.cuda.current_device()
        return torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{dev}"), dev
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()), -1


# Row formats carried in the header so that ranks moving the same bytes per row with different
# dtypes or widths are refused instead of reinterpreting each other's rows.
def row_format(t: torch.Tensor) -> int:
    """Columns x 64 + the dtype's code of :func:`~efa_ep.kernels.base.dtype_code` (63: other)."""
    code = dtype_code(t.dtype)
    return int(t.shape[1]) * 64 + (code if 0 < code < 63 else 63)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with standard row-major strides. ``contiguous()`` is not enough before a byte view:
    an empty or size-1-dim tensor counts as contiguous with any strides (``torch.where`` on an
    empty top-1 tensor yields stride (1, 0)) and ``view(uint8)`` then refuses it."""
    if t.is_contiguous() and t.numel() and (t.dim() == 0 or t.stride(-1) == 1):
        return t
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, D]`` any dtype -> ``[n, D * elem]`` uint8 view of a dense copy (or of ``t``)."""
    t = dense(t)
    return t.view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())
