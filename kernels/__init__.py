"""``efa_ep.kernels`` (this folder, ``kernels/``): transports that move tokens between
expert-parallel ranks. Knows nothing of Megatron.

    from efa_ep.kernels import create_transport, available_transports
    t = create_transport(name, group, num_experts, hidden, max_tokens_per_rank, dtype, **options)
    recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle = t.dispatch(x, idx, w)
    out = t.combine(y, handle)

The contract is written in :mod:`efa_ep.kernels.base` (its pieces live in ``core/``: errors,
handles, routing math, input checks, the status exchange, the ``Transport`` class). Each
transport is a package: ``torch_a2a/``, ``hier/``, ``gda/`` and ``proxy/``, each with its front class
in ``transport.py`` and, where it has them, window/layout, device kernels and native binding
(the hosts each rank runs on come from ``core/hosts.py``); ``native/``
holds the C sources, ``launch.py`` and ``native_launch.py`` the kernel launch paths. Names map
to factories in one registry; a transport module is imported only when it is asked for or
probed.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .base import (  # noqa: F401  (re-exported)
    DispatchHandle, DispatchInputError, TooManyTokensError, Transport, TransportConfig,
    TransportError, TransportUnavailable, check_group_agreement,
)


@dataclasses.dataclass(frozen=True)
class TransportEntry:
    """A registered transport: ``module`` defines ``availability() -> Optional[str]`` (None when
    usable here, else why not and what to install) and the class ``cls``."""

    module: str
    cls: str
    install_hint: str


_REGISTRY: Dict[str, TransportEntry] = {
    "torch": TransportEntry("efa_ep.kernels.torch_a2a", "TorchTransport", "torch with torch.distributed"),
    "gda": TransportEntry("efa_ep.kernels.gda", "GdaTransport",
                          "a CUDA GPU, triton>=3.2 and torch symmetric memory (pip install 'efa-ep[gpu]')"),
    "proxy": TransportEntry("efa_ep.kernels.proxy", "ProxyTransport",
                            "libfabric headers and a C compiler (apt-get install libfabric-dev gcc; "
                            "on AWS the EFA installer)"),
    "hier": TransportEntry("efa_ep.kernels.hier", "HierTransport",
                           "torch.distributed, plus its stages' needs (proxy: libfabric; gda: a GPU)"),
}
_ALIASES = ("auto",)


def _load(name: str):
    entry = _REGISTRY[name]
    try:
        return importlib.import_module(entry.module)
    except ImportError as e:
        raise TransportUnavailable(
            f"transport {name!r} cannot be imported ({e}); it needs {entry.install_hint}") from e


def transport_status() -> Dict[str, Optional[str]]:
    """Maps every registered name to None (usable here) or the reason it is not."""
    out: Dict[str, Optional[str]] = {}
    for name, entry in _REGISTRY.items():
        try:
            reason = _load(name).availability()
        except TransportUnavailable as e:
            reason = str(e)
        except Exception as e:  # a broken probe must not hide the other transports
            reason = f"availability probe failed: {type(e).__name__}: {e}"
        out[name] = None if reason is None else f"{reason} (needs {entry.install_hint})"
    return out


def available_transports() -> List[str]:
    """Names of the transports usable on this machine, in registry order (``torch`` first)."""
    return [n for n, why in transport_status().items() if why is None]


def resolve_transport_name(name: str) -> str:
    """``auto`` -> the best usable transport: ``gda`` when usable (intra-node GPU), else
    ``torch``. Other names pass through after a check that they exist."""
    if name == "auto":
        status = transport_status()
        return "gda" if status.get("gda") is None else "torch"
    if name not in _REGISTRY:
        raise TransportError(
            f"unknown transport {name!r}; known: {sorted(list(_REGISTRY) + list(_ALIASES))}")
    return name


def ranks_per_node(group, node_size=None) -> int:
    """Ranks per host of ``group`` (collective over it); ``node_size`` (hier's option, which the
    dispatcher's settings fill from ``EFA_EP_NODE_SIZE``) emulates nodes."""
    from .core.hosts import ranks_per_node as per_node

    return per_node(group, node_size)


def auto_choice(world: int, ranks_per_node: int, options: dict,
                pick_channels: Optional[Callable[[int, int], tuple]] = None) -> tuple:
    """What ``auto`` runs for an EP group of ``world`` ranks, ``ranks_per_node`` per host:
    ``(name, options, reason)``. Across hosts ``hier``; with ``pick_channels`` and no
    ``num_channels`` given, its channel count is ``pick_channels(world, ranks_per_node)``'s
    ``(num_channels, why)`` (the Megatron dispatcher passes the planner's pick from a
    calibration file). On one host ``gda`` where usable, else ``torch``."""
    if world <= ranks_per_node:
        name = resolve_transport_name("auto")
        return name, options, f"EP group of {world} ranks on one host: {name}"
    options = dict(options)
    reason = f"EP group spans {world // ranks_per_node} hosts: hier"
    if pick_channels is not None and "num_channels" not in options:
        nc, why = pick_channels(world, ranks_per_node)
        options["num_channels"] = nc
        reason += f" with num_channels={nc} ({why})"
    return "hier", options, reason


def create_transport(name: str, group, num_experts: int, hidden: int, max_tokens_per_rank: int,
                     dtype: torch.dtype, **options) -> Transport:
    """Builds transport ``name`` for the EP process group ``group`` (collective over it).

    Args:
        name: ``torch``, ``gda``, ``proxy``, ``hier`` or ``auto`` (``hier`` when the group spans
            several hosts, else ``gda`` where usable, else ``torch``).
        group: torch.distributed process group of the EP ranks (None = WORLD).
        num_experts: E, global experts, a multiple of the group size.
        hidden: H. max_tokens_per_rank: bound on any rank's T (sizes fixed windows).
        dtype: dtype of the rows to move.
        options: transport knobs (e.g. ``num_channels`` for proxy); part of the agreement check.

    Raises:
        TransportUnavailable: the transport cannot run here (the message says what to install).
        TransportError: unknown name, or ranks that disagree on name/sizes/options (named).
    """
    group = group if group is not None else dist.group.WORLD
    resolved = resolve_transport_name(name)
    if name == "auto":
        import logging

        resolved, options, reason = auto_choice(
            dist.get_world_size(group), ranks_per_node(group, options.get("node_size")), options)
        if dist.get_rank(group) == 0:
            logging.getLogger("efa_ep").info("efa-ep: transport auto -> %s: %s", resolved, reason)
    module = _load(resolved)
    reason = module.availability()
    cfg = TransportConfig(
        name=resolved, world_size=dist.get_world_size(group), num_experts=num_experts,
        hidden=hidden, max_tokens_per_rank=max_tokens_per_rank, dtype=dtype,
        options=tuple(sorted(options.items())))
    rank = dist.get_rank(group)
    # Agreement first, so a rank that cannot run the transport is named to every peer too.
    check_group_agreement(dataclasses.replace(cfg, options=cfg.options + (("_usable", reason is None),)),
                          group, rank)
    if reason is not None:
        raise TransportUnavailable(
            f"rank {rank}: transport {resolved!r} is not available here: {reason}; "
            f"it needs {_REGISTRY[resolved].install_hint}")
    return getattr(module, _REGISTRY[resolved].cls)(cfg, group)


__all__ = [
    "create_transport", "available_transports", "transport_status", "resolve_transport_name",
    "auto_choice", "ranks_per_node",
    "Transport", "TransportConfig", "DispatchHandle", "TransportError", "TransportUnavailable",
    "DispatchInputError", "TooManyTokensError",
]
