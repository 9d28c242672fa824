"""Device side of the proxy transport for CUDA inputs on a host window (the host-staged path).

Without these kernels a CUDA dispatch + combine is a chain of ~20 small launches, copies and
five stream synchronizations driven from Python (routing to the host, layout there, a gather, a
device-to-host copy, per-peer host-to-device copies, a reduction in several torch ops). Here:

- dispatch: the routing layout runs on the device (:func:`~efa_ep.kernels.gda.launches.layout`,
  the same kernels and value checks as ``gda``), then :func:`pack_dispatch` stores every row for
  a peer straight into the window's send plane (GPU stores into pinned host memory: no staging
  buffer, no separate copy), the routing metadata of every sent row into a pinned host buffer,
  and the counts and status word into pinned host memory, chunk by chunk with a progress word
  per program: the host posts a chunk's rows while the next ones are stored.
  After the wire, :func:`gather_dispatch` builds the outputs in one launch: the peers' rows read
  from the receive window (GPU loads from pinned memory), this rank's own rows from ``x``, and
  the ids and weights the host unpacked and checked.
- combine and cached dispatch: :func:`pack_rows` stores the rows for the peers (a cached
  dispatch's gathered through its handle's send order) into the send plane chunk by chunk as
  the dispatch's packing does. After the wire a cached dispatch's rows are copied out of the
  window; combine's :func:`reduce_combine` sums each token's partial rows in float32 over source
  ranks in ascending order from +0.0, reading the peers' rows from the receive window and this rank's own
  rows from ``y``, rounded once: bit-equal to :func:`~efa_ep.kernels.base.reduce_rows_by_rank`
  followed by the cast, as the host path is.

Host buffers are passed to the kernels by address (:class:`~efa_ep.kernels.proxy.ring.HostPtr`:
pinned memory is mapped into the GPU's address space). Under ``TRITON_INTERPRET=1`` (the CPU
tests) every buffer is a CPU tensor and is passed as one.

Symbols: W ranks, T tokens, K top-k, E experts, L = E // W, D row width in elements, S rows sent
(rank-major: rows to rank 0, then rank 1, ...), N rows received.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..gda import launches as kern
from ..gda.device import _round_f32_to, _source_of_row, next_pow2
from ..launch import FastKernel
from ..native_launch import KernelStep
from .marks import await_bytes, await_mark, begin_reads
from .native import MARK_WHOLE
from .ring import HostPtr

__all__ = ["pack_dispatch", "pack_rows", "pack_grid", "gather_dispatch", "reduce_combine",
           "reads_grid", "host_arg"]


_MARK_WHOLE = tl.constexpr(MARK_WHOLE)  # (marks.py)
_HOST_TENSORS = None  # whether host buffers go to kernels as tensors (interpreter, no GPU)


def host_arg(t: torch.Tensor, dtype: torch.dtype = None):
    """A host tensor as a kernel argument: its pinned address on a GPU (UVA), the tensor itself
    under the interpreter. ``dtype`` reinterprets the bytes (the window is uint8)."""
    if dtype is not None and t.dtype != dtype:
        t = t.view(dtype)
    return t if _host_tensors() else HostPtr(t)


def _host_tensors() -> bool:
    global _HOST_TENSORS
    if _HOST_TENSORS is None:
        _HOST_TENSORS = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
    return _HOST_TENSORS


def _watcher() -> int:
    """1 where the reading kernels are compiled with their waits on the chunk marks and program
    0 as the marks' watcher (``marks.py``): a GPU; 0 under the interpreter (no clock; its
    kernels run after the round)."""
    return 0 if _host_tensors() else 1


def reads_grid(n: int, num_programs: int) -> int:
    """Programs of :func:`gather_dispatch` / :func:`reduce_combine` for ``n`` rows or tokens:
    up to ``num_programs`` readers, and the watcher where there is one."""
    return max(1, min(n, num_programs)) + _watcher()


def _go(kernel: FastKernel, grid, args, num_warps: int, plan) -> None:
    """Launches ``kernel`` now, or with ``plan`` (a list) appends the launch to it instead (a
    :class:`~efa_ep.kernels.native_launch.Program` is bound from it)."""
    if plan is None:
        kernel.launch(grid, args, num_warps)
    else:
        plan.append(KernelStep(kernel, grid, args, num_warps))


@triton.jit
def _copy_row(src, dst, D, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):
    offs = tl.arange(0, BLOCK_D)
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + offs
        cm = cols < D
        tl.store(dst + cols, tl.load(src + cols, mask=cm), mask=cm)


@triton.jit(do_not_specialize=["me", "num_topk", "num_local", "num_experts", "D", "stride_x",
                               "chunk_rows"])
def _pack_dispatch_kernel(
    x_ptr,                                          # [T, D] rows, row stride stride_x
    topk_idx_ptr: tl.pointer_type(tl.int64),        # [T, K] global expert ids
    topk_w_ptr: tl.pointer_type(tl.float32),        # [T, K]
    send_token_idx_ptr: tl.pointer_type(tl.int64),  # [S] from the layout, rank-major
    num_per_rank_ptr: tl.pointer_type(tl.int64),    # [W] rows sent to each rank
    num_per_expert_ptr: tl.pointer_type(tl.int64),  # [E] (token, expert) pairs per expert
    status_ptr: tl.pointer_type(tl.int64),          # [1] the layout's status word
    plane_ptr,                                      # out (host) [S - S_me, D] rows to peers
    meta_ptr: tl.pointer_type(tl.int64),            # out (host) [S, 2K] routing rows
    counts_ptr: tl.pointer_type(tl.int64),          # out (host) [2 + W + E] status, W, E counts, ready
    progress_ptr: tl.pointer_type(tl.int64),        # out (host) [grid] chunks each program stored
    me, num_topk, num_local, num_experts, D, stride_x, chunk_rows,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Send row i (to rank d, token t): metadata row i = [local ids of t's experts on d (-1
    elsewhere), their weights' float32 bits sign-extended (0 elsewhere)], as the host layout
    writes it; for d != me, ``x[t]`` -> plane row i (i - S_me past this rank's block). Rows go
    in chunks of ``chunk_rows`` of the send order; after its rows of chunk c a program stores
    c + 1 into its progress word (release), so the host can post a chunk's rows while the next
    ones are stored."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ws = tl.arange(0, W_PAD)
    n_r = tl.load(num_per_rank_ptr + ws, mask=ws < W, other=0)
    ends = tl.cumsum(n_r, axis=0)           # padded lanes hold the total: never <= a row index
    total = tl.sum(n_r, axis=0)
    n_me = tl.load(num_per_rank_ptr + me)
    if pid == 0:
        tl.store(counts_ptr, tl.load(status_ptr))
        tl.store(counts_ptr + 1 + ws, n_r, mask=ws < W)
        e = tl.arange(0, E_PAD)
        em = e < num_experts
        tl.store(counts_ptr + 1 + W + e, tl.load(num_per_expert_ptr + e, mask=em), mask=em)
        # then the ready word, last and with release order: a host that reads 1 there may post
        # the round's headers while the rows below are still being stored
        tl.debug_barrier()
        tl.atomic_xchg(counts_ptr + 1 + W + num_experts, 1, sem="release", scope="sys")
    k = tl.arange(0, K_PAD)
    km = k < num_topk
    for c in range(0, tl.cdiv(total, chunk_rows)):
        lo = c * chunk_rows
        for i in range(lo + pid, tl.minimum(lo + chunk_rows, total), nprog):
            i64 = tl.cast(i, tl.int64)
            d = tl.sum((ends <= i64).to(tl.int64), axis=0)
            t = tl.load(send_token_idx_ptr + i64)
            ids = tl.load(topk_idx_ptr + t * num_topk + k, mask=km, other=-1)
            wv = tl.load(topk_w_ptr + t * num_topk + k, mask=km, other=0.0)
            on = (ids >= 0) & (ids // num_local == d)
            row = meta_ptr + i64 * 2 * num_topk
            tl.store(row + k, tl.where(on, ids - d * num_local, -1), mask=km)
            tl.store(row + num_topk + k,
                     tl.where(on, wv.to(tl.int32, bitcast=True).to(tl.int64), 0), mask=km)
            if d != me:
                pos = tl.where(d > me, i64 - n_me, i64)
                _copy_row(x_ptr + t * stride_x, plane_ptr + pos * D, D, BLOCK_D, ALIGNED)
        tl.debug_barrier()
        tl.atomic_xchg(progress_ptr + pid, tl.zeros([], tl.int64) + (c + 1), sem="release",
                       scope="sys")


@triton.jit(do_not_specialize=["own_start", "own_end", "num_rows", "D", "stride_src",
                               "chunk_rows"])
def _pack_rows_kernel(
    src_ptr,                                        # [R, D] rows, row stride stride_src
    idx_ptr,                                        # [num_rows] int64: source row of send row i (HAS_IDX)
    plane_ptr,                                      # out (host) [num_rows - own, D] rows to peers
    progress_ptr: tl.pointer_type(tl.int64),        # out (host) [grid] chunks each program stored
    own_start, own_end, num_rows, D, stride_src, chunk_rows,
    HAS_IDX: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Send row i (``src[idx[i]]``, or ``src[i]`` without an index), unless it is this rank's
    own (``[own_start, own_end)``) -> plane row i, or i minus the own rows past them; in chunks
    of ``chunk_rows`` send rows, each program then storing c + 1 into its progress word
    (release), as :func:`_pack_dispatch_kernel` does."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for c in range(0, tl.cdiv(num_rows, chunk_rows)):
        lo = c * chunk_rows
        for i in range(lo + pid, tl.minimum(lo + chunk_rows, num_rows), nprog):
            i64 = tl.cast(i, tl.int64)
            if (i64 < own_start) | (i64 >= own_end):
                pos = tl.where(i64 < own_start, i64, i64 - (own_end - own_start))
                if HAS_IDX:
                    row = tl.load(idx_ptr + i64)
                else:
                    row = i64
                _copy_row(src_ptr + row * stride_src, plane_ptr + pos * D, D, BLOCK_D, ALIGNED)
        tl.debug_barrier()
        tl.atomic_xchg(progress_ptr + pid, tl.zeros([], tl.int64) + (c + 1), sem="release",
                       scope="sys")


@triton.jit(do_not_specialize=["me", "own_start", "num_rows", "num_topk", "D", "stride_x", "tag",
                               "chunk_bytes", "timeout_ns"])
def _gather_dispatch_kernel(
    x_ptr,                                          # [T, D] this rank's input rows
    send_token_idx_ptr: tl.pointer_type(tl.int64),  # [S] of this dispatch
    src_ptrs_ptr: tl.pointer_type(tl.int64),        # [W] address of source s's rows (host)
    recv_off_ptr: tl.pointer_type(tl.int64),        # (host) [W + 1] prefix of rows per source
    in_idx_ptr: tl.pointer_type(tl.int64),          # (host) [N, K] checked local ids
    in_w_ptr: tl.pointer_type(tl.float32),          # (host) [N, K] weights
    marks_ptr: tl.pointer_type(tl.int32),           # (host) [W, 256] chunk marks
    dev_marks_ptr: tl.pointer_type(tl.int32),       # [W, 256] their device copy (marks.py)
    out_x_ptr,                                      # out [N, D]
    out_idx_ptr: tl.pointer_type(tl.int64),         # out [N, K]
    out_w_ptr: tl.pointer_type(tl.float32),         # out [N, K]
    me, own_start, num_rows, num_topk, D, stride_x, tag, chunk_bytes, timeout_ns,
    W: tl.constexpr, W_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    ALIGNED: tl.constexpr, WATCHER: tl.constexpr,
):
    """Output row i (the j-th row from source s) = ``x[send_token_idx[own_start + j]]`` when s
    is this rank, else row j of s's block in the receive window; ids and weights row i from the
    host's unpacked copy. ``tag`` != 0: launched before the round completed; a peer's row is
    read once its chunks' marks hold ``tag``, the ids and weights once this rank's whole mark
    does (the host unpacked them). ``WATCHER`` 1 (a GPU): program 0 is the marks' watcher
    (``marks.py``), the others read; 0: no waits (the interpreter)."""
    elt = out_x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    k = tl.arange(0, K_PAD)
    km = k < num_topk
    start, nprog = begin_reads(marks_ptr, dev_marks_ptr, me, tag, timeout_ns, W, WATCHER)
    if pid >= WATCHER:
        row_bytes = D * elt.primitive_bitwidth // 8
        for i in range(pid - WATCHER, num_rows, nprog):
            i64 = tl.cast(i, tl.int64)
            s, j = _source_of_row(recv_off_ptr, i64, W, W_PAD)
            if s == me:
                t = tl.load(send_token_idx_ptr + own_start + j)
                src = x_ptr + t * stride_x
            else:
                if WATCHER == 1:
                    if tag != 0:
                        await_bytes(dev_marks_ptr, s, j * row_bytes, (j + 1) * row_bytes,
                                    chunk_bytes, tag, start, timeout_ns)
                src = tl.load(src_ptrs_ptr + s).to(tl.pointer_type(elt)) + j * D
            _copy_row(src, out_x_ptr + i64 * D, D, BLOCK_D, ALIGNED)
        if WATCHER == 1:
            if tag != 0:
                await_mark(dev_marks_ptr, me, _MARK_WHOLE, tag, start, timeout_ns)
        for i in range(pid - WATCHER, num_rows, nprog):
            i64 = tl.cast(i, tl.int64)
            tl.store(out_idx_ptr + i64 * num_topk + k,
                     tl.load(in_idx_ptr + i64 * num_topk + k, mask=km), mask=km)
            tl.store(out_w_ptr + i64 * num_topk + k,
                     tl.load(in_w_ptr + i64 * num_topk + k, mask=km), mask=km)


@triton.jit
def _find_token(block_ptr, n, t, LOG_N: tl.constexpr):
    """Row of token ``t`` in an ascending ``[n]`` int64 block, or -1 (binary search)."""
    lo = n - n
    hi = n
    for _ in tl.static_range(LOG_N):
        mid = (lo + hi) // 2
        v = tl.load(block_ptr + mid, mask=mid < hi, other=0x7FFFFFFFFFFFFFFF)
        go_right = (mid < hi) & (v < t)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right | (mid >= hi), hi, mid)
    v = tl.load(block_ptr + lo, mask=lo < n, other=-1)
    return tl.where((lo < n) & (v == t), lo, -1)


@triton.jit(do_not_specialize=["me", "own_start", "num_tokens", "D", "stride_y", "tag",
                               "chunk_bytes", "timeout_ns"])
def _reduce_combine_kernel(
    y_ptr,                                          # [N, D] this rank's expert outputs
    send_token_idx_ptr: tl.pointer_type(tl.int64),  # [S] of the dispatch (rank-major, ascending)
    send_off_ptr: tl.pointer_type(tl.int64),        # (host) [W + 1] prefix of rows sent per rank
    src_ptrs_ptr: tl.pointer_type(tl.int64),        # [W] address of rank r's returned rows
    marks_ptr: tl.pointer_type(tl.int32),           # (host) [W, 256] chunk marks
    dev_marks_ptr: tl.pointer_type(tl.int32),       # [W, 256] their device copy (marks.py)
    out_ptr,                                        # out [T, D]
    me, own_start, num_tokens, D, stride_y, tag, chunk_bytes, timeout_ns,
    W: tl.constexpr, LOG_T: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
    WATCHER: tl.constexpr,
):
    """out[t] = (((+0.0 + part_r0) + part_r1) + ...) over the ranks r (ascending) that token t
    was sent to, in float32, rounded once (the rule of ``gda``'s reduce). Token t's row in rank
    r's block is found by binary search (a block lists its tokens in ascending order); rank
    ``me``'s part is row ``own_start + row`` of ``y``, a peer's is that row of its block in the
    window (``tag`` != 0: launched before the round completed; read once its chunks' marks hold
    ``tag``; ``WATCHER`` as :func:`_gather_dispatch_kernel`'s)."""
    elt = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    start, nprog = begin_reads(marks_ptr, dev_marks_ptr, me, tag, timeout_ns, W, WATCHER)
    if pid >= WATCHER:
        row_bytes = D * elt.primitive_bitwidth // 8
        for t in range(pid - WATCHER, num_tokens, nprog):
            t64 = tl.cast(t, tl.int64)
            if WATCHER == 1:
                if tag != 0:
                    for r in tl.static_range(W):
                        if r != me:
                            a = tl.load(send_off_ptr + r)
                            row = _find_token(send_token_idx_ptr + a,
                                              tl.load(send_off_ptr + r + 1) - a, t64, LOG_T)
                            if row >= 0:
                                await_bytes(dev_marks_ptr, r, row * row_bytes,
                                            (row + 1) * row_bytes, chunk_bytes, tag, start,
                                            timeout_ns)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + offs
                cm = cols < D
                acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                for r in tl.static_range(W):
                    a = tl.load(send_off_ptr + r)
                    row = _find_token(send_token_idx_ptr + a,
                                      tl.load(send_off_ptr + r + 1) - a, t64, LOG_T)
                    if row >= 0:
                        if r == me:
                            src = y_ptr + (own_start + row) * stride_y
                        else:
                            src = tl.load(src_ptrs_ptr + r).to(tl.pointer_type(elt)) + row * D
                        if ALIGNED:
                            src = tl.multiple_of(src, 16)
                        acc += tl.load(src + cols, mask=cm).to(tl.float32)
                tl.store(out_ptr + t64 * D + cols, _round_f32_to(acc, elt), mask=cm)


# launched through their compiled launchers once compiled (Triton's per-call argument handling
# cost ~40-55 us per launch of these kernels on the H200 host)
_PACK = FastKernel(_pack_dispatch_kernel)
_PACK_ROWS = FastKernel(_pack_rows_kernel)
_GATHER = FastKernel(_gather_dispatch_kernel)
_REDUCE = FastKernel(_reduce_combine_kernel)


def _grid(n: int, num_programs: int):
    return (max(1, min(n, num_programs)),)


def _aligned(d: int, elem: int, stride: int) -> bool:
    return (d * elem) % 16 == 0 and (stride * elem) % 16 == 0


def pack_grid(rows: int, num_programs: int) -> int:
    """Programs of :func:`pack_dispatch` for ``rows`` send rows (``T * min(W, K)`` bounds them):
    the size of its progress buffer."""
    return _grid(rows, num_programs)[0]


def pack_dispatch(x, topk_idx, topk_weights, layout, me: int, plane, meta, counts, progress,
                  chunk_rows: int, *, num_programs: int, plan=None) -> None:
    """Stores a dispatch's send side (asynchronous, on the current stream).

    Args:
        x: ``[T, D]`` rows (device, any float dtype, unit column stride).
        topk_idx, topk_weights: ``[T, K]`` int64 / float32 (device, contiguous).
        layout: the outputs of :func:`~efa_ep.kernels.gda.launches.layout` for them.
        plane: host ``[>= (S - S_me) * D * elem]`` uint8, the window's send plane 0 (pinned).
        meta: host ``[>= S * 2K]`` int64 (pinned). counts: host ``[2 + W + E]`` int64 (pinned):
            status word, rows per rank, (token, expert) pairs per expert, then a ready word set
            to 1 once the others are written (zero it before the launch to wait for it).
        progress: host ``[pack_grid(T * min(W, K), num_programs)]`` int64 (pinned), zeroed
            before the launch: program p stores c + 1 once its rows of chunk c (send rows
            ``[c * chunk_rows, (c + 1) * chunk_rows)``, plane and routing rows) are stored; the
            rows below ``min(progress) * chunk_rows`` are in host memory.
        plan: a list: append the launch instead of making it (the same for the wrappers below).
    The host reads the counts once the ready word is 1, the rows and routing rows as the progress
    words say (or after a stream synchronization).
    """
    slot, send_token_idx, num_per_rank, num_per_expert, status = layout
    t, d = x.shape
    k = topk_idx.shape[1]
    world = num_per_rank.numel()
    num_experts = num_per_expert.numel()
    elem = x.element_size()
    bd = kern._block_d(d, elem)
    _go(_PACK, _grid(t * min(world, k), num_programs), (
        x, topk_idx, topk_weights, send_token_idx, num_per_rank, num_per_expert, status,
        host_arg(plane, x.dtype), host_arg(meta), host_arg(counts), host_arg(progress),
        me, k, num_experts // world, num_experts, d, max(1, x.stride(0)), max(1, chunk_rows),
        world, max(2, next_pow2(world)), max(2, next_pow2(k)), max(2, next_pow2(num_experts)),
        bd, _aligned(d, elem, max(1, x.stride(0)))), kern._warps(bd, elem), plan)


def pack_rows(src, idx, own_start: int, own_end: int, plane, progress, chunk_rows: int, *,
              num_programs: int, plan=None) -> None:
    """Stores the rows of a combine (``idx`` None: ``src`` is ``y``, rows grouped by
    destination) or of a cached dispatch (``idx``: the handle's ``send_token_idx``) for the
    peers into the send plane (asynchronous, on the current stream), chunk by chunk as
    :func:`pack_dispatch` does.

    Args:
        src: ``[R, D]`` rows (device, unit column stride). idx: None, or ``[S]`` int64 (device):
            send row i is ``src[idx[i]]``. Send rows are grouped by destination rank; this
            rank's own ``[own_start, own_end)`` stay. plane: host ``[>= (S - own) * D * elem]``
            uint8, the send plane (pinned). progress: host ``[pack_grid(S, num_programs)]``
            int64 (pinned), zeroed before the launch: program p stores c + 1 once its rows of
            chunk c (send rows ``[c * chunk_rows, (c + 1) * chunk_rows)``) are stored.
    """
    n = src.shape[0] if idx is None else idx.numel()
    d = src.shape[1]
    elem = src.element_size()
    bd = kern._block_d(d, elem)
    _go(_PACK_ROWS, _grid(n, num_programs), (
        src, src if idx is None else idx, host_arg(plane, src.dtype), host_arg(progress),
        own_start, own_end, n, d, max(1, src.stride(0)), max(1, chunk_rows), idx is not None,
        bd, _aligned(d, elem, max(1, src.stride(0)))), kern._warps(bd, elem), plan)


def gather_dispatch(x, send_token_idx, src_ptrs, recv_off, in_idx, in_w, out_x, out_idx, out_w, *,
                    me: int, own_start: int, num_programs: int, marks, dev_marks, tag: int = 0,
                    chunk_bytes: int = 1, timeout_ns: int = 0, plan=None) -> None:
    """Builds a dispatch's outputs (asynchronous, on the current stream).

    Args:
        x: ``[T, D]`` this rank's rows (device). send_token_idx: ``[S]`` int64 (device).
        src_ptrs: ``[W]`` int64 (device), the address of each source's rows in the receive
            window (entry ``me`` unused). recv_off: host ``[W + 1]`` int64, rows per source as a
            prefix. in_idx, in_w: host ``[N, K]`` int64 / float32 (the checked routing rows).
        out_x, out_idx, out_w: ``[N, D]`` / ``[N, K]`` / ``[N, K]`` outputs (device).
        marks: host ``[W * 256]`` int32, the transport's chunk marks; dev_marks: ``[W * 256]``
            int32 on x's device, their copy (``marks.py``); ``tag`` != 0: the round's tag
            (launched before its complete: the kernel waits for the marks, at most
            ``timeout_ns``); 0: launched after it. chunk_bytes: the wire's chunk size.
    The host buffers must not change until the kernel ran (the caller records an event).
    """
    n, d = out_x.shape
    if n == 0:
        return
    k = out_idx.shape[1]
    world = src_ptrs.numel()
    elem = out_x.element_size()
    bd = kern._block_d(d, elem)
    _go(_GATHER, (reads_grid(n, num_programs),), (
        x, send_token_idx, src_ptrs, host_arg(recv_off), host_arg(in_idx), host_arg(in_w),
        host_arg(marks), dev_marks, out_x, out_idx, out_w, me, own_start, n, k, d,
        max(1, x.stride(0)), tag, chunk_bytes, timeout_ns, world, max(2, next_pow2(world)),
        max(2, next_pow2(k)), bd,
        _aligned(d, elem, max(1, x.stride(0))), _watcher()), kern._warps(bd, elem), plan)


def reduce_combine(y, send_token_idx, send_off, src_ptrs, out, *, me: int, own_start: int,
                   num_programs: int, marks, dev_marks, tag: int = 0, chunk_bytes: int = 1,
                   timeout_ns: int = 0, plan=None) -> None:
    """``out`` ``[T, D]`` = combine's reduction (asynchronous, on the current stream).

    Args:
        y: ``[N, D]`` this rank's expert outputs (device); its own block starts at row
            ``own_start``. send_token_idx: ``[S]`` int64 (device) of the matching dispatch.
        send_off: host ``[W + 1]`` int64, rows sent to each rank as a prefix.
        src_ptrs: ``[W]`` int64 (device), the address of each rank's returned rows in the
            receive window (entry ``me`` unused). out: ``[T, D]`` in y's dtype (device).
        marks, dev_marks, tag, chunk_bytes, timeout_ns: as :func:`gather_dispatch`'s.
    The host buffer must not change until the kernel ran (the caller records an event).
    """
    t, d = out.shape
    if t == 0:
        return
    world = src_ptrs.numel()
    elem = out.element_size()
    bd = kern._block_d(d, elem)
    _go(_REDUCE, (reads_grid(t, num_programs),), (
        y, send_token_idx, host_arg(send_off), src_ptrs, host_arg(marks), dev_marks, out, me,
        own_start, t, d, max(1, y.stride(0)), tag, chunk_bytes, timeout_ns, world,
        max(1, (t + 1).bit_length()), bd, _aligned(d, elem, max(1, y.stride(0))),
        _watcher()), kern._warps(bd, elem), plan)
