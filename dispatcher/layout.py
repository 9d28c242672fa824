"""Layout math of the ``efa`` dispatcher: pure tensor functions, no communication, no state.

T local tokens, E experts, K = moe_router_topk, N rows received, L local experts, W EP ranks,
T_MAX window rows per source, C expert capacity, P = L * W * C padded rows. Every function
works on the device of its inputs and, unless its docstring says otherwise, makes no host read
of device data (no ``.item()``, ``.tolist()``, ``nonzero`` or data-dependent shape), so on a
GPU it only launches kernels.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """``routing_map [T, E]`` bool, ``probs [T, E]`` -> ``topk_idx [T, K]`` int64 (selected
    experts ascending, -1 padding where a token kept fewer than K, e.g. capacity drops) and
    ``topk_weights [T, K]`` float32 (differentiable w.r.t. probs; 0 at -1). Both on
    routing_map's device.

    Raises ValueError when a token selects more than K experts; checked only for CPU tensors,
    where it costs one host read (on a GPU it would be a device sync)."""
    num_tokens, num_experts = routing_map.shape
    if num_tokens == 0:
        return (torch.empty(0, topk, dtype=torch.int64, device=routing_map.device),
                probs.new_zeros((0, topk), dtype=torch.float32) + probs.sum() * 0)
    # A stable descending sort of the bools lists each token's selected experts first, in
    # ascending id order, then its unselected ones (also ascending): one op gives both the ids
    # and, in the flags, which slots are real.
    selected, ids = routing_map.bool().sort(dim=1, descending=True, stable=True)
    if (topk < num_experts and routing_map.device.type == "cpu"
            and bool(selected[:, topk].any())):
        raise ValueError(
            f"routing_map selects more than moe_router_topk={topk} experts for a token")
    unused = ~selected[:, :topk]
    ids = ids[:, :topk]
    topk_idx = ids.masked_fill(unused, -1)
    # An unused slot's id names an expert the token did not select, so the gather never reads
    # (nor, in backward, adds into) a selected expert's prob; the weight is then zeroed.
    topk_weights = probs.gather(1, ids).masked_fill(unused, 0.0).float()
    return topk_idx, topk_weights


def expert_major_order(recv_topk_idx: torch.Tensor, num_local: int, num_rows: int):
    """The permutation of received rows into expert-major order, as Megatron's ``permute``
    builds from a ``[N, L]`` routing map, computed from ``recv_topk_idx [N, K]`` int64 (local
    expert ids, -1 unused; no row names an expert twice) directly.

    Args:
        recv_topk_idx: ``[N, K]`` int64, any device.
        num_local: L. num_rows: R, the number of (row, local expert) pairs (the sum of
            tokens_per_expert, known on the host).

    Returns:
        ``(slot_R, row_R)``, both ``[R]`` int64 on recv_topk_idx's device: for each output row,
        in order of local expert ascending then received row ascending, its position in the
        flattened ``[N * K]`` slots (where its weight is) and its received row (Megatron's
        ``sorted_indices``). One sort; no host read.
    """
    n, k = recv_topk_idx.shape
    # key = expert * N + row, the unused slots' -1 mapped to expert L: real slots' keys are
    # unique, equal keys occur only among unused slots, which sort last and are cut off, so an
    # unstable sort gives Megatron's order.
    rows = torch.arange(n, dtype=torch.int64, device=recv_topk_idx.device).unsqueeze(1)
    key = torch.add(rows, recv_topk_idx.remainder(num_local + 1), alpha=n)
    slot = key.view(-1).sort().indices[:num_rows]
    return slot, slot.div(k, rounding_mode="floor")


def routing_map_to_slots(routing_map: torch.Tensor, probs: torch.Tensor):
    """Drop-and-pad routing: ``routing_map [T, E]`` bool, ``probs [T, E]`` -> ``topk_idx [T, E]``
    int64 (slot e holds expert e where routed, else -1) and ``topk_weights [T, E]`` float32
    (differentiable w.r.t. probs; 0 where not routed). One slot per expert because Megatron's
    capacity padding routes a token to any number of experts. Device-side, no host sync."""
    num_experts = routing_map.shape[1]
    routed = routing_map.bool()
    ids = torch.arange(num_experts, dtype=torch.int64, device=routing_map.device).expand_as(routed)
    topk_idx = torch.where(routed, ids, torch.full_like(ids, -1))
    topk_weights = torch.where(routed, probs, torch.zeros((), dtype=probs.dtype,
                                                          device=probs.device)).float()
    return topk_idx, topk_weights


class PaddedLayout(NamedTuple):
    """Where each row of the padded expert input comes from in a fixed-layout window.

    P = L * W * C rows (per local expert l a block of W * C rows; inside it, source s's rows at
    ``s * C + c`` in its token order). All tensors on the window's device.

    Attributes:
        src_row_P: ``[P]`` int64, window row (``s * T_MAX + j``) of each padded row; 0 where
            ``valid_P`` is False (a pad row).
        slot_P: ``[P]`` int64, top-k slot of the window row that holds this row's local expert.
        valid_P: ``[P]`` bool, a real row (False: a pad row, all zeros).
        scatter_row_P: ``[P]`` int64, ``src_row_P`` where valid, else ``W * T_MAX`` (a dummy row
            one past the window, for index_add).
    """

    src_row_P: torch.Tensor
    slot_P: torch.Tensor
    valid_P: torch.Tensor
    scatter_row_P: torch.Tensor


def padded_layout(recv_topk_idx: torch.Tensor, num_local: int, world: int, t_max: int,
                  capacity: int) -> PaddedLayout:
    """Drop-and-pad layout from a fixed-layout dispatch's ``recv_topk_idx [W * T_MAX, K]`` int64
    (local expert ids, -1 unused; unused window rows all -1). Rows of source s for local expert
    l beyond ``capacity`` are dropped (Megatron's drop-and-pad keeps the first C in token
    order). Static shapes, device-side only: no host sync on any device."""
    dev = recv_topk_idx.device
    rows, k = recv_topk_idx.shape
    used = recv_topk_idx >= 0
    cols = torch.where(used, recv_topk_idx, num_local)  # column L collects the unused slots
    member = torch.zeros(rows, num_local + 1, dtype=torch.bool, device=dev).scatter_(1, cols, True)
    slots = torch.arange(k, dtype=torch.int64, device=dev).expand(rows, k).contiguous()
    slot_of = torch.zeros(rows, num_local + 1, dtype=torch.int64, device=dev).scatter_(1, cols, slots)
    # count[s, l, j]: rows of source s up to window row j (inclusive) that hold local expert l
    count = member[:, :num_local].reshape(world, t_max, num_local).permute(0, 2, 1).to(
        torch.int64).cumsum(2).contiguous()
    want = torch.arange(1, capacity + 1, dtype=torch.int64, device=dev).expand(
        world, num_local, capacity).contiguous()
    j = torch.searchsorted(count, want)  # [W, L, C]: first row whose count reaches c + 1
    valid = j < t_max
    src = torch.arange(world, dtype=torch.int64, device=dev).view(world, 1, 1) * t_max \
        + j.clamp(max=max(t_max - 1, 0))
    src = torch.where(valid, src, torch.zeros((), dtype=torch.int64, device=dev))
    local = torch.arange(num_local, dtype=torch.int64, device=dev).view(1, num_local, 1)
    # [W, L, C] -> [L, W, C]: Megatron's expert-major order
    src_p = src.permute(1, 0, 2).reshape(-1)
    valid_p = valid.permute(1, 0, 2).reshape(-1)
    local_p = local.expand(world, num_local, capacity).permute(1, 0, 2).reshape(-1)
    slot_p = slot_of[src_p, local_p]
    scatter_p = torch.where(valid_p, src_p, torch.full_like(src_p, rows))
    return PaddedLayout(src_p, slot_p, valid_p, scatter_p)


def rows_where(valid_P: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` where valid, exact zeros elsewhere (stale window rows may hold anything)."""
    mask = valid_P.view(-1, *([1] * (rows.dim() - 1)))
    return torch.where(mask, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def scatter_rows(layout: PaddedLayout, rows_PD: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Padded rows ``[P, D]`` -> window rows ``[num_rows, D]``: each window row the sum, from
    +0.0 in local-expert order (index order on CPU), of its rows; pad rows go nowhere."""
    out = rows_PD.new_zeros((num_rows + 1, rows_PD.shape[1]))
    out.index_add_(0, layout.scatter_row_P, rows_PD)
    return out[:num_rows]
