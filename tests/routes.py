"""Shared builders of routing inputs for the transport tests and benchmarks.

Kinds: ``random`` (uniform distinct experts), ``skewed`` (a few hot experts take most slots),
``one_rank`` (every token routed only to rank 0's experts), ``dropped`` (random with ~30% of
slots -1, some tokens with all -1).
"""
from __future__ import annotations

import torch


def make_route(kind: str, num_tokens: int, num_experts: int, topk: int, world: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if num_tokens == 0:
        return torch.empty(0, topk, dtype=torch.int64), torch.empty(0, topk, dtype=torch.float32)
    if kind == "one_rank":
        local = num_experts // world
        k = min(topk, local)
        scores = torch.rand(num_tokens, local, generator=g)
        idx = scores.topk(k, dim=1).indices
        idx = torch.cat([idx, torch.full((num_tokens, topk - k), -1)], dim=1)
    else:
        scores = torch.rand(num_tokens, num_experts, generator=g)
        if kind == "skewed":  # experts 0..3 are hot: exponential bias on their scores
            bias = torch.zeros(num_experts)
            bias[: min(4, num_experts)] = 3.0
            scores = scores + bias
        idx = scores.topk(topk, dim=1).indices
        if kind == "dropped":
            drop = torch.rand(num_tokens, topk, generator=g) < 0.3
            drop[::7] = True
            idx = torch.where(drop, torch.full_like(idx, -1), idx)
    w = torch.rand(num_tokens, topk, generator=g, dtype=torch.float32)
    w = torch.where(idx >= 0, w, torch.zeros_like(w))
    return idx.to(torch.int64), w
