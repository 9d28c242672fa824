#!/usr/bin/env python3
"""A training step with and without Megatron's 1F1B EP-communication overlap
(``overlap_moe_expert_parallel_comm``), Megatron's ``alltoall`` dispatcher against ``efa``, side by
side in the same rank processes.

One step = ``forward_backward_no_pipelining`` over ``--microbatches`` micro-batches of a bf16
GPTModel (local layer spec, MoE in every layer, top-2), EP 2 as two rank processes (on one GPU
they need MPS, which the caller starts). Arms, in this order in every start: ``alltoall``,
``alltoall+1f1b``, ``efa:<transport>``, ``efa:<transport>+1f1b``. Each arm builds its model from
the same seed, runs one untimed step (compilation, first touch), then ``--steps`` timed steps;
the time of a step is the slower rank's (barrier, device idle -> the step's last kernel done).
``--starts`` fresh pairs of rank processes; the record pools every step of every start and gives
each start's median. Ratios: each arm over ``alltoall`` in the same mode, and each overlapped arm
over the same dispatcher without the overlap. Writes ``--out/bench_1f1b.json`` and a PNG.

    python3 scripts/bench_1f1b.py --out runs/bench_1f1b [--starts 6] [--steps 5] [--transport gda]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from efa_ep.distributed import run_ranks  # noqa: E402
from efa_ep.testing.overlap_1f1b import schedule_worker  # noqa: E402
from efa_ep.tools.bench_stats import format_stats, slowest_rank, summarize  # noqa: E402
from efa_ep.tools.provenance import cpu_model  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (JSON + PNG)")
    ap.add_argument("--starts", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per arm and start")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--transport", default="gda", help="efa's transport (gda, torch, ...)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (micro-batch of 2)")
    ap.add_argument("--layers", type=int, default=3)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                 ffn_hidden_size=4 * args.hidden, moe_ffn_hidden_size=args.hidden,
                 num_moe_experts=args.experts, moe_router_topk=2, vocab_size=1024,
                 seq_length=args.seq, dtype="bf16")
    t = args.transport
    arms = [dict(name="alltoall", dispatcher="alltoall", overlap=False),
            dict(name="alltoall+1f1b", dispatcher="alltoall", overlap=True),
            dict(name=f"efa:{t}", dispatcher="efa", overlap=False, transport=t),
            dict(name=f"efa:{t}+1f1b", dispatcher="efa", overlap=True, transport=t)]
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1",
           "EFA_EP_MAX_TOKENS_PER_RANK": str(4 * args.seq), "OMP_NUM_THREADS": "1"}
    per_start = {a["name"]: [] for a in arms}
    checks = {a["name"]: [] for a in arms}
    for s in range(args.starts):
        res = run_ranks(schedule_worker, 2, (arms, args.microbatches, model, args.steps, False),
                        timeout_s=900, pg_timeout_s=600, env=env)
        for i, a in enumerate(arms):
            steps = [t * 1e3 for t in slowest_rank([r[i]["step_s"] for r in res])]
            per_start[a["name"]].append(steps)
            checks[a["name"]].append(dict(dispatchers=res[0][i]["dispatchers"],
                                          transports=res[0][i]["transports"],
                                          schedule_plans=res[0][i]["schedule_plans"],
                                          pairs=res[0][i]["pairs"],
                                          losses_rank0=res[0][i]["losses"]))
        print(f"[bench_1f1b] start {s + 1}/{args.starts}: " + ", ".join(
            f"{n} {statistics.median(v[-1]):.2f} ms" for n, v in per_start.items()), flush=True)
    records = []
    med = {}
    for a in arms:
        n = a["name"]
        pooled = [v for st in per_start[n] for v in st]
        med[n] = statistics.median(pooled)
        records.append({"arm": n, "dispatcher": a["dispatcher"], "overlap": a["overlap"],
                        "transport": a.get("transport") or "-", "step_ms": summarize(pooled),
                        "start_medians_ms": [statistics.median(st) for st in per_start[n]],
                        "checks": checks[n]})
    for r in records:
        same_mode_ref = "alltoall+1f1b" if r["overlap"] else "alltoall"
        r["vs_alltoall_same_mode"] = med[r["arm"]] / med[same_mode_ref]
        if r["overlap"]:
            r["vs_no_overlap"] = med[r["arm"]] / med[r["arm"].replace("+1f1b", "")]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
            "host": platform.node(), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "ranks": 2, "model": model,
            "microbatches": args.microbatches, "micro_batch_size": 2, "starts": args.starts,
            "steps_per_start": args.steps}
    with open(os.path.join(args.out, "bench_1f1b.json"), "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    for r in records:
        extra = f", vs no overlap {r['vs_no_overlap']:.2f}" if "vs_no_overlap" in r else ""
        print(f"[bench_1f1b] {r['arm']}: step {format_stats(r['step_ms'], unit=' ms')}, start medians "
              f"{min(r['start_medians_ms']):.2f}-{max(r['start_medians_ms']):.2f}, vs alltoall "
              f"(same mode) {r['vs_alltoall_same_mode']:.2f}{extra}", flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.boxplot([[v for st in per_start[a["name"]] for v in st] for a in arms])
        ax.set_xticks(range(1, len(arms) + 1))
        ax.set_xticklabels([a["name"] for a in arms], fontsize=8)
        ax.set_ylabel("training step ms (slower rank)")
        ax.set_title(f"1F1B EP overlap, EP 2, {args.microbatches} micro-batches, "
                     f"{args.starts} starts x {args.steps} steps", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bench_1f1b.png"), dpi=110)
    except Exception as e:  # the JSON is the result
        print(f"plot failed: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
