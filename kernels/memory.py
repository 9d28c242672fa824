"""Memory a transport's windows take per rank, computed from the transports' own window layouts
(no transport is created, no device touched), so a user can size ``max_tokens_per_rank`` before
a job starts.

    from efa_ep.kernels.memory import window_bytes
    window_bytes("gda", world=8, hidden=7168, dtype=torch.bfloat16, max_tokens_per_rank=4096,
                 num_experts=256)          # bytes per rank

What is counted: ``gda`` its symmetric-memory window (two parities of data, ids, weights, headers
and the compact dispatch's count board; torch's signal pads are a few KiB more); ``proxy`` its
registered window (send slots, receive regions, headers), not the engine's provider buffers
(measured ~72 MB resident per tcp channel: ``ProxyTransport.memory_report``); ``hier`` the sum of
its network stage (``proxy`` over one rail, a rank per node; over the whole group without
aggregation) and local stage (``gda`` over the node's ranks, sized for the rows a rank forwards:
nodes x ``max_tokens_per_rank`` with aggregation); ``torch`` holds no window (it allocates per call:
about its received rows).
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import align_up

TRANSPORTS_WITH_WINDOWS = ("gda", "proxy", "hier")


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def gda_window_bytes(*, world: int, hidden: int, dtype: torch.dtype, max_tokens_per_rank: int,
                     num_experts: int, max_topk: int = 16) -> int:
    """Bytes of one rank's gda window (``efa_ep.kernels.gda.WindowLayout.total_bytes``)."""
    from .gda import WindowLayout

    layout = WindowLayout(world=world, t_max=max_tokens_per_rank,
                          row_bytes=align_up(hidden * _elem(dtype), 16), k_cap=max_topk,
                          num_local=num_experts // world)
    return layout.total_bytes


def proxy_window_bytes(*, world: int, hidden: int, dtype: torch.dtype, max_tokens_per_rank: int,
                       num_experts: int, max_topk: int = 8, chunk_bytes: int = 256 << 10) -> int:
    """Bytes of one rank's proxy window (``efa_ep.kernels.proxy.window.WindowLayout``), with the
    default row capacity ``hidden * elem + 16 * max_topk``."""
    from .proxy.window import WindowLayout

    row_cap = align_up(hidden * _elem(dtype) + 16 * max_topk, 16)
    return WindowLayout.build(world, num_experts // world, max_tokens_per_rank, row_cap,
                              chunk_bytes, hidden).window_bytes


def window_bytes(transport: str, *, world: int, hidden: int, dtype: torch.dtype,
                 max_tokens_per_rank: int, num_experts: int, max_topk: Optional[int] = None,
                 node_size: Optional[int] = None, aggregate: int = 1) -> int:
    """Window bytes per rank of ``transport`` for an EP group of ``world`` ranks.

    Args:
        transport: ``gda``, ``proxy``, ``hier`` or ``torch`` (0: no window).
        max_topk: the transport option (defaults: gda 16, proxy 8); drop-and-pad mode needs
            ``num_experts``.
        node_size, aggregate: ``hier`` only (defaults 8 and 1, as the transport's).
    Raises:
        ValueError: an unknown transport, or a world / node_size that does not divide.
    """
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} is not divisible by world={world}")
    kw = dict(hidden=hidden, dtype=dtype, max_tokens_per_rank=max_tokens_per_rank)
    if transport == "torch":
        return 0
    if transport == "gda":
        return gda_window_bytes(world=world, num_experts=num_experts, max_topk=max_topk or 16, **kw)
    if transport == "proxy":
        return proxy_window_bytes(world=world, num_experts=num_experts, max_topk=max_topk or 8, **kw)
    if transport == "hier":
        g = min(node_size or 8, world)
        if world % g:
            raise ValueError(f"node_size={g} does not divide world={world}")
        n = world // g
        pk, gk = max_topk or 8, max_topk or 16
        if aggregate and n > 1:  # rail stage over n nodes; the local stage forwards n sources
            net = proxy_window_bytes(world=n, num_experts=num_experts, max_topk=pk, **kw)
            local_kw = dict(kw, max_tokens_per_rank=n * max_tokens_per_rank)
        else:  # direct: the network stage spans the group (one node: a torch rail, no window)
            net = (proxy_window_bytes(world=world, num_experts=num_experts, max_topk=pk, **kw)
                   if n > 1 else 0)
            local_kw = kw
        return net + gda_window_bytes(world=g, num_experts=num_experts // n, max_topk=gk,
                                      **local_kw)
    raise ValueError(f"unknown transport {transport!r}: expected gda, proxy, hier or torch")
