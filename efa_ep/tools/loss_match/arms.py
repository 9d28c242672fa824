"""The loss-match arms (one training run each: a dispatcher at an EP size) resolved from the
config, and the file-name form of an arm name."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Arm:
    """One training run.

    Attributes:
        name: ``allgather``, ``ep1``, ``alltoall``, ``efa:<transport>`` or ``file:<stem>``.
        role: ``baseline`` or ``candidate``.
        dispatcher: Megatron ``moe_token_dispatcher_type``.
        ep_size: expert-parallel size (= ranks launched; TP=PP=1, so DP = EP).
        transport: efa transport name (``efa`` arms only).
        transport_options: knobs passed to the transport (``EFA_EP_TRANSPORT_OPTIONS``).
    """

    name: str
    role: str
    dispatcher: str
    ep_size: int
    transport: Optional[str] = None
    transport_options: tuple = ()


def resolve_arms(cfg: Dict[str, Any], available: Sequence[str]) -> List[Arm]:
    """Turns ``cfg["arms"]`` into :class:`Arm` objects; ``efa:*`` expands to ``available``."""
    ep = int(cfg["ep_size"])
    opts_by_transport = cfg["arms"].get("transport_options") or {}
    out: List[Arm] = []
    for role, key in (("baseline", "baselines"), ("candidate", "candidates")):
        for spec in cfg["arms"].get(key) or []:
            names = [f"efa:{t}" for t in available] if spec == "efa:*" else [spec]
            for name in names:
                if name == "ep1":
                    arm = Arm(name, role, "allgather", 1)
                elif name in ("allgather", "alltoall"):
                    arm = Arm(name, role, name, ep)
                elif name.startswith("efa:"):
                    t = name.split(":", 1)[1]
                    arm = Arm(name, role, "efa", ep, t,
                              tuple(sorted((opts_by_transport.get(t) or {}).items())))
                else:
                    raise ValueError(f"arms.{key} entry {name!r} is not one of ep1, allgather, "
                                     f"alltoall, efa:<transport>, efa:*")
                if any(a.name == arm.name for a in out):
                    raise ValueError(f"arm {arm.name!r} is listed twice")
                out.append(arm)
    if not any(a.role == "baseline" for a in out):
        raise ValueError("arms.baselines is empty: a loss-match needs at least one baseline")
    if not any(a.role == "candidate" for a in out):
        raise ValueError("arms.candidates is empty (no transport available?)")
    return out


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
