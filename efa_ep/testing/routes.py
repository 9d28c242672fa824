"""Seeded top-k routes of one rank's tokens: ``(topk_idx [T, K] int64, topk_weights [T, K]
float32)``, expert ids in ``[0, E)`` with ``-1`` for an unused slot (weight 0 there).

Two families, each with its own seeding; a kind name belongs to one family only. Every draw is
fixed: tests compare bit for bit and recorded results name these routes, so a change here
changes what they mean.

Contract routes (:func:`contract_route`, kinds :data:`CONTRACT_ROUTE_KINDS`): the transport
tests and GPU scripts; one generator seeded with ``seed`` draws everything, so a caller picks
a per-rank seed.

- ``random``: K distinct experts per token, every K-subset equally likely.
- ``hot_experts``: as ``random`` with +3.0 added to the scores of experts 0..3 (of uniform
  [0, 1) scores), so those experts take most slots.
- ``one_rank``: every token routed only to rank 0's experts (min(K, E/W) of them; the other
  slots -1).
- ``dropped``: ``random`` with about 30% of the slots -1, and every 7th token all -1.
- ``one_node``: every token's experts on one node (a random node per token, ``node_size``
  ranks per node; min(K, experts per node) of them, the other slots -1).

Bench routes (:func:`bench_route`, kinds :data:`BENCH_ROUTE_KINDS`; the names of
``conf/bench`` ``routes`` and of ``route`` in bench records): seeds derived from the run's seed,
the kind, the rank and the shape (:func:`derived_seed`), and one expert order shared by all
ranks.

- ``balanced``: every expert receives the same number of slots over all ranks.
- ``skewed``: Zipf weights over a seeded expert order: a few experts are hot.
- ``uniform``: K distinct experts per token, every K-subset equally likely (the planner's
  routing assumption).
"""
from __future__ import annotations

import hashlib
from typing import Optional, Tuple

import torch

CONTRACT_ROUTE_KINDS = ("random", "hot_experts", "one_rank", "dropped", "one_node")
BENCH_ROUTE_KINDS = ("balanced", "skewed", "uniform")

# Experts 0..HOT_EXPERTS-1 are the hot ones of a ``hot_experts`` route; HOT_SCORE_BIAS is added
# to their uniform [0, 1) scores.
HOT_EXPERTS = 4
HOT_SCORE_BIAS = 3.0


# ----------------------------------------------------------------------------------------------
# Contract routes
# ----------------------------------------------------------------------------------------------
def contract_route(kind: str, num_tokens: int, num_experts: int, topk: int, world: int,
                   seed: int, node_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A contract route (see the module docstring) drawn on the CPU from a generator seeded
    with ``seed``. ``node_size``: ranks per node, for ``one_node`` only."""
    g = torch.Generator().manual_seed(seed)
    return contract_route_from(g, kind, num_tokens, num_experts, topk, world, node_size)


def contract_route_from(generator: torch.Generator, kind: str, num_tokens: int, num_experts: int,
                        topk: int, world: int,
                        node_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A contract route drawn from ``generator``, on the generator's device (a CUDA generator
    draws the route on that GPU). Draws nothing when ``num_tokens`` is 0.

    Raises:
        ValueError: an unknown kind, or ``one_node`` without ``node_size``.
    """
    g, dev = generator, generator.device
    if kind not in CONTRACT_ROUTE_KINDS:
        raise ValueError(f"route {kind!r}: expected one of {', '.join(CONTRACT_ROUTE_KINDS)}")
    if kind == "one_node" and node_size is None:
        raise ValueError("route 'one_node' needs node_size (ranks per node)")
    if num_tokens == 0:
        return (torch.empty(0, topk, dtype=torch.int64, device=dev),
                torch.empty(0, topk, dtype=torch.float32, device=dev))
    if kind == "one_node":
        return _one_node_route(g, num_tokens, num_experts, topk, world, node_size)
    if kind == "one_rank":
        local = num_experts // world
        k = min(topk, local)
        scores = torch.rand(num_tokens, local, generator=g, device=dev)
        idx = scores.topk(k, dim=1).indices
        idx = torch.cat([idx, torch.full((num_tokens, topk - k), -1, device=dev)], dim=1)
    else:
        scores = torch.rand(num_tokens, num_experts, generator=g, device=dev)
        if kind == "hot_experts":
            bias = torch.zeros(num_experts, device=dev)
            bias[: min(HOT_EXPERTS, num_experts)] = HOT_SCORE_BIAS
            scores = scores + bias
        idx = scores.topk(topk, dim=1).indices
        if kind == "dropped":
            drop = torch.rand(num_tokens, topk, generator=g, device=dev) < 0.3
            drop[::7] = True
            idx = torch.where(drop, torch.full_like(idx, -1), idx)
    w = torch.rand(num_tokens, topk, generator=g, dtype=torch.float32, device=dev)
    w = torch.where(idx >= 0, w, torch.zeros_like(w))
    return idx.to(torch.int64), w


def _one_node_route(g: torch.Generator, num_tokens: int, num_experts: int, topk: int, world: int,
                    node_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``one_node``: a random node per token, then min(K, experts per node) distinct experts of
    that node; the other slots -1."""
    dev = g.device
    per_node = num_experts // (world // node_size)
    node = torch.randint(0, world // node_size, (num_tokens, 1), generator=g, device=dev)
    k = min(topk, per_node)
    idx = torch.rand(num_tokens, per_node, generator=g, device=dev).topk(k, dim=1).indices
    idx = idx + node * per_node
    idx = torch.cat([idx, torch.full((num_tokens, topk - k), -1, dtype=torch.int64, device=dev)], 1)
    w = torch.where(idx >= 0, torch.rand(num_tokens, topk, generator=g, device=dev),
                    torch.zeros(num_tokens, topk, device=dev))
    return idx, w


# ----------------------------------------------------------------------------------------------
# Bench routes
# ----------------------------------------------------------------------------------------------
def derived_seed(*parts) -> int:
    """A 63-bit seed from ``parts`` (sha256 of their ``str`` joined by ``:``): the same parts
    give the same seed in every process and Python version."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def bench_route(kind: str, num_tokens: int, num_experts: int, topk: int, rank: int, world: int,
                seed: int, skew: float = 1.2) -> Tuple[torch.Tensor, torch.Tensor]:
    """A bench route of rank ``rank``'s tokens (weights normalised to sum 1 per token).

    - ``balanced``: every expert receives exactly the same number of slots over all ranks when
      W*T is a multiple of E/K (token g takes experts P[(g + j*E/K) mod E] for a seeded
      permutation P shared by all ranks: K distinct experts, spread over ranks).
    - ``skewed``: K distinct experts per token sampled without replacement with Zipf weights
      1/(i+1)^skew over a seeded expert order (same on all ranks): a few experts are hot.
    - ``uniform``: K distinct experts per token, every K-subset equally likely (the planner's
      routing assumption: its predicted network counts are checked against this route).

    Raises:
        ValueError: an unknown kind.
    """
    g = torch.Generator().manual_seed(derived_seed(seed, "perm", num_experts))
    perm = torch.randperm(num_experts, generator=g)
    gr = torch.Generator().manual_seed(derived_seed(seed, kind, rank, num_tokens, num_experts, topk))
    if kind == "balanced":
        stride = max(1, num_experts // topk)
        gtok = torch.arange(num_tokens) + rank * num_tokens
        slots = (gtok.unsqueeze(1) + stride * torch.arange(topk).unsqueeze(0)) % num_experts
        idx = perm[slots]
    elif kind == "skewed":
        w = 1.0 / (torch.arange(num_experts, dtype=torch.float64) + 1) ** skew
        probs = torch.empty(num_experts, dtype=torch.float64)
        probs[perm] = w / w.sum()
        idx = torch.multinomial(probs.float().expand(num_tokens, -1), topk, replacement=False,
                                generator=gr)
    elif kind == "uniform":
        idx = torch.rand(num_tokens, num_experts, generator=gr).topk(topk, dim=1).indices
    else:
        raise ValueError(f"route {kind!r}: expected balanced, skewed or uniform")
    weights = torch.rand(num_tokens, topk, generator=gr)
    weights = weights / weights.sum(1, keepdim=True)
    return idx.to(torch.int64).contiguous(), weights.float().contiguous()
