"""Lets Megatron-Core 0.19's MoE path run on a CPU-only torch (gloo), for CI and laptops.

Used only when no GPU is present (:func:`enable` is a no-op when CUDA is available); GPU runs
never touch it. Three contained patches, each for a CUDA-only call on Megatron's MoE path:

1. ``torch.cuda.current_device`` returns ``cpu``: Megatron allocates outputs with
   ``device=torch.cuda.current_device()`` (router weight moves, all-gather/all-to-all outputs).
2. Megatron's ``alltoall`` dispatcher (our comparison baseline) creates a CUDA stream and copies
   its splits D2H on it; on CPU the splits only need to become host lists.
3. The CUDA RNG tracker is replaced by Megatron's inference tracker (fork = no-op), since
   ``torch.cuda.get_rng_state`` does not exist on CPU (attention dropout forks it).
4. Shared-expert overlap (``moe_shared_expert_overlap``) runs the shared expert on
   ``SharedExpertMLP.stream`` and joins it with ``torch.cuda.current_stream()``: both become a
   stand-in stream whose waits are no-ops (on CPU everything runs in program order).
"""
from __future__ import annotations

import torch

_enabled = False


class NoStream:
    """CPU stand-in for a CUDA stream: work runs in program order, so waits do nothing.
    ``torch.cuda.stream(NoStream())`` is already a no-op context on a CPU-only torch."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event

    def synchronize(self) -> None:
        pass


NO_STREAM = NoStream()


def enable() -> bool:
    """Applies the CPU patches once. Returns True if they are active (no CUDA here)."""
    global _enabled
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True
    torch.cuda.current_device = lambda: torch.device("cpu")

    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import token_dispatcher as td

    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu: no stream"  # skips torch.cuda.Stream()

    def _host_splits(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.tolist())
        return tokens_per_expert

    td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_splits

    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    torch.cuda.current_stream = lambda device=None: NO_STREAM
    if SharedExpertMLP.stream is None:
        SharedExpertMLP.stream = NO_STREAM  # skips torch.cuda.Stream() in its __init__
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _enabled = True
    return True
