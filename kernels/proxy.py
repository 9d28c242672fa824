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
_HDR_FIXED = 4            # status, op, rows, row_bytes
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


class ProxyTransport(Transport):
    """CPU-proxy transport over libfabric; see the module docstring for the protocol.

    Synchronization: every call is collective over the EP group and blocks the calling thread
    until this rank's outputs are complete (the waits are bounded by ``timeout_s`` and name the
    peer and message on expiry). GPU inputs are staged through host memory on the current stream
    (the call synchronizes it). Buffers (windows, rings, counters) are allocated once and reused.

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
        if self.world_size > native.MAX_RANKS:
            raise TransportError(f"EP group of {self.world_size} ranks > {native.MAX_RANKS} (imm has 12 rank bits)")
        w, L = self.world_size, cfg.num_local_experts
        self.hdr_fields = _HDR_FIXED + L
        self.hdr_bytes = _align(self.hdr_fields * 8)
        # A slot carries at most max_tokens_per_rank rows (a rank sends each token once per
        # destination), plus alignment slack for up to 4 planes.
        self.slot_bytes = _align(max(1, cfg.max_tokens_per_rank) * self.row_cap) + 4 * _ALIGN
        self.off_hdr_send = 0
        self.off_hdr_recv = w * self.hdr_bytes
        # Header receive slots are double-buffered by round parity: a peer that expects no rows
        # from us can finish round n and send its round n+1 header before we read its round n
        # header; it cannot send round n+2's before we sent ours for n+1 (after reading n).
        self.off_data_send = 3 * w * self.hdr_bytes
        self.off_data_recv = self.off_data_send + w * self.slot_bytes
        self.window_bytes = self.off_data_recv + w * self.slot_bytes
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
        self.engine = None
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
        try:
            self.engine = native.Engine(
                self.provider, self.rank, self.world_size, self.num_channels, self.window.data_ptr(),
                self.window_bytes, self.rings.data_ptr(), self.ring_slots, self.ring_ctrl.data_ptr(),
                self.counters.data_ptr(), _NUM_COUNTER_SLOTS, self.max_inflight, self.spin_us,
                self.inject, 1234 + self.rank, self.cpu_base, self.timeout_ms, self.hmem_device)
        except native.NativeError as ex:
            where = (f"a CUDA window on cuda:{self.hmem_device} (hmem='cuda'; hmem='off' stages "
                     f"through host memory instead)" if self.hmem == "cuda" else "a host window")
            raise TransportError(f"rank {self.rank}: the proxy engine over libfabric provider "
                                 f"{self.provider!r} with {where} failed to start: {ex}") from ex

    def _setup(self) -> None:
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
        settings = (self.provider, self.num_channels, self.chunk_bytes, self.row_cap,
                    self.window_bytes, self.inject, self.hmem)
        mine = [self.engine.local_info(c) for c in range(self.num_channels)]
        # Endpoint names, window keys and base addresses travel over the torch group (gloo) once.
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, (settings, mine), group=self.group)
        bad = [r for r, (s, _) in enumerate(gathered) if s != settings]
        if bad:
            self.close(barrier=False)
            raise TransportError(
                f"rank {self.rank}: proxy settings (provider, num_channels, chunk_bytes, row_cap, "
                f"window_bytes, inject, hmem) differ across ranks: {[g[0] for g in gathered]} "
                f"(check EFA_EP_PROXY_* env vars on ranks {bad})")
        for c in range(self.num_channels):
            names = b"".join(g[1][c][0] for g in gathered)
            self.engine.set_peers(c, names, [g[1][c][1] for g in gathered],
                                  [g[1][c][2] for g in gathered], [g[1][c][3] for g in gathered],
                                  self.timeout_ms)
        dist.barrier(group=self.group)  # every AV is populated before anyone writes
        self._warm_up()

    def _warm_up(self) -> None:
        """Round 0: every channel writes one small message to every peer and waits for all of
        theirs, so connections (tcp/rxm connects lazily) exist before the first dispatch."""
        w, me = self.world_size, self.rank
        peers = [r for r in range(w) if r != me]
        msg = (2 * self._seq) & 0xFFFFF
        hdr_in = self.off_hdr_recv + (self._seq % 2) * w * self.hdr_bytes
        self._seq += 1
        if not peers:
            return
        self._window_ready()  # torch.zeros of a device window is asynchronous
        p = torch.tensor(peers, dtype=torch.int64)
        for c in range(self.num_channels):
            self._push_channel(c, describe_messages(
                p, self.off_hdr_send + p * self.hdr_bytes, torch.full_like(p, hdr_in + me * self.hdr_bytes),
                torch.full_like(p, 16), msg, self.chunk_bytes))
        self._wait(msg, peers, [self.num_channels] * len(peers))

    def close(self, barrier: bool = True) -> None:
        """Releases the engine (threads, endpoints, registrations). Idempotent.

        Collective when ``barrier`` (the default): our last writes may still be in flight after
        our last operation returned (we only waited for what we receive), so we wait for their
        local completion and then for every peer to reach close (a peer reaches it only after it
        received everything we sent); only then are endpoints torn down. ``__del__`` skips the
        barrier (a peer may be gone)."""
        if self.engine is None:
            return
        try:
            self.engine.wait_idle(min(self.timeout_ms, 10000))
            if barrier and dist.is_initialized():
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

    # Wire primitives ------------------------------------------------------------------------
    def _window_view(self, off: int, nbytes: int) -> torch.Tensor:
        return self.window[off:off + nbytes]

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
            self.engine.ring_wait_space(c, cnt, self.timeout_ms)
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
            self.engine.ring_wait_space(c, total, self.timeout_ms)  # back-pressure
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

    def _wait(self, msg: int, srcs: List[int], expected: List[int]) -> None:
        if not srcs:
            return
        s = torch.tensor(srcs, dtype=torch.int32)
        e = torch.tensor(expected, dtype=torch.int64)
        try:
            self.engine.wait_counters(msg, s.data_ptr(), e.data_ptr(), len(srcs), True, self.timeout_ms)
        except native.NativeError as ex:
            raise TransportError(str(ex)) from ex

    def _quiesce(self) -> None:
        """Waits until our previous writes completed locally, so the send side may be rewritten."""
        try:
            self.engine.wait_idle(self.timeout_ms)
        except native.NativeError as ex:
            raise TransportError(str(ex)) from ex

    def _chunks(self, nbytes: int) -> int:
        return -(-nbytes // self.chunk_bytes)

    def _round(self, op: int, planes: Dict[int, List[torch.Tensor]], widths: List[int],
               n_recv: Optional[List[int]], extra_WL: Optional[torch.Tensor],
               error: Optional[str]):
        """One header + data exchange with every peer (collective).

        Args:
            planes: dest rank (!= self) -> list of ``[n, widths[p]]`` uint8 tensors, any device (rows to
                that rank); empty when ``error``.
            widths: bytes per row of each plane (same on every rank).
            n_recv: rows expected from each rank, or None (dispatch: learned from the headers).
            extra_WL: ``[W, L]`` int64 CPU, per-destination extra header fields, or None.
            error: this rank's input error (sent as status, then raised).
        Returns:
            (headers ``[W, F]`` int64 CPU (row ``self.rank`` unset), {src: [plane views into the
            receive window]}). The views are valid until the next round: copy them out.
        """
        w, me = self.world_size, self.rank
        peers = [r for r in range(w) if r != me]
        msg_hdr, msg_data = (2 * self._seq) & 0xFFFFF, (2 * self._seq + 1) & 0xFFFFF
        hdr_in = self.off_hdr_recv + (self._seq % 2) * w * self.hdr_bytes  # parity buffer
        self._seq += 1
        row_bytes = sum(widths)
        self._quiesce()

        # 1. headers (also the "my window is free" handshake and the status carrier)
        hdr = self._window_view(self.off_hdr_send, w * self.hdr_bytes).view(torch.int64).view(w, -1)
        hdr.zero_()
        hdr[:, 0] = _STATUS_BAD if error else _STATUS_OK
        hdr[:, 1] = op
        hdr[:, 3] = row_bytes
        if not error:
            for d, pl in planes.items():
                hdr[d, 2] = pl[0].shape[0] if pl else 0
            if extra_WL is not None:
                hdr[:, _HDR_FIXED:_HDR_FIXED + extra_WL.shape[1]] = extra_WL
        self._window_ready()
        if peers:
            p = torch.tensor(peers, dtype=torch.int64)
            self._push(describe_messages(
                p, self.off_hdr_send + p * self.hdr_bytes,
                torch.full_like(p, hdr_in + me * self.hdr_bytes),
                torch.full_like(p, self.hdr_fields * 8), msg_hdr, self.chunk_bytes))
        self._wait(msg_hdr, peers, [1] * len(peers))
        got = self._window_view(hdr_in, w * self.hdr_bytes).view(torch.int64).view(w, -1)
        got = got[:, :self.hdr_fields].to("cpu", copy=True)
        if error:
            raise DispatchInputError(error)
        what = _OP_NAMES[op]
        bad = [r for r in peers if int(got[r, 0]) != _STATUS_OK]
        if bad:
            raise DispatchInputError(
                f"rank {me}: EP peer rank(s) {bad} passed invalid {what} inputs (see their error)")
        wrong = [r for r in peers if int(got[r, 1]) != op or int(got[r, 3]) != row_bytes]
        if wrong:
            raise TransportError(
                f"rank {me}: peers {wrong} are in a different operation or row size: "
                f"{[(int(got[r, 1]), int(got[r, 3])) for r in wrong]} vs this rank's "
                f"({op}={what}, {row_bytes} bytes/row); every rank must call the same ops in order")
        rows_from = {r: int(got[r, 2]) for r in peers}
        if n_recv is not None:
            mism = [r for r in peers if rows_from[r] != n_recv[r]]
            if mism:
                raise TransportError(
                    f"rank {me}: {what}: ranks {mism} send {[rows_from[r] for r in mism]} rows, "
                    f"the handle expects {[n_recv[r] for r in mism]}; handles from different "
                    f"dispatches?")

        # 2-3. pack into the send slots, describe, push
        dests, loffs, roffs, sizes = [], [], [], []
        for d, pl in planes.items():
            n = pl[0].shape[0] if pl else 0
            if n == 0:
                continue
            base = self.off_data_send + d * self.slot_bytes
            rbase = self.off_data_recv + me * self.slot_bytes
            off = 0
            for t, wdt in zip(pl, widths):
                nb = n * wdt
                dst = self._window_view(base + off, nb).view(n, wdt)
                if t.data_ptr() != dst.data_ptr():
                    dst.copy_(t)
                dests.append(d); loffs.append(base + off); roffs.append(rbase + off); sizes.append(nb)
                off += _align(nb)
        if dests:
            self._window_ready()
            if self._use_triton:
                self._push_triton(dests, loffs, roffs, sizes, msg_data)
            else:
                self._push(describe_messages(torch.tensor(dests), torch.tensor(loffs),
                                             torch.tensor(roffs), torch.tensor(sizes), msg_data,
                                             self.chunk_bytes))

        # 5. wait for every chunk of every source's message, then hand out views
        srcs = [r for r in peers if rows_from[r]]
        self._wait(msg_data, srcs, [sum(self._chunks(rows_from[r] * wd) for wd in widths) for r in srcs])
        out = {}
        for r in peers:
            n = rows_from[r]
            base = self.off_data_recv + r * self.slot_bytes
            views, off = [], 0
            for wdt in widths:
                views.append(self._window_view(base + off, n * wdt).view(n, wdt))
                off += _align(n * wdt)
            out[r] = views
        return got, out

    def _send_slot(self, d: int, off: int, n: int, width: int) -> torch.Tensor:
        """Writable ``[n, width]`` uint8 view of dest d's send slot at byte offset off."""
        return self._window_view(self.off_data_send + d * self.slot_bytes + off, n * width).view(n, width)

    def _exchange_rows(self, op: int, rows_to: Dict[int, torch.Tensor], self_rows: torch.Tensor,
                       n_recv: List[int]) -> torch.Tensor:
        """Moves ``[n, D]`` row blocks (any dtype, contiguous, all on one device) to each rank and
        returns the received rows concatenated in source-rank order (this rank's block =
        ``self_rows``), on that device. Rows wider than the window's row capacity go in column
        rounds. Each block is copied once into the pinned send slot and once out of the window."""
        me, w = self.rank, self.world_size
        d_cols, dtype = self_rows.shape[1], self_rows.dtype
        row_bytes = d_cols * self_rows.element_size()
        as_bytes = {d: t.contiguous().view(torch.uint8).view(t.shape[0], row_bytes) for d, t in rows_to.items()}
        recv = {r: torch.empty(n_recv[r], row_bytes, dtype=torch.uint8, device=self_rows.device)
                for r in range(w) if r != me}
        for c0 in range(0, max(row_bytes, 1), self.row_cap):
            c1 = min(row_bytes, c0 + self.row_cap)
            planes = {d: [t[:, c0:c1]] for d, t in as_bytes.items()}  # _round copies into the slot
            _, got = self._round(op, planes, [c1 - c0], n_recv, None, None)
            for r, views in got.items():
                recv[r][:, c0:c1].copy_(views[0])
            if row_bytes == 0:
                break
        blocks = [self_rows if r == me else recv[r].view(dtype).view(n_recv[r], d_cols) for r in range(w)]
        return torch.cat(blocks, 0) if blocks else self_rows

    # Contract -------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights):
        cfg, w, me = self.cfg, self.world_size, self.rank
        error = validate_dispatch_inputs(cfg, me, x, topk_idx, topk_weights)
        if error is None and cfg.hidden * x.element_size() + 16 * topk_idx.shape[1] > self.row_cap:
            # would overflow a window row: refused on every rank (status in the header) before any
            # row moves; all ranks share H and K, so all of them hit this
            error = (f"rank {me}: dispatch rows of {cfg.hidden * x.element_size()} + "
                     f"{16 * topk_idx.shape[1]} bytes (hidden*elem + 16*top-k) exceed the window's "
                     f"row capacity {self.row_cap}; create the transport with "
                     f"max_topk>={topk_idx.shape[1]} (or max_row_bytes)")
        dev = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
        if error is not None:
            self._round(_OP_DISPATCH, {}, [0], None, None, error)  # raises on every rank
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
        meta = torch.cat([layout.send_topk_idx_SK, float_bits_to_int64(send_w)], dim=1)  # [S, 2K]
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
            ms = meta[starts[d]:starts[d] + n].view(torch.uint8).view(n, 16 * k)
            planes[d] = [xs, ms]
        got, recv = self._round(_OP_DISPATCH, planes, widths, None, extra, None)
        recv_blocks_x = {r: v[0] for r, v in recv.items()}
        recv_blocks_m = {r: v[1] for r, v in recv.items()}
        num_recv = [num_send[me] if r == me else int(got[r, 2]) for r in range(w)]
        tokens_per_expert = extra[me].clone()
        for r in range(w):
            if r != me:
                tokens_per_expert += got[r, _HDR_FIXED:]
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
                recv_x[row:row + n].copy_(recv_blocks_x[r].view(x.dtype).view(n, cfg.hidden))
                mb.append(recv_blocks_m[r].view(torch.int64).view(n, 2 * k).cpu())
            row += n
        recv_meta = torch.cat(mb, 0)
        recv_topk_idx = recv_meta[:, :k].contiguous()
        recv_topk_weights = int64_to_float_bits(recv_meta[:, k:]).contiguous()
        if dev.type != "cpu":
            recv_topk_idx = recv_topk_idx.to(dev)
            recv_topk_weights = recv_topk_weights.to(dev)
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=n_recv, topk_idx=topk_idx,
            send_token_idx=send_idx, num_send_per_rank=tuple(num_send),
            num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_topk_idx,
            state={"send_token_idx_cpu": layout.send_token_idx_S})
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle

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
        if x.dim() != 2 or x.shape[0] != handle.num_tokens:
            self._round(_OP_CACHED, {}, [0], None, None,
                        f"rank {self.rank}: cached dispatch input must be [{handle.num_tokens}, D], "
                        f"got {tuple(x.shape)}")
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
        if y.dim() != 2 or y.shape[0] != handle.num_recv_tokens:
            self._round(_OP_COMBINE, {}, [0], None, None,
                        f"rank {self.rank}: combine input y must be [{handle.num_recv_tokens}, D] "
                        f"(rows received by the matching dispatch), got {tuple(y.shape)}")
        w, me = self.world_size, self.rank
        self._select_producer(y.device)
        yc = y.contiguous()  # stays on its device; rows go D2H straight into the send slots
        num_recv = handle.num_recv_per_rank
        starts = [sum(num_recv[:r]) for r in range(w)]
        rows_to = {d: yc[starts[d]:starts[d] + num_recv[d]] for d in range(w) if d != me}
        self_rows = yc[starts[me]:starts[me] + num_recv[me]]
        back = self._exchange_rows(_OP_COMBINE, rows_to, self_rows, list(handle.num_send_per_rank))
        return reduce_rows_by_rank(back, self._send_idx(handle, y.device), handle.num_send_per_rank,
                                   handle.num_tokens).to(y.dtype)
