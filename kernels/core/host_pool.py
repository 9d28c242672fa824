"""Host output tensors whose memory is reused once the caller drops them.

Why: an operation on CPU rows returns new tensors (the received rows, a combine's sums). A
fresh allocation of a megabyte or more comes from the kernel (glibc maps it), so every call
first faults in and zeroes its pages, and every free returns them: on a 2-core host that costs
about as much as the operation's own copies (a decode dispatch + combine over the proxy: ~1 ms
of its ~3 ms host part). A pool keeps the blocks: a tensor handed out here lives on a pooled
block until the caller's last reference (views included) is gone, then the block goes back to
the pool for the next call. Nothing the caller holds is ever reused.

Small tensors (under :data:`MIN_POOLED_BYTES`) come from ``torch.empty``: the allocator's arenas
already reuse them. Memory held besides the outputs alive: at most :data:`MAX_FREE_PER_CLASS`
free blocks per power-of-two size class (a block is at most twice its output).
"""
from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Sequence

import numpy as np
import torch

#: outputs smaller than this are plain ``torch.empty`` tensors
MIN_POOLED_BYTES = 256 * 1024
#: blocks kept per size class (more free blocks than this go back to the system)
MAX_FREE_PER_CLASS = 4
_ALIGN = 64


def _size_class(nbytes: int) -> int:
    """Bytes of the block that holds ``nbytes``: the next power of two (at most 2x waste)."""
    return 1 << (int(nbytes) - 1).bit_length()


class HostOutputPool:
    """CPU output tensors on reused blocks (see the module).

    Thread safety: :meth:`empty` may be called from one thread at a time per pool; blocks come
    back from whichever thread drops the last reference (guarded by a lock).
    """

    def __init__(self):
        self._free: Dict[int, List[np.ndarray]] = {}
        # reentrant: a collection inside empty() may drop the last view of an output, whose
        # finalizer gives its block back on this thread
        self._lock = threading.RLock()
        self.blocks_made = 0   # blocks allocated from the system (each faults its pages once)
        self.reused = 0        # outputs placed on a block that came back

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor of ``shape`` and ``dtype``, 64-byte aligned."""
        shape = tuple(int(s) for s in shape)
        count = 1
        for s in shape:
            count *= s
        nbytes = count * dtype.itemsize
        if nbytes < MIN_POOLED_BYTES:
            return torch.empty(shape, dtype=dtype)
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            block = free.pop() if free else None
        if block is None:
            raw = np.empty(size + _ALIGN, dtype=np.uint8)
            start = (-raw.ctypes.data) % _ALIGN
            block = raw[start:start + size]
            self.blocks_made += 1
        else:
            self.reused += 1
        view = block[:nbytes]  # its own object: it dies with the tensor's last reference
        out = torch.frombuffer(view, dtype=dtype, count=count).view(shape)
        done = weakref.finalize(view, self._give_back, size, block)
        done.atexit = False
        return out

    def _give_back(self, size: int, block: np.ndarray) -> None:
        with self._lock:
            free = self._free.setdefault(size, [])
            if len(free) < MAX_FREE_PER_CLASS:
                free.append(block)
