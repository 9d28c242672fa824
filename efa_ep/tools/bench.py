"""Times expert-parallel dispatch + combine of every transport side by side, honestly.

One command launches its own ranks, times every arm with one boundary, checks every arm against
``torch`` before timing it, and writes raw records, a summary, a markdown table and box plots.
The method in code:

1. **One timing boundary for every arm**: inputs (x, route, weights) are built before it; each
   sample starts after all ranks pass a barrier and the device is synchronized, and ends when
   combine has completed. Nothing arm-specific happens inside. Two timing modes (``timing``):
   ``single`` is *barrier-aligned single shot* (host clock around one dispatch + combine and a
   device sync); ``steady`` times ``steady_iters`` back-to-back dispatch + combine iterations
   with CUDA events on the current stream (host clock after a device sync on CPU) and reports
   elapsed / ``steady_iters``. Every record says which (``timing``, ``clock``).
2. **Slowest rank** is the primary metric: every rank's per-sample times are gathered and the
   max is taken per sample (:func:`bench_stats.slowest_rank`); a start's value is the median
   over its measured samples. Aggregate input tokens/s = EP x tokens_per_rank / latency.
3. **Independent starts**: every start is a fresh launch of all ranks (>= 20 by default); the
   cell order is rotated by one position per start; warm-up samples are excluded. Summaries
   give n and the median of the start values, with a bootstrap interval only where n makes it
   meaningful (:func:`bench_stats.summarize`), otherwise min/median/max.
4. **Correctness before timing**: each arm's dispatch outputs and combine output are compared
   bit for bit with the ``torch`` transport on the same input (the contract requires equality);
   a failure voids the cell in that start and is reported.
5. **Provenance in every record**: git commit, versions (torch, Triton, megatron-core, the NCCL
   library actually loaded, libfabric), CPU/GPU model and SMs, the kernels' SM budget, MPS,
   ranks per GPU/node, the process group's backend, channel count, resolved transport options
   (gda ``num_programs``/``launch_gate``, proxy channels/provider), environment knobs, and
   whether the shapes were scaled down.

Arms of the ``transport`` view: each efa-ep transport, and the raw collective arm ``nccl``:
``torch.distributed.all_to_all_single`` of the same bytes as dispatch + combine (a
dispatch-sized exchange of each sent row with its routing metadata, then a combine-sized
exchange back, with the per-destination row counts the dispatcher sends), on the same ranks,
inside the same boundary. It needs an NCCL group (``backend=nccl``); ``arms.nccl_arm=gloo`` runs
the same exchange over gloo for CPU tests, named ``a2a:gloo``. Control collectives (check
agreement, barriers, broadcasts) put their tensors on :func:`collective_device` of the group.

``hier`` runs only when listed (``arms.transports=[torch,proxy,hier]``), as one arm per
``arms.hier_aggregate`` value (``hier:agg1`` once per destination node, ``hier:agg0`` once per
destination rank), with ``node_size`` = the emulated ranks per node (null: per host).

``gda`` runs as one arm per ``arms.gda_modes`` entry: ``gda`` (regular dispatch, compact
receive, one host sync), ``gda:fixed`` (``dispatch_fixed``: the window is the receive buffer,
no host sync) and ``gda:graph`` (that dispatch + combine captured once in a CUDA graph, each
sample one replay); the fixed arms are checked on the used window rows.

Network counts: every transport record has ``net_counts``: the network messages, rows, payload
bytes, libfabric writes and wire bytes of one dispatch and one combine, summed over the ranks
(from the transports' ``last_op_counts``; None for arms that do not count, e.g. ``torch``), and
the flat route's cross-node figure at the same layout; the table lists them per counting arm.

Views: ``transport`` (dispatch+combine of a transport) and ``layer`` (one Megatron ``MoELayer``
forward+backward with the ``efa`` dispatcher on each transport vs Megatron's ``alltoall``).

Usage::

    efa-ep-bench                        # conf/bench/default.yaml (CPU-feasible sizes)
    efa-ep-bench --quick                # CI smoke run (< 60 s)
    efa-ep-bench --config-name gpu      # real shapes, bf16, ranks as processes on one GPU
    efa-ep-bench --config-name gpu_nccl # real shapes, one rank per GPU, NCCL group, nccl arm
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

from efa_ep.testing.routes import bench_route, derived_seed

from . import bench_stats

SCHEMA = "efa_ep.bench/2"
TIMING_MODES = ("single", "steady")
_BOUNDARY = {
    "single": ("barrier-aligned single shot: [all ranks barrier, device sync] t0 -> {op} -> "
               "device sync -> t1 (host perf_counter); inputs and route built before t0"),
    "steady": ("steady state: [all ranks barrier, device sync] start -> steady_iters x ({op}) "
               "back to back -> end; time per iteration = (end - start) / steady_iters; CUDA "
               "events on the current stream (cuda), host perf_counter after a device sync (cpu); "
               "inputs and route built before start"),
}
_BOUNDARY_OP = {"transport": "dispatch -> combine(recv_x)", "layer": "MoELayer forward + backward"}


def timing_boundary(timing: str, view: str = "transport") -> str:
    """The timing boundary of ``timing`` (single | steady) for ``view``, in words."""
    return _BOUNDARY[timing].replace("{op}", _BOUNDARY_OP[view])


# Fields every raw record has (tests check the schema against this list).
RECORD_FIELDS = (
    "schema", "run_id", "start", "order_index", "view", "arm", "transport", "options",
    "num_channels", "profile", "shape", "route", "route_skew", "route_stats", "dtype",
    "tokens_per_rank", "hidden", "num_experts", "topk", "ep_size", "ranks_per_gpu",
    "ranks_per_node", "device", "collective_backend", "scaled", "scale_note", "warmup", "iters",
    "timing", "steady_iters", "clock", "timing_boundary", "check", "void", "void_reason",
    "slowest_us", "start_median_us", "per_rank_median_us", "dispatch_rows", "dispatch_bytes",
    "collective_bytes", "net_counts", "sm_budget", "transport_info", "provenance",
)
_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


# ----------------------------------------------------------------------------------------------
# Arms and cells
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Arm:
    """A thing that moves tokens: a transport with options, an external library, a raw
    collective, or (layer view) a Megatron dispatcher. ``name`` is unique: ``torch``,
    ``proxy:k4``, ``nccl``, ``efa:gda``, ``alltoall``. ``collective`` is the process-group
    backend a raw ``all_to_all_single`` arm requires (``nccl``; ``gloo`` for CPU tests)."""

    name: str
    view: str                    # transport | layer
    transport: Optional[str]     # efa-ep transport name (None: raw collective / alltoall / external)
    options: tuple = ()
    external: Optional[str] = None
    collective: Optional[str] = None
    mode: str = "regular"        # gda: regular | fixed (dispatch_fixed) | graph (fixed, CUDA graph)

    @property
    def num_channels(self) -> Optional[int]:
        return dict(self.options).get("num_channels")


# External EP libraries: benchmarked only when importable (and an adapter exists).
EXTERNAL = {"deep_ep": "deep_ep", "uccl_ep": "uccl.ep", "nccl_ep": "nccl.ep"}
# arms.nccl_arm values: auto = run the nccl arm when backend=nccl, else list it as not run;
# require = refuse a run whose backend is not nccl; gloo = the same raw exchange on a gloo group
# (CPU tests), named a2a:gloo so that it is never mistaken for NCCL; off = no raw arm.
NCCL_ARM_MODES = ("auto", "require", "gloo", "off")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def nccl_arm_refusal(backend: str) -> str:
    """Why the nccl arm cannot run on a ``backend`` group, and what to set instead."""
    return (f"the nccl arm times NCCL's all_to_all_single and needs an NCCL process group; this "
            f"run's group is backend={backend}. Set backend=nccl device=cuda (one rank per GPU), "
            f"or arms.nccl_arm=gloo to time the same raw exchange over gloo (arm a2a:gloo)")


def resolve_arms(cfg: Dict[str, Any], available: Sequence[str]) -> Tuple[List[Arm], Dict[str, str]]:
    """Arms to run, and ``{name: reason}`` for arms that will not run here.

    Raises:
        ValueError: the torch reference is not available; ``arms.nccl_arm`` is unknown, or asks
            for a raw arm the configured backend cannot run (``require`` without
            ``backend=nccl``, ``gloo`` without ``backend=gloo``).
    """
    arms: List[Arm] = []
    not_run: Dict[str, str] = {}
    want = cfg["arms"].get("transports") or "*"
    # "*": the flat transports; hier composes them and needs a node layout: name it explicitly
    names = ([t for t in available if t != "hier"] if want == "*"
             else [t for t in want if t in available])
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
        elif t == "hier":
            arms.extend(hier_arms(cfg, dict(base)))
        elif t == "gda":
            arms.extend(gda_arms(cfg, base))
        else:
            arms.append(Arm(t, "transport", t, base))
    raw = collective_arm(cfg)
    if isinstance(raw, Arm):
        arms.append(raw)
    elif raw:
        not_run["nccl"] = raw
    for name, module in EXTERNAL.items():
        if name not in (cfg["arms"].get("external") or []):
            continue
        not_run[name] = ("installed, but efa-ep has no adapter for it yet" if _importable(module)
                         else f"not installed (import {module} failed)")
    if cfg.get("layer", {}).get("enabled"):
        arms.append(Arm("alltoall", "layer", None))
        for t in names:
            base = tuple(sorted((per_opts.get(t) or {}).items()))
            if t == "hier":
                arms.extend(Arm(f"efa:{h.name}", "layer", "hier", h.options)
                            for h in hier_arms(cfg, dict(base)))
            else:
                arms.append(Arm(f"efa:{t}", "layer", t, base))
    if "torch" not in names:
        raise ValueError("the torch transport must be available: it is the correctness reference")
    return arms, not_run


GDA_MODES = ("regular", "fixed", "graph")


def gda_arms(cfg: Dict[str, Any], base: tuple) -> List[Arm]:
    """One gda arm per ``arms.gda_modes`` entry: ``gda`` (regular dispatch: compact receive,
    one host sync), ``gda:fixed`` (``dispatch_fixed``: window layout, no host sync) and
    ``gda:graph`` (the fixed D+C captured once with ``GdaTransport.capture``, each sample one
    ``replay()``).

    Raises:
        ValueError: an unknown mode.
    """
    arms = []
    for mode in cfg["arms"].get("gda_modes") or ["regular"]:
        if mode not in GDA_MODES:
            raise ValueError(f"arms.gda_modes: {mode!r} is not one of {', '.join(GDA_MODES)}")
        arms.append(Arm("gda" if mode == "regular" else f"gda:{mode}", "transport", "gda", base,
                        mode=mode))
    return arms


def hier_arms(cfg: Dict[str, Any], base: Dict[str, Any]) -> List[Arm]:
    """``hier:agg1`` / ``hier:agg0`` arms (``arms.hier_aggregate``), each with ``node_size``
    (the emulated ranks per node; None = from host names) and ``base`` options.

    Raises:
        ValueError: an ``arms.hier_aggregate`` value or ``node_size`` the hier schema refuses.
    """
    from efa_ep.kernels.options import ConfigError, SCHEMAS

    node_size = cfg.get("node_size")
    arms = []
    for agg in cfg["arms"].get("hier_aggregate") or [1]:
        opts = dict(base)
        try:
            opts["aggregate"] = SCHEMAS["hier"]["aggregate"].convert(agg, "arms.hier_aggregate")
            if node_size is not None:
                opts["node_size"] = SCHEMAS["hier"]["node_size"].convert(node_size, "node_size")
        except ConfigError as e:
            raise ValueError(str(e)) from None
        arms.append(Arm(f"hier:agg{opts['aggregate']}", "transport", "hier",
                        tuple(sorted(opts.items()))))
    return arms


def collective_arm(cfg: Dict[str, Any]):
    """The raw ``all_to_all_single`` arm ``arms.nccl_arm`` asks for: an :class:`Arm`, a reason
    it does not run (str), or None (``off``)."""
    mode = cfg["arms"].get("nccl_arm", "auto")
    mode = "off" if mode in (False, None) else str(mode)
    if mode not in NCCL_ARM_MODES:
        raise ValueError(f"arms.nccl_arm={mode!r}: expected one of {', '.join(NCCL_ARM_MODES)}")
    backend = str(cfg["backend"]).lower()
    if mode == "off":
        return None
    if mode == "gloo":
        if backend != "gloo":
            raise ValueError(f"arms.nccl_arm=gloo requires backend=gloo, got backend={backend} "
                             f"(on an NCCL group use arms.nccl_arm=auto or require)")
        return Arm("a2a:gloo", "transport", None, collective="gloo")
    if backend == "nccl":
        return Arm("nccl", "transport", None, collective="nccl")
    if mode == "require":
        raise ValueError(f"arms.nccl_arm=require: {nccl_arm_refusal(backend)}")
    return nccl_arm_refusal(backend)


def timing_modes(cfg: Dict[str, Any]) -> List[str]:
    """``timing`` as a list: ``single``, ``steady`` or both (each a cell of its own)."""
    t = cfg.get("timing", "single")
    modes = [t] if isinstance(t, str) else list(t or [])
    if not modes or any(m not in TIMING_MODES for m in modes):
        raise ValueError(f"timing={t!r}: expected single, steady or a list of them")
    if "steady" in modes and int(cfg.get("steady_iters", 0)) < 1:
        raise ValueError(f"timing=steady requires steady_iters >= 1, got {cfg.get('steady_iters')}")
    return modes


def validate_config(cfg: Dict[str, Any]) -> None:
    """Combinations that cannot run, refused in the parent before any rank starts."""
    backend, device = str(cfg["backend"]).lower(), str(cfg["device"])
    if backend == "nccl" and not device.startswith("cuda"):
        raise ValueError(f"backend=nccl requires device=cuda (NCCL moves GPU memory only), "
                         f"got device={device}")
    if backend == "nccl" and device.startswith("cuda:") and int(cfg["ep_size"]) > 1:
        raise ValueError(f"backend=nccl requires one rank per GPU (device=cuda puts rank r on "
                         f"cuda:r % num_gpus); device={device} puts every rank on one GPU, which "
                         f"NCCL refuses (use backend=gloo for ranks sharing a GPU)")
    timing_modes(cfg)
    ns = cfg.get("node_size")
    if ns is not None and (not isinstance(ns, int) or ns < 1 or int(cfg["ep_size"]) % ns):
        raise ValueError(f"node_size={ns!r} must be a positive integer dividing ep_size="
                         f"{cfg['ep_size']} (the emulated ranks per node)")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (arm, profile, shape, route, timing) combination: the unit of the summary."""

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

    @property
    def key(self) -> str:
        return (f"{self.arm.view}|{self.arm.name}|{self.profile}|{self.shape}|{self.route}|"
                f"{self.dtype}|{self.timing}")


def build_cells(cfg: Dict[str, Any], arms: Sequence[Arm]) -> List[Cell]:
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
                cells.append(Cell(arm, "layer", lay["name"], lay["route"], int(lay["tokens_per_rank"]),
                                  int(lay["hidden"]), int(lay["num_experts"]), int(lay["topk"]),
                                  lay["dtype"], timing))
    return cells


def rotate(items: Sequence[Any], start: int) -> List[Any]:
    """Cell order of start ``start``: rotated by ``start`` positions, so over starts every cell
    runs early and late (warm caches, thermal state, neighbours' load)."""
    if not items:
        return []
    k = start % len(items)
    return list(items[k:]) + list(items[:k])


# ----------------------------------------------------------------------------------------------
# Routes (drawn by efa_ep.testing.routes.bench_route)
# ----------------------------------------------------------------------------------------------
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


def collective_device(group=None):
    """Device of the tensors a collective on ``group`` takes (CPU for gloo, the current CUDA
    device for NCCL). The one rule for every control tensor of the benchmark."""
    from efa_ep.kernels.base import collective_device as base_collective_device

    return base_collective_device(group)


def resolve_device(device: str, rank: int) -> str:
    """``cuda`` -> ``cuda:<rank % num_gpus>`` (one rank per GPU); anything else unchanged."""
    if device != "cuda":
        return device
    import torch

    n = torch.cuda.device_count()
    if n < 1:
        raise RuntimeError("device=cuda but torch sees no CUDA device")
    return f"cuda:{rank % n}"


# Resolved knobs recorded per transport (attributes of the transport object; None where a
# transport version does not have one).
TRANSPORT_KNOBS = {
    "torch": (),
    "gda": ("num_programs", "launch_gate", "ranks_per_device", "max_topk", "timeout_s",
            "check_every_call", "check_backward"),
    "proxy": ("num_channels", "provider", "hmem", "chunk_bytes", "timeout_s"),
    "hier": ("aggregate", "num_nodes", "node_size", "stage_names"),
}


def transport_info(name: Optional[str], t) -> Dict[str, Any]:
    """JSON-safe resolved options of transport ``t`` (see :data:`TRANSPORT_KNOBS`)."""
    out: Dict[str, Any] = {}
    for k in TRANSPORT_KNOBS.get(name or "", ()):
        v = getattr(t, k, None)
        out[k] = v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
    return out


class _RankContext:
    def __init__(self, rank, world, cfg):
        import socket

        import torch
        import torch.distributed as dist

        self.rank, self.world, self.cfg = rank, world, cfg
        dev = resolve_device(cfg["device"], rank)
        if dev.startswith("cuda"):
            torch.cuda.set_device(torch.device(dev))
        self.device = torch.device(dev)
        self.backend = str(dist.get_backend()).lower()
        self.sm_count, gpu = None, None
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self.sm_count = props.multi_processor_count
            gpu = str(getattr(props, "uuid", self.device.index))
        # Where every rank runs (host, GPU): ranks per node and per GPU are measured, not assumed.
        where = [None] * world
        dist.all_gather_object(where, (socket.gethostname(), gpu))
        self.ranks_per_node = sum(1 for h, _ in where if h == where[rank][0])
        self.ranks_per_gpu = where.count(where[rank]) if gpu is not None else None
        self.transports: Dict[Tuple, Any] = {}
        self.layers: Dict[str, Any] = {}
        self.megatron_ready = False

    def barrier(self):
        import torch.distributed as dist

        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])  # the barrier's tensor on our GPU
        else:
            dist.barrier()

    def transport(self, name, options, cell: Cell):
        import torch

        from efa_ep.dispatcher.settings import environment_options
        from efa_ep.kernels import create_transport

        dtype = getattr(torch, _DTYPES[cell.dtype])
        key = (name, options, cell.hidden, cell.num_experts, dtype)
        t = self.transports.get(key)
        if t is None:
            max_tokens = max(int(p["tokens_per_rank"]) for p in self.cfg["profiles"].values())
            # the arm's options over EFA_EP_PROXY_* & co., as the dispatcher's settings resolve
            opts = {**environment_options(name), **dict(options)}
            t = create_transport(name, None, cell.num_experts, cell.hidden, max_tokens, dtype,
                                 **opts)
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
    idx, w = bench_route(cell.route, cell.tokens_per_rank, cell.num_experts, cell.topk, rank,
                         ctx.world, seed, float(ctx.cfg["skew"]))
    g = torch.Generator().manual_seed(derived_seed(seed, "x", rank, cell.tokens_per_rank, cell.hidden))
    x = torch.randn(cell.tokens_per_rank, cell.hidden, generator=g).to(dtype)
    return x.to(ctx.device), idx.to(ctx.device), w.to(ctx.device)


def time_samples(fn, *, warmup: int, iters: int, timing: str = "single", steady_iters: int = 1,
                 device=None, barrier=None) -> List[float]:
    """This rank's seconds per dispatch + combine, one value per measured sample.

    Every sample starts after ``barrier()`` and a device sync. ``single``: host perf_counter
    around one ``fn()`` and a device sync. ``steady``: ``steady_iters`` calls of ``fn()`` back to
    back, timed with CUDA events on the current stream when ``device`` is CUDA (host
    perf_counter after a device sync otherwise); the value is elapsed / ``steady_iters``. The
    first ``warmup`` samples are run and dropped.
    """
    import torch

    if timing not in TIMING_MODES:
        raise ValueError(f"timing={timing!r}: expected one of {TIMING_MODES}")
    n = 1 if timing == "single" else int(steady_iters)
    if n < 1:
        raise ValueError(f"steady_iters must be >= 1, got {steady_iters}")
    cuda_events = timing == "steady" and device is not None and device.type == "cuda"
    times = []
    for i in range(warmup + iters):
        if barrier is not None:
            barrier()
        if device is not None:
            _sync(device)
        if cuda_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) * 1e-3 / n
        else:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            if device is not None:
                _sync(device)
            dt = (time.perf_counter() - t0) / n
        if i >= warmup:
            times.append(dt)
    return times


def clock_of(timing: str, device) -> str:
    return "cuda events" if timing == "steady" and device.type == "cuda" else "host perf_counter"


def _time_iters(ctx: _RankContext, fn, cell: Cell) -> List[float]:
    return time_samples(fn, warmup=int(ctx.cfg["warmup"]), iters=int(ctx.cfg["iters"]),
                        timing=cell.timing, steady_iters=int(ctx.cfg.get("steady_iters", 1)),
                        device=ctx.device, barrier=ctx.barrier)


def _agree(ok: bool, group=None) -> bool:
    """True only if every rank says ok (so all ranks skip a void cell together). The flag
    lives on the group's collective device (an NCCL group has no CPU backend)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _broadcast_(t, src: int = 0, group=None):
    """Broadcast ``t`` in place from ``src`` through the group's collective device."""
    import torch
    import torch.distributed as dist

    dev = collective_device(group)
    if t.device == dev and t.is_contiguous():
        dist.broadcast(t, src=src, group=group)
        return t
    buf = t.detach().to(dev).contiguous()
    dist.broadcast(buf, src=src, group=group)
    with torch.no_grad():
        t.copy_(buf.to(t.device))
    return t


def _gather_times(times: List[float]) -> List[List[float]]:
    import torch.distributed as dist

    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, times)
    return parts


def _void(rec: Dict[str, Any], reason: str) -> Dict[str, Any]:
    rec.update(void=True, void_reason=reason, slowest_us=[], start_median_us=None,
               per_rank_median_us=[])
    return rec


def _library_sm_note(backend: str) -> str:
    if backend == "nccl":
        return "NCCL, which picks its own channels/SMs (NCCL_MIN/MAX_NCHANNELS in provenance.env)"
    return f"{backend} on host threads (no GPU kernels of its own)"


def _sm_budget(ctx: _RankContext, programs: Optional[int], note: str) -> Dict[str, Any]:
    return {"device_sm_count": ctx.sm_count, "kernel_programs": programs, "note": note}


def _run_transport_cell(ctx: _RankContext, cell: Cell) -> Dict[str, Any]:
    import torch.distributed as dist

    x, idx, w = _inputs(ctx, cell, ctx.rank)
    ref = ctx.transport("torch", (), cell)
    r_recv_x, r_recv_idx, r_recv_w, r_tpe, r_handle = ref.dispatch(x, idx, w)
    r_out = ref.combine(r_recv_x, r_handle)
    t = ctx.transport(cell.arm.transport, cell.arm.options, cell)
    err = None
    if cell.arm.mode != "regular":
        return _run_fixed_cell(ctx, cell, t, (x, idx, w), (r_recv_x, r_recv_idx, r_recv_w, r_tpe,
                                                           r_out, r_handle))
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
    ok = _agree(err is None)
    info = transport_info(cell.arm.transport, t)
    rows = sum(r_handle.num_send_per_rank)
    total_rows = [None] * ctx.world
    dist.all_gather_object(total_rows, rows)
    if cell.arm.transport == "gda":
        budget = _sm_budget(ctx, info.get("num_programs"),
                            "gda store/gather grids: min(rows, num_programs) programs per kernel; "
                            "SMs touched <= min(num_programs, device_sm_count)")
    elif cell.arm.transport == "proxy":
        budget = _sm_budget(ctx, None, "proxy: rows move through libfabric, posted by native CPU "
                                       "proxy threads (num_channels in transport_info)")
    else:
        budget = _sm_budget(ctx, None, f"{cell.arm.transport}: rows move through "
                            + _library_sm_note(ctx.backend))
    rec: Dict[str, Any] = {"check": {"status": check if ok else "fail", "detail": err},
                           "dispatch_rows": sum(total_rows),
                           "dispatch_bytes": sum(total_rows) * cell.hidden * x.element_size(),
                           "collective_bytes": None,
                           "net_counts": net_counts(ctx, t, r_handle, cell.hidden * x.element_size()),
                           "sm_budget": budget, "transport_info": info}
    if not ok:
        return _void(rec, err or "a peer rank's check failed")

    def once():
        rx, _, _, _, h = t.dispatch(x, idx, w)
        t.combine(rx, h)

    return _finish(rec, _time_iters(ctx, once, cell))


def _run_fixed_cell(ctx: _RankContext, cell: Cell, t, inputs, ref) -> Dict[str, Any]:
    """A ``gda:fixed`` / ``gda:graph`` cell: ``dispatch_fixed`` + ``combine`` of the window rows
    (in a CUDA graph for ``graph``), checked against the torch reference first: the used window
    rows (``s * T_MAX + j``, ``j < num_recv[s]``) equal the reference's received rows, ids and
    weights, ``tokens_per_expert`` and the combine output are equal bit for bit."""
    import torch
    import torch.distributed as dist

    x, idx, w = inputs
    r_recv_x, r_recv_idx, r_recv_w, r_tpe, r_out, r_handle = ref
    err, graph = None, None
    try:
        t_max = t.cfg.max_tokens_per_rank
        fx, fi, fw, num_recv, ftpe, fh = t.dispatch_fixed(x, idx, w)
        n = num_recv.tolist()
        used = torch.cat([torch.arange(s * t_max, s * t_max + n[s], device=fx.device)
                          for s in range(ctx.world)])
        for name, got, want in (("recv_x", fx[used], r_recv_x), ("recv_topk_idx", fi[used], r_recv_idx),
                                ("recv_topk_weights", fw[used], r_recv_w),
                                ("tokens_per_expert", ftpe.cpu(), r_tpe)):
            err = err or _compare(name, got, want)
        if cell.arm.mode == "graph":
            graph = t.capture(lambda: t.combine(*_rows_and_handle(t.dispatch_fixed(x, idx, w))),
                              warmup=2)
            graph.replay()
            out = graph.outputs
        else:
            out = t.combine(fx, fh)
        err = err or _compare("combine_out", out, r_out)
    except Exception as e:  # a crashing arm voids its cell; peers learn it via _agree
        err = f"{type(e).__name__}: {e}"
    ok = _agree(err is None)
    info = dict(transport_info(cell.arm.transport, t), mode=cell.arm.mode)
    rows = [None] * ctx.world
    dist.all_gather_object(rows, sum(r_handle.num_send_per_rank))
    rec: Dict[str, Any] = {
        "check": {"status": "pass" if ok else "fail", "detail": err},
        "dispatch_rows": sum(rows), "dispatch_bytes": sum(rows) * cell.hidden * x.element_size(),
        "collective_bytes": None, "net_counts": None, "transport_info": info,
        "sm_budget": _sm_budget(ctx, info.get("num_programs"),
                                "gda store grids: min(rows, num_programs) programs per kernel; "
                                "waits one program each")}
    if not ok:
        return _void(rec, err or "a peer rank's check failed")
    if graph is not None:
        return _finish(rec, _time_iters(ctx, graph.replay, cell))

    def once():
        r = t.dispatch_fixed(x, idx, w)
        t.combine(r[0], r[-1])

    return _finish(rec, _time_iters(ctx, once, cell))


def _rows_and_handle(dispatched):
    """(recv_x, handle) of a ``dispatch_fixed`` result."""
    return dispatched[0], dispatched[-1]


NET_COUNT_FIELDS = ("messages", "rows", "bytes", "writes", "wire_bytes")


def emulated_node_size(ctx: "_RankContext") -> int:
    """Ranks per node of this run's layout: ``node_size`` when set (emulated nodes), else the
    ranks per host measured at start."""
    return int(ctx.cfg.get("node_size") or ctx.ranks_per_node)


def net_counts(ctx: "_RankContext", t, ref_handle, row_bytes: int) -> Dict[str, Any]:
    """Network operations and bytes of one dispatch and one combine, summed over the ranks
    (collective: every rank calls it after the arm's checked dispatch + combine).

    ``dispatch``/``combine``: the arm's own counts (``last_op_counts`` of a counting transport:
    proxy, hier; :class:`~efa_ep.kernels.base.NetOpCounts` for the units), each field summed
    over ranks, plus ``messages_max_rank`` (the busiest rank's messages); None for arms that
    do not count. ``per_rank_cross_node``: what a flat design without aggregation sends to
    ranks of other nodes in one dispatch at this layout (from the torch reference's route:
    destination ranks on other nodes with >= 1 row, rows, payload bytes), the figure hier with
    ``aggregate=0`` must equal. ``node_size``: ranks per node of the layout (emulated or
    measured). Units: messages, rows and writes are counts; bytes and wire_bytes are bytes.
    """
    import torch.distributed as dist

    g = emulated_node_size(ctx)
    me = ctx.rank // g
    cross = [int(v) for r, v in enumerate(ref_handle.num_send_per_rank) if r // g != me]
    mine = {"cross": (sum(1 for v in cross if v), sum(cross), sum(cross) * row_bytes)}
    last = getattr(t, "last_op_counts", None)
    for op in ("dispatch", "combine"):
        c = last.get(op) if isinstance(last, dict) else None
        mine[op] = None if c is None else {f: getattr(c, f) for f in NET_COUNT_FIELDS}
    parts: List[Any] = [None] * ctx.world
    dist.all_gather_object(parts, mine)
    out: Dict[str, Any] = {"node_size": g, "num_nodes": ctx.world // g}
    for op in ("dispatch", "combine"):
        if any(p[op] is None for p in parts):
            out[op] = None
            continue
        out[op] = {f: (None if any(p[op][f] is None for p in parts)
                       else sum(p[op][f] for p in parts)) for f in NET_COUNT_FIELDS}
        out[op]["messages_max_rank"] = max(p[op]["messages"] for p in parts)
    out["per_rank_cross_node"] = {f: sum(p["cross"][i] for p in parts)
                                  for i, f in enumerate(("messages", "rows", "bytes"))}
    out["note"] = ("all ranks, one op; messages = (source, destination rank) pairs with >= 1 "
                   "row over the network; bytes = rows x payload row bytes; writes/wire_bytes = "
                   "libfabric writes the proxy queued (headers, rows with routing metadata, "
                   "footers); flat proxy counts every peer (same-node peers go through "
                   "libfabric too), hier only rows that cross nodes")
    return out


def pack_rows(x_SD, topk_idx_SK, topk_weights_SK):
    """Dispatch rows as the wire carries them: ``[S, D*elem + 8K + 4K]`` uint8, each row its
    payload bytes, then K int64 local expert ids, then K float32 weights (bit patterns)."""
    import torch

    def as_bytes(t):
        return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)

    return torch.cat([as_bytes(x_SD), as_bytes(topk_idx_SK), as_bytes(topk_weights_SK)], dim=1)


def unpack_rows(rows_SB, hidden: int, topk: int, dtype):
    """Inverse of :func:`pack_rows`: ``(x [S, D] dtype, topk_idx [S, K] int64, weights [S, K] f32)``."""
    import torch

    nx = hidden * torch.empty((), dtype=dtype).element_size()
    x = rows_SB[:, :nx].contiguous().view(dtype)
    idx = rows_SB[:, nx:nx + 8 * topk].contiguous().view(torch.int64)
    w = rows_SB[:, nx + 8 * topk:].contiguous().view(torch.float32)
    return x, idx, w


def _run_collective_cell(ctx: _RankContext, cell: Cell) -> Dict[str, Any]:
    """The raw collective arm: ``all_to_all_single`` of the bytes dispatch + combine move.

    Dispatch-sized exchange: each sent row with its routing metadata (:func:`pack_rows`), with
    the torch transport's per-destination row counts; then a combine-sized exchange of the
    received payload rows back to their sources. Send buffers are built before the boundary
    (no index_select, no reduction inside: this is the floor of moving the same bytes). Checked
    before timing: the received rows, ids and weights equal the torch transport's dispatch
    outputs, and the combine-sized exchange returns exactly the rows sent.
    """
    import torch
    import torch.distributed as dist

    from efa_ep.kernels.base import compute_send_layout

    if ctx.backend != cell.arm.collective:
        raise RuntimeError(f"arm {cell.arm.name} needs a {cell.arm.collective} process group, this "
                           f"rank's group is {ctx.backend}: "
                           + (nccl_arm_refusal(ctx.backend) if cell.arm.collective == "nccl" else ""))
    x, idx, w = _inputs(ctx, cell, ctx.rank)
    ref = ctx.transport("torch", (), cell)
    r_recv_x, r_recv_idx, r_recv_w, _, r_handle = ref.dispatch(x, idx, w)
    num_send, num_recv = list(r_handle.num_send_per_rank), list(r_handle.num_recv_per_rank)
    layout = compute_send_layout(idx, cell.num_experts, ctx.world, num_rows=sum(num_send))
    send_x = x.index_select(0, layout.send_token_idx_S)
    send_w = torch.where(layout.send_topk_idx_SK >= 0, w.index_select(0, layout.send_token_idx_S),
                         torch.zeros((), dtype=torch.float32, device=w.device))
    send_rows = pack_rows(send_x, layout.send_topk_idx_SK, send_w)
    recv_rows = send_rows.new_empty((sum(num_recv), send_rows.shape[1]))
    back_x = send_x.new_empty(send_x.shape)
    combine_rows = r_recv_x.contiguous()  # identity experts: combine sends the received rows back
    err = None
    try:
        dist.all_to_all_single(recv_rows, send_rows, num_recv, num_send)
        dist.all_to_all_single(back_x, combine_rows, num_send, num_recv)
        got_x, got_idx, got_w = unpack_rows(recv_rows, cell.hidden, cell.topk, x.dtype)
        for name, got, want in (("recv_x", got_x, r_recv_x), ("recv_topk_idx", got_idx, r_recv_idx),
                                ("recv_topk_weights", got_w, r_recv_w),
                                ("combine_rows", back_x, send_x)):
            err = err or _compare(name, got, want)
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    ok = _agree(err is None)
    totals = [None] * ctx.world
    dist.all_gather_object(totals, (sum(num_send), sum(num_send) * send_rows.shape[1],
                                    sum(num_send) * send_x.shape[1] * send_x.element_size()))
    rec: Dict[str, Any] = {
        "check": {"status": "pass" if ok else "fail", "detail": err},
        "dispatch_rows": sum(t[0] for t in totals),
        "dispatch_bytes": sum(t[0] for t in totals) * cell.hidden * x.element_size(),
        "net_counts": None,
        "collective_bytes": {"dispatch": sum(t[1] for t in totals),
                             "combine": sum(t[2] for t in totals),
                             "row_bytes_dispatch": int(send_rows.shape[1]),
                             "row_bytes_combine": int(send_x.shape[1] * send_x.element_size()),
                             "note": "all ranks' bytes per D+C: dispatch rows carry payload + K "
                                     "int64 ids + K float32 weights, combine rows the payload"},
        "sm_budget": _sm_budget(ctx, None, "all_to_all_single through " + _library_sm_note(ctx.backend)),
        "transport_info": {"op": "torch.distributed.all_to_all_single", "backend": ctx.backend,
                           "exchanges": ["dispatch-sized", "combine-sized"]},
    }
    if not ok:
        return _void(rec, err or "a peer rank's check failed")

    def once():
        dist.all_to_all_single(recv_rows, send_rows, num_recv, num_send)
        dist.all_to_all_single(back_x, combine_rows, num_send, num_recv)

    return _finish(rec, _time_iters(ctx, once, cell))


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
        _broadcast_(ref.router.weight.data, src=0)  # same router on every rank
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


def _layer_transport_info(cell: Cell) -> Dict[str, Any]:
    """Options the layer arm's transport was configured with (the dispatcher resolves the rest)."""
    if cell.arm.transport is None:
        return {"dispatcher": "megatron alltoall"}
    return {"dispatcher": "efa", "transport": cell.arm.transport, "options": dict(cell.arm.options)}


def _run_layer_cell(ctx: _RankContext, cell: Cell) -> Dict[str, Any]:
    import torch

    dtype = getattr(torch, _DTYPES[cell.dtype])
    seq, batch = cell.tokens_per_rank // int(ctx.cfg["layer"]["micro_batch"]), int(ctx.cfg["layer"]["micro_batch"])
    g = torch.Generator().manual_seed(derived_seed(ctx.cfg["seed"], "layer", ctx.rank))
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
    ok = _agree(err is None)
    check = "reference" if cell.arm.name == "alltoall" and err is None else ("pass" if ok else "fail")
    rec: Dict[str, Any] = {"check": {"status": check, "detail": err}, "dispatch_rows": None,
                           "dispatch_bytes": None, "collective_bytes": None, "net_counts": None,
                           "sm_budget": _sm_budget(ctx, None, "layer view: not measured"),
                           "transport_info": _layer_transport_info(cell)}
    if not ok:
        return _void(rec, err or "a peer rank's check failed")
    xin = x.clone().requires_grad_(True)

    def once():
        out, _ = layer(xin)
        out.backward(grad)
        xin.grad = None

    return _finish(rec, _time_iters(ctx, once, cell))


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
    from .provenance import collect

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
            runner = (_run_layer_cell if cell.arm.view == "layer" else
                      _run_collective_cell if cell.arm.collective else _run_transport_cell)
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
                 ctx: _RankContext) -> Dict[str, Any]:
    return {
        "schema": SCHEMA, "run_id": run_id, "start": start, "order_index": order_index,
        "view": cell.arm.view, "arm": cell.arm.name, "transport": cell.arm.transport,
        "options": dict(cell.arm.options), "num_channels": cell.arm.num_channels,
        "profile": cell.profile, "shape": cell.shape, "route": cell.route,
        "route_skew": (f"zipf s={cfg['skew']}" if cell.route == "skewed" else
                       "none (uniform random top-k)" if cell.route == "uniform" else
                       "none (every expert equal load)"),
        "route_stats": rstats, "dtype": cell.dtype, "tokens_per_rank": cell.tokens_per_rank,
        "hidden": cell.hidden, "num_experts": cell.num_experts, "topk": cell.topk,
        "ep_size": world, "ranks_per_gpu": ctx.ranks_per_gpu if ctx.ranks_per_gpu else cfg.get("ranks_per_gpu"),
        "ranks_per_node": ctx.ranks_per_node, "device": cfg["device"],
        "collective_backend": ctx.backend,
        "scaled": bool(cfg.get("scaled")), "scale_note": cfg.get("scale_note"),
        "warmup": int(cfg["warmup"]), "iters": int(cfg["iters"]), "timing": cell.timing,
        "steady_iters": int(cfg.get("steady_iters", 1)) if cell.timing == "steady" else 1,
        "clock": clock_of(cell.timing, ctx.device),
        "timing_boundary": timing_boundary(cell.timing, cell.arm.view),
    }


# ----------------------------------------------------------------------------------------------
# Parent: starts, summary, outputs
# ----------------------------------------------------------------------------------------------
def summarize_records(records: List[Dict[str, Any]], cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One summary row per cell: n (non-void starts), n_void, stats of the per-start medians,
    tokens/s, the ratio to the reference arm (``torch`` / ``alltoall``) of the same cell and,
    where a raw collective arm ran, the ratio to it (``vs_collective``)."""
    def cell_of(r):
        return (r["view"], r["profile"], r["shape"], r["route"], r["dtype"], r.get("timing", "single"))

    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(cell_of(r) + (r["arm"],), []).append(r)
    rows = []
    for key, recs in groups.items():
        view, profile, shape, route, dtype, timing, arm = key
        good = [r["start_median_us"] for r in recs if not r["void"]]
        st = bench_stats.summarize(good, alpha=float(cfg["alpha"]), min_n_for_ci=int(cfg["min_n_for_ci"]),
                                   seed=int(cfg["seed"]))
        r0 = recs[0]
        tok_s = (r0["ep_size"] * r0["tokens_per_rank"] / (st["median"] * 1e-6)) if st["median"] else None
        rows.append({"view": view, "profile": profile, "shape": shape, "route": route, "dtype": dtype,
                     "timing": timing, "arm": arm, "num_channels": r0["num_channels"],
                     "tokens_per_rank": r0["tokens_per_rank"],
                     "hidden": r0["hidden"], "num_experts": r0["num_experts"], "topk": r0["topk"],
                     "ep_size": r0["ep_size"], "n_void": sum(1 for r in recs if r["void"]),
                     "void_reasons": sorted({(r["void_reason"] or "")[:200] for r in recs if r["void"]}),
                     "latency_us": st, "tokens_per_s": tok_s, "route_stats": r0["route_stats"],
                     "collective": r0["arm"] in COLLECTIVE_ARM_NAMES,
                     # deterministic per cell (same route every start): the first record's
                     "net_counts": next((r.get("net_counts") for r in recs
                                         if not r["void"] and r.get("net_counts")), None)})
    ref_of = {"transport": "torch", "layer": "alltoall"}
    by_key = {(r["view"], r["profile"], r["shape"], r["route"], r["dtype"], r["timing"], r["arm"]): r
              for r in rows}
    for r in rows:
        cell = (r["view"], r["profile"], r["shape"], r["route"], r["dtype"], r["timing"])
        ref = by_key.get(cell + (ref_of[r["view"]],))
        r["vs_reference"] = bench_stats.ratio(r["latency_us"]["median"],
                                              ref["latency_us"]["median"] if ref else None)
        coll = next((by_key[cell + (a,)] for a in COLLECTIVE_ARM_NAMES if cell + (a,) in by_key), None)
        r["vs_collective"] = bench_stats.ratio(r["latency_us"]["median"],
                                               coll["latency_us"]["median"] if coll else None)
        r["collective_arm"] = coll["arm"] if coll else None
    rows.sort(key=lambda r: (r["view"] != "transport", r["timing"], r["profile"], r["shape"],
                             r["route"], r["arm"]))
    return rows


# Names of the raw collective arms (``vs_collective`` is the ratio to whichever ran).
COLLECTIVE_ARM_NAMES = ("nccl", "a2a:gloo")


def markdown_table(rows: List[Dict[str, Any]], cfg: Dict[str, Any], meta: Dict[str, Any]) -> str:
    modes = timing_modes(cfg)
    lines = [f"Slowest-rank latency in us: median of per-start medians, with a bootstrap interval "
             f"of the median where n allows ({int(100 * (1 - float(cfg['alpha'])))}%), else min/max. "
             f"EP={meta['ep_size']}, dtype {cfg['dtype']}, device {cfg['device']}, backend "
             f"{cfg['backend']}, starts {cfg['starts']} x {cfg['iters']} samples "
             f"(+{cfg['warmup']} warm-up)."]
    for m in modes:
        extra = f" (steady_iters={cfg.get('steady_iters')})" if m == "steady" else ""
        lines.append(f"Timing `{m}`{extra}: {timing_boundary(m)}.")
    if cfg.get("scaled"):
        lines.append(f"**Scaled shapes:** {cfg.get('scale_note')}")
    coll = sorted({r["collective_arm"] for r in rows if r.get("collective_arm")})
    for view, ref in (("transport", "torch"), ("layer", "alltoall")):
        vr = [r for r in rows if r["view"] == view]
        if not vr:
            continue
        title = ("Dispatch + combine" if view == "transport"
                 else "MoE layer forward + backward (Megatron MoELayer)")
        vs_coll = view == "transport" and coll
        head = (f"| timing | profile | shape (H, E, top-k, tok/rank) | route | arm | latency us | "
                f"tokens/s (aggregate) | vs {ref} |" + (f" vs {'/'.join(coll)} |" if vs_coll else "")
                + " void |")
        lines += ["", f"### {title}", "", head, "|" + "---|" * (head.count("|") - 1)]
        for r in vr:
            shape = f"{r['shape']} ({r['hidden']}, {r['num_experts']}, {r['topk']}, {r['tokens_per_rank']})"
            tps = f"{r['tokens_per_s']:.3g}" if r["tokens_per_s"] else "-"
            vs = f"{r['vs_reference']:.3f}" if r["vs_reference"] else "-"
            vc = (f" {r['vs_collective']:.3f} |" if r.get("vs_collective") else " - |") if vs_coll else ""
            lines.append(f"| {r['timing']} | {r['profile']} | {shape} | {r['route']} | {r['arm']} | "
                         f"{bench_stats.format_stats(r['latency_us'])} | {tps} | {vs} |{vc} {r['n_void']} |")
    lines += net_counts_table(rows)
    if meta.get("not_run"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in meta["not_run"].items())]
    return "\n".join(lines) + "\n"


def _n(v) -> str:
    return "-" if v is None else (f"{v / 1e3:.1f}k" if v >= 1e4 else str(v))


def net_counts_table(rows: List[Dict[str, Any]]) -> List[str]:
    """Markdown lines: network operations and bytes per dispatch and combine of every counting
    arm (all ranks, one op), next to the cross-node figure of a flat design at the same layout;
    empty when no arm counted."""
    counted = [r for r in rows if r["view"] == "transport" and (r.get("net_counts") or {}).get("dispatch")]
    if not counted:
        return []
    lines = ["", "### Network operations per op (all ranks, one dispatch / one combine)", "",
             "messages = (source, destination rank) pairs with >= 1 row on the network; "
             "writes = libfabric writes queued (headers and footers included); bytes = row "
             "payload, wire bytes = everything written. Flat proxy: every peer goes through "
             "libfabric; hier: only rows that cross nodes. `flat x-node` = destination ranks on "
             "other nodes with >= 1 row, rows (what no aggregation sends across nodes).", "",
             "| timing | profile | shape | route | arm | nodes x G | D msgs | D rows | D bytes | "
             "D writes | D wire bytes | C msgs | C writes | C wire bytes | flat x-node msgs / rows |",
             "|" + "---|" * 15]
    for r in counted:
        nc = r["net_counts"]
        d, c, x = nc["dispatch"], nc.get("combine") or {}, nc["per_rank_cross_node"]
        lines.append(f"| {r['timing']} | {r['profile']} | {r['shape']} | {r['route']} | {r['arm']} | "
                     f"{nc['num_nodes']} x {nc['node_size']} | {_n(d['messages'])} | {_n(d['rows'])} | "
                     f"{_n(d['bytes'])} | {_n(d['writes'])} | {_n(d['wire_bytes'])} | "
                     f"{_n(c.get('messages'))} | {_n(c.get('writes'))} | {_n(c.get('wire_bytes'))} | "
                     f"{_n(x['messages'])} / {_n(x['rows'])} |")
    return lines


def box_plots(records: List[Dict[str, Any]], out_dir: str) -> List[str]:
    """One PNG per profile: per-start medians of every arm, grouped by shape, route, timing."""
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
        groups = sorted({(r["shape"], r["route"], r.get("timing", "single")) for r in recs})
        arms = sorted({r["arm"] for r in recs}, key=lambda a: (a not in ("torch", "alltoall"), a))
        if not groups:
            continue
        fig, axes = plt.subplots(1, len(groups), figsize=(max(5, 3.2 * len(groups)), 4.2), squeeze=False)
        for ax, (shape, route, timing) in zip(axes[0], groups):
            data, labels = [], []
            for a in arms:
                vals = [r["start_median_us"] for r in recs if r["shape"] == shape and r["route"] == route
                        and r.get("timing", "single") == timing and r["arm"] == a]
                if vals:
                    data.append(vals)
                    labels.append(f"{a}\nn={len(vals)}")
            ax.boxplot(data, showfliers=True)
            ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7, rotation=30)
            ax.set_title(f"{shape} / {route} / {timing}", fontsize=9)
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

    validate_config(cfg)
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
               "failed_starts": failed_starts, "timing_boundary": {m: timing_boundary(m) for m in timing_modes(cfg)},
               "provenance": records[0]["provenance"] if records else None, "cells": rows}
    with open(os.path.join(out_dir, "bench_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    table = markdown_table(rows, cfg, meta)
    with open(os.path.join(out_dir, "bench_table.md"), "w") as f:
        f.write(table)
    summary["plots"] = box_plots(records, out_dir) if cfg.get("plots", True) else []
    summary["table"] = table
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .config import config_names

    parser = argparse.ArgumentParser(
        prog="efa-ep-bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides: key=value changes a config key (starts=30, \"arms.transports=[torch,proxy]\", "
               "timing=steady); +key=value adds one.\n"
               f"configs: {', '.join(config_names('bench'))} (--quick: a CI smoke run, about a "
               "minute on 2 cores; the default runs >= 20 starts and takes tens of minutes).\n"
               "writes: out_dir (default ./bench_out; --quick: ./bench_quick): bench_records.jsonl, "
               "bench_summary.json, bench_table.md, bench_<profile>.png.\nexit codes: 0 ok, 1 a failed start or a void "
               "cell, 2 bad settings.")
    parser.add_argument("--config-name", default=None, help="conf/bench/<name>.yaml (default: default)")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: conf/bench/quick.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    from efa_ep.kernels.options import ConfigError
    from .config import compose

    name = args.config_name or ("quick" if args.quick else "default")
    try:
        cfg = compose("bench", name, args.overrides)
    except ConfigError as e:
        print(f"efa-ep-bench: error: {e}", file=sys.stderr)
        if e.hint:
            print(f"  hint: {e.hint}", file=sys.stderr)
        return 2
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
