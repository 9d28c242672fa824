"""The ``gda`` transport: GPU-initiated dispatch and combine through symmetric-memory windows.

The GPU moves every byte: Triton kernels store token rows straight into the peers' receive
windows (torch symmetric memory, CUDA backend: NVLink peers of one host, or several ranks as
processes on one GPU) and raise per-source flags; no CPU on the data path. Kernels and the flag
protocol: :mod:`efa_ep.kernels.gda_kernels` (read its module docstring first).

Symbols: W ranks, T tokens here, K top-k, E experts, L = E // W, H hidden, D row width,
T_MAX = ``max_tokens_per_rank``, N rows received, S rows sent.

Windows (allocated once per transport, collective, reused by every call):
    One ``symm_mem.empty`` byte buffer per rank holding two parities of
    ``data [W, T_MAX, H * elem bytes] | idx [W, T_MAX, K_CAP] int64 | wts [W, T_MAX, K_CAP] f32 |
    hdr [W, 2 + L] int64``, each region 256-byte aligned; ``K_CAP`` = option ``max_topk``
    (default 16). Bytes per rank ~= 2 * W * T_MAX * (H * elem + 12 * K_CAP). Op ``e`` uses parity
    ``e % 2`` for every window kind (data of dispatch, returned rows of combine), which is what
    lets windows be reused with no resets and no extra acknowledgement (protocol step 5).

One dispatch (collective, current stream; kernels in order):
    1. host: shape/dtype/capacity checks (no sync). An overflow (T > T_MAX, K > K_CAP, rows wider
       than the window) raises here, before any byte moves, on the offending rank; it still
       takes part in the count exchange with ``status`` set, so its peers raise too instead of
       timing out.
    2. ``layout`` (2 launches over token blocks): slot of every (token, destination), rows per
       destination, (token, expert) pairs per expert, value checks (bad ids, NaN weights).
    3. ``dispatch_store``: every token row stored once per destination rank at
       ``window[me * T_MAX + slot]`` of that rank (16-byte stores), with its local expert ids and
       weights; program 0 also writes the count header ``[status, rows, rows per local expert]``
       into every destination (the count exchange); the grid's last program raises the
       per-source signal (release, system scope).
    4. ``recv_header`` (1 program): waits (acquire, bounded) for all W sources, gathers headers
       and the error word into one small tensor; the host copies it: **the one host sync per
       dispatch** (Megatron needs ``tokens_per_expert`` on the CPU, as in its alltoall dispatcher).
    5. ``gather_rows``: the receive permutation, window -> compact ``recv_x [N, H]`` in
       (source, token) order, with ids and weights.
Combine: ``combine_store`` returns row i to its source's window at ``me * T_MAX + j`` and signals;
a one-program wait kernel waits (bounded) for every source; ``combine_reduce`` then sums the
partials in ascending rank order in float32 from +0.0, rounding once: bit-equal to ``torch``.
No host sync; a deadline expiry is recorded in the error word and raised at the next dispatch
(or by :meth:`GdaTransport.check_errors` / ``after_backward``, or at once with option
``check_every_call=1``). ``dispatch_cached`` replays the layout with new rows, no host sync.

Never stuck, never silently wrong:
    * The stall this design prevents (4 ranks as MPS clients of one H200, every run before
      it): a combine wait spun until its deadline for a store its peer had not issued, every
      rank's host sat in Triton's module load, and the reduce then summed without that peer's
      rows. Measured since (``scripts/gda_stall_probe.py``): a module load waits for the
      process's *own* running kernels (1.7 s behind a 2 s spin; 0.3 ms idle), so a rank whose
      wait spins cannot issue anything until that wait ends. A wait must therefore only ever
      wait for stores already in the peers' streams. Hence the **launch gate**: a rank launches
      a waiting kernel only after every source has *issued* (enqueued) the op's stores, told
      through a host shared-memory board (:class:`LaunchGate`, on by default when ranks share a
      GPU, where the ranks also compete for SMs). A wait then depends only on kernels already in
      streams, which complete whatever the hosts do; a peer that never issues is found on the
      host, within ``timeout_s``, and named. Pre-loading kernels is not enough: any library may
      load a module or allocate between two ops.
    * Waits run in one-program kernels, so a spinning wait holds one program slot, never the SMs
      a peer's store on the same GPU needs (full-width spinning grids starved them).
    * An expired wait records the op (number and kind: dispatch, combine, cached dispatch,
      weight combine) and the missing sources in the error word; every later gather/reduce of
      the transport writes NaN rows, so no output looks valid; the host raises
      :class:`PeerTimeoutError` naming the op, its kind, the waiting rank and the missing ranks
      at the next dispatch, ``check_errors`` or ``after_backward``. After any deadline or peer
      failure the transport refuses further calls on every rank that sees it (the group's
      epochs no longer agree): rebuild it. Bad inputs to combine / cached dispatch make every
      rank raise naming the offending rank (through the gate; without it the peers' waits
      expire as above).

Fixed-capacity mode (:meth:`GdaTransport.dispatch_fixed`; inference and decode):
    no host sync and no receive copy: the layout, store and a one-program fixed receive
    (``recv_header_fixed``: counts into device tensors, unused rows of the window marked with
    ids -1 / weights 0) and then the returned ``recv_x [W * T_MAX, H]`` *is* the window; every
    launch has a grid fixed by T and T_MAX. ``combine`` with its handle takes ``y`` in the same
    layout and returns only rows ``j < n_s`` (counts read on the device). The views are
    overwritten two ops later (window parity): hold at most one fixed dispatch result while its
    combine runs, as in DeepEP's low-latency mode; training keeps the regular ``dispatch``
    (activations saved for backward must outlive that).

CUDA graphs (:meth:`GdaTransport.capture`, :class:`GdaGraph`): fixed-capacity ops have static
grids and no host sync, so a sequence of them is captured once and replayed with one host
call (decode D+C on one H200: ~7 us of host time instead of ~500). Kernels take op numbers as
``op_base[0] + delta`` with the base on the device; the graph's last node advances it, and a
replay first moves it past any eager call made since (and restores the window parity with a
barrier op when needed), so graphs and eager calls interleave freely.
"""
from __future__ import annotations

import dataclasses
import importlib
import mmap
import os
import secrets
import socket
import time
from typing import Optional

import numpy as np

import torch
import torch.distributed as dist

from .base import (
    STATUS_BAD_INPUT, STATUS_OK, DispatchHandle, DispatchInputError, HandleState, PeerFailure,
    ProtocolError, Transport, TransportBroken,
    TransportError, TransportUnavailable, align_up, describe_status, group_input_error,
    rows_input_error, validate_dispatch_inputs,
)

_ALIGN = 256      # bytes: every region of the window starts at a multiple of this
_MAX_WORLD = 62   # the error word is a 64-bit mask of missing sources; bit 62: bad input seen
_BAD_INPUT_BIT = 1 << 62


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


def availability() -> Optional[str]:
    """None when gda can run here (CUDA GPU, triton, torch symmetric memory), else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        return f"torch symmetric memory is unavailable ({e})"
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    return None


@dataclasses.dataclass(frozen=True)
class WindowLayout:
    """Byte layout of one rank's window (see the module docstring).

    Attributes:
        world: W. t_max: T_MAX rows per source. row_bytes: capacity of one row in bytes.
        k_cap: K_CAP top-k slots per row. num_local: L (header length is 2 + L).
    """

    world: int
    t_max: int
    row_bytes: int
    k_cap: int
    num_local: int

    @property
    def rows(self) -> int:
        return self.world * max(1, self.t_max)

    @property
    def data_bytes(self) -> int:
        return align_up(self.rows * self.row_bytes, _ALIGN)

    @property
    def idx_bytes(self) -> int:
        return align_up(self.rows * self.k_cap * 8, _ALIGN)

    @property
    def w_bytes(self) -> int:
        return align_up(self.rows * self.k_cap * 4, _ALIGN)

    @property
    def hdr_len(self) -> int:
        return 2 + self.num_local

    @property
    def hdr_bytes(self) -> int:
        return align_up(self.world * self.hdr_len * 8, _ALIGN)

    @property
    def parity_bytes(self) -> int:
        return self.data_bytes + self.idx_bytes + self.w_bytes + self.hdr_bytes

    @property
    def total_bytes(self) -> int:
        return 2 * self.parity_bytes

    def offsets(self, parity: int) -> dict:
        """Byte offsets of the regions of parity 0 or 1."""
        base = parity * self.parity_bytes
        return dict(data_off=base, idx_off=base + self.data_bytes,
                    w_off=base + self.data_bytes + self.idx_bytes,
                    hdr_off=base + self.data_bytes + self.idx_bytes + self.w_bytes)


@dataclasses.dataclass(frozen=True)
class GdaDispatchState(HandleState):
    """``DispatchHandle.state`` of a gda dispatch.

    Attributes:
        owner: the transport object that made it (:class:`~efa_ep.kernels.base.HandleState`).
        slot_TW: ``[T, W]`` int64, device: row of (token, rank) in rank's block, -1 = not sent.
        recv_offsets: ``[W + 1]`` int64, device: first received row of each source (None for a
            fixed-capacity dispatch).
        epoch: the dispatch's op number.
        fixed: made by :meth:`GdaTransport.dispatch_fixed`; then ``num_recv_W`` ``[W]`` int64,
            device: rows received from each source (rows ``s * T_MAX + j``, ``j < n_s``).
    """

    slot_TW: torch.Tensor
    recv_offsets: Optional[torch.Tensor]
    epoch: int
    fixed: bool = False
    num_recv_W: Optional[torch.Tensor] = None


class GdaTransport(Transport):
    """GPU-initiated transport over symmetric-memory windows; contract in ``efa_ep.kernels.base``.

    Options (``create_transport(..., **options)``, identical on every rank):
        max_topk: K_CAP, most top-k slots a dispatch may carry (default 16).
        timeout_s: deadline of every device-side wait (default 60).
        num_programs: grid of the store/gather kernels (default 2 x SMs / ranks sharing the GPU).
        check_every_call: 1 = sync after combine/dispatch_cached to raise deadline errors at
            once (default 0: raised at the next dispatch, by :meth:`check_errors`, or by
            :meth:`after_backward`).
        check_backward: 1 (default) = :meth:`after_backward` syncs once per layer backward and
            raises deferred deadline errors before the gradients are used; 0 = defer.
        launch_gate: ``auto`` (default: on when ranks share a GPU), ``on`` or ``off``. With it a
            rank launches a waiting kernel only after every source has issued its stores for
            the op (host shared memory, see :class:`LaunchGate`); needed for ranks sharing one
            CUDA context (MPS), where a spinning wait can block a peer's module load.
        fast_launch: 2 (default) = the kernels of each op phase in one native call
            (:mod:`efa_ep.kernels.native_launch`; where the driver cannot, 1, with the reason in
            ``native_launch_off``); 1 = each kernel through its compiled launcher, skipping
            Triton's per-call Python (:mod:`efa_ep.kernels.launch`); 0 = Triton's own launch
            path. Same kernels and results on every path; ``launch_path`` says which runs.

    Host time: ``blocked_s`` accumulates the seconds this transport's calls spent blocked on
    the device (the dispatch's count read) or on peers' hosts (the launch gate); a call's wall
    time minus its growth of ``blocked_s`` is the host time the call itself costs.

    Synchronization: all kernels run on the current stream. ``dispatch`` blocks the CPU once
    (device-to-host copy of the counts), so it is not CUDA-graph capturable; ``combine`` and
    ``dispatch_cached`` do not block. Calls are collective: every rank must make the same
    sequence of calls.

    Warning: all calls of one transport must be issued on one stream (the flag protocol relies
    on stream order between consecutive ops).
    """

    name = "gda"
    state_type = GdaDispatchState

    def __init__(self, cfg, group):
        super().__init__(cfg, group)
        why = availability()
        if why is not None:
            raise TransportUnavailable(f"rank {self.rank}: gda is not available: {why}")
        if self.world_size > _MAX_WORLD:
            raise TransportError(f"gda supports up to {_MAX_WORLD} ranks, got {self.world_size}")
        from . import gda_kernels  # triton import stays lazy
        from .gda_phases import GdaPhases
        symm_mem = importlib.import_module("torch.distributed._symmetric_memory")

        self._kern = gda_kernels
        opts = dict(cfg.options)
        self.max_topk = int(opts.get("max_topk", 16))
        self.timeout_s = float(opts.get("timeout_s", 60.0))
        self.check_every_call = bool(int(opts.get("check_every_call", 0)))
        # after_backward(): one host sync per layer backward that raises deferred deadline
        # errors before the optimizer can use the gradients (0 = defer to the next dispatch)
        self.check_backward = bool(int(opts.get("check_backward", 1)))
        self.fast_launch = int(opts.get("fast_launch", 2))
        self.blocked_s = 0.0
        gate = str(opts.get("launch_gate", "auto")).lower()
        if gate not in ("auto", "0", "1", "on", "off"):
            raise TransportError(f"rank {self.rank}: gda option launch_gate must be auto, on or "
                                 f"off, got {gate!r}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(self.device)
        me = (socket.gethostname(), str(getattr(props, "uuid", self.device.index)))
        peers = [None] * self.world_size
        dist.all_gather_object(peers, me, group=group)
        hosts = sorted({h for h, _ in peers})
        if len(hosts) > 1:
            raise TransportError(
                f"rank {self.rank}: gda needs every EP rank on one host (symmetric memory over "
                f"NVLink); the group spans hosts {hosts}; use transport 'proxy' across hosts")
        self.ranks_per_device = peers.count(me)
        # auto: on when ranks share a GPU (one CUDA context under MPS; see LaunchGate)
        self.launch_gate = (gate in ("1", "on")) or (gate == "auto" and self.ranks_per_device > 1)
        self._gate = LaunchGate(group, self.rank, self.world_size) if self.launch_gate else None
        if self.ranks_per_device > 1:
            # Several ranks on one GPU (tests, benchmarks): rendezvous refuses overlapping devices
            # unless told otherwise (this also disables multicast, which gda does not use).
            os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        sms = props.multi_processor_count
        default_programs = max(4, 2 * sms // self.ranks_per_device)
        self.num_programs = int(opts.get("num_programs", default_programs))
        self._elem = cfg.dtype.itemsize
        self.layout = WindowLayout(world=self.world_size, t_max=cfg.max_tokens_per_rank,
                                   row_bytes=align_up(cfg.hidden * self._elem, 16),
                                   k_cap=self.max_topk, num_local=cfg.num_local_experts)
        self._offs = (self.layout.offsets(0), self.layout.offsets(1))
        self._buf = symm_mem.empty(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        self._hdl = symm_mem.rendezvous(self._buf, group)
        # Peers' windows at the same offset inside their allocations as ours inside ours.
        delta = self._buf.data_ptr() - int(self._hdl.buffer_ptrs[self.rank])
        self._buf_ptrs = torch.tensor([int(p) + delta for p in self._hdl.buffer_ptrs],
                                      dtype=torch.int64, device=self.device)
        self._sig_ptrs = torch.tensor(list(self._hdl.signal_pad_ptrs), dtype=torch.int64,
                                      device=self.device)
        self._win_ptr = self._buf_ptrs[self.rank:self.rank + 1]
        self._my_sig = self._hdl.get_signal_pad(self.rank, (self.world_size,), dtype=torch.int32)
        self._my_sig.zero_()
        # error word: [missing-source bits (bit 62: a source reported bad input in a
        # fixed-capacity dispatch), epoch * 8 + kind of the first expired wait, bad sources]
        self._err = torch.zeros(3, dtype=torch.int64, device=self.device)
        gda_kernels.check_err(self._err)
        # rows of each parity's id region written per source (fixed mode clears the rest), and
        # per parity the top-k width last written (a new width makes every row stale)
        self._hw = torch.zeros(2, self.world_size, dtype=torch.int64, device=self.device)
        self._idx_k = [0, 0]
        self._idx_full = [False, False]
        self._idx_epoch = [0, 0]
        self._done = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._epoch = 0
        # Op numbers on the device are op_base[0] + a host delta, so a captured CUDA graph
        # replays with new ones: the graph ends by advancing op_base by its op count.
        # _dev_base is the value op_base holds, in stream order, when the next op runs.
        self._op_base = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._dev_base = 0
        self._capturing = False
        self._broken: Optional[str] = None
        # per-call constants, built once: the wait arguments and the header view per parity
        self._wait_kw = dict(timeout_ns=int(self.timeout_s * 1e9), max_spins=2**31 - 1,
                             use_globaltimer=True)
        n_hdr = self.world_size * self.layout.hdr_len
        self._hdr = tuple(self._buf[o["hdr_off"]:o["hdr_off"] + 8 * n_hdr].view(torch.int64)
                          .view(self.world_size, -1) for o in self._offs)
        self._phases = GdaPhases(self, self.fast_launch)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)

    @property
    def launch_path(self) -> str:
        """How kernels are launched: ``native`` (one call per op phase), ``fast`` or ``triton``."""
        return self._phases.path

    @property
    def native_launch_off(self) -> Optional[str]:
        """Why op phases are not launched natively (None when they are)."""
        return self._phases.native_off

    # ------------------------------------------------------------------------------------
    def _wait_args(self):
        return self._wait_kw

    def _op(self, epoch: int) -> dict:
        """Kernel arguments naming op ``epoch``: the device base and the delta from it (and the
        launch path)."""
        return dict(epoch=epoch - self._dev_base, op_base=self._op_base,
                    fast=self.fast_launch >= 1)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TransportBroken(f"rank {self.rank}: gda transport unusable after an earlier "
                                 f"failure ({self._broken}); create a new one")

    def _begin_op(self, op: str) -> int:
        self._check_usable()
        if not self._capturing and torch.cuda.is_current_stream_capturing():
            raise TransportError(
                f"rank {self.rank}: gda {op} inside a CUDA graph capture that the transport "
                f"does not know of: capture with GdaTransport.capture(fn), which keeps the op "
                f"numbers of every replay in step across ranks")
        self._epoch += 1
        if self._epoch >= 2**31 - 1:
            raise TransportError(f"rank {self.rank}: gda epoch counter exhausted; recreate")
        return self._epoch

    def _break(self, msg: str, epoch: int, kind: str) -> None:
        """Marks the transport unusable here and, through the launch gate, for waiting peers."""
        self._broken = self._broken or msg
        if self._gate is not None:
            self._gate.fail(self._kern.wait_record(max(epoch, 1), kind))

    def _issued(self, epoch: int, kind: str) -> None:
        """Called right after this rank enqueued its stores of op ``epoch``; with the launch
        gate, publishes that and waits until every source did the same (see LaunchGate)."""
        if self._gate is None or self._capturing:
            # While capturing nothing is launched; a replay then issues every captured store
            # in one host call, so its waits never depend on a peer's host (see capture()).
            return
        self._gate.publish(epoch)
        if self._gate.ready(epoch):
            return
        t0 = time.perf_counter()
        try:
            self._gate.wait(epoch, self.timeout_s, kind)
        except TransportError as e:
            self._break(str(e), epoch, kind)
            raise
        finally:
            self.blocked_s += time.perf_counter() - t0

    def _raise_missing(self, bits: int, record: int) -> None:
        """Raises :class:`PeerTimeoutError` for the error word ``(bits, record)`` (no-op if 0)."""
        if not bits:
            return
        epoch, kind = divmod(int(record), 8)
        what = self._kern.OP_KINDS.get(kind, "op")
        missing = [s for s in range(self.world_size) if (bits >> s) & 1]
        msg = (f"rank {self.rank}: gda {what} (op {epoch}) gave up after {self.timeout_s:g}s "
               f"waiting for source rank(s) {missing}: they never signalled (crashed, hung, or "
               f"skipped this collective call); outputs of that op and later ones are NaN")
        self._break(msg, epoch, what)
        raise PeerTimeoutError(msg)

    def check_errors(self, op: str = "call") -> None:
        """Blocks on the stream and raises :class:`PeerTimeoutError` if any wait expired, naming
        the first op whose wait expired (its number and kind) and the missing source ranks; or
        :class:`DispatchInputError` if a fixed-capacity dispatch received bad-input status."""
        t0 = time.perf_counter()
        bits, record, bad = self._err.tolist()  # waits for the stream: blocked, not host work
        self.blocked_s += time.perf_counter() - t0
        self._raise_missing(bits & ~_BAD_INPUT_BIT, record)
        if bits & _BAD_INPUT_BIT:
            ranks = [s for s in range(self.world_size) if (bad >> s) & 1]
            msg = (f"rank {self.rank}: EP rank(s) {ranks} passed invalid inputs to a "
                   f"fixed-capacity dispatch (see their error); its rows were marked unused and "
                   f"later combines of this transport return NaN")
            self._break(msg, self._epoch, "dispatch")
            raise DispatchInputError(msg)

    def after_backward(self) -> None:
        """See ``Transport.after_backward``: with ``check_backward`` (default 1) one host sync,
        raising :class:`PeerTimeoutError` if any wait of the layer (forward combine included)
        expired. Without it a deadline expiry in a layer's backward would leave wrong rows in
        the gradients and be raised only by the next dispatch, after the optimizer step."""
        if self.check_backward and not self._capturing:  # no host sync inside a capture
            self.check_errors("backward")

    def _note_idx_width(self, parity: int, k: int) -> bool:
        """Records that this op writes parity ``parity``'s id region with top-k width ``k``;
        returns (and clears) whether every row of it must be treated as stale."""
        if self._idx_k[parity] != k:
            self._idx_k[parity] = k
            self._idx_full[parity] = True
        self._idx_epoch[parity] = self._epoch
        full, self._idx_full[parity] = self._idx_full[parity], False
        return full

    def _region(self, off: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self._buf[off:off + nbytes].view(dtype)


    def _host_check(self, x, topk_idx, topk_weights) -> Optional[str]:
        """The contract's host-side checks (no sync; value checks run on the device in the
        layout kernel) plus this window's limits: top-k capacity and this rank's GPU."""
        error = validate_dispatch_inputs(self.cfg, self.rank, x, topk_idx, topk_weights,
                                         value_checks=False)
        if error is not None:
            return error
        who = f"rank {self.rank}"
        if topk_idx.shape[1] > self.max_topk:
            return (f"{who}: top-k {topk_idx.shape[1]} > the gda window's max_topk="
                    f"{self.max_topk}; create the transport with max_topk={topk_idx.shape[1]}")
        if x.device != self.device:
            return f"{who}: x, topk_idx and topk_weights must be on {self.device}, got {x.device}"
        return None

    def _check_row_fits(self, d: int, dtype: torch.dtype, what: str) -> None:
        nbytes = d * dtype.itemsize
        if nbytes > self.layout.row_bytes:
            raise DispatchInputError(
                f"rank {self.rank}: {what} rows of {d} x {dtype} ({nbytes} bytes) exceed the gda "
                f"window row capacity {self.layout.row_bytes} bytes (hidden={self.cfg.hidden} x "
                f"{self.cfg.dtype})")

    # ------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights):
        """See ``efa_ep.kernels.base``. Blocks the CPU once for the counts (not graph-safe).

        Args:
            x: ``[T, H]`` cfg.dtype, this rank's GPU. topk_idx: ``[T, K]`` int64, -1 = unused.
            topk_weights: ``[T, K]`` float32.
        Returns:
            recv_x ``[N, H]``, recv_topk_idx ``[N, K]`` int64 (local ids, -1 elsewhere),
            recv_topk_weights ``[N, K]`` float32, tokens_per_expert ``[L]`` int64 CPU, handle.
        """
        cfg, world = self.cfg, self.world_size
        if self._capturing:
            raise TransportError(
                f"rank {self.rank}: gda dispatch reads the receive counts on the host and cannot "
                f"be captured in a CUDA graph; use dispatch_fixed inside capture()")
        error = self._host_check(x, topk_idx, topk_weights)
        epoch = self._begin_op("dispatch")
        if error is not None:  # take part with no rows and a bad status: nobody waits forever
            x = torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=self.device)
            topk_idx = torch.empty(0, 1, dtype=torch.int64, device=self.device)
            topk_weights = torch.empty(0, 1, dtype=torch.float32, device=self.device)
        x = x.contiguous() if x.stride(-1) != 1 else x
        topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        k = topk_idx.shape[1]
        phases = self._phases
        scratch, slot, send_idx = phases.front(
            x, topk_idx, topk_weights, epoch, None if error is None else STATUS_BAD_INPUT)
        self._issued(epoch, "dispatch")
        if self._note_idx_width(epoch % 2, k):
            self._idx_full[epoch % 2] = True  # only a fixed-capacity receive clears rows
        # the one host sync per dispatch
        vals, tokens_per_expert, recv_offsets, blocked = phases.header(scratch, epoch)
        self.blocked_s += blocked
        if vals[0]:
            self.check_errors()
        hdr_len = self.layout.hdr_len
        end = 1 + world * hdr_len
        num_send = vals[end:end + world]
        bad = {s: v for s, v in enumerate(vals[1:end:hdr_len]) if v != STATUS_OK}
        if error is not None or bad:
            # Every rank refuses; only the offending rank knows its own words (no text travels
            # in the window header), the others name it.
            words = {s: None for s in bad}
            mine = bad.get(self.rank)
            if error is not None:
                words[self.rank] = error
            elif mine is not None:
                words[self.rank] = f"rank {self.rank}: {describe_status(mine, cfg.num_experts)}"
            raise group_input_error(f"gda dispatch (op {epoch})", words)
        num_recv = vals[2:end:hdr_len]
        t_max = cfg.max_tokens_per_rank
        if not all(0 <= r <= t_max for r in num_recv):  # peers' counts are untrusted
            msg = (f"rank {self.rank}: gda dispatch (op {epoch}): source rank(s) "
                   f"{[s for s, r in enumerate(num_recv) if not 0 <= r <= t_max]} announced row "
                   f"counts {num_recv} outside [0, max_tokens_per_rank={t_max}]")
            self._break(msg, epoch, "dispatch")
            raise ProtocolError(msg)
        per_expert = vals[end + world:]
        # (row, local expert) pairs: at most k per received row
        if per_expert and (min(per_expert) < 0 or sum(per_expert) > sum(num_recv) * k):
            msg = (f"rank {self.rank}: gda dispatch (op {epoch}): the sources' rows per local "
                   f"expert {per_expert} are not counts of the {sum(num_recv)} rows received "
                   f"with top-{k}")
            self._break(msg, epoch, "dispatch")
            raise ProtocolError(msg)
        n = sum(num_recv)
        dev = self.device
        recv_x = torch.empty(n, cfg.hidden, dtype=cfg.dtype, device=dev)
        recv_idx = torch.empty(n, k, dtype=torch.int64, device=dev)
        recv_w = torch.empty(n, k, dtype=torch.float32, device=dev)
        phases.gather(recv_offsets, recv_x, recv_idx, recv_w, epoch)
        s_total = sum(num_send)
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=n, topk_idx=topk_idx,
            send_token_idx=send_idx[:s_total], num_send_per_rank=tuple(num_send),
            num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_idx,
            state=GdaDispatchState(owner=self.uid, slot_TW=slot, recv_offsets=recv_offsets,
                                   epoch=epoch))
        return recv_x, recv_idx, recv_w, tokens_per_expert, handle

    def dispatch_fixed(self, x, topk_idx, topk_weights):
        """Fixed-capacity dispatch: no host sync, no receive copy, static launch grids.

        Args: as :meth:`dispatch`.
        Returns:
            recv_x ``[W * T_MAX, H]`` cfg.dtype, recv_topk_idx ``[W * T_MAX, K]`` int64,
            recv_topk_weights ``[W * T_MAX, K]`` float32: **views of this transport's window**,
            rows ``s * T_MAX + j`` for ``j < num_recv_W[s]`` hold what source s sent (in its
            token order), every other row has ids -1 and weights 0 (mask with ids >= 0; its
            ``recv_x`` row is stale). num_recv_W ``[W]`` int64 and tokens_per_expert ``[L]``
            int64, on the device. handle: pass to :meth:`combine` (``y`` ``[W * T_MAX, D]``,
            rows in the same layout; rows of unused slots are ignored).

        Lifetime (the low-latency rule of DeepEP): the views are overwritten by this
        transport's op two calls later (window parity); copy what must outlive that. Bad
        inputs cannot raise on peers without a host sync: they raise here on the offending
        rank; its peers get every row marked unused and raise at :meth:`check_errors` (or the
        next ``dispatch`` / ``after_backward``), and later combines return NaN.
        Synchronization: none with the host; all work on the current stream.
        """
        kern, cfg, world = self._kern, self.cfg, self.world_size
        error = self._host_check(x, topk_idx, topk_weights)
        epoch = self._begin_op("dispatch")
        parity = epoch % 2
        offs = self._offs[parity]
        if error is not None:  # take part with no rows and a bad status (see dispatch)
            x = torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=self.device)
            topk_idx = torch.empty(0, topk_idx.shape[1] if topk_idx.dim() == 2 else 1,
                                   dtype=torch.int64, device=self.device)
            topk_weights = torch.empty(0, topk_idx.shape[1], dtype=torch.float32,
                                       device=self.device)
        x = x.contiguous() if x.stride(-1) != 1 else x
        topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        k = topk_idx.shape[1]
        _, slot, send_idx = self._phases.front(
            x, topk_idx, topk_weights, epoch, None if error is None else STATUS_BAD_INPUT)
        t_max = cfg.max_tokens_per_rank
        self._issued(epoch, "dispatch")
        full = self._note_idx_width(parity, k)
        rows = world * t_max
        num_recv = torch.empty(world, dtype=torch.int64, device=self.device)
        tokens_per_expert = torch.empty(cfg.num_local_experts, dtype=torch.int64,
                                        device=self.device)
        idx_region = self._region(offs["idx_off"], rows * k * 8, torch.int64)
        w_region = self._region(offs["w_off"], rows * k * 4, torch.float32)
        kern.recv_header_fixed(self._my_sig, self._hdr[parity], self._err,
                            self._hw[parity], num_recv, tokens_per_expert, idx_region, w_region,
                            num_topk=k, t_max=t_max, **self._op(epoch), full=full, kind="dispatch",
                            **self._wait_args())
        if error is not None:
            raise DispatchInputError(error)
        recv_x = self._region(offs["data_off"], rows * cfg.hidden * self._elem,
                              cfg.dtype).view(rows, cfg.hidden)
        recv_idx, recv_w = idx_region.view(rows, k), w_region.view(rows, k)
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=rows, topk_idx=topk_idx,
            send_token_idx=send_idx, num_send_per_rank=(), num_recv_per_rank=(),
            recv_topk_idx=recv_idx,
            state=GdaDispatchState(owner=self.uid, slot_TW=slot, recv_offsets=None, epoch=epoch,
                                   fixed=True, num_recv_W=num_recv))
        return recv_x, recv_idx, recv_w, num_recv, tokens_per_expert, handle

    def dispatch_cached(self, x, handle):
        """Replays ``handle``'s layout for ``x`` ``[T, D]`` (any dtype whose rows fit the window
        row): returns ``[N, D]``. No host sync (deadline errors are deferred, see the class)."""
        try:
            st = self.handle_state(handle)
            error = rows_input_error(self.rank, "cached dispatch input x", x, handle.num_tokens,
                                     device=self.device)
            if error is not None:
                raise DispatchInputError(error)
            self._check_row_fits(x.shape[1], x.dtype, "cached dispatch")
        except DispatchInputError as e:
            self._refuse(str(e), "cached dispatch")
        kern = self._kern
        epoch = self._begin_op("dispatch_cached")
        offs = self._offs[epoch % 2]
        x = x.contiguous() if (x.shape[1] > 1 and x.stride(1) != 1) else x
        self._phases.cached_store(x, st.slot_TW, epoch)
        self._issued(epoch, "cached dispatch")
        if st.fixed:  # the receive buffer is the window: wait, then return a view of it
            kern.wait_for_sources(self._my_sig, self._err, **self._op(epoch), kind="cached dispatch",
                               **self._wait_args())
            rows = handle.num_recv_tokens
            return self._region(offs["data_off"], rows * x.shape[1] * x.element_size(),
                                x.dtype).view(rows, x.shape[1])
        out = x.new_empty((handle.num_recv_tokens, x.shape[1]))
        self._phases.cached_gather(st.recv_offsets, out, epoch)
        if self.check_every_call and not self._capturing:
            self.check_errors("dispatch_cached")
        return out

    def combine(self, y, handle):
        """``y`` ``[N, D]`` (rows received by ``handle``'s dispatch) -> ``[T, D]`` in y's dtype:
        per token the float32 sum over destination ranks ascending, bit-equal to ``torch``.
        No host sync (deadline errors are deferred, see the class)."""
        return self._combine(y, handle, "combine")

    def combine_topk_weights(self, grad_recv_topk_weights, handle):
        """See ``Transport.combine_topk_weights``; ``[N, K]`` float32 -> ``[T, K]`` float32."""
        g = grad_recv_topk_weights
        error = self.handle_error(handle) or rows_input_error(
            self.rank, "combine_topk_weights input", g, handle.num_recv_tokens,
            width=handle.recv_topk_idx.shape[1], device=self.device)
        if error is not None:
            self._refuse(error, "weight combine")
        st = handle.state
        if st.fixed and self._idx_epoch[st.epoch % 2] != st.epoch:
            self._refuse(f"rank {self.rank}: combine_topk_weights with a fixed-capacity handle "
                         f"of op {st.epoch}: its window ids were overwritten by a later "
                         f"dispatch (views live until the op two calls later)", "weight combine")
        masked = torch.where(handle.recv_topk_idx >= 0, g.float(),
                             torch.zeros((), dtype=torch.float32, device=g.device))
        return self._combine(masked.contiguous(), handle, "weight combine")

    def _refuse(self, msg: str, kind: str) -> None:
        """A bad input to an op without a status exchange: with the launch gate the peers learn
        it at once (they raise naming this rank); the op's epochs no longer agree, so the
        transport is unusable on every rank. Without the gate the peers' waits expire."""
        self._break(msg, self._epoch + 1, kind)
        raise DispatchInputError(msg)

    def _combine(self, y, handle, kind: str):
        try:
            st = self.handle_state(handle)
            error = rows_input_error(self.rank, "combine input y", y, handle.num_recv_tokens,
                                     device=self.device)
            if error is not None:
                raise DispatchInputError(error)
            self._check_row_fits(y.shape[1], y.dtype, kind)
        except DispatchInputError as e:
            self._refuse(str(e), kind)
        epoch = self._begin_op(kind)
        y = y.contiguous() if (y.shape[1] > 1 and y.stride(1) != 1) else y
        self._phases.combine_store(y, st.num_recv_W if st.fixed else st.recv_offsets, st.fixed,
                                   epoch)
        self._issued(epoch, kind)
        out = torch.empty(handle.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        self._phases.combine_reduce(st.slot_TW, out, epoch, kind)
        if self.check_every_call and not self._capturing:
            self.check_errors(kind)
        return out

    def _barrier_op(self) -> None:
        """An op that moves no data: every rank signals every peer and waits for all of them
        (one single-program store launch and one wait). Keeps a captured op count even."""
        kern = self._kern
        epoch = self._begin_op("combine")
        offs = self._offs[epoch % 2]
        if getattr(self, "_no_rows", None) is None:  # one row routed nowhere (slot -1)
            self._no_rows = (torch.zeros(1, 16, dtype=torch.uint8, device=self.device),
                             torch.full((1, self.world_size), -1, dtype=torch.int64,
                                        device=self.device))
        row, nowhere = self._no_rows
        kern.dispatch_store(row, None, None, nowhere, None, None, None, self._buf_ptrs,
                         self._sig_ptrs, self._done[0:1], **offs, me=self.rank,
                         t_max=self.cfg.max_tokens_per_rank, num_local=self.cfg.num_local_experts,
                         **self._op(epoch), with_meta=False, num_programs=1)
        self._issued(epoch, "combine")
        kern.wait_for_sources(self._my_sig, self._err, **self._op(epoch), kind="combine",
                           **self._wait_args())

    def capture(self, fn, *, warmup: int = 1, pool=None) -> "GdaGraph":
        """Captures ``fn()`` (collective: every rank captures the same sequence of calls) in a
        CUDA graph and returns a :class:`GdaGraph` whose ``replay()`` reruns it with one host
        launch; ``GdaGraph.outputs`` is what ``fn`` returned (static tensors, overwritten by
        every replay).

        Inside ``fn``: :meth:`dispatch_fixed` and :meth:`combine` / :meth:`dispatch_cached` /
        :meth:`combine_topk_weights` with its handles, plus any other capturable torch work;
        inputs are read from tensors ``fn`` closes over (fill them before each replay, as with
        any CUDA graph). The regular :meth:`dispatch` reads counts on the host and raises.
        ``fn`` first runs ``warmup`` times eagerly (kernel compilation happens there, never
        during capture). The graph's op numbers come from a device counter that the graph
        advances by its op count as its last node, so replays interleave freely with eager
        calls (see :meth:`GdaGraph.replay`); an odd op count is padded with one data-free barrier
        op (window parities must repeat on every replay).

        Why no launch gate on replay: one replay enqueues every store and wait of the sequence
        at once, so a wait depends only on peers' kernels of the same or an earlier replay,
        which are in their streams as soon as the peer's host called ``replay()``. A peer that
        never replays is caught by the device deadline (error word, NaN rows, raised by
        :meth:`check_errors`).
        Synchronization: capture synchronizes the device once; replay does not block.
        """
        self._check_usable()
        if self._capturing:
            raise TransportError(f"rank {self.rank}: gda capture() is not re-entrant")
        for _ in range(max(0, int(warmup))):
            first = self._epoch
            fn()
            if (self._epoch - first) % 2:
                self._barrier_op()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        first = self._epoch
        # captured op i (1-based) carries the number op_base[0] + first - dev_base + i
        offset = first - self._dev_base
        self._capturing = True
        try:
            with torch.cuda.graph(graph, pool=pool):
                outputs = fn()
                if (self._epoch - first) % 2:
                    self._barrier_op()
                num_ops = self._epoch - first
                self._op_base.add_(num_ops)  # captured: every replay advances the base
        except BaseException as e:
            self._break(f"CUDA graph capture failed ({type(e).__name__}: {e})",
                        self._epoch, "dispatch")
            raise
        finally:
            self._capturing = False
        # The captured add never ran: replay() moves the base to what the replay needs.
        return GdaGraph(self, graph, num_ops, outputs, first, offset)

    def close(self) -> None:
        """Drops the windows (idempotent). Collective in spirit: peers may still map them."""
        for name in ("_hdl", "_buf", "_buf_ptrs", "_sig_ptrs", "_win_ptr", "_my_sig"):
            if hasattr(self, name):
                delattr(self, name)
        self._broken = self._broken or "closed"
        if getattr(self, "_gate", None) is not None:
            self._gate.fail(-1)
            self._gate.close()
            self._gate = None


class GdaGraph:
    """A CUDA graph of one :class:`GdaTransport`'s ops, made by :meth:`GdaTransport.capture`.

    Attributes:
        outputs: what the captured function returned (static tensors; every replay overwrites
            them, so copy what must outlive the next replay).
        num_ops: op numbers one replay consumes (even).
    """

    def __init__(self, transport: GdaTransport, graph, num_ops: int, outputs, first: int,
                 offset: int):
        self._transport, self.graph, self.num_ops, self.outputs = transport, graph, num_ops, outputs
        self._first, self._offset = first, offset

    def replay(self) -> None:
        """Relaunches the captured sequence on the current stream (collective: every rank
        replays its graph the same number of times, in the same order relative to its eager
        calls). No host sync; deadline expiries are deferred as for eager calls.

        The replay's ops take the next op numbers: when eager calls (or another graph) ran
        since this graph's last replay, one small kernel first moves the device base; when an
        odd number of them ran, one barrier op first restores the window parities the graph
        was captured with (so no op writes the window half a peer may still be reading)."""
        tr = self._transport
        tr._check_usable()
        if tr._epoch + self.num_ops + 1 >= 2**31 - 1:
            raise TransportError(f"rank {tr.rank}: gda epoch counter exhausted; recreate")
        if (tr._epoch - self._first) % 2:
            tr._barrier_op()
        base = tr._epoch - self._offset  # captured op i then runs as op tr._epoch + i
        if base != tr._dev_base:
            tr._op_base.add_(base - tr._dev_base)
            tr._dev_base = base
        tr._epoch += self.num_ops
        self.graph.replay()
        tr._dev_base += self.num_ops
        if tr.check_every_call:
            tr.check_errors("graph replay")
