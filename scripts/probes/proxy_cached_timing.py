#!/usr/bin/env python3
"""Wall time of the proxy's ``dispatch_cached`` (combine's backward in every training step) with
CUDA inputs on a host window, EP 2 as two processes; its output is checked bit-identical to the
``torch`` transport's before it is timed.

    python3 scripts/probes/proxy_cached_timing.py [--provider shm] [--iters 20] [--starts 3]

DeepSeek-V3 shape (H 7168 bf16, top-8 of 256), decode (128 tokens/rank) and prefill (4096).
Each timed call starts after a barrier and ends with a device synchronization; a start's figure
is the slowest rank's median, printed per start with the median over starts (one JSON line per
profile). Run it with another installed efa-ep to compare versions: it uses only the transport
API.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

HIDDEN, EXPERTS, TOPK = 7168, 256, 8


def _rank(rank, world, provider, iters, seed):
    import torch
    import torch.distributed as dist
    from efa_ep.kernels import create_transport

    torch.set_num_threads(1)
    dev = torch.device("cuda", 0)
    out = {}
    for name, tokens in (("decode", 128), ("prefill", 4096)):
        ref = create_transport("torch", None, EXPERTS, HIDDEN, tokens, torch.bfloat16)
        px = create_transport("proxy", None, EXPERTS, HIDDEN, tokens, torch.bfloat16,
                              provider=provider, num_channels=4)
        g = torch.Generator().manual_seed(seed + rank)
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)])
        w = torch.rand(tokens, TOPK, generator=g)
        x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
        x2 = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
        hr = ref.dispatch(x, idx, w)[4]
        hp = px.dispatch(x.to(dev), idx.to(dev), w.to(dev))[4]
        ok = torch.equal(ref.dispatch_cached(x2, hr).view(torch.uint8),
                         px.dispatch_cached(x2.to(dev), hp).cpu().view(torch.uint8))
        xd = x2.to(dev)
        for _ in range(3):
            px.dispatch_cached(xd, hp)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            px.dispatch_cached(xd, hp)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        px.close()
        out[name] = {"ok": bool(ok), "median_ms": statistics.median(times) * 1e3}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--starts", type=int, default=3)
    a = ap.parse_args()
    from efa_ep.distributed import run_ranks

    env = {"FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "1"}
    per_start = []
    for s in range(a.starts):
        per_start.append(run_ranks(_rank, 2, (a.provider, a.iters, 11 + s), timeout_s=300,
                                   env=env))
    for name in ("decode", "prefill"):
        starts = [max(r[name]["median_ms"] for r in ranks) for ranks in per_start]
        print(json.dumps({"op": "dispatch_cached", "profile": name, "provider": a.provider,
                          "ok": all(r[name]["ok"] for ranks in per_start for r in ranks),
                          "start_ms": [round(v, 4) for v in starts],
                          "median_ms": round(statistics.median(starts), 4),
                          "iters": a.iters}))


if __name__ == "__main__":
    main()
