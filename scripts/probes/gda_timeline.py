#!/usr/bin/env python3
"""Where a gda D+C's GPU time goes, eager against the graph replay: kernels and idle gaps.

EP ranks as processes on one GPU (MPS on), DeepSeek-V3 shape (H 7168 bf16, top-8 of 256),
``--tokens`` per rank, random routes. Each rank runs two arms in the same process: ``eager``
(``dispatch`` + ``combine``, the regular path with ``--options``) and ``replay`` (a captured
fixed-capacity D+C). Per arm: the D+C between CUDA events (median of ``--iters``, no profiler),
then ``--iters`` more under ``torch.profiler`` (CUDA activity only) where the rank's stream is
split into kernel time per kernel name and idle gaps, each gap named by the kernels around it
(``prev -> next``), all per D+C. An idle gap in the eager arm that the replay does not have is
time the GPU waited for this rank's host or for a peer.

    python3 scripts/probes/gda_timeline.py [--world 2] [--tokens 4096] [--iters 50]
        [--options rows_in_window=1] [--out FILE.json]
"""
import argparse
import collections
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

HIDDEN, EXPERTS, TOPK, T_MAX = 7168, 256, 8, 4096


def _timeline(prof, iters):
    """Kernel time per name and idle gaps per (prev -> next), both in us per D+C."""
    try:  # kernel times relative to the trace's start: made absolute to line the ranks up
        t0 = prof.profiler.kineto_results.trace_start_ns() / 1e3
    except AttributeError:
        t0 = 0.0
    evs = sorted(((t0 + e.time_range.start, t0 + e.time_range.end, e.name.split("(")[0][:48])
                  for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda v: v[0])
    busy = collections.defaultdict(float)
    gaps = collections.defaultdict(lambda: [0, 0.0])
    end, prev = None, None
    for s, e, name in evs:
        busy[name] += e - s
        if end is not None and s - end > 1.0:
            g = gaps[f"{prev} -> {name}"]
            g[0] += 1
            g[1] += s - end
        if end is None or e > end:
            end, prev = e, name
    span = (evs[-1][1] - evs[0][0]) if evs else 0.0
    return dict(span_us=span / iters, intervals=evs,
                idle_us=sum(g[1] for g in gaps.values()) / iters,
                kernels={n: t / iters for n, t in sorted(busy.items(), key=lambda v: -v[1])},
                gaps={n: dict(per_dc=g[0] / iters, us=g[1] / iters)
                      for n, g in sorted(gaps.items(), key=lambda v: -v[1][1])})


def _global(ranks, arm):
    """The GPU as a whole: idle time when no rank runs a kernel, over the window every rank
    profiled, per D+C, each gap named ``rank:kernel -> rank:kernel``."""
    lo = max(r[arm]["intervals"][0][0] for r in ranks)
    hi = min(r[arm]["intervals"][-1][1] for r in ranks)
    evs = sorted((s, e, f"{r['rank']}:{n}") for r in ranks for s, e, n in r[arm]["intervals"]
                 if s >= lo and e <= hi)
    gaps = collections.defaultdict(float)
    end, prev = None, None
    for s, e, name in evs:
        if end is not None and s - end > 1.0:
            gaps[f"{prev} -> {name}"] += s - end
        if end is None or e > end:
            end, prev = e, name
    # D+Cs in the window, from the unprofiled D+C time (a rank's first profiled gap can be
    # long: the ranks start their profilers at different times)
    n = max(1e-9, (hi - lo) / statistics.median(r[arm]["dc_us"] for r in ranks))
    return dict(window_us=(hi - lo) / n, idle_us=sum(gaps.values()) / n,
                gaps={k: v / n for k, v in sorted(gaps.items(), key=lambda v: -v[1])})


def _rank(rank, world, tokens, options, iters):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    eager = create_transport("gda", None, EXPERTS, HIDDEN, T_MAX, torch.bfloat16,
                             **{"timeout_s": 60, **options})
    fixed = create_transport("gda", None, EXPERTS, HIDDEN, T_MAX, torch.bfloat16, timeout_s=60)
    idx, w = contract_route("random", tokens, EXPERTS, TOPK, world, seed=1234 + rank)
    idx, w = idx.to(dev), w.to(dev)
    g = torch.Generator(device=dev).manual_seed(99 + rank)
    x = torch.randn(tokens, HIDDEN, device=dev, generator=g).to(torch.bfloat16)

    def eager_dc():
        r = eager.dispatch(x, idx, w)
        return eager.combine(r[0], r[-1])

    def fixed_dc():
        r = fixed.dispatch_fixed(x, idx, w)
        return fixed.combine(r[0], r[-1])

    graph = fixed.capture(fixed_dc, warmup=2)
    want = None
    for _ in range(20):
        want = eager_dc()
        graph.replay()
    torch.cuda.synchronize()
    ok = torch.equal(want, eager_dc())
    out = dict(rank=rank, ok=bool(ok))
    for arm, run in (("eager", eager_dc), ("replay", graph.replay)):
        dist.barrier()
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(iters)]
        for a, b in evs:
            a.record()
            run()
            b.record()
        torch.cuda.synchronize()
        dc = statistics.median(a.elapsed_time(b) * 1e3 for a, b in evs)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                run()
            torch.cuda.synchronize()
        out[arm] = dict(dc_us=dc, **_timeline(prof, iters))
    eager.check_errors()
    fixed.check_errors()
    return out


def main():
    from efa_ep.distributed import run_ranks
    from efa_ep.kernels.options import parse_options_text, validate_options

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--options", default="rows_in_window=1", help="eager arm's gda options")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    options = validate_options("gda", parse_options_text(a.options, "--options"), "--options")
    res = run_ranks(_rank, a.world, (a.tokens, options, a.iters), timeout_s=400,
                    pg_timeout_s=350, env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
    glob = {arm: _global(res, arm) for arm in ("eager", "replay")}
    for arm, gv in glob.items():
        print(f"GPU as a whole, {arm}: per D+C {gv['window_us']:.1f} us, idle {gv['idle_us']:.1f}")
        for k, v in list(gv["gaps"].items())[:10]:
            print(f"    idle {k:<90} {v:8.1f}")
    for r in res:
        print(f"rank {r['rank']} ok={r['ok']}")
        for arm in ("eager", "replay"):
            v = r[arm]
            print(f"  {arm}: D+C {v['dc_us']:.1f} us (profiled span {v['span_us']:.1f}, "
                  f"idle {v['idle_us']:.1f})")
            for n, t in list(v["kernels"].items())[:12]:
                print(f"    kernel {n:<50} {t:8.1f}")
            for n, gv in list(v["gaps"].items())[:8]:
                print(f"    gap {n:<90} {gv['per_dc']:4.1f}x {gv['us']:8.1f}")
    if a.out:
        for r in res:  # the record keeps the summaries, not every kernel's interval
            for arm in ("eager", "replay"):
                r[arm].pop("intervals")
        with open(a.out, "w") as f:
            json.dump(dict(world=a.world, tokens=a.tokens, iters=a.iters, options=options,
                           device=torch.cuda.get_device_name(0), ranks=res, gpu=glob), f, indent=1)


if __name__ == "__main__":
    main()
