"""Triton kernels of a ``gda`` dispatch that stores its rows compact (``rows_in_window``): the
count exchange before the stores (window layout and flag protocol: :mod:`.device`).

Such a dispatch is two ops. Op e (kind ``dispatch counts``): every rank writes the rows it sends
to each rank into every rank's board (``[W, W]`` int64, row ``me``, parity ``e % 2``) and
signals ``e``. Then one program per rank waits for every source's signal and sums the board's
rows of the ranks before it: the first row at which it stores into each destination. Op e + 1
(kind ``dispatch``) is the regular store, at those rows instead of ``me * T_MAX``: every rank
receives its rows compact, in (source, token) order, and the caller reads them in the window,
with no copy. The board of parity ``e % 2`` is written again at op e + 2 at the earliest, which
a peer reaches after this rank's op e + 1 signal, raised after its wait here (stream order).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .device import _op_epoch, _wait_for_sources


@triton.jit(do_not_specialize=["me", "epoch_delta"])
def _publish_counts_kernel(
    num_per_rank_ptr: tl.pointer_type(tl.int64),    # [W] rows this rank sends to each rank
    buf_ptrs: tl.pointer_type(tl.int64),            # [W] window base address of every rank
    sig_ptrs: tl.pointer_type(tl.int64),            # [W] signal pad address of every rank
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    board_off, me, epoch_delta,
    W: tl.constexpr, W_PAD: tl.constexpr,
):
    """One program: ``board[me, :]`` of every rank's window = this rank's counts, then
    ``signal[me] = epoch`` at every rank (release, system scope: covers the board stores)."""
    rr = tl.arange(0, W_PAD)
    live = rr < W
    counts = tl.load(num_per_rank_ptr + rr, mask=live, other=0)
    me64 = tl.cast(me, tl.int64)
    for r in tl.static_range(W):
        board = (tl.load(buf_ptrs + r) + board_off).to(tl.pointer_type(tl.int64))
        tl.store(board + me64 * W + rr, counts, mask=live)
    tl.debug_barrier()
    epoch, _ = _op_epoch(op_base_ptr, epoch_delta, 0)
    for r in tl.static_range(W):
        sig = tl.load(sig_ptrs + r).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(sig + me, epoch, sem="release", scope="sys")


@triton.jit(do_not_specialize=["me", "T_MAX", "counts_epoch_delta", "kind", "timeout_ns",
                               "max_spins"])
def _count_wait_kernel(
    my_sig_ptr: tl.pointer_type(tl.int32),          # [W] this rank's signal pad
    err_ptr: tl.pointer_type(tl.int64),             # [3] error word (see _wait_for_sources)
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    board_ptr: tl.pointer_type(tl.int64),           # [W, W] this rank's board (this parity)
    dst_off_ptr: tl.pointer_type(tl.int64),         # out [W] first row at each destination
    me, T_MAX, counts_epoch_delta, kind, timeout_ns, max_spins,
    W: tl.constexpr, W_PAD: tl.constexpr, USE_GLOBALTIMER: tl.constexpr,
):
    """One program: waits for every source's counts, then ``dst_off[d]`` = the rows ranks
    0 .. me - 1 send to rank d. Peers' counts are untrusted: each is clamped to [0, T_MAX], so
    ``dst_off[d] + this rank's rows <= (me + 1) * T_MAX`` stays inside d's window whatever they
    wrote (a destination whose rows then overlap sees the misplacement in its header read).
    After an expired wait the error word is set and the sums use what arrived. (The epoch
    argument has a name of its own: a native program binds it and the store's op number,
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
