"""Cells (arm x profile x shape x route x timing, and x feature in the layer view: the unit of
the summary), their order per start, and the load statistics of a cell's routes."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from .arms import Arm, timing_modes
from .features import layer_features


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (arm, profile, shape, route, timing, feature) combination: the unit of the summary.
    ``feature`` is the layer view's training feature (:mod:`.features`); None in the transport
    view."""

    arm: Arm
    profile: str
    shape: str
    route: str
    tokens_per_rank: int
    hidden: int
    num_experts: int
    topk: int
    dtype: str
    timing: str = "single"
    feature: Optional[str] = None

    @property
    def key(self) -> str:
        return (f"{self.arm.view}|{self.arm.name}|{self.profile}|{self.shape}|{self.route}|"
                f"{self.dtype}|{self.timing}|{self.feature}")


def build_cells(cfg: Dict[str, Any], arms: Sequence[Arm]) -> List[Cell]:
    """Every cell of the run: per timing mode, each transport-view arm x profile x shape x
    route, and each layer-view arm x ``layer.features`` (the ``layer`` section's shape)."""
    cells = []
    for timing in timing_modes(cfg):
        for arm in arms:
            if arm.view == "transport":
                for pname, prof in cfg["profiles"].items():
                    for sname in cfg["use_shapes"]:
                        shape = cfg["shapes"][sname]
                        for route in cfg["routes"]:
                            cells.append(Cell(arm, pname, sname, route, int(prof["tokens_per_rank"]),
                                              int(shape["hidden"]), int(shape["num_experts"]),
                                              int(shape["topk"]), cfg["dtype"], timing))
            else:
                lay = cfg["layer"]
                for feature in layer_features(cfg):
                    cells.append(Cell(arm, "layer", lay["name"], lay["route"],
                                      int(lay["tokens_per_rank"]), int(lay["hidden"]),
                                      int(lay["num_experts"]), int(lay["topk"]), lay["dtype"],
                                      timing, feature))
    return cells


def rotate(items: Sequence[Any], start: int) -> List[Any]:
    """Cell order of start ``start``: rotated by ``start`` positions, so over starts every cell
    runs early and late (warm caches, thermal state, neighbours' load)."""
    if not items:
        return []
    k = start % len(items)
    return list(items[k:]) + list(items[:k])


def route_stats(idx_all, num_experts: int, world: int) -> Dict[str, float]:
    """Load imbalance of the routes of all ranks: expert max/mean slots, rank max/mean rows
    (rows = de-duplicated (token, destination rank) pairs)."""
    import torch

    idx = torch.cat(list(idx_all))
    per_expert = torch.bincount(idx.flatten(), minlength=num_experts).double()
    local = num_experts // world
    dest = idx // local
    rows = torch.zeros(world, dtype=torch.float64)
    for r in range(world):
        rows[r] = (dest == r).any(1).sum()
    return {"expert_max_over_mean": round(float(per_expert.max() / per_expert.mean()), 3),
            "rank_rows_max_over_mean": round(float(rows.max() / rows.mean()), 3),
            "rows_per_token": round(float(rows.sum() / idx.shape[0]), 3)}
