"""One device call: the gda GPU tests, then dispatch/combine latency and bandwidth.

Run after the command has started the MPS daemon (several ranks share one GPU):

    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d
    PYTHONUNBUFFERED=1 python scripts/gpu/gda_gpu_check.py [--skip-tests] [--worlds 2,4,8]
    echo quit | nvidia-cuda-mps-control

Benchmark: H 7168, bf16, top-8 of 256 experts, contract routes of :mod:`efa_ep.testing.routes`
(``random`` and ``hot_experts``), decode (128 tokens/rank) and prefill (4096 tokens/rank), EP 2/4/8
as processes on one GPU. Each cell is checked before it is timed (dispatch then combine of the
received rows must give ``x * number of destination ranks`` bit for bit; in the eager modes the
last timed call, a shape seen before, must give the first call's outputs bit for bit). Timing:
CUDA events on every rank around each dispatch (which includes its one host sync) and each
combine, back to back, after warm-up; per-rank median; the reported figure is the slowest rank's
median. Bytes: rows sent summed over all ranks x row bytes; "HBM frac" = 2 x bytes (each byte read
once and written once) / time / 4.26 TB/s (the H200's measured device copy rate): all ranks
share one GPU's HBM here, so this is an HBM-bound stand-in for NVLink, not an NVLink figure.
Launch floor: the same number of empty Triton launches plus one device-to-host copy, timed the
same way on every rank.
Host columns (eager modes): per op, the wall time of the Python call minus the time the transport
reports blocked on the device or on peers (``GdaTransport.blocked_s``: the count read, the
launch gate), median per rank, slowest rank: dispatch (hD), combine (hC), and in the regular mode
cached dispatch (hCD) and weight combine (hWC) with the dispatch's handle.
``--starts N`` repeats every EP size with fresh rank processes (one record per start);
``--options k=v,...`` passes gda options (``fast_launch=0``: Triton's own launch path).

Writes ``$OUT/gda_gpu_check.json`` (and pytest's log) and prints a short table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

COPY_CEILING_BPS = 4.26e12
HIDDEN, EXPERTS, TOPK, T_MAX = 7168, 256, 8, 4096
PROFILES = {"decode": 128, "prefill": 4096}
ITERS = {"decode": 300, "prefill": 60}
WARMUP = 15


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def _empty_kernel():
    import triton

    @triton.jit
    def _empty(p):
        pass

    return _empty


def _first_last(r):
    return r[0], r[-1]


def _time_graph(graph, n, dist):
    """One CUDA-graph replay of fixed-mode D+C per iteration: CUDA events around each replay
    (host waits for the GPU between iterations: latency), host time of the replay call alone,
    and steady state (n replays back to back, one event pair: the GPU-bound time)."""
    for _ in range(WARMUP):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    lat, host = [], []
    for _ in range(n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        h0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - h0) * 1e6)
        e1.record()
        e1.synchronize()
        lat.append(e0.elapsed_time(e1) * 1e3)
    dist.barrier()
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0.record()
    for _ in range(n):
        graph.replay()
    s1.record()
    torch.cuda.synchronize()
    dist.barrier()
    return dict(dispatch_us=statistics.median(lat), combine_us=0.0,
                total_us=statistics.median(lat), total_p10_us=_pct(lat, 0.1),
                total_p90_us=_pct(lat, 0.9), floor_us=0.0, iters=n,
                steady_us=s0.elapsed_time(s1) * 1e3 / n, host_us=statistics.median(host))


def _pin(rank):
    """Binds this rank's process to a physical core of its own (its first hardware thread; the
    first core is left to the system and the MPS server), so host timings do not depend on
    where the scheduler puts the ranks. Returns the CPU, or None where there are too few."""
    firsts, seen = [], set()
    for c in sorted(os.sched_getaffinity(0)):
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                core = f.read().strip()
        except OSError:
            core = str(c)
        if core not in seen:
            seen.add(core)
            firsts.append(c)
    if len(firsts) < 2:
        return None
    cpu = firsts[1 + rank % (len(firsts) - 1)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def _bench_rank(rank, world, routes, modes=("regular",), options=None, pin=False):
    if pin:
        _pin(rank)
    out = {}
    for mode in modes:
        for key, v in _bench_mode(rank, world, routes, mode, options or {}).items():
            out[key if mode == "regular" else f"{key}/{mode}"] = v
    return out


def _host_times(tr, fn):
    """(result, host us, blocked us) of one call: wall of the Python call, and the part of it
    the transport reports as blocked on the device or on peers (``blocked_s``)."""
    b0 = tr.blocked_s
    t0 = time.perf_counter()
    r = fn()
    wall = time.perf_counter() - t0
    blocked = tr.blocked_s - b0
    return r, (wall - blocked) * 1e6, blocked * 1e6


def _bench_mode(rank, world, routes, mode, options):
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    _empty = _empty_kernel()
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    tr = create_transport("gda", None, EXPERTS, HIDDEN, T_MAX, torch.bfloat16,
                          **{"timeout_s": 60, **options})
    out = {}
    for route in routes:
        for prof, t in PROFILES.items():
            idx, w = contract_route(route, t, EXPERTS, TOPK, world, seed=1234 + rank)
            idx, w = idx.to(dev), w.to(dev)
            g = torch.Generator(device=dev).manual_seed(99 + rank)
            x = torch.randn(t, HIDDEN, device=dev, generator=g).to(torch.bfloat16)
            # check: combine(dispatch(x)) == x * (destination ranks), exact in float32
            disp_fn = tr.dispatch if mode == "regular" else tr.dispatch_fixed
            if mode == "graph":
                graph = tr.capture(lambda: tr.combine(*_first_last(tr.dispatch_fixed(x, idx, w))),
                                   warmup=2)
                graph.replay()
                back = graph.outputs
            else:
                recv_x, *_, h = disp_fn(x, idx, w)
                back = tr.combine(recv_x, h)
                first = (recv_x.clone(), _[2].clone())  # rows, tokens_per_expert
            dest = torch.zeros(t, world, dtype=torch.bool, device=dev)
            valid = idx >= 0
            rows = torch.arange(t, device=dev).unsqueeze(1).expand_as(idx)
            dest[rows[valid], (idx // (EXPERTS // world))[valid]] = True
            want = (x.float() * dest.sum(1, keepdim=True).float()).to(torch.bfloat16)
            ok = bool(torch.equal(back.view(torch.int16), want.view(torch.int16)))
            sent_rows = int(dest.sum())
            recv_rows = world * T_MAX if mode == "graph" else h.num_recv_tokens
            if mode == "graph":
                out[f"{route}/{prof}"] = dict(ok=ok, tokens=t, sent_rows=sent_rows,
                                              recv_rows=recv_rows, mode=mode,
                                              **_time_graph(graph, ITERS[prof], dist))
                continue
            for _ in range(WARMUP):
                r = disp_fn(x, idx, w)
                tr.combine(r[0], r[-1])
            torch.cuda.synchronize()
            dist.barrier()
            n = ITERS[prof]
            evs = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]
            host_d, host_c = [], []
            for e in evs:
                e[0].record()
                r, hd, _ = _host_times(tr, lambda: disp_fn(x, idx, w))
                e[1].record()
                _, hc, _ = _host_times(tr, lambda: tr.combine(r[0], r[-1]))
                e[2].record()
                host_d.append(hd)
                host_c.append(hc)
            torch.cuda.synchronize()
            # host time of the two backward ops (cached dispatch, weight combine) with a handle
            host_cd, host_wc = [], []
            if mode == "regular":
                r = disp_fn(x, idx, w)
                gw = torch.ones_like(r[2])
                for _ in range(min(n, 100)):
                    _, hcd, _ = _host_times(tr, lambda: tr.dispatch_cached(x, r[-1]))
                    _, hwc, _ = _host_times(tr, lambda: tr.combine_topk_weights(gw, r[-1]))
                    host_cd.append(hcd)
                    host_wc.append(hwc)
                tr.combine(r[0], r[-1])
                torch.cuda.synchronize()
            # steady state: one event pair around n back-to-back D+C (the host may run ahead)
            dist.barrier()
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record()
            for _ in range(n):
                r = disp_fn(x, idx, w)
                back_last = tr.combine(r[0], r[-1])
            s1.record()
            torch.cuda.synchronize()
            # the timed calls (planned, after the first) gave the first call's outputs bit for bit
            ok_repeat = bool(torch.equal(r[0].view(torch.int16), first[0].view(torch.int16))
                             and torch.equal(r[3], first[1])
                             and torch.equal(back_last.view(torch.int16), want.view(torch.int16)))
            steady = s0.elapsed_time(s1) * 1e3 / n
            disp = [e[0].elapsed_time(e[1]) * 1e3 for e in evs]
            comb = [e[1].elapsed_time(e[2]) * 1e3 for e in evs]
            both = [a + b for a, b in zip(disp, comb)]
            # launch floor: 1 memset + 5 launches + one D2H copy + 2 launches (gda's D+C shape)
            tiny = torch.zeros(64, dtype=torch.int64, device=dev)
            fl = []
            for i in range(n + WARMUP):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                torch.zeros(257, dtype=torch.int64, device=dev)
                for _ in range(5):
                    _empty[(1,)](tiny)
                tiny.cpu()
                for _ in range(2):
                    _empty[(1,)](tiny)
                e1.record()
                torch.cuda.synchronize()
                if i >= WARMUP:
                    fl.append(e0.elapsed_time(e1) * 1e3)
            dist.barrier()
            progs = [p for p in tr._phases._progs.values() if p is not None]
            out[f"{route}/{prof}"] = dict(
                ok=ok, ok_repeat=ok_repeat, tokens=t, sent_rows=sent_rows, recv_rows=recv_rows,
                dispatch_us=statistics.median(disp), combine_us=statistics.median(comb),
                total_us=statistics.median(both), total_p10_us=_pct(both, 0.1),
                total_p90_us=_pct(both, 0.9), floor_us=statistics.median(fl), iters=n,
                steady_us=steady, mode=mode, compact_dispatches=tr.compact_dispatches,
                host_dispatch_us=statistics.median(host_d), host_combine_us=statistics.median(host_c),
                host_cached_us=statistics.median(host_cd) if host_cd else 0.0,
                host_wcombine_us=statistics.median(host_wc) if host_wc else 0.0,
                host_us=statistics.median([a + b for a, b in zip(host_d, host_c)]),
                launch=getattr(tr, "launch_path", None),
                native_off=getattr(tr, "native_launch_off", None),
                # bound programs that went to the GPU as one CUDA graph each / all bound
                graphed=[sum(p.graphed for p in progs), len(progs)])
    tr.check_errors()
    dist.barrier()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--routes", default="random,hot_experts")
    ap.add_argument("--pytest-args", default="")
    ap.add_argument("--modes", default="regular",
                    help="regular,fixed (dispatch_fixed),graph (fixed D+C in a CUDA graph)")
    ap.add_argument("--starts", type=int, default=1,
                    help="fresh sets of rank processes per EP size (each a start)")
    ap.add_argument("--options", default="",
                    help="gda transport options, k=v,... (e.g. fast_launch=0)")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    ap.add_argument("--pin", action="store_true",
                    help="bind each rank to a physical core of its own (recorded as 'pinned')")
    args = ap.parse_args()
    options = dict(kv.split("=", 1) for kv in args.options.split(",") if kv)
    out_dir = os.environ.get("OUT", os.path.join(REPO, "outputs"))
    os.makedirs(out_dir, exist_ok=True)
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        torch=torch.__version__, mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        starts=args.starts, options=options, pinned=args.pin,
        shape=dict(hidden=HIDDEN, experts=EXPERTS, topk=TOPK, dtype="bf16", t_max=T_MAX),
        copy_ceiling_tbps=COPY_CEILING_BPS / 1e12)
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        pass
    if not args.skip_tests:
        t0 = time.time()
        cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
               "tests/kernels/test_gda_gpu.py"] + args.pytest_args.split()
        with open(os.path.join(out_dir, "pytest_gda_gpu.log"), "w") as f:
            proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        with open(os.path.join(out_dir, "pytest_gda_gpu.log")) as f:
            tail = f.read()[-4000:]
        print(tail)
        report["tests"] = dict(rc=proc.returncode, seconds=round(time.time() - t0, 1), tail=tail[-1500:])
    from efa_ep.distributed import run_ranks
    cells = []
    routes = args.routes.split(",")
    for world, start in [(int(w), s) for s in range(args.starts) for w in args.worlds.split(",")]:
        t0 = time.time()
        try:
            res = run_ranks(_bench_rank, world,
                            (routes, tuple(args.modes.split(",")), options, args.pin),
                            timeout_s=300, pg_timeout_s=250,
                            env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
        except Exception as e:  # record and go on with the next size
            cells.append(dict(world=world, error=str(e)[-3000:]))
            print(f"world {world} failed: {str(e)[-1500:]}")
            continue
        for key in res[0]:
            per = [r[key] for r in res]
            row_bytes = HIDDEN * 2
            moved = sum(p["sent_rows"] for p in per) * row_bytes
            d = max(p["dispatch_us"] for p in per)
            c = max(p["combine_us"] for p in per)
            tot = max(p["total_us"] for p in per)
            cells.append(dict(
                world=world, start=start, cell=key,
                ok=all(p["ok"] and p.get("ok_repeat", True) for p in per),
                tokens=per[0]["tokens"], bytes_moved=moved,
                dispatch_us=d, combine_us=c, total_us=tot,
                total_p10_us=max(p["total_p10_us"] for p in per),
                total_p90_us=max(p["total_p90_us"] for p in per),
                steady_us=max(p["steady_us"] for p in per),
                steady_hbm_frac=4 * moved / (max(p["steady_us"] for p in per) * 1e-6)
                / COPY_CEILING_BPS,
                floor_us=max(p["floor_us"] for p in per),
                dispatch_hbm_frac=2 * moved / (d * 1e-6) / COPY_CEILING_BPS,
                combine_hbm_frac=2 * moved / (c * 1e-6) / COPY_CEILING_BPS if c else 0.0,
                total_hbm_frac=4 * moved / (tot * 1e-6) / COPY_CEILING_BPS,
                host_us=max(p.get("host_us", 0.0) for p in per),
                **{h: max(p.get(h, 0.0) for p in per) for h in (
                    "host_dispatch_us", "host_combine_us", "host_cached_us", "host_wcombine_us")},
                launch=per[0].get("launch"), native_off=per[0].get("native_off"),
                compact_dispatches=per[0].get("compact_dispatches"),
                per_rank=per, seconds=round(time.time() - t0, 1)))
    report["cells"] = cells
    with open(os.path.join(out_dir, f"gda_gpu_check{args.tag}.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"\ngda on {report['device']} (MPS {'on' if report['mps'] else 'OFF'}), H={HIDDEN} bf16 "
          f"top-{TOPK}/{EXPERTS}; slowest-rank medians; frac = share of 4.26 TB/s (read+write)")
    if "tests" in report:
        print(f"GPU tests rc={report['tests']['rc']} ({report['tests']['seconds']}s)")
    print(f"{'W':>2} {'cell':<22} {'ok':<3} {'MB':>7} {'disp us':>8} {'comb us':>8} {'D+C us':>8} "
          f"{'p10-p90':>13} {'floor':>6} {'D frac':>6} {'C frac':>6} {'DC frac':>7} "
          f"{'steady':>7} {'st frac':>7} {'host':>6} {'hD':>5} {'hC':>5} {'hCD':>5} {'hWC':>5}")
    paths = sorted({(c.get("launch"), c.get("native_off")) for c in cells if "error" not in c},
                   key=str)
    print("launch path: " + "; ".join(f"{p} ({why})" if why else str(p) for p, why in paths))
    for c in cells:
        if "error" in c:
            print(f"{c['world']:>2} ERROR {c['error'][-200:]}")
            continue
        print(f"{c['world']:>2} {c['cell']:<22} {'y' if c['ok'] else 'N':<3} "
              f"{c['bytes_moved'] / 1e6:7.1f} {c['dispatch_us']:8.1f} {c['combine_us']:8.1f} "
              f"{c['total_us']:8.1f} {c['total_p10_us']:6.0f}-{c['total_p90_us']:<6.0f} "
              f"{c['floor_us']:6.1f} {c['dispatch_hbm_frac']:6.2f} {c['combine_hbm_frac']:6.2f} "
              f"{c['total_hbm_frac']:7.2f} {c['steady_us']:7.1f} {c['steady_hbm_frac']:7.2f} "
              f"{c['host_us']:6.1f} {c['host_dispatch_us']:5.1f} {c['host_combine_us']:5.1f} "
              f"{c['host_cached_us']:5.1f} {c['host_wcombine_us']:5.1f}")


if __name__ == "__main__":
    main()
