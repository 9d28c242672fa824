"""One independent start: every rank runs every cell in the start's rotated order; rank 0
returns the records."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

from efa_ep.testing.routes import bench_route

from .cells import Cell, rotate, route_stats
from .collective_cell import run_collective_cell
from .layer_cell import run_layer_cell
from .rank import RankContext, clock_of
from .schema import SCHEMA, timing_boundary
from .transport_cells import run_transport_cell


def start_main(rank: int, world: int, cfg: Dict[str, Any], start: int, cells: List[Cell],
               run_id: str) -> List[Dict[str, Any]]:
    """One independent start: every cell in this start's rotated order. Rank 0 returns records."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    torch.set_num_threads(int(cfg["num_threads"]))
    ctx = RankContext(rank, world, cfg)
    from ..provenance import collect

    records = []
    try:
        order = rotate(cells, start)
        routes_cache: Dict[Tuple, Dict[str, float]] = {}
        prev_arm = None
        for i, cell in enumerate(order):
            if prev_arm is not None and cell.arm != prev_arm:
                # An idle transport must not share the CPU with the arm being timed (a proxy's
                # channel threads poll): close the previous arm's transports (collective, same
                # order on every rank); setup stays outside the timing boundary.
                ctx.close()
            prev_arm = cell.arm
            runner = (run_layer_cell if cell.arm.view == "layer" else
                      run_collective_cell if cell.arm.collective else run_transport_cell)
            tc = time.perf_counter()
            body = runner(ctx, cell)
            body["cell_seconds"] = round(time.perf_counter() - tc, 3)
            rkey = (cell.route, cell.tokens_per_rank, cell.num_experts, cell.topk)
            if cell.arm.view != "transport":
                routes_cache[rkey] = {"note": "routed by the layer's own router"}
            elif rkey not in routes_cache:
                idx_all = [bench_route(cell.route, cell.tokens_per_rank, cell.num_experts, cell.topk,
                                       r, world, int(cfg["seed"]), float(cfg["skew"]))[0] for r in range(world)]
                routes_cache[rkey] = route_stats(idx_all, cell.num_experts, world)
            if rank == 0:
                records.append({**_record_head(cfg, run_id, start, i, cell, world, routes_cache[rkey], ctx),
                                **body})
        prov = collect() if rank == 0 else None
    finally:
        ctx.close()
    for r in records:
        r["provenance"] = prov
    return records


def _record_head(cfg, run_id, start, order_index, cell: Cell, world, rstats,
                 ctx: RankContext) -> Dict[str, Any]:
    return {
        "schema": SCHEMA, "run_id": run_id, "start": start, "order_index": order_index,
        "view": cell.arm.view, "arm": cell.arm.name, "transport": cell.arm.transport,
        "options": dict(cell.arm.options), "num_channels": cell.arm.num_channels,
        "profile": cell.profile, "shape": cell.shape, "route": cell.route,
        "route_skew": (f"zipf s={cfg['skew']}" if cell.route == "skewed" else
                       "none (uniform random top-k)" if cell.route == "uniform" else
                       "none (every expert equal load)"),
        "route_stats": rstats, "dtype": cell.dtype, "feature": cell.feature,
        "tokens_per_rank": cell.tokens_per_rank,
        "hidden": cell.hidden, "num_experts": cell.num_experts, "topk": cell.topk,
        "ep_size": world, "ranks_per_gpu": ctx.ranks_per_gpu if ctx.ranks_per_gpu else cfg.get("ranks_per_gpu"),
        "ranks_per_node": ctx.ranks_per_node, "device": cfg["device"],
        "collective_backend": ctx.backend,
        "scaled": bool(cfg.get("scaled")), "scale_note": cfg.get("scale_note"),
        "warmup": int(cfg["warmup"]), "iters": int(cfg["iters"]), "timing": cell.timing,
        "steady_iters": int(cfg.get("steady_iters", 1)) if cell.timing == "steady" else 1,
        "clock": clock_of(cell.timing, ctx.device),
        "timing_boundary": timing_boundary(cell.timing, cell.arm.view),
        # host time per op ({"dispatch": us, "combine": us}, slowest rank's medians) where the
        # arm's transport reports the time it blocks (``Transport.blocked_s``); else None
        "host_us": None,
    }
