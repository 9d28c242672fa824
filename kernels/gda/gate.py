"""The launch gate of ranks sharing one GPU, and the errors of a peer that never issued its
stores."""
from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import time

import numpy as np

import torch.distributed as dist

from ..base import PeerFailure, ProtocolError, TransportError

#: the kind of each op, as recorded on the launch gate and in the device error word
OP_KINDS = {1: "dispatch", 2: "combine", 3: "cached dispatch", 4: "weight combine",
            5: "dispatch counts"}
KIND_OF = {v: k for k, v in OP_KINDS.items()}
#: bit of the error word ``err[0]`` set by the header read of a compact dispatch
#: (``rows_in_window``) when a source (its bit in ``err[3]``) stored other rows than it announced,
#: or not where the announced counts of the ranks before it put them
ROWS_MISPLACED = 1 << 61


def wait_record(epoch: int, kind: str) -> int:
    """``epoch * 8 + kind``: op ``epoch`` and its kind in one int64 (gate slots, error word)."""
    return epoch * 8 + KIND_OF[kind]


class PeerTimeoutError(PeerFailure):
    """A wait (device-side, or the host launch gate) passed its deadline: the named source
    rank(s) never signalled / never issued their stores."""


class PeerFailedError(PeerFailure):
    """An EP peer gave up (deadline, closed transport) before issuing this op's stores."""


def _agreed(slots, record: int) -> bool:
    """Every slot holds ``record`` or a later op's record (that rank passed this gate)."""
    nxt = (record | 7) + 1
    return all(v == record or v >= nxt for v in slots)


#: bytes of one rank's error text slot on the board (stamp, length, text)
TEXT_SLOT_BYTES = 1024
#: how long one native call waits for the peers at the launch gate before the transport's own
#: wait (deadline, failed peers) takes over; ranks in step publish within microseconds
GATE_SPIN_NS = 200_000


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

    Bad input travels on the same board, so every rank raises the same error with the offending
    rank's own words: ``bad[e % 2] = e`` when some rank refused op ``e`` (written before that
    rank publishes ``e``, so a peer past the gate of ``e`` sees it), and per rank and parity a
    text slot ``[stamp int64 | length int64 | utf-8 bytes]`` stamped with the op. Parity
    suffices because no rank gets two ops ahead of a peer: passing the gate of ``e + 1`` needs
    every peer to have published ``e + 1``, which each does only after reading op ``e``'s board.
    Dispatch sizes travel on it too, for option ``rows_in_window=auto``: before publishing
    regular dispatch ``c`` (counted from 1 on every rank, the same everywhere) a rank posts
    ``[c, rows it sends at most]`` into its slot ``c % 2``; at dispatch ``c + 1`` every rank
    reads the slots of ``c`` (every rank published ``c``'s op before this rank passed its gate,
    and none can post ``c + 2`` before this rank publishes ``c + 1``), so all take the same
    largest size, and so the same way of storing the rows. The C++ dispatch makes the same
    choice with the same count (:meth:`choice_block`), so either may post a dispatch's size.
    Layout: int64 ``[issued W | failed W | bad 2]``, then from the next 64-byte boundary per
    parity ``[stamp, size] x W`` (each parity 64-byte aligned), then ``2 W`` text slots of
    :data:`TEXT_SLOT_BYTES`.
    """

    def __init__(self, group, rank: int, world: int):
        token = [None]
        if rank == 0:
            token[0] = f"/dev/shm/efa_ep_gda_{os.getpid()}_{secrets.token_hex(8)}"
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        path = token[0]
        size = self.board_bytes(world)
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
        mm = mmap.mmap(fd, size)
        os.close(fd)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path)  # nothing left behind, even after a crash
        self._attach(mm, rank, world)

    @staticmethod
    def _sizes_words(world: int):
        """(first int64 word of the parity 0 sizes, words per parity): the sizes of one parity
        together, on cache lines of their own: a dispatch reads every rank's (a line a peer
        wrote) and writes its own, away from the spun-on issued slots."""
        return -(-(2 * world + 2) // 8) * 8, -(-(2 * world) // 8) * 8

    @classmethod
    def board_bytes(cls, world: int) -> int:
        """Bytes of the board of ``world`` ranks (see the class)."""
        sizes, block = cls._sizes_words(world)
        return 8 * (sizes + 2 * block) + 2 * world * TEXT_SLOT_BYTES

    def _attach(self, mm, rank: int, world: int) -> None:
        """Takes ``mm`` (:meth:`board_bytes`, shared by the ranks) as this rank's board."""
        sizes, block = self._sizes_words(world)
        self._size_base = (sizes, sizes + block)  # per parity
        self._text_off = 8 * (sizes + 2 * block)
        self._mm = mm
        arr = np.frombuffer(mm, dtype=np.int64, count=2 * world + 2)
        self.issued, self.failed = arr[:world], arr[world:2 * world]
        self._address = self.issued.ctypes.data  # read per op: numpy's .ctypes costs microseconds
        # the hot path reads and writes through a memoryview: Python ints, no numpy per call
        self._slots = memoryview(mm).cast("q")
        self.rank, self.world = rank, world
        # regular dispatches posted (next_dispatch), then what the C++ dispatch's choice reads
        # (choice_block): the sizes' addresses per parity (from the board's first byte), world,
        # rank, threshold
        base = self._address
        self._choice = (ctypes.c_int64 * 6)(0, base + 8 * sizes, base + 8 * (sizes + block),
                                            world, rank, 0)

    @property
    def address(self) -> int:
        """Address of the ``[world]`` int64 "issued" slots in this process (native callers
        publish and read them with atomic stores and loads)."""
        return self._address

    def publish(self, record: int) -> None:
        """This rank has enqueued its stores of op ``record // 8`` of kind ``record % 8``
        (:func:`wait_record`; an aligned 8-byte store)."""
        self._slots[self.rank] = record

    def passed(self, record: int) -> bool:
        """Every rank has issued this op with the same kind (or is past it: it agreed). No
        wait."""
        return _agreed(self._slots[:self.world], record)

    def fail(self, record: int) -> None:
        self.failed[self.rank] = record

    def mark_bad(self, epoch: int, text: str) -> None:
        """This rank refuses op ``epoch`` with ``text`` (its own words): posts the text, then
        the group's bad flag of the op. Call before publishing ``epoch``."""
        self.post_text(epoch, text)
        self._slots[2 * self.world + epoch % 2] = epoch

    def bad_at(self, epoch: int) -> bool:
        """Some rank refused op ``epoch`` (valid once past the gate of ``epoch``)."""
        return self._slots[2 * self.world + epoch % 2] == epoch

    def next_dispatch(self, rows: int) -> int:
        """Posts ``rows``, this rank's size for its next regular dispatch (counted from 1 on
        every rank), and returns the largest size the ranks posted for the previous one, or -1
        (the first dispatch, or a slot that holds another dispatch's size: the ranks did not
        make the same calls). Call before publishing that dispatch's first op. (Hot path:
        Python ints and one read of the slots' line.)"""
        count = self._choice[0] + 1
        self._choice[0] = count
        slots, largest = self._slots, -1
        if count > 1:
            base = self._size_base[(count - 1) & 1]
            words = slots[base:base + 2 * self.world].tolist()
            if words[0::2].count(count - 1) == self.world:
                largest = max(words[1::2])
        i = self._size_base[count & 1] + 2 * self.rank
        slots[i + 1] = rows
        slots[i] = count  # the stamp last
        return largest

    def choice_block(self, threshold_rows: int) -> int:
        """Address of the int64 block ``[count, address of the parity 0 sizes, of parity 1,
        world, rank, threshold_rows]`` with which the C++ dispatch makes :meth:`next_dispatch`'s
        post and choice itself (compact when the largest size reaches ``threshold_rows``)
        sharing this gate's count of dispatches. Kept alive by the gate."""
        self._choice[5] = threshold_rows
        return ctypes.addressof(self._choice)

    @property
    def dispatches_posted(self) -> int:
        """Regular dispatches whose size this rank posted (from Python or the C++ dispatch)."""
        return self._choice[0]

    def post_text(self, epoch: int, text: str) -> None:
        """Posts this rank's error text for op ``epoch`` (cut to fit the slot)."""
        data = text.encode("utf-8", "replace")[:TEXT_SLOT_BYTES - 16]
        off = self._text_off + (2 * self.rank + epoch % 2) * TEXT_SLOT_BYTES
        words = memoryview(self._mm)[off:off + TEXT_SLOT_BYTES]
        try:
            words[16:16 + len(data)] = data
            stamp = words[:16].cast("q")
            stamp[1] = len(data)
            stamp[0] = epoch  # last: a reader that sees the stamp sees the text
            stamp.release()
        finally:
            words.release()

    def text_of(self, rank: int, epoch: int, timeout_s: float) -> "str | None":
        """Rank ``rank``'s posted text for op ``epoch``, waiting up to ``timeout_s`` for it
        (None if it never comes: that rank died or gave up first)."""
        off = self._text_off + (2 * rank + epoch % 2) * TEXT_SLOT_BYTES
        deadline = time.monotonic() + timeout_s
        words = memoryview(self._mm)[off:off + TEXT_SLOT_BYTES]
        stamp = words[:16].cast("q")
        try:
            while stamp[0] != epoch:
                if self.failed[rank] != 0 or time.monotonic() > deadline:
                    return None
                time.sleep(2e-5)
            n = min(max(int(stamp[1]), 0), TEXT_SLOT_BYTES - 16)  # the peer's length: bound it
            return bytes(words[16:16 + n]).decode("utf-8", "replace")
        finally:
            stamp.release()
            words.release()

    def wait(self, record: int, timeout_s: float, op: str) -> None:
        """Returns once every rank has issued op ``record`` (:meth:`passed`); raises naming the
        ranks otherwise: :class:`PeerFailedError` when one gave up, :class:`PeerTimeoutError` at
        the deadline, :class:`ProtocolError` (the same words on every rank) when every rank
        issued the op but not all the same kind of op."""
        if self.passed(record):
            return
        epoch = record // 8
        issued, failed = self.issued, self.failed
        deadline = time.monotonic() + timeout_s
        spins = 0
        while True:
            seen = self._slots[:self.world].tolist()  # one snapshot for both decisions
            if _agreed(seen, record):
                return
            if min(seen) >= epoch * 8:  # all issued this op, not all the same kind
                raise ProtocolError(self._disagreement(epoch, seen))
            if failed.any():
                gone = [int(r) for r in np.flatnonzero(failed)
                        if r != self.rank and issued[r] < epoch * 8]
                if gone:
                    raise PeerFailedError(
                        f"rank {self.rank}: gda {op} (op {epoch}): EP peer rank(s) {gone} "
                        f"failed or closed their transport before this op (see their error)")
            spins += 1
            if spins > 2000:
                time.sleep(2e-5 if spins < 100000 else 1e-3)
            if time.monotonic() > deadline:
                missing = [int(r) for r in np.flatnonzero(issued < epoch * 8)]
                raise PeerTimeoutError(
                    f"rank {self.rank}: gda {op} (op {epoch}) gave up after {timeout_s:g}s "
                    f"waiting for source rank(s) {missing}: they never issued their stores "
                    f"(crashed, hung, or skipped this collective call)")

    @staticmethod
    def _disagreement(epoch: int, seen) -> str:
        """The words every rank raises when the ranks issued different kinds of op ``epoch``
        (no rank names itself, so the text is the same everywhere)."""
        by_kind: dict = {}
        for r, v in enumerate(seen):
            if v // 8 == epoch:
                by_kind.setdefault(OP_KINDS.get(v % 8, f"op kind {v % 8}"), []).append(r)
        calls = ", ".join(f"{kind} on rank(s) {ranks}" for kind, ranks in sorted(by_kind.items()))
        return (f"gda op {epoch}: the EP ranks called different operations ({calls}); every "
                f"rank must make the same sequence of dispatch / combine calls")

    def close(self) -> None:
        if getattr(self, "_mm", None) is not None:
            self._choice[1] = self._choice[2] = 0  # (the C++ choice then reads no board)
            self.issued = self.failed = None
            self._slots.release()
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None
