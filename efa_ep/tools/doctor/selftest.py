"""The doctor's loopback self-test: every transport usable here, run by a few ranks started as
processes on this host (:func:`efa_ep.distributed.run_ranks`, gloo on 127.0.0.1), checked bit for
bit against ``torch`` on the same input and timed at a small shape, where one dispatch +
combine is its fixed cost.

Arms (:func:`plan_arms`): ``torch`` (the reference), ``gda`` (a GPU per rank, or MPS), ``proxy``
once per usable libfabric provider (``efa``, ``tcp`` bound to ``lo``, ``shm``), and ``hier`` with
one rank per emulated node (what ``auto`` runs across hosts: the network stage over the proxy).
Nothing leaves the host: the rendezvous store and gloo listen on loopback, tcp is pinned to
``lo`` (``FI_TCP_IFACE``), efa and shm move between processes of this host.

Each arm, on every rank alike (each step ends in an agreement, so a failure on one rank is
known to all and no rank waits alone): create the transport (collective), one dispatch +
combine compared with ``torch``'s outputs, then ``warmup`` + n timed samples, n at most
``iters`` and bounded by ``arm_budget_s``; a sample starts after a barrier and ends when
combine returned (bench's :func:`~efa_ep.tools.bench.rank.time_samples`), and its time is the
slowest rank's; the warm-up samples' median sizes n. Reported: the median D+C and half of it,
the fixed cost per op (measured).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Dict, List, Optional

from .checks import Check, Host

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclasses.dataclass(frozen=True)
class Arm:
    """One transport of the self-test: ``label`` (``proxy:tcp``), transport ``name``, its
    ``options``, and ``skip`` (why it does not run here) or None."""

    label: str
    name: str
    options: tuple = ()
    skip: Optional[str] = None


def plan_arms(h: Host, ranks: int) -> List[Arm]:
    """The arms for this host, runnable ones and skipped ones (with why), in report order."""
    arms = [Arm("torch", "torch")]
    why_gda = h.transports.get("gda")
    if why_gda is not None:
        arms.append(Arm("gda", "gda", skip=why_gda.split(" (needs ")[0]))
    elif h.gpus < ranks and not h.mps:
        arms.append(Arm("gda", "gda", skip=f"{ranks} ranks would share {h.gpus} GPU(s) without MPS"))
    else:
        arms.append(Arm("gda", "gda"))
    why_proxy = h.transports.get("proxy")
    usable = [p for p in ("efa", "tcp", "shm") if h.providers.get(p) is None]
    for p in ("efa", "tcp", "shm"):
        label = f"proxy:{p}"
        if why_proxy is not None and h.providers.get(p) is None:
            arms.append(Arm(label, "proxy", skip=why_proxy.split(" (needs ")[0]))
        elif h.providers.get(p) is not None:
            why = " ".join(str(h.providers[p]).split()).split("; ")[0]
            arms.append(Arm(label, "proxy", skip=("no EFA device on this host" if p == "efa" and not h.efa_devices
                                                  else f"provider unusable: {why}")))
        else:
            arms.append(Arm(label, "proxy", (("provider", p),)))
    if why_proxy is None and usable:
        net = "efa" if "efa" in usable else usable[0]
        arms.append(Arm(f"hier:{net}", "hier", (("node_size", 1), ("provider", net))))
    else:
        arms.append(Arm("hier", "hier", skip="its network stage needs the proxy, which cannot run here"))
    return arms


def _describe(e: BaseException) -> str:
    from efa_ep.dispatcher.transports import describe

    return describe(e)


def selftest_worker(rank: int, world: int, arms: List[Arm], shape: Dict[str, Any], iters: int,
                    warmup: int, arm_budget_s: float) -> List[Dict[str, Any]]:
    """Rank side (see the module docstring): one result dict per runnable arm, in order:
    ``label``, ``status`` (ok | fail), ``detail``, ``create_s``, ``samples`` (slowest rank's
    seconds per D+C), ``dc_us`` (their median), ``op_us`` (half of it)."""
    import torch
    import torch.distributed as dist

    from efa_ep.dispatcher.transports import close_probe
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    from .. import bench_stats
    from ..bench.rank import all_ranks_ok, compare_to_reference, time_samples

    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = getattr(torch, DTYPES[shape["dtype"]])
    t_tok, hidden, experts, topk = (int(shape[k]) for k in ("tokens", "hidden", "num_experts", "topk"))
    idx, w = contract_route("random", t_tok, experts, topk, world, 1000 + rank)
    x = torch.randn(t_tok, hidden, generator=torch.Generator().manual_seed(2000 + rank)).to(dtype)
    x, idx, w = x.to(device), idx.to(device), w.to(device)
    ref = None
    out: List[Dict[str, Any]] = []
    for arm in arms:
        res: Dict[str, Any] = {"label": arm.label, "status": "fail", "detail": "", "create_s": None,
                               "samples": [], "dc_us": None, "op_us": None, "device": str(device)}
        out.append(res)
        t, err = None, None
        t0 = time.perf_counter()
        try:
            t = create_transport(arm.name, None, experts, hidden, t_tok, dtype, **dict(arm.options))
        except Exception as e:
            err = f"setup: {_describe(e)}"
        res["create_s"] = round(time.perf_counter() - t0, 3)
        if not all_ranks_ok(err is None):
            res["detail"] = err or "setup failed on a peer rank"
            close_probe(t, collective=False)
            continue
        try:
            recv_x, recv_idx, recv_w, tpe, handle = t.dispatch(x, idx, w)
            comb = t.combine(recv_x, handle)
            got = (recv_x, recv_idx, recv_w, tpe, comb)
            if arm.name == "torch":
                ref = tuple(v.clone() for v in got)
            elif ref is None:
                err = "no torch reference to compare with"
            else:
                names = ("recv_x", "recv_topk_idx", "recv_topk_weights", "tokens_per_expert", "combine_out")
                for name, g, want in zip(names, got, ref):
                    err = err or compare_to_reference(name, g, want)
        except Exception as e:
            err = f"dispatch/combine: {_describe(e)}"
        if not all_ranks_ok(err is None):
            res["detail"] = err or "the check failed on a peer rank"
            close_probe(t, collective=False)
            continue

        def once():
            rx, _, _, _, h = t.dispatch(x, idx, w)
            t.combine(rx, h)

        # The warm-up samples also size the run: n fits arm_budget_s at their slowest rank's median.
        warm = time_samples(once, warmup=0, iters=max(1, int(warmup)), device=device, barrier=dist.barrier)
        est = torch.tensor([statistics.median(warm)], dtype=torch.float64)
        dist.all_reduce(est, op=dist.ReduceOp.MAX)
        n = max(3, min(int(iters), int(arm_budget_s / max(float(est.item()), 1e-6))))
        times = time_samples(once, warmup=0, iters=n, device=device, barrier=dist.barrier)
        parts: List[Any] = [None] * world
        dist.all_gather_object(parts, times)
        samples = bench_stats.slowest_rank(parts)
        dc = statistics.median(samples) * 1e6
        res.update(status="ok", samples=[round(s * 1e6, 2) for s in samples], dc_us=round(dc, 1),
                   op_us=round(dc / 2, 1),
                   detail="reference" if arm.name == "torch" else "bit-identical to torch")
        close_probe(t, collective=True)
    return out


def run_selftest(h: Host, cfg: Dict[str, Any], log=None) -> Dict[str, Any]:
    """Runs the runnable arms in ``cfg["ranks"]`` local processes; returns ``{"arms": [...],
    "checks": [Check per arm], "wall_s": ..., "error": None or the ranks' first error line}``."""
    from efa_ep.distributed import run_ranks

    ranks = int(cfg["ranks"])
    arms = plan_arms(h, ranks)
    runnable = [a for a in arms if a.skip is None]
    shape = {k: cfg[k] for k in ("tokens", "hidden", "num_experts", "topk", "dtype")}
    t0 = time.perf_counter()
    results: Dict[str, Dict[str, Any]] = {}
    error = None
    if runnable:
        per_arm = max(0.5, float(cfg["arm_budget_s"]))
        got = run_ranks(selftest_worker, ranks, (runnable, shape, int(cfg["iters"]), int(cfg["warmup"]), per_arm),
                        timeout_s=float(cfg["timeout_s"]), pg_timeout_s=min(30.0, float(cfg["timeout_s"])),
                        env={"FI_TCP_IFACE": "lo"}, raise_on_error=False, ranks_block_sigint=True)
        ok, val = got[0]
        if ok:
            results = {r["label"]: r for r in val}
        else:
            bad = next((v for o, v in got if not o), val)
            error = str(bad).strip().splitlines()[0] if str(bad).strip() else "a rank failed"
    wall = time.perf_counter() - t0
    checks = [arm_check(a, results.get(a.label), error, shape, ranks) for a in arms]
    return {"arms": [dict(dataclasses.asdict(a), options=dict(a.options)) for a in arms],
            "results": list(results.values()), "checks": checks, "wall_s": round(wall, 2), "error": error,
            "shape": shape, "ranks": ranks}


def arm_check(arm: Arm, res: Optional[Dict[str, Any]], error: Optional[str], shape: Dict[str, Any],
              ranks: int, prefix: str = "selftest", where: Optional[str] = None) -> Check:
    """The report line of one arm (``prefix``: the line's first word; ``where``: how the ranks
    were placed, default ``N ranks on 127.0.0.1``)."""
    name = f"{prefix} {arm.label}"
    what = (f"{where or f'{ranks} ranks on 127.0.0.1'}, {shape['tokens']} tokens x {shape['hidden']} "
            f"{shape['dtype']}, top-{shape['topk']} of {shape['num_experts']}")
    if arm.skip is not None:
        return Check(name, "skip", arm.skip, data={"arm": arm.label})
    if res is None:
        return Check(name, "fail", f"did not finish: {error or 'no result'}",
                     "rerun with --json and read selftest.error; raise selftest.timeout_s on a slow host",
                     data={"arm": arm.label})
    data = dict(res)
    if res["status"] != "ok":
        return Check(name, "fail", res["detail"], _selftest_fix(arm), data=data)
    n = len(res["samples"])
    timing = (f"fixed cost {_us(res['op_us'])}/op [M] (D+C median {_us(res['dc_us'])} of {n}, slowest rank; "
              f"setup {res['create_s']:.2f} s)")
    if arm.name == "torch":
        return Check(name, "ok", f"reference, {what}; {timing}", data=data)
    return Check(name, "ok", f"bit-identical to torch; {timing}", data=data)


def _us(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.0f} us"


def _selftest_fix(arm: Arm) -> str:
    if arm.name == "gda":
        return "see the gpus, mps and symmetric memory lines; EFA_EP_TRANSPORT=torch runs meanwhile"
    if arm.name in ("proxy", "hier"):
        return ("see the libfabric, provider and native library lines; EFA_EP_FALLBACK=alltoall keeps a job "
                "running on Megatron's alltoall meanwhile")
    return "torch.distributed over gloo must work: check the loopback interface (GLOO_SOCKET_IFNAME=lo)"
