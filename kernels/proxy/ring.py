"""Command rings: the producers that hand 16-byte descriptors to the native channel threads.

A message (bytes at a local window offset, to a peer's window offset) is cut into ``chunk_bytes``
chunks; every chunk becomes one descriptor (``efa_proxy.h``: ``w0 = dest << 52 | msg << 32 |
length``, ``w1 = local_off/16 << 32 | remote_off/16``) in channel ``c``'s ring, and the ring's tail
is published with a release store; the channel thread acquires the tail before reading. Two
producers write the same words: host code (:meth:`Rings.push`) and, for GPU inputs, a Triton
kernel that stores into the pinned ring (:meth:`Rings.push_triton`). The host path of a round
hands whole messages to native code (:meth:`Rings.post`), which cuts and writes the descriptors:
no per-chunk (or per-message) work in Python. Each ring's tail lives only in its control word
(the producer is its only writer), so every producer continues where the others stopped.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..base import ceil_div, error_for_errno
from . import native


def native_call(fn, *args):
    """Calls a native wrapper; its NativeError (message from C: verb, peer, message) becomes
    the contract's error kind (:func:`~efa_ep.kernels.base.error_for_errno`: a deadline or lost
    peer is a PeerFailure)."""
    try:
        return fn(*args)
    except native.NativeError as ex:
        raise error_for_errno(ex.code, str(ex)) from ex


def describe_messages(dest, local_off, remote_off, nbytes, msg: int, chunk_bytes: int) -> torch.Tensor:
    """Cuts messages into chunks and encodes one 16-byte descriptor per chunk (reference for the
    Triton producer).

    Args:
        dest, local_off, remote_off, nbytes: ``[M]`` int64 CPU, one entry per message; offsets are
            16-byte aligned window offsets, nbytes > 0.
        msg: message id (its low 8 bits are sent; the descriptor's chunk-mark bits stay 0: no
            chunk marks from this producer). chunk_bytes: multiple of 16.
    Returns:
        ``[D, 2]`` int64 CPU descriptor words (see efa_proxy.h), chunks in message order.
    """
    nch = ceil_div(nbytes, chunk_bytes)
    total = int(nch.sum())
    if total == 0:
        return torch.empty(0, 2, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(nch)), nch)
    first = torch.cumsum(nch, 0) - nch
    k = torch.arange(total) - first[owner]
    off = k * chunk_bytes
    length = torch.minimum(nbytes[owner] - off, torch.full_like(off, chunk_bytes))
    w0 = (dest[owner] << 52) | ((msg & native.IMM_MSG_MASK) << 32) | length
    w1 = (((local_off[owner] + off) >> 4) << 32) | ((remote_off[owner] + off) >> 4)
    return torch.stack([w0, w1], 1)


_TRITON = None


def triton_producer():
    """Builds (once) the Triton descriptor producer; None when triton is missing."""
    global _TRITON
    if _TRITON is not None:
        return _TRITON or None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _TRITON = False
        return None

    # Protocol: the producer writes descriptor words into ring slots [tail0, tail0 + n) of pinned
    # host memory with plain stores, and a second launch on the same stream publishes the new tail
    # with a system-scope release exchange; the channel thread acquires the tail before reading.
    @triton.jit(do_not_specialize=["tail0", "msg", "chunk_bytes", "ring_slots"])
    def _describe_to_ring_kernel(dest_ptr, loff_ptr, roff_ptr, nbytes_ptr, first_ptr, ring_ptr,
                                 tail0, msg, chunk_bytes, ring_slots, BLOCK: tl.constexpr):
        # One program per message: its k-th chunk becomes descriptor slot tail0 + first + k.
        # Example: nbytes=40, chunk_bytes=16 -> lengths 16, 16, 8 at offsets 0, 16, 32.
        i = tl.program_id(0)
        dest = tl.load(dest_ptr + i).to(tl.int64)
        loff = tl.load(loff_ptr + i).to(tl.int64)
        roff = tl.load(roff_ptr + i).to(tl.int64)
        nbytes = tl.load(nbytes_ptr + i).to(tl.int64)
        first = tl.load(first_ptr + i).to(tl.int64)
        cb = chunk_bytes.to(tl.int64)
        nch = (nbytes + cb - 1) // cb
        for k0 in range(0, nch, BLOCK):
            k = k0 + tl.arange(0, BLOCK).to(tl.int64)
            m = k < nch
            off = k * cb
            length = tl.minimum(nbytes - off, cb)
            w0 = (dest << 52) | ((msg.to(tl.int64) & 0xFF) << 32) | length  # (no chunk mark)
            w1 = (((loff + off) >> 4) << 32) | ((roff + off) >> 4)
            slot = (tail0.to(tl.int64) + first + k) % ring_slots
            tl.store(ring_ptr + slot * 2, w0, mask=m)
            tl.store(ring_ptr + slot * 2 + 1, w1, mask=m)

    @triton.jit(do_not_specialize=["new_tail"])
    def _publish_tail_kernel(tail_ptr, new_tail):
        tl.atomic_xchg(tail_ptr, new_tail.to(tl.int64), sem="release", scope="sys")

    _TRITON = (_describe_to_ring_kernel, _publish_tail_kernel)
    return _TRITON


class HostPtr:
    """A pinned host buffer handed to Triton as a raw pointer (UVA: the GPU can store into it)."""

    def __init__(self, t: torch.Tensor, offset_elems: int = 0):
        self._ptr = t.data_ptr() + offset_elems * t.element_size()
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._ptr


class Rings:
    """C command rings (C = num_channels) and their control words (caller memory the engine reads), plus the
    producer-side state: each ring's tail and the channel the next message starts on.

    Args:
        num_channels: C. ring_slots: descriptors per ring. pin: page-lock (a GPU producer
            stores into them). The engine is attached after it starts (:meth:`attach`).
    """

    def __init__(self, num_channels: int, ring_slots: int, pin: bool):
        self.num_channels = num_channels
        self.ring_slots = ring_slots
        self.rings = torch.zeros(num_channels, ring_slots, 2, dtype=torch.int64, pin_memory=pin)
        self.ring_ctrl = torch.zeros(num_channels, native.CTRL_STRIDE, dtype=torch.int64, pin_memory=pin)
        self._ctrl_np = self.ring_ctrl.numpy()
        # channel of the next descriptor, shared by every producer (native code updates it)
        self._next_channel = np.zeros(1, dtype=np.uint32)
        self._next_channel_ptr = self._next_channel.ctypes.data
        self.engine = None
        self.timeout_ms = 0

    def attach(self, engine, timeout_ms: int) -> None:
        self.engine = engine
        self.timeout_ms = timeout_ms

    @property
    def next_channel(self) -> int:
        return int(self._next_channel[0])

    @next_channel.setter
    def next_channel(self, c: int) -> None:
        self._next_channel[0] = c

    def tail(self, c: int) -> int:
        """Ring c's tail (exact: producers are the only writers, one operation at a time)."""
        return int(self._ctrl_np[c, native.CTRL_TAIL])

    def post(self, msg: int, dests: np.ndarray, local_offs: np.ndarray, remote_offs: np.ndarray,
             sizes: np.ndarray, chunk_bytes: int) -> None:
        """Posts whole messages (``[M]`` int64 contiguous arrays each): native code cuts them
        into chunks, chunk j to channel (r + j) % C as :meth:`push`, and publishes the tails."""
        n = len(dests)
        if n == 0:
            return
        native_call(self.engine.post_messages, msg, n, dests.ctypes.data, local_offs.ctypes.data,
                    remote_offs.ctypes.data, sizes.ctypes.data, chunk_bytes,
                    self._next_channel_ptr, self.timeout_ms)

    def push(self, descs: torch.Tensor) -> None:
        """Writes descriptors ``[D, 2]`` int64 into the rings (descriptor j -> channel (j + r) % C,
        r rotating per call so small messages spread over channels) and publishes each tail."""
        n = descs.shape[0]
        if n == 0:
            return
        nc = self.num_channels
        start = self.next_channel
        self.next_channel = (start + n) % nc
        for j in range(min(nc, n)):
            self.push_channel((start + j) % nc, descs[j::nc])

    def push_channel(self, c: int, mine: torch.Tensor) -> None:
        """Torch code writes descriptors into ring c's slots (wrapping), then publishes the tail
        with a release store (native call); waits for free slots first (back-pressure)."""
        done = 0
        while done < mine.shape[0]:
            cnt = min(mine.shape[0] - done, self.ring_slots)
            native_call(self.engine.ring_wait_space, c, cnt, self.timeout_ms)
            tail = self.tail(c)
            s0 = tail % self.ring_slots
            first = min(cnt, self.ring_slots - s0)
            self.rings[c, s0:s0 + first].copy_(mine[done:done + first])
            if cnt > first:  # wrap around
                self.rings[c, :cnt - first].copy_(mine[done + first:done + cnt])
            self.engine.ring_publish(c, tail + cnt)
            done += cnt

    def push_triton(self, dests, loffs, roffs, sizes, msg: int, chunk_bytes: int,
                    dev: torch.device) -> None:
        """GPU producer: message m goes to channel (r + m) % C; per channel one launch writes every
        chunk's descriptor into the pinned ring, a second publishes the tail (release, sys)."""
        describe, publish = triton_producer()
        nc = self.num_channels
        start = self.next_channel
        self.next_channel = (start + len(dests)) % nc
        for j in range(min(nc, len(dests))):
            c = (start + j) % nc
            sel = slice(j, None, nc)
            nb = torch.tensor(sizes[sel], dtype=torch.int64)
            nch = ceil_div(nb, chunk_bytes)
            total = int(nch.sum())
            if total > self.ring_slots:  # more than the ring holds: the host path handles it
                self.push_channel(c, describe_messages(
                    torch.tensor(dests[sel]), torch.tensor(loffs[sel]), torch.tensor(roffs[sel]),
                    nb, msg, chunk_bytes))
                continue
            first = torch.cumsum(nch, 0) - nch
            table = torch.stack([torch.tensor(dests[sel]), torch.tensor(loffs[sel]),
                                 torch.tensor(roffs[sel]), nb, first]).to(dev)
            native_call(self.engine.ring_wait_space, c, total, self.timeout_ms)  # back-pressure
            tail = self.tail(c)
            # Under TRITON_INTERPRET (CPU tests) the kernel needs tensors (it copies them back);
            # on a GPU it gets the raw pinned-host address.
            interp = os.environ.get("TRITON_INTERPRET") == "1"
            ring = self.rings[c] if interp else HostPtr(self.rings[c])
            tail_word = self.ring_ctrl[c, native.CTRL_TAIL:native.CTRL_TAIL + 1]
            describe[(table.shape[1],)](table[0], table[1], table[2], table[3], table[4], ring, tail,
                                        msg, chunk_bytes, self.ring_slots, BLOCK=64)
            publish[(1,)](tail_word if interp else HostPtr(tail_word), tail + total)
        # every channel appears once above; later readers of the tails (any producer) need the
        # kernels' stores
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
