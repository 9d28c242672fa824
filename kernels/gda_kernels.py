"""Triton kernels of the ``gda`` transport: layout, peer stores, waits, receive gather, reduce.

Symbols (shape suffixes):
    W: EP ranks.   T: tokens on this rank.   K: top-k slots.   E: experts.   L = E // W.
    D: row width in elements (H for token rows, K for the weight-gradient combine).
    T_MAX: window capacity per source rank (``max_tokens_per_rank``).
    N: rows received.   NB: token blocks of the layout kernels.

Every kernel takes peers as a pointer table ``*_ptrs`` (int64 device addresses, one per rank):
on the GPU these are the symmetric-memory mappings of the peers' windows; in the CPU tests
(``TRITON_INTERPRET=1``) they are ``data_ptr()`` of local tensors standing in for peers.

Window of one rank (one parity of the double buffer; byte offsets are kernel arguments):

    data [W, T_MAX, D]  rows from source s at s * T_MAX + slot (dispatch: token rows; combine:
                        expert outputs returned by destination rank s)
    idx  [W, T_MAX, K]  int64 local expert ids of dispatched rows (-1: not this rank's expert)
    wts  [W, T_MAX, K]  float32 routing weights (0 where idx is -1)
    hdr  [W, 2 + L]     int64 per source: [status word (base.STATUS_*), rows sent here,
                        rows per local expert...]

Flag protocol (the only cross-rank synchronisation; its constraints: ``gda.py``'s docstring):

1. Every collective call ("op") has an epoch ``e`` (1, 2, 3, ... identical on all ranks, int32)
   and uses window parity ``e % 2``. Kernels compute ``e = op_base[0] + epoch`` from a
   device-resident base, so a captured CUDA graph replays with new op numbers (the graph's
   last node advances the base by its op count, an even number, so parities repeat).
2. A sender stores all its rows (and header) into the peer's window with plain (weak) stores,
   16 bytes per thread. Each program of the grid then does ``__syncthreads`` and an
   ``atom.acq_rel.sys`` increment of a local completion counter; the program that increments
   last has observed (acquire) every other program's release, so after its own
   ``__syncthreads`` it publishes ``epoch`` into ``signal[me]`` of every peer with
   ``atom.exch.release.sys`` (release is cumulative: it covers every program's stores).
   It also resets the counter for the next launch (stream order).
3. A receiver polls its own signal pad with ``atom.add(0).acquire.sys`` until
   ``signal[s] >= e`` for every source ``s``; the acquire pairs with the sender's release, so
   the rows are visible. ``>=`` (not ``==``): a fast sender may already have published e + 1.
4. Every wait is bounded: ``%globaltimer`` against ``timeout_ns`` (and a spin bound). Waits run
   in one-program kernels (the dispatch header read, or :func:`wait_for_sources` before a
   combine reduce / cached gather), never inside a full-width grid. On expiry the kernel ORs the
   bit of every missing source into the error word ``err[0]`` and records ``epoch * 8 + kind``
   of the first expired op in ``err[1]``; every later gather/reduce of the window reads
   ``err[0]`` and writes NaN rows instead of partial sums; the host raises from the error word,
   naming the op, its kind and the missing ranks.
5. Reuse without resets: op e writes parity e % 2, last written by op e - 2. A sender reaches
   op e only after its wait in op e - 1 saw every peer's op e - 1 signal, which each peer
   raised after (stream order) it consumed op e - 2's rows. So no flag is ever reset, and a
   window is never overwritten while its owner still reads it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .base import STATUS_BAD_EXPERT_ID, STATUS_NON_FINITE_WEIGHT, ceil_div
from typing import Optional

from .launch import FastKernel
from .native_launch import KernelStep, MemsetStep

__all__ = [
    "layout", "dispatch_store", "recv_header", "recv_header_fixed", "wait_for_sources", "gather_rows", "combine_store",
    "combine_reduce", "next_pow2", "OP_KINDS", "wait_record", "check_err", "op_base_zero",
]


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# -------------------------------------------------------------------------------------------
# Device helpers
# -------------------------------------------------------------------------------------------
@triton.jit
def _now_ns(USE_GLOBALTIMER: tl.constexpr):
    if USE_GLOBALTIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def _wait_for_sources(sig_ptr, epoch, record, err_ptr, timeout_ns, max_spins, W: tl.constexpr,
                      W_PAD: tl.constexpr, USE_GLOBALTIMER: tl.constexpr):
    """Spins until ``sig_ptr[s] >= epoch`` for all s < W (acquire, system scope), or the
    deadline. On expiry ORs ``1 << s`` of each missing source into ``err_ptr[0]`` (int64) and,
    if no wait expired before, stores ``record`` (= epoch * 8 + op kind) into ``err_ptr[1]``:
    the host names the op whose wait expired, not the op it happens to be in when it reads."""
    offs = tl.arange(0, W_PAD)
    live = offs < W
    v = tl.atomic_add(sig_ptr + offs, 0, mask=live, sem="acquire", scope="sys")
    missing = live & (v < epoch)
    num_missing = tl.sum(missing.to(tl.int32), axis=0)
    start = _now_ns(USE_GLOBALTIMER)
    spins = 0
    expired = 0
    while (num_missing > 0) & (expired == 0):
        v = tl.atomic_add(sig_ptr + offs, 0, mask=live, sem="acquire", scope="sys")
        missing = live & (v < epoch)
        num_missing = tl.sum(missing.to(tl.int32), axis=0)
        spins += 1
        late = (_now_ns(USE_GLOBALTIMER) - start) > timeout_ns
        expired = (late | (spins >= max_spins)).to(tl.int32)
    if num_missing > 0:
        bits = tl.sum(tl.where(missing, tl.full([W_PAD], 1, tl.int64) << offs.to(tl.int64), 0),
                      axis=0)
        tl.atomic_cas(err_ptr + 1, tl.full([], 0, tl.int64), record.to(tl.int64), sem="relaxed")
        tl.atomic_or(err_ptr, bits, sem="release", scope="gpu")


@triton.jit
def _op_epoch(op_base_ptr, epoch_delta, kind):
    """(epoch, record) of this op: epoch = op_base[0] + epoch_delta (int32), record = epoch * 8
    + kind (int64). The base lives on the device so that a captured CUDA graph replays with
    new op numbers (the graph advances it); eager calls pass the whole offset as the delta."""
    epoch = tl.load(op_base_ptr) + epoch_delta
    return epoch, epoch.to(tl.int64) * 8 + kind


@triton.jit(do_not_specialize=["epoch_delta", "kind", "timeout_ns", "max_spins"])
def _wait_kernel(
    my_sig_ptr: tl.pointer_type(tl.int32),          # [W] this rank's signal pad
    err_ptr: tl.pointer_type(tl.int64),             # [3] error word: missing bits, first record
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    epoch_delta, kind, timeout_ns, max_spins,
    W: tl.constexpr, W_PAD: tl.constexpr, USE_GLOBALTIMER: tl.constexpr,
):
    """One program: the wait of a combine or cached dispatch, split from the kernel that reads
    the rows so that a spinning wait holds one program slot, never the SMs a peer's store (on
    the same GPU) needs, and the copy/reduce after it runs at full width without spinning."""
    epoch, record = _op_epoch(op_base_ptr, epoch_delta, kind)
    _wait_for_sources(my_sig_ptr, epoch, record, err_ptr, timeout_ns, max_spins, W, W_PAD,
                      USE_GLOBALTIMER)


@triton.jit
def _signal_when_grid_done(done_ptr, sig_ptrs, me, epoch, W: tl.constexpr):
    """Step 2 of the flag protocol; returns nothing. Call after this program's last store."""
    tl.debug_barrier()
    old = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys")
    if old == tl.num_programs(0) - 1:
        tl.store(done_ptr, 0)
        tl.debug_barrier()
        for r in tl.static_range(W):
            sig = tl.load(sig_ptrs + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(sig + me, epoch, sem="release", scope="sys")


@triton.jit
def _round_f32_to(acc, OUT: tl.constexpr):
    """float32 -> OUT. bf16 is rounded to nearest-even with integer ops (c10's rule, NaN ->
    0x7FC0), identical on the GPU and in the interpreter (whose plain cast truncates)."""
    if OUT == tl.bfloat16:
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(acc != acc, 0x7FC0, rounded)
        out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = acc.to(OUT)
    return out


@triton.jit
def _source_of_row(offsets_ptr, i, W: tl.constexpr, W_PAD: tl.constexpr):
    """Received row i -> (source rank s, row j inside s's block); offsets_ptr: [W + 1] int64."""
    ws = tl.arange(0, W_PAD)
    ends = tl.load(offsets_ptr + 1 + ws, mask=ws < W, other=0x7FFFFFFFFFFFFFFF)
    s = tl.sum((ends <= i).to(tl.int64), axis=0)
    j = i - tl.load(offsets_ptr + s)
    return s, j


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


# -------------------------------------------------------------------------------------------
# 2-3. Dispatch: store rows (+ ids, weights, header) into every destination's window
# -------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["me", "num_tokens", "epoch_delta"])
def _dispatch_store_kernel(
    x_ptr,                                          # [T, D] rows (any dtype), row stride stride_x
    topk_idx_ptr: tl.pointer_type(tl.int64),        # [T, K]
    topk_w_ptr: tl.pointer_type(tl.float32),        # [T, K]
    slot_ptr: tl.pointer_type(tl.int64),            # [T, W] from the layout
    num_per_rank_ptr: tl.pointer_type(tl.int64),    # [W]
    num_per_expert_ptr: tl.pointer_type(tl.int64),  # [E]
    status_ptr: tl.pointer_type(tl.int64),          # [1]
    buf_ptrs: tl.pointer_type(tl.int64),            # [W] window base address of every rank
    sig_ptrs: tl.pointer_type(tl.int64),            # [W] signal pad address of every rank
    done_ptr: tl.pointer_type(tl.int32),            # [1] local grid-completion counter (0)
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    data_off, idx_off, w_off, hdr_off,              # byte offsets of the regions (this parity)
    me, num_tokens, stride_x, D, num_topk, T_MAX, num_local, epoch_delta,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, L_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr, WITH_META: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Token t of rank ``me`` goes to every rank r with slot[t, r] >= 0, at window row
    me * T_MAX + slot[t, r]: the row is loaded once per chunk and stored W times at most.
    Example: W=2, me=1, T_MAX=4, slot=[[0, -1], [1, 0]] -> rank 0 rows 4, 5 = x[0], x[1];
    rank 1 row 4 = x[1]; then each rank's signal[1] = epoch."""
    elt = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    me64 = tl.cast(me, tl.int64)
    for t in range(pid, num_tokens, nprog):
        t64 = tl.cast(t, tl.int64)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs
            cm = cols < D
            v = tl.load(x_ptr + t64 * stride_x + cols, mask=cm)
            for r in tl.static_range(W):
                slot = tl.load(slot_ptr + t64 * W + r)
                if slot >= 0:
                    base = (tl.load(buf_ptrs + r) + data_off).to(tl.pointer_type(elt))
                    dst = base + (me64 * T_MAX + slot) * D
                    if ALIGNED:  # peer address from a table: tell the compiler (16-byte stores)
                        dst = tl.multiple_of(dst, 16)
                    tl.store(dst + cols, v, mask=cm)
        if WITH_META:
            k = tl.arange(0, K_PAD)
            km = k < num_topk
            ids = tl.load(topk_idx_ptr + t64 * num_topk + k, mask=km, other=-1)
            wts = tl.load(topk_w_ptr + t64 * num_topk + k, mask=km, other=0.0)
            for r in tl.static_range(W):
                slot = tl.load(slot_ptr + t64 * W + r)
                if slot >= 0:
                    own = (ids >= r * num_local) & (ids < (r + 1) * num_local)
                    row = me64 * T_MAX + slot
                    pi = (tl.load(buf_ptrs + r) + idx_off).to(tl.pointer_type(tl.int64))
                    pw = (tl.load(buf_ptrs + r) + w_off).to(tl.pointer_type(tl.float32))
                    tl.store(pi + row * num_topk + k, tl.where(own, ids - r * num_local, -1), mask=km)
                    tl.store(pw + row * num_topk + k, tl.where(own, wts, 0.0), mask=km)
    if WITH_META:
        # Header rows are written by program 0; the grid-done release below covers them.
        if pid == 0:
            st = tl.load(status_ptr)
            hl = tl.arange(0, L_PAD)
            for r in tl.static_range(W):
                hdr = (tl.load(buf_ptrs + r) + hdr_off).to(tl.pointer_type(tl.int64))
                hdr += me64 * (2 + num_local)
                tl.store(hdr, st)
                tl.store(hdr + 1, tl.load(num_per_rank_ptr + r))
                cnt = tl.load(num_per_expert_ptr + r * num_local + hl, mask=hl < num_local)
                tl.store(hdr + 2 + hl, cnt, mask=hl < num_local)
    epoch, _ = _op_epoch(op_base_ptr, epoch_delta, 0)
    _signal_when_grid_done(done_ptr, sig_ptrs, me, epoch, W)


@triton.jit(do_not_specialize=["epoch_delta", "kind", "timeout_ns", "max_spins"])
def _recv_header_kernel(
    my_sig_ptr: tl.pointer_type(tl.int32),          # [W] this rank's signal pad
    hdr_ptr: tl.pointer_type(tl.int64),             # [W, 2 + L] this rank's header region
    err_ptr: tl.pointer_type(tl.int64),             # [3] sticky error word (see _wait_for_sources)
    num_per_rank_ptr: tl.pointer_type(tl.int64),    # [W] rows this rank sent (from the layout)
    info_ptr: tl.pointer_type(tl.int64),            # out [1 + W * (2 + L) + W + L] for the host
    offsets_ptr: tl.pointer_type(tl.int64),         # out [W + 1] first received row per source
    hw_ptr: tl.pointer_type(tl.int64),              # in/out [W] rows of this parity's idx written
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    num_local, T_MAX, epoch_delta, kind, timeout_ns, max_spins,
    W: tl.constexpr, W_PAD: tl.constexpr, HDR_PAD: tl.constexpr, USE_GLOBALTIMER: tl.constexpr,
):
    """One program: wait for every source, then copy the headers (and the error word, this
    rank's send counts and the rows received per local expert, summed over sources) into
    ``info`` for one device-to-host copy; offsets = exclusive prefix sum of the rows each
    source sent here. ``hw`` keeps the highest row count of this parity's
    id region per source, so a fixed-capacity dispatch knows which stale rows to clear."""
    epoch, record = _op_epoch(op_base_ptr, epoch_delta, kind)
    _wait_for_sources(my_sig_ptr, epoch, record, err_ptr, timeout_ns, max_spins, W, W_PAD,
                      USE_GLOBALTIMER)
    hdr_len = 2 + num_local
    s = tl.arange(0, W_PAD)
    c = tl.arange(0, HDR_PAD)
    hm = (s[:, None] < W) & (c[None, :] < hdr_len)
    h = tl.load(hdr_ptr + s[:, None] * hdr_len + c[None, :], mask=hm, other=0)
    tl.store(info_ptr + 1 + s[:, None] * hdr_len + c[None, :], h, mask=hm)
    per_expert = tl.sum(h, axis=0)  # [HDR_PAD]: column 2 + l is local expert l's rows
    tl.store(info_ptr + 1 + W * hdr_len + W + c - 2, per_expert, mask=(c >= 2) & (c < hdr_len))
    n = tl.load(hdr_ptr + s * hdr_len + 1, mask=s < W, other=0)
    tl.store(offsets_ptr + 1 + s, tl.cumsum(n, axis=0), mask=s < W)
    tl.store(offsets_ptr, 0)
    hw = tl.load(hw_ptr + s, mask=s < W, other=0)
    tl.store(hw_ptr + s, tl.maximum(hw, tl.minimum(tl.maximum(n, 0), T_MAX)), mask=s < W)
    sent = tl.load(num_per_rank_ptr + s, mask=s < W)
    tl.store(info_ptr + 1 + W * hdr_len + s, sent, mask=s < W)
    tl.debug_barrier()
    tl.store(info_ptr, tl.atomic_add(err_ptr, 0, sem="relaxed"))


@triton.jit(do_not_specialize=["epoch_delta", "kind", "timeout_ns", "max_spins", "full"])
def _recv_header_fixed_kernel(
    my_sig_ptr: tl.pointer_type(tl.int32),          # [W] this rank's signal pad
    hdr_ptr: tl.pointer_type(tl.int64),             # [W, 2 + L] this rank's header region
    err_ptr: tl.pointer_type(tl.int64),             # [3] error word (see _wait_for_sources)
    hw_ptr: tl.pointer_type(tl.int64),              # in/out [W] rows of this parity's idx written
    num_recv_ptr: tl.pointer_type(tl.int64),        # out [W] rows received from each source
    tpe_ptr: tl.pointer_type(tl.int64),             # out [L] (token, local expert) pairs received
    idx_ptr: tl.pointer_type(tl.int64),             # [W, T_MAX, K] this parity's id region
    w_ptr: tl.pointer_type(tl.float32),             # [W, T_MAX, K] this parity's weight region
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    num_local, num_topk, T_MAX, epoch_delta, kind, timeout_ns, max_spins, full,
    W: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr, USE_GLOBALTIMER: tl.constexpr,
):
    """Fixed-capacity receive, one program, no host copy: waits for every source, then writes
    the counts to the device tensors ``num_recv`` and ``tokens_per_expert``, and marks every row
    of the window that this op did not fill as unused (ids -1, weights 0): rows j >= n_s of
    source s up to the region's high-water mark (``full``: up to T_MAX, after the top-k width
    changed). Counts from peers are clamped to [0, T_MAX]. A source that reported bad input
    (header status != 0) sets bit 62 of ``err[0]`` and its bit in ``err[2]``; then every row is
    marked unused, so no expert computes on it, and combines of this window return NaN."""
    epoch, record = _op_epoch(op_base_ptr, epoch_delta, kind)
    _wait_for_sources(my_sig_ptr, epoch, record, err_ptr, timeout_ns, max_spins, W, W_PAD,
                      USE_GLOBALTIMER)
    hdr_len = 2 + num_local
    s = tl.arange(0, W_PAD)
    sm = s < W
    st = tl.load(hdr_ptr + s * hdr_len, mask=sm, other=0)
    n = tl.load(hdr_ptr + s * hdr_len + 1, mask=sm, other=0)
    n = tl.minimum(tl.maximum(n, 0), T_MAX)
    bad = tl.sum(tl.where(sm & (st != 0), tl.full([W_PAD], 1, tl.int64) << s.to(tl.int64), 0),
                 axis=0)
    if bad != 0:
        tl.atomic_or(err_ptr + 2, bad, sem="relaxed")
        tl.atomic_or(err_ptr, tl.full([], 1 << 62, tl.int64), sem="relaxed")
        n = n * 0
    tl.store(num_recv_ptr + s, n, mask=sm)
    l = tl.arange(0, L_PAD)
    cnt = tl.load(hdr_ptr + s[:, None] * hdr_len + 2 + l[None, :],
                  mask=sm[:, None] & (l[None, :] < num_local), other=0)
    tpe = tl.sum(cnt, axis=0)
    if bad != 0:
        tpe = tpe * 0
    tl.store(tpe_ptr + l, tpe, mask=l < num_local)
    r = tl.arange(0, BLOCK_R).to(tl.int64)
    k = tl.arange(0, K_PAD)
    km = k < num_topk
    for src in tl.static_range(W):
        lo = tl.load(num_recv_ptr + src)
        hw = tl.load(hw_ptr + src)
        hi = tl.maximum(hw, lo)
        if full != 0:
            hi = tl.full([], 0, tl.int64) + T_MAX
        if bad != 0:
            hi = tl.full([], 0, tl.int64) + T_MAX
        for r0 in range(lo, hi, BLOCK_R):
            rows = r0 + r
            m = (rows < hi)[:, None] & km[None, :]
            off = (src * T_MAX + rows)[:, None] * num_topk + k[None, :]
            tl.store(idx_ptr + off, tl.full([BLOCK_R, K_PAD], -1, tl.int64), mask=m)
            tl.store(w_ptr + off, tl.zeros([BLOCK_R, K_PAD], dtype=tl.float32), mask=m)
        tl.store(hw_ptr + src, lo)


@triton.jit
def _poisoned(v, bad):
    """``v`` unchanged, or NaN everywhere when ``bad`` (a float ``v``; integer rows pass)."""
    if v.dtype.is_floating():
        v = tl.where(bad, tl.full(v.shape, float("nan"), v.dtype), v)
    return v


@triton.jit(do_not_specialize=["num_rows"])
def _gather_rows_kernel(
    win_ptr: tl.pointer_type(tl.int64),             # [1] this rank's window base address
    offsets_ptr: tl.pointer_type(tl.int64),         # [W + 1]
    out_x_ptr,                                      # out [N, D] received rows (compact)
    out_idx_ptr: tl.pointer_type(tl.int64),         # out [N, K] (WITH_META)
    out_w_ptr: tl.pointer_type(tl.float32),         # out [N, K] (WITH_META)
    err_ptr: tl.pointer_type(tl.int64),             # [3] error word (read: poison on expiry)
    data_off, idx_off, w_off,
    num_rows, D, num_topk, T_MAX,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    WITH_META: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Receive permutation: output row i (source s, j-th row from s) = window row
    s * T_MAX + j. Example: W=2, T_MAX=4, offsets [0, 1, 3] -> out rows 0, 1, 2 = window rows
    0, 4, 5. Runs after the op's wait (stream order); if any wait of this transport expired
    (error word set), float rows are written as NaN so no consumer mistakes them for data."""
    elt = out_x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    bad = tl.load(err_ptr) != 0
    win = tl.load(win_ptr)
    src_x = (win + data_off).to(tl.pointer_type(elt))
    for i in range(pid, num_rows, nprog):
        i64 = tl.cast(i, tl.int64)
        s, j = _source_of_row(offsets_ptr, i64, W, W_PAD)
        row = s * T_MAX + j
        src_row = src_x + row * D
        if ALIGNED:
            src_row = tl.multiple_of(src_row, 16)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs
            cm = cols < D
            v = _poisoned(tl.load(src_row + cols, mask=cm), bad)
            tl.store(out_x_ptr + i64 * D + cols, v, mask=cm)
        if WITH_META:
            k = tl.arange(0, K_PAD)
            km = k < num_topk
            pi = (win + idx_off).to(tl.pointer_type(tl.int64))
            pw = (win + w_off).to(tl.pointer_type(tl.float32))
            tl.store(out_idx_ptr + i64 * num_topk + k, tl.load(pi + row * num_topk + k, mask=km),
                     mask=km)
            tl.store(out_w_ptr + i64 * num_topk + k, tl.load(pw + row * num_topk + k, mask=km),
                     mask=km)


# -------------------------------------------------------------------------------------------
# 4. Combine: return rows to their sources, reduce in ascending rank order in float32
# -------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["me", "num_rows", "epoch_delta"])
def _combine_store_kernel(
    y_ptr,                                          # [N, D] expert outputs, row stride stride_y
    offsets_ptr: tl.pointer_type(tl.int64),         # [W + 1] of the matching dispatch
    buf_ptrs: tl.pointer_type(tl.int64), sig_ptrs: tl.pointer_type(tl.int64),
    done_ptr: tl.pointer_type(tl.int32),
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    data_off, me, num_rows, stride_y, D, T_MAX, epoch_delta,
    W: tl.constexpr, W_PAD: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    FIXED: tl.constexpr,
):
    """Row i (the j-th row received from source s) -> source s's window row me * T_MAX + j.
    FIXED: ``y`` is ``[W * T_MAX, D]`` in window layout and ``offsets_ptr`` holds the device
    counts ``num_recv [W]``: row s * T_MAX + j is returned for j < num_recv[s] only."""
    elt = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    me64 = tl.cast(me, tl.int64)
    if FIXED:
        for s in tl.static_range(W):
            n = tl.load(offsets_ptr + s)
            base = (tl.load(buf_ptrs + s) + data_off).to(tl.pointer_type(elt))
            for j in range(pid, n, nprog):
                dst = base + (me64 * T_MAX + j) * D
                src = y_ptr + (s * T_MAX + j) * stride_y
                if ALIGNED:
                    dst = tl.multiple_of(dst, 16)
                for d0 in range(0, D, BLOCK_D):
                    cols = d0 + offs
                    cm = cols < D
                    tl.store(dst + cols, tl.load(src + cols, mask=cm), mask=cm)
    else:
        for i in range(pid, num_rows, nprog):
            i64 = tl.cast(i, tl.int64)
            s, j = _source_of_row(offsets_ptr, i64, W, W_PAD)
            base = (tl.load(buf_ptrs + s) + data_off).to(tl.pointer_type(elt))
            dst = base + (me64 * T_MAX + j) * D
            if ALIGNED:
                dst = tl.multiple_of(dst, 16)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + offs
                cm = cols < D
                tl.store(dst + cols, tl.load(y_ptr + i64 * stride_y + cols, mask=cm), mask=cm)
    epoch, _ = _op_epoch(op_base_ptr, epoch_delta, 0)
    _signal_when_grid_done(done_ptr, sig_ptrs, me, epoch, W)


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_reduce_kernel(
    win_ptr: tl.pointer_type(tl.int64),             # [1] this rank's window base address
    slot_ptr: tl.pointer_type(tl.int64),            # [T, W] of the matching dispatch
    out_ptr,                                        # out [T, D] in the rows' dtype
    err_ptr: tl.pointer_type(tl.int64),             # [3] error word (read: poison on expiry)
    data_off, num_tokens, D, T_MAX,
    W: tl.constexpr, W_PAD: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
):
    """out[t] = (((+0.0 + part_r0) + part_r1) + ...) over ranks r ascending with slot[t, r] >= 0,
    in float32, rounded once to the output dtype: bit-equal to ``reduce_rows_by_rank``.
    A skipped rank adds nothing (adding +0.0 would also be exact: the sum is never -0.0).
    Runs after the op's wait (stream order); if any wait of this transport expired, every row
    is NaN: a sum missing a source's partials must never look valid."""
    elt = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    bad = tl.load(err_ptr) != 0
    win = tl.load(win_ptr)
    src = (win + data_off).to(tl.pointer_type(elt))
    for t in range(pid, num_tokens, nprog):
        t64 = tl.cast(t, tl.int64)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs
            cm = cols < D
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for r in tl.static_range(W):
                slot = tl.load(slot_ptr + t64 * W + r)
                if slot >= 0:
                    src_row = src + (r * T_MAX + slot) * D
                    if ALIGNED:
                        src_row = tl.multiple_of(src_row, 16)
                    part = tl.load(src_row + cols, mask=cm)
                    acc += part.to(tl.float32)
            acc = tl.where(bad, float("nan"), acc)
            tl.store(out_ptr + t64 * D + cols, _round_f32_to(acc, elt), mask=cm)


# -------------------------------------------------------------------------------------------
# Public wrappers (check dtypes, build grids, pass constexprs by keyword)
# -------------------------------------------------------------------------------------------
def _check(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int = None) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _block_d(d: int, elem: int) -> int:
    """Columns per chunk: up to 8 KiB of row per iteration (16 bytes per thread)."""
    return max(16, min(next_pow2(d), 8192 // elem))


def _warps(block_d: int, elem: int) -> int:
    return max(1, min(8, block_d * elem // 512))


def _aligned16(d: int, elem: int, row_stride: int, region_off: int) -> bool:
    """Window rows start 16-byte aligned (windows are 256-byte aligned allocations)."""
    return (d * elem) % 16 == 0 and (row_stride * elem) % 16 == 0 and region_off % 16 == 0


def _pad(n: int) -> int:
    """Power-of-two extent of a constexpr axis, at least 2."""
    return 2 if n <= 2 else 1 << (int(n) - 1).bit_length()


def _even(n: int) -> int:
    """``n`` int64 slots rounded up to 16 bytes (pieces of one allocation stay 16-byte aligned,
    so every call sees the same kernel specialization)."""
    return n + (n & 1)


# Every kernel is launched through a FastKernel: compiled once per specialization, then called
# through its native launcher (see :mod:`efa_ep.kernels.launch`). Wrappers pass every parameter
# positionally in signature order; ``fast=False`` takes Triton's own launch path.
_K_LAYOUT_SMALL = FastKernel(_layout_small_kernel)
_K_LAYOUT_COUNT = FastKernel(_layout_count_kernel)
_K_LAYOUT_SLOT = FastKernel(_layout_slot_kernel)
_K_STORE = FastKernel(_dispatch_store_kernel)
_K_RECV_HEADER = FastKernel(_recv_header_kernel)
_K_RECV_HEADER_FIXED = FastKernel(_recv_header_fixed_kernel)
_K_WAIT = FastKernel(_wait_kernel)
_K_GATHER = FastKernel(_gather_rows_kernel)
_K_COMBINE_STORE = FastKernel(_combine_store_kernel)
_K_REDUCE = FastKernel(_combine_reduce_kernel)
_ONE = (1,)


def _go(kernel: FastKernel, grid, args, num_warps: int, fast: bool, plan) -> None:
    """Launches ``kernel`` now, or with ``plan`` (a list) appends the launch to it instead."""
    if plan is None:
        kernel.launch(grid, args, num_warps, fast)
    else:
        plan.append(KernelStep(kernel, grid, args, num_warps))
_UNUSED_F32 = {}  # device -> [1] float32: a pointer argument the kernel variant never reads


def _unused_f32(device) -> torch.Tensor:
    t = _UNUSED_F32.get(device)
    if t is None:
        t = _UNUSED_F32[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return t


LAYOUT_BLOCK_T = 64
# One-program layout when the whole batch fits: T_PAD x K_PAD x W_PAD elements at most
# (decode sizes; larger batches use the two block kernels).
LAYOUT_SMALL_ELEMS = 1 << 14


def layout_words(t: int, num_experts: int, world: int, k: int) -> int:
    """int64 elements of the scratch :func:`layout` uses for ``t`` tokens of top-``k``."""
    return _layout_offsets(t, num_experts, world, k)[-1]


def _layout_offsets(t: int, num_experts: int, world: int, k: int):
    """(small, nb, o_exp, o_rank, o_slot, o_send, o_blk, total words) of layout's scratch."""
    small = _pad(t) * _pad(k) * _pad(world) <= LAYOUT_SMALL_ELEMS
    nb = max(1, ceil_div(t, LAYOUT_BLOCK_T))
    tw = t * world
    # [status, pad | per expert E | per rank W | slot T x W | send idx | block counts NB x W]
    o_exp = 2
    o_rank = o_exp + _even(num_experts)
    o_slot = o_rank + _even(world)
    o_send = o_slot + _even(tw)
    o_blk = o_send + _even(max(1, tw))
    return small, nb, o_exp, o_rank, o_slot, o_send, o_blk, \
        o_blk + (0 if small else _even(nb * world))


def layout(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, world: int,
           *, fast: bool = True, scratch: Optional[torch.Tensor] = None, plan=None):
    """Routing layout on the device (no host sync): one launch for a small batch (decode:
    T_PAD x K_PAD x W_PAD <= ``LAYOUT_SMALL_ELEMS``), else a memset and two block kernels.

    Args:
        topk_idx: ``[T, K]`` int64; global expert ids, -1 = unused slot; other values outside
            [-1, E) are flagged in ``status`` (``STATUS_BAD_EXPERT_ID`` of
            :mod:`efa_ep.kernels.base`) and routed nowhere.
        topk_weights: ``[T, K]`` float32; NaN/Inf flagged in ``status``
            (``STATUS_NON_FINITE_WEIGHT``).
        fast: launch through the compiled kernel's own launcher (see :class:`FastKernel`).
        scratch: int64 device buffer of at least :func:`layout_words` elements to use (None:
            allocated here).
        plan: a list: append the launches (:mod:`efa_ep.kernels.native_launch` steps) instead
            of making them (the same for every wrapper below).
    Returns:
        (slot_TW [T, W] int64 (-1 = not sent), send_token_idx [T*W] int64 (first S valid),
        num_per_rank_W [W] int64, num_per_expert_E [E] int64, status [1] int64), on the device:
        views of one int64 allocation made by this call.
    """
    _check("topk_idx", topk_idx, torch.int64, 2)
    _check("topk_weights", topk_weights, torch.float32, 2)
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights must be {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}")
    t, k = topk_idx.shape
    num_local = num_experts // world
    w_pad, k_pad, t_pad = _pad(world), _pad(k), _pad(t)
    tw = t * world
    small, nb, o_exp, o_rank, o_slot, o_send, o_blk, words = _layout_offsets(
        t, num_experts, world, k)
    if scratch is None:
        scratch = torch.empty(words, dtype=torch.int64, device=topk_idx.device)
    status = scratch[0:1]
    num_per_expert = scratch[o_exp:o_exp + num_experts]
    num_per_rank = scratch[o_rank:o_rank + world]
    slot = scratch[o_slot:o_slot + tw].view(t, world)
    send_token_idx = scratch[o_send:o_send + max(1, tw)]
    if small:  # the kernel zeroes the counts itself
        _go(_K_LAYOUT_SMALL, _ONE, (
            topk_idx, topk_weights, slot, send_token_idx, num_per_rank, num_per_expert, status,
            t, k, num_experts, num_local,
            world, w_pad, k_pad, t_pad, _pad(num_experts), STATUS_BAD_EXPERT_ID,
            STATUS_NON_FINITE_WEIGHT), 4, fast, plan)
        return slot, send_token_idx, num_per_rank, num_per_expert, status
    # status and per-expert counts: the count kernel adds atomically
    if plan is None:
        scratch[:o_rank].zero_()
    else:
        plan.append(MemsetStep(scratch, o_rank * 8))
    block_counts = scratch[o_blk:o_blk + nb * world].view(nb, world)
    _go(_K_LAYOUT_COUNT, (nb,), (
        topk_idx, topk_weights, block_counts, num_per_expert, status,
        t, k, num_experts, num_local,
        world, w_pad, k_pad, LAYOUT_BLOCK_T, STATUS_BAD_EXPERT_ID, STATUS_NON_FINITE_WEIGHT),
        4, fast, plan)
    _go(_K_LAYOUT_SLOT, (nb,), (
        topk_idx, block_counts, slot, send_token_idx, num_per_rank,
        t, k, num_experts, num_local, nb,
        world, w_pad, k_pad, LAYOUT_BLOCK_T, _pad(nb)), 4, fast, plan)
    return slot, send_token_idx, num_per_rank, num_per_expert, status


def op_base_zero(device) -> torch.Tensor:
    """A ``[1]`` int32 zero op-number base (``epoch`` is then the whole op number)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def _base(op_base, device) -> torch.Tensor:
    """The ``[1]`` int32 device op-number base; None: a zero (``epoch`` is the whole op number)."""
    if op_base is None:
        return op_base_zero(device)
    return op_base


# The transport's own tables (peer pointers, signal pad, error word, op base, completion
# counters) are made and checked once when it is created; the wrappers below check what
# changes per call: rows, routing tensors and outputs.

def dispatch_store(x, topk_idx, topk_weights, slot, num_per_rank, num_per_expert, status,
                   buf_ptrs, sig_ptrs, done, *, data_off, idx_off, w_off, hdr_off, me, t_max,
                   num_local, epoch, with_meta, num_programs, op_base=None, fast=True,
                   plan=None):
    """Stores rows (and, ``with_meta``, ids, weights and headers) into every destination's
    window, then raises ``signal[me] = op_base[0] + epoch`` at every rank. ``x``: ``[T, D]``
    (row stride ``x.stride(0)``, unit column stride); ``slot``: ``[T, W]`` int64; tables:
    ``[W]`` int64; ``done``: ``[1]`` int32; ``op_base``: ``[1]`` int32 device op-number base
    (None: 0; the same rule for every ``epoch`` argument of this module). Without
    ``with_meta`` the id, weight and count arguments are not read (None is fine)."""
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [T, D] with unit column stride, got {tuple(x.shape)}")
    if slot.dtype != torch.int64 or slot.dim() != 2:
        raise ValueError(f"slot must be [T, W] int64, got {tuple(slot.shape)} {slot.dtype}")
    world = buf_ptrs.numel()
    t, d = x.shape
    if with_meta:
        if topk_idx.dtype != torch.int64 or topk_weights.dtype != torch.float32:
            raise ValueError(f"topk_idx / topk_weights must be int64 / float32, got "
                             f"{topk_idx.dtype} / {topk_weights.dtype}")
        k = topk_idx.shape[1]
    else:  # unused int64 / float32 pointers: the kernel never reads them
        k = 1
        topk_idx = num_per_expert = num_per_rank = status = slot
        topk_weights = _unused_f32(x.device)
    elem = x.element_size()
    bd = _block_d(d, elem)
    stride = max(1, x.stride(0))
    _go(_K_STORE, (max(1, min(t, num_programs)),), (
        x, topk_idx, topk_weights, slot, num_per_rank, num_per_expert, status, buf_ptrs, sig_ptrs,
        done, _base(op_base, x.device), data_off, idx_off, w_off, hdr_off, me, t, stride, d, k,
        t_max, num_local, epoch,
        world, _pad(world), _pad(k), _pad(num_local), bd, bool(with_meta),
        _aligned16(d, elem, stride, data_off)), _warps(bd, elem), fast, plan)


# Op kinds recorded with the epoch of an expired wait (error word slot 1 = epoch * 8 + kind).
OP_KINDS = {1: "dispatch", 2: "combine", 3: "cached dispatch", 4: "weight combine"}
KIND_OF = {v: k for k, v in OP_KINDS.items()}


def wait_record(epoch: int, kind: str) -> int:
    return epoch * 8 + KIND_OF[kind]


def check_err(err: torch.Tensor) -> None:
    """The error word: ``[3]`` int64 (missing-source bits, first expired op, sources with bad
    input). Checked once by whoever makes it."""
    _check("err", err, torch.int64, 1)
    if err.numel() < 3:
        raise ValueError(f"err must hold 3 int64 (missing-source bits, first expired op, sources "
                         f"with bad input), got {err.numel()}")


def recv_header(my_sig, hdr, err, num_per_rank, hw, *, num_local, t_max, epoch, timeout_ns,
                max_spins, use_globaltimer, kind="dispatch", op_base=None, fast=True, out=None,
                plan=None):
    """Waits for every source and returns (info [1 + W*(2+L) + W + L] int64, offsets [W+1]
    int64) on the device. info = [error bits, headers (status, rows, rows per local expert) per
    source, rows this rank sent per destination, rows received per local expert]. ``my_sig``: ``[W]`` int32; ``hdr``:
    ``[W, 2 + L]`` int64; ``err``: ``[3]`` int64 error word (:func:`check_err`); ``hw``:
    ``[W]`` int64 id-region high-water mark of this parity (updated). ``out``: an int64
    buffer of at least ``info + offsets`` elements to write into (None: allocated here)."""
    world = my_sig.numel()
    n_info = 1 + world * (2 + num_local) + world + num_local
    o_off = _even(n_info)
    if out is None:
        out = torch.empty(o_off + world + 1, dtype=torch.int64, device=hdr.device)
    info = out[:n_info]
    offsets = out[o_off:o_off + world + 1]
    _go(_K_RECV_HEADER, _ONE, (
        my_sig, hdr, err, num_per_rank, info, offsets, hw, _base(op_base, hdr.device),
        num_local, t_max, epoch, KIND_OF[kind], timeout_ns, max_spins,
        world, _pad(world), _pad(2 + num_local), bool(use_globaltimer)), 4, fast, plan)
    return info, offsets


def recv_header_fixed(my_sig, hdr, err, hw, num_recv, tokens_per_expert, idx_region, w_region,
                      *, num_topk, t_max, epoch, full, timeout_ns, max_spins, use_globaltimer,
                      kind="dispatch", op_base=None, fast=True, plan=None):
    """Fixed-capacity receive (one program, no host copy, see :func:`_recv_header_fixed_kernel`):
    fills ``num_recv`` ``[W]`` and ``tokens_per_expert`` ``[L]`` (int64, device) and marks the
    window rows this op did not fill as unused in ``idx_region`` / ``w_region`` (flat int64 /
    float32 views of this parity's id and weight regions, ``W * T_MAX * K`` used)."""
    world = my_sig.numel()
    num_local = tokens_per_expert.numel()
    _go(_K_RECV_HEADER_FIXED, _ONE, (
        my_sig, hdr, err, hw, num_recv, tokens_per_expert, idx_region, w_region,
        _base(op_base, hdr.device), num_local, num_topk, t_max, epoch, KIND_OF[kind],
        timeout_ns, max_spins, int(full),
        world, _pad(world), _pad(num_local), _pad(num_topk), 64, bool(use_globaltimer)), 4, fast, plan)


def wait_for_sources(my_sig, err, *, epoch, kind, timeout_ns, max_spins, use_globaltimer,
                     op_base=None, fast=True, plan=None):
    """One-program kernel: waits until every source signalled ``epoch`` (or the deadline, which
    sets the error word ``err`` ``[3]`` int64). Stream-ordered before the op's copy/reduce."""
    world = my_sig.numel()
    _go(_K_WAIT, _ONE, (
        my_sig, err, _base(op_base, err.device), epoch, KIND_OF[kind], timeout_ns, max_spins,
        world, _pad(world), bool(use_globaltimer)), 1, fast, plan)


def gather_rows(win_ptr, offsets, out_x, out_idx, out_w, my_sig, err, *, data_off, idx_off,
                w_off, t_max, epoch, wait, timeout_ns, max_spins, use_globaltimer, num_programs,
                kind="cached dispatch", op_base=None, fast=True, plan=None):
    """Copies the received rows out of this rank's window into ``out_x`` ``[N, D]`` (and, when
    ``out_idx`` is given, ids and weights into ``[N, K]``), in (source, row) order. With
    ``wait``, a one-program wait kernel runs first (:func:`wait_for_sources`). Float rows are
    NaN if any wait of this window expired. ``offsets``: ``[W + 1]`` int64."""
    if not out_x.is_contiguous() or out_x.dim() != 2:
        raise ValueError(f"out_x must be a contiguous [N, D] tensor, got {tuple(out_x.shape)}")
    if wait:
        wait_for_sources(my_sig, err, epoch=epoch, kind=kind, timeout_ns=timeout_ns,
                         max_spins=max_spins, use_globaltimer=use_globaltimer, op_base=op_base,
                         fast=fast, plan=plan)
    world = offsets.numel() - 1
    n, d = out_x.shape
    if n == 0:
        return
    with_meta = out_idx is not None
    if with_meta:
        if out_idx.dtype != torch.int64 or out_w.dtype != torch.float32:
            raise ValueError(f"out_idx / out_w must be int64 / float32, got {out_idx.dtype} / "
                             f"{out_w.dtype}")
        k = out_idx.shape[1]
    else:
        out_idx, out_w, k = offsets, _unused_f32(out_x.device), 1
    elem = out_x.element_size()
    bd = _block_d(d, elem)
    _go(_K_GATHER, (max(1, min(n, num_programs)),), (
        win_ptr, offsets, out_x, out_idx, out_w, err, data_off, idx_off, w_off,
        n, d, k, t_max,
        world, _pad(world), _pad(k), bd, with_meta, _aligned16(d, elem, d, data_off)),
        _warps(bd, elem), fast, plan)


def combine_store(y, offsets, buf_ptrs, sig_ptrs, done, *, data_off, me, t_max, epoch,
                  num_programs, fixed=False, op_base=None, fast=True, plan=None):
    """Returns row i of ``y`` ``[N, D]`` to its source's window, then signals every rank.
    ``fixed``: ``y`` is ``[W * T_MAX, D]`` in window layout and ``offsets`` is the device count
    ``num_recv [W]``; only rows j < num_recv[s] of each source block are returned."""
    if y.dim() != 2 or (y.shape[1] > 1 and y.stride(1) != 1):
        raise ValueError(f"y must be [N, D] with unit column stride, got {tuple(y.shape)}")
    world = buf_ptrs.numel()
    n, d = y.shape
    elem = y.element_size()
    bd = _block_d(d, elem)
    stride = max(1, y.stride(0))
    _go(_K_COMBINE_STORE, (max(1, min(n if not fixed else t_max, num_programs)),), (
        y, offsets, buf_ptrs, sig_ptrs, done, _base(op_base, y.device), data_off, me, n,
        stride, d, t_max, epoch,
        world, _pad(world), bd, _aligned16(d, elem, stride, data_off), bool(fixed)),
        _warps(bd, elem), fast, plan)


def combine_reduce(win_ptr, slot, out, my_sig, err, *, data_off, t_max, epoch, wait, timeout_ns,
                   max_spins, use_globaltimer, num_programs, kind="combine", op_base=None,
                   fast=True, plan=None):
    """``out`` ``[T, D]`` = float32 sum of this rank's returned partials in ascending rank order
    (see :func:`_combine_reduce_kernel`), written in ``out``'s dtype. ``slot``: ``[T, W]``
    int64 of the matching dispatch. With ``wait``, a one-program wait kernel runs first; rows
    are NaN if any wait of this window expired."""
    if slot.dtype != torch.int64 or slot.dim() != 2:
        raise ValueError(f"slot must be [T, W] int64, got {tuple(slot.shape)} {slot.dtype}")
    if not out.is_contiguous() or out.dim() != 2:
        raise ValueError(f"out must be a contiguous [T, D] tensor, got {tuple(out.shape)}")
    if wait:
        wait_for_sources(my_sig, err, epoch=epoch, kind=kind, timeout_ns=timeout_ns,
                         max_spins=max_spins, use_globaltimer=use_globaltimer, op_base=op_base,
                         fast=fast, plan=plan)
    t, d = out.shape
    if t == 0:
        return
    world = slot.shape[1]
    elem = out.element_size()
    bd = _block_d(d, elem)
    _go(_K_REDUCE, (max(1, min(t, num_programs)),), (
        win_ptr, slot, out, err, data_off, t, d, t_max,
        world, _pad(world), bd, _aligned16(d, elem, d, data_off)), _warps(bd, elem), fast, plan)
