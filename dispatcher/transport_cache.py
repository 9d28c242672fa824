"""The transports the ``efa`` dispatcher shares between layers: one per EP group and setup.

Every MoE layer with the same sizes gets the same transport object, so fixed windows, rings and
endpoints are allocated once per process, not once per layer. Creation is collective over the EP
group (``create_transport`` checks there, once, that every rank passes the same settings); it
happens on the first dispatch of the first layer that needs it, on every rank of the group.

The key is ``(name, id(group), num_experts, hidden, max_tokens_per_rank, dtype, options)``. The
group's ``id`` cannot be reused by another group while its entry lives: the cached transport
holds the group object (``Transport.group``), so the group is not collected before
:func:`clear_transport_cache` drops the entry.

Knows nothing of Megatron; settings come resolved from :mod:`efa_ep.dispatcher.settings`.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from efa_ep.kernels import Transport, create_transport

_TRANSPORTS: Dict[Tuple, Transport] = {}


def get_shared_transport(name: str, group, num_experts: int, hidden: int,
                         max_tokens_per_rank: int, dtype: torch.dtype, options: tuple) -> Transport:
    """Returns the process-wide transport for these settings, creating it (collectively over
    ``group``) on the first call.

    Args:
        name: the transport that runs (``torch``, ``gda``, ``proxy``, ``hier``; ``auto`` already
            resolved). group: the EP process group.
        num_experts: E. hidden: H. max_tokens_per_rank: T_MAX. dtype: dtype of the rows.
        options: sorted ``(key, value)`` pairs, every option the transport gets
            (:meth:`~efa_ep.dispatcher.settings.DispatcherSettings.options_for`).
    """
    key = (name, id(group), num_experts, hidden, max_tokens_per_rank, dtype, options)
    t = _TRANSPORTS.get(key)
    if t is None:
        t = create_transport(name, group, num_experts, hidden, max_tokens_per_rank, dtype,
                             **dict(options))
        _TRANSPORTS[key] = t
    return t


_AUTO: Dict[int, Tuple[str, tuple]] = {}


def auto_transport_for_group(group, one_host: str, hier_options: dict,
                             calibration: Optional[str] = None) -> Tuple[str, tuple]:
    """What ``auto`` runs for the EP group ``group``, as ``(name, options)``: ``hier`` with
    ``hier_options`` (and, from ``calibration``, the planner's ``num_channels`` when none is
    given) when the group spans several hosts (or emulated nodes: ``node_size`` in
    ``hier_options``); else ``one_host`` (``gda`` where usable, else ``torch``, resolved on this
    machine) and no options of its own. Collective over ``group`` the first time per group
    (host names are exchanged); one INFO log line on the group's first rank says why."""
    import logging

    import torch.distributed as dist

    from efa_ep.kernels import auto_choice, ranks_per_node

    key = id(group)
    if key not in _AUTO:
        world = dist.get_world_size(group)
        name, options, reason = auto_choice(
            world, ranks_per_node(group, hier_options.get("node_size")), hier_options,
            calibration)
        _AUTO[key] = (("hier", tuple(sorted(options.items()))) if name == "hier"
                      else (one_host, None))
        if dist.get_rank(group) == 0:
            logging.getLogger("efa_ep").info("efa-ep: transport auto -> %s: %s", _AUTO[key][0],
                                             reason)
    return _AUTO[key]


def clear_transport_cache() -> None:
    """Closes and forgets every shared transport (tests, process-group teardown). Collective in
    the way each transport's ``close`` is: call it on every rank."""
    for t in _TRANSPORTS.values():
        t.close()
    _TRANSPORTS.clear()
    _AUTO.clear()


__all__ = ["get_shared_transport", "clear_transport_cache", "auto_transport_for_group"]
