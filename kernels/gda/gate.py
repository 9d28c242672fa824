"""The launch gate of ranks sharing one GPU, and the errors of a peer that never issued its
stores."""
from __future__ import annotations

import mmap
import os
import secrets
import time

import numpy as np

import torch.distributed as dist

from ..base import PeerFailure, TransportError


class PeerTimeoutError(PeerFailure):
    """A wait (device-side, or the host launch gate) passed its deadline: the named source
    rank(s) never signalled / never issued their stores."""


class PeerFailedError(PeerFailure):
    """An EP peer gave up (deadline, closed transport) before issuing this op's stores."""


class LaunchGate:
    """Host-side board of the ranks of one gda group on one host: which op each rank has issued
    its stores for, and which rank failed. Shared memory (a ``/dev/shm`` file, mapped by every
    rank, unlinked once all have mapped it), int64 slots ``[issued W | failed W]``.

    Why: a host call that needs the CUDA context idle (a module load on a kernel's first use,
    lazy loading of a library's kernel) waits for the process's own running kernels, a spinning
    wait included. If that wait needs a store that a peer has not issued, and the peer's host is
    held the same way, both stall until the deadline. A rank therefore launches a kernel that
    waits on sources only once every source has *issued* (enqueued) its stores for that op: the
    wait then depends only on kernels already in streams, which finish whatever the hosts do.
    The gate is a host wait for the peers' hosts (shared memory, microseconds when they are in
    step), not a device sync.

    ``failed[r]`` = ``epoch * 8 + kind`` of the op at which rank r gave up (-1: closed), so a
    waiting peer raises at once naming it instead of waiting out its own deadline.
    """

    def __init__(self, group, rank: int, world: int):
        token = [None]
        if rank == 0:
            token[0] = f"/dev/shm/efa_ep_gda_{os.getpid()}_{secrets.token_hex(8)}"
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        path = token[0]
        size = 16 * world
        if rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        dist.barrier(group=group)
        if rank != 0:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise TransportError(
                    f"rank {rank}: gda launch gate: cannot open {path} made by rank 0 ({e}); "
                    f"ranks sharing a GPU must share /dev/shm (same host and IPC namespace)")
        self._mm = mmap.mmap(fd, size)
        os.close(fd)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path)  # nothing left behind, even after a crash
        arr = np.frombuffer(self._mm, dtype=np.int64)
        self.issued, self.failed = arr[:world], arr[world:]
        # the hot path reads and writes through a memoryview: Python ints, no numpy per call
        self._slots = memoryview(self._mm).cast("q")
        self.rank, self.world = rank, world

    @property
    def address(self) -> int:
        """Address of the ``[world]`` int64 "issued" slots in this process (native callers
        publish and read them with atomic stores and loads)."""
        return self.issued.ctypes.data

    def publish(self, epoch: int) -> None:
        """This rank has enqueued its stores of op ``epoch`` (an aligned 8-byte store)."""
        self._slots[self.rank] = epoch

    def ready(self, epoch: int) -> bool:
        """Every rank has issued op ``epoch`` (no wait)."""
        return min(self._slots[:self.world]) >= epoch

    def fail(self, record: int) -> None:
        self.failed[self.rank] = record

    def wait(self, epoch: int, timeout_s: float, op: str) -> None:
        """Returns once every rank has issued op ``epoch``; raises naming the ranks otherwise."""
        issued, failed = self.issued, self.failed
        if self.ready(epoch):
            return
        deadline = time.monotonic() + timeout_s
        spins = 0
        while True:
            if self.ready(epoch):
                return
            if failed.any():
                gone = [int(r) for r in np.flatnonzero(failed)
                        if r != self.rank and issued[r] < epoch]
                if gone:
                    raise PeerFailedError(
                        f"rank {self.rank}: gda {op} (op {epoch}): EP peer rank(s) {gone} "
                        f"failed or closed their transport before this op (see their error)")
            spins += 1
            if spins > 2000:
                time.sleep(2e-5 if spins < 100000 else 1e-3)
            if time.monotonic() > deadline:
                missing = [int(r) for r in np.flatnonzero(issued < epoch)]
                raise PeerTimeoutError(
                    f"rank {self.rank}: gda {op} (op {epoch}) gave up after {timeout_s:g}s "
                    f"waiting for source rank(s) {missing}: they never issued their stores "
                    f"(crashed, hung, or skipped this collective call)")

    def close(self) -> None:
        if getattr(self, "_mm", None) is not None:
            self.issued = self.failed = None
            self._slots.release()
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None
