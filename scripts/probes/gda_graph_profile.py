#!/usr/bin/env python3
"""Where does the GPU time of a captured ``gda`` dispatch + combine go? (GPU, MPS on.)

W ranks as processes on the GPU capture one fixed-capacity D+C (DeepSeek-V3 shape: H 7168
bf16, top-8 of 256; ``--tokens`` per rank) with ``GdaTransport.capture`` and replay it
``--iters`` times under ``torch.profiler`` (CUDA activity: kernels inside graphs are traced);
every rank returns its kernels' mean and total device time per replay; rank 0 prints them.

    python3 scripts/probes/gda_graph_profile.py [--world 2] [--tokens 128] [--iters 200]

Writes ``$OUT/gda_graph_profile_W{world}_T{tokens}.json`` when ``$OUT`` is set.
"""
import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def _rank(rank, world, tokens, iters):
    from torch.profiler import ProfilerActivity, profile

    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    tr = create_transport("gda", None, 256, 7168, 4096, torch.bfloat16, timeout_s=60)
    idx, w = contract_route("random", tokens, 256, 8, world, seed=rank)
    idx, w = idx.to(dev), w.to(dev)
    x = torch.randn(tokens, 7168, device=dev).to(torch.bfloat16)

    def step():
        r = tr.dispatch_fixed(x, idx, w)
        return tr.combine(r[0], r[-1])

    graph = tr.capture(step, warmup=2)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    tr.check_errors()
    per = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.split("(")[0][:60]
            per[name][0] += 1
            per[name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    rows = sorted(((n, c / iters, t / max(1, c), t / iters) for n, (c, t) in per.items()),
                  key=lambda r: -r[3])
    return dict(rank=rank, kernels=[dict(name=n, per_replay=k, mean_us=m, us_per_replay=u)
                                    for n, k, m, u in rows],
                sum_us_per_replay=sum(r[3] for r in rows))


def main():
    from efa_ep.distributed import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    res = run_ranks(_rank, a.world, (a.tokens, a.iters), timeout_s=300, pg_timeout_s=250,
                    env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
    for r in res:
        print(f"rank {r['rank']}: kernel time per replay {r['sum_us_per_replay']:.1f} us")
    print(f"{'kernel (rank 0)':<62} {'n/replay':>8} {'mean us':>8} {'us/replay':>9}")
    for k in res[0]["kernels"]:
        print(f"{k['name']:<62} {k['per_replay']:8.1f} {k['mean_us']:8.1f} {k['us_per_replay']:9.1f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"gda_graph_profile_W{a.world}_T{a.tokens}.json"), "w") as f:
            json.dump(dict(world=a.world, tokens=a.tokens, iters=a.iters, ranks=res), f, indent=1)


if __name__ == "__main__":
    main()
