"""EP dispatch+combine benchmark with the seeds' method (issue 7).

One command launches its own ranks, times every arm with one boundary, checks every arm against
``torch`` before timing it, and writes raw records, a summary, a markdown table and box plots.
The method (``../shared/notes/benchmarking.md``) in code:

1. **One timing boundary for every arm**: inputs (x, route, weights) are built before it; per
   iteration all ranks pass a barrier, the device is synchronized, then ``t0``; ``dispatch``;
   ``combine`` of the received rows (identity experts, the same for every arm); device sync;
   ``t1``. Nothing arm-specific happens inside. This is *barrier-aligned single-shot* latency
   (host clock, device synchronized), not pipelined steady state.
2. **Slowest rank** is the primary metric: every rank's per-iteration times are gathered and the
   max is taken per iteration (:func:`bench_stats.slowest_rank`); a start's value is the median
   over its measured iterations. Aggregate input tokens/s = EP x tokens_per_rank / latency.
3. **Independent starts**: every start is a fresh launch of all ranks (>= 20 by default); the
   cell order is rotated by one position per start; warm-up iterations are excluded. Summaries
   give n and the median of the start values, with a bootstrap interval only where n makes it
   meaningful (:func:`bench_stats.summarize`), otherwise min/median/max.
4. **Correctness before timing**: each arm's dispatch outputs and combine output are compared
   bit for bit with the ``torch`` transport on the same input (the contract requires equality);
   a failure voids the cell in that start and is reported.
5. **Provenance in every record**: git commit, versions (torch, Triton, megatron-core, the NCCL
   library actually loaded, libfabric), CPU/GPU model and SMs, MPS, ranks per GPU/node, channel
   count, environment knobs, and whether the shapes were scaled down.

Views: ``transport`` (dispatch+combine of a transport) and ``layer`` (one Megatron ``MoELayer``
forward+backward with the ``efa`` dispatcher on each transport vs Megatron's ``alltoall``).

Usage::

    efa-ep-bench                        # conf/bench/default.yaml (CPU-feasible sizes)
    efa-ep-bench --quick                # CI smoke run (< 60 s)
    efa-ep-bench --config-name gpu      # real shapes, bf16, ranks as processes on one GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from efa_ep.tools import bench_stats

SCHEMA = "efa_ep.bench/1"
TIMING_BOUNDARY = ("barrier-aligned single shot: [all ranks barrier, device sync] t0 -> dispatch "
                   "-> combine(recv_x) -> device sync -> t1; inputs and route built before t0")
# Fields every raw record has (tests check the schema against this list).
RECORD_FIELDS = (
    "schema", "run_id", "start", "order_index", "view", "arm", "transport", "options",
    "num_channels", "profile", "shape", "route", "route_skew", "route_stats", "dtype",
    "tokens_per_rank", "hidden", "num_experts", "topk", "ep_size", "ranks_per_gpu",
    "ranks_per_node", "device", "scaled", "scale_note", "warmup", "iters", "timing_boundary",
    "check", "void", "void_reason", "slowest_us", "start_median_us", "per_rank_median_us",
    "dispatch_rows", "dispatch_bytes", "transport_info", "provenance",
)
_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


# ----------------------------------------------------------------------------------------------
# Arms and cells
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Arm:
    """A thing that moves tokens: a transport with options, an external library, or (layer
    view) a Megatron dispatcher. ``name`` is unique: ``torch``, ``proxy:k4``, ``efa:gda``,
    ``alltoall``."""

    name: str
    view: str                    # transport | layer
    transport: Optional[str]     # efa-ep transport name (None: Megatron alltoall / external)
    options: tuple = ()
    external: Optional[str] = None

    @property
    def num_channels(self) -> Optional[int]:
        return dict(self.options).get("num_channels")


# External EP libraries: benchmarked only when importable (and an adapter exists).
EXTERNAL = {"deep_ep": "deep_ep", "uccl_ep": "uccl.ep", "nccl_ep": "nccl.ep"}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve_arms(cfg: Dict[str, Any], available: Sequence[str]) -> Tuple[List[Arm], Dict[str, str]]:
    """Arms to run, and ``{name: reason}`` for arms that will not run here."""
    arms: List[Arm] = []
    not_run: Dict[str, str] = {}
    want = cfg["arms"].get("transports") or "*"
    names = list(available) if want == "*" else [t for t in want if t in available]
    for t in ([] if want == "*" else [t for t in want if t not in available]):
        not_run[t] = "transport not available here"
    channels = cfg["arms"].get("proxy_channels") or []
    per_opts = cfg["arms"].get("transport_options") or {}
    for t in names:
        base = tuple(sorted((per_opts.get(t) or {}).items()))
        if t == "proxy" and channels:
            for k in channels:
                opts = tuple(sorted({**dict(base), "num_channels": int(k)}.items()))
                arms.append(Arm(f"proxy:k{k}", "transport", "proxy", opts))
        else:
            arms.append(Arm(t, "transport", t, base))
    for name, module in EXTERNAL.items():
        if name not in (cfg["arms"].get("external") or []):
            continue
        not_run[name] = ("installed, but efa-ep has no adapter for it yet" if _importable(module)
                         else f"not installed (import {module} failed)")
    if cfg.get("layer", {}).get("enabled"):
        arms.append(Arm("alltoall", "layer", None))
        for t in names:
            arms.append(Arm(f"efa:{t}", "layer", t, tuple(sorted((per_opts.get(t) or {}).items()))))
    if "torch" not in names:
        raise ValueError("the torch transport must be available: it is the correctness reference")
    return arms, not_run


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (arm, profile, shape, route) combination: the unit of the summary."""

    arm: Arm
    profile: str
    shape: str
    route: str
    tokens_per_rank: int
    hidden: int
    num_experts: int
    topk: int
    dtype: str

    @property
    def key(self) -> str:
        return f"{self.arm.view}|{self.arm.name}|{self.profile}|{self.shape}|{self.route}|{self.dtype}"


def build_cells(cfg: Dict[str, Any], arms: Sequence[Arm]) -> List[Cell]:
    cells = []
    for arm in arms:
        if arm.view == "transport":
            for pname, prof in cfg["profiles"].items():
                for sname in cfg["use_shapes"]:
                    shape = cfg["shapes"][sname]
                    for route in cfg["routes"]:
                        cells.append(Cell(arm, pname, sname, route, int(prof["tokens_per_rank"]),
                                          int(shape["hidden"]), int(shape["num_experts"]),
                                          int(shape["topk"]), cfg["dtype"]))
        else:
            lay = cfg["layer"]
            cells.append(Cell(arm, "layer", lay["name"], lay["route"], int(lay["tokens_per_rank"]),
                              int(lay["hidden"]), int(lay["num_experts"]), int(lay["topk"]),
                              lay["dtype"]))
    return cells


def rotate(items: Sequence[Any], start: int) -> List[Any]:
    """Cell order of start ``start``: rotated by ``start`` positions, so over starts every cell
    runs early and late (warm caches, thermal state, neighbours' load)."""
    if not items:
        return []
    k = start % len(items)
    return list(items[k:]) + list(items[:k])


# ----------------------------------------------------------------------------------------------
# Routes
# ----------------------------------------------------------------------------------------------
def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def make_route(kind: str, num_tokens: int, num_experts: int, topk: int, rank: int, world: int,
               seed: int, skew: float = 1.2):
    """Top-k routes of one rank's tokens: ``(topk_idx [T, K] int64, topk_weights [T, K] f32)``.

    - ``balanced``: every expert receives exactly the same number of slots over all ranks when
      W*T is a multiple of E/K (token g takes experts P[(g + j*E/K) mod E] for a seeded
      permutation P shared by all ranks: K distinct experts, spread over ranks).
    - ``skewed``: K distinct experts per token sampled without replacement with Zipf weights
      1/(i+1)^skew over a seeded expert order (same on all ranks): a few experts are hot.
    """
    import torch

    g = torch.Generator().manual_seed(_seed(seed, "perm", num_experts))
    perm = torch.randperm(num_experts, generator=g)
    gr = torch.Generator().manual_seed(_seed(seed, kind, rank, num_tokens, num_experts, topk))
    if kind == "balanced":
        stride = max(1, num_experts // topk)
        gtok = torch.arange(num_tokens) + rank * num_tokens
        slots = (gtok.unsqueeze(1) + stride * torch.arange(topk).unsqueeze(0)) % num_experts
        idx = perm[slots]
    elif kind == "skewed":
        w = 1.0 / (torch.arange(num_experts, dtype=torch.float64) + 1) ** skew
        probs = torch.empty(num_experts, dtype=torch.float64)
        probs[perm] = w / w.sum()
        idx = torch.multinomial(probs.float().expand(num_tokens, -1), topk, replacement=False,
                                generator=gr)
    else:
        raise ValueError(f"route {kind!r}: expected balanced or skewed")
    weights = torch.rand(num_tokens, topk, generator=gr)
    weights = weights / weights.sum(1, keepdim=True)
    return idx.to(torch.int64).contiguous(), weights.float().contiguous()


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


# ----------------------------------------------------------------------------------------------
# Rank side
# ----------------------------------------------------------------------------------------------
def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compare(name, got, want) -> Optional[str]:
    import torch

    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {tuple(got.shape)} {got.dtype} vs torch {tuple(want.shape)} {want.dtype}"
    if not torch.equal(got.cpu(), want.cpu()):
        diff = (got.double() - want.double()).abs().max().item() if got.is_floating_point() else "ints"
        return f"{name}: differs from torch (max |diff| {diff})"
    return None


class _RankContext:
    def __init__(self, rank, world, cfg):
        import torch

        self.rank, self.world, self.cfg = rank, world, cfg
        dev = cfg["device"]
        if dev.startswith("cuda"):
            n = torch.cuda.device_count()
            dev = f"cuda:{rank % n}" if dev == "cuda" else dev
            torch.cuda.set_device(torch.device(dev))
        self.device = torch.device(dev)
        self.transports: Dict[Tuple, Any] = {}
        self.layers: Dict[str, Any] = {}
        self.megatron_ready = False

    def transport(self, name, options, cell: Cell):
        import torch

        from efa_ep.kernels import create_transport

        dtype = getattr(torch, _DTYPES[cell.dtype])
        key = (name, options, cell.hidden, cell.num_experts, dtype)
        t = self.transports.get(key)
        if t is None:
            max_tokens = max(int(p["tokens_per_rank"]) for p in self.cfg["profiles"].values())
            t = create_transport(name, None, cell.num_experts, cell.hidden, max_tokens, dtype,
                                 **dict(options))
            self.transports[key] = t
        return t

    def close(self):
        for t in self.transports.values():
            try:
                t.close()
            except Exception:
                pass
        self.transports.clear()
        if self.megatron_ready:  # transports the efa layers created through the dispatcher
            from efa_ep.dispatcher.token_dispatcher import clear_transport_cache

            clear_transport_cache()


def _inputs(ctx: _RankContext, cell: Cell, rank: int):
    import torch

    dtype = getattr(torch, _DTYPES[cell.dtype])
    seed = int(ctx.cfg["seed"])
    idx, w = make_route(cell.route, cell.tokens_per_rank, cell.num_experts, cell.topk, rank,
                        ctx.world, seed, float(ctx.cfg["skew"]))
    g = torch.Generator().manual_seed(_seed(seed, "x", rank, cell.tokens_per_rank, cell.hidden))
    x = torch.randn(cell.tokens_per_rank, cell.hidden, generator=g).to(dtype)
    return x.to(ctx.device), idx.to(ctx.device), w.to(ctx.device)


def _time_iters(ctx: _RankContext, fn, warmup: int, iters: int) -> List[float]:
    import torch.distributed as dist

    times = []
    for i in range(warmup + iters):
        dist.barrier()
        _sync(ctx.device)
        t0 = time.perf_counter()
        fn()
        _sync(ctx.device)
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    return times


def _agree(ok: bool, device) -> bool:
    """True only if every rank says ok (so all ranks skip a void cell together)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _gather_times(times: List[float]) -> List[List[float]]:
    import torch.distributed as dist

    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, times)
    return parts


def _run_transport_cell(ctx: _RankContext, cell: Cell) -> Dict[str, Any]:
    import torch.distributed as dist

    x, idx, w = _inputs(ctx, cell, ctx.rank)
    ref = ctx.transport("torch", (), cell)
    r_recv_x, r_recv_idx, r_recv_w, r_tpe, r_handle = ref.dispatch(x, idx, w)
    r_out = ref.combine(r_recv_x, r_handle)
    t = ctx.transport(cell.arm.transport, cell.arm.options, cell)
    err = None
    if cell.arm.transport == "torch":
        check = "reference"
    else:
        try:
            recv_x, recv_idx, recv_w, tpe, handle = t.dispatch(x, idx, w)
            out = t.combine(recv_x, handle)
            for name, got, want in (("recv_x", recv_x, r_recv_x), ("recv_topk_idx", recv_idx, r_recv_idx),
                                    ("recv_topk_weights", recv_w, r_recv_w),
                                    ("tokens_per_expert", tpe, r_tpe), ("combine_out", out, r_out)):
                err = err or _compare(name, got, want)
        except Exception as e:  # a crashing arm voids its cell; peers learn it via _agree
            err = f"{type(e).__name__}: {e}"
        check = "pass" if err is None else "fail"
    ok = _agree(err is None, ctx.device)
    info = {}
    describe = getattr(t, "describe", None)
    if callable(describe):
        try:
            info = dict(describe())
        except Exception:
            info = {}
    rows = sum(r_handle.num_send_per_rank)
    total_rows = [None] * ctx.world
    dist.all_gather_object(total_rows, rows)
    rec: Dict[str, Any] = {"check": {"status": check if ok else "fail", "detail": err},
                           "dispatch_rows": sum(total_rows),
                           "dispatch_bytes": sum(total_rows) * cell.hidden * x.element_size(),
                           "transport_info": info}
    if not ok:
        rec.update(void=True, void_reason=err or "a peer rank's check failed", slowest_us=[],
                   start_median_us=None, per_rank_median_us=[])
        return rec

    def once():
        rx, _, _, _, h = t.dispatch(x, idx, w)
        t.combine(rx, h)

    times = _time_iters(ctx, once, int(ctx.cfg["warmup"]), int(ctx.cfg["iters"]))
    return _finish(rec, times)


def _finish(rec, times):
    import statistics

    per_rank = _gather_times(times)
    slow = bench_stats.slowest_rank(per_rank)
    rec.update(void=False, void_reason=None, slowest_us=[round(s * 1e6, 3) for s in slow],
               start_median_us=round(statistics.median(slow) * 1e6, 3),
               per_rank_median_us=[round(statistics.median(t) * 1e6, 3) for t in per_rank])
    return rec


def _layer(ctx: _RankContext, cell: Cell):
    """Megatron MoELayer for this cell's arm; efa layers copy the alltoall layer's weights."""
    import torch
    import torch.distributed as dist

    from efa_ep.dispatcher import settings as dsettings

    if not ctx.megatron_ready:
        import efa_ep  # noqa: F401
        from efa_ep.tiny_moe import init_megatron

        init_megatron(ctx.world, seed=int(ctx.cfg["seed"]))
        ctx.megatron_ready = True
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, transformer_config

    lay = ctx.cfg["layer"]

    def build(dispatcher):
        mcfg = TinyMoEConfig(num_layers=1, hidden_size=cell.hidden, num_moe_experts=cell.num_experts,
                             moe_router_topk=cell.topk, ffn_hidden_size=int(lay["ffn_hidden_size"]),
                             moe_ffn_hidden_size=int(lay["ffn_hidden_size"]), dtype=cell.dtype,
                             num_attention_heads=1)
        config = transformer_config(mcfg, dispatcher, ctx.world)
        sub = get_submodules(get_gpt_layer_local_submodules(num_experts=cell.num_experts).mlp)
        layer = MoELayer(config, sub)
        layer.set_layer_number(0)
        return layer.to(ctx.device)

    if "alltoall" not in ctx.layers:
        torch.manual_seed(0)
        ref = build("alltoall")
        w = ref.router.weight.data.cpu().clone()  # same router on every rank
        dist.broadcast(w, src=0)
        ref.router.weight.data.copy_(w)
        ctx.layers["alltoall"] = ref
    if cell.arm.name not in ctx.layers:
        dsettings.configure(transport=cell.arm.transport, **dict(cell.arm.options))
        try:
            layer = build("efa")
        finally:
            dsettings.reset()
        layer.load_state_dict(ctx.layers["alltoall"].state_dict())
        ctx.layers[cell.arm.name] = layer
    return ctx.layers[cell.arm.name]


def _run_layer_cell(ctx: _RankContext, cell: Cell) -> Dict[str, Any]:
    import torch

    dtype = getattr(torch, _DTYPES[cell.dtype])
    seq, batch = cell.tokens_per_rank // int(ctx.cfg["layer"]["micro_batch"]), int(ctx.cfg["layer"]["micro_batch"])
    g = torch.Generator().manual_seed(_seed(ctx.cfg["seed"], "layer", ctx.rank))
    x = torch.randn(seq, batch, cell.hidden, generator=g).to(dtype).to(ctx.device)
    grad = torch.randn(seq, batch, cell.hidden, generator=g).to(dtype).to(ctx.device)
    err = None
    try:
        layer = _layer(ctx, cell)
        ref = ctx.layers["alltoall"]
        if layer is not ref:
            xa = x.clone().requires_grad_(True)
            xb = x.clone().requires_grad_(True)
            oa, _ = ref(xa)
            ob, _ = layer(xb)
            oa.backward(grad)
            ob.backward(grad)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            if not torch.allclose(ob.float(), oa.float(), **tol):
                err = f"layer output differs from alltoall (max |diff| {(ob.float() - oa.float()).abs().max().item():.3g})"
            elif not torch.allclose(xb.grad.float(), xa.grad.float(), **tol):
                err = "layer input grad differs from alltoall"
    except Exception as e:
        err = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    ok = _agree(err is None, ctx.device)
    check = "reference" if cell.arm.name == "alltoall" and err is None else ("pass" if ok else "fail")
    rec: Dict[str, Any] = {"check": {"status": check, "detail": err}, "dispatch_rows": None,
                           "dispatch_bytes": None, "transport_info": {}}
    if not ok:
        rec.update(void=True, void_reason=err or "a peer rank's check failed", slowest_us=[],
                   start_median_us=None, per_rank_median_us=[])
        return rec
    xin = x.clone().requires_grad_(True)

    def once():
        out, _ = layer(xin)
        out.backward(grad)
        xin.grad = None

    times = _time_iters(ctx, once, int(ctx.cfg["warmup"]), int(ctx.cfg["iters"]))
    return _finish(rec, times)


def _start_main(rank: int, world: int, cfg: Dict[str, Any], start: int, cells: List[Cell],
                run_id: str) -> List[Dict[str, Any]]:
    """One independent start: every cell in this start's rotated order. Rank 0 returns records."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    torch.set_num_threads(int(cfg["num_threads"]))
    ctx = _RankContext(rank, world, cfg)
    from efa_ep.tools.provenance import collect

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
            runner = _run_transport_cell if cell.arm.view == "transport" else _run_layer_cell
            tc = time.perf_counter()
            body = runner(ctx, cell)
            body["cell_seconds"] = round(time.perf_counter() - tc, 3)
            rkey = (cell.route, cell.tokens_per_rank, cell.num_experts, cell.topk)
            if cell.arm.view != "transport":
                routes_cache[rkey] = {"note": "routed by the layer's own router"}
            elif rkey not in routes_cache:
                idx_all = [make_route(cell.route, cell.tokens_per_rank, cell.num_experts, cell.topk,
                                      r, world, int(cfg["seed"]), float(cfg["skew"]))[0] for r in range(world)]
                routes_cache[rkey] = route_stats(idx_all, cell.num_experts, world)
            if rank == 0:
                records.append({**_record_head(cfg, run_id, start, i, cell, world, routes_cache[rkey]),
                                **body})
        prov = collect() if rank == 0 else None
    finally:
        ctx.close()
    for r in records:
        r["provenance"] = prov
    return records


def _record_head(cfg, run_id, start, order_index, cell: Cell, world, rstats) -> Dict[str, Any]:
    rpg = cfg.get("ranks_per_gpu")
    return {
        "schema": SCHEMA, "run_id": run_id, "start": start, "order_index": order_index,
        "view": cell.arm.view, "arm": cell.arm.name, "transport": cell.arm.transport,
        "options": dict(cell.arm.options), "num_channels": cell.arm.num_channels,
        "profile": cell.profile, "shape": cell.shape, "route": cell.route,
        "route_skew": (f"zipf s={cfg['skew']}" if cell.route == "skewed" else "none (every expert equal load)"),
        "route_stats": rstats, "dtype": cell.dtype, "tokens_per_rank": cell.tokens_per_rank,
        "hidden": cell.hidden, "num_experts": cell.num_experts, "topk": cell.topk,
        "ep_size": world, "ranks_per_gpu": rpg, "ranks_per_node": world, "device": cfg["device"],
        "scaled": bool(cfg.get("scaled")), "scale_note": cfg.get("scale_note"),
        "warmup": int(cfg["warmup"]), "iters": int(cfg["iters"]),
        "timing_boundary": TIMING_BOUNDARY if cell.arm.view == "transport" else
        TIMING_BOUNDARY.replace("dispatch -> combine(recv_x)", "MoELayer forward + backward"),
    }


# ----------------------------------------------------------------------------------------------
# Parent: starts, summary, outputs
# ----------------------------------------------------------------------------------------------
def summarize_records(records: List[Dict[str, Any]], cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One summary row per cell: n (non-void starts), n_void, stats of the per-start medians,
    tokens/s, and the ratio to the reference arm (``torch`` / ``alltoall``) of the same cell."""
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["view"], r["profile"], r["shape"], r["route"], r["dtype"], r["arm"]), []).append(r)
    rows = []
    for (view, profile, shape, route, dtype, arm), recs in groups.items():
        good = [r["start_median_us"] for r in recs if not r["void"]]
        st = bench_stats.summarize(good, alpha=float(cfg["alpha"]), min_n_for_ci=int(cfg["min_n_for_ci"]),
                                   seed=int(cfg["seed"]))
        r0 = recs[0]
        tok_s = (r0["ep_size"] * r0["tokens_per_rank"] / (st["median"] * 1e-6)) if st["median"] else None
        rows.append({"view": view, "profile": profile, "shape": shape, "route": route, "dtype": dtype,
                     "arm": arm, "num_channels": r0["num_channels"], "tokens_per_rank": r0["tokens_per_rank"],
                     "hidden": r0["hidden"], "num_experts": r0["num_experts"], "topk": r0["topk"],
                     "ep_size": r0["ep_size"], "n_void": sum(1 for r in recs if r["void"]),
                     "void_reasons": sorted({(r["void_reason"] or "")[:200] for r in recs if r["void"]}),
                     "latency_us": st, "tokens_per_s": tok_s, "route_stats": r0["route_stats"]})
    ref_of = {"transport": "torch", "layer": "alltoall"}
    by_key = {(r["view"], r["profile"], r["shape"], r["route"], r["dtype"], r["arm"]): r for r in rows}
    for r in rows:
        ref = by_key.get((r["view"], r["profile"], r["shape"], r["route"], r["dtype"], ref_of[r["view"]]))
        r["vs_reference"] = bench_stats.ratio(r["latency_us"]["median"],
                                              ref["latency_us"]["median"] if ref else None)
    rows.sort(key=lambda r: (r["view"] != "transport", r["profile"], r["shape"], r["route"], r["arm"]))
    return rows


def markdown_table(rows: List[Dict[str, Any]], cfg: Dict[str, Any], meta: Dict[str, Any]) -> str:
    lines = [f"Slowest-rank latency in us: median of per-start medians, with a bootstrap interval "
             f"of the median where n allows ({int(100 * (1 - float(cfg['alpha'])))}%), else min/max. "
             f"Timing: {TIMING_BOUNDARY}. EP={meta['ep_size']}, dtype {cfg['dtype']}, device "
             f"{cfg['device']}, starts {cfg['starts']} x {cfg['iters']} iters (+{cfg['warmup']} warm-up)."]
    if cfg.get("scaled"):
        lines.append(f"**Scaled shapes:** {cfg.get('scale_note')}")
    for view, ref in (("transport", "torch"), ("layer", "alltoall")):
        vr = [r for r in rows if r["view"] == view]
        if not vr:
            continue
        title = ("Dispatch + combine" if view == "transport"
                 else "MoE layer forward + backward (Megatron MoELayer)")
        lines += ["", f"### {title}", "",
                  f"| profile | shape (H, E, top-k, tok/rank) | route | arm | latency us | "
                  f"tokens/s (aggregate) | vs {ref} | void |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in vr:
            shape = f"{r['shape']} ({r['hidden']}, {r['num_experts']}, {r['topk']}, {r['tokens_per_rank']})"
            tps = f"{r['tokens_per_s']:.3g}" if r["tokens_per_s"] else "-"
            vs = f"{r['vs_reference']:.3f}" if r["vs_reference"] else "-"
            lines.append(f"| {r['profile']} | {shape} | {r['route']} | {r['arm']} | "
                         f"{bench_stats.format_stats(r['latency_us'])} | {tps} | {vs} | {r['n_void']} |")
    if meta.get("not_run"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in meta["not_run"].items())]
    return "\n".join(lines) + "\n"


def box_plots(records: List[Dict[str, Any]], out_dir: str) -> List[str]:
    """One PNG per profile: per-start medians of every arm, grouped by shape and route."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    profiles = sorted({r["profile"] for r in records})
    for prof in profiles:
        recs = [r for r in records if r["profile"] == prof and not r["void"]]
        groups = sorted({(r["shape"], r["route"]) for r in recs})
        arms = sorted({r["arm"] for r in recs}, key=lambda a: (a not in ("torch", "alltoall"), a))
        if not groups:
            continue
        fig, axes = plt.subplots(1, len(groups), figsize=(max(5, 3.2 * len(groups)), 4.2), squeeze=False)
        for ax, (shape, route) in zip(axes[0], groups):
            data, labels = [], []
            for a in arms:
                vals = [r["start_median_us"] for r in recs if r["shape"] == shape and r["route"] == route and r["arm"] == a]
                if vals:
                    data.append(vals)
                    labels.append(f"{a}\nn={len(vals)}")
            ax.boxplot(data, showfliers=True)
            ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7, rotation=30)
            ax.set_title(f"{shape} / {route}", fontsize=9)
            ax.set_ylabel("slowest-rank latency, us")
        fig.suptitle(f"profile {prof}: per-start medians", fontsize=10)
        fig.tight_layout()
        p = os.path.join(out_dir, f"bench_{prof}.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def run(cfg: Dict[str, Any], log=print) -> Dict[str, Any]:
    from efa_ep.distributed import run_ranks
    from efa_ep.kernels import available_transports

    out_dir = os.path.abspath(cfg["out_dir"])
    os.makedirs(out_dir, exist_ok=True)
    arms, not_run = resolve_arms(cfg, available_transports())
    cells = build_cells(cfg, arms)
    world = int(cfg["ep_size"])
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + hashlib.sha1(os.urandom(8)).hexdigest()[:6]
    env = {"FI_TCP_IFACE": os.environ.get("FI_TCP_IFACE", "lo"), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": str(cfg["num_threads"])}
    env.update({k: str(v) for k, v in (cfg.get("env") or {}).items()})
    records: List[Dict[str, Any]] = []
    failed_starts: List[Dict[str, Any]] = []
    jsonl = os.path.join(out_dir, "bench_records.jsonl")
    t0 = time.perf_counter()
    try:
        from tqdm import tqdm

        bar = tqdm(total=int(cfg["starts"]) * len(cells), unit="cell", desc="efa-ep-bench",
                   disable=not cfg.get("progress", True), file=sys.stderr)
    except ImportError:
        bar = None
    with open(jsonl, "w") as f:
        for start in range(int(cfg["starts"])):
            res = run_ranks(_start_main, world, (cfg, start, cells, run_id), backend=cfg["backend"],
                            timeout_s=float(cfg["start_timeout_s"]), pg_timeout_s=float(cfg["pg_timeout_s"]),
                            env=env, raise_on_error=False)
            ok, val = res[0]
            if all(o for o, _ in res):
                for rec in val:
                    f.write(json.dumps(rec) + "\n")
                records.extend(val)
            else:
                errs = "\n".join(f"rank {r}: {v}" for r, (o, v) in enumerate(res) if not o)
                failed_starts.append({"start": start, "error": errs[-4000:]})
                log(f"[bench] start {start} failed:\n{errs[-2000:]}", file=sys.stderr)
            f.flush()
            if bar is not None:
                bar.update(len(cells))
    if bar is not None:
        bar.close()
    rows = summarize_records(records, cfg)
    meta = {"ep_size": world, "not_run": not_run}
    summary = {"schema": SCHEMA + "-summary", "run_id": run_id, "config": cfg,
               "wall_seconds": round(time.perf_counter() - t0, 1), "not_run": not_run,
               "failed_starts": failed_starts, "timing_boundary": TIMING_BOUNDARY,
               "provenance": records[0]["provenance"] if records else None, "cells": rows}
    with open(os.path.join(out_dir, "bench_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    table = markdown_table(rows, cfg, meta)
    with open(os.path.join(out_dir, "bench_table.md"), "w") as f:
        f.write(table)
    summary["plots"] = box_plots(records, out_dir)
    summary["table"] = table
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="efa-ep-bench", description=__doc__.split("\n\n")[0],
                                     epilog="Positional arguments are Hydra overrides, e.g. starts=30.")
    parser.add_argument("--config-name", default=None, help="conf/bench/<name>.yaml (default: default)")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: conf/bench/quick.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from efa_ep.tools.config import compose

    name = args.config_name or ("quick" if args.quick else "default")
    cfg = compose("bench", name, args.overrides)
    try:
        summary = run(cfg)
    except Exception:
        traceback.print_exc()
        print("bench: FAIL error (see traceback above)")
        return 1
    print(summary["table"])
    voids = sum(r["n_void"] for r in summary["cells"])
    print(f"bench: records={sum(r['latency_us']['n'] for r in summary['cells'])} cells={len(summary['cells'])} "
          f"void={voids} failed_starts={len(summary['failed_starts'])} "
          f"out={os.path.abspath(cfg['out_dir'])} wall={summary['wall_seconds']}s")
    return 0 if not summary["failed_starts"] and voids == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
