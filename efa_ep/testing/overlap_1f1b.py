"""Megatron's combined-1F1B schedule (``overlap_moe_expert_parallel_comm``) driving a tiny
``GPTModel`` (local layer spec, MoE in every layer, :mod:`efa_ep.tiny_moe`), shared by
``tests/dispatcher/test_overlap_1f1b.py`` (CPU) and ``tests/dispatcher/test_overlap_1f1b_gpu.py``.

:func:`schedule_worker` runs, inside each rank of :func:`efa_ep.distributed.run_ranks`, one
training step per *arm* (a dispatcher, a transport, the overlap on or off, config overrides)
through ``get_forward_backward_func()`` (``forward_backward_no_pipelining``, which hands the
step to ``combined_1f1b_schedule_for_no_pipelining`` when the overlap is on), every arm from the
same weights and micro-batches, and returns each arm's per-micro-batch losses and every
parameter's gradient, so the caller can compare arms bit for bit.

On a CPU-only torch the schedule's CUDA-only calls get stand-ins for the duration of a step
(:func:`cpu_schedule`); on a GPU nothing is replaced and the schedule runs as in training.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

# The model of the tests: 3 layers, so the middle one's forward (micro-batch m + 1) runs between
# the nodes of its own backward (micro-batch m); top-2 of 4 experts, EP 2 -> 2 local experts.
MODEL = dict(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
             moe_ffn_hidden_size=128, num_moe_experts=4, moe_router_topk=2, vocab_size=32,
             seq_length=16, dtype="bf16")
MICRO_BATCH = 2


class _NoEvent:
    """CPU stand-in for ``torch.cuda.Event``: work runs in program order, nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuTorch:
    """The ``torch`` that Megatron's ``schedules`` module sees during :func:`cpu_schedule`:
    ``zeros(..., device="cuda")`` (its token counter) allocates on the CPU; all else is torch."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


@contextlib.contextmanager
def cpu_schedule():
    """Lets the combined-1F1B schedule run on a CPU-only torch (no-op where CUDA is available).

    Four CUDA-only calls, each replaced while the context is open: the communication stream
    (``set_streams`` creates none once one is set: the CPU stand-in stream of
    :mod:`efa_ep.dispatcher.cpu_compat`), ``torch.cuda.Event`` (a stand-in whose record/wait do
    nothing), ``Tensor.record_stream`` (nothing to record on the CPU; freeing a node's inputs,
    ``untyped_storage().resize_(0)``, stays real, so a tensor freed too early fails here as on
    a GPU) and the schedule's ``torch.zeros(..., device="cuda")``. Everything else, the node
    order, the detaching between nodes and the separate backward of every node, is Megatron's.
    """
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel import utils as pp_utils

    from efa_ep.dispatcher import cpu_compat

    cpu_compat.enable()
    saved = (pp_utils._COMM_STREAM, torch.cuda.Event, torch.Tensor.record_stream,
             schedules.torch)
    pp_utils._COMM_STREAM = cpu_compat.NO_STREAM
    torch.cuda.Event = _NoEvent
    torch.Tensor.record_stream = lambda self, stream: None
    schedules.torch = _CpuTorch()
    try:
        yield
    finally:
        (pp_utils._COMM_STREAM, torch.cuda.Event, torch.Tensor.record_stream,
         schedules.torch) = saved


def _count_interleaving():
    """Wraps ``TransformerLayerSchedulePlan.run`` to count the layer steps that run a forward
    and a backward together, and those whose two are the same layer object. Returns (counts,
    undo)."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerLayerSchedulePlan

    counts = {"pairs": 0, "same_layer_pairs": 0}
    original = TransformerLayerSchedulePlan.run

    def run(f_layer, b_layer, *args, **kwargs):
        if f_layer is not None and b_layer is not None:
            counts["pairs"] += 1
            counts["same_layer_pairs"] += int(f_layer.layer is b_layer.layer)
        return original(f_layer, b_layer, *args, **kwargs)

    TransformerLayerSchedulePlan.run = staticmethod(run)

    def undo():
        TransformerLayerSchedulePlan.run = staticmethod(original)

    return counts, undo


@contextlib.contextmanager
def _environ(values: Dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_arm(arm: dict, world: int, rank: int, num_microbatches: int, device,
            model: Optional[dict] = None, timed_steps: int = 0, keep_grads: bool = True) -> dict:
    """One training step of one arm, then ``timed_steps`` more, each timed; see
    :func:`schedule_worker`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from efa_ep.tiny_moe import TinyMoEConfig, build_gpt_moe, causal_inputs

    cfg = TinyMoEConfig(**{**MODEL, **(model or {})})
    with _environ(arm.get("env", {})):
        net = build_gpt_moe(cfg, arm["dispatcher"], device=device,
                            overlap_moe_expert_parallel_comm=arm["overlap"],
                            efa_ep_transport=arm.get("transport") or "torch",
                            **arm.get("config", {}))
        gen = torch.Generator().manual_seed(1000 + rank)
        batches = [torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_length), generator=gen)
                   .to(device) for _ in range(num_microbatches)]
        plans = []

        def forward_step(data_iterator, model, return_schedule_plan=False):
            tokens = next(data_iterator)
            labels = torch.roll(tokens, -1, dims=1)
            position_ids, mask = causal_inputs(tokens)
            plans.append(return_schedule_plan)
            if return_schedule_plan:
                out = model.build_schedule_plan(tokens, position_ids, mask, labels=labels)
            else:
                out = model(tokens, position_ids, mask, labels=labels)

            def loss_func(per_token_loss):
                loss = per_token_loss.float().mean()
                return loss, {"loss": loss.detach()}

            return out, loss_func

        def step():
            with cpu_schedule():
                return get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(batches), model=net,
                    num_microbatches=num_microbatches, seq_length=cfg.seq_length,
                    micro_batch_size=MICRO_BATCH, forward_only=False)

        counts, undo = _count_interleaving()
        try:
            stats = step()
        finally:
            undo()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        grads = {n: (None if p.grad is None else p.grad.detach().float().cpu().numpy())
                 for n, p in net.named_parameters()} if keep_grads else {}
        # Timed steps (gradients accumulate; only the time is kept): one boundary, from a
        # barrier with the device idle to the step's last kernel done on this rank.
        step_s = []
        for _ in range(timed_steps):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_s.append(time.perf_counter() - t0)
        dispatchers = sorted({type(l.mlp.token_dispatcher).__name__ for l in net.decoder.layers})
        transports = sorted({getattr(getattr(l.mlp.token_dispatcher, "transport", None), "name",
                                     None) or "-" for l in net.decoder.layers})
        result = dict(
            name=arm["name"], dispatchers=dispatchers, transports=transports,
            losses=[float(s["loss"]) for s in stats],
            schedule_plans=sum(plans[:num_microbatches]), forward_steps=num_microbatches,
            **counts, grads=grads, step_s=step_s)
    del net
    dist.barrier()
    return result


def schedule_worker(rank: int, world: int, arms: List[dict], num_microbatches: int = 4,
                    model: Optional[dict] = None, timed_steps: int = 0,
                    keep_grads: bool = True) -> List[dict]:
    """Per rank: sets up Megatron (TP 1, PP 1, EP ``world``) and runs every arm in order.

    An arm: ``{"name", "dispatcher": "efa" | "alltoall", "overlap": bool, "transport": efa
    transport (default torch; the config's ``efa_ep_transport``), "config": TransformerConfig
    overrides, "env": environment variables while the arm's model is built and run (for what
    is read only from the environment, e.g. ``EFA_EP_REPLACE_DISPATCHER``)}``. Each result: ``name``, the dispatcher
    classes and transport names its layers used, ``losses`` (one per micro-batch, before the
    division by the number of micro-batches), ``schedule_plans`` (micro-batches whose forward
    built a schedule plan, i.e. went through the combined-1F1B schedule), ``forward_steps``,
    ``pairs`` / ``same_layer_pairs`` (layer steps that ran a forward and a backward together /
    of one layer object), ``grads`` ``{parameter name: float32 numpy array or None}`` (empty
    without ``keep_grads``) and ``step_s``, the wall seconds of each of ``timed_steps`` further
    steps on this rank (the step's interleaving counts are of the first step only).
    GPU: rank r uses ``cuda:r % device_count`` (several ranks per GPU need MPS)."""
    import efa_ep  # noqa: F401  (registers the efa dispatcher)
    from efa_ep.tiny_moe import init_megatron

    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    init_megatron(world)
    return [run_arm(arm, world, rank, num_microbatches, device, model, timed_steps, keep_grads)
            for arm in arms]


def compare_arms(reference: dict, other: dict, rank: int) -> Optional[str]:
    """None when ``other``'s losses and every gradient are bitwise ``reference``'s, else one
    line naming the first difference."""
    import numpy as np

    what = f"rank {rank}: {other['name']} vs {reference['name']}"
    if other["losses"] != reference["losses"]:
        return f"{what}: losses differ: {other['losses']} vs {reference['losses']}"
    if sorted(other["grads"]) != sorted(reference["grads"]):
        return f"{what}: parameter names differ"
    for name, want in reference["grads"].items():
        got = other["grads"][name]
        if (got is None) != (want is None):
            return f"{what}: grad of {name} is None in one arm only"
        if want is not None and not np.array_equal(got, want):
            diff = float(np.abs(got - want).max())
            return f"{what}: grad of {name} not bitwise equal (max |diff| {diff:.3g})"
    return None
