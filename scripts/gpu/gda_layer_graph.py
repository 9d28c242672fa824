#!/usr/bin/env python3
"""A Megatron MoE layer's forward + backward in drop-and-pad mode over ``gda``: eager against
one CUDA-graph replay (``GdaTransport.capture``), ranks as processes on one GPU (MPS on).

Each start checks graph == eager bit for bit first (the GPU test's worker,
:func:`efa_ep.testing.moe_layer.capacity_graph_worker`), then times ``--iters`` back-to-back
eager fwd+bwd and replays with CUDA events (per rank; the slowest rank is reported). Layer:
hidden 256, 16 experts, top-2, 64 x 4 tokens per rank, capacity factor 1.0.

    python3 scripts/gpu/gda_layer_graph.py [--worlds 2,4] [--dtype bf16] [--starts 3] [--iters 50]

Writes ``$OUT/gda_layer_graph.json`` (or ``outputs/``).
"""
import argparse
import datetime
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402


def main():
    from efa_ep.distributed import run_ranks
    from efa_ep.testing.moe_layer import capacity_graph_worker

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    cells = []
    for world in [int(w) for w in a.worlds.split(",")]:
        starts = []
        for _ in range(a.starts):
            res = run_ranks(capacity_graph_worker, world, (a.dtype, 1, a.iters), timeout_s=300,
                            env=env)
            starts.append(dict(eager_us=max(r["timing"]["eager_us"] for r in res),
                               graph_us=max(r["timing"]["graph_us"] for r in res),
                               num_ops=res[0]["timing"]["num_ops"]))
        eager = [s["eager_us"] for s in starts]
        graph = [s["graph_us"] for s in starts]
        cells.append(dict(world=world, dtype=a.dtype, starts=starts,
                          eager_us_median=statistics.median(eager),
                          graph_us_median=statistics.median(graph),
                          eager_range=[min(eager), max(eager)], graph_range=[min(graph), max(graph)]))
        c = cells[-1]
        print(f"EP {world} {a.dtype}: eager fwd+bwd {c['eager_us_median']:.0f} us "
              f"({c['eager_range'][0]:.0f}-{c['eager_range'][1]:.0f}), graph replay "
              f"{c['graph_us_median']:.0f} us ({c['graph_range'][0]:.0f}-{c['graph_range'][1]:.0f}), "
              f"{starts[0]['num_ops']} gda ops per replay; n = {a.starts} starts x {a.iters}")
    out = os.environ.get("OUT", os.path.join(REPO, "outputs"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gda_layer_graph.json"), "w") as f:
        json.dump(dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       device=torch.cuda.get_device_name(0), torch=torch.__version__,
                       mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), cells=cells), f, indent=1)


if __name__ == "__main__":
    main()
