"""Whether the ``efa`` dispatcher's transport can run on every rank of an EP group, decided by
all of them together: what ``EFA_EP_FALLBACK=alltoall``
(:func:`~efa_ep.dispatcher.settings.fallback_dispatcher`) needs so that every rank builds
Megatron's ``alltoall`` dispatcher instead, or none does.

Without a fallback nothing here runs: the dispatcher creates its transport on the first
dispatch (:mod:`.transport_cache`) and a failure there raises one line on every rank. With one,
:func:`efa_problem` probes when a layer is built, in three steps, each ending in an agreement
(an all-reduce of a failure flag over the EP group; the reasons are gathered only when a flag is
set), so every rank takes the same decision and no rank is left in a collective its peers
skipped:

1. local checks, no communication: the settings (``EFA_EP_*``, config attributes) parse, the
   transport resolves and can run here (``transport_status``), and the libfabric provider its
   options name answers ``fi_getinfo``;
2. creation of a small transport of the same kind and options, collective as on the first
   dispatch (``create_transport`` compares every rank's settings there);
3. a self-test on it: one dispatch and one combine of a few integer-valued rows, whose round
   trip must equal each row times its number of destination ranks, exactly.

The probe transport is then closed; the dispatcher creates its own on the first dispatch, as
without a fallback. The verdict is cached per EP group and settings, so later layers cost
nothing. A rank that fails inside a collective of step 2 while its peers wait (one dying
mid-setup) is bounded by the process group's timeout, after which the peers fail and agree too.

Knows Megatron only through the config object it reads (``num_moe_experts``, ``hidden_size``,
``moe_router_topk``, ``bf16``/``fp16``/``params_dtype``).
"""
from __future__ import annotations

import logging
import re
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from efa_ep.kernels import create_transport, transport_status
from efa_ep.kernels.base import collective_device

from .settings import (
    _status_keeping_sigint, capacity_overflow_policy, current_settings, grow_max_tokens_per_rank,
)

#: tokens per rank of the probe's transport and self-test
PROBE_TOKENS = 4
_VERDICTS: Dict[tuple, Optional[str]] = {}
_RANK_PREFIX = re.compile(r"^rank \d+: ")
log = logging.getLogger("efa_ep")


def rows_dtype(config) -> torch.dtype:
    """The dtype of the rows the layer will move: bf16/fp16 training moves half-precision
    activations, else ``params_dtype`` (float32 by default)."""
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    dtype = getattr(config, "params_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _rows_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(problem: Optional[str], group) -> Optional[str]:
    """Collective over ``group``: None when no rank has a problem, else every rank's reason in
    one line (``rank 1: why; ranks 0, 2: why``), the same on every rank. One all-reduce (MAX) of
    a flag; the reasons are all-gathered only when a flag is set."""
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64,
                        device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return None
    reasons: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, problem, group=group)
    return join_reasons(reasons)


def join_reasons(reasons: List[Optional[str]]) -> str:
    """``[None, "rank 1: x", "x"]`` -> ``"ranks 1, 2: x"``: ranks with the same reason (a
    leading ``rank N:`` of the transports' own messages dropped) named together."""
    by: Dict[str, List[int]] = {}
    for r, why in enumerate(reasons):
        if why is not None:
            text = " ".join(str(why).split())
            by.setdefault(_RANK_PREFIX.sub("", text), []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {why}"
                     for why, rs in by.items())


def describe(error: BaseException) -> str:
    """``Type: message`` of ``error`` in one line (its first line; a leading ``rank N:`` of the
    transports' own messages dropped: the agreement names the rank)."""
    lines = [ln for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {_RANK_PREFIX.sub('', lines[0]) if lines else ''}".rstrip(": ")


def local_problem(config) -> Tuple[Optional[str], Optional[tuple]]:
    """Step 1, on this rank alone: ``(None, (settings, name, options))`` when the settings parse
    and the transport (``auto`` resolved on this machine) can run here, else ``(why, None)``."""
    try:
        s = current_settings(config)
        capacity_overflow_policy(config)
        grow_max_tokens_per_rank(config)
        name = s.resolved_transport()
        options = s.options_for(name)
        status = _status_keeping_sigint(transport_status)
        why = status.get(name)
        if why is None and name == "hier" and dict(options).get("network", "proxy") == "proxy":
            why = status.get("proxy")
        if why is not None:
            return f"transport {name!r} cannot run here: {why}", None
        provider = dict(options).get("provider")
        if provider and name in ("proxy", "hier"):
            from efa_ep.kernels.proxy import native

            why = native.probe(str(provider))
            if why is not None:
                return f"transport {name!r}: libfabric provider {provider!r} unusable: {why}", None
        return None, (s, name, options)
    except Exception as e:  # any reason this rank cannot build the transport
        return describe(e), None


def create_probe_transport(name: str, group, num_experts: int, hidden: int, dtype: torch.dtype,
                           options: tuple):
    """Step 2: the probe's transport (``PROBE_TOKENS`` tokens per rank), collective over
    ``group``."""
    return create_transport(name, group, num_experts, hidden, PROBE_TOKENS, dtype, **dict(options))


def round_trip_problem(transport, num_experts: int, topk: int, hidden: int, dtype: torch.dtype,
                       device: torch.device) -> Optional[str]:
    """Step 3: one dispatch and one combine on ``transport`` (collective); None when the
    combined rows equal each row times its number of destination ranks exactly (small integers,
    exact in every dtype) and the received counts add up, else what differed."""
    rank, world = transport.rank, transport.world_size
    k = max(1, min(topk, 2, num_experts))
    t = PROBE_TOKENS
    x = ((torch.arange(t * hidden, dtype=torch.int64).view(t, hidden) + 3 * rank) % 9 - 4)
    x = x.to(dtype).to(device)
    step = max(1, num_experts // k)
    experts = [[(i + rank + j * step) % num_experts for j in range(k)] for i in range(t)]
    idx = torch.tensor(experts, dtype=torch.int64, device=device)
    w = torch.ones(t, k, dtype=torch.float32, device=device)
    recv_x, recv_idx, _recv_w, tpe, handle = transport.dispatch(x, idx, w)
    out = transport.combine(recv_x, handle)
    per_rank = num_experts // world
    dests = torch.tensor([len({e // per_rank for e in row}) for row in experts],
                         dtype=torch.float32, device=device)
    want = (x.float() * dests[:, None]).to(out.dtype)
    if int(tpe.sum()) != int((recv_idx >= 0).sum()):
        return (f"self-test: tokens_per_expert sums to {int(tpe.sum())} but the received rows "
                f"hold {int((recv_idx >= 0).sum())} expert slots")
    if out.shape != want.shape or not torch.equal(out, want):
        diff = (out.double() - want.double()).abs().max().item() if out.shape == want.shape else "shape"
        return f"self-test: combine(dispatch(x)) differs from the expected rows (max |diff| {diff})"
    return None


def close_probe(transport, collective: bool) -> None:
    """Closes the probe's transport; without ``collective`` nothing waits on peers (a peer
    may have failed): the proxy skips its closing barrier, hier closes its stages so."""
    if transport is None:
        return
    try:
        if collective:
            transport.close()
            return
        stages = [getattr(transport, a, None) for a in ("network", "local")]
        if any(s is not None for s in stages):
            for s in stages:
                close_probe(s, False)
            return
        try:
            transport.close(barrier=False)
        except TypeError:
            transport.close()
    except Exception:  # a broken probe transport must not hide the verdict
        pass


def _probe(config, group) -> Optional[str]:
    problem, resolved = local_problem(config)
    why = agree(problem, group)
    if why is not None:
        return why
    s, name, options = resolved
    transport, problem = None, None
    try:
        if s.transport == "auto":
            from .transport_cache import auto_transport_for_group

            auto_name, auto_options = auto_transport_for_group(
                group, name, dict(s.options_for("hier")), s.calibration)
            if auto_name != name:
                name, options = auto_name, auto_options
        transport = create_probe_transport(name, group, int(config.num_moe_experts),
                                           int(config.hidden_size), rows_dtype(config), options)
    except Exception as e:
        problem = describe(e)
    why = agree(problem, group)
    if why is not None:
        close_probe(transport, collective=False)
        return why
    try:
        problem = round_trip_problem(transport, int(config.num_moe_experts),
                                     int(getattr(config, "moe_router_topk", 2) or 2),
                                     int(config.hidden_size), rows_dtype(config), _rows_device())
    except Exception as e:
        problem = f"self-test: {describe(e)}"
    why = agree(problem, group)
    close_probe(transport, collective=why is None)
    return why


def efa_problem(config, group) -> Optional[str]:
    """Collective over the EP ``group`` (every rank calls it for the same layer): None when the
    efa transport that ``config`` and the environment select can be created and passes the
    self-test on every rank, else why not, one line, the same on every rank. Cached per group
    and settings (bad settings are not cached: they are refused again on every call)."""
    try:
        s = current_settings(config)
        key = (id(group), s, int(config.num_moe_experts), int(config.hidden_size),
               rows_dtype(config))
    except Exception:
        key = None  # bad settings: probed (and refused) every time, never cached
    if key is not None and key in _VERDICTS:
        return _VERDICTS[key]
    why = _probe(config, group)
    if key is not None:
        _VERDICTS[key] = why
    return why


def decide_fallback(config, group, fallback: str) -> bool:
    """Whether this layer runs ``fallback`` (Megatron's dispatcher type) instead of efa: True
    on every rank of ``group`` or on none (:func:`efa_problem`). The group's first rank logs
    one WARNING line saying why, once per group and settings."""
    cached = len(_VERDICTS)
    why = efa_problem(config, group)
    if why is None:
        return False
    if len(_VERDICTS) != cached and dist.get_rank(group) == 0:
        log.warning("efa-ep: EFA_EP_FALLBACK=%s: the efa transport cannot run on every EP rank "
                    "(%s); every EP rank runs Megatron's %s dispatcher instead", fallback, why,
                    fallback)
    return True


def reset() -> None:
    """Forgets the cached verdicts (tests; a process group torn down and rebuilt)."""
    _VERDICTS.clear()


__all__ = ["efa_problem", "decide_fallback", "agree", "join_reasons", "local_problem",
           "create_probe_transport", "round_trip_problem", "rows_dtype", "describe", "close_probe", "reset",
           "PROBE_TOKENS"]
