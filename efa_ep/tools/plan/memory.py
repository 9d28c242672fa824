"""``efa-ep-plan memory``: window memory per rank of every transport, for the shapes of a bench
config, at several EP sizes, so ``max_tokens_per_rank`` (the knob that bounds it:
``EFA_EP_MAX_TOKENS_PER_RANK`` for the Megatron dispatcher) can be chosen before a job starts.

    efa-ep-plan memory                                  # conf/bench/gpu.yaml shapes, T_MAX 4096
    efa-ep-plan memory --ep 8,16,32,64 --max-tokens-per-rank 1024 --json mem.json
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Sequence

import torch

from efa_ep.kernels.memory import window_bytes

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def memory_rows(shapes: Dict[str, dict], eps: Sequence[int], max_tokens_per_rank: int,
                dtype: str, node_size: int, pad_mode: bool = False) -> List[dict]:
    """One row per (shape, EP, transport): window bytes per rank. ``pad_mode``: drop-and-pad
    sizing (``max_topk = num_experts``, one slot per expert)."""
    rows = []
    for name, sh in shapes.items():
        for ep in eps:
            if int(sh["num_experts"]) % ep:
                continue
            for t in ("gda", "proxy", "hier"):
                if t == "gda" and ep > node_size:
                    continue  # gda reaches the GPUs of one host only
                aggs = (1, 0) if t == "hier" else (None,)
                for agg in aggs:
                    kw = dict(world=ep, hidden=int(sh["hidden"]), dtype=_DTYPES[dtype],
                              max_tokens_per_rank=max_tokens_per_rank,
                              num_experts=int(sh["num_experts"]),
                              max_topk=int(sh["num_experts"]) if pad_mode else None)
                    if t == "hier":
                        kw.update(node_size=node_size, aggregate=agg)
                    rows.append(dict(shape=name, ep=ep, transport=t if agg is None else f"hier:agg{agg}",
                                     max_tokens_per_rank=max_tokens_per_rank, dtype=dtype,
                                     pad_mode=pad_mode, bytes=window_bytes(t, **kw)))
    return rows


def table(rows: List[dict]) -> str:
    arms = list(dict.fromkeys(r["transport"] for r in rows))
    out = [f"Window memory per rank, GiB (max_tokens_per_rank={rows[0]['max_tokens_per_rank']}, "
           f"{rows[0]['dtype']}{', drop-and-pad sizing' if rows[0]['pad_mode'] else ''}):", "",
           "| shape | EP | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    keys = list(dict.fromkeys((r["shape"], r["ep"]) for r in rows))
    by = {(r["shape"], r["ep"], r["transport"]): r["bytes"] for r in rows}
    for shape, ep in keys:
        cells = [f"{by[(shape, ep, a)] / 2**30:.2f}" if (shape, ep, a) in by else "-" for a in arms]
        out.append(f"| {shape} | {ep} | " + " | ".join(cells) + " |")
    out += ["", "gda: one host only (EP <= node size); hier: node size as given; proxy: the "
            "registered window only (the provider adds ~72 MB per tcp channel)."]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="efa-ep-plan memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--config-name", default="gpu", help="bench config whose shapes to size (default gpu)")
    p.add_argument("--ep", default="2,4,8,16,32,64", help="EP sizes, comma separated")
    p.add_argument("--max-tokens-per-rank", type=int, default=4096)
    p.add_argument("--node-size", type=int, default=8, help="GPUs per node (hier, gda's limit)")
    p.add_argument("--pad-mode", action="store_true", help="drop-and-pad sizing (max_topk = experts)")
    p.add_argument("--json", help="also write the rows here")
    a = p.parse_args(argv)
    from ..config import compose

    try:
        if a.max_tokens_per_rank < 1 or a.node_size < 1:
            raise ValueError("--max-tokens-per-rank and --node-size must be positive")
        eps = [int(e) for e in a.ep.split(",") if e.strip()]
        cfg = compose("bench", a.config_name)
        rows = memory_rows(cfg["shapes"], eps, a.max_tokens_per_rank, cfg["dtype"], a.node_size,
                           a.pad_mode)
        if not rows:
            raise ValueError(f"no EP size in {eps} divides the experts of {sorted(cfg['shapes'])}")
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"efa-ep-plan memory: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
