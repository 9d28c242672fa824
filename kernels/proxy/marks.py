"""The reading kernels' side of the chunk marks (``efa_proxy.h``, "Chunk marks"): a dispatch's
gather or a combine's reduction launched before its round completed reads each peer's rows as
their chunks arrive.

The host marks live in pinned host memory (``[W, 256]`` int32: chunk c of source s at
``s * 256 + c``, the whole-data mark at ``s * 256 + 255``), written by the engine's channel
threads and, for the whole marks, by the host once the round completed. Polled from every
program of a full-width grid they would flood the PCIe link the rows themselves cross (measured
on an H200: a decode D+C 3.5x slower), so one program of the grid, the watcher, polls them and
forwards each mark it sees into a device copy (``[W, 256]`` int32 in GPU memory); the other
programs wait on the device copy. Tags are never reset: a round's tag differs from every older
one (:func:`~efa_ep.kernels.proxy.native.mark_tag`), so neither copy needs clearing.

Every wait is bounded by ``timeout_ns`` (``%globaltimer``): by then the host's own waits have
failed and raise; the kernel only must end.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..gda.device import _now_ns
from .native import MARK_CHUNKS, MARK_WHOLE, MARKS

_MARKS, _MARK_CHUNKS, _MARK_WHOLE = tl.constexpr(MARKS), tl.constexpr(MARK_CHUNKS), \
    tl.constexpr(MARK_WHOLE)


@triton.jit
def _fence_sys():
    """After a volatile load that saw the host's mark: what the host wrote before it is seen."""
    return tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fence_gpu():
    """After a volatile load that saw the watcher's forwarded mark (its release at GPU scope)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _backoff():
    return tl.inline_asm_elementwise("nanosleep.u32 200; mov.u32 $0, 0;", "=r", [],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def watch(marks_ptr, dev_marks_ptr, me, tag, start, timeout_ns, W: tl.constexpr):
    """The watcher program: forwards every host mark holding ``tag`` into ``dev_marks`` until
    this rank's whole mark holds it (the host's complete returned) or the deadline, then stores
    ``tag`` at every source's whole mark there (nothing waits past it)."""
    lanes = tl.arange(0, _MARKS)
    done = tl.load(marks_ptr + me * _MARKS + _MARK_WHOLE, volatile=True) == tag
    while (done == 0) & ((_now_ns(True) - start) <= timeout_ns):
        for s in tl.static_range(W):
            v = tl.load(marks_ptr + s * _MARKS + lanes, volatile=True)
            _fence_sys()
            tl.atomic_xchg(dev_marks_ptr + s * _MARKS + lanes, tag, mask=v == tag,
                           sem="release", scope="gpu")
        _backoff()
        done = tl.load(marks_ptr + me * _MARKS + _MARK_WHOLE, volatile=True) == tag
    _fence_sys()
    for s in tl.static_range(W):
        tl.atomic_xchg(dev_marks_ptr + s * _MARKS + _MARK_WHOLE, tag, sem="release", scope="gpu")


@triton.jit
def begin_reads(marks_ptr, dev_marks_ptr, me, tag, timeout_ns, W: tl.constexpr,
                WATCHER: tl.constexpr):
    """The start of a reading kernel: with ``WATCHER`` 1 program 0 is the watcher (it returns
    when the round is wholly in) and the others read. Returns (the clock at the start, for the
    waits' deadline; the number of reading programs)."""
    start = _now_ns(WATCHER == 1)
    if WATCHER == 1:
        if (tl.program_id(0) == 0) & (tag != 0):
            watch(marks_ptr, dev_marks_ptr, me, tag, start, timeout_ns, W)
    return start, tl.num_programs(0) - WATCHER


@triton.jit
def await_mark(dev_marks_ptr, s, slot, tag, start, timeout_ns):
    """Spins (backing off) until source ``s``'s forwarded mark ``slot`` or its whole mark holds
    ``tag``, or the deadline."""
    base = dev_marks_ptr + s * _MARKS
    v = tl.load(base + slot, volatile=True)
    while (v != tag) & ((_now_ns(True) - start) <= timeout_ns):
        _backoff()
        v = tl.load(base + slot, volatile=True)
        v = tl.where(tl.load(base + _MARK_WHOLE, volatile=True) == tag, tag, v)
    _fence_gpu()


@triton.jit
def await_bytes(dev_marks_ptr, s, lo, hi, chunk_bytes, tag, start, timeout_ns):
    """Waits until bytes ``[lo, hi)`` of source ``s``'s first plane are in the window: the marks
    of the chunks they span, or the source's whole mark (for chunks past the marked ones)."""
    for c in range(lo // chunk_bytes, (hi - 1) // chunk_bytes + 1):
        await_mark(dev_marks_ptr, s, tl.where(c < _MARK_CHUNKS, c, _MARK_WHOLE), tag, start,
                   timeout_ns)
