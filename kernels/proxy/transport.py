"""The ``proxy`` transport: command rings + a native multi-channel CPU proxy + a libfabric wire.

A token's path: :meth:`ProxyTransport.dispatch` packs rows into the registered window
(``window.py``), a wire runs one round (header exchange, then data: ``wire.py``, in native steps
over a host or a device window), the rings (``ring.py``)
hand descriptors to the native channel threads (``native.py`` -> ``kernels/native/efa_proxy.c``),
which post ``fi_writedata`` into the peers' windows and count arrivals per (source, message).
Dispatch is one round, combine one, dispatch_cached one; a row wider than the window's row capacity
is split into column rounds. Rows to or from this rank itself never touch the wire (copied
locally).

Modules: this one holds setup, the failure state, the input checks and the contract's entry
points; ``round_ops.py`` the operations as wire rounds, ``device_path.py`` the CUDA-input path.

CPU rows on a host window run each operation as two native calls, post and complete
(``hostop.py`` -> ``kernels/native/efa_op.c``): the routing layout with the contract's value
checks, the round (headers, packing straight into the registered send area, the peers' headers
checked, data, footers), the rows copied once out of the receive window, the routing rows
checked and unpacked, combine's reduction in one pass; every check once, in C, which also words
every error. Python checks the arguments, allocates the outputs and maps return codes to the
contract's errors. Other inputs (GPU rows, the Triton producer, test-only tampering) run the
operation in Python around the wire's round (``round_ops.py``), in native steps over a host
window (in place) or a device window (through copies of a pinned stage), with the same native pieces
(``kernels/native/efa_round.c``, ``efa_host.c``), each matching its torch reference bit for bit.
Buffers are allocated once.

GPU inputs are host-staged (a host window): the dispatch's routing layout and packing run on the
GPU (``device.py``: the layout kernels of ``gda``, then one kernel storing every row for a peer
straight into the pinned send area, its routing rows and the counts into pinned host memory),
launched as one native program (``native_launch``). The round is three native calls
(``hostop.py``, ``efa_op.c``): the headers, as soon as the kernel has written the counts; the
peers' headers checked and the rows posted chunk by chunk as the kernel stores them (its
progress words, no stream synchronization), then the routing rows; the data waited for, the
routing rows checked and unpacked. The dispatch's outputs are then built by one kernel that
reads the peers' rows straight from the pinned window (GPU loads) and this rank's own rows from
``x``, with the ids and weights the host checked. Combine and the cached dispatch store their
rows for the peers the same way (one kernel, chunk by chunk, the round in the same three
calls); combine then reduces in one kernel reading the peers' rows from the window and this
rank's from ``y``, the cached dispatch copies the peers' rows out of the window. Every op ends
with an event, not a synchronization (the next op waits for it before its header lets peers
overwrite the window). ``device_layout=False`` runs
the dispatch's layout on the host instead (the routing copied to the host, rows gathered on the
GPU and copied once into the send area) and the round in Python steps around the native wire.
With ``producer="triton"`` a Triton kernel writes the data descriptors into the pinned ring
instead of the native host producer.
With ``hmem="cuda"`` the whole window is CUDA memory registered with ``FI_HMEM_CUDA``: rows are
gathered straight into it and the provider moves them GPU to GPU (GPUDirect RDMA on efa); only
rings, counters and the small headers' host copies stay on the host. Every call blocks the
CPU until its outputs are ready or enqueued on the current CUDA stream (GPU inputs); not
CUDA-graph capturable.

Options: see ``options.py`` (``create_transport("proxy", ..., **options)``; the dispatcher's
settings fill them from the EFA_EP_PROXY_* variables).
"""
from __future__ import annotations

import os
import socket
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..base import (
    DispatchInputError, NetCounter, Transport, TransportBroken, TransportConfig,
    TransportError, check_group_agreement, align_up, nbytes_of, rows_input_error,
    validate_dispatch_inputs,
)
from .. import native_launch
from ..core.hosts import device_identity as _device_identity
from . import native
from .hostop import HostOps
from .options import default_provider, resolve_options
from .ring import Rings
from .window import ALIGN, NUM_COUNTER_SLOTS, WindowLayout, alloc_window
from .device_path import DevicePath
from .round_ops import ProxyHandleState, RoundOps  # noqa: F401 (public name)
from .wire import Wire


def availability() -> Optional[str]:
    """None when the proxy can run here; else what is missing (headers, compiler, provider)."""
    problem = native.build_problem()
    if problem:
        return problem
    try:
        native.load()
    except RuntimeError as e:
        return str(e)
    # The default provider: a configured one is checked when the transport is created.
    provider = default_provider()
    why = native.probe(provider)
    if why:
        return f"libfabric provider {provider!r} unusable: {why}"
    return None


def _group_local_address() -> str:
    """The local IP address this process uses to reach the process group's rendezvous host
    (MASTER_ADDR, else the default store's host); '' when unknown."""
    host = os.environ.get("MASTER_ADDR")
    if not host:
        try:
            store = dist.distributed_c10d._get_default_store()
            while hasattr(store, "underlying_store"):
                store = store.underlying_store
            host = getattr(store, "host", None)
        except Exception:
            host = None
    if not host:
        return ""
    try:
        ip = socket.gethostbyname(host)
        if ip.startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # no packet is sent: this only asks the kernel for the route
            return s.getsockname()[0]
    except OSError:
        return ""


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


# how long an idle channel thread keeps spinning after its last work before it blocks (until a
# waiter or producer enters the engine); see efa_engine_set_idle
_IDLE_LINGER_US = 50


class ProxyTransport(RoundOps, DevicePath, Transport):
    """CPU-proxy transport over libfabric; see the module docstring for the protocol.

    Synchronization: every call is collective over the EP group and blocks the calling thread
    until this rank's outputs are complete, or, for GPU outputs, enqueued on the current stream
    (the waits are bounded by ``timeout_s`` and name the peer and message on expiry). GPU inputs
    are staged through host memory on the current stream (the call synchronizes it before its
    data is posted; a combine's last kernel is waited for by the next call, through an event).
    Buffers (windows, rings, counters) are allocated once and reused.

    Failures: invalid input on any rank raises the same :class:`DispatchInputError` on every rank
    (the transport stays usable). A deadline, a failed or dead peer, a protocol violation or ranks
    in different operations break the transport on the rank that saw it: later calls there raise
    :class:`TransportBroken` carrying the original error.

    Warning: one operation at a time per transport object (calls are not thread-safe).
    """

    name = "proxy"
    state_type = ProxyHandleState

    def __init__(self, cfg: TransportConfig, group):
        super().__init__(cfg, group)
        opts = resolve_options(cfg.options)
        self.options = opts
        self.provider = opts.provider
        self.num_channels = opts.num_channels
        self.inject = opts.inject
        self.timeout_ms = opts.timeout_ms
        self.chunk_bytes = opts.chunk_bytes
        self.ring_slots = opts.ring_slots
        self.max_inflight = opts.max_inflight
        self.spin_us = opts.spin_us
        self.cpu_base = opts.cpu_base
        self.hmem = opts.hmem
        self._hmem_auto = opts.hmem_auto
        self.producer = opts.producer
        esize = nbytes_of(cfg.dtype)
        self.row_cap = align_up(opts.max_row_bytes if opts.max_row_bytes is not None
                                else cfg.hidden * esize + 16 * opts.max_topk, ALIGN)
        if self.world_size > native.MAX_RANKS:
            raise TransportError(f"EP group of {self.world_size} ranks > {native.MAX_RANKS} (imm has 12 rank bits)")
        self.layout = WindowLayout.build(self.world_size, cfg.num_local_experts, cfg.max_tokens_per_rank,
                                         self.row_cap, self.chunk_bytes, cfg.hidden)
        self.window_bytes = self.layout.window_bytes
        self.region_bytes = self.layout.region_bytes

        pin = torch.cuda.is_available()
        self.window, self.hmem_device = alloc_window(self.window_bytes, self.hmem)
        self.rings = Rings(self.num_channels, self.ring_slots, pin)
        # one set of arrival counters per channel (efa_proxy.h): channels never share a counter
        self.counters = torch.zeros(self.num_channels * self.world_size * NUM_COUNTER_SLOTS,
                                    dtype=torch.int64, pin_memory=pin)
        # chunk marks (efa_proxy.h): the reading kernels follow the arrivals of each source's rows
        self.marks = torch.zeros(self.world_size * native.MARKS, dtype=torch.int32,
                                 pin_memory=pin)
        self.wire = self._make_wire()
        self._broken: Optional[str] = None
        self._buffers: dict = {}  # work buffers (combine's float32, pinned staging), see _scratch
        # host arrays of the native layout / checks / reduction, allocated once
        w = self.world_size
        self._num_send = np.zeros(w, dtype=np.int64)
        self._counts_E = np.zeros(cfg.num_experts, dtype=np.int64)
        self._layout_scratch = np.zeros(2 * w, dtype=np.int64)
        self._i64_out = np.zeros(1, dtype=np.int64)
        self._meta_buf = np.empty(0, dtype=np.int64)
        self._meta_srcs, self._meta_n, self._meta_check = (np.zeros(w, dtype=np.int64) for _ in range(3))
        self._counts_L = np.zeros(cfg.num_local_experts, dtype=np.int64)
        # their addresses, taken once (``ndarray.ctypes`` builds a helper object per access)
        self._meta_ptr = self._meta_buf.ctypes.data
        self._addr = {name: a.ctypes.data for name, a in (
            ("num_send", self._num_send), ("counts_E", self._counts_E), ("layout", self._layout_scratch),
            ("i64", self._i64_out), ("srcs", self._meta_srcs), ("n", self._meta_n),
            ("check", self._meta_check), ("counts_L", self._counts_L))}
        self._net = NetCounter()
        # CUDA inputs on a host window: the dispatch's receive and combine's reduction run as
        # one kernel each (device.py) when triton is importable, and with device_layout the
        # dispatch's layout and packing too, with the round in native calls (see the module).
        # device_kernels=False forces torch ops everywhere (tests and benchmarks compare);
        # "always" runs the kernels for CPU inputs too (tests, under the Triton interpreter).
        self.device_kernels = _triton_importable()
        self.device_layout = True
        self._reads_done = None  # CUDA event: the last op's kernels finished reading host buffers
        self._programs: dict = {}  # the device path's native programs (device_path.py)
        self._native_off: Optional[str] = (
            "no CUDA device" if not torch.cuda.is_available() else native_launch.availability())
        self._hostops: Optional[HostOps] = None
        # packed calls of CUDA rows whose case ran before: one native call each (planned.py);
        # made on first use, False where they cannot run
        self._planned = None
        self.engine = None
        self.gen = 0
        self.ranks_per_device = 1  # ranks of the group on this rank's GPU (set up below)
        self.bind_address = ""
        self._engine_rss = 0
        self._setup()

    @property
    def hdr_len(self) -> int:
        return self.layout.hdr_len

    @property
    def hdr_chunks(self) -> int:
        return self.layout.hdr_chunks

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000

    # Setup ----------------------------------------------------------------------------------
    def _make_wire(self):
        """The wire of this transport's window."""
        return Wire(self.rank, self.world_size, self.cfg.max_tokens_per_rank, self.layout,
                    self.window, self.rings, self.timeout_ms, self.options.tamper)

    def _start_engine(self) -> None:
        if self.provider.split(";")[0] == "shm":
            # segments of killed processes (SIGKILL skips the provider's unlink) go first
            from ..shm_segments import remove_stale_segments

            remove_stale_segments()
        rss0 = _rss_bytes()
        try:
            self.engine = native.Engine(
                self.provider, self.rank, self.world_size, self.num_channels, self.window.data_ptr(),
                self.window_bytes, self.rings.rings.data_ptr(), self.ring_slots,
                self.rings.ring_ctrl.data_ptr(), self.counters.data_ptr(), NUM_COUNTER_SLOTS,
                self.max_inflight, self.spin_us, self.inject, 1234 + self.rank, self.cpu_base,
                self.timeout_ms, self.hmem_device, recv_off=self.layout.off_recv,
                recv_stride=self.region_bytes, key_seed=None, node=self.bind_address, gen=self.gen)
        except native.NativeError as ex:
            where = (f"a CUDA window on cuda:{self.hmem_device} (hmem='cuda'; hmem='off' stages "
                     f"through host memory instead)" if self.hmem == "cuda" else "a host window")
            raise TransportError(f"rank {self.rank}: the proxy engine over libfabric provider "
                                 f"{self.provider!r} with {where} failed to start: {ex}") from ex
        self.engine.set_marks(self.marks.data_ptr())
        self._engine_rss = max(0, _rss_bytes() - rss0)
        # On a host with few CPUs per channel the channel threads leave the CPU to the host's
        # own work between ops (every waiter wakes them); with CPUs to spare they keep spinning,
        # the lower-latency policy measured on the GPU hosts.
        if (os.cpu_count() or 1) < 2 * (self.num_channels + 1):
            self.engine.set_idle(_IDLE_LINGER_US)

    def _settings(self) -> dict:
        """What this rank resolved from its options and its probes (provider default, hmem)."""
        return dict(provider=self.provider, num_channels=self.num_channels,
                    chunk_bytes=self.chunk_bytes, row_cap=self.row_cap,
                    window_bytes=self.window_bytes, inject=self.inject, hmem=self.hmem,
                    timeout_ms=self.timeout_ms)

    def _agree(self, payload) -> list:
        """Refuses setup on every rank when the ranks resolved different settings (the agreement
        check of ``kernels/base.py``, with the values this rank resolved), then all-gathers
        ``payload``."""
        try:
            check_group_agreement(self.cfg, self.group, self.rank,
                                  resolved_options=self._settings())
        except TransportError:
            if self.engine is not None:
                self.close(barrier=False)
            raise
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, payload, group=self.group)
        return gathered

    def _setup(self) -> None:
        # The tcp provider otherwise listens on every interface; bind it to the one the process
        # group uses unless the user chose an interface (FI_TCP_IFACE).
        if self.provider.split(";")[0] == "tcp" and not os.environ.get("FI_TCP_IFACE"):
            self.bind_address = _group_local_address()
        # Round 1 of setup: agree on settings and take rank 0's generation (random per transport)
        # before any endpoint exists, so every immediate carries the group's generation.
        # With it, which ranks share this rank's GPU (the reading kernels' grid, device_path.py).
        device = _device_identity()
        proposals = self._agree((int.from_bytes(os.urandom(1), "little") & native.IMM_GEN_MASK,
                                 device))
        self.gen = proposals[0][0]
        self.ranks_per_device = (sum(1 for _, d in proposals if d == device)
                                 if device is not None else 1)
        try:
            self._start_engine()
        except TransportError as ex:
            if not (self._hmem_auto and self.hmem == "cuda"):
                raise
            # hmem='auto' chose the device window; this libfabric offered FI_HMEM but could not
            # register it: say so and use the host window (every rank compares settings below)
            warnings.warn(f"{ex}; hmem='auto' continues with a host window (host-staged)")
            self.hmem = "off"
            self.window, self.hmem_device = alloc_window(self.window_bytes, self.hmem)
            self.wire = self._make_wire()
            self._start_engine()
        w, nc = self.world_size, self.num_channels
        mine = [self.engine.local_info(c)[:2] for c in range(nc)]
        # Endpoint names (public) travel over the torch group once; region keys go only to the
        # source that may use them (all_to_all: rank r receives the keys of its regions at peers).
        gathered = self._agree(mine)
        keys_out = torch.zeros(w, nc, 2, dtype=torch.int64)
        for src in range(w):
            for c in range(nc):
                key, base = self.engine.region_info(c, src)
                keys_out[src, c, 0] = key - (1 << 64) if key >= (1 << 63) else key
                keys_out[src, c, 1] = base - (1 << 64) if base >= (1 << 63) else base
        keys_in = torch.empty_like(keys_out)
        dist.all_to_all_single(keys_in, keys_out, group=self.group)
        keys_in = [[(int(keys_in[d, c, 0]) & ((1 << 64) - 1), int(keys_in[d, c, 1]) & ((1 << 64) - 1))
                    for c in range(nc)] for d in range(w)]
        for c in range(nc):
            names = b"".join(g[c][0] for g in gathered)
            self.engine.set_peers(c, names, [g[c][1] for g in gathered],
                                  [keys_in[d][c][0] for d in range(w)],
                                  [keys_in[d][c][1] for d in range(w)], self.timeout_ms)
        dist.barrier(group=self.group)  # every AV is populated before anyone writes
        self.wire.start(self.engine, self.gen)
        self.wire.warm_up()
        if self.options.tamper in native.TAMPER_KINDS:
            self.engine.tamper(self.options.tamper)

    def close(self, barrier: bool = True) -> None:
        """Releases the engine (threads, endpoints, registrations). Idempotent.

        Collective when ``barrier`` (the default): our last writes may still be in flight after
        our last operation returned (we only waited for what we receive), so we wait for their
        local completion and then for every peer to reach close (a peer reaches it only after it
        received everything we sent); only then are endpoints torn down. ``__del__`` skips the
        barrier (a peer may be gone); so does a broken transport (its peers may be waiting on it
        or gone)."""
        if self.engine is None:
            return
        try:
            self._wait_reads()  # no kernel still reads the window when it goes
            self.engine.wait_idle(min(self.timeout_ms, 10000))
            if barrier and self._broken is None and dist.is_initialized():
                dist.barrier(group=self.group)
        except Exception:
            pass
        finally:
            self.engine.destroy()
            self.engine = None

    def __del__(self):
        try:
            self.close(barrier=False)
        except Exception:
            pass

    def stats(self) -> list:
        """Per-channel native counters (popped, posted, tx_done, arrived, eagain, ...), cumulative
        since the engine started (warm-up included). ``posted`` counts writes when a channel
        thread posts them, which may be after the operation that queued them returned; call
        ``wire.quiesce()`` first for a settled figure."""
        return self.engine.stats()

    @property
    def last_op_counts(self) -> dict:
        """``{op: NetOpCounts}``: what the most recent call of each op on this rank handed to
        the wire (every peer counts: same-node peers go through libfabric too). ``messages``
        are data messages (peers with >= 1 row), ``writes``/``wire_bytes`` every descriptor
        queued (headers, row chunks with their routing metadata, footers): the same writes the
        engine's ``posted`` counter sums once they are posted. Host counts, no synchronization."""
        return dict(self._net.last)

    def net_counts(self, op: str):
        """:attr:`last_op_counts`'s entry for ``op`` as its five counts (messages, rows, bytes,
        writes, wire_bytes), or None before the first call: for a caller that reads one op's
        after every call (hier's network stage)."""
        return self._net.last_of(op)

    @property
    def one_calls(self) -> dict:
        """``{"dispatch": n, "combine": n, "cached": n}``: calls that ran as one native call each
        (a packed op of CUDA rows whose case ran before, see ``planned.py``; a dispatch takes a
        second for its reading kernel); zeros where that path is off."""
        p = self._planned
        return dict(p.calls) if p else {"dispatch": 0, "combine": 0, "cached": 0}

    @property
    def cpp_calls(self) -> dict:
        """``{"dispatch": n, "combine": n}``: the :attr:`one_calls` that went to the C++ call
        (``cpp_op.py``); zeros where it is off (``cpp_off`` says why)."""
        p = self._planned
        return dict(p.cpp_calls) if p else {"dispatch": 0, "combine": 0}

    @property
    def cpp_off(self) -> Optional[str]:
        """None where planned dispatches and combines go to the C++ call, else why not."""
        p = self._planned
        return p.cpp_off if p else "no planned ops here (no CUDA rows on a host window yet)"

    def op_totals(self) -> dict:
        """Per-op sums of :attr:`last_op_counts` over every call since creation (see
        :class:`~efa_ep.kernels.base.NetCounter`); warm-up writes are not in them."""
        return self._net.totals()

    def memory_report(self) -> dict:
        """Bytes this transport holds: the registered window (``window``, of which each source's
        receive region is ``region``), rings, counters, and the resident memory the engine's
        endpoints added at start (``engine_rss``, measured; ``per_channel`` = engine_rss /
        num_channels:
        provider buffers, completion queues, registrations)."""
        return {"window": self.window_bytes, "region": self.region_bytes,
                "rings": self.rings.rings.numel() * 8, "counters": self.counters.numel() * 8,
                "marks": self.marks.numel() * 4,
                "engine_rss": self._engine_rss, "num_channels": self.num_channels,
                "per_channel": self._engine_rss // self.num_channels}

    @property
    def broken(self) -> Optional[str]:
        """None while usable, else the error that broke this transport on this rank."""
        return self._broken

    # Failure state --------------------------------------------------------------------------
    def _check_usable(self, what: str) -> None:
        if self._broken is not None:
            raise TransportBroken(
                f"rank {self.rank}: proxy transport refuses {what}: it is broken since an earlier "
                f"failure (create a new transport): {self._broken}")
        if self.engine is None:
            raise TransportBroken(f"rank {self.rank}: proxy transport refuses {what}: it is closed")

    def _guarded(self, fn, *args):
        """Runs one operation; anything but a group's input error (refused by every rank in
        step) breaks the transport (peers' writes for this round may still land). Records what
        the operation handed to the wire (:attr:`last_op_counts`), also when it raised."""
        p = self.wire.posted
        m, r, b, w, wb = p["messages"], p["rows"], p["bytes"], p["writes"], p["wire_bytes"]
        try:
            return fn(*args)  # (each op waits for the previous op's reads before its header)
        except DispatchInputError:
            raise
        except BaseException as e:
            if self._broken is None:
                self._broken = f"{type(e).__name__}: {e}"
            raise
        finally:
            self._net.add(fn.__name__.lstrip("_"), p["messages"] - m, p["rows"] - r,
                          p["bytes"] - b, p["writes"] - w, p["wire_bytes"] - wb)

    # Input checks (local; their result travels in the header) ---------------------------------
    def _device_error(self, **tensors) -> Optional[str]:
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "cuda"):
                return (f"rank {self.rank}: {name} is on device {t.device}; the proxy transport "
                        f"moves cpu or cuda tensors")
        return None

    def _handle_error(self, handle) -> Optional[str]:
        w = self.world_size
        error = self.handle_error(handle)
        if error is not None:
            return error
        if len(handle.num_send_per_rank) != w or len(handle.num_recv_per_rank) != w:
            return (f"rank {self.rank}: handle has per-rank counts for "
                    f"{len(handle.num_send_per_rank)} ranks, the group has {w}")
        return None

    def _rows_error(self, name: str, t, rows: int, handle) -> Optional[str]:
        """The contract's rows check (:func:`~efa_ep.kernels.base.rows_input_error`) after this
        transport's own limits: cpu or cuda tensors, floating point."""
        err = self._device_error(**{name: t})
        if err:
            return err
        err = rows_input_error(self.rank, name, t, rows, device=handle.topk_idx.device)
        if err:
            return err
        if not t.dtype.is_floating_point:
            return f"rank {self.rank}: {name} must be a floating-point tensor, got {t.dtype}"
        return None

    def _checked(self, what: str, check) -> Optional[str]:
        """Runs a local check; an exception becomes this rank's error message (sent to peers)."""
        try:
            return check()
        except Exception as e:
            return f"rank {self.rank}: {what} inputs could not be checked: {type(e).__name__}: {e}"

    # Contract -------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights):
        self._check_usable("dispatch")
        return self._guarded(self._dispatch, x, topk_idx, topk_weights)

    def _dispatch_error(self, x, topk_idx, topk_weights) -> Optional[str]:
        """The contract's checks that read no values (the values, expert ids and weights, are
        checked on the host copy by the native layout, see :meth:`_route`)."""
        error = self._device_error(x=x, topk_idx=topk_idx, topk_weights=topk_weights)
        if error is None:
            error = validate_dispatch_inputs(self.cfg, self.rank, x, topk_idx, topk_weights,
                                             value_checks=False)
        return error

    def _row_cap_error(self, x, topk_idx) -> Optional[str]:
        cfg, me = self.cfg, self.rank
        if cfg.hidden * x.element_size() + 16 * topk_idx.shape[1] > self.row_cap:
            # would overflow a window row: refused on every rank (status in the header) before any
            # row moves; all ranks share H and the top-k, so all of them hit this
            return (f"rank {me}: dispatch rows of {cfg.hidden * x.element_size()} + "
                    f"{16 * topk_idx.shape[1]} bytes (hidden*elem + 16*top-k) exceed the window's "
                    f"row capacity {self.row_cap}; create the transport with "
                    f"max_topk>={topk_idx.shape[1]} (or max_row_bytes)")
        return None

    def dispatch_cached(self, x, handle):
        self._check_usable("dispatch_cached")
        return self._guarded(self._dispatch_cached, x, handle)

    def combine(self, y, handle):
        self._check_usable("combine")
        return self._guarded(self._combine, y, handle, "combine input y")

    def combine_topk_weights(self, grad_recv_topk_weights, handle):
        """See :meth:`Transport.combine_topk_weights`; a wrong shape, dtype or device on one rank
        raises on every rank (it travels in the combine's header like any input error)."""
        self._check_usable("combine_topk_weights")
        return self._guarded(self._combine_topk_weights, grad_recv_topk_weights, handle)
