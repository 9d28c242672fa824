"""The transports the ``efa`` dispatcher shares between layers: one per EP group and setup.

Every MoE layer with the same sizes gets the same transport object, so fixed windows, rings and
endpoints are allocated once per process, not once per layer. Creation is collective over the EP
group (``create_transport`` checks there, once, that every rank passes the same settings); it
happens on the first dispatch of the first layer that needs it, on every rank of the group.

The key is ``(name, id(group), num_experts, hidden, max_tokens_per_rank, dtype, options)``. The
group's ``id`` cannot be reused by another group while its entry lives: the cached transport
holds the group object (``Transport.group``), so the group is not collected before
:func:`clear_transport_cache` drops the entry.

Growing (the dispatcher's ``grow`` policy): :func:`grow_shared_transport` records a larger
T_MAX for the key without it and creates the transport of that size; from then on
:func:`get_shared_transport` hands every layer of the group that transport (the larger of the
asked and the grown T_MAX), so sizes never shrink. The replaced transport is retired, not
closed: handles it made may still be combined by a backward pass (the autograd context holds
the transport that made the handle), and closing is collective while the last such backward
comes at no point every rank can see. :func:`close_retired_transports` closes retired ones
when the caller knows none is pending (e.g. after the optimizer step);
:func:`clear_transport_cache` closes them too.

Knows nothing of Megatron; settings come resolved from :mod:`efa_ep.dispatcher.settings`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from efa_ep.kernels import Transport, create_transport

_TRANSPORTS: Dict[Tuple, Transport] = {}
# (name, id(group), num_experts, hidden, dtype, options) -> the T_MAX its windows grew to
_GROWN: Dict[Tuple, int] = {}
# transports a grow replaced: open until close_retired_transports / clear_transport_cache
_RETIRED: List[Transport] = []


def get_shared_transport(name: str, group, num_experts: int, hidden: int,
                         max_tokens_per_rank: int, dtype: torch.dtype, options: tuple) -> Transport:
    """Returns the process-wide transport for these settings, creating it (collectively over
    ``group``) on the first call. Its T_MAX is ``max_tokens_per_rank`` or, when a grow enlarged
    the windows of these settings, the grown size if larger.

    Args:
        name: the transport that runs (``torch``, ``gda``, ``proxy``, ``hier``; ``auto`` already
            resolved). group: the EP process group.
        num_experts: E. hidden: H. max_tokens_per_rank: T_MAX. dtype: dtype of the rows.
        options: sorted ``(key, value)`` pairs, every option the transport gets
            (:meth:`~efa_ep.dispatcher.settings.DispatcherSettings.options_for`).
    """
    grown = _GROWN.get((name, id(group), num_experts, hidden, dtype, options), 0)
    t_max = max(max_tokens_per_rank, grown)
    key = (name, id(group), num_experts, hidden, t_max, dtype, options)
    t = _TRANSPORTS.get(key)
    if t is None:
        t = create_transport(name, group, num_experts, hidden, t_max, dtype, **dict(options))
        _TRANSPORTS[key] = t
    return t


def grow_shared_transport(old: Transport, group, max_tokens_per_rank: int,
                          options: tuple) -> Transport:
    """Replaces the shared transport ``old`` by one with windows for ``max_tokens_per_rank``
    (larger than ``old``'s T_MAX) and returns it. Collective over ``group`` (the creation
    is): every rank of the group calls it with the same size, as the dispatcher's agreement
    ensures. ``old`` stays open (retired; see the module docstring).

    Args:
        old: the transport the refused dispatch ran on (its cfg gives name, E, H and dtype).
        group: the EP process group ``old`` was asked for with (the cache key's).
        options: the sorted ``(key, value)`` pairs ``old`` was asked for with (the cache key's).
    """
    cfg = old.cfg
    if max_tokens_per_rank <= cfg.max_tokens_per_rank:
        raise ValueError(f"grow_shared_transport: {max_tokens_per_rank} tokens per rank is not "
                         f"larger than the transport's {cfg.max_tokens_per_rank}")
    _GROWN[(cfg.name, id(group), cfg.num_experts, cfg.hidden, cfg.dtype, options)] = \
        max_tokens_per_rank
    for key, t in list(_TRANSPORTS.items()):
        if t is old:
            del _TRANSPORTS[key]
            _RETIRED.append(old)
    return get_shared_transport(cfg.name, group, cfg.num_experts, cfg.hidden,
                                max_tokens_per_rank, cfg.dtype, options)


def close_retired_transports() -> int:
    """Closes the transports that grows replaced and returns how many. Collective in the way
    each transport's ``close`` is: call it on every rank, at a point where no backward pass
    will combine a handle made before the last grow (after the optimizer step, say)."""
    n = len(_RETIRED)
    for t in _RETIRED:
        t.close()
    _RETIRED.clear()
    return n


_AUTO: Dict[int, Tuple[str, tuple]] = {}


def channels_from_calibration(path: str):
    """``pick(world, ranks_per_node) -> (num_channels, why)``: the planner's proxy channel
    count for the layout, from the calibration file at ``path`` (``efa-ep-plan calibrate``)."""
    from efa_ep.tools.plan.calibrate import read
    from efa_ep.tools.plan.model import choose_transport

    cal = read(path)

    def pick(world: int, ranks_per_node: int):
        _, nc, why = choose_transport(world, ranks_per_node, ["proxy"], cal)
        return nc, f"from the calibration: {why}"
    return pick


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
            channels_from_calibration(calibration) if calibration else None)
        _AUTO[key] = (("hier", tuple(sorted(options.items()))) if name == "hier"
                      else (one_host, None))
        if dist.get_rank(group) == 0:
            logging.getLogger("efa_ep").info("efa-ep: transport auto -> %s: %s", _AUTO[key][0],
                                             reason)
    return _AUTO[key]


def clear_transport_cache() -> None:
    """Closes and forgets every shared transport, retired ones included, and every grown size
    (tests, process-group teardown). Collective in the way each transport's ``close`` is: call
    it on every rank."""
    for t in _TRANSPORTS.values():
        t.close()
    _TRANSPORTS.clear()
    close_retired_transports()
    _GROWN.clear()
    _AUTO.clear()


__all__ = ["get_shared_transport", "grow_shared_transport", "close_retired_transports",
           "clear_transport_cache", "auto_transport_for_group", "channels_from_calibration"]
