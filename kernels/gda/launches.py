"""Host wrappers of gda's device kernels (:mod:`.device`): check dtypes, build grids, pass
constexprs; launch through :class:`~efa_ep.kernels.launch.FastKernel`, or append the launch to a
``plan`` for a native program (:mod:`efa_ep.kernels.native_launch`)."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..base import STATUS_BAD_EXPERT_ID, STATUS_NON_FINITE_WEIGHT, ceil_div
from ..launch import FastKernel
from ..native_launch import KernelStep, MemsetStep
from .device import (
    _combine_reduce_kernel, _combine_reduce_wait_kernel, _combine_store_kernel,
    _dispatch_store_kernel, _recv_header_fixed_kernel, _recv_header_kernel, _wait_kernel,
    next_pow2,
)
from .compact_kernels import _count_wait_kernel, _publish_counts_kernel
from .gather_kernels import (
    _copy_ids_early_kernel, _gather_rows_early_kernel, _gather_rows_kernel,
    _gather_rows_wait_kernel,
)
from .gate import KIND_OF, OP_KINDS, ROWS_MISPLACED, wait_record  # noqa: F401  (one definition)
from .layout_kernels import _layout_count_kernel, _layout_slot_kernel, _layout_small_kernel

__all__ = [
    "layout", "layout_words", "layout_views", "layout_in_store", "dispatch_store", "recv_header",
    "recv_header_fixed",
    "wait_for_sources", "gather_rows", "copy_ids_early", "combine_store", "combine_reduce",
    "next_pow2", "OP_KINDS",
    "wait_record", "check_err", "op_base_zero",
]

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
_K_GATHER_WAIT = FastKernel(_gather_rows_wait_kernel)
_K_GATHER_EARLY = FastKernel(_gather_rows_early_kernel)
_K_COPY_IDS_EARLY = FastKernel(_copy_ids_early_kernel)
_K_REDUCE_WAIT = FastKernel(_combine_reduce_wait_kernel)
_K_PUBLISH = FastKernel(_publish_counts_kernel)
_K_COUNT_WAIT = FastKernel(_count_wait_kernel)
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
#: T_PAD x K_PAD x W_PAD of a batch whose layout the store kernel computes itself (every program
#: computes it whole; 4096: up to 128 tokens of top-8 at EP 4)
LAYOUT_IN_STORE_ELEMS = 1 << 12


def layout_words(t: int, num_experts: int, world: int, k: int) -> int:
    """int64 elements of the scratch :func:`layout` uses for ``t`` tokens of top-``k``."""
    return _layout_offsets(t, num_experts, world, k)[-1]


@functools.lru_cache(maxsize=4096)
def _layout_offsets(t: int, num_experts: int, world: int, k: int):
    """(small, nb, o_exp, o_rank, o_slot, o_send, o_blk, total words) of layout's scratch
    (memoized: every dispatch asks, with a handful of distinct shapes)."""
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
    small, nb, o_exp, o_rank, o_slot, o_send, o_blk, words = _layout_offsets(
        t, num_experts, world, k)
    if scratch is None:
        scratch = torch.empty(words, dtype=torch.int64, device=topk_idx.device)
    slot, send_token_idx, num_per_rank, num_per_expert, status = layout_views(
        scratch, t, num_experts, world, k)
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


def layout_views(scratch: torch.Tensor, t: int, num_experts: int, world: int, k: int):
    """The outputs of :func:`layout` as views of its ``scratch`` (int64, at least
    :func:`layout_words` elements): (slot ``[T, W]``, send_token_idx ``[T * W]``, num_per_rank
    ``[W]``, num_per_expert ``[E]``, status ``[1]``)."""
    _, _, o_exp, o_rank, o_slot, o_send, _, _ = _layout_offsets(t, num_experts, world, k)
    tw = t * world
    return (scratch[o_slot:o_slot + tw].view(t, world), scratch[o_send:o_send + max(1, tw)],
            scratch[o_rank:o_rank + world], scratch[o_exp:o_exp + num_experts], scratch[0:1])


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

def layout_in_store(t: int, k: int, world: int) -> bool:
    """Whether a dispatch of ``t`` tokens of top-``k`` computes its layout inside its store
    kernel (:func:`dispatch_store` with ``send_token_idx``): a batch small enough for every
    program of the store to compute it whole (decode sizes)."""
    return _pad(t) * _pad(k) * _pad(world) <= LAYOUT_IN_STORE_ELEMS


def dispatch_store(x, topk_idx, topk_weights, slot, num_per_rank, num_per_expert, status,
                   buf_ptrs, sig_ptrs, done, *, data_off, idx_off, w_off, hdr_off, me, t_max,
                   num_local, epoch, with_meta, num_programs, op_base=None, fast=True,
                   plan=None, send_token_idx=None, num_experts=0, board_off=0, dst_off=None):
    """Stores rows (and, ``with_meta``, ids, weights and headers) into every destination's
    window, then raises ``signal[me] = op_base[0] + epoch`` at every rank. ``x``: ``[T, D]``
    (row stride ``x.stride(0)``, unit column stride); ``slot``: ``[T, W]`` int64; tables:
    ``[W]`` int64; ``done``: ``[1]`` int32; ``op_base``: ``[1]`` int32 device op-number base
    (None: 0; the same rule for every ``epoch`` argument of this module). Without
    ``with_meta`` the id, weight and count arguments are not read (None is fine).

    With ``send_token_idx`` (``[T * W]`` int64; ``with_meta``, :func:`layout_in_store` true,
    ``num_experts`` E) the kernel computes the routing layout first, as :func:`layout` does:
    ``slot``, ``send_token_idx``, ``num_per_rank``, ``num_per_expert`` and ``status`` are then
    its outputs (one launch instead of two).

    With ``dst_off`` (``[W]`` int64 from :func:`count_wait`; ``with_meta``, no layout inside)
    the rows for rank r go to r's window rows ``dst_off[r] + slot`` (compact) and ``dst_off[r]``
    to r's board at ``board_off`` (see :mod:`.compact_kernels`)."""
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
    in_store = send_token_idx is not None
    compact = dst_off is not None
    if compact and (in_store or not with_meta):
        raise ValueError("a compact store takes ids and weights and a layout made before it")
    if in_store and not (with_meta and layout_in_store(t, k, world) and num_experts > 0):
        raise ValueError(f"a layout inside the store needs ids, weights and a small batch "
                         f"(T={t}, K={k}, W={world}, E={num_experts})")
    elem = x.element_size()
    bd = _block_d(d, elem)
    stride = max(1, x.stride(0))
    _go(_K_STORE, (max(1, min(t, num_programs)),), (
        x, topk_idx, topk_weights, slot, send_token_idx if in_store else slot, num_per_rank,
        num_per_expert, status, buf_ptrs, sig_ptrs,
        done, _base(op_base, x.device), dst_off if compact else slot, data_off, idx_off, w_off,
        hdr_off, board_off, me, t, stride, d, k, t_max, num_local, num_experts, epoch,
        world, _pad(world), _pad(k), _pad(num_local), bd, bool(with_meta),
        _aligned16(d, elem, stride, data_off), in_store, _pad(t) if in_store else 2,
        _pad(num_experts) if in_store else 2, STATUS_BAD_EXPERT_ID, STATUS_NON_FINITE_WEIGHT,
        compact), _warps(bd, elem), fast, plan)


# Op kinds recorded with the epoch of an expired wait (error word slot 1 = epoch * 8 + kind).
def check_err(err: torch.Tensor) -> None:
    """The error word: ``[3]`` int64 (missing-source bits, first expired op, sources with bad
    input), a fourth (sources whose compact rows were not as announced) where compact
    dispatches run (the transport's has it). Checked once by whoever makes it."""
    _check("err", err, torch.int64, 1)
    if err.numel() < 3:
        raise ValueError(f"err must hold 3 int64 (missing-source bits, first expired op, sources "
                         f"with bad input), got {err.numel()}")


def recv_header(my_sig, hdr, err, num_per_rank, hw, *, num_local, t_max, epoch, timeout_ns,
                max_spins, use_globaltimer, kind="dispatch", op_base=None, fast=True, out=None,
                host=None, plan=None, board=None):
    """Waits for every source and returns (info [1 + W*(2+L) + W + L] int64, offsets [W+1]
    int64 on the device). info = [error bits, headers (status, rows, rows per local expert) per
    source, rows this rank sent per destination, rows received per local expert]. The int64
    after the offsets receives the rows received when the counts are clean, else -1 (see
    :func:`gather_rows`' ``early``).
    ``my_sig``: ``[W]`` int32; ``hdr``: ``[W, 2 + L]`` int64; ``err``: ``[3]`` int64 error
    word (:func:`check_err`); ``hw``: ``[W]`` int64 id-region high-water mark of this parity
    (updated). ``out``: an int64 device buffer of at least ``info + offsets`` elements to write
    into (None: allocated here). ``host``: a page-locked CPU int64 tensor of at least
    ``len(info) + 1`` elements: info is written there instead (a host view is returned), then
    ``host[len(info)]`` = this op's record (``epoch * 8 + kind``), last: the host waits for
    that word instead of copying and synchronizing. ``out`` holds ``_even(len(info)) + W + 2``
    elements. ``board``: this rank's count board (int64 view of this parity, at least
    ``[W * W + W]``) when the sources stored compact (:mod:`.compact_kernels`): the count wait
    wrote ``out`` (and ``host``) from the counts the sources announced; here nothing is written
    for the host and ``host`` is unused: a source whose header differs from ``out``'s info or
    whose rows are not where the board says sets :data:`ROWS_MISPLACED` in the error word (its
    bit in ``err[3]``)."""
    world = my_sig.numel()
    n_info = 1 + world * (2 + num_local) + world + num_local
    o_off = _even(n_info)
    if out is None:
        out = torch.empty(o_off + world + 2, dtype=torch.int64, device=hdr.device)
    if host is not None and (host.dtype != torch.int64 or host.numel() < n_info + 1):
        raise ValueError(f"host must hold {n_info + 1} int64, got {host.numel()} {host.dtype}")
    info = out[:n_info] if host is None or board is not None else host[:n_info]
    offsets = out[o_off:o_off + world + 1]
    _go(_K_RECV_HEADER, _ONE, (
        my_sig, hdr, err, num_per_rank, info, offsets, hw, _base(op_base, hdr.device),
        hdr if board is None else board, num_local, t_max, epoch, KIND_OF[kind], timeout_ns,
        max_spins, world, _pad(world), _pad(2 + num_local), bool(use_globaltimer),
        host is not None and board is None, board is not None, ROWS_MISPLACED), 4, fast,
        plan)
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


def publish_counts(num_per_rank, num_per_expert, status, buf_ptrs, sig_ptrs, *, board_off, me,
                   num_local, epoch, op_base=None, fast=True, plan=None):
    """One-program kernel: this rank's rows per destination (``num_per_rank`` ``[W]`` int64)
    into row ``me`` of every rank's board at ``board_off``, and to each rank r the header its
    stores will carry (``status`` ``[1]``, rows to r, ``num_per_expert`` ``[W * L]`` int64 of
    r's experts), then ``signal[me] = epoch`` at every rank (op ``dispatch counts`` of a
    compact dispatch, see :mod:`.compact_kernels`)."""
    world = buf_ptrs.numel()
    _go(_K_PUBLISH, _ONE, (num_per_rank, num_per_expert, status, buf_ptrs, sig_ptrs,
                           _base(op_base, buf_ptrs.device), board_off, me, num_local, epoch,
                           world, _pad(world), _pad(num_local)), 1, fast, plan)


def count_wait(my_sig, err, board, dst_off, num_per_rank, out, *, me, t_max, num_local, epoch,
               timeout_ns, max_spins, use_globaltimer, host=None, op_base=None, fast=True,
               plan=None):
    """One-program kernel: waits for every source's counts (op ``epoch``, kind ``dispatch
    counts``; bound as the variable ``counts_epoch_delta``), then ``dst_off`` ``[W]`` int64 =
    the rows ranks before ``me`` send to each rank (from this rank's ``board``, each count
    clamped to [0, ``t_max``]), and the headers the sources announced go where the rows op's
    header read (:func:`recv_header`) writes a regular dispatch's: ``out`` (int64 device,
    ``_even(n_info) + W + 2``: info, then offsets and the clean row count) and, with ``host``
    (page-locked int64, ``n_info + 1``), there too with the rows op's record (``(epoch + 1) * 8
    + kind dispatch``) last: the count read, before the rows are stored. ``num_per_rank``
    ``[W]`` int64: the rows this rank sends (from the layout). Returns (info, offsets) of
    ``out``."""
    world = my_sig.numel()
    n_info = 1 + world * (2 + num_local) + world + num_local
    o_off = _even(n_info)
    if host is not None and (host.dtype != torch.int64 or host.numel() < n_info + 1):
        raise ValueError(f"host must hold {n_info + 1} int64, got {host.numel()} {host.dtype}")
    info, offsets = out[:n_info], out[o_off:o_off + world + 2]
    _go(_K_COUNT_WAIT, _ONE, (
        my_sig, err, _base(op_base, err.device), board, dst_off, num_per_rank, info, offsets,
        info if host is None else host, me, t_max, num_local, epoch, KIND_OF["dispatch counts"],
        timeout_ns, max_spins, world, _pad(world), _pad(2 + num_local), bool(use_globaltimer),
        host is not None, KIND_OF["dispatch"]), 1, fast, plan)
    return info, offsets[:world + 1]


def gather_rows(win_ptr, offsets, out_x, out_idx, out_w, my_sig, err, *, data_off, idx_off,
                w_off, t_max, epoch, wait, timeout_ns, max_spins, use_globaltimer, num_programs,
                kind="cached dispatch", op_base=None, fast=True, plan=None,
                wait_in_kernel=False, early=False):
    """Copies the received rows out of this rank's window into ``out_x`` ``[N, D]`` (and, when
    ``out_idx`` is given, ids and weights into ``[N, K]``), in (source, row) order. With
    ``wait``, a one-program wait kernel runs first (:func:`wait_for_sources`), or with
    ``wait_in_kernel`` every program of the copy waits itself (one launch; the caller bounds
    ``num_programs`` so that the waiting programs of every rank on the GPU leave room for the
    peers' stores; a copy of no rows still launches its wait). Float rows are NaN if any wait
    of this window expired. ``offsets``: ``[W + 1]`` int64. With ``early`` (no ``wait``) the
    copy may be launched before the host read the counts: ``offsets`` is :func:`recv_header`'s
    (``[W + 2]``: the clean row count after them) and the copy moves that many rows when it is
    in ``[1, N]`` (N: the rows ``out_x`` holds), else none."""
    if not out_x.is_contiguous() or out_x.dim() != 2:
        raise ValueError(f"out_x must be a contiguous [N, D] tensor, got {tuple(out_x.shape)}")
    if early and wait:
        raise ValueError("an early gather runs after the header's wait (wait=False)")
    in_kernel = wait and wait_in_kernel
    if wait and not in_kernel:
        wait_for_sources(my_sig, err, epoch=epoch, kind=kind, timeout_ns=timeout_ns,
                         max_spins=max_spins, use_globaltimer=use_globaltimer, op_base=op_base,
                         fast=fast, plan=plan)
    world = offsets.numel() - (2 if early else 1)
    n, d = out_x.shape
    if n == 0 and not in_kernel:
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
    grid, aligned = (max(1, min(n, num_programs)),), _aligned16(d, elem, d, data_off)
    if early:
        _go(_K_GATHER_EARLY, grid, (
            win_ptr, offsets, out_x, out_idx, out_w, err, data_off, idx_off, w_off,
            n, d, k, t_max,
            world, _pad(world), _pad(k), bd, with_meta, aligned), _warps(bd, elem), fast, plan)
        return
    if in_kernel:
        _go(_K_GATHER_WAIT, grid, (
            win_ptr, offsets, out_x, out_idx, out_w, err, my_sig, _base(op_base, err.device),
            data_off, idx_off, w_off, n, d, k, t_max, epoch, KIND_OF[kind], timeout_ns,
            max_spins, world, _pad(world), _pad(k), bd, with_meta, aligned,
            bool(use_globaltimer)), _warps(bd, elem), fast, plan)
        return
    _go(_K_GATHER, grid, (
        win_ptr, offsets, out_x, out_idx, out_w, err, data_off, idx_off, w_off,
        n, d, k, t_max,
        world, _pad(world), _pad(k), bd, with_meta, aligned), _warps(bd, elem), fast, plan)


#: the early ids copy's grid and block: 64 programs of 2,048 int64 (16 KiB) each per pass
COPY_IDS_PROGRAMS, COPY_IDS_BLOCK = 64, 2048


def copy_ids_early(win_ptr, offsets, out, *, idx_off, fast=True, plan=None):
    """Copies the ids a compact dispatch received (``K`` per row, rows contiguous at byte
    ``idx_off`` of this rank's window) into ``out`` ``[N, K]`` int64, launched after the header
    read and before the host's count read: ``offsets`` is :func:`recv_header`'s ``[W + 2]``
    (the clean row count after them) and the copy moves that many rows when it is in ``[1, N]``,
    else none (the host copies). ``win_ptr``: ``[1]`` int64 window base address."""
    _check("out", out, torch.int64, 2)
    n, k = out.shape
    _go(_K_COPY_IDS_EARLY, (COPY_IDS_PROGRAMS,), (
        win_ptr, offsets, out, idx_off, n, k, offsets.numel() - 2, COPY_IDS_BLOCK), 4, fast, plan)


def combine_store(y, offsets, buf_ptrs, sig_ptrs, done, *, data_off, me, t_max, epoch,
                  num_programs, fixed=False, ids=None, op_base=None, fast=True, plan=None):
    """Returns row i of ``y`` ``[N, D]`` to its source's window, then signals every rank.
    ``fixed``: ``y`` is ``[W * T_MAX, D]`` in window layout and ``offsets`` is the device count
    ``num_recv [W]``; only rows j < num_recv[s] of each source block are returned. ``ids``: a
    contiguous int64 tensor of ``y``'s shape (a weight combine's received ids): elements whose
    id is -1 are returned as 0."""
    if y.dim() != 2 or (y.shape[1] > 1 and y.stride(1) != 1):
        raise ValueError(f"y must be [N, D] with unit column stride, got {tuple(y.shape)}")
    if ids is not None and (ids.dtype != torch.int64 or ids.shape != y.shape or
                            not ids.is_contiguous()):
        raise ValueError(f"ids must be contiguous int64 {tuple(y.shape)}, got "
                         f"{tuple(ids.shape)} {ids.dtype}")
    world = buf_ptrs.numel()
    n, d = y.shape
    elem = y.element_size()
    bd = _block_d(d, elem)
    stride = max(1, y.stride(0))
    _go(_K_COMBINE_STORE, (max(1, min(n if not fixed else t_max, num_programs)),), (
        y, offsets if ids is None else ids, offsets, buf_ptrs, sig_ptrs, done,
        _base(op_base, y.device), data_off, me, n, stride, d, t_max, epoch,
        world, _pad(world), bd, _aligned16(d, elem, stride, data_off), bool(fixed),
        ids is not None), _warps(bd, elem), fast, plan)


def combine_reduce(win_ptr, slot, out, my_sig, err, *, data_off, t_max, epoch, wait, timeout_ns,
                   max_spins, use_globaltimer, num_programs, kind="combine", op_base=None,
                   fast=True, plan=None, wait_in_kernel=False):
    """``out`` ``[T, D]`` = float32 sum of this rank's returned partials in ascending rank order
    (see :func:`_combine_reduce_kernel`), written in ``out``'s dtype. ``slot``: ``[T, W]``
    int64 of the matching dispatch. With ``wait``, a one-program wait kernel runs first, or
    with ``wait_in_kernel`` every program of the reduce waits itself (as :func:`gather_rows`);
    rows are NaN if any wait of this window expired."""
    if slot.dtype != torch.int64 or slot.dim() != 2:
        raise ValueError(f"slot must be [T, W] int64, got {tuple(slot.shape)} {slot.dtype}")
    if not out.is_contiguous() or out.dim() != 2:
        raise ValueError(f"out must be a contiguous [T, D] tensor, got {tuple(out.shape)}")
    in_kernel = wait and wait_in_kernel
    if wait and not in_kernel:
        wait_for_sources(my_sig, err, epoch=epoch, kind=kind, timeout_ns=timeout_ns,
                         max_spins=max_spins, use_globaltimer=use_globaltimer, op_base=op_base,
                         fast=fast, plan=plan)
    t, d = out.shape
    if t == 0 and not in_kernel:
        return
    world = slot.shape[1]
    elem = out.element_size()
    bd = _block_d(d, elem)
    grid, aligned = (max(1, min(t, num_programs)),), _aligned16(d, elem, d, data_off)
    if in_kernel:
        _go(_K_REDUCE_WAIT, grid, (
            win_ptr, slot, out, err, my_sig, _base(op_base, err.device), data_off, t, d, t_max,
            epoch, KIND_OF[kind], timeout_ns, max_spins, world, _pad(world), bd, aligned,
            bool(use_globaltimer)), _warps(bd, elem), fast, plan)
        return
    _go(_K_REDUCE, grid, (
        win_ptr, slot, out, err, data_off, t, d, t_max,
        world, _pad(world), bd, aligned), _warps(bd, elem), fast, plan)
