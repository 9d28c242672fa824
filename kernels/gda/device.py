"""Triton kernels of the ``gda`` transport: peer stores, waits, the receive header, reduce (the
routing layout: :mod:`.layout_kernels`; the receive gather: :mod:`.gather_kernels`).

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
    board [W, W], [W], [W, 2 + L]
                        int64: a compact dispatch's counts (row s: source s's rows per rank),
                        the first row each source stored here (rows then at offset + slot,
                        compact in (source, token) order), and the header each source
                        announced to this rank before its stores (:mod:`.compact_kernels`)

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

import triton
import triton.language as tl

from .layout_kernels import _count_and_check, _token_ranks


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


# -------------------------------------------------------------------------------------------
# 2-3. Dispatch: store rows (+ ids, weights, header) into every destination's window
# -------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["me", "num_tokens", "epoch_delta"])
def _dispatch_store_kernel(
    x_ptr,                                          # [T, D] rows (any dtype), row stride stride_x
    topk_idx_ptr: tl.pointer_type(tl.int64),        # [T, K]
    topk_w_ptr: tl.pointer_type(tl.float32),        # [T, K]
    slot_ptr: tl.pointer_type(tl.int64),            # [T, W] from the layout (LAYOUT: out)
    send_token_idx_ptr: tl.pointer_type(tl.int64),  # out [S] (LAYOUT only) as the layout's
    num_per_rank_ptr: tl.pointer_type(tl.int64),    # [W] (LAYOUT: out)
    num_per_expert_ptr: tl.pointer_type(tl.int64),  # [E] (LAYOUT: out)
    status_ptr: tl.pointer_type(tl.int64),          # [1] (LAYOUT: out)
    buf_ptrs: tl.pointer_type(tl.int64),            # [W] window base address of every rank
    sig_ptrs: tl.pointer_type(tl.int64),            # [W] signal pad address of every rank
    done_ptr: tl.pointer_type(tl.int32),            # [1] local grid-completion counter (0)
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    dst_off_ptr: tl.pointer_type(tl.int64),         # [W] COMPACT: first row at each rank
    data_off, idx_off, w_off, hdr_off, board_off,   # byte offsets of the regions (this parity)
    me, num_tokens, stride_x, D, num_topk, T_MAX, num_local, num_experts, epoch_delta,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, L_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr, WITH_META: tl.constexpr, ALIGNED: tl.constexpr,
    LAYOUT: tl.constexpr, T_PAD: tl.constexpr, E_PAD: tl.constexpr, BAD_ID: tl.constexpr,
    BAD_WEIGHT: tl.constexpr, COMPACT: tl.constexpr,
):
    """Token t of rank ``me`` goes to every rank r with slot[t, r] >= 0, at window row
    me * T_MAX + slot[t, r]: the row is loaded once per chunk and stored W times at most.
    Example: W=2, me=1, T_MAX=4, slot=[[0, -1], [1, 0]] -> rank 0 rows 4, 5 = x[0], x[1];
    rank 1 row 4 = x[1]; then each rank's signal[1] = epoch.

    ``LAYOUT`` (a small batch: T <= T_PAD, decode): the routing layout is computed here first,
    as :func:`~efa_ep.kernels.gda.layout_kernels._layout_small_kernel` computes it (the same
    prefix sums), by every program for all T tokens (a few thousand elements), so that no
    separate layout launch precedes the stores: each program writes the slot rows of the tokens
    it stores, program 0 the rest of the layout (send order, counts, status).

    ``COMPACT`` (``rows_in_window``): rank r's rows go to r's window rows dst_off[r] + slot
    (dst_off from :func:`~efa_ep.kernels.gda.compact_kernels._count_wait_kernel`: the rows the
    ranks before ``me`` send to r), so r receives its rows compact in (source, token) order;
    program 0 also writes dst_off[r] into r's board, where r checks it."""
    elt = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_D)
    me64 = tl.cast(me, tl.int64)
    if LAYOUT:
        tt = tl.arange(0, T_PAD).to(tl.int64)
        tmask = tt < num_tokens
        # (names of their own: the token loop below reassigns ids of another shape)
        l_ids, l_m, l_valid, is_in = _token_ranks(topk_idx_ptr, tt, tmask, num_topk,
                                                  num_experts, num_local, W_PAD, K_PAD)
        rr = tl.arange(0, W_PAD)
        rmask = rr < W
        sent = is_in > 0
        slot_all = tl.where(sent, tl.cumsum(is_in, axis=0) - 1, -1)
        mine = tmask & ((tt % nprog) == pid)  # the tokens this program stores below
        tl.store(slot_ptr + tt[:, None] * W + rr[None, :], slot_all,
                 mask=mine[:, None] & rmask[None, :])
        if pid == 0:
            total = tl.sum(is_in, axis=0)
            rank_off = tl.cumsum(total, axis=0) - total
            tl.store(num_per_rank_ptr + rr, total, mask=rmask)
            pos = tl.where(sent, rank_off[None, :] + slot_all, 0)
            tl.store(send_token_idx_ptr + pos, tl.broadcast_to(tt[:, None], pos.shape),
                     mask=sent & tmask[:, None] & rmask[None, :])
            e = tl.arange(0, E_PAD)
            tl.store(num_per_expert_ptr + e, tl.zeros([E_PAD], dtype=tl.int64),
                     mask=e < num_experts)
            tl.debug_barrier()  # the zeros land before this program's own atomics below
            tl.store(status_ptr, _count_and_check(num_per_expert_ptr, topk_w_ptr, l_ids, l_m,
                                                  l_valid, tt, num_topk, num_experts, K_PAD,
                                                  BAD_ID, BAD_WEIGHT))
        tl.debug_barrier()  # this program's slot rows are written before it reads them
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
                    if COMPACT:
                        dst = base + (tl.load(dst_off_ptr + r) + slot) * D
                    else:
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
                    if COMPACT:
                        row = tl.load(dst_off_ptr + r) + slot
                    else:
                        row = me64 * T_MAX + slot
                    pi = (tl.load(buf_ptrs + r) + idx_off).to(tl.pointer_type(tl.int64))
                    pw = (tl.load(buf_ptrs + r) + w_off).to(tl.pointer_type(tl.float32))
                    tl.store(pi + row * num_topk + k, tl.where(own, ids - r * num_local, -1), mask=km)
                    tl.store(pw + row * num_topk + k, tl.where(own, wts, 0.0), mask=km)
    if WITH_META:
        # Header rows are written by program 0; the grid-done release below covers them.
        if pid == 0:
            # (".cg": from L2, where LAYOUT's count atomics of this program landed)
            tl.debug_barrier()
            st = tl.load(status_ptr, cache_modifier=".cg")
            hl = tl.arange(0, L_PAD)
            for r in tl.static_range(W):
                hdr = (tl.load(buf_ptrs + r) + hdr_off).to(tl.pointer_type(tl.int64))
                hdr += me64 * (2 + num_local)
                tl.store(hdr, st)
                tl.store(hdr + 1, tl.load(num_per_rank_ptr + r, cache_modifier=".cg"))
                cnt = tl.load(num_per_expert_ptr + r * num_local + hl, mask=hl < num_local,
                              cache_modifier=".cg")
                tl.store(hdr + 2 + hl, cnt, mask=hl < num_local)
                if COMPACT:
                    board = (tl.load(buf_ptrs + r) + board_off).to(tl.pointer_type(tl.int64))
                    tl.store(board + W * W + me64, tl.load(dst_off_ptr + r))
    epoch, _ = _op_epoch(op_base_ptr, epoch_delta, 0)
    _signal_when_grid_done(done_ptr, sig_ptrs, me, epoch, W)


@triton.jit
def _publish_info(h, n, err_ptr, num_per_rank_ptr, info_ptr, offsets_ptr, num_local, T_MAX,
                  W: tl.constexpr, W_PAD: tl.constexpr, HDR_PAD: tl.constexpr):
    """What the host reads of a dispatch's counts, from the headers ``h`` ``[W_PAD, HDR_PAD]``
    (rows past W and columns past 2 + L zero) and their row counts ``n`` ``[W_PAD]``: ``info``
    = [error word, headers, rows this rank sent per destination, rows per local expert summed
    over sources]; ``offsets`` = exclusive prefix sum of ``n``, then ``offsets[W + 1]`` = the
    rows received when the counts are clean (error word 0, every status 0, rows in [0, T_MAX],
    no negative per-expert count), else -1."""
    hdr_len = 2 + num_local
    s = tl.arange(0, W_PAD)
    c = tl.arange(0, HDR_PAD)
    hm = (s[:, None] < W) & (c[None, :] < hdr_len)
    status = tl.sum(tl.where(c[None, :] == 0, h, 0), axis=1)
    tl.store(info_ptr + 1 + s[:, None] * hdr_len + c[None, :], h, mask=hm)
    per_expert = tl.sum(h, axis=0)  # [HDR_PAD]: column 2 + l is local expert l's rows
    pe_cols = (c >= 2) & (c < hdr_len)
    tl.store(info_ptr + 1 + W * hdr_len + W + c - 2, per_expert, mask=pe_cols)
    tl.store(offsets_ptr + 1 + s, tl.cumsum(n, axis=0), mask=s < W)
    tl.store(offsets_ptr, 0)
    sent = tl.load(num_per_rank_ptr + s, mask=s < W)
    tl.store(info_ptr + 1 + W * hdr_len + s, sent, mask=s < W)
    tl.debug_barrier()
    err = tl.atomic_add(err_ptr, 0, sem="relaxed")
    tl.store(info_ptr, err)
    bad = tl.sum(((status != 0) | (n < 0) | (n > T_MAX)).to(tl.int32), axis=0) + \
        tl.sum((pe_cols & (per_expert < 0)).to(tl.int32), axis=0)
    tl.store(offsets_ptr + W + 1, tl.where((err == 0) & (bad == 0), tl.sum(n, axis=0), -1))


@triton.jit(do_not_specialize=["epoch_delta", "kind", "timeout_ns", "max_spins"])
def _recv_header_kernel(
    my_sig_ptr: tl.pointer_type(tl.int32),          # [W] this rank's signal pad
    hdr_ptr: tl.pointer_type(tl.int64),             # [W, 2 + L] this rank's header region
    err_ptr: tl.pointer_type(tl.int64),             # [4] sticky error word (see _wait_for_sources)
    num_per_rank_ptr: tl.pointer_type(tl.int64),    # [W] rows this rank sent (from the layout)
    info_ptr: tl.pointer_type(tl.int64),            # out [1 + W * (2 + L) + W + L (+ 1)] for the host
                                                    # (COMPACT: in, the announced counts)
    offsets_ptr: tl.pointer_type(tl.int64),         # out [W + 2] first received row per source,
                                                    # then the clean row count (see below)
    hw_ptr: tl.pointer_type(tl.int64),              # in/out [W] rows of this parity's idx written
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    board_ptr: tl.pointer_type(tl.int64),           # [W * W + W] this rank's board (COMPACT)
    num_local, T_MAX, epoch_delta, kind, timeout_ns, max_spins,
    W: tl.constexpr, W_PAD: tl.constexpr, HDR_PAD: tl.constexpr, USE_GLOBALTIMER: tl.constexpr,
    HOST_FLAG: tl.constexpr, COMPACT: tl.constexpr, MISPLACED: tl.constexpr,
):
    """One program: wait for every source, then copy the headers (and the error word, this
    rank's send counts and the rows received per local expert, summed over sources) into
    ``info`` and the offsets (:func:`_publish_info`). Everything comes from one read of the
    headers, so ``info``, the offsets and the clean row count agree whatever a peer writes
    meanwhile. ``hw`` keeps the highest row count of this parity's id region per source, so a
    fixed-capacity dispatch knows which stale rows to clear.

    ``info`` is device memory the host copies, or (``HOST_FLAG``) page-locked host memory the
    kernel writes over the bus: then the word after ``info`` receives the op's record last
    (release, system scope), and a host that sees it there may read ``info`` (no copy, no
    stream sync).

    ``COMPACT`` (the sources stored their rows compact, see the store kernel): the host read the
    counts the sources announced before their stores (``info``, written by the count wait of
    :mod:`.compact_kernels`); here the rows have arrived and only their check is left. A source
    whose header differs from what it announced, or whose rows are not at the offset its
    predecessors' announced counts give (the first row it wrote into the board), sets its bit in
    ``err[3]`` and ``MISPLACED`` in ``err[0]``: the transport's next count read or error check
    raises naming it. Nothing is written for the host; the id region's high-water marks cover
    rows [0, N)."""
    epoch, record = _op_epoch(op_base_ptr, epoch_delta, kind)
    _wait_for_sources(my_sig_ptr, epoch, record, err_ptr, timeout_ns, max_spins, W, W_PAD,
                      USE_GLOBALTIMER)
    hdr_len = 2 + num_local
    s = tl.arange(0, W_PAD)
    c = tl.arange(0, HDR_PAD)
    hm = (s[:, None] < W) & (c[None, :] < hdr_len)
    h = tl.load(hdr_ptr + s[:, None] * hdr_len + c[None, :], mask=hm, other=0)
    n = tl.sum(tl.where(c[None, :] == 1, h, 0), axis=1)
    hw = tl.load(hw_ptr + s, mask=s < W, other=0)
    if COMPACT:
        said = tl.load(info_ptr + 1 + s[:, None] * hdr_len + c[None, :], mask=hm, other=0)
        n_said = tl.sum(tl.where(c[None, :] == 1, said, 0), axis=1)
        n_said = tl.minimum(tl.maximum(n_said, 0), T_MAX)  # as the count wait summed them
        placed = tl.load(board_ptr + W * W + s, mask=s < W, other=0)
        other = tl.sum((h != said).to(tl.int32), axis=1) > 0
        wrong = (s < W) & (other | ((n > 0) & (placed != tl.cumsum(n_said, axis=0) - n_said)))
        sources = tl.sum(tl.where(wrong, tl.full([W_PAD], 1, tl.int64) << s.to(tl.int64), 0),
                         axis=0)
        if sources != 0:
            tl.atomic_or(err_ptr + 3, sources, sem="relaxed")
            tl.atomic_or(err_ptr, tl.full([], MISPLACED, tl.int64), sem="relaxed")
        # rows [0, N) of the id region, in the slots of sources 0, 1, ...
        total = tl.sum(n_said, axis=0)
        written = tl.minimum(tl.maximum(total - s.to(tl.int64) * T_MAX, 0), T_MAX)
        tl.store(hw_ptr + s, tl.maximum(hw, written), mask=s < W)
    else:
        _publish_info(h, n, err_ptr, num_per_rank_ptr, info_ptr, offsets_ptr, num_local, T_MAX,
                      W, W_PAD, HDR_PAD)
        written = tl.minimum(tl.maximum(n, 0), T_MAX)
        tl.store(hw_ptr + s, tl.maximum(hw, written), mask=s < W)
        if HOST_FLAG:
            tl.debug_barrier()
            tl.atomic_xchg(info_ptr + 1 + W * hdr_len + W + num_local, record, sem="release",
                           scope="sys")


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
def _wait_here(my_sig_ptr, err_ptr, op_base_ptr, epoch_delta, kind, timeout_ns, max_spins,
               W: tl.constexpr, W_PAD: tl.constexpr, USE_GLOBALTIMER: tl.constexpr):
    """The op's wait at the start of a reading kernel: every program waits for every source
    itself, as :func:`_wait_kernel` does (a program's own expiry sets the error word that its
    read then sees)."""
    epoch, record = _op_epoch(op_base_ptr, epoch_delta, kind)
    _wait_for_sources(my_sig_ptr, epoch, record, err_ptr, timeout_ns, max_spins, W, W_PAD,
                      USE_GLOBALTIMER)


# -------------------------------------------------------------------------------------------
# 4. Combine: return rows to their sources, reduce in ascending rank order in float32
# -------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["me", "num_rows", "epoch_delta"])
def _combine_store_kernel(
    y_ptr,                                          # [N, D] expert outputs, row stride stride_y
    ids_ptr: tl.pointer_type(tl.int64),             # [N, D] received ids (MASK), contiguous
    offsets_ptr: tl.pointer_type(tl.int64),         # [W + 1] of the matching dispatch
    buf_ptrs: tl.pointer_type(tl.int64), sig_ptrs: tl.pointer_type(tl.int64),
    done_ptr: tl.pointer_type(tl.int32),
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    data_off, me, num_rows, stride_y, D, T_MAX, epoch_delta,
    W: tl.constexpr, W_PAD: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    FIXED: tl.constexpr, MASK: tl.constexpr,
):
    """Row i (the j-th row received from source s) -> source s's window row me * T_MAX + j.
    FIXED: ``y`` is ``[W * T_MAX, D]`` in window layout and ``offsets_ptr`` holds the device
    counts ``num_recv [W]``: row s * T_MAX + j is returned for j < num_recv[s] only.
    MASK (a weight combine): element (i, d) is returned as 0 where ``ids[i, d] < 0`` (a slot of
    an expert on another rank), so each (token, slot) is non-zero in one destination only."""
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
                    v = tl.load(src + cols, mask=cm)
                    if MASK:
                        ids = tl.load(ids_ptr + (s * T_MAX + j) * D + cols, mask=cm, other=-1)
                        v = tl.where(ids >= 0, v, tl.zeros_like(v))
                    tl.store(dst + cols, v, mask=cm)
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
                v = tl.load(y_ptr + i64 * stride_y + cols, mask=cm)
                if MASK:
                    ids = tl.load(ids_ptr + i64 * D + cols, mask=cm, other=-1)
                    v = tl.where(ids >= 0, v, tl.zeros_like(v))
                tl.store(dst + cols, v, mask=cm)
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


@triton.jit(do_not_specialize=["num_tokens", "epoch_delta", "kind", "timeout_ns", "max_spins"])
def _combine_reduce_wait_kernel(
    win_ptr, slot_ptr, out_ptr, err_ptr,
    my_sig_ptr: tl.pointer_type(tl.int32),          # [W] this rank's signal pad
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    data_off, num_tokens, D, T_MAX, epoch_delta, kind, timeout_ns, max_spins,
    W: tl.constexpr, W_PAD: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
):
    """:func:`_combine_reduce_kernel` with the op's wait in it, as
    :func:`.gather_kernels._gather_rows_wait_kernel`."""
    _wait_here(my_sig_ptr, err_ptr, op_base_ptr, epoch_delta, kind, timeout_ns, max_spins, W,
               W_PAD, USE_GLOBALTIMER)
    _combine_reduce_kernel(win_ptr, slot_ptr, out_ptr, err_ptr, data_off, num_tokens, D, T_MAX,
                           W, W_PAD, BLOCK_D, ALIGNED)
