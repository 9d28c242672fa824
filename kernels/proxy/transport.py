"""The ``proxy`` transport: command rings + a native multi-channel CPU proxy + a libfabric wire.

A token's path: :meth:`ProxyTransport.dispatch` packs rows into the registered window
(``window.py``), :class:`~efa_ep.kernels.proxy.wire.Wire` runs one round (header exchange, then
data; ``wire.py``), the rings (``ring.py``) hand descriptors to the native channel threads
(``native.py`` -> ``kernels/native/efa_proxy.c``), which post ``fi_writedata`` into the peers'
windows and count arrivals per (source, message). Dispatch is one round, combine one,
dispatch_cached one; a row wider than the window's row capacity is split into column rounds.
Rows to or from this rank itself never touch the wire (copied locally).

CPU rows on a host window run each operation as two native calls, post and complete
(``hostop.py`` -> ``kernels/native/efa_op.c``): the routing layout with the contract's value
checks, the round (headers, packing straight into the registered send area, the peers' headers
checked, data, footers), the rows copied once out of the receive window, the routing rows
checked and unpacked, combine's reduction in one pass; every check once, in C, which also words
every error. Python checks the arguments, allocates the outputs and maps return codes to the
contract's errors. Other inputs (GPU rows, device windows, the Triton producer, test-only
tampering) run the round in steps (``wire.py``) with the same native pieces
(``kernels/native/efa_round.c``, ``efa_host.c``), each matching its torch reference bit for bit.
Buffers are allocated once.

GPU inputs are host-staged: the routing (16 B per token slot) goes to the host in one copy, rows
are gathered on the GPU and copied once into the pinned send area (one device-to-host copy for
all peers), moved by the proxy. The dispatch's outputs are then built by one kernel (``device.py``) that
reads the peers' rows straight from the pinned window (GPU loads) and this rank's own rows from
``x``, with the ids and weights the host checked; combine's reduction is one kernel reading the
peers' rows from the window and this rank's from ``y``. Both end with an event, not a
synchronization (the next op waits for it before its header lets peers overwrite the window). With ``device_layout`` the dispatch's
layout, packing and receive run as kernels too (off by default: no faster on the H200 host).
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

import dataclasses
import itertools
import os
import socket
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..base import (
    DispatchHandle, DispatchInputError, HandleState, NetCounter, NetOpCounts, Transport,
    TransportBroken, TransportConfig, TransportError, check_group_agreement, describe_value_errors,
    align_up, nbytes_of, reduce_rows_by_rank, rows_input_error,
    validate_dispatch_inputs,
)
from . import native
from .hostop import HostOps
from .options import PY_TAMPER, default_provider, resolve_options
from .ring import Rings, triton_producer
from .window import (
    ALIGN, HDR_FIXED, NUM_COUNTER_SLOTS, OP_CACHED, OP_COMBINE, OP_DISPATCH, WindowLayout,
    alloc_window, as_bytes, dense, row_format,
)
from .wire import ProtocolViolation, Wire


def _prefix(counts) -> list:
    """``[0, c0, c0 + c1, ...]``: where each rank's block starts (and the total, last)."""
    return [0, *itertools.accumulate(counts)]


# how long an idle channel thread keeps spinning after its last work before it blocks (until a
# waiter or producer enters the engine); see efa_engine_set_idle
_IDLE_LINGER_US = 50

# dtypes combine's native reduction takes (others: torch ops)
_NATIVE_DT = {torch.float32: native.DT_F32, torch.bfloat16: native.DT_BF16}


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


@dataclasses.dataclass(frozen=True)
class ProxyHandleState(HandleState):
    """``DispatchHandle.state`` of a proxy dispatch.

    Attributes:
        owner: the transport object that made it (:class:`~efa_ep.kernels.base.HandleState`).
        send_token_idx_cpu: ``[S]`` int64 CPU, the handle's ``send_token_idx`` on the host (the
            handle keeps it on x's device too), for CPU rows without a device copy; None when
            the layout ran on the device (the device path of a CUDA dispatch).
    """

    send_token_idx_cpu: Optional[torch.Tensor]


class ProxyTransport(Transport):
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
        self.wire = Wire(self.rank, self.world_size, cfg.max_tokens_per_rank, self.layout, self.window,
                         self.rings, self.timeout_ms, opts.tamper)
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
        # dispatch's layout and packing too (off by default: on the H200 host it measured no faster than the host
        # layout, its kernel launches cost what the torch ops cost). False forces torch ops
        # everywhere (tests and benchmarks compare); "always" runs the kernels for CPU inputs
        # too (tests, under the Triton interpreter).
        self.device_kernels = _triton_importable()
        self.device_layout = False
        self._reads_done = None  # CUDA event: the last op's kernels finished reading host buffers
        self._hostops: Optional[HostOps] = None
        self.engine = None
        self.gen = 0
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
        proposals = self._agree(int.from_bytes(os.urandom(1), "little") & native.IMM_GEN_MASK)
        self.gen = proposals[0]
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
            self.wire.set_window(self.window)
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
        before = dict(self.wire.posted)
        try:
            self._wait_reads()
            return fn(*args)
        except DispatchInputError:
            raise
        except BaseException as e:
            if self._broken is None:
                self._broken = f"{type(e).__name__}: {e}"
            raise
        finally:
            d = {k: v - before[k] for k, v in self.wire.posted.items()}
            self._net.record(NetOpCounts(fn.__name__.lstrip("_"), **d))

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

    def _dispatch(self, x, topk_idx, topk_weights):
        cfg, w, me, wire = self.cfg, self.world_size, self.rank, self.wire
        dev = x.device
        if self._device_path(x):
            return self._dispatch_device(x, topk_idx, topk_weights)
        error = self._checked("dispatch", lambda: self._dispatch_error(x, topk_idx, topk_weights))
        ops = self._host_ops(x, topk_idx, topk_weights) if error is None else None
        if ops is not None and (error := self._row_cap_error(x, topk_idx)) is None:
            res = ops.dispatch(dense(x), dense(topk_idx), dense(topk_weights))
            if res is not None:
                recv_x, recv_idx, recv_w, tpe, send_idx, num_send, num_recv = res
                return recv_x, recv_idx, recv_w, tpe, DispatchHandle(
                    num_tokens=x.shape[0], num_recv_tokens=recv_x.shape[0], topk_idx=topk_idx,
                    send_token_idx=send_idx, num_send_per_rank=tuple(num_send),
                    num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_idx,
                    state=ProxyHandleState(owner=self.uid, send_token_idx_cpu=send_idx))
            error = (describe_value_errors(cfg, me, topk_idx, topk_weights)
                     or f"rank {me}: the routing layout refused the routing values")
        route = None
        if error is None:
            try:
                route = self._route(topk_idx, topk_weights)
                error = route if isinstance(route, str) else self._row_cap_error(x, topk_idx)
            except Exception as e:
                # a local failure while preparing still reaches every peer through the status
                error = f"rank {me}: dispatch failed while packing rows: {type(e).__name__}: {e}"
        if error is not None:
            wire.round(OP_DISPATCH, {}, [0], None, None, error)  # raises on every rank
            raise TransportError(f"rank {me}: dispatch error round did not raise: {error}")
        send_idx_cpu, meta, num_send, counts = route
        k, H, L = topk_idx.shape[1], cfg.hidden, cfg.num_local_experts
        starts = _prefix(num_send)
        s_me, e_me = starts[me], starts[me + 1]
        self._select_producer(dev)
        send_idx = send_idx_cpu if dev.type == "cpu" else send_idx_cpu.to(dev, non_blocking=True)
        row_x = H * x.element_size()

        # 1. headers out (counts in them); our previous writes have left the send side
        wire.begin(OP_DISPATCH, [row_x, 16 * k], num_send, extras=counts.reshape(w, L), fmt=k)
        # 2. pack while the headers fly: token rows straight into the registered send area (one
        #    gather on x's device, then one D2H copy for a GPU input), routing rows from the layout
        xs, ms = wire.plane(0), wire.plane(1)
        if s_me == 0 or e_me == starts[-1]:  # the peers' rows are one run of send_idx
            peer_idx = send_idx[e_me:] if s_me == 0 else send_idx[:s_me]
        else:
            peer_idx = torch.cat([send_idx[:s_me], send_idx[e_me:]])
        if xs is not None:
            self._gather_into(xs.view(x.dtype).view(-1, H), x, peer_idx)
        else:  # rows not a multiple of 16 bytes: one slot per destination
            for d in range(w):
                if d != me and num_send[d]:
                    self._gather_into(wire.slot(0, d).view(x.dtype).view(-1, H), x,
                                      send_idx[starts[d]:starts[d + 1]])
        if ms.device.type == "cpu":
            msn = ms.numpy().view(np.int64).reshape(-1, 2 * k)
            msn[:s_me] = meta[:s_me]
            msn[s_me:] = meta[e_me:]
        elif ms.numel():  # a device window
            ms.copy_(torch.from_numpy(np.concatenate([meta[:s_me], meta[e_me:]])).view(torch.uint8).view(ms.shape))
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the D2H copies are in the window
        # 3. the peers' headers (checked), then our data out
        got = wire.exchange()
        num_recv = [num_send[me] if r == me else wire.rows_from(r) for r in range(w)]
        rstarts = _prefix(num_recv)
        n_recv = rstarts[-1]
        if self._device_kernels_for(x):  # 4-6 as one kernel after the data arrived
            wire.finish()
            recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert = self._receive_device(
                dense(x), send_idx, num_recv, s_me, self._meta_ptr + s_me * 16 * k, got, k)
            handle = DispatchHandle(
                num_tokens=x.shape[0], num_recv_tokens=n_recv, topk_idx=topk_idx,
                send_token_idx=send_idx, num_send_per_rank=tuple(num_send),
                num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_topk_idx,
                state=ProxyHandleState(owner=self.uid, send_token_idx_cpu=send_idx_cpu))
            return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle
        # 4. this rank's own rows go straight into the output while the peers' rows fly
        recv_x = torch.empty(n_recv, H, dtype=x.dtype, device=dev)
        torch.index_select(x, 0, send_idx[s_me:e_me], out=recv_x[rstarts[me]:rstarts[me + 1]])
        # 5. the peers' rows: one copy each out of the window (H2D for a GPU input)
        wire.finish()
        for r in range(w):
            if r != me and num_recv[r]:
                recv_x[rstarts[r]:rstarts[r + 1]].copy_(wire.recv(r, 0).view(x.dtype).view(-1, H),
                                                         non_blocking=True)
        # 6. routing rows: checked (ids, weights, per-expert counts vs the header) and unpacked
        recv_topk_idx = torch.empty(n_recv, k, dtype=torch.int64)
        recv_topk_weights = torch.empty(n_recv, k, dtype=torch.float32)
        tokens_per_expert = self._unpack_meta(num_recv, self._meta_ptr + s_me * 16 * k, k, got,
                                              recv_topk_idx, recv_topk_weights)
        if dev.type != "cpu":
            recv_topk_idx = recv_topk_idx.to(dev, non_blocking=True)
            recv_topk_weights = recv_topk_weights.to(dev, non_blocking=True)
            torch.cuda.current_stream(dev).synchronize()  # the window is read before our next header
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=n_recv, topk_idx=topk_idx,
            send_token_idx=send_idx, num_send_per_rank=tuple(num_send),
            num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_topk_idx,
            state=ProxyHandleState(owner=self.uid, send_token_idx_cpu=send_idx_cpu))
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle

    def _receive_device(self, x, send_token_idx, num_recv, own_start: int, own_meta_address: int,
                        got, k: int):
        """A dispatch's outputs after its round (``wire.finish``), as one kernel: the routing
        rows are checked (ids, weights, per-expert counts vs the headers) and unpacked on the
        host into pinned buffers, then :func:`~efa_ep.kernels.proxy.device.gather_dispatch`
        writes ``recv_x`` (peers' rows from the window, this rank's from ``x``), ids and
        weights on x's device. Ends with an event (the next op waits for it), no sync.

        Args:
            x: ``[T, H]`` rows (x's device). send_token_idx: ``[S]`` int64 on x's device.
            num_recv: W ints. own_start: where this rank's own rows start in the send order.
            own_meta_address: host address of this rank's own routing rows
                (``[n_me, 2K]`` int64). got: the peers' headers of this round. k: top-k.
        Returns: (recv_x ``[N, H]``, recv_topk_idx ``[N, K]`` int64, recv_topk_weights
            ``[N, K]`` float32, tokens_per_expert ``[L]`` int64 CPU).
        """
        from . import device as dk

        w, me = self.world_size, self.rank
        dev = x.device
        rstarts = _prefix(num_recv)
        n_recv = rstarts[-1]
        in_idx = self._pinned("recv_idx", max(1, n_recv * k), torch.int64)
        in_w = self._pinned("recv_w", max(1, n_recv * k), torch.float32)
        tokens_per_expert = self._unpack_meta(num_recv, own_meta_address, k, got, in_idx, in_w)
        recv_off = self._pinned("recv_off", w + 1, torch.int64)
        recv_off.numpy()[:] = rstarts
        recv_x = torch.empty(n_recv, x.shape[1], dtype=x.dtype, device=dev)
        recv_topk_idx = torch.empty(n_recv, k, dtype=torch.int64, device=dev)
        recv_topk_weights = torch.empty(n_recv, k, dtype=torch.float32, device=dev)
        dk.gather_dispatch(x, send_token_idx, self._src_ptrs(dev), recv_off,
                           in_idx[:n_recv * k].view(-1, k) if n_recv else in_idx,
                           in_w[:n_recv * k].view(-1, k) if n_recv else in_w,
                           recv_x, recv_topk_idx, recv_topk_weights, me=me,
                           own_start=own_start, num_programs=self._num_programs(dev))
        self._record_reads(dev)
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert

    def _route(self, topk_idx, topk_weights):
        """The routing layout (native, on the host: one D2H of the routing for a GPU input, never
        of the rows), with the value checks of the contract. Returns (send_idx ``[S]`` int64 CPU,
        meta ``[S, 2K]`` int64 (scratch, valid for this call), rows per rank (W ints),
        ``[E]`` int64 (token, expert) pairs per expert), or the value error's message."""
        cfg, w = self.cfg, self.world_size
        t, k = topk_idx.shape
        if topk_idx.is_cuda:  # both to pinned staging, one sync
            idxh = self._pinned("idx", t * k, torch.int64).view(t, k)
            wh = self._pinned("w", t * k, torch.float32).view(t, k)
            idxh.copy_(topk_idx, non_blocking=True)
            wh.copy_(topk_weights, non_blocking=True)
            torch.cuda.current_stream(topk_idx.device).synchronize()
        else:
            idxh, wh = dense(topk_idx), dense(topk_weights)
        cap = t * min(w, k)
        # pinned for a GPU input: its copy to the device does not wait (torch's caching host
        # allocator reuses the block only after that copy completed)
        send_idx = torch.empty(cap, dtype=torch.int64, pin_memory=topk_idx.is_cuda)
        if self._meta_buf.shape[0] < cap * 2 * k:
            self._meta_buf = np.empty(cap * 2 * k, dtype=np.int64)
            self._meta_ptr = self._meta_buf.ctypes.data
        meta = self._meta_buf
        num_send, counts, flags, pa = self._num_send, self._counts_E, self._i64_out, self._addr
        s = native.route_layout(idxh.data_ptr(), wh.data_ptr(), t, k, cfg.num_experts, w,
                                send_idx.data_ptr(), self._meta_ptr, cap, pa["num_send"],
                                pa["counts_E"], pa["layout"], pa["i64"])
        if s < 0:
            return (describe_value_errors(cfg, self.rank, idxh, wh)
                    or f"rank {self.rank}: the routing layout failed ({s}, flags {int(flags[0])})")
        return send_idx[:s], meta[:s * 2 * k].reshape(s, 2 * k), num_send.tolist(), counts

    def _host_ops(self, *tensors) -> Optional[HostOps]:
        """The native operations (``hostop.py``) when they apply: CPU tensors on a host window
        with native rounds, the native descriptor producer, no test-only header tampering and
        no forced device kernels; else None (the round in steps, below)."""
        wire = self.wire
        if (wire._nw is None or not wire.native_rounds or wire.tamper in PY_TAMPER
                or self.producer == "triton" or self.device_kernels == "always"
                or any(t.device.type != "cpu" for t in tensors)):
            return None
        ops = self._hostops
        if ops is None or not ops.bound_to(wire):
            cfg = self.cfg
            ops = self._hostops = HostOps(wire, cfg.num_experts, cfg.num_local_experts,
                                          cfg.max_tokens_per_rank)
        return ops

    # Device path: CUDA inputs on a host window (kernels in device.py) ------------------------
    def _device_path(self, x) -> bool:
        """Whether a dispatch runs as the kernels of ``device.py`` (layout and packing on the
        device, one synchronization) rather than as torch ops around the host layout:
        ``device_layout`` on, CUDA input, a host window, rows of whole 16-byte units."""
        return (self.device_layout and self._device_kernels_for(x) and x.dim() == 2
                and (x.shape[1] * x.element_size()) % 16 == 0
                and x.shape[1] * x.element_size() <= self.row_cap)

    def _device_kernels_for(self, t) -> bool:
        """Whether ``t``'s device work runs as the kernels of ``device.py``: a CUDA tensor (or any,
        with ``device_kernels="always"``) on a host window, triton importable."""
        return (bool(self.device_kernels) and isinstance(t, torch.Tensor)
                and (t.is_cuda or self.device_kernels == "always") and not self.window.is_cuda)

    def _wait_reads(self) -> None:
        """The previous op's kernels have finished reading the receive window and the pinned
        buffers (so a header may let peers overwrite it, and the host may rewrite them)."""
        if self._reads_done is not None:
            self._reads_done.synchronize()
            self._reads_done = None

    @staticmethod
    def _sync(dev: torch.device) -> None:
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def _record_reads(self, dev: torch.device) -> None:
        if dev.type != "cuda":
            return  # CPU kernels (interpreter) have finished when they return
        ev = self._buffers.get(("event", str(dev)))
        if ev is None:
            ev = self._buffers[("event", str(dev))] = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        self._reads_done = ev

    def _src_ptrs(self, dev: torch.device) -> torch.Tensor:
        """``[W]`` int64 on ``dev``: the address of plane 0 of each source's receive region
        (pinned host memory, mapped into the GPU's address space)."""
        key = ("src_ptrs", str(dev), self.window.data_ptr())
        t = self._buffers.get(key)
        if t is None:
            base = self.window.data_ptr()
            t = torch.tensor([base + self.layout.data_recv_off(r) for r in range(self.world_size)],
                             dtype=torch.int64).to(dev)
            self._buffers[key] = t
        return t

    def _num_programs(self, dev: torch.device) -> int:
        key = ("sms", str(dev))
        n = self._buffers.get(key)
        if n is None:
            n = self._buffers[key] = (torch.cuda.get_device_properties(dev).multi_processor_count
                                      if dev.type == "cuda" else 4)
        return n

    def _dispatch_device(self, x, topk_idx, topk_weights):
        """:meth:`dispatch` of CUDA rows on a host window: layout and packing on the device
        straight into the window (one stream synchronization), the wire, then one kernel for
        the outputs (no synchronization: the next op waits for its event before its header)."""
        from ..gda import launches as kern
        from . import device as dk

        cfg, w, me, wire = self.cfg, self.world_size, self.rank, self.wire
        dev = x.device
        error = self._checked("dispatch", lambda: self._dispatch_error(x, topk_idx, topk_weights)
                              or self._row_cap_error(x, topk_idx))
        if error is not None:
            wire.round(OP_DISPATCH, {}, [0], None, None, error)  # raises on every rank
            raise TransportError(f"rank {me}: dispatch error round did not raise: {error}")
        t, k = topk_idx.shape
        H, L, E = cfg.hidden, cfg.num_local_experts, cfg.num_experts
        xd, idx, wts = dense(x), topk_idx.contiguous(), topk_weights.contiguous()
        lay = kern.layout(idx, wts, E, w)
        send_token_idx = lay[1]
        meta = self._pinned("meta", max(1, t * min(w, k)) * 2 * k, torch.int64)
        counts = self._pinned("counts", 1 + w + E, torch.int64)
        nsm = self._num_programs(dev)
        wire.quiesce()  # our previous writes have left the send plane the kernel overwrites
        dk.pack_dispatch(xd, idx, wts, lay, me, self.window[self.layout.off_data_send:self.layout.off_recv],
                         meta, counts, num_programs=nsm)
        self._sync(dev)  # the rows, routing rows and counts are in host memory
        cn = counts.numpy()
        if cn[0]:  # a bad expert id or weight: named from a host copy (error path only)
            error = (describe_value_errors(cfg, me, idx.cpu(), wts.cpu())
                     or f"rank {me}: the device layout flagged the routing (status {int(cn[0])})")
            wire.round(OP_DISPATCH, {}, [0], None, None, error)
            raise TransportError(f"rank {me}: dispatch error round did not raise: {error}")
        num_send = cn[1:1 + w].tolist()
        counts_E = cn[1 + w:].copy()
        starts = _prefix(num_send)
        s_me, e_me, s_all = starts[me], starts[me + 1], starts[-1]
        row_x = H * x.element_size()

        wire.begin(OP_DISPATCH, [row_x, 16 * k], num_send, extras=counts_E.reshape(w, L), fmt=k)
        xs, ms = wire.plane(0), wire.plane(1)
        if xs.numel() and xs.data_ptr() != self.window.data_ptr() + self.layout.off_data_send:
            raise TransportError(f"rank {me}: the send plane moved (at {xs.data_ptr()}, the "
                                 f"device packed at the send area's start)")
        metan = meta.numpy()[:s_all * 2 * k].reshape(s_all, 2 * k)
        msn = ms.numpy().view(np.int64).reshape(-1, 2 * k)
        msn[:s_me] = metan[:s_me]
        msn[s_me:] = metan[e_me:]
        got = wire.exchange()
        num_recv = [num_send[me] if r == me else wire.rows_from(r) for r in range(w)]
        rstarts = _prefix(num_recv)
        n_recv = rstarts[-1]
        wire.finish()
        recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert = self._receive_device(
            xd, send_token_idx, num_recv, s_me, meta.data_ptr() + s_me * 16 * k, got, k)
        handle = DispatchHandle(
            num_tokens=t, num_recv_tokens=n_recv, topk_idx=topk_idx,
            send_token_idx=send_token_idx[:s_all], num_send_per_rank=tuple(num_send),
            num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_topk_idx,
            state=ProxyHandleState(owner=self.uid, send_token_idx_cpu=None))
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle

    def _gather_into(self, out: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> None:
        """``out[i] = x[idx[i]]`` into a view of the window: in place when both are on one device;
        for a GPU input and a host window one gather on the device and one D2H copy
        (asynchronous: the caller syncs)."""
        if not idx.numel():
            return
        if out.device == x.device:  # a CPU input, or a device window (hmem)
            torch.index_select(x, 0, idx, out=out)
        else:
            out.copy_(x.index_select(0, idx), non_blocking=True)

    def _pinned(self, name: str, n: int, dtype) -> torch.Tensor:
        """A flat host buffer of ``n`` elements, page-locked, reused across calls (grown when too
        small): staging of D2H copies that must not wait on pageable memory."""
        buf = self._buffers.get(("pin", name))
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 1), dtype=dtype, pin_memory=torch.cuda.is_available())
            self._buffers[("pin", name)] = buf
        return buf[:n]

    def _unpack_meta(self, num_recv, own_meta_address: int, k: int, got: np.ndarray,
                     out_idx: torch.Tensor, out_w: torch.Tensor) -> torch.Tensor:
        """The routing rows of a round's steps, checked and unpacked (efa_unpack_meta) into
        ``out_idx`` / ``out_w`` (host, ``>= [N, K]`` int64 / float32, source order); returns
        tokens_per_expert ``[L]`` int64. ``own_meta_address``: this rank's own rows (host)."""
        w, me, wire, L = self.world_size, self.rank, self.wire, self.cfg.num_local_experts
        srcs, nr, chk = self._meta_srcs, self._meta_n, self._meta_check
        keep = []  # host copies of a device window's routing rows
        for r in range(w):
            nr[r], chk[r] = num_recv[r], r != me
            m = None if r == me else wire.recv(r, 1)
            if m is not None and m.device.type != "cpu":
                keep.append(m := m.cpu())
            srcs[r] = own_meta_address if m is None else m.data_ptr()
        tokens_per_expert = torch.empty(L, dtype=torch.int64)
        pa = self._addr
        bad = native.unpack_meta(w, k, L, pa["srcs"], pa["n"], pa["check"],
                                 wire.got_address + HDR_FIXED * 8, got.shape[1], out_idx.data_ptr(),
                                 out_w.data_ptr(), tokens_per_expert.data_ptr(), pa["counts_L"], pa["i64"])
        if bad >= 0:
            self._meta_violation(bad, wire.recv(bad, 1), k, got)
        return tokens_per_expert

    def _meta_violation(self, src: int, m: torch.Tensor, k: int, got: np.ndarray):
        """Raises the :class:`ProtocolViolation` efa_unpack_meta found in rank ``src``'s routing
        rows ``m`` (``[n, 16K]`` uint8, any device), named by C (efa_describe_meta)."""
        L = self.cfg.num_local_experts
        m = m.cpu().contiguous().view(torch.int64).view(-1, 2 * k)
        counts = np.ascontiguousarray(got[src, HDR_FIXED:HDR_FIXED + L], dtype=np.int64)
        raise ProtocolViolation(self.wire._checks.describe_meta(
            src, m.data_ptr(), m.shape[0], k, L, counts.ctypes.data))

    def _select_producer(self, dev: torch.device) -> None:
        """Who writes a round's data descriptors: the native host producer (``auto``, ``torch``),
        or the Triton kernel (``triton``). Every round synchronizes the stream before its data
        is posted (the rows are staged or written by the device first), so for ``auto`` the
        Triton producer would only add launches: about 0.5 ms of Python per round on the H200
        host, against a few microseconds for efa_post_messages."""
        wire = self.wire
        if self.producer == "triton":
            wire.use_triton = triton_producer() is not None
            if not wire.use_triton:
                raise TransportError("producer='triton' needs triton (pip install triton)")
        else:
            wire.use_triton = False
        wire.triton_device = dev

    def _send_idx(self, handle, device: torch.device) -> torch.Tensor:
        """``[S]`` int64 source token of each sent row, on ``device`` (the handle keeps both)."""
        if device.type != "cpu" or handle.state.send_token_idx_cpu is None:
            return handle.send_token_idx.to(device)
        return handle.state.send_token_idx_cpu

    def dispatch_cached(self, x, handle):
        self._check_usable("dispatch_cached")
        return self._guarded(self._dispatch_cached, x, handle)

    def _dispatch_cached(self, x, handle):
        error = self._checked("dispatch_cached", lambda: self._handle_error(handle)
                              or self._rows_error("dispatch_cached input x", x, handle.num_tokens, handle))
        if error is not None:
            self.wire.round(OP_CACHED, {}, [0], None, None, error)
        w, me, wire = self.world_size, self.rank, self.wire
        dev = x.device
        self._select_producer(dev)
        idx = self._send_idx(handle, dev)
        num_send, num_recv = list(handle.num_send_per_rank), list(handle.num_recv_per_rank)
        starts = _prefix(num_send)
        rstarts = _prefix(num_recv)
        d_cols = x.shape[1]
        row_bytes = d_cols * x.element_size()
        if row_bytes > self.row_cap:  # column rounds
            rows_to = {d: x.index_select(0, idx[starts[d]:starts[d + 1]]) for d in range(w) if d != me}
            self_rows = x.index_select(0, idx[starts[me]:starts[me + 1]])
            return wire.exchange_rows(OP_CACHED, rows_to, self_rows, num_recv)
        xd = dense(x)
        ops = self._host_ops(x, idx)
        if ops is not None:
            return ops.dispatch_cached(xd, idx, num_send, num_recv, row_format(xd))
        wire.begin(OP_CACHED, [row_bytes], num_send, n_recv=num_recv, fmt=row_format(xd))
        self._pack_rows(xd, idx, num_send, starts, gather=True)
        wire.exchange()
        out = torch.empty(rstarts[-1], d_cols, dtype=x.dtype, device=dev)
        torch.index_select(xd, 0, idx[starts[me]:starts[me + 1]], out=out[rstarts[me]:rstarts[me + 1]])
        wire.finish()
        for r in range(w):
            if r != me and num_recv[r]:
                out[rstarts[r]:rstarts[r + 1]].copy_(wire.recv(r, 0).view(x.dtype).view(-1, d_cols),
                                                     non_blocking=True)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the window is read before our next header
        return out

    def _pack_rows(self, y: torch.Tensor, idx: torch.Tensor, rows_to, starts, gather: bool) -> None:
        """Packs the rows of every peer into plane 0 of the send area: ``y[idx[run of d]]``
        (``gather``) or ``y[run of d]`` (rows already grouped by destination), straight into the
        registered window (for a GPU input: a gather on the device, one D2H copy per run; synced
        here, before the data is posted)."""
        w, me, wire = self.world_size, self.rank, self.wire
        d_cols = y.shape[1]
        s_me, e_me = starts[me], starts[me + 1]
        plane = wire.plane(0)
        if plane is not None:
            dst = plane.view(y.dtype).view(-1, d_cols)
            runs = [(0, s_me), (e_me, starts[-1])]
            at = 0
            for a, b in runs:
                if b > a:
                    part = dst[at:at + b - a]
                    if gather:
                        self._gather_into(part, y, idx[a:b])
                    else:
                        part.copy_(y[a:b], non_blocking=True)
                    at += b - a
        else:
            for d in range(w):
                if d == me or not rows_to[d]:
                    continue
                dst = wire.slot(0, d).view(y.dtype).view(-1, d_cols)
                if gather:
                    self._gather_into(dst, y, idx[starts[d]:starts[d + 1]])
                else:
                    dst.copy_(y[starts[d]:starts[d + 1]], non_blocking=True)
        if y.device.type == "cuda":
            torch.cuda.current_stream(y.device).synchronize()

    def combine(self, y, handle):
        self._check_usable("combine")
        return self._guarded(self._combine, y, handle, "combine input y")

    def _combine(self, y, handle, name: str):
        error = self._checked("combine", lambda: self._handle_error(handle)
                              or self._rows_error(name, y, handle.num_recv_tokens, handle))
        if error is not None:
            self.wire.round(OP_COMBINE, {}, [0], None, None, error)
        w, me, wire = self.world_size, self.rank, self.wire
        self._select_producer(y.device)
        yc = dense(y)  # stays on its device; rows go straight into the send area
        num_recv = list(handle.num_recv_per_rank)
        n_send = list(handle.num_send_per_rank)
        starts = _prefix(num_recv)
        sstarts = _prefix(n_send)
        idx = self._send_idx(handle, y.device)
        d_cols = yc.shape[1]
        row_bytes = d_cols * yc.element_size()
        if row_bytes > self.row_cap:  # column rounds: gather every block, then reduce
            rows_to = {d: yc[starts[d]:starts[d + 1]] for d in range(w) if d != me}
            back = wire.exchange_rows(OP_COMBINE, rows_to, yc[starts[me]:starts[me + 1]], n_send)
            return reduce_rows_by_rank(back, idx, handle.num_send_per_rank,
                                       handle.num_tokens).to(y.dtype)
        ops = self._host_ops(yc, idx) if yc.dtype in _NATIVE_DT else None
        if ops is not None:
            out = ops.combine(yc, idx, n_send, num_recv, handle.num_tokens, row_format(yc))
            if out is not None:
                return out
            # a NaN sum: torch reduces the rows still in the window (NaN payloads are torch's)
            views = [yc[starts[me]:starts[me + 1]] if r == me else
                     ops.received(r, n_send[r], row_bytes).view(yc.dtype).view(-1, d_cols)
                     for r in range(w)]
            return self._reduce_torch(views, idx, n_send, sstarts, handle.num_tokens, yc)
        wire.begin(OP_COMBINE, [row_bytes], num_recv, n_recv=n_send, fmt=row_format(yc))
        self._pack_rows(yc, idx, num_recv, starts, gather=False)
        wire.exchange()
        wire.finish()
        # One pass from the receive window: float32 sum over source ranks in ascending order from
        # +0.0, rounded once (as reduce_rows_by_rank(...).to(dtype), bit for bit).
        self_rows = yc[starts[me]:starts[me + 1]]
        views = [self_rows if r == me else wire.recv(r, 0).view(yc.dtype).view(-1, d_cols)
                 for r in range(w)]
        if self._device_kernels_for(yc):
            from . import device as dk

            out = torch.empty(handle.num_tokens, d_cols, dtype=yc.dtype, device=yc.device)
            send_off = self._pinned("send_off", w + 1, torch.int64)
            send_off.numpy()[:] = sstarts
            dk.reduce_combine(yc, idx.contiguous(), send_off, self._src_ptrs(yc.device), out,
                              me=me, own_start=starts[me],
                              num_programs=self._num_programs(yc.device))
            self._record_reads(yc.device)  # the next op waits for it before its header
            return out
        out = self._reduce_torch(views, idx, n_send, sstarts, handle.num_tokens, yc)
        if y.device.type == "cuda":
            torch.cuda.current_stream(y.device).synchronize()  # the window is read before our next header
        return out

    def _reduce_torch(self, views, idx, n_send, sstarts, num_tokens: int, yc):
        """The reduction with torch ops on the output's device (GPU inputs, other dtypes)."""
        d_cols = yc.shape[1]
        out = self._scratch("acc", num_tokens, d_cols, yc.device,
                            persistent=yc.dtype != torch.float32).zero_()
        for r, rows in enumerate(views):
            n = n_send[r]
            if not n:
                continue
            if rows.device != out.device:
                rows = rows.to(out.device, non_blocking=True)
            if rows.dtype != torch.float32:  # float32 copy in a reused buffer
                rows = self._scratch("rows", n, d_cols, out.device).copy_(rows)
            out.index_add_(0, idx[sstarts[r]:sstarts[r] + n], rows)
        return out.to(yc.dtype) if yc.dtype != torch.float32 else out

    def _scratch(self, name: str, rows: int, cols: int, device, persistent: bool = True):
        """``[rows, cols]`` float32 work buffer on ``device``, reused across calls (grown when
        too small) unless not ``persistent``; its contents are undefined."""
        if not persistent:
            return torch.empty(rows, cols, dtype=torch.float32, device=device)
        key = (name, str(device), cols)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty(max(rows, 1), cols, dtype=torch.float32, device=device)
            self._buffers = {k: v for k, v in self._buffers.items() if k[:2] != key[:2]}
            self._buffers[key] = buf
        return buf[:rows]

    def combine_topk_weights(self, grad_recv_topk_weights, handle):
        """See :meth:`Transport.combine_topk_weights`; a wrong shape, dtype or device on one rank
        raises on every rank (it travels in the combine's header like any input error)."""
        self._check_usable("combine_topk_weights")
        return self._guarded(self._combine_topk_weights, grad_recv_topk_weights, handle)

    def _combine_topk_weights(self, g, handle):
        me = self.rank

        def check():
            err = self._handle_error(handle)
            if err:
                return err
            if not isinstance(g, torch.Tensor):
                return f"rank {me}: combine_topk_weights grad must be a tensor, got {type(g).__name__}"
            err = self._device_error(grad_recv_topk_weights=g)
            if err:
                return err
            want = tuple(handle.recv_topk_idx.shape)
            if tuple(g.shape) != want:
                return (f"rank {me}: combine_topk_weights grad_recv_topk_weights must be {list(want)} "
                        f"(received rows x the dispatch's top-k), got {list(g.shape)}")
            if not g.dtype.is_floating_point:
                return f"rank {me}: combine_topk_weights grad_recv_topk_weights must be floating point, got {g.dtype}"
            if g.device != handle.recv_topk_idx.device:
                return (f"rank {me}: combine_topk_weights grad_recv_topk_weights is on {g.device}, "
                        f"the handle on {handle.recv_topk_idx.device}")
            return None

        error = self._checked("combine_topk_weights", check)
        if error is not None:
            self.wire.round(OP_COMBINE, {}, [0], None, None, error)
        masked = torch.where(handle.recv_topk_idx >= 0, g.float(),
                             torch.zeros((), dtype=torch.float32, device=g.device))
        return self._combine(dense(masked), handle, "combine_topk_weights grad_recv_topk_weights")

