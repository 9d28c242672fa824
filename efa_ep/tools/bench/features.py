"""Training features of the ``layer`` view (``layer.features``): each is a mode of the Megatron
``MoELayer`` that both dispatchers of a cell run in, ``alltoall`` and ``efa`` alike, so every
feature's efa cells are compared with ``alltoall`` in the same mode.

- ``plain``: the layer as the ``layer`` section builds it (dropless, no shared expert).
- ``pad``: drop-and-pad capacity mode: ``moe_expert_capacity_factor = layer.capacity_factor``
  and ``moe_pad_expert_input_to_capacity=True``. The efa dispatcher then takes its static-shape
  path (``Transport.dispatch_fixed``; over ``gda`` no host wait in dispatch or combine), with
  ``EFA_EP_CAPACITY_OVERFLOW = layer.capacity_overflow`` (``drop`` keeps that path free of host
  reads; ``error`` adds a count all-gather and a host read per dispatch) and ``max_topk`` of the
  transports that size windows by it raised to ``num_experts`` (a token carries one slot per
  expert in this mode).
- ``shared``: a shared expert (``moe_shared_expert_intermediate_size =
  layer.shared_expert_intermediate_size``, null: ``ffn_hidden_size``) run after the routed
  experts (``moe_shared_expert_overlap=False``): the baseline of ``shared_overlap``.
- ``shared_overlap``: the same shared expert with ``moe_shared_expert_overlap=True`` (its pieces
  run on a side stream around the dispatcher's transfers).

Names join with ``+`` to combine modes (``pad+shared_overlap``); ``shared`` and
``shared_overlap`` exclude each other.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Tuple

FEATURES = ("plain", "pad", "shared", "shared_overlap")


def feature_parts(feature: str) -> Tuple[str, ...]:
    """The modes a feature name combines (``pad+shared_overlap`` -> ``("pad",
    "shared_overlap")``); ``plain`` alone is the empty combination."""
    return tuple(p for p in str(feature).split("+") if p != "plain")


def layer_features(cfg: Mapping[str, Any]) -> List[str]:
    """``layer.features`` as a list (absent: ``[plain]``)."""
    feats = (cfg.get("layer") or {}).get("features")
    if feats is None:
        return ["plain"]
    return [feats] if isinstance(feats, str) else [str(f) for f in feats]


def check_features(cfg: Mapping[str, Any]) -> List[str]:
    """``layer.features`` checked: known names, no duplicates, settings the modes need.

    Raises:
        ValueError: one line naming the key and what is wrong.
    """
    feats = layer_features(cfg)
    if not feats:
        raise ValueError(f"layer.features is empty: list one or more of {', '.join(FEATURES)}")
    if len(set(feats)) != len(feats):
        raise ValueError(f"layer.features={feats}: a feature is listed twice")
    for f in feats:
        parts = str(f).split("+")
        bad = [p for p in parts if p not in FEATURES]
        if bad:
            raise ValueError(f"layer.features: {bad[0]!r} is not a feature; expected one of "
                             f"{', '.join(FEATURES)} (or several joined with +)")
        if len(set(parts)) != len(parts) or ("plain" in parts and len(parts) > 1):
            raise ValueError(f"layer.features: {f!r} repeats a mode or combines plain")
        if {"shared", "shared_overlap"} <= set(parts):
            raise ValueError(f"layer.features: {f!r} combines shared and shared_overlap "
                             f"(the same shared expert without and with overlap)")
    lay = cfg.get("layer") or {}
    used = {p for f in feats for p in feature_parts(f)}
    if "pad" in used:
        factor = lay.get("capacity_factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise ValueError(f"layer.capacity_factor={factor!r} must be a number > 0 (feature pad)")
        tokens, topk, experts = (int(lay[k]) for k in ("tokens_per_rank", "topk", "num_experts"))
        cap = capacity(tokens, topk, experts, float(factor))
        if cap > tokens:
            # Megatron's alltoall reshapes its padded input by C and fails when C > T
            raise ValueError(f"layer.capacity_factor={factor}: capacity {cap} tokens per expert "
                             f"exceeds tokens_per_rank={tokens}; use a factor <= num_experts / "
                             f"topk = {experts / topk:g}")
        from efa_ep.dispatcher.settings import CAPACITY_OVERFLOW_POLICIES

        policy = lay.get("capacity_overflow", "drop")
        if policy not in CAPACITY_OVERFLOW_POLICIES:
            raise ValueError(f"layer.capacity_overflow={policy!r} is not one of "
                             f"{', '.join(CAPACITY_OVERFLOW_POLICIES)}")
    if used & {"shared", "shared_overlap"}:
        size = lay.get("shared_expert_intermediate_size")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"layer.shared_expert_intermediate_size={size!r} must be a positive "
                             f"integer or null (null: ffn_hidden_size)")
    return feats


def capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Tokens per expert per source rank in drop-and-pad mode (Megatron's ``get_capacity``)."""
    return math.ceil(tokens * topk / num_experts * factor)


def megatron_overrides(feature: str, lay: Mapping[str, Any]) -> Dict[str, Any]:
    """The ``TransformerConfig`` fields ``feature`` sets, for both dispatchers."""
    out: Dict[str, Any] = {}
    parts = feature_parts(feature)
    if "pad" in parts:
        out.update(moe_expert_capacity_factor=float(lay["capacity_factor"]),
                   moe_pad_expert_input_to_capacity=True)
    if "shared" in parts or "shared_overlap" in parts:
        size = lay.get("shared_expert_intermediate_size")
        out.update(moe_shared_expert_intermediate_size=int(size if size is not None
                                                            else lay["ffn_hidden_size"]),
                   moe_shared_expert_overlap="shared_overlap" in parts)
    return out


def efa_settings(feature: str, lay: Mapping[str, Any], transport: str, options: tuple,
                 num_experts: int) -> Tuple[tuple, Dict[str, Any]]:
    """What the efa dispatcher needs for ``feature`` on ``transport``: the transport options
    (``options`` with ``max_topk`` raised to ``num_experts`` in ``pad`` mode, for transports
    whose windows are sized by it) and the attributes set on the layer's ``TransformerConfig``
    (``efa_ep_capacity_overflow`` in ``pad`` mode)."""
    from efa_ep.kernels.options import SCHEMAS

    opts = dict(options)
    attrs: Dict[str, Any] = {}
    if "pad" in feature_parts(feature):
        if "max_topk" in SCHEMAS.get(transport, {}):
            opts["max_topk"] = max(int(opts.get("max_topk") or 0), int(num_experts))
        attrs["efa_ep_capacity_overflow"] = str(lay.get("capacity_overflow", "drop"))
    return tuple(sorted(opts.items())), attrs
