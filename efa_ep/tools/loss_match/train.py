"""Rank side: trains the tiny GPT-MoE once per arm (same seeds, data order, optimizer and
threads) and records per-step losses, grad norms, routing and final parameter digests; the
self-test faults that must make the check fail."""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from typing import Any, Dict, List

from .arms import Arm, safe_name
from .corpus import make_corpus


def _force_determinism(cfg: Dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(int(cfg["num_threads"]))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


class _DropLastRankPartial:
    """Fault injection (self-test only): a transport whose combine drops the last rank's
    partial sums, i.e. what a combine that forgets one source would do."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, item):
        return getattr(self._inner, item)

    def combine(self, y, handle):
        if self._inner.rank == self._inner.world_size - 1:
            y = y * 0
        return self._inner.combine(y, handle)


def _apply_fault(model, fault: Dict[str, Any], seed: int) -> None:
    """``weight_noise``: every parameter p <- p * (1 + scale * n), n ~ N(0, 1) seeded per name."""
    import torch

    if fault["kind"] == "weight_noise":
        scale = float(fault.get("scale", 1e-3))
        with torch.no_grad():
            for name, p in model.named_parameters():
                digest = hashlib.sha256(f"fault:{seed}:{name}".encode()).digest()
                g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
                noise = torch.randn(p.shape, generator=g).to(device=p.device, dtype=torch.float32)
                p.copy_((p.float() * (1 + scale * noise)).to(p.dtype))


def _param_digest(model) -> str:
    """sha256 over this rank's parameters (names and raw bytes), for bitwise comparisons."""
    import torch

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train_arm(rank: int, cfg: Dict[str, Any], arm: Arm, corpus, fault) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from efa_ep.dispatcher import settings as dsettings
    from efa_ep.dispatcher import token_dispatcher
    from efa_ep.kernels.base import collective_device
    from efa_ep.tiny_moe import TinyMoEConfig, build_gpt_moe, causal_inputs, is_expert_param, sync_grads

    mcfg = TinyMoEConfig(**cfg["model"])
    device = torch.device(cfg["device"])
    # Arm-specific dispatcher settings, passed as a settings object (this process builds the
    # model) and replaced for every arm; the rest (T_MAX, per-option variables) stays the
    # environment's. A non-efa arm reads the environment, as before any arm ran.
    if arm.transport is not None:
        dsettings.use(dsettings.DispatcherSettings.from_env().replace(
            transport=arm.transport, transport_options=tuple(arm.transport_options)))
    else:
        dsettings.use(None)
    token_dispatcher.clear_transport_cache()
    faulted = fault is not None and fault.get("arm") == arm.name
    original_get = token_dispatcher.get_shared_transport
    if faulted and fault["kind"] == "drop_partial":
        token_dispatcher.get_shared_transport = lambda *a, **k: _DropLastRankPartial(original_get(*a, **k))

    torch.manual_seed(cfg["seed"])
    if device.type == "cuda":
        torch.cuda.manual_seed_all(cfg["seed"])
    model = build_gpt_moe(mcfg, dispatcher=arm.dispatcher, device=device)
    if faulted and fault["kind"] == "weight_noise":
        _apply_fault(model, fault, cfg["seed"])
    params = [p for p in model.parameters() if p.requires_grad]
    low_precision = mcfg.dtype != "fp32"
    # Mixed precision as Megatron does it: fp32 master weights, model weights a rounded copy.
    master = [p.detach().float().clone().requires_grad_(True) for p in params] if low_precision else params
    opt_cfg = cfg["optimizer"]
    opt = torch.optim.Adam(master, lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]),
                           eps=opt_cfg["eps"], weight_decay=opt_cfg["weight_decay"])
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    ep_group = parallel_state.get_expert_model_parallel_group()
    gb = int(cfg["global_batch"])
    if gb % dp_size:
        raise ValueError(f"global_batch={gb} must be a multiple of the data-parallel size {dp_size}")
    per = gb // dp_size
    losses: List[float] = []
    grad_norms: List[float] = []
    # Routing record: the experts each router picked, per step, to find routing flips (a
    # near-tied top-k choice that flips turns a 1e-7 weight difference into a loss jump).
    routed: List[Any] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: routed.append(out[1].detach()))
             for m in model.modules() if type(m).__name__ == "TopKRouter"]
    routing_steps: List[Any] = []
    t0 = time.perf_counter()
    try:
        for step in range(int(cfg["steps"])):
            routed.clear()
            batch = corpus[step * gb:(step + 1) * gb][dp_rank * per:(dp_rank + 1) * per].to(device)
            tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            position_ids, mask = causal_inputs(tokens)
            for p in params:
                p.grad = None
            per_token = model(tokens, position_ids, mask, labels=labels)  # [B, S] float
            per_token.float().mean().backward()
            sync_grads(model)
            routing_steps.append(_gather_routing(routed, tokens.shape, dp_group, dp_size))
            # Reported loss: float64 sum over the global batch / count (same for every arm).
            # Tensors of a collective live on the group's device (NCCL has no CPU backend).
            total = per_token.detach().double().sum().reshape(1).to(collective_device(dp_group))
            if dp_size > 1:
                dist.all_reduce(total, group=dp_group)
            losses.append(float(total) / (gb * tokens.shape[1]))
            # Grad norm over the whole model: dense grads are replicated, expert grads sharded.
            norm_device = collective_device(ep_group)
            dense_sq = torch.zeros(1, dtype=torch.float64, device=norm_device)
            expert_sq = torch.zeros(1, dtype=torch.float64, device=norm_device)
            for p in params:
                if p.grad is not None:
                    sq = p.grad.detach().double().pow(2).sum().to(norm_device)
                    if is_expert_param(p):
                        expert_sq += sq
                    else:
                        dense_sq += sq
            if dist.get_world_size(ep_group) > 1:
                dist.all_reduce(expert_sq, group=ep_group)
            grad_norms.append(math.sqrt(float(dense_sq + expert_sq)))
            if low_precision:
                for m, p in zip(master, params):
                    m.grad = None if p.grad is None else p.grad.float()
            opt.step()
            if low_precision:
                with torch.no_grad():
                    for m, p in zip(master, params):
                        p.copy_(m.to(p.dtype))
    finally:
        token_dispatcher.get_shared_transport = original_get
        for h in hooks:
            h.remove()
    seconds = time.perf_counter() - t0
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _param_digest(model))
    token_dispatcher.clear_transport_cache()
    return {"name": arm.name, "losses": losses, "grad_norms": grad_norms,
            "param_sha256": digests, "train_seconds": round(seconds, 3), "error": None,
            "_routing": routing_steps}


def _gather_routing(routed, tokens_shape, dp_group, dp_size):
    """Per-router ``routing_map [S*B_local, E]`` -> ``[layers, B_global, S, K]`` uint8 expert ids
    (sorted), gathered over the data-parallel ranks (rank r holds batch rows r*B_local...)."""
    import numpy as np
    import torch.distributed as dist

    b, s = tokens_shape
    layers = []
    for rmap in routed:
        ids = rmap.to("cpu").nonzero()[:, 1].view(s * b, -1)  # [S*B, K]: sb-major (Megatron [S, B])
        layers.append(ids.view(s, b, -1).permute(1, 0, 2).numpy().astype(np.uint8))
    mine = np.stack(layers) if layers else np.zeros((0, b, s, 0), np.uint8)
    if dp_size == 1:
        return mine
    parts = [None] * dp_size
    dist.all_gather_object(parts, mine, group=dp_group)
    return np.concatenate(parts, axis=1)


def rank_main(rank: int, world: int, cfg: Dict[str, Any], arms: List[Arm], out_dir: str,
              fault) -> List[str]:
    """Runs ``arms`` (all with ep_size == world) one after another; rank 0 writes one JSON per
    finished arm into ``out_dir/arms/`` so a later failure keeps the finished ones."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")  # Megatron's "Apex/TE not installed" and deprecation noise
    logging.getLogger("megatron").setLevel(logging.ERROR)
    _force_determinism(cfg)
    if cfg["device"] == "cuda":  # one rank per GPU (what an NCCL group needs)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    elif cfg["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(cfg["device"]))
    import efa_ep  # noqa: F401,E501  (registers the efa dispatcher)
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world, seed=cfg["seed"])
    d = cfg["data"]
    corpus = make_corpus(cfg["model"]["vocab_size"], cfg["model"]["seq_length"] + 1,
                         int(cfg["steps"]) * int(cfg["global_batch"]), d["seed"], d["branching"])
    done = []
    for arm in arms:
        result = _train_arm(rank, cfg, arm, corpus, fault)
        if rank != 0:
            result.pop("_routing", None)
        if rank == 0:
            import numpy as np

            routing = result.pop("_routing")
            np.save(os.path.join(out_dir, "arms", safe_name(arm.name) + ".routing.npy"),
                    np.stack(routing) if routing else np.zeros((0,), np.uint8))
            path = os.path.join(out_dir, "arms", safe_name(arm.name) + ".json")
            with open(path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(path + ".tmp", path)
        done.append(arm.name)
    return done
