"""Brute-force, single-process reference of the transport contract (for tests and benchmarks).

Given every rank's inputs, computes every rank's expected outputs with plain Python loops, the
contract's words turned into code with no shared logic with the transports.
"""
from __future__ import annotations

from typing import List, Sequence

import torch


def reference_dispatch(xs: Sequence[torch.Tensor], idxs: Sequence[torch.Tensor],
                       weights: Sequence[torch.Tensor], num_experts: int):
    """Per destination rank: (recv_x [N,H], recv_topk_idx [N,K], recv_topk_weights [N,K],
    tokens_per_expert [L], sources: list of (src_rank, token)) computed by loops."""
    world = len(xs)
    num_local = num_experts // world
    out = []
    for dst in range(world):
        rows, ids, ws, src = [], [], [], []
        counts = torch.zeros(num_local, dtype=torch.int64)
        for s in range(world):
            for t in range(xs[s].shape[0]):
                experts = idxs[s][t].tolist()
                if not any(e >= 0 and e // num_local == dst for e in experts):
                    continue
                rows.append(xs[s][t])
                local = [e - dst * num_local if e >= 0 and e // num_local == dst else -1
                         for e in experts]
                ids.append(local)
                ws.append([float(weights[s][t][k]) if local[k] >= 0 else 0.0
                           for k in range(len(local))])
                for e in local:
                    if e >= 0:
                        counts[e] += 1
                src.append((s, t))
        k = idxs[0].shape[1]
        h = xs[0].shape[1]
        out.append((
            torch.stack(rows) if rows else xs[0].new_empty((0, h)),
            torch.tensor(ids, dtype=torch.int64).view(-1, k),
            torch.tensor(ws, dtype=torch.float32).view(-1, k),
            counts,
            src,
        ))
    return out


def reference_combine(ys: Sequence[torch.Tensor], sources: Sequence[List], num_tokens: Sequence[int]):
    """Per source rank: [T, D] float32-accumulated sums in ascending destination-rank order,
    returned in ys' dtype."""
    world = len(ys)
    d = ys[0].shape[1]
    outs = [torch.zeros(num_tokens[s], d, dtype=torch.float32) for s in range(world)]
    for dst in range(world):  # ascending destination order
        for row, (s, t) in enumerate(sources[dst]):
            outs[s][t] += ys[dst][row].float()
    return [o.to(ys[0].dtype) for o in outs]
