"""Window-size and capacity-policy helpers of the ``efa`` dispatcher (host only): whether a
refused dispatch was refused for its token count alone, the agreement on
``EFA_EP_CAPACITY_OVERFLOW``, and the sizes a ``grow`` decision needs (free memory, window
bytes at a larger T_MAX).
"""
from __future__ import annotations

import torch

from efa_ep.kernels import Transport
from efa_ep.kernels.base import DispatchInputError, TooManyTokensError, parse_too_many_tokens


def only_too_many_tokens(error: DispatchInputError) -> bool:
    """Whether every offending rank's words known here say "more tokens than T_MAX". Words this
    rank cannot know (gda's peers learn only that a rank's input was bad) count as yes: the
    rank that knows them says otherwise in the agreement that follows."""
    if isinstance(error, TooManyTokensError):
        return True
    messages = getattr(error, "messages", None)
    if messages is None:  # not an offending-ranks error (e.g. ranks disagree on K)
        return False
    return all(m is None or parse_too_many_tokens(m) is not None for m in messages.values())


def raise_if_policies_differ(policies, mode: str, error=None) -> None:
    """Raises one line, the same on every rank, when the EP ranks' ``EFA_EP_CAPACITY_OVERFLOW``
    values (rank r's at index r) differ."""
    if len(set(policies)) > 1:
        by = {p: [r for r, q in enumerate(policies) if q == p] for p in sorted(set(policies))}
        raise ValueError(f"EP ranks disagree on EFA_EP_CAPACITY_OVERFLOW ({mode}): "
                         + "; ".join(f"{p!r} on rank(s) {r}" for p, r in by.items())
                         + "; set the same value on every rank") from error


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def free_bytes(device: torch.device) -> int:
    """Free memory where windows for rows on ``device`` would live (bytes; -1 unknown): the
    CUDA device's, else the host's ``MemAvailable`` (which counts reclaimable page cache)."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, RuntimeError):
        pass
    return -1


def window_bytes_at(transport: Transport, max_tokens_per_rank: int) -> int:
    """Estimated window bytes per rank of ``transport``'s kind and options with windows for
    ``max_tokens_per_rank`` (:func:`efa_ep.kernels.memory.window_bytes`; ``hier``: its stages',
    each scaled from its own T_MAX). 0 for ``torch`` (no window)."""
    from efa_ep.kernels.memory import window_bytes

    cfg = transport.cfg
    if cfg.name == "hier":
        stages = [getattr(transport, a, None) for a in ("network", "local")]
        return sum(window_bytes_at(t, t.cfg.max_tokens_per_rank * max_tokens_per_rank
                                    // cfg.max_tokens_per_rank)
                   for t in stages if isinstance(t, Transport))
    if cfg.name not in ("gda", "proxy"):
        return 0
    return window_bytes(cfg.name, world=cfg.world_size, hidden=cfg.hidden, dtype=cfg.dtype,
                        max_tokens_per_rank=max_tokens_per_rank, num_experts=cfg.num_experts,
                        max_topk=dict(cfg.options).get("max_topk"))


def size_text(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"
