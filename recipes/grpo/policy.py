"""The policy model's pieces the GRPO trainer runs on every rank: logits processing, token
logprobs, sampling, the global gradient norm."""
from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F

from .task import EOS, PAD


def _efa_transport_setting() -> str:
    """The efa dispatcher's transport setting, as its settings read it (for the log line)."""
    from efa_ep.dispatcher import current_settings

    return current_settings().transport


def _process_logits(logits: torch.Tensor, gen_cfg) -> torch.Tensor:
    """Temperature, then top-k / top-p filtering (filtered entries -> -inf)."""
    logits = logits.float() / gen_cfg.temperature
    if gen_cfg.top_k is not None and 0 < gen_cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, gen_cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if gen_cfg.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > gen_cfg.top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


def _forward(model, tokens: torch.Tensor) -> torch.Tensor:
    from efa_ep.tiny_moe import causal_inputs

    pos, mask = causal_inputs(tokens)
    return model(tokens, pos, mask)  # [B, S, V]


def token_logprobs(model, tokens: torch.Tensor, prompt_len: int, gen_cfg, batch_size: int,
                   grad: bool = False) -> torch.Tensor:
    """Logprobs ``[B, T]`` of ``tokens[:, prompt_len:]`` under ``model`` (same logits processing
    as the sampler), in chunks of ``batch_size`` rows (every rank runs the same number)."""
    outs = []
    with torch.set_grad_enabled(grad):
        for chunk in tokens.split(batch_size):
            logits = _process_logits(_forward(model, chunk)[:, prompt_len - 1:-1], gen_cfg)
            lp = torch.log_softmax(logits, -1).gather(-1, chunk[:, prompt_len:, None]).squeeze(-1)
            outs.append(lp)
    return torch.cat(outs)


@torch.no_grad()
def generate(model, prompts: torch.Tensor, gen_cfg, gen: torch.Generator, greedy: bool = False):
    """Samples ``max_new_tokens`` tokens after ``prompts [B, P]``.

    Returns ``(tokens [B, P+T], response_mask [B, T] float, generation_logprobs [B, T])``;
    tokens after ``<eos>`` are ``<pad>`` with mask 0 (``<eos>`` itself counts). Stops early only
    when every sequence on every rank has ended (all-reduce), so all ranks call forward equally.
    """
    b = prompts.shape[0]
    tokens, done = prompts, torch.zeros(b, dtype=torch.bool, device=prompts.device)
    masks, lps = [], []
    for _ in range(gen_cfg.max_new_tokens):
        logits = _process_logits(_forward(model, tokens)[:, -1], gen_cfg)
        logp = torch.log_softmax(logits, -1)
        if greedy:
            nxt = logp.argmax(-1)
        else:
            nxt = torch.multinomial(logp.exp().cpu(), 1, generator=gen).squeeze(-1).to(logp.device)
        lp = logp.gather(-1, nxt[:, None]).squeeze(-1)
        masks.append((~done).float())
        lps.append(torch.where(done, torch.zeros_like(lp), lp))
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        done = done | (nxt == EOS)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        all_done = torch.tensor([float(done.all())], device=tokens.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(all_done, op=dist.ReduceOp.MIN)
        if all_done.item() == 1.0:
            break
    t = len(masks)
    pad = gen_cfg.max_new_tokens - t
    mask, lp = torch.stack(masks, 1), torch.stack(lps, 1)
    if pad:
        tokens = F.pad(tokens, (0, pad), value=PAD)
        mask, lp = F.pad(mask, (0, pad)), F.pad(lp, (0, pad))
    return tokens, mask, lp


def global_grad_norm(model) -> torch.Tensor:
    """L2 norm of all gradients of the full (un-sharded) model: dense grads are replicated after
    :func:`sync_grads`; expert shards are summed over the expert-parallel group."""
    from megatron.core import parallel_state

    from efa_ep.tiny_moe import is_expert_param

    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if is_expert_param(p):
            expert += sq
        else:
            dense += sq
    if dist.is_initialized():
        group = parallel_state.get_expert_model_parallel_group()
        expert = expert.to(next(model.parameters()).device)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(expert, group=group)
        expert = expert.cpu()
    return (dense + expert).sqrt()


def _all_reduce(x: torch.Tensor, op=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x
