"""Triton kernels of the ``gda`` receive gather: a dispatch's received rows copied out of this
rank's window into compact outputs, in (source, row) order (window layout and flag protocol:
:mod:`.device`)."""
from __future__ import annotations

import triton
import triton.language as tl

from .device import _source_of_row, _wait_here


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


@triton.jit(do_not_specialize=["num_rows", "epoch_delta", "kind", "timeout_ns", "max_spins"])
def _gather_rows_wait_kernel(
    win_ptr, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, err_ptr,
    my_sig_ptr: tl.pointer_type(tl.int32),          # [W] this rank's signal pad
    op_base_ptr: tl.pointer_type(tl.int32),         # [1] device op-number base
    data_off, idx_off, w_off, num_rows, D, num_topk, T_MAX, epoch_delta, kind, timeout_ns,
    max_spins,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    WITH_META: tl.constexpr, ALIGNED: tl.constexpr, USE_GLOBALTIMER: tl.constexpr,
):
    """:func:`_gather_rows_kernel` with the op's wait in it (:func:`_wait_here`): one launch
    instead of a one-program wait kernel and the copy. Every program spins until the sources
    signalled, so the caller bounds the grid (the waiting programs of every rank sharing the
    GPU must leave the peers' stores room to run)."""
    _wait_here(my_sig_ptr, err_ptr, op_base_ptr, epoch_delta, kind, timeout_ns, max_spins, W,
               W_PAD, USE_GLOBALTIMER)
    _gather_rows_kernel(win_ptr, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, err_ptr,
                        data_off, idx_off, w_off, num_rows, D, num_topk, T_MAX, W, W_PAD, K_PAD,
                        BLOCK_D, WITH_META, ALIGNED)


@triton.jit(do_not_specialize=["cap"])
def _gather_rows_early_kernel(
    win_ptr, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, err_ptr,
    data_off, idx_off, w_off, cap, D, num_topk, T_MAX,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    WITH_META: tl.constexpr, ALIGNED: tl.constexpr,
):
    """:func:`_gather_rows_kernel` launched before the host has read the counts: the row count
    is the one the dispatch's header kernel left after the offsets (``offsets_ptr[W + 1]``: the
    rows received when the counts it read were clean, else -1), and the copy runs only when it
    is in ``[1, cap]`` (``cap``: the rows the outputs hold). Otherwise nothing is written and
    the host, whose own check of the same counts is stricter, gathers after its count read."""
    n = tl.load(offsets_ptr + W + 1)
    n = tl.where((n > 0) & (n <= cap), n, 0).to(tl.int32)
    _gather_rows_kernel(win_ptr, offsets_ptr, out_x_ptr, out_idx_ptr, out_w_ptr, err_ptr,
                        data_off, idx_off, w_off, n, D, num_topk, T_MAX, W, W_PAD, K_PAD,
                        BLOCK_D, WITH_META, ALIGNED)


@triton.jit(do_not_specialize=["idx_off", "cap", "num_topk"])
def _copy_ids_early_kernel(
    win_ptr: tl.pointer_type(tl.int64),             # [1] this rank's window base address
    offsets_ptr: tl.pointer_type(tl.int64),         # [W + 2] (the clean row count at W + 1)
    out_ptr: tl.pointer_type(tl.int64),             # out [cap, K] received ids
    idx_off, cap, num_topk,
    W: tl.constexpr, BLOCK: tl.constexpr,
):
    """The received ids of a dispatch whose rows were stored compact (``rows_in_window``: row
    i's K ids at ``idx_off + 8 * i * K`` of the window) copied to ``out``, launched before the
    host has read the counts, after the header read (stream order: the rows have arrived). The
    row count is the one the count wait left after the offsets (``offsets_ptr[W + 1]``: clean
    counts, else -1; each source's clamped to [0, T_MAX] there, so the rows lie inside the id
    region), and the copy runs only when it is in ``[1, cap]``; otherwise nothing is written
    and the host copies after its count read."""
    n = tl.load(offsets_ptr + W + 1)
    total = (tl.where((n > 0) & (n <= cap), n, 0) * num_topk).to(tl.int32)
    src = (tl.load(win_ptr) + idx_off).to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, total, step):
        i = start + offs
        m = i < total
        tl.store(out_ptr + i, tl.load(src + i, mask=m), mask=m)
