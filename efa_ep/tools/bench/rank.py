"""Rank side of the benchmark: the per-rank context (device, group backend, transports), a
cell's inputs, the checks against the reference, the control collectives, the timing of
samples and the record fields every cell fills."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from efa_ep.testing.routes import bench_route, derived_seed

from .. import bench_stats
from .cells import Cell
from .schema import DTYPES, TIMING_MODES


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare_to_reference(name, got, want) -> Optional[str]:
    """None when ``got`` equals the torch reference ``want`` bit for bit (shape, dtype,
    values), else what differs, in words."""
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


class RankContext:
    """What one rank keeps over a start: its device, the group's backend, ranks per node and per
    GPU (measured with a collective at construction), the transports it created per (arm
    options, shape, dtype), and the layer view's Megatron layers per (feature, arm) with the
    initial weights they share."""

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
        self.layers: Dict[Tuple[str, str], Any] = {}
        self.layer_weights: Optional[Dict[str, Any]] = None
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

        dtype = getattr(torch, DTYPES[cell.dtype])
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


def cell_inputs(ctx: RankContext, cell: Cell, rank: int):
    """Rank ``rank``'s inputs of ``cell`` on the rank's device: ``x [T, H]`` in the cell's
    dtype, ``topk_idx [T, K]`` int64 and ``topk_weights [T, K]`` float32 (a bench route); the
    same every start."""
    import torch

    dtype = getattr(torch, DTYPES[cell.dtype])
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
    """The clock :func:`time_samples` uses for ``timing`` on ``device``, in words."""
    return "cuda events" if timing == "steady" and device.type == "cuda" else "host perf_counter"


def time_cell(ctx: RankContext, fn, cell: Cell) -> List[float]:
    """:func:`time_samples` of ``fn`` with the config's warm-up, samples and the cell's
    timing mode, each sample after the ranks' barrier."""
    return time_samples(fn, warmup=int(ctx.cfg["warmup"]), iters=int(ctx.cfg["iters"]),
                        timing=cell.timing, steady_iters=int(ctx.cfg.get("steady_iters", 1)),
                        device=ctx.device, barrier=ctx.barrier)


def all_ranks_ok(ok: bool, group=None) -> bool:
    """True only if every rank says ok (so all ranks skip a void cell together). The flag
    lives on the group's collective device (an NCCL group has no CPU backend)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def broadcast_(t, src: int = 0, group=None):
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


def void_record(rec: Dict[str, Any], reason: str) -> Dict[str, Any]:
    """``rec`` marked void (failed check or error: no times), with ``reason``."""
    rec.update(void=True, void_reason=reason, slowest_us=[], start_median_us=None,
               per_rank_median_us=[])
    return rec


def finish_record(rec, times):
    """``rec`` with this start's times (collective: gathers every rank's ``times`` [s]): the
    slowest rank per sample and its median, and each rank's median, in microseconds."""
    import statistics

    per_rank = _gather_times(times)
    slow = bench_stats.slowest_rank(per_rank)
    rec.update(void=False, void_reason=None, slowest_us=[round(s * 1e6, 3) for s in slow],
               start_median_us=round(statistics.median(slow) * 1e6, 3),
               per_rank_median_us=[round(statistics.median(t) * 1e6, 3) for t in per_rank])
    return rec


def library_sm_note(backend: str) -> str:
    """Who moves the rows of a ``backend`` collective and on what, for ``sm_budget`` notes."""
    if backend == "nccl":
        return "NCCL, which picks its own channels/SMs (NCCL_MIN/MAX_NCHANNELS in provenance.env)"
    return f"{backend} on host threads (no GPU kernels of its own)"


def sm_budget(ctx: RankContext, programs: Optional[int], note: str) -> Dict[str, Any]:
    """The record's ``sm_budget``: the device's SM count, the kernel programs (None: no
    kernels of ours) and a note."""
    return {"device_sm_count": ctx.sm_count, "kernel_programs": programs, "note": note}
