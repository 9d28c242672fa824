"""A tiny Megatron-Core GPT-MoE, built identically for any EP size and any dispatcher.

Shared by the loss-match command, the built-in GRPO trainer, the benchmarks and the tests.
Weights are set from a seed per parameter *name with the global expert id*, so the model is the
same function whether it runs with EP 1 in one process or EP 2/4/8 over several ranks, and
whichever dispatcher (``efa``, ``alltoall``, ``allgather``) moves its tokens.

Typical use inside each rank (after ``torch.distributed.init_process_group``)::

    init_megatron(ep_size=2)
    model = build_gpt_moe(TinyMoEConfig(), dispatcher="efa")
    loss = model(tokens, position_ids, None, labels=labels).mean()  # causal mask built inside
    loss.backward(); sync_grads(model)
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Optional

import torch
import torch.distributed as dist


@dataclasses.dataclass
class TinyMoEConfig:
    """Model shape and numerics. Keys match Megatron's TransformerConfig where they exist."""

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int = 256
    moe_ffn_hidden_size: int = 256
    num_moe_experts: int = 8
    moe_router_topk: int = 2
    vocab_size: int = 64
    seq_length: int = 64
    dtype: str = "fp32"          # fp32 | bf16
    init_std: float = 0.02
    seed: int = 1234
    freeze_router: bool = False  # NeMo-RL freezes the router in RL (moe_router_freeze)


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def init_megatron(ep_size: int, seed: int = 1234) -> None:
    """Initialises Megatron's parallel state for TP=1, PP=1, EP=ep_size over the default group.

    On a machine without CUDA it first enables :mod:`efa_ep.dispatcher.cpu_compat`.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    from efa_ep.dispatcher import cpu_compat

    on_cpu = cpu_compat.enable()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=ep_size,
        create_gloo_process_groups=False)
    if on_cpu:
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        tp_random.model_parallel_cuda_manual_seed(seed)


def transformer_config(cfg: TinyMoEConfig, dispatcher: str, ep_size: int, **overrides):
    """Megatron TransformerConfig for ``cfg`` with ``moe_token_dispatcher_type=dispatcher``.
    ``overrides``: TransformerConfig fields, and the efa dispatcher's settings as
    ``efa_ep_<name>`` attributes (``efa_ep_transport="torch"``; see
    :mod:`efa_ep.dispatcher.settings`), set on the config after it is built."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = _dtype(cfg.dtype)
    kw = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, num_moe_experts=cfg.num_moe_experts,
        moe_router_topk=cfg.moe_router_topk, moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
        expert_model_parallel_size=ep_size, tensor_model_parallel_size=1,
        use_cpu_initialization=True, perform_initialization=True,
        gradient_accumulation_fusion=False, bf16=dtype == torch.bfloat16, fp16=False,
        params_dtype=dtype, pipeline_dtype=dtype, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, moe_permute_fusion=False,
        init_method_std=cfg.init_std,
        # Megatron's default ("full") warns that it is deprecated on every config it builds;
        # an empty list means the same here (no CUDA graphs: cuda_graph_impl stays "none").
        cuda_graph_modules=[],
    )
    efa = {k: overrides.pop(k) for k in list(overrides) if k.startswith("efa_ep_")}
    kw.update(overrides)
    config = TransformerConfig(**kw)
    for k, v in efa.items():
        setattr(config, k, v)
    return config


_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def global_param_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """``...local_experts.1.linear_fc1.weight`` on EP rank 2 with 4 local experts ->
    ``...experts.9.linear_fc1.weight``: the name a parameter has at EP=1."""
    return _LOCAL_EXPERT.sub(lambda m: f"experts.{ep_rank * num_local_experts + int(m.group(1))}.",
                             name)


def deterministic_init_(model, cfg: TinyMoEConfig, ep_rank: int, ep_size: int) -> None:
    """Re-initialises every parameter from a seed derived from ``cfg.seed`` and its global name:
    normal(0, init_std) for matrices, ones for norm weights, zeros for biases."""
    num_local = cfg.num_moe_experts // ep_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            gname = global_param_name(name, ep_rank, num_local)
            digest = hashlib.sha256(f"{cfg.seed}:{gname}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            if "layernorm" in gname or "norm" in gname.split(".")[-2]:
                value = torch.ones(p.shape) if gname.endswith("weight") else torch.zeros(p.shape)
            elif gname.endswith("bias"):
                value = torch.zeros(p.shape)
            else:
                value = torch.randn(p.shape, generator=gen) * cfg.init_std
            p.copy_(value.to(p.dtype))


def build_gpt_moe(cfg: TinyMoEConfig, dispatcher: str = "efa", device: Optional[torch.device] = None,
                  **config_overrides):
    """Megatron ``GPTModel`` (local layer spec, MoE MLP in every layer, RoPE) with weights from
    :func:`deterministic_init_`. Needs :func:`init_megatron` first."""
    import efa_ep  # noqa: F401  (registers the efa dispatcher)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    ep_size = parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    config = transformer_config(cfg, dispatcher, ep_size, **config_overrides)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts)
    import logging
    import warnings

    # "GPTModel IS DEPRECATED" (a logging warning, printed once per build): the local-spec
    # GPTModel is still what runs Megatron's MoE layer on CPU without Transformer Engine.
    gpt_logger = logging.getLogger(GPTModel.__module__)
    level = gpt_logger.level
    gpt_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                             max_sequence_length=cfg.seq_length, position_embedding_type="rope",
                             share_embeddings_and_output_weights=False)
    finally:
        gpt_logger.setLevel(level)
    deterministic_init_(model, cfg, ep_rank, ep_size)
    if cfg.dtype != "fp32":
        # What Megatron's Float16Module does: every parameter in the low-precision dtype. The
        # local spec's torch LayerNorm ignores params_dtype, and CUDA's layer_norm refuses a
        # bf16 input with fp32 weights (CPU tolerates it). The router still computes in fp32
        # (moe_router_dtype).
        model = model.to(dtype=_dtype(cfg.dtype))
    if cfg.freeze_router:
        for name, p in model.named_parameters():
            if ".router." in name:
                p.requires_grad_(False)
    if device is not None:
        model = model.to(device)
    return model


def is_expert_param(p) -> bool:
    """Expert parameters are sharded over EP; Megatron marks them ``allreduce=False``."""
    return not getattr(p, "allreduce", True)


def sync_grads(model) -> None:
    """What Megatron's DDP does to gradients, without its CUDA buffers: average over the
    data-parallel ranks. Dense grads all-reduce over the DP group; expert grads over the
    expert-DP group; both divided by the DP size (each rank's loss is a mean over its own batch)."""
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    dp_size = dist.get_world_size(dp_group)
    edp_group = parallel_state.get_expert_data_parallel_group()
    for p in model.parameters():
        if p.grad is None:
            continue
        group = edp_group if is_expert_param(p) else dp_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
        if dp_size > 1:
            p.grad.div_(dp_size)


def causal_inputs(tokens: torch.Tensor):
    """``tokens [B, S]`` -> (position_ids [B, S], attention_mask [1, 1, S, S] bool, True = masked)."""
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, -1)
    mask = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1)[None, None]
    return position_ids, mask
