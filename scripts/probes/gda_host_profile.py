#!/usr/bin/env python3
"""Where does the host time of a decode dispatch + combine over ``gda`` go? (GPU, MPS on.)

W ranks as processes on the GPU run ``--iters`` fixed-capacity (or regular) D+C at decode size
(DeepSeek-V3 shape: H 7168 bf16, top-8 of 256, 128 tokens per rank) under cProfile; rank 0
prints the functions with the most own time and the wall time per iteration.

    python3 scripts/probes/gda_host_profile.py [--world 2] [--mode fixed|regular] [--iters 300]
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def _rank(rank, world, mode, iters, threads=0, options=None, lines=False):
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    if threads:
        torch.set_num_threads(threads)

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    tr = create_transport("gda", None, 256, 7168, 4096, torch.bfloat16,
                          **{"timeout_s": 60, **(options or {})})
    idx, w = contract_route("random", 128, 256, 8, world, seed=rank)
    idx, w = idx.to(dev), w.to(dev)
    x = torch.randn(128, 7168, device=dev).to(torch.bfloat16)
    fn = tr.dispatch_fixed if mode == "fixed" else tr.dispatch
    for _ in range(20):
        r = fn(x, idx, w)
        tr.combine(r[0], r[-1])
    torch.cuda.synchronize()
    # unprofiled: wall per D+C and host per op (wall minus the transport's blocked time)
    hd, hc, walls = [], [], []
    for _ in range(iters):
        b0, t0 = tr.blocked_s, time.perf_counter()
        r = fn(x, idx, w)
        b1, t1 = tr.blocked_s, time.perf_counter()
        tr.combine(r[0], r[-1])
        t2 = time.perf_counter()
        hd.append((t1 - t0 - (b1 - b0)) * 1e6)
        hc.append((t2 - t1 - (tr.blocked_s - b1)) * 1e6)
        walls.append((t2 - t0) * 1e6)
    torch.cuda.synchronize()
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    plain = dict(host_dispatch_us=med(hd), host_combine_us=med(hc), wall_us=med(walls))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(iters):
        r = fn(x, idx, w)
        tr.combine(r[0], r[-1])
    prof.disable()
    host = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e6
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    if lines:  # where inside the hot functions (line_profiler's own cost included)
        from efa_ep.kernels.gda import cpp_op, gather_ahead, phases, transport
        from efa_ep.testing.line_profile import line_profile

        def step():
            r = fn(x, idx, w)
            tr.combine(r[0], r[-1])
        s.write(line_profile([transport.GdaTransport.dispatch, phases.GdaPhases.dispatch_head,
                               gather_ahead.dispatch_gather, cpp_op.dispatch,
                               transport.GdaTransport._combine, phases.GdaPhases.combine],
                              step, iters))
    tr.check_errors()
    return dict(host_us_per_iter=host, wall_us_per_iter=wall, profile=s.getvalue(), **plain)


def main():
    from efa_ep.distributed import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mode", default="fixed")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in each rank")
    ap.add_argument("--options", default="", help="gda options k=v,...")
    ap.add_argument("--lines", action="store_true",
                    help="then a line profile of the hot functions (needs line_profiler)")
    a = ap.parse_args()
    options = dict(kv.split("=", 1) for kv in a.options.split(",") if kv)
    res = run_ranks(_rank, a.world, (a.mode, a.iters, a.threads, options, a.lines), timeout_s=300,
                    env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
    for r, out in enumerate(res):
        print(f"rank {r}: unprofiled: host dispatch {out['host_dispatch_us']:.0f} us, host "
              f"combine {out['host_combine_us']:.0f} us, wall D+C {out['wall_us']:.0f} us; "
              f"profiled: host {out['host_us_per_iter']:.0f} us/iter, "
              f"wall {out['wall_us_per_iter']:.0f} us/iter")
    print(res[0]["profile"][-(30000 if a.lines else 6000):])


if __name__ == "__main__":
    main()
