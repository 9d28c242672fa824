"""The loss-match arms (one training run each: a dispatcher at an EP size) resolved from the
config, the config checks made before any rank starts, and the file-name form of an arm name."""
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
        transport_options: knobs passed to the transport (the dispatcher settings'
            ``transport_options``, :func:`efa_ep.dispatcher.settings.use`).
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


def validate_config(cfg: Dict[str, Any]) -> None:
    """Settings that cannot run, refused in the parent before any rank starts: every key's value
    (``efa_ep.tools.config.SETTINGS["loss_match"]``: ``steps`` >= 1, ``global_batch`` >= 1, ...),
    then combinations (the batch split over the ranks, top-k above the experts, arm names).

    Raises:
        ValueError: one line naming the key, its value and what is expected
            (:class:`~efa_ep.kernels.options.ConfigError`, with a hint, for a single key).
    """
    from efa_ep.kernels.options import TRANSPORT_NAMES, check_transport_name

    from ..config import SETTINGS, check_settings

    check_settings(cfg, SETTINGS["loss_match"])
    m, ep = cfg["model"], int(cfg["ep_size"])
    if int(cfg["global_batch"]) % ep:
        raise ValueError(f"global_batch={cfg['global_batch']} must be a multiple of ep_size={ep} "
                         f"(each rank trains global_batch / ep_size sequences; DP = EP)")
    if int(m["moe_router_topk"]) > int(m["num_moe_experts"]):
        raise ValueError(f"model.moe_router_topk={m['moe_router_topk']} must be <= "
                         f"model.num_moe_experts={m['num_moe_experts']}")
    if int(m["num_moe_experts"]) % ep:
        raise ValueError(f"model.num_moe_experts={m['num_moe_experts']} must be a multiple of "
                         f"ep_size={ep} (experts split evenly over the ranks)")
    if int(m["hidden_size"]) % int(m["num_attention_heads"]):
        raise ValueError(f"model.hidden_size={m['hidden_size']} must be a multiple of "
                         f"model.num_attention_heads={m['num_attention_heads']}")
    for key in ("baselines", "candidates"):
        for spec in cfg["arms"].get(key) or []:
            if str(spec).startswith("efa:") and spec != "efa:*":
                check_transport_name(str(spec)[4:], f"arms.{key} entry efa:<transport>")
    # names, duplicates and empty lists, as if every transport were available here
    resolve_arms(cfg, [t for t in TRANSPORT_NAMES if t != "auto"])
