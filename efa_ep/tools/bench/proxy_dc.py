"""The proxy benchmark's dispatch+combine cell (part 3 of :mod:`efa_ep.tools.bench.proxy`): the
proxy's D+C of a DeepSeek-V3-shaped batch in two rank processes, interleaved with its own wire
floor (the same rows' two wire rounds alone) and gloo, every arm checked bit for bit against
``torch`` (``one_call``: whether a case that ran before goes to one native call per op,
``EFA_EP_PROXY_ONE_CALL``; ``early_reads``: whether its reading kernel follows the chunks'
arrival, ``EFA_EP_PROXY_EARLY_READS``; ``cpp``: whether a planned dispatch or combine goes to
one C++ call, ``EFA_EP_PROXY_CPP``); and the helpers the benchmark's parts share (rank
environment, summaries, the engine-wait clock)."""
from __future__ import annotations

import resource
import statistics
import time

import torch

from efa_ep.kernels.proxy.cpp_op import enabled as cpp_enabled
from efa_ep.kernels.proxy.planned import early_reads
from efa_ep.kernels.proxy.planned import enabled as one_call_enabled

# The dispatch+combine cells' shape: DeepSeek-V3 (hidden, routed experts, top-k), bf16.
HIDDEN, EXPERTS, TOPK = 7168, 256, 8


def _rank_env(provider: str) -> dict:
    """Environment of the rank processes: loopback only, one thread, tcp alone when asked."""
    env = {"FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "1"}
    if provider == "tcp":
        env["FI_PROVIDER"] = "tcp"
    return env


def _summary(vals):
    vals = sorted(vals)
    q = lambda f: vals[min(len(vals) - 1, int(f * len(vals)))]  # noqa: E731
    return {"n": len(vals), "median": statistics.median(vals), "min": vals[0], "max": vals[-1],
            "p10": q(0.1), "p90": q(0.9)}


def _wait_clock(px):
    """Cumulative seconds this rank's calling thread spent blocked in the proxy engine's waits
    (for the peers' headers and data, and for our own writes to leave the send side). The
    transport reports it itself when it can (``wire.wait_seconds``); older trees are timed by
    wrapping the engine's blocking calls."""
    own = getattr(getattr(px, "wire", None), "wait_seconds", None)
    if callable(own):
        return own
    acc = [0.0]
    eng = px.engine
    for name in ("wait_counters", "wait_idle"):
        fn = getattr(eng, name)

        def timed(*a, _fn=fn, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t
        setattr(eng, name, timed)
    return lambda: acc[0]


def _bits(t):
    """``t`` on the host, bfloat16 as its bytes (compared bit for bit)."""
    t = t.cpu()
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


class _WireFloor:
    """The two wire rounds of one rank's dispatch+combine alone (headers, the rows' bytes,
    footers; no layout, packing, copies or checks of the rows), on a proxy transport's own wire:
    the floor under that D+C, timed interleaved with it in the same ranks (a ratio that holds on
    a shared machine). Collective: every rank calls :meth:`run` together."""

    def __init__(self, px, idx, world: int, rank: int, topk: int, hidden: int, elem: int):
        import numpy as np
        import torch.distributed as dist

        per_rank = px.cfg.num_experts // world
        self.rows_to = [int(((idx.cpu() // per_rank) == d).any(dim=1).sum()) for d in range(world)]
        got = [None] * world
        dist.all_gather_object(got, self.rows_to)
        self.n_recv = [got[r][rank] for r in range(world)]
        self.counts = np.zeros((world, per_rank), dtype=np.int64)
        for d in range(world):
            self.counts[d, 0] = self.rows_to[d] * topk  # any count the header check accepts
        self.px, self.topk, self.row_x = px, topk, hidden * elem

    def run(self) -> None:
        from efa_ep.kernels.proxy.window import OP_COMBINE, OP_DISPATCH

        wire = self.px.wire
        wire.begin(OP_DISPATCH, [self.row_x, 16 * self.topk], self.rows_to, extras=self.counts,
                   fmt=self.topk)
        wire.exchange()
        wire.finish()
        wire.begin(OP_COMBINE, [self.row_x], self.n_recv, n_recv=self.rows_to, fmt=0)
        wire.exchange()
        wire.finish()


def _a2a_rank(rank, world, provider, profiles, iters, num_channels, seed, device="cpu", hmem="off",
              torch_staging=False, chunk_bytes=None, spin_us=None, time_torch=True,
              fresh_routes=False):
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route as make_route

    torch.set_num_threads(1)
    if device == "cuda":  # one GPU per rank where the host has several (ranks share one else)
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    hidden, experts, topk = HIDDEN, EXPERTS, TOPK
    chunk = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    if spin_us is not None:
        chunk["spin_us"] = spin_us
    res = []
    for name, tokens in profiles:
        ref = create_transport("torch", None, experts, hidden, tokens, torch.bfloat16)
        px = create_transport("proxy", None, experts, hidden, tokens, torch.bfloat16,
                              provider=provider, num_channels=num_channels, hmem=hmem, **chunk)
        arms = [("proxy", px), ("torch", ref)]
        if torch_staging:  # the same transport with its CUDA device work as torch ops
            px_t = create_transport("proxy", None, experts, hidden, tokens, torch.bfloat16,
                                    provider=provider, num_channels=num_channels, hmem=hmem, **chunk)
            px_t.device_kernels = False
            arms.append(("proxy_torch_staging", px_t))
            px_l = create_transport("proxy", None, experts, hidden, tokens, torch.bfloat16,
                                    provider=provider, num_channels=num_channels, hmem=hmem, **chunk)
            px_l.device_layout = False  # the dispatch's layout on the host, its round in steps
            arms.append(("proxy_host_layout", px_l))
        # one route, or (fresh_routes) a new one for every warm-up and timed iteration, as in
        # training (a transport that binds or allocates per routing shape pays for it here)
        n_routes = 4 + iters if fresh_routes else 1
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        x = x.to(device) if device != "cpu" else x
        routes = []
        for j in range(n_routes):
            idx, w = make_route("random", tokens, experts, topk, world, seed + rank + 1000 * j)
            floor = _WireFloor(px, idx, world, rank, topk, hidden, 2)
            if device != "cpu":
                idx, w = idx.to(device), w.to(device)
            r = ref.dispatch(x, idx, w)
            want = ([a.cpu() for a in r[:4]], ref.combine(r[0], r[4]).cpu())
            routes.append((idx, w, floor, want))

        def same(p, out, want):
            """The proxy's dispatch outputs ``p`` and combine output ``out`` equal torch's."""
            return all(torch.equal(_bits(a), _bits(b)) for a, b in zip(want[0], p[:4])) and \
                torch.equal(_bits(want[1]), _bits(out))

        # correctness before timing (a failed check voids the cell); fresh routes are checked
        # again after each timed call, outside its timing
        ok = True
        for t in [t for _, t in arms if t is not ref]:  # every proxy arm
            p = t.dispatch(x, routes[0][0], routes[0][1])
            ok = ok and same(p, t.combine(p[0], p[4]), routes[0][3])
        if not time_torch:  # torch checked the results above; proxy and its floor back to back
            arms = [(a, t) for a, t in arms if t is not ref]
        arms.append(("wire", None))  # not a transport: the floor, timed like the arms
        times = {a: [] for a, _ in arms}
        cpu = {a: [] for a, _ in arms}  # this rank's main-thread CPU time (load-robust)
        proc = {a: [] for a, _ in arms}  # the rank process's CPU time, every thread (channels too)
        host = []  # proxy: wall time outside the engine's blocking waits
        waited = _wait_clock(px)
        for i in range(3):  # warm-up: first-touch of outputs, allocator, connections
            idx, w, floor, _ = routes[(1 + i) % n_routes]
            for _, t in arms:
                if t is None:
                    floor.run()
                    continue
                o = t.dispatch(x, idx, w)
                t.combine(o[0], o[4])
        for it in range(iters):
            idx, w, floor, want = routes[(4 + it) % n_routes]
            # interleave the arms, rotated per iteration (ratios, not absolutes, on a shared machine)
            for arm, t in arms[it % len(arms):] + arms[:it % len(arms)]:
                dist.barrier()
                w0 = waited()
                p0 = resource.getrusage(resource.RUSAGE_SELF)
                t0, c0 = time.perf_counter(), time.thread_time()
                if t is None:
                    floor.run()
                else:
                    o = t.dispatch(x, idx, w)
                    out = t.combine(o[0], o[4])
                if device != "cpu":
                    torch.cuda.synchronize()
                times[arm].append(time.perf_counter() - t0)
                cpu[arm].append(time.thread_time() - c0)
                p1 = resource.getrusage(resource.RUSAGE_SELF)
                proc[arm].append(p1.ru_utime + p1.ru_stime - p0.ru_utime - p0.ru_stime)
                if arm == "proxy":
                    host.append(times[arm][-1] - (waited() - w0))
                if fresh_routes and t is not None and t is not ref:
                    ok = ok and same(o, out, want)
        stats = px.stats()
        for _, t in arms:
            if t is not ref and t is not None:
                t.close()
        res.append({"profile": name, "tokens": tokens, "ok": ok, "times": times, "cpu": cpu, "proc": proc,
                    "host": host, "stats": stats})
    return res


def bench_a2a(provider: str, profiles, iters: int, num_channels: int, device: str = "cpu",
              hmem: str = "off", starts: int = 1, torch_staging: bool = False,
              chunk_bytes: int = 0, spin_us=None, time_torch: bool = True,
              fresh_routes: bool = False):
    """Each start is a fresh pair of rank processes (new transports); every figure is the
    slowest (or larger) rank per iteration, pooled over all iterations of all starts, plus
    each start's median. ``time_torch=False``: torch only checks the results (the proxy and
    its wire floor alternate with no gloo operation between them). ``fresh_routes``: every
    warm-up and timed iteration routes the tokens anew (row counts change per call, as in
    training); else one route for all."""
    from efa_ep.distributed import run_ranks

    env = _rank_env(provider)
    runs = [run_ranks(_a2a_rank, 2, (provider, profiles, iters, num_channels, 7 + s, device, hmem,
                                     torch_staging, chunk_bytes, spin_us, time_torch, fresh_routes),
                      timeout_s=1200, pg_timeout_s=600, env=env) for s in range(starts)]
    out = []
    for i, (name, tokens) in enumerate(profiles):
        rec = {"kind": "a2a", "provider": provider, "profile": name, "tokens_per_rank": tokens,
               "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "dtype": "bfloat16", "ranks": 2,
               "num_channels": num_channels, "chunk_bytes": chunk_bytes or "default",
               "spin_us": "default" if spin_us is None else spin_us,
               "route": "random, fresh per iteration" if fresh_routes else "random",
               "device": device, "hmem": hmem, "one_call": one_call_enabled(),
               "early_reads": early_reads(), "cpp": cpp_enabled(),
               "starts": starts, "iters_per_start": iters, "torch_timed": time_torch,
               "bit_identical_to_torch": all(r[i]["ok"] for per_rank in runs for r in per_rank)}
        series = {}
        for arm in runs[0][0][i]["times"]:
            series[arm] = [[max(r[i]["times"][arm][j] for r in pr) * 1e3 for j in range(iters)] for pr in runs]
            # main-thread CPU time per D+C (includes the native waits' spinning), the larger rank
            series[arm + "_cpu"] = [[max(r[i]["cpu"][arm][j] for r in pr) * 1e3 for j in range(iters)]
                                    for pr in runs]
            # CPU time of the whole rank process (main and channel threads) per D+C, summed over
            # the ranks: what the op costs a shared host, spinning included
            series[arm + "_proc_cpu"] = [[sum(r[i]["proc"][arm][j] for r in pr) * 1e3 for j in range(iters)]
                                         for pr in runs]
        series["proxy_host"] = [[max(r[i]["host"][j] for r in pr) * 1e3 for j in range(iters)] for pr in runs]
        for key, per_start in series.items():
            rec[key + "_ms"] = _summary([v for s in per_start for v in s])
            meds = [statistics.median(s) for s in per_start]
            rec[key + "_start_medians_ms"] = meds
            rec[key + "_spread_ms"] = {"median_of_starts": statistics.median(meds),
                                       "min_of_starts": min(meds), "max_of_starts": max(meds)}
        if time_torch:
            rec["proxy_over_torch"] = rec["proxy_ms"]["median"] / rec["torch_ms"]["median"]
        # the D+C against its wire floor timed interleaved in the same ranks: pooled, per start
        rec["proxy_over_wire"] = rec["proxy_ms"]["median"] / rec["wire_ms"]["median"]
        rec["proxy_over_wire_starts"] = [p / f for p, f in zip(rec["proxy_start_medians_ms"],
                                                                rec["wire_start_medians_ms"])]
        for arm in ("proxy_torch_staging", "proxy_host_layout"):
            if arm + "_ms" in rec:
                rec[f"proxy_over_{arm}"] = rec["proxy_ms"]["median"] / rec[arm + "_ms"]["median"]
        rec["proxy_stats_rank0"] = runs[-1][0][i]["stats"]
        out.append(rec)
    return out
