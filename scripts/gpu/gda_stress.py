#!/usr/bin/env python3
"""Stress suite of the ``gda`` transport (GPU): randomized rounds bit-identical to the contract,
and repeated Megatron layer runs bit-identical to the ``torch`` transport.

Rounds: every round draws, from a seed shared by all ranks, every rank's token count T (0..4096),
top-k K (1..8), route kind (random, hot_experts, one_rank, dropped with -1 slots) and rows, so each
rank computes its expected outputs locally (a vectorized brute-force reference on the GPU, no
communication) and checks, bit for bit: dispatch (rows, local ids, weights, tokens_per_expert,
counts), combine (float32 sum in ascending rank order), cached dispatch of token rows and of
float32 [T, K] rows, and the weight combine. Every ``--torch-every``-th round with T <= 512 is also
run through the ``torch`` transport (CPU, gloo) and compared bit for bit. Layouts (E, H, dtype)
cycle through E in {64, 256, 384} (E up to 384), H in {2048, 7168}, bf16 and fp32.

Layer runs: the Megatron MoE layer (:mod:`efa_ep.testing.moe_layer`) forward + backward
over ``gda`` against ``torch``: output, x.grad and every parameter gradient bitwise equal;
``--layer-launches`` fresh process groups x ``--layer-iters`` fresh layers and transports each.

Ranks are processes on GPU ``rank % device_count`` (several per GPU need MPS; start it first).
Writes one JSON record per world size to ``--out``.

    python3 scripts/gpu/gda_stress.py --worlds 2,4,8 --rounds 1000 --out results/gda_stress.jsonl
    python3 scripts/gpu/gda_stress.py --worlds 4,8 --rounds 0 --layer-launches 4 --layer-iters 5
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402

from efa_ep.testing.gda_stress import layer_worker, stress_worker  # noqa: E402

def main():
    from efa_ep.distributed import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--rounds", type=int, default=1000, help="randomized rounds per world size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--torch-every", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=1e9, help="per world size, then stop")
    ap.add_argument("--layer-options", default="", help="gda options of the layer runs, k=v,...")
    ap.add_argument("--layer-launches", type=int, default=0)
    ap.add_argument("--layer-iters", type=int, default=5)
    ap.add_argument("--layer-dtypes", default="fp32,bf16")
    ap.add_argument("--out", default="results/gda_stress.jsonl")
    args = ap.parse_args()
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), gpu=torch.cuda.get_device_name(0),
                gpus=torch.cuda.device_count(), torch=torch.__version__,
                mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")))
    opts = dict(kv.split("=", 1) for kv in args.layer_options.split(",") if kv)
    ok = True
    for world in [int(w) for w in args.worlds.split(",") if w]:
        rec = dict(meta, world=world)
        if args.rounds:
            t0 = time.time()
            try:
                stats = run_ranks(stress_worker, world, (args.rounds, args.seed, args.torch_every,
                                                      args.max_seconds),
                                  timeout_s=1800, pg_timeout_s=600, env=env)
                rec.update(rounds=stats[0]["rounds"], mismatches=0,
                           stopped_early=bool(stats[0].get("stopped_early")),
                           rows_received=sum(s["rows_received"] for s in stats),
                           torch_checked=stats[0]["torch_checked"],
                           zero_token_rank_rounds=sum(s["zero_token_ranks"] for s in stats),
                           stress_seconds=round(time.time() - t0, 1))
            except Exception as e:  # a mismatch or an error: record it, go on with the next size
                ok = False
                rec.update(stress_error=str(e)[-2000:])
        for dtype in [d for d in args.layer_dtypes.split(",") if d and args.layer_launches]:
            passed, failures, t0 = 0, [], time.time()
            for launch in range(args.layer_launches):
                try:
                    passed += run_ranks(layer_worker, world, (args.layer_iters, dtype, opts),
                                        timeout_s=600, pg_timeout_s=300, env=env)[0]
                except Exception as e:
                    ok = False
                    failures.append(str(e)[-800:])
            rec[f"layer_{dtype}"] = dict(options=opts,passed=passed, runs=args.layer_launches * args.layer_iters,
                                         seconds=round(time.time() - t0, 1), failures=failures)
        print(json.dumps(rec), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
