"""Triton kernels of a ``gda`` dispatch that stores its rows compact (``rows_in_window``): the
count exchange before the stores (window layout and flag protocol: :mod:`.device`).

Such a dispatch is two ops. Op e (kind ``dispatch counts``): every rank writes the rows it sends
to each rank into every rank's board (``[W, W]`` int64, row ``me``, parity ``e % 2``), and to
each rank r the header its stores will carry there (status, rows, rows per local expert of r:
row ``me`` of r's ``[W, 2 + L]`` announced headers), and signals ``e``. Then one program per
rank waits for every source's signal, sums the board's rows of the ranks before it (the first
row at which it stores into each destination) and hands the host the announced headers as the
header read of a regular dispatch would (the count read): the host learns its counts while the
rows are still being stored. Op e + 1 (kind ``dispatch``) is the regular store, at those rows
instead of ``me * T_MAX``: every rank receives its rows compact, in (source, token) order, and
the caller reads them in the window, with no copy; its header read checks that every source
stored what it announced, where its predecessors' counts put it. The board of parity ``e % 2``
is written again at op e + 2 at the earliest, which a peer reaches after this rank's op e + 1
signal, raised after its wait here (stream order); the wait copies what it read of it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .device import _op_epoch, _publish_info, _wait_for_sources


@triton.jit(do_not_specialize=["me", "num_local", "epoch_delta"])
def _publish_counts_kernel(
    num_per_rank_ptr: tl.pointer_type(tl.int64),    # [W] rows this rank sends to each rank
    num_per_expert_ptr: tl.pointer_type(tl.int64),  # [W * L] rows this rank sends per expert
    status_ptr: tl.pointer_type(tl.int64),          # [1] this rank's status word
    buf_ptrs: tl.pointer_type(tl.int64),            # [W] window base address of every rank
    sig_ptrs: tl.pointer_type(tl.int64),            # [W] signal pad address of every rank
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    board_off, me, num_local, epoch_delta,
    W: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr,
):
    """One program: ``board[me, :]`` of every rank's window = this rank's counts, row ``me`` of
    rank r's announced headers = (status, rows to r, rows per expert of r), then
    ``signal[me] = epoch`` at every rank (release, system scope: covers the board stores)."""
    rr = tl.arange(0, W_PAD)
    live = rr < W
    counts = tl.load(num_per_rank_ptr + rr, mask=live, other=0)
    st = tl.load(status_ptr)
    hl = tl.arange(0, L_PAD)
    me64 = tl.cast(me, tl.int64)
    for r in tl.static_range(W):
        board = (tl.load(buf_ptrs + r) + board_off).to(tl.pointer_type(tl.int64))
        tl.store(board + me64 * W + rr, counts, mask=live)
        said = board + (W + 1) * W + me64 * (2 + num_local)
        tl.store(said, st)
        tl.store(said + 1, tl.load(num_per_rank_ptr + r))
        tl.store(said + 2 + hl, tl.load(num_per_expert_ptr + r * num_local + hl,
                                        mask=hl < num_local), mask=hl < num_local)
    tl.debug_barrier()
    epoch, _ = _op_epoch(op_base_ptr, epoch_delta, 0)
    for r in tl.static_range(W):
        sig = tl.load(sig_ptrs + r).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(sig + me, epoch, sem="release", scope="sys")


@triton.jit(do_not_specialize=["me", "T_MAX", "num_local", "counts_epoch_delta", "kind",
                               "timeout_ns", "max_spins"])
def _count_wait_kernel(
    my_sig_ptr: tl.pointer_type(tl.int32),          # [W] this rank's signal pad
    err_ptr: tl.pointer_type(tl.int64),             # [4] error word (see _wait_for_sources)
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    board_ptr: tl.pointer_type(tl.int64),           # [W, W] + [W] + [W, 2 + L] this rank's board
    dst_off_ptr: tl.pointer_type(tl.int64),         # out [W] first row at each destination
    num_per_rank_ptr: tl.pointer_type(tl.int64),    # [W] rows this rank sends (the layout's)
    info_ptr: tl.pointer_type(tl.int64),            # out [n_info] device copy of the counts
    offsets_ptr: tl.pointer_type(tl.int64),         # out [W + 2] (see _publish_info)
    host_ptr: tl.pointer_type(tl.int64),            # out [n_info + 1] page-locked (HOST_FLAG)
    me, T_MAX, num_local, counts_epoch_delta, kind, timeout_ns, max_spins,
    W: tl.constexpr, W_PAD: tl.constexpr, HDR_PAD: tl.constexpr, USE_GLOBALTIMER: tl.constexpr,
    HOST_FLAG: tl.constexpr, ROWS_KIND: tl.constexpr,
):
    """One program: waits for every source's counts, then ``dst_off[d]`` = the rows ranks
    0 .. me - 1 send to rank d, and the announced headers go to ``info`` and ``offsets``
    (:func:`~.device._publish_info`, as a regular dispatch's header read writes them), with
    ``HOST_FLAG`` also to ``host`` and, last, the rows op's record (``(epoch + 1) * 8 +
    ROWS_KIND``) after them (release, system scope): the host's count read. Peers' counts are
    untrusted: each is clamped to [0, T_MAX] in the sums, so ``dst_off[d] + this rank's rows <=
    (me + 1) * T_MAX`` stays inside d's window whatever they wrote (a destination whose rows
    then overlap sees the misplacement in its header read), and the host checks the announced
    values. After an expired wait the error word is set and the sums use what arrived. (The
    epoch argument has a name of its own: a native program binds it and the store's op number,
    one op later, as two variables.)"""
    epoch, record = _op_epoch(op_base_ptr, counts_epoch_delta, kind)
    _wait_for_sources(my_sig_ptr, epoch, record, err_ptr, timeout_ns, max_spins, W, W_PAD,
                      USE_GLOBALTIMER)
    s = tl.arange(0, W_PAD)
    d = tl.arange(0, W_PAD)
    before = s < me
    m = before[:, None] & (d[None, :] < W)
    counts = tl.load(board_ptr + s[:, None] * W + d[None, :], mask=m, other=0)
    counts = tl.minimum(tl.maximum(counts, 0), T_MAX)
    tl.store(dst_off_ptr + d, tl.sum(counts, axis=0), mask=d < W)
    hdr_len = 2 + num_local
    c = tl.arange(0, HDR_PAD)
    hm = (s[:, None] < W) & (c[None, :] < hdr_len)
    h = tl.load(board_ptr + (W + 1) * W + s[:, None] * hdr_len + c[None, :], mask=hm, other=0)
    n = tl.sum(tl.where(c[None, :] == 1, h, 0), axis=1)
    _publish_info(h, n, err_ptr, num_per_rank_ptr, info_ptr, offsets_ptr, num_local, T_MAX,
                  W, W_PAD, HDR_PAD)
    if HOST_FLAG:
        _publish_info(h, n, err_ptr, num_per_rank_ptr, host_ptr, offsets_ptr, num_local, T_MAX,
                      W, W_PAD, HDR_PAD)
        tl.debug_barrier()
        tl.atomic_xchg(host_ptr + 1 + W * hdr_len + W + num_local, record + 8 - kind + ROWS_KIND,
                       sem="release", scope="sys")
