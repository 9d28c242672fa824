"""Routing math shared by the transports: where each token goes (computed locally from
``topk_idx``), combine's ordered reduction, float bit patterns carried in int64, sizes."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class SendLayout:
    """Where each token goes, computed locally from ``topk_idx`` (no communication).

    Attributes:
        dest_rank_TK: ``[T, K]`` int64 destination rank of each slot, -1 for an unused slot.
        is_token_in_rank_TW: ``[T, W]`` bool, token t is sent to rank r.
        num_tokens_per_rank_W: ``[W]`` int64 rows sent to each rank.
        num_tokens_per_expert_E: ``[E]`` int64 (token, expert) pairs per global expert.
        send_token_idx_S: ``[S]`` int64 source token of each sent row (rank-major, token order).
        send_rank_S: ``[S]`` int64 destination rank of each sent row.
        send_topk_idx_SK: ``[S, K]`` int64 local expert ids as seen by the destination, -1
            where the slot's expert is on another rank.
        send_slot_TW: ``[T, W]`` int64 row index of (token, rank) inside that rank's block of
            rows from this source, -1 where the token is not sent to the rank.
    """

    dest_rank_TK: torch.Tensor
    is_token_in_rank_TW: torch.Tensor
    num_tokens_per_rank_W: torch.Tensor
    num_tokens_per_expert_E: torch.Tensor
    send_token_idx_S: torch.Tensor
    send_rank_S: torch.Tensor
    send_topk_idx_SK: torch.Tensor
    send_slot_TW: torch.Tensor


def _tokens_in_rank(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    num_local = num_experts // world_size
    # Out-of-range ids count as unused here so that counting never indexes out of bounds; the
    # transport reports them (value_error_flags) before any row moves.
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    dest = torch.where(valid, topk_idx // num_local, torch.full_like(topk_idx, -1))
    is_in = torch.zeros(topk_idx.shape[0], world_size, dtype=torch.bool, device=topk_idx.device)
    if topk_idx.numel():
        rows = torch.arange(topk_idx.shape[0], device=topk_idx.device).unsqueeze(1).expand_as(dest)
        is_in[rows[valid], dest[valid]] = True
    return valid, dest, is_in


def _counts(topk_idx, valid, is_in, num_experts: int):
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_idx.device)
    per_expert.index_add_(0, torch.where(valid, topk_idx, num_experts).reshape(-1),
                          torch.ones(topk_idx.numel(), dtype=torch.int64, device=topk_idx.device))
    return is_in.sum(0).to(torch.int64), per_expert[:num_experts]


def count_sends(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    """Counts only, with no device-to-host sync: ``(num_tokens_per_rank_W [W] int64,
    num_tokens_per_expert_E [E] int64)`` on ``topk_idx``'s device (see :class:`SendLayout`)."""
    valid, _, is_in = _tokens_in_rank(topk_idx, num_experts, world_size)
    return _counts(topk_idx, valid, is_in, num_experts)


def compute_send_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int,
                        num_rows: Optional[int] = None) -> SendLayout:
    """Routing layout of one rank's tokens (the reference the Triton layout kernel must match).

    Args:
        topk_idx: ``[T, K]`` int64, any device; global expert ids, -1 marks an unused slot.
            Must already be validated (ids in [-1, E)).
        num_experts: E. world_size: W.
        num_rows: S if the host already knows it (e.g. after the count exchange): the row
            indices are then built without a device-to-host sync.

    Returns:
        SendLayout on ``topk_idx``'s device. Deterministic: slots come from prefix sums over
        token order, never from atomics.
    """
    num_local = num_experts // world_size
    valid, dest, is_in = _tokens_in_rank(topk_idx, num_experts, world_size)
    num_per_rank, num_per_expert = _counts(topk_idx, valid, is_in, num_experts)
    # Rank-major row order: transpose so that nonzero() walks rank by rank, tokens ascending.
    is_in_t = is_in.t()
    nz = is_in_t.nonzero() if num_rows is None else torch.nonzero_static(is_in_t, size=num_rows)
    send_rank = nz[:, 0].contiguous()
    send_token = nz[:, 1].contiguous()
    # Slot of (token, rank) inside rank's block: exclusive prefix sum down the token axis.
    slot = torch.cumsum(is_in.to(torch.int64), dim=0) - 1
    slot = torch.where(is_in, slot, torch.full_like(slot, -1))
    src_idx = topk_idx[send_token]  # [S, K]
    owner = dest[send_token]
    send_topk = torch.where(
        owner == send_rank.unsqueeze(1), src_idx - send_rank.unsqueeze(1) * num_local,
        torch.full_like(src_idx, -1),
    )
    return SendLayout(dest, is_in, num_per_rank, num_per_expert, send_token, send_rank, send_topk, slot)


def ranks_in_mask(mask: int, world: int) -> list:
    """Source ranks named by a :func:`received_metadata_errors` bitmask."""
    return [r for r in range(min(world, 63)) if (mask >> min(r, 62)) & 1]


def float_bits_to_int64(w: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 carrying the exact bit pattern (so weights ride with int64 ids)."""
    return w.contiguous().view(torch.int32).to(torch.int64)


def int64_to_float_bits(v: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`float_bits_to_int64`."""
    return v.to(torch.int32).view(torch.float32)


def reduce_rows_by_rank(rows_SD: torch.Tensor, send_token_idx_S: torch.Tensor,
                        num_send_per_rank, num_tokens: int) -> torch.Tensor:
    """Float32 sum over destination ranks in ascending rank order, starting from +0.0.

    Args:
        rows_SD: ``[S, D]`` rows returned by the ranks, grouped by rank ascending.
        send_token_idx_S: ``[S]`` int64 source token of each row.
        num_send_per_rank: W ints, group sizes.
        num_tokens: T.
    Returns:
        ``[T, D]`` float32. Inside one rank's group each token appears at most once, so
        ``index_add_`` per group adds exactly one value per token: the order is rank order.
    """
    out = torch.zeros(num_tokens, rows_SD.shape[1], dtype=torch.float32, device=rows_SD.device)
    start = 0
    for n in num_send_per_rank:
        if n:
            out.index_add_(0, send_token_idx_S[start:start + n], rows_SD[start:start + n].float())
        start += n
    return out


# Sizes ------------------------------------------------------------------------------------
def ceil_div(a, b):
    """``ceil(a / b)`` for non-negative integers: how many pieces of ``b`` hold ``a`` (chunks of
    a message, token blocks of a grid). Works elementwise on integer numpy arrays and torch tensors
    too."""
    return -(-a // b)


def align_up(n, alignment: int):
    """The smallest multiple of ``alignment`` that is >= ``n`` (byte offsets and sizes of window
    regions). Works elementwise on integer numpy arrays and torch tensors too."""
    return ceil_div(n, alignment) * alignment


def nbytes_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
