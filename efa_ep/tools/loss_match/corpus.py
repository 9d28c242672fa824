"""The training data: a seeded Markov corpus (learnable: the loss falls towards the chain's
entropy, which :func:`markov_entropy` gives as the loss floor)."""
from __future__ import annotations


def make_corpus(vocab: int, length: int, num_seqs: int, seed: int, branching: int):
    """``[num_seqs, length]`` int64 token ids from a fixed random Markov chain.

    Each token has ``branching`` possible successors with random (seeded) probabilities, so a
    model can learn the transition table: the optimal loss is the chain's conditional entropy
    (< log(branching)), far below the initial ~log(vocab).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    succ = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
    probs = torch.rand(vocab, branching, generator=g) + 0.1
    probs = probs / probs.sum(1, keepdim=True)
    cur = torch.randint(0, vocab, (num_seqs,), generator=g)
    cols = [cur]
    for _ in range(length - 1):
        pick = torch.multinomial(probs[cur], 1, generator=g).squeeze(1)
        cur = succ[cur, pick]
        cols.append(cur)
    return torch.stack(cols, dim=1)


def markov_entropy(vocab: int, seed: int, branching: int) -> float:
    """Conditional entropy (nats) of the chain, averaged uniformly over states: a loss floor."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(vocab):
        torch.randperm(vocab, generator=g)
    probs = torch.rand(vocab, branching, generator=g) + 0.1
    probs = probs / probs.sum(1, keepdim=True)
    return float(-(probs * probs.log()).sum(1).mean())
