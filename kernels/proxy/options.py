"""Options of the ``proxy`` transport, resolved once per transport.

``create_transport("proxy", ..., **options)``: options are explicit. The environment variable in
parentheses is the option's name for users of the Megatron dispatcher: its settings
(:mod:`efa_ep.dispatcher.settings`) pass it as the option when no other channel gives it (each
variable is one row of ``VARIABLES`` in :mod:`efa_ep.kernels.core.variables`, whose reader is
the one that reads ``EFA_EP_*``; the option's type, default and bounds are the schema's in
``kernels/options.py``).

    provider (EFA_EP_PROXY_PROVIDER): ``efa`` if usable, else ``tcp``; also ``shm``.
    num_channels (EFA_EP_PROXY_CHANNELS): proxy channels (threads + endpoints), default
        :func:`default_num_channels` (4 on hosts with >= 8 CPUs, else 2).
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
    producer (EFA_EP_PROXY_PRODUCER): who writes descriptors: ``torch`` (host), ``triton`` (a
        kernel into the pinned ring) or ``auto`` (the native host producer: every round syncs
        the stream before posting, so a kernel saves nothing and costs launches).

Test-only, on one rank, never part of the agreement check (so read here, through the reader,
not an option): EFA_EP_PROXY_TAMPER=<kind>.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..base import TransportError, align_up
from ..core.variables import raw
from . import native
from .window import ALIGN

# Providers on which hmem='auto' tries a device window first (GPUDirect RDMA into GPU memory).
HMEM_AUTO_PROVIDERS = ("efa",)
# Test-only header/data tampering done in Python (EFA_EP_PROXY_TAMPER); native kinds are in
# native.TAMPER_KINDS.
PY_TAMPER = ("rows", "rows_consistent", "capacity", "chunks", "expert_counts", "tag", "ids")


def default_provider() -> str:
    return "efa" if native.probe("efa") is None else "tcp"


def default_num_channels() -> int:
    """Channels when none are asked for: 4 on hosts with at least 8 CPUs, else 2.

    Measured on a 16-core H200 host over shm (EP 2, DeepSeek-V3 shape, bit-identical to torch
    first): prefill dispatch+combine 29.6 ms with 4 channels against 43.8 ms with 2 (3 starts
    each); the wire rounds of a decode 0.66 ms against 0.68 (no loss). Each channel is a
    polling thread per rank, so small hosts keep 2: on a 2-core VM 4 channels were slower."""
    return 4 if (os.cpu_count() or 1) >= 8 else 2


def _opt(options: dict, key: str, default, cast):
    return cast(options[key]) if key in options else default


@dataclass
class ProxyOptions:
    """Resolved options (see the module docstring); ``hmem`` is ``off`` or ``cuda`` once
    resolved, ``hmem_auto`` remembers that ``auto`` chose it (setup may fall back to ``off``)."""

    provider: str
    num_channels: int
    inject: int
    timeout_ms: int
    chunk_bytes: int
    ring_slots: int
    max_inflight: int
    spin_us: int
    cpu_base: int
    hmem: str
    hmem_auto: bool
    producer: str
    max_topk: int
    max_row_bytes: Optional[int]
    tamper: str


def resolve_options(options: dict) -> ProxyOptions:
    """Options dict -> :class:`ProxyOptions` (defaults for the options not given). Raises
    TransportError naming the option and the accepted values."""
    o = dict(options)
    provider = _opt(o, "provider", None, str) or default_provider()
    num_channels = _opt(o, "num_channels", None, int)
    if num_channels is None:
        num_channels = default_num_channels()
    inj = _opt(o, "inject_reorder", 0, int)
    inject = (native.INJECT_TARGET | native.INJECT_SENDER) if inj == 1 else inj
    timeout_ms = int(1000 * _opt(o, "timeout_s", 60.0, float))
    chunk_bytes = align_up(_opt(o, "chunk_bytes", 256 << 10, int), ALIGN)
    tamper = raw("EFA_EP_PROXY_TAMPER") or ""
    if tamper and tamper not in PY_TAMPER and tamper not in native.TAMPER_KINDS:
        raise TransportError(f"EFA_EP_PROXY_TAMPER={tamper!r}: expected one of "
                             f"{sorted(set(PY_TAMPER) | set(native.TAMPER_KINDS))}")
    # Where the window lives (transport docstring). "auto" picks the device window only over
    # efa, where the NIC reads and writes GPU memory directly; on shm a device window is
    # slower than host staging (RESULTS.md) and tcp never offers FI_HMEM.
    hmem = _opt(o, "hmem", "auto", str)
    if hmem not in ("auto", "off", "cuda"):
        raise TransportError(f"hmem={hmem!r}: expected 'auto', 'off' (host window) or 'cuda'")
    hmem_auto = hmem == "auto"
    if hmem_auto:
        hmem = "cuda" if (provider in HMEM_AUTO_PROVIDERS and torch.cuda.is_available()
                          and native.probe(provider, hmem=True) is None) else "off"
    if hmem == "cuda" and not torch.cuda.is_available():
        raise TransportError("hmem='cuda' needs a CUDA device (torch.cuda.is_available() is False)")
    producer = _opt(o, "producer", "auto", str)
    if producer not in ("auto", "torch", "triton"):
        raise TransportError(f"producer={producer!r}: expected auto, torch or triton")
    out = ProxyOptions(
        provider=provider, num_channels=num_channels, inject=inject, timeout_ms=timeout_ms,
        chunk_bytes=chunk_bytes, ring_slots=_opt(o, "ring_slots", 1024, int),
        max_inflight=_opt(o, "max_inflight", 64, int),
        spin_us=_opt(o, "spin_us", 200, int),
        cpu_base=_opt(o, "cpu_base", -1, int), hmem=hmem,
        hmem_auto=hmem_auto, producer=producer, max_topk=_opt(o, "max_topk", 8, int),
        max_row_bytes=_opt(o, "max_row_bytes", None, int), tamper=tamper)
    if out.num_channels < 1 or out.num_channels > 64:
        raise TransportError(f"num_channels={out.num_channels} must be in 1..64")
    if out.chunk_bytes < ALIGN or out.chunk_bytes >= (1 << 32):
        raise TransportError(f"chunk_bytes={out.chunk_bytes} must be in [16, 4 GiB)")
    if out.timeout_ms < 1:
        raise TransportError(f"timeout_s={out.timeout_ms / 1000} must be > 0")
    return out
