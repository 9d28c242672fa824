"""The ``proxy`` transport: command rings + a native multi-channel CPU proxy + a libfabric wire.

How bytes move (one *round*; dispatch is one round, combine one, dispatch_cached one; a row wider
than the window's row capacity is split into column rounds):

1. **Header** (the count exchange, on our own wire, not torch.distributed): every rank writes a
   small int64 header ``[status, op, rows, row_bytes, rows per local expert (L)]`` into each
   peer's header slot (message id ``2*seq``). A rank with invalid input still sends its header
   with ``status=1``, so every rank learns of the failure and raises instead of waiting. The
   header is also the handshake that makes window reuse safe: a rank sends its header for round
   n+1 only after it copied round n's data out, and nobody writes data into a peer's window before
   that peer's header for the same round arrived.
2. **Pack**: rows to each destination are packed contiguously (``index_select`` straight into the
   send slot of the registered window), planes back to back (x rows, then routing metadata).
3. **Describe**: each message is cut into ``chunk_bytes`` chunks; every chunk becomes a 16-byte
   descriptor (``efa_proxy.h``) written by torch code (CPU) or by a Triton kernel (GPU inputs)
   into channel ``j % K``'s ring; the ring's tail is published with a release store.
4. **Proxy**: the K native channel threads post ``fi_writedata`` into the peer's window with
   imm = (source rank, message id). The target threads count completions per (source, message)
   in host memory.
5. **Wait**: the receiver waits until each source's counter reaches that message's chunk count
   (known from the header), never inferring completion from order; then copies out.

Memory (allocated once at setup, registered with every channel's domain, pinned when CUDA is
present): ``[hdr send W][hdr recv 2 x W][data send W slots][data recv W slots]``; a slot holds
``max_tokens_per_rank`` rows of ``row_cap`` bytes (row_cap = H * elem + 16 * max_topk by default).
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

Options (``create_transport("proxy", ..., **options)``; env var in parentheses):
    provider (EFA_EP_PROXY_PROVIDER): ``efa`` if usable, else ``tcp``; also ``shm``.
    num_channels (EFA_EP_PROXY_CHANNELS): K proxy channels (threads + endpoints), default 2.
    inject_reorder (EFA_EP_PROXY_INJECT): test-only fault injection (0 off, 1 target-side hold/
        delay/shuffle/batch of completions + sender-side shuffled posting).
    timeout_s (EFA_EP_PROXY_TIMEOUT_S): deadline of every wait, default 60.
    chunk_bytes (EFA_EP_PROXY_CHUNK_BYTES): bytes per descriptor, default 256 KiB.
    max_topk: top-k the windows are sized for (default 8). max_row_bytes: override row_cap.
    ring_slots (1024), max_inflight (64 writes per channel), spin_us (EFA_EP_PROXY_SPIN_US, 200),
    cpu_base (EFA_EP_PROXY_CPU_BASE, -1 = no pinning): channel c pinned to CPU cpu_base + c.
    hmem (EFA_EP_PROXY_HMEM): ``auto`` (default: ``cuda`` over efa when libfabric offers FI_HMEM
        and CUDA is present, else ``off``), ``off`` (host window) or ``cuda`` (device window with
        FI_HMEM; raises at construction, naming the verb, if this libfabric cannot register CUDA
        memory: Debian's 1.17 build cannot, the AWS EFA installer's can).
"""
from __future__ import annotations

import os
import socket
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from efa_ep.kernels import proxy_native as native
from efa_ep.kernels.base import (
    DispatchHandle, DispatchInputError, Transport, TransportConfig, TransportError,
    compute_send_layout, float_bits_to_int64, int64_to_float_bits, nbytes_of,
    reduce_rows_by_rank, validate_dispatch_inputs,
)

_STATUS_OK, _STATUS_BAD = 0, 1
_OP_DISPATCH, _OP_COMBINE, _OP_CACHED = 1, 2, 3
_OP_NAMES = {_OP_DISPATCH: "dispatch", _OP_COMBINE: "combine", _OP_CACHED: "dispatch_cached"}
# Header int64 fields, then L per-expert counts (dispatch), then _ERR_BYTES of error text.
_H_STATUS, _H_OP, _H_ROWS, _H_ROW_BYTES, _H_CHUNKS, _H_TAG, _H_FORMAT = range(7)
_HDR_FIXED = 7
_ERR_BYTES = 512          # an input error's message travels to every peer (truncated)
_FOOTER_BYTES = 16        # [rows, round tag] after a data message's planes
_MSG_MASK = native.IMM_MSG_MASK  # message ids as carried in the immediate data
# Test-only header/data tampering (EFA_EP_PROXY_TAMPER); native kinds are in native.TAMPER_KINDS.
_PY_TAMPER = ("rows", "rows_consistent", "capacity", "chunks", "expert_counts", "tag", "ids")
_NUM_COUNTER_SLOTS = 64   # counter slots per source; a peer is never more than 2 messages ahead
_ALIGN = 16


# Providers on which hmem='auto' tries a device window first (GPUDirect RDMA into GPU memory).
_HMEM_AUTO_PROVIDERS = ("efa",)


def _align(n: int, a: int = _ALIGN) -> int:
    return -(-n // a) * a


def _default_provider() -> str:
    return "efa" if native.probe("efa") is None else "tcp"


def availability() -> Optional[str]:
    """None when the proxy can run here; else what is missing (headers, compiler, provider)."""
    problem = native.build_problem()
    if problem:
        return problem
    try:
        native.load()
    except RuntimeError as e:
        return str(e)
    provider = os.environ.get("EFA_EP_PROXY_PROVIDER") or _default_provider()
    why = native.probe(provider)
    if why:
        return f"libfabric provider {provider!r} unusable: {why}"
    return None


def _opt(options: dict, key: str, env: str, default, cast):
    if key in options:
        return cast(options[key])
    if env and os.environ.get(env):
        return cast(os.environ[env])
    return default


def describe_messages(dest, local_off, remote_off, nbytes, msg: int, chunk_bytes: int) -> torch.Tensor:
    """Cuts messages into chunks and encodes one 16-byte descriptor per chunk (reference for the
    Triton producer).

    Args:
        dest, local_off, remote_off, nbytes: ``[M]`` int64 CPU, one entry per message; offsets are
            16-byte aligned window offsets, nbytes > 0.
        msg: message id (20 bits). chunk_bytes: multiple of 16.
    Returns:
        ``[D, 2]`` int64 CPU descriptor words (see efa_proxy.h), chunks in message order.
    """
    nch = (nbytes + chunk_bytes - 1) // chunk_bytes
    total = int(nch.sum())
    if total == 0:
        return torch.empty(0, 2, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(nch)), nch)
    first = torch.cumsum(nch, 0) - nch
    k = torch.arange(total) - first[owner]
    off = k * chunk_bytes
    length = torch.minimum(nbytes[owner] - off, torch.full_like(off, chunk_bytes))
    w0 = (dest[owner] << 52) | ((msg & ((1 << native.MSG_BITS) - 1)) << 32) | length
    w1 = (((local_off[owner] + off) >> 4) << 32) | ((remote_off[owner] + off) >> 4)
    return torch.stack([w0, w1], 1)


_TRITON = None


def _triton_producer():
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
            w0 = (dest << 52) | ((msg.to(tl.int64) & 0xFFFFF) << 32) | length
            w1 = (((loff + off) >> 4) << 32) | ((roff + off) >> 4)
            slot = (tail0.to(tl.int64) + first + k) % ring_slots
            tl.store(ring_ptr + slot * 2, w0, mask=m)
            tl.store(ring_ptr + slot * 2 + 1, w1, mask=m)

    @triton.jit(do_not_specialize=["new_tail"])
    def _publish_tail_kernel(tail_ptr, new_tail):
        tl.atomic_xchg(tail_ptr, new_tail.to(tl.int64), sem="release", scope="sys")

    _TRITON = (_describe_to_ring_kernel, _publish_tail_kernel)
    return _TRITON


class _HostPtr:
    """A pinned host buffer handed to Triton as a raw pointer (UVA: the GPU can store into it)."""

    def __init__(self, t: torch.Tensor, offset_elems: int = 0):
        self._ptr = t.data_ptr() + offset_elems * t.element_size()
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._ptr


class _GroupError(TransportError):
    """Raised by every rank at the same point of a round from the same headers (the protocol stays
    in step): the transport remains usable."""


class _ProtocolViolation(TransportError):
    """A peer sent something the protocol forbids (counts beyond capacity, ids out of range,
    inconsistent header and data, stale round tag)."""


# Row formats carried in the header so that ranks moving the same bytes per row with different
# dtypes or widths are refused instead of reinterpreting each other's rows.
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4,
                torch.uint8: 5, torch.int8: 6, torch.int32: 7, torch.int64: 8}


def _row_format(t: torch.Tensor) -> int:
    return int(t.shape[1]) * 64 + _DTYPE_CODES.get(t.dtype, 63)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with standard row-major strides. ``contiguous()`` is not enough before a byte view:
    an empty or size-1-dim tensor counts as contiguous with any strides (``torch.where`` on an
    empty top-1 tensor yields stride (1, 0)) and ``view(uint8)`` then refuses it."""
    if t.is_contiguous() and t.numel() and (t.dim() == 0 or t.stride(-1) == 1):
        return t
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, D]`` any dtype -> ``[n, D * elem]`` uint8 view of a dense copy (or of ``t``)."""
    t = _dense(t)
    return t.view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


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

    def __init__(self, cfg: TransportConfig, group):
        super().__init__(cfg, group)
        o = dict(cfg.options)
        self.provider = _opt(o, "provider", "EFA_EP_PROXY_PROVIDER", None, str) or _default_provider()
        self.num_channels = _opt(o, "num_channels", "EFA_EP_PROXY_CHANNELS", 2, int)
        inj = _opt(o, "inject_reorder", "EFA_EP_PROXY_INJECT", 0, int)
        self.inject = (native.INJECT_TARGET | native.INJECT_SENDER) if inj == 1 else inj
        self.timeout_ms = int(1000 * _opt(o, "timeout_s", "EFA_EP_PROXY_TIMEOUT_S", 60.0, float))
        self.chunk_bytes = _align(_opt(o, "chunk_bytes", "EFA_EP_PROXY_CHUNK_BYTES", 256 << 10, int))
        self.ring_slots = _opt(o, "ring_slots", "", 1024, int)
        self.max_inflight = _opt(o, "max_inflight", "", 64, int)
        self.spin_us = _opt(o, "spin_us", "EFA_EP_PROXY_SPIN_US", 200, int)
        self.cpu_base = _opt(o, "cpu_base", "EFA_EP_PROXY_CPU_BASE", -1, int)
        # Test-only fault injection on this rank alone (never part of the agreement check):
        # EFA_EP_PROXY_TAMPER=<kind>, see _PY_TAMPER and native.TAMPER_KINDS.
        self._tamper = os.environ.get("EFA_EP_PROXY_TAMPER", "")
        if self._tamper and self._tamper not in _PY_TAMPER and self._tamper not in native.TAMPER_KINDS:
            raise TransportError(f"EFA_EP_PROXY_TAMPER={self._tamper!r}: expected one of "
                                 f"{sorted(set(_PY_TAMPER) | set(native.TAMPER_KINDS))}")
        # Where the window lives (module docstring). "auto" picks the device window only over
        # efa, where the NIC reads and writes GPU memory directly; on shm a device window is
        # slower than host staging (RESULTS.md) and tcp never offers FI_HMEM.
        self.hmem = _opt(o, "hmem", "EFA_EP_PROXY_HMEM", "auto", str)
        if self.hmem not in ("auto", "off", "cuda"):
            raise TransportError(f"hmem={self.hmem!r}: expected 'auto', 'off' (host window) or 'cuda'")
        self._hmem_auto = self.hmem == "auto"
        if self._hmem_auto:
            self.hmem = "cuda" if (self.provider in _HMEM_AUTO_PROVIDERS and torch.cuda.is_available()
                                   and native.probe(self.provider, hmem=True) is None) else "off"
        if self.hmem == "cuda" and not torch.cuda.is_available():
            raise TransportError("hmem='cuda' needs a CUDA device (torch.cuda.is_available() is False)")
        # descriptor producer: "torch" (host code), "triton" (kernel into the pinned ring), "auto"
        # (triton for CUDA inputs when triton is importable, else torch)
        self.producer = _opt(o, "producer", "EFA_EP_PROXY_PRODUCER", "auto", str)
        if self.producer not in ("auto", "torch", "triton"):
            raise TransportError(f"producer={self.producer!r}: expected auto, torch or triton")
        self._use_triton = False
        max_topk = _opt(o, "max_topk", "", 8, int)
        esize = nbytes_of(cfg.dtype)
        self.row_cap = _align(_opt(o, "max_row_bytes", "", cfg.hidden * esize + 16 * max_topk, int))
        if self.num_channels < 1 or self.num_channels > 64:
            raise TransportError(f"num_channels={self.num_channels} must be in 1..64")
        if self.chunk_bytes < _ALIGN or self.chunk_bytes >= (1 << 32):
            raise TransportError(f"chunk_bytes={self.chunk_bytes} must be in [16, 4 GiB)")
        if self.timeout_ms < 1:
            raise TransportError(f"timeout_s={self.timeout_ms / 1000} must be > 0")
        if self.world_size > native.MAX_RANKS:
            raise TransportError(f"EP group of {self.world_size} ranks > {native.MAX_RANKS} (imm has 12 rank bits)")
        w, L = self.world_size, cfg.num_local_experts
        self.hdr_fields = _HDR_FIXED + L
        self.hdr_len = self.hdr_fields * 8 + _ERR_BYTES  # bytes a header message carries
        self.hdr_bytes = _align(self.hdr_len)
        self.hdr_chunks = -(-self.hdr_len // self.chunk_bytes)  # the header may span several chunks
        # A slot carries at most max_tokens_per_rank rows (a rank sends each token once per
        # destination), plus alignment slack for up to 4 planes and the footer.
        self.slot_bytes = _align(max(1, cfg.max_tokens_per_rank) * self.row_cap) + 4 * _ALIGN + _FOOTER_BYTES
        # Layout: [header send W][data send W slots][receive region per source r: header parity 0,
        # header parity 1, data slot]. Header receive slots are double-buffered by round parity: a
        # peer that expects no rows from us can finish round n and send its round n+1 header before
        # we read its round n header; it cannot send round n+2's before we sent ours for n+1.
        # Source r may write only into its receive region (its own registration and key).
        self.off_hdr_send = 0
        self.off_data_send = w * self.hdr_bytes
        self.off_recv = self.off_data_send + w * self.slot_bytes
        # + a 16-byte pad at the region's end that liveness probes write into (nobody reads it)
        self.region_bytes = 2 * self.hdr_bytes + self.slot_bytes + _ALIGN
        self.window_bytes = self.off_recv + w * self.region_bytes
        if self.window_bytes >= (1 << 36):
            raise TransportError(
                f"window of {self.window_bytes} bytes exceeds 64 GiB (descriptor offsets); lower "
                f"max_tokens_per_rank={cfg.max_tokens_per_rank} or hidden={cfg.hidden}")

        pin = torch.cuda.is_available()
        self._alloc_window()
        self.rings = torch.zeros(self.num_channels, self.ring_slots, 2, dtype=torch.int64, pin_memory=pin)
        self.ring_ctrl = torch.zeros(self.num_channels, native.CTRL_STRIDE, dtype=torch.int64, pin_memory=pin)
        self.counters = torch.zeros(w * _NUM_COUNTER_SLOTS, dtype=torch.int64, pin_memory=pin)
        self._tails = [0] * self.num_channels
        self._next_channel = 0
        self._seq = 0
        self._broken: Optional[str] = None
        self.engine = None
        self.gen = 0
        self.bind_address = ""
        self._engine_rss = 0
        self._setup()

    # Setup ----------------------------------------------------------------------------------
    def _alloc_window(self) -> None:
        if self.hmem == "cuda":
            self.hmem_device = torch.cuda.current_device()
            self.window = torch.zeros(self.window_bytes, dtype=torch.uint8, device=f"cuda:{self.hmem_device}")
        else:
            # Host memory the NIC writes into and the GPU may read: pinned so a kernel can reach it.
            self.hmem_device = -1
            self.window = torch.zeros(self.window_bytes, dtype=torch.uint8,
                                      pin_memory=torch.cuda.is_available())

    def _start_engine(self) -> None:
        rss0 = _rss_bytes()
        try:
            self.engine = native.Engine(
                self.provider, self.rank, self.world_size, self.num_channels, self.window.data_ptr(),
                self.window_bytes, self.rings.data_ptr(), self.ring_slots, self.ring_ctrl.data_ptr(),
                self.counters.data_ptr(), _NUM_COUNTER_SLOTS, self.max_inflight, self.spin_us,
                self.inject, 1234 + self.rank, self.cpu_base, self.timeout_ms, self.hmem_device,
                recv_off=self.off_recv, recv_stride=self.region_bytes, key_seed=None,
                node=self.bind_address, gen=self.gen)
        except native.NativeError as ex:
            where = (f"a CUDA window on cuda:{self.hmem_device} (hmem='cuda'; hmem='off' stages "
                     f"through host memory instead)" if self.hmem == "cuda" else "a host window")
            raise TransportError(f"rank {self.rank}: the proxy engine over libfabric provider "
                                 f"{self.provider!r} with {where} failed to start: {ex}") from ex
        self._engine_rss = max(0, _rss_bytes() - rss0)

    def _settings(self) -> tuple:
        return (self.provider, self.num_channels, self.chunk_bytes, self.row_cap, self.window_bytes,
                self.inject, self.hmem, self.timeout_ms)

    def _agree(self, payload) -> list:
        """All-gathers (settings, payload); refuses setup on every rank when settings differ."""
        settings = self._settings()
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, (settings, payload), group=self.group)
        if any(s != gathered[0][0] for s, _ in gathered):
            if self.engine is not None:
                self.close(barrier=False)
            groups: dict = {}
            for r, (s, _) in enumerate(gathered):
                groups.setdefault(s, []).append(r)
            raise TransportError(
                f"rank {self.rank}: proxy settings (provider, num_channels, chunk_bytes, row_cap, "
                f"window_bytes, inject, hmem, timeout_ms) differ across ranks: "
                + "; ".join(f"ranks {rs}: {s}" for s, rs in groups.items())
                + " (check the EFA_EP_PROXY_* env vars and timeout_s on those ranks)")
        return [p for _, p in gathered]

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
            self._alloc_window()
            self._start_engine()
        w, k = self.world_size, self.num_channels
        mine = [self.engine.local_info(c)[:2] for c in range(k)]
        # Endpoint names (public) travel over the torch group once; region keys go only to the
        # source that may use them (all_to_all: rank r receives the keys of its regions at peers).
        gathered = self._agree(mine)
        keys_out = torch.zeros(w, k, 2, dtype=torch.int64)
        for src in range(w):
            for c in range(k):
                key, base = self.engine.region_info(c, src)
                keys_out[src, c, 0] = key - (1 << 64) if key >= (1 << 63) else key
                keys_out[src, c, 1] = base - (1 << 64) if base >= (1 << 63) else base
        keys_in = torch.empty_like(keys_out)
        dist.all_to_all_single(keys_in, keys_out, group=self.group)
        keys_in = [[(int(keys_in[d, c, 0]) & ((1 << 64) - 1), int(keys_in[d, c, 1]) & ((1 << 64) - 1))
                    for c in range(k)] for d in range(w)]
        for c in range(k):
            names = b"".join(g[c][0] for g in gathered)
            self.engine.set_peers(c, names, [g[c][1] for g in gathered],
                                  [keys_in[d][c][0] for d in range(w)],
                                  [keys_in[d][c][1] for d in range(w)], self.timeout_ms)
        dist.barrier(group=self.group)  # every AV is populated before anyone writes
        self._warm_up()
        if self._tamper in native.TAMPER_KINDS:
            self.engine.tamper(self._tamper)

    def _warm_up(self) -> None:
        """Round 0: every channel writes one small message to every peer and waits for all of
        theirs, so connections (tcp/rxm connects lazily) exist before the first dispatch."""
        w, me = self.world_size, self.rank
        peers = [r for r in range(w) if r != me]
        msg = (2 * self._seq) & _MSG_MASK
        self.engine.expect(self._seq)
        hdr_in = self._hdr_recv_off(me, self._seq)
        self._seq += 1
        if not peers:
            return
        self._window_ready()  # torch.zeros of a device window is asynchronous
        p = torch.tensor(peers, dtype=torch.int64)
        for c in range(self.num_channels):
            self._push_channel(c, describe_messages(
                p, self.off_hdr_send + p * self.hdr_bytes, torch.full_like(p, hdr_in),
                torch.full_like(p, 16), msg, self.chunk_bytes))
        self._wait(msg, peers, [self.num_channels] * len(peers))

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
        """Per-channel native counters (popped, posted, tx_done, arrived, eagain, ...)."""
        return self.engine.stats()

    def memory_report(self) -> dict:
        """Bytes this transport holds: the registered window (``window``, of which each source's
        receive region is ``region``), rings, counters, and the resident memory the engine's
        endpoints added at start (``engine_rss``, measured; ``per_channel`` = engine_rss / K:
        provider buffers, completion queues, registrations)."""
        return {"window": self.window_bytes, "region": self.region_bytes,
                "rings": self.rings.numel() * 8, "counters": self.counters.numel() * 8,
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
        transport broken (its peers' writes for this round may still land)."""
        try:
            return fn(*args)
        except (DispatchInputError, _GroupError):
            raise
        except BaseException as e:
            if self._broken is None:
                self._broken = f"{type(e).__name__}: {e}"
            raise

    def _violation(self, msg: str):
        raise _ProtocolViolation(f"rank {self.rank}: protocol violation: {msg}")

    # Wire primitives ------------------------------------------------------------------------
    def _window_view(self, off: int, nbytes: int) -> torch.Tensor:
        return self.window[off:off + nbytes]

    def _hdr_recv_off(self, src: int, seq: int) -> int:
        return self.off_recv + src * self.region_bytes + (seq % 2) * self.hdr_bytes

    def _data_recv_off(self, src: int) -> int:
        return self.off_recv + src * self.region_bytes + 2 * self.hdr_bytes

    def _window_ready(self) -> None:
        """A device window is written by kernels on the current stream: they must have finished
        before a descriptor hands the bytes to the provider, and our copies out of the receive
        side must have finished before a header lets peers overwrite it. No-op for host windows."""
        if self.window.is_cuda:
            torch.cuda.current_stream(self.window.device).synchronize()

    def _push(self, descs: torch.Tensor) -> None:
        """Writes descriptors ``[D, 2]`` int64 into the rings (descriptor j -> channel (j + r) % K,
        r rotating per call so small messages spread over channels) and publishes each tail."""
        n = descs.shape[0]
        if n == 0:
            return
        k = self.num_channels
        start = self._next_channel
        self._next_channel = (start + n) % k
        for j in range(min(k, n)):
            self._push_channel((start + j) % k, descs[j::k])

    def _push_channel(self, c: int, mine: torch.Tensor) -> None:
        """Torch code writes descriptors into ring c's slots (wrapping), then publishes the tail
        with a release store (native call); waits for free slots first (back-pressure)."""
        done = 0
        while done < mine.shape[0]:
            cnt = min(mine.shape[0] - done, self.ring_slots)
            self._native(self.engine.ring_wait_space, c, cnt, self.timeout_ms)
            tail = self._tails[c]
            s0 = tail % self.ring_slots
            first = min(cnt, self.ring_slots - s0)
            self.rings[c, s0:s0 + first].copy_(mine[done:done + first])
            if cnt > first:  # wrap around
                self.rings[c, :cnt - first].copy_(mine[done + first:done + cnt])
            self._tails[c] = tail + cnt
            self.engine.ring_publish(c, self._tails[c])
            done += cnt

    def _push_triton(self, dests, loffs, roffs, sizes, msg: int) -> None:
        """GPU producer: message m goes to channel (r + m) % K; per channel one launch writes every
        chunk's descriptor into the pinned ring, a second publishes the tail (release, sys)."""
        describe, publish = _triton_producer()
        dev = self._triton_device
        k = self.num_channels
        start = self._next_channel
        self._next_channel = (start + len(dests)) % k
        for j in range(min(k, len(dests))):
            c = (start + j) % k
            sel = slice(j, None, k)
            nb = torch.tensor(sizes[sel], dtype=torch.int64)
            nch = (nb + self.chunk_bytes - 1) // self.chunk_bytes
            total = int(nch.sum())
            if total > self.ring_slots:  # more than the ring holds: the host path handles it
                self._push_channel(c, describe_messages(
                    torch.tensor(dests[sel]), torch.tensor(loffs[sel]), torch.tensor(roffs[sel]),
                    nb, msg, self.chunk_bytes))
                continue
            first = torch.cumsum(nch, 0) - nch
            table = torch.stack([torch.tensor(dests[sel]), torch.tensor(loffs[sel]),
                                 torch.tensor(roffs[sel]), nb, first]).to(dev)
            self._native(self.engine.ring_wait_space, c, total, self.timeout_ms)  # back-pressure
            tail = self._tails[c]
            # Under TRITON_INTERPRET (CPU tests) the kernel needs tensors (it copies them back);
            # on a GPU it gets the raw pinned-host address.
            interp = os.environ.get("TRITON_INTERPRET") == "1"
            ring = self.rings[c] if interp else _HostPtr(self.rings[c])
            tail_word = self.ring_ctrl[c, native.CTRL_TAIL:native.CTRL_TAIL + 1]
            describe[(table.shape[1],)](table[0], table[1], table[2], table[3], table[4], ring, tail,
                                        msg, self.chunk_bytes, self.ring_slots, BLOCK=64)
            self._tails[c] = tail + total
            publish[(1,)](tail_word if interp else _HostPtr(tail_word), self._tails[c])
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def _native(self, fn, *args) -> None:
        try:
            fn(*args)
        except native.NativeError as ex:
            raise TransportError(str(ex)) from ex

    def _wait(self, msg: int, srcs: List[int], expected: List[int]) -> None:
        if not srcs:
            return
        s = torch.tensor(srcs, dtype=torch.int32)
        e = torch.tensor(expected, dtype=torch.int64)
        self._native(self.engine.wait_counters, msg, s.data_ptr(), e.data_ptr(), len(srcs), True,
                     self.timeout_ms)

    def _quiesce(self) -> None:
        """Waits until our previous writes completed locally, so the send side may be rewritten."""
        self._native(self.engine.wait_idle, self.timeout_ms)

    def _chunks(self, nbytes: int) -> int:
        return -(-nbytes // self.chunk_bytes)

    def _data_chunks(self, rows: int, widths: List[int]) -> int:
        """Chunks of one data message: each plane cut into chunks, plus the footer."""
        return sum(self._chunks(rows * wd) for wd in widths) + 1 if rows else 0

    def _round(self, op: int, planes: Dict[int, List[torch.Tensor]], widths: List[int],
               n_recv: Optional[List[int]], extra_WL: Optional[torch.Tensor],
               error: Optional[str], fmt: int = 0):
        """One header + data exchange with every peer (collective).

        Args:
            planes: dest rank (!= self) -> list of ``[n, widths[p]]`` uint8 tensors, any device (rows to
                that rank); empty when ``error``.
            widths: bytes per row of each plane (same on every rank).
            n_recv: rows expected from each rank, or None (dispatch: learned from the headers).
            extra_WL: ``[W, L]`` int64 CPU, per-destination extra header fields, or None.
            error: this rank's input error (sent with the status, then raised on every rank).
            fmt: row format (columns and dtype) every rank must share, 0 when not applicable.
        Returns:
            (headers ``[W, F]`` int64 CPU (row ``self.rank`` unset), {src: [plane views into the
            receive window]}). The views are valid until the next round: copy them out. Every
            header field was checked against this rank's capacities before the data moved.
        """
        w, me = self.world_size, self.rank
        peers = [r for r in range(w) if r != me]
        seq = self._seq
        self._seq += 1
        msg_hdr, msg_data = (2 * seq) & _MSG_MASK, (2 * seq + 1) & _MSG_MASK
        tag = (self.gen << 32) | (seq & 0xFFFFFFFF)
        row_bytes = sum(widths)
        what = _OP_NAMES[op]
        self._quiesce()
        self.engine.expect(seq)  # from here on, a peer's message of another round is an error

        # 1. headers (also the "my window is free" handshake and the status carrier)
        hdr_raw = self._window_view(self.off_hdr_send, w * self.hdr_bytes).view(w, self.hdr_bytes)
        hdr_raw.zero_()
        hdr = hdr_raw[:, :self.hdr_fields * 8].view(torch.int64)
        hdr[:, _H_STATUS] = _STATUS_BAD if error else _STATUS_OK
        hdr[:, _H_OP] = op
        hdr[:, _H_ROW_BYTES] = row_bytes
        hdr[:, _H_TAG] = tag
        hdr[:, _H_FORMAT] = fmt
        if error:
            text = error.encode("utf-8", errors="replace")[:_ERR_BYTES - 1]
            error = text.decode("utf-8", errors="ignore")  # what peers will read, byte for byte
            hdr_raw[:, self.hdr_fields * 8:self.hdr_fields * 8 + len(text)].copy_(
                torch.frombuffer(bytearray(text), dtype=torch.uint8))
        else:
            for d, pl in planes.items():
                n = pl[0].shape[0] if pl else 0
                hdr[d, _H_ROWS] = n
                hdr[d, _H_CHUNKS] = self._data_chunks(n, widths)
            if extra_WL is not None:
                hdr[:, _HDR_FIXED:_HDR_FIXED + extra_WL.shape[1]] = extra_WL
            self._tamper_header(op, hdr, planes, widths)
        self._window_ready()
        if peers:
            p = torch.tensor(peers, dtype=torch.int64)
            self._push(describe_messages(
                p, self.off_hdr_send + p * self.hdr_bytes,
                torch.full_like(p, self._hdr_recv_off(me, seq)),
                torch.full_like(p, self.hdr_len), msg_hdr, self.chunk_bytes))
        self._wait(msg_hdr, peers, [self.hdr_chunks] * len(peers))
        got = torch.zeros(w, self.hdr_fields, dtype=torch.int64)
        errs = {me: error} if error else {}
        for r in peers:
            raw = self._window_view(self._hdr_recv_off(r, seq), self.hdr_len).to("cpu", copy=True)
            got[r] = raw[:self.hdr_fields * 8].view(torch.int64)
            st = int(got[r, _H_STATUS])
            if st == _STATUS_BAD:
                text = bytes(raw[self.hdr_fields * 8:].tolist()).split(b"\0", 1)[0]
                errs[r] = text.decode("utf-8", errors="replace") or f"rank {r}: (no message)"
            elif st != _STATUS_OK:
                self._violation(f"rank {r}'s {what} header has status {st}")
        if errs:
            # the same message on every rank: every rank read the same statuses and texts
            bad = sorted(errs)
            raise DispatchInputError(f"proxy {what}: invalid input on rank(s) {bad}: "
                                     + "; ".join(errs[r] for r in bad))
        for r in peers:
            if int(got[r, _H_TAG]) != tag:
                self._violation(f"rank {r}'s {what} header carries round tag {int(got[r, _H_TAG]):#x}, "
                                f"expected {tag:#x} (a stale or replayed header)")
        views = {r: (int(got[r, _H_OP]), int(got[r, _H_ROW_BYTES]), int(got[r, _H_FORMAT]))
                 for r in peers}
        views[me] = (op, row_bytes, fmt)
        if len(set(views.values())) > 1:
            raise _GroupError(
                f"proxy: ranks are in different operations or row formats: "
                + ", ".join(f"rank {r}: {_OP_NAMES.get(v[0], v[0])} {v[1]} bytes/row format {v[2]}"
                            for r, v in sorted(views.items()))
                + "; every rank must call the same operations in order with rows of one "
                  "dtype and width")
        rows_from = {}
        cap = self.cfg.max_tokens_per_rank
        for r in peers:
            n, ch = int(got[r, _H_ROWS]), int(got[r, _H_CHUNKS])
            if not 0 <= n <= cap:
                self._violation(f"rank {r} declares {n} {what} rows; capacity is 0..{cap} "
                                f"(max_tokens_per_rank)")
            if ch != self._data_chunks(n, widths):
                self._violation(f"rank {r} declares {n} {what} rows in {ch} chunks; {n} rows of "
                                f"{row_bytes} bytes are {self._data_chunks(n, widths)} chunks")
            rows_from[r] = n
        if n_recv is not None:
            mism = [r for r in peers if rows_from[r] != n_recv[r]]
            if mism:
                raise TransportError(
                    f"rank {me}: {what}: ranks {mism} send {[rows_from[r] for r in mism]} rows, "
                    f"the handle expects {[n_recv[r] for r in mism]}; handles from different "
                    f"dispatches?")

        # 2-3. pack into the send slots, describe, push (each plane, then the footer)
        dests, loffs, roffs, sizes = [], [], [], []
        for d, pl in planes.items():
            n = pl[0].shape[0] if pl else 0
            if n == 0:
                continue
            base = self.off_data_send + d * self.slot_bytes
            rbase = self._data_recv_off(me)
            off = 0
            for t, wdt in zip(pl, widths):
                nb = n * wdt
                dst = self._window_view(base + off, nb).view(n, wdt)
                if t.data_ptr() != dst.data_ptr():
                    dst.copy_(t)
                if nb:
                    dests.append(d); loffs.append(base + off); roffs.append(rbase + off); sizes.append(nb)
                off += _align(nb)
            # footer: rows and round tag, checked by the receiver against the header
            foot = self._window_view(base + off, _FOOTER_BYTES)
            foot.copy_(torch.tensor([n, tag], dtype=torch.int64).view(torch.uint8))
            dests.append(d); loffs.append(base + off); roffs.append(rbase + off); sizes.append(_FOOTER_BYTES)
        if dests:
            self._window_ready()
            if self._use_triton:
                self._push_triton(dests, loffs, roffs, sizes, msg_data)
            else:
                self._push(describe_messages(torch.tensor(dests), torch.tensor(loffs),
                                             torch.tensor(roffs), torch.tensor(sizes), msg_data,
                                             self.chunk_bytes))

        # 5. wait for every chunk of every source's message, check its footer, hand out views
        srcs = [r for r in peers if rows_from[r]]
        self._wait(msg_data, srcs, [self._data_chunks(rows_from[r], widths) for r in srcs])
        out = {}
        for r in peers:
            n = rows_from[r]
            base = self._data_recv_off(r)
            views_r, off = [], 0
            for wdt in widths:
                views_r.append(self._window_view(base + off, n * wdt).view(n, wdt))
                off += _align(n * wdt)
            if n:
                foot = self._window_view(base + off, _FOOTER_BYTES).to("cpu", copy=True).view(torch.int64)
                if int(foot[0]) != n or int(foot[1]) != tag:
                    self._violation(
                        f"rank {r}'s {what} data says {int(foot[0])} rows (round tag "
                        f"{int(foot[1]):#x}), its header {n} rows (tag {tag:#x})")
            out[r] = views_r
        return got, out

    def _tamper_header(self, op: int, hdr: torch.Tensor, planes, widths) -> None:
        """Test-only (EFA_EP_PROXY_TAMPER): corrupts this rank's first dispatch header to a peer
        it sends rows to, once."""
        kind = self._tamper
        if kind not in _PY_TAMPER or op != _OP_DISPATCH:
            return
        d = next((d for d, pl in planes.items() if pl and pl[0].shape[0]), None)
        if d is None:
            return
        if kind == "rows":
            hdr[d, _H_ROWS] += 3
        elif kind == "rows_consistent":  # chunk count matching the lie: only the footer tells
            hdr[d, _H_ROWS] += 3
            hdr[d, _H_CHUNKS] = self._data_chunks(int(hdr[d, _H_ROWS]), widths)
        elif kind == "capacity":
            hdr[d, _H_ROWS] = self.cfg.max_tokens_per_rank + 1
        elif kind == "chunks":
            hdr[d, _H_CHUNKS] += 1
        elif kind == "expert_counts":
            hdr[d, _HDR_FIXED] += 1
        elif kind == "tag":
            hdr[d, _H_TAG] -= 2
        elif kind == "ids":
            ids = planes[d][1].view(torch.int64)  # the meta plane in the send slot: ids first
            ids[0, 0] = 999
        self._tamper = ""

    def _send_slot(self, d: int, off: int, n: int, width: int) -> torch.Tensor:
        """Writable ``[n, width]`` uint8 view of dest d's send slot at byte offset off."""
        return self._window_view(self.off_data_send + d * self.slot_bytes + off, n * width).view(n, width)

    def _exchange_rows(self, op: int, rows_to: Dict[int, torch.Tensor], self_rows: torch.Tensor,
                       n_recv: List[int]) -> torch.Tensor:
        """Moves ``[n, D]`` row blocks (any dtype, all on one device) to each rank and
        returns the received rows concatenated in source-rank order (this rank's block =
        ``self_rows``), on that device. Rows wider than the window's row capacity go in column
        rounds. Each block is copied once into the pinned send slot and once out of the window."""
        me, w = self.rank, self.world_size
        d_cols, dtype = self_rows.shape[1], self_rows.dtype
        row_bytes = d_cols * self_rows.element_size()
        fmt = _row_format(self_rows)
        as_bytes = {d: _as_bytes(t) for d, t in rows_to.items()}
        recv = {r: torch.empty(n_recv[r], row_bytes, dtype=torch.uint8, device=self_rows.device)
                for r in range(w) if r != me}
        for c0 in range(0, max(row_bytes, 1), self.row_cap):
            c1 = min(row_bytes, c0 + self.row_cap)
            planes = {d: [t[:, c0:c1]] for d, t in as_bytes.items()}  # _round copies into the slot
            _, got = self._round(op, planes, [c1 - c0], n_recv, None, None, fmt)
            for r, views in got.items():
                recv[r][:, c0:c1].copy_(views[0])
            if row_bytes == 0:
                break
        blocks = [self_rows if r == me else recv[r].view(dtype).view(n_recv[r], d_cols) for r in range(w)]
        return torch.cat(blocks, 0) if blocks else self_rows

    # Input checks (local; their result travels in the header) ---------------------------------
    def _device_error(self, **tensors) -> Optional[str]:
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "cuda"):
                return (f"rank {self.rank}: {name} is on device {t.device}; the proxy transport "
                        f"moves cpu or cuda tensors")
        return None

    def _handle_error(self, handle) -> Optional[str]:
        w = self.world_size
        if not isinstance(handle, DispatchHandle):
            return f"rank {self.rank}: handle must be a DispatchHandle, got {type(handle).__name__}"
        if len(handle.num_send_per_rank) != w or len(handle.num_recv_per_rank) != w:
            return (f"rank {self.rank}: handle has per-rank counts for "
                    f"{len(handle.num_send_per_rank)} ranks, the group has {w}")
        return None

    def _rows_error(self, name: str, t, rows: int, handle) -> Optional[str]:
        me = self.rank
        if not isinstance(t, torch.Tensor):
            return f"rank {me}: {name} must be a tensor, got {type(t).__name__}"
        err = self._device_error(**{name: t})
        if err:
            return err
        if t.dim() != 2 or t.shape[0] != rows:
            return f"rank {me}: {name} must be [{rows}, D], got {tuple(t.shape)}"
        if not t.dtype.is_floating_point:
            return f"rank {me}: {name} must be a floating-point tensor, got {t.dtype}"
        if t.device != handle.topk_idx.device:
            return (f"rank {me}: {name} is on {t.device}, the dispatch's tensors were on "
                    f"{handle.topk_idx.device}")
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
            self._round(_OP_DISPATCH, {}, [0], None, None, error)  # raises on every rank
        try:
            packed = self._pack_dispatch(x, topk_idx, topk_weights)
        except Exception as e:
            # a local failure while packing still reaches every peer through the status
            self._round(_OP_DISPATCH, {}, [0], None, None,
                        f"rank {me}: dispatch failed while packing rows: {type(e).__name__}: {e}")
        planes, widths, extra, layout, send_idx, meta, num_send, starts, k, dev = packed
        got, recv = self._round(_OP_DISPATCH, planes, widths, None, extra, None, k)
        num_recv = [num_send[me] if r == me else int(got[r, _H_ROWS]) for r in range(w)]
        n_recv = sum(num_recv)
        # Copy out of the window (reused next round) into x's device; the blocking H2D copies
        # from pinned memory return only once the window has been read.
        recv_x = torch.empty(n_recv, cfg.hidden, dtype=x.dtype, device=dev)
        mb, row = [], 0
        for r in range(w):
            n = num_recv[r]
            if r == me:
                torch.index_select(x, 0, send_idx[starts[me]:starts[me] + n], out=recv_x[row:row + n])
                mb.append(meta[starts[me]:starts[me] + n])
            else:
                recv_x[row:row + n].copy_(recv[r][0].view(x.dtype).view(n, cfg.hidden))
                m = recv[r][1].view(torch.int64).view(n, 2 * k).cpu()
                self._check_meta(r, m, k, got[r, _HDR_FIXED:])
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
            state={"send_token_idx_cpu": layout.send_token_idx_S})
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle

    def _pack_dispatch(self, x, topk_idx, topk_weights):
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
        meta = _dense(torch.cat([layout.send_topk_idx_SK, float_bits_to_int64(send_w)], dim=1))  # [S, 2K]
        extra = layout.num_tokens_per_expert_E.view(w, cfg.num_local_experts)

        planes = {}
        self._quiesce()  # the previous round's writes must have left the send slots
        for d in range(w):
            if d == me:
                continue
            n = num_send[d]
            idx = send_idx[starts[d]:starts[d] + n]
            # pack straight into the registered send slot (one copy; D2H for a GPU input)
            xs = self._send_slot(d, 0, n, row_x)
            slot_rows = xs.view(x.dtype).view(n, cfg.hidden)
            if slot_rows.device == x.device:
                torch.index_select(x, 0, idx, out=slot_rows)
            else:
                slot_rows.copy_(x.index_select(0, idx))
            ms = self._send_slot(d, _align(n * row_x), n, 16 * k)
            ms.copy_(_as_bytes(meta[starts[d]:starts[d] + n]))
            planes[d] = [xs, ms]
        return planes, widths, extra, layout, send_idx, meta, num_send, starts, k, dev

    def _check_meta(self, src: int, m: torch.Tensor, k: int, counts_L: torch.Tensor) -> None:
        """A peer's routing rows are untrusted: local ids in [-1, L), at least one per row (a row
        is sent only to a rank owning one of its experts), weight 0 where the id is -1, finite
        weights, and per-expert counts equal to the header's."""
        L = self.cfg.num_local_experts
        ids, wbits = m[:, :k], m[:, k:]
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -1 or hi >= L:
                self._violation(f"rank {src} sent local expert id {hi if hi >= L else lo}; expected "
                                f"-1 or 0 <= id < {L} (local experts)")
            if not bool((ids >= 0).any(1).all()):
                self._violation(f"rank {src} sent a row that names none of this rank's experts")
            if bool(((ids < 0) & (wbits != 0)).any()):
                self._violation(f"rank {src} sent a non-zero weight in a slot without an expert here")
            if not bool(torch.isfinite(int64_to_float_bits(wbits)).all()):
                self._violation(f"rank {src} sent NaN/Inf routing weights")
        counted = torch.bincount(ids[ids >= 0], minlength=L)[:L]
        if not torch.equal(counted, counts_L.to(counted.dtype)):
            self._violation(f"rank {src}'s per-expert counts {counts_L.tolist()} disagree with the "
                            f"expert ids of the {m.shape[0]} rows it sent ({counted.tolist()})")

    def _select_producer(self, dev: torch.device) -> None:
        if self.producer == "torch":
            self._use_triton = False
        elif self.producer == "triton" or dev.type == "cuda":
            self._use_triton = _triton_producer() is not None
            if self.producer == "triton" and not self._use_triton:
                raise TransportError("producer='triton' needs triton (pip install triton)")
        else:
            self._use_triton = False
        self._triton_device = dev

    def _send_idx(self, handle, device: torch.device) -> torch.Tensor:
        """``[S]`` int64 source token of each sent row, on ``device`` (the handle keeps both)."""
        if device.type != "cpu":
            return handle.send_token_idx.to(device)
        st = handle.state if isinstance(handle.state, dict) else {}
        return st.get("send_token_idx_cpu", handle.send_token_idx.cpu())

    def dispatch_cached(self, x, handle):
        self._check_usable("dispatch_cached")
        return self._guarded(self._dispatch_cached, x, handle)

    def _dispatch_cached(self, x, handle):
        error = self._checked("dispatch_cached", lambda: self._handle_error(handle)
                              or self._rows_error("dispatch_cached input x", x, handle.num_tokens, handle))
        if error is not None:
            self._round(_OP_CACHED, {}, [0], None, None, error)
        w, me = self.world_size, self.rank
        self._select_producer(x.device)
        idx = self._send_idx(handle, x.device)
        num_send = handle.num_send_per_rank
        starts = [sum(num_send[:r]) for r in range(w)]
        rows_to = {d: x.index_select(0, idx[starts[d]:starts[d] + num_send[d]])
                   for d in range(w) if d != me}
        self_rows = x.index_select(0, idx[starts[me]:starts[me] + num_send[me]])
        return self._exchange_rows(_OP_CACHED, rows_to, self_rows, list(handle.num_recv_per_rank))

    def combine(self, y, handle):
        self._check_usable("combine")
        return self._guarded(self._combine, y, handle, "combine input y")

    def _combine(self, y, handle, name: str):
        error = self._checked("combine", lambda: self._handle_error(handle)
                              or self._rows_error(name, y, handle.num_recv_tokens, handle))
        if error is not None:
            self._round(_OP_COMBINE, {}, [0], None, None, error)
        w, me = self.world_size, self.rank
        self._select_producer(y.device)
        yc = _dense(y)  # stays on its device; rows go D2H straight into the send slots
        num_recv = handle.num_recv_per_rank
        starts = [sum(num_recv[:r]) for r in range(w)]
        rows_to = {d: yc[starts[d]:starts[d] + num_recv[d]] for d in range(w) if d != me}
        self_rows = yc[starts[me]:starts[me] + num_recv[me]]
        back = self._exchange_rows(_OP_COMBINE, rows_to, self_rows, list(handle.num_send_per_rank))
        return reduce_rows_by_rank(back, self._send_idx(handle, y.device), handle.num_send_per_rank,
                                   handle.num_tokens).to(y.dtype)

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
            self._round(_OP_COMBINE, {}, [0], None, None, error)
        masked = torch.where(handle.recv_topk_idx >= 0, g.float(),
                             torch.zeros((), dtype=torch.float32, device=g.device))
        return self._combine(_dense(masked), handle, "combine_topk_weights grad_recv_topk_weights")
