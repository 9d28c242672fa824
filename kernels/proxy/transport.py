"""The ``proxy`` transport: command rings + a native multi-channel CPU proxy + a libfabric wire.

A token's path: :meth:`ProxyTransport.dispatch` packs rows into the registered window
(``window.py``), :class:`~efa_ep.kernels.proxy.wire.Wire` runs one round (header exchange, then
data; ``wire.py``), the rings (``ring.py``) hand descriptors to the native channel threads
(``native.py`` -> ``kernels/native/efa_proxy.c``), which post ``fi_writedata`` into the peers'
windows and count arrivals per (source, message). Dispatch is one round, combine one,
dispatch_cached one; a row wider than the window's row capacity is split into column rounds.
Rows to or from this rank itself never touch the wire (copied locally).

GPU inputs are host-staged: rows are gathered on the GPU and copied once into the pinned send
slots, moved by the proxy, and copied once from the pinned window back to the GPU, where the
combine's reduction also runs (the descriptors of a GPU-input round are produced by a Triton
kernel into the pinned ring). Routing metadata (a few bytes per token) is built on the host.
With ``hmem="cuda"`` the whole window is CUDA memory registered with ``FI_HMEM_CUDA``: rows are
gathered straight into it and the provider moves them GPU to GPU (GPUDirect RDMA on efa); only
rings, counters and the small headers' host copies stay on the host. Every call blocks the
CPU until its outputs are ready (synchronizes the current CUDA stream for GPU inputs); not
CUDA-graph capturable.

Options: see ``options.py`` (``create_transport("proxy", ..., **options)``; the dispatcher's
settings fill them from the EFA_EP_PROXY_* variables).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..base import (
    DispatchHandle, DispatchInputError, HandleState, NetCounter, NetOpCounts, Transport,
    TransportConfig, TransportError, check_group_agreement, compute_send_layout,
    float_bits_to_int64, int64_to_float_bits, nbytes_of, reduce_rows_by_rank, rows_input_error,
    validate_dispatch_inputs,
)
from . import native
from .options import default_provider, resolve_options
from .ring import Rings, triton_producer
from .window import (
    HDR_FIXED, H_ROWS, NUM_COUNTER_SLOTS, OP_CACHED, OP_COMBINE, OP_DISPATCH, WindowLayout,
    align, alloc_window, as_bytes, dense, row_format,
)
from .wire import GroupError, Wire


def availability() -> Optional[str]:
    """None when the proxy can run here; else what is missing (headers, compiler, provider)."""
    problem = native.build_problem()
    if problem:
        return problem
    try:
        native.load()
    except RuntimeError as e:
        return str(e)
    provider = os.environ.get("EFA_EP_PROXY_PROVIDER") or default_provider()
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
            handle keeps it on x's device too), for CPU rows without a device copy.
    """

    send_token_idx_cpu: torch.Tensor


class ProxyTransport(Transport):
    """CPU-proxy transport over libfabric; see the module docstring for the protocol.

    Synchronization: every call is collective over the EP group and blocks the calling thread
    until this rank's outputs are complete (the waits are bounded by ``timeout_s`` and name the
    peer and message on expiry). GPU inputs are staged through host memory on the current stream
    (the call synchronizes it). Buffers (windows, rings, counters) are allocated once and reused.

    Failures: invalid input on any rank raises the same :class:`DispatchInputError` on every rank
    (the transport stays usable). A deadline, a failed or dead peer, or a protocol violation
    marks the transport broken on the rank that saw it: later calls there raise the original error.

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
        self.row_cap = align(opts.max_row_bytes if opts.max_row_bytes is not None
                             else cfg.hidden * esize + 16 * opts.max_topk)
        if self.world_size > native.MAX_RANKS:
            raise TransportError(f"EP group of {self.world_size} ranks > {native.MAX_RANKS} (imm has 12 rank bits)")
        self.layout = WindowLayout.build(self.world_size, cfg.num_local_experts, cfg.max_tokens_per_rank,
                                         self.row_cap, self.chunk_bytes, cfg.hidden)
        self.window_bytes = self.layout.window_bytes
        self.region_bytes = self.layout.region_bytes

        pin = torch.cuda.is_available()
        self.window, self.hmem_device = alloc_window(self.window_bytes, self.hmem)
        self.rings = Rings(self.num_channels, self.ring_slots, pin)
        self.counters = torch.zeros(self.world_size * NUM_COUNTER_SLOTS, dtype=torch.int64, pin_memory=pin)
        self.wire = Wire(self.rank, self.world_size, cfg.max_tokens_per_rank, self.layout, self.window,
                         self.rings, self.timeout_ms, opts.tamper)
        self._broken: Optional[str] = None
        self._buffers: dict = {}  # float32 work buffers of combine, see _scratch
        self._net = NetCounter()
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
            from efa_ep.kernels.shm_segments import remove_stale_segments

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
            raise TransportError(
                f"rank {self.rank}: proxy transport refuses {what}: it is broken since an earlier "
                f"failure (create a new transport): {self._broken}")
        if self.engine is None:
            raise TransportError(f"rank {self.rank}: proxy transport refuses {what}: it is closed")

    def _guarded(self, fn, *args):
        """Runs one operation; anything but an error every rank raised in step marks the
        transport broken (its peers' writes for this round may still land). Records what the
        operation handed to the wire (:attr:`last_op_counts`), also when it raised."""
        before = dict(self.wire.posted)
        try:
            return fn(*args)
        except (DispatchInputError, GroupError):
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
        cfg, me = self.cfg, self.rank
        error = self._device_error(x=x, topk_idx=topk_idx, topk_weights=topk_weights)
        if error is None:
            error = validate_dispatch_inputs(cfg, me, x, topk_idx, topk_weights)
        if error is None and cfg.hidden * x.element_size() + 16 * topk_idx.shape[1] > self.row_cap:
            # would overflow a window row: refused on every rank (status in the header) before any
            # row moves; all ranks share H and K, so all of them hit this
            error = (f"rank {me}: dispatch rows of {cfg.hidden * x.element_size()} + "
                     f"{16 * topk_idx.shape[1]} bytes (hidden*elem + 16*top-k) exceed the window's "
                     f"row capacity {self.row_cap}; create the transport with "
                     f"max_topk>={topk_idx.shape[1]} (or max_row_bytes)")
        return error

    def _dispatch(self, x, topk_idx, topk_weights):
        cfg, w, me = self.cfg, self.world_size, self.rank
        error = self._checked("dispatch", lambda: self._dispatch_error(x, topk_idx, topk_weights))
        if error is not None:
            self.wire.round(OP_DISPATCH, {}, [0], None, None, error)  # raises on every rank
        try:
            prep = self._prepare_dispatch(x, topk_idx, topk_weights)
        except Exception as e:
            # a local failure while preparing still reaches every peer through the status
            self.wire.round(OP_DISPATCH, {}, [0], None, None,
                            f"rank {me}: dispatch failed while packing rows: {type(e).__name__}: {e}")
        planes, widths, extra, layout, send_idx, meta, num_send, starts, k, dev, pack = prep
        own = {}

        def local(got):
            # this rank's own rows go straight into the output while the peers' rows fly
            num_recv = [num_send[me] if r == me else int(got[r, H_ROWS]) for r in range(w)]
            recv_x = torch.empty(sum(num_recv), cfg.hidden, dtype=x.dtype, device=dev)
            row = sum(num_recv[:me])
            n = num_send[me]
            torch.index_select(x, 0, send_idx[starts[me]:starts[me] + n], out=recv_x[row:row + n])
            own.update(num_recv=num_recv, recv_x=recv_x)

        got, recv = self.wire.round(OP_DISPATCH, planes, widths, None, extra, None, k,
                                    pack=pack, local=local)
        num_recv, recv_x = own["num_recv"], own["recv_x"]
        n_recv = sum(num_recv)
        # Copy out of the window (reused next round) into x's device; the blocking H2D copies
        # from pinned memory return only once the window has been read.
        mb, row = [], 0
        for r in range(w):
            n = num_recv[r]
            if r == me:
                mb.append(meta[starts[me]:starts[me] + n])
            else:
                recv_x[row:row + n].copy_(recv[r][0].view(x.dtype).view(n, cfg.hidden))
                m = recv[r][1].view(torch.int64).view(n, 2 * k).cpu()
                self._check_meta(r, m, k, got[r, HDR_FIXED:])
                mb.append(m)
            row += n
        recv_meta = torch.cat(mb, 0)
        recv_topk_idx = recv_meta[:, :k].contiguous()
        recv_topk_weights = int64_to_float_bits(recv_meta[:, k:]).contiguous()
        # counted from the validated ids (equal to the peers' header counts, checked above)
        L = cfg.num_local_experts
        ids = recv_topk_idx[recv_topk_idx >= 0]
        tokens_per_expert = torch.bincount(ids, minlength=L).to(torch.int64)[:L].clone()
        if dev.type != "cpu":
            recv_topk_idx = recv_topk_idx.to(dev)
            recv_topk_weights = recv_topk_weights.to(dev)
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=n_recv, topk_idx=topk_idx,
            send_token_idx=send_idx, num_send_per_rank=tuple(num_send),
            num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_topk_idx,
            state=ProxyHandleState(owner=self.uid, send_token_idx_cpu=layout.send_token_idx_S))
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle

    def _prepare_dispatch(self, x, topk_idx, topk_weights):
        """Routing layout and metadata (host), the send-slot views of each destination's planes,
        and ``pack``, which fills them (run by the round once our previous writes left the slots,
        while the headers fly)."""
        cfg, w, me = self.cfg, self.world_size, self.rank
        dev = x.device
        self._select_producer(dev)
        # Host-staged wire. Routing metadata is small and built on the host; token rows stay on
        # x's device until they are copied straight into (out of) the pinned window: a GPU input
        # pays a device gather and one D2H copy per destination, never a pageable copy of all of x
        # followed by a single-threaded CPU gather (8x slower at prefill on the H200 host).
        idxh, wh = topk_idx.cpu(), topk_weights.cpu()
        k = idxh.shape[1]
        layout = compute_send_layout(idxh, cfg.num_experts, w)
        num_send = layout.num_tokens_per_rank_W.tolist()
        starts = [sum(num_send[:r]) for r in range(w)]
        row_x = cfg.hidden * x.element_size()
        send_idx = layout.send_token_idx_S.to(dev)
        widths = [row_x, 16 * k]
        send_w = torch.where(layout.send_topk_idx_SK >= 0, wh.index_select(0, layout.send_token_idx_S),
                             torch.zeros((), dtype=torch.float32))
        meta = dense(torch.cat([layout.send_topk_idx_SK, float_bits_to_int64(send_w)], dim=1))  # [S, 2K]
        extra = layout.num_tokens_per_expert_E.view(w, cfg.num_local_experts)

        planes = {}
        for d in range(w):
            if d == me:
                continue
            n = num_send[d]
            xs = self.wire.send_slot(d, 0, n, row_x)
            ms = self.wire.send_slot(d, align(n * row_x), n, 16 * k)
            planes[d] = [xs, ms]

        def pack():
            for d, (xs, ms) in planes.items():
                n = num_send[d]
                idx = send_idx[starts[d]:starts[d] + n]
                # straight into the registered send slot (one copy; D2H for a GPU input)
                slot_rows = xs.view(x.dtype).view(n, cfg.hidden)
                if slot_rows.device == x.device:
                    torch.index_select(x, 0, idx, out=slot_rows)
                else:
                    slot_rows.copy_(x.index_select(0, idx))
                ms.copy_(as_bytes(meta[starts[d]:starts[d] + n]))

        return planes, widths, extra, layout, send_idx, meta, num_send, starts, k, dev, pack

    def _check_meta(self, src: int, m: torch.Tensor, k: int, counts_L: torch.Tensor) -> None:
        """A peer's routing rows are untrusted: local ids in [-1, L), at least one per row (a row
        is sent only to a rank owning one of its experts), weight 0 where the id is -1, finite
        weights, and per-expert counts equal to the header's."""
        L = self.cfg.num_local_experts
        ids, wbits = m[:, :k], m[:, k:]
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -1 or hi >= L:
                self.wire.violation(f"rank {src} sent local expert id {hi if hi >= L else lo}; expected "
                                f"-1 or 0 <= id < {L} (local experts)")
            if not bool((ids >= 0).any(1).all()):
                self.wire.violation(f"rank {src} sent a row that names none of this rank's experts")
            if bool(((ids < 0) & (wbits != 0)).any()):
                self.wire.violation(f"rank {src} sent a non-zero weight in a slot without an expert here")
            if not bool(torch.isfinite(int64_to_float_bits(wbits)).all()):
                self.wire.violation(f"rank {src} sent NaN/Inf routing weights")
        counted = torch.bincount(ids[ids >= 0], minlength=L)[:L]
        if not torch.equal(counted, counts_L.to(counted.dtype)):
            self.wire.violation(f"rank {src}'s per-expert counts {counts_L.tolist()} disagree with the "
                            f"expert ids of the {m.shape[0]} rows it sent ({counted.tolist()})")

    def _select_producer(self, dev: torch.device) -> None:
        wire = self.wire
        if self.producer == "torch":
            wire.use_triton = False
        elif self.producer == "triton" or dev.type == "cuda":
            wire.use_triton = triton_producer() is not None
            if self.producer == "triton" and not wire.use_triton:
                raise TransportError("producer='triton' needs triton (pip install triton)")
        else:
            wire.use_triton = False
        wire.triton_device = dev

    def _send_idx(self, handle, device: torch.device) -> torch.Tensor:
        """``[S]`` int64 source token of each sent row, on ``device`` (the handle keeps both)."""
        if device.type != "cpu":
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
        w, me = self.world_size, self.rank
        self._select_producer(x.device)
        idx = self._send_idx(handle, x.device)
        num_send = handle.num_send_per_rank
        starts = [sum(num_send[:r]) for r in range(w)]
        rows_to = {d: x.index_select(0, idx[starts[d]:starts[d] + num_send[d]])
                   for d in range(w) if d != me}
        self_rows = x.index_select(0, idx[starts[me]:starts[me] + num_send[me]])
        return self.wire.exchange_rows(OP_CACHED, rows_to, self_rows, list(handle.num_recv_per_rank))

    def combine(self, y, handle):
        self._check_usable("combine")
        return self._guarded(self._combine, y, handle, "combine input y")

    def _combine(self, y, handle, name: str):
        error = self._checked("combine", lambda: self._handle_error(handle)
                              or self._rows_error(name, y, handle.num_recv_tokens, handle))
        if error is not None:
            self.wire.round(OP_COMBINE, {}, [0], None, None, error)
        w, me = self.world_size, self.rank
        self._select_producer(y.device)
        yc = dense(y)  # stays on its device; rows go D2H straight into the send slots
        num_recv = handle.num_recv_per_rank
        starts = [sum(num_recv[:r]) for r in range(w)]
        idx = self._send_idx(handle, y.device)
        rows_to = {d: yc[starts[d]:starts[d] + num_recv[d]] for d in range(w) if d != me}
        self_rows = yc[starts[me]:starts[me] + num_recv[me]]
        n_send = list(handle.num_send_per_rank)
        row_bytes = yc.shape[1] * yc.element_size()
        if row_bytes > self.row_cap:  # column rounds: gather every block, then reduce
            back = self.wire.exchange_rows(OP_COMBINE, rows_to, self_rows, n_send)
            return reduce_rows_by_rank(back, idx, handle.num_send_per_rank,
                                       handle.num_tokens).to(y.dtype)
        # One round: reduce straight from the receive window (no gathered copy of the rows).
        # Float32 sum over source ranks in ascending order from +0.0, as reduce_rows_by_rank.
        acc = {}

        def local(_got):  # zeroed while the rows fly
            acc["out"] = self._scratch("acc", handle.num_tokens, yc.shape[1], yc.device,
                                       persistent=y.dtype != torch.float32).zero_()

        planes = {d: [as_bytes(t)] for d, t in rows_to.items()}
        _, got = self.wire.round(OP_COMBINE, planes, [row_bytes], n_send, None, None,
                                 row_format(self_rows), local=local)
        out = acc["out"]
        start = 0
        for r in range(w):
            n = n_send[r]
            if n:
                rows = self_rows if r == me else got[r][0].view(yc.dtype).view(n, yc.shape[1])
                if rows.device != out.device:
                    rows = rows.to(out.device)
                if rows.dtype != torch.float32:  # float32 copy in a reused buffer
                    rows = self._scratch("rows", n, yc.shape[1], out.device).copy_(rows)
                out.index_add_(0, idx[start:start + n], rows)
            start += n
        return out.to(y.dtype) if y.dtype != torch.float32 else out

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

