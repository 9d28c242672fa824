"""Triton kernels of the routing layout on the device (no host sync): where each token goes,
rows per destination and per expert, the status word for bad ids and weights. Used by ``gda``'s
dispatch and by the ``proxy``'s device-input path."""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _token_ranks(topk_idx_ptr, t, tmask, num_topk, num_experts, num_local, W_PAD: tl.constexpr,
                 K_PAD: tl.constexpr):
    """[BT, K_PAD] ids of tokens t -> (ids, valid, is_in [BT, W_PAD] int64)."""
    k = tl.arange(0, K_PAD)
    m = tmask[:, None] & (k[None, :] < num_topk)
    ids = tl.load(topk_idx_ptr + t[:, None] * num_topk + k[None, :], mask=m, other=-1)
    valid = (ids >= 0) & (ids < num_experts)
    dest = tl.where(valid, ids // num_local, -1)
    r = tl.arange(0, W_PAD).to(tl.int64)
    hit = (dest[:, :, None] == r[None, None, :]).to(tl.int64)
    is_in = tl.max(hit, axis=1)
    return ids, m, valid, is_in


@triton.jit
def _count_and_check(num_per_expert_ptr, topk_w_ptr, ids, m, valid, t, num_topk, num_experts,
                     K_PAD: tl.constexpr, BAD_ID: tl.constexpr, BAD_WEIGHT: tl.constexpr):
    """Adds the tokens' valid (token, expert) pairs to the per-expert counts (integers: atomic
    order cannot change them) and returns their status bits (bad id, NaN/Inf weight)."""
    tl.atomic_add(num_per_expert_ptr + tl.where(valid, ids, 0), tl.full(ids.shape, 1, tl.int64),
                  mask=valid, sem="relaxed")
    w = tl.load(topk_w_ptr + t[:, None] * num_topk + tl.arange(0, K_PAD)[None, :], mask=m,
                other=0.0)
    bad_id = tl.max(((ids < -1) | (ids >= num_experts)).to(tl.int64))
    bad_w = tl.max(((w != w) | (tl.abs(w) == float("inf"))).to(tl.int64))
    return (bad_id * BAD_ID) | (bad_w * BAD_WEIGHT)


# -------------------------------------------------------------------------------------------
# 1. Layout (two launches over token blocks; deterministic prefix sums, no ordering atomics)
# -------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_tokens"])
def _layout_count_kernel(
    topk_idx_ptr: tl.pointer_type(tl.int64),       # [T, K] global expert ids, -1 = none
    topk_w_ptr: tl.pointer_type(tl.float32),       # [T, K] routing weights
    block_counts_ptr: tl.pointer_type(tl.int64),   # out [NB, W] tokens of block b sent to rank r
    num_per_expert_ptr: tl.pointer_type(tl.int64), # in/out [E] zeroed; (token, expert) pairs
    status_ptr: tl.pointer_type(tl.int64),         # in/out [1] zeroed; status word (base.STATUS_*)
    num_tokens, num_topk, num_experts, num_local,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BAD_ID: tl.constexpr, BAD_WEIGHT: tl.constexpr,  # STATUS_BAD_EXPERT_ID, STATUS_NON_FINITE_WEIGHT
):
    """Example: W=2, L=2, ids [[0, 3], [1, -1], [2, 2]] -> block counts [2, 2] (token 0 goes
    to ranks 0 and 1, token 1 to rank 0, token 2 to rank 1), expert counts [1, 1, 2, 1]."""
    b = tl.program_id(0).to(tl.int64)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tmask = t < num_tokens
    ids, m, valid, is_in = _token_ranks(topk_idx_ptr, t, tmask, num_topk, num_experts, num_local,
                                        W_PAD, K_PAD)
    r = tl.arange(0, W_PAD)
    tl.store(block_counts_ptr + b * W + r, tl.sum(is_in, axis=0), mask=r < W)
    st = _count_and_check(num_per_expert_ptr, topk_w_ptr, ids, m, valid, t, num_topk,
                          num_experts, K_PAD, BAD_ID, BAD_WEIGHT)
    if st != 0:
        tl.atomic_or(status_ptr, st, sem="relaxed")


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def _layout_slot_kernel(
    topk_idx_ptr: tl.pointer_type(tl.int64),       # [T, K]
    block_counts_ptr: tl.pointer_type(tl.int64),   # [NB, W] from _layout_count_kernel
    slot_ptr: tl.pointer_type(tl.int64),           # out [T, W] row of (t, r) in r's block, -1
    send_token_idx_ptr: tl.pointer_type(tl.int64), # out [S] token of each sent row, rank-major
    num_per_rank_ptr: tl.pointer_type(tl.int64),   # out [W] rows sent to each rank
    num_tokens, num_topk, num_experts, num_local, num_blocks,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    NB_PAD: tl.constexpr,
):
    """slot[t, r] = number of tokens t' < t sent to r (exclusive prefix sum over token order);
    send_token_idx[offset_r + slot[t, r]] = t with offset_r = rows sent to ranks < r."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, W_PAD)
    rmask = r < W
    nb = tl.arange(0, NB_PAD).to(tl.int64)
    cnt = tl.load(block_counts_ptr + nb[:, None] * W + r[None, :],
                  mask=(nb[:, None] < num_blocks) & rmask[None, :], other=0)   # [NB_PAD, W_PAD]
    total = tl.sum(cnt, axis=0)                                                 # [W_PAD]
    before = tl.sum(tl.where(nb[:, None] < b, cnt, 0), axis=0)                  # [W_PAD]
    rank_off = tl.cumsum(total, axis=0) - total
    if b == 0:
        tl.store(num_per_rank_ptr + r, total, mask=rmask)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tmask = t < num_tokens
    ids, m, valid, is_in = _token_ranks(topk_idx_ptr, t, tmask, num_topk, num_experts, num_local,
                                        W_PAD, K_PAD)
    incl = tl.cumsum(is_in, axis=0) + before[None, :]
    sent = is_in > 0
    slot = tl.where(sent, incl - 1, -1)
    tl.store(slot_ptr + t[:, None] * W + r[None, :], slot, mask=tmask[:, None] & rmask[None, :])
    pos = tl.where(sent, rank_off[None, :] + slot, 0)
    tl.store(send_token_idx_ptr + pos, tl.broadcast_to(t[:, None], pos.shape),
             mask=sent & tmask[:, None] & rmask[None, :])


@triton.jit
def _layout_small_kernel(
    topk_idx_ptr: tl.pointer_type(tl.int64),       # [T, K]
    topk_w_ptr: tl.pointer_type(tl.float32),       # [T, K]
    slot_ptr: tl.pointer_type(tl.int64),           # out [T, W]
    send_token_idx_ptr: tl.pointer_type(tl.int64), # out [S] rank-major
    num_per_rank_ptr: tl.pointer_type(tl.int64),   # out [W]
    num_per_expert_ptr: tl.pointer_type(tl.int64), # out [E] (zeroed here)
    status_ptr: tl.pointer_type(tl.int64),         # out [1]
    num_tokens, num_topk, num_experts, num_local,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr, BAD_ID: tl.constexpr, BAD_WEIGHT: tl.constexpr,
):
    """The whole layout of a small batch (T <= BLOCK_T, decode) in one program: the same
    outputs as the two block kernels (slots are the same prefix sums in token order), with no
    scratch memset and one launch instead of three."""
    t = tl.arange(0, BLOCK_T).to(tl.int64)
    tmask = t < num_tokens
    ids, m, valid, is_in = _token_ranks(topk_idx_ptr, t, tmask, num_topk, num_experts, num_local,
                                        W_PAD, K_PAD)
    r = tl.arange(0, W_PAD)
    rmask = r < W
    total = tl.sum(is_in, axis=0)                                               # [W_PAD]
    rank_off = tl.cumsum(total, axis=0) - total
    tl.store(num_per_rank_ptr + r, total, mask=rmask)
    sent = is_in > 0
    slot = tl.where(sent, tl.cumsum(is_in, axis=0) - 1, -1)
    tl.store(slot_ptr + t[:, None] * W + r[None, :], slot, mask=tmask[:, None] & rmask[None, :])
    pos = tl.where(sent, rank_off[None, :] + slot, 0)
    tl.store(send_token_idx_ptr + pos, tl.broadcast_to(t[:, None], pos.shape),
             mask=sent & tmask[:, None] & rmask[None, :])
    e = tl.arange(0, E_PAD)
    tl.store(num_per_expert_ptr + e, tl.zeros([E_PAD], dtype=tl.int64), mask=e < num_experts)
    tl.debug_barrier()  # the zeros land before this program's own atomics below
    tl.store(status_ptr, _count_and_check(num_per_expert_ptr, topk_w_ptr, ids, m, valid, t,
                                          num_topk, num_experts, K_PAD, BAD_ID, BAD_WEIGHT))
