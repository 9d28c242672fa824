"""GRPO's math, as NeMo-RL implements it: advantages, k3 KL, clipped policy-gradient loss.

Pure torch, no distributed calls, so the unit tests check them against hand-computed values.
The NeMo-RL sources they follow (commit 7ea279ab):

- :func:`baseline_and_std_per_prompt`: ``nemo_rl/algorithms/utils.py::calculate_baseline_and_std_per_prompt``.
- :func:`grpo_advantages`: ``nemo_rl/algorithms/advantage_estimator.py::GRPOAdvantageEstimator``.
- :func:`calculate_kl`: ``nemo_rl/algorithms/utils.py::calculate_kl``.
- :func:`clipped_pg_loss`: ``nemo_rl/algorithms/loss/loss_functions.py::ClippedPGLossFn`` (the
  default path: no importance-sampling correction, no GSPO, no CISPO).

Symbols: B samples (prompt x generation), T response tokens per sample (right-padded).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, global_normalization_factor=None,
                dim=None) -> torch.Tensor:
    """``sum(values * mask) / factor``; ``factor`` defaults to ``mask.sum()`` (NeMo-RL's
    ``masked_mean``). With ``dim``, a per-row mean over that dim (rows with no mask give 0)."""
    if dim is not None:
        return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1e-8)
    factor = mask.sum() if global_normalization_factor is None else global_normalization_factor
    return (values * mask).sum() / (factor + 1e-8)


def baseline_and_std_per_prompt(prompt_ids: torch.Tensor, rewards: torch.Tensor,
                                valid_mask: Optional[torch.Tensor] = None,
                                leave_one_out_baseline: bool = True
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and reward std over the other samples of the same prompt.

    Args:
        prompt_ids: ``[B]`` int (group id) or ``[B, P]`` prompt tokens; equal rows = one group.
        rewards: ``[B]`` float.
        valid_mask: ``[B]`` 0/1, samples with 0 are left out of the statistics (default all 1).
        leave_one_out_baseline: RLOO baseline ``b_i = sum_{j != i} r_j / (n - 1)``.

    Returns:
        ``(baseline [B], std [B])``. The std is Bessel-corrected over the ``n'`` samples the
        baseline averages (``n' = n - 1`` with leave-one-out). A group with <= 1 valid sample
        gets ``baseline = reward`` (advantage 0) and std 0.
    """
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids.unsqueeze(-1)
    rewards = rewards.float()
    valid = torch.ones_like(rewards) if valid_mask is None else valid_mask.float()
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for group in torch.unique(prompt_ids, dim=0):
        idx = torch.nonzero((prompt_ids == group).all(1)).flatten()
        n = len(idx)
        if valid[idx].sum() <= 1:
            baseline[idx] = rewards[idx]
            continue
        mat = (1 - torch.eye(n)) if leave_one_out_baseline else torch.ones(n, n)
        num_valid = valid[idx].sum() - int(leave_one_out_baseline)
        r = rewards[idx] * valid[idx]
        b = mat @ r / num_valid
        sq = mat @ (rewards[idx].pow(2) * valid[idx]) / num_valid
        baseline[idx] = b
        std[idx] = ((sq - b.square()) * (num_valid / (num_valid - 1))).sqrt().nan_to_num(0)
    return baseline, std


def grpo_advantages(prompt_ids: torch.Tensor, rewards: torch.Tensor, normalize_rewards: bool = True,
                    use_leave_one_out_baseline: bool = True,
                    advantage_clip_low: Optional[float] = None,
                    advantage_clip_high: Optional[float] = None) -> torch.Tensor:
    """``A = r - baseline``, divided by ``std + 1e-6`` only where ``std > 0``. Returns ``[B]``
    (broadcast over tokens by the caller). Optional clipping to ``[low, high]``."""
    baseline, std = baseline_and_std_per_prompt(prompt_ids, rewards, None, use_leave_one_out_baseline)
    adv = rewards.float() - baseline
    if normalize_rewards:
        nz = std > 0
        adv[nz] = adv[nz] / (std[nz] + 1e-6)
    if advantage_clip_low is not None or advantage_clip_high is not None:
        adv = adv.clamp(min=advantage_clip_low, max=advantage_clip_high)
    return adv


def calculate_kl(logprobs: torch.Tensor, logprobs_reference: torch.Tensor, kl_type: str = "k3",
                 input_clamp_value: Optional[float] = 20.0, output_clamp_value: Optional[float] = 10.0,
                 importance_sampling_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token KL estimate of ``pi || pi_ref`` from sampled-token logprobs.

    ``logr = ref - cur`` clamped to ``±input_clamp_value``; k1 = ``-logr``, k2 = ``logr²/2``,
    k3 = ``exp(logr) - 1 - logr``; times the weights; output clamped to ``±output_clamp_value``.
    """
    logr = logprobs_reference - logprobs
    if input_clamp_value is not None:
        clamped = logr.clamp(-input_clamp_value, input_clamp_value)
        if importance_sampling_weights is not None:
            importance_sampling_weights = torch.where(
                logr == clamped, importance_sampling_weights, importance_sampling_weights.detach())
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"reference_policy_kl_type={kl_type!r}: expected 'k1', 'k2' or 'k3'")
    if importance_sampling_weights is not None:
        kl = importance_sampling_weights * kl
    if output_clamp_value is not None:
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl


def clipped_pg_loss(curr_logprobs: torch.Tensor, prev_logprobs: torch.Tensor,
                    generation_logprobs: torch.Tensor, reference_logprobs: Optional[torch.Tensor],
                    advantages: torch.Tensor, mask: torch.Tensor, global_valid_toks, cfg,
                    global_valid_seqs=None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """NeMo-RL's ``ClippedPGLossFn`` for one microbatch.

    Args:
        curr_logprobs: ``[B, T]`` float32, differentiable: the policy being trained.
        prev_logprobs: ``[B, T]`` recomputed by the trainer before the update (no grad).
        generation_logprobs: ``[B, T]`` from the sampler; used only for the error metrics.
        reference_logprobs: ``[B, T]`` from the frozen reference policy, or None when
            ``reference_policy_kl_penalty == 0``.
        advantages: ``[B, T]`` (or ``[B]``, broadcast).
        mask: ``[B, T]`` 0/1 valid response tokens (times the sample mask).
        global_valid_toks: valid tokens in the whole global batch (all microbatches, all ranks):
            the denominator of every token-level mean, so microbatch losses sum to the global mean.
        cfg: a :class:`~efa_ep.recipes.grpo.config.ClippedPGLossConfig`.
        global_valid_seqs: valid samples in the global batch (``token_level_loss=False`` only).

    Returns:
        ``(loss, metrics)``; ``loss = actor_loss + kl``. Metrics use NeMo-RL's names and are
        this microbatch's share of the global mean (sum over microbatches and ranks to combine),
        except the ``*_min``/``*_max`` entries.
    """
    mask = mask.float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(mask)
    seq_mask = (mask.sum(-1) > 0).float()

    def reduce(x):
        if cfg.token_level_loss:
            return masked_mean(x, mask, global_valid_toks)
        return masked_mean(masked_mean(x, mask, dim=-1), seq_mask, global_valid_seqs)

    with torch.no_grad():
        lp_error = (generation_logprobs - prev_logprobs).abs()
        mult_prob_error = masked_mean(torch.exp(lp_error * mask), mask, global_valid_toks)
        gen_kl_error = masked_mean(calculate_kl(generation_logprobs, prev_logprobs,
                                                cfg.reference_policy_kl_type, None, None),
                                   mask, global_valid_toks)

    if cfg.reference_policy_kl_penalty != 0:
        if reference_logprobs is None:
            raise ValueError("reference_policy_kl_penalty != 0 needs reference logprobs")
        if cfg.use_on_policy_kl_approximation:
            weights = torch.exp(curr_logprobs - generation_logprobs)
        else:
            weights = torch.exp(curr_logprobs - curr_logprobs.detach())  # value 1, keeps the grad
        weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
        kl = cfg.reference_policy_kl_penalty * calculate_kl(
            curr_logprobs, reference_logprobs, cfg.reference_policy_kl_type,
            cfg.kl_input_clamp_value, cfg.kl_output_clamp_value, weights)
        kl = reduce(kl)
    else:
        kl = torch.zeros((), dtype=curr_logprobs.dtype)

    ratios = torch.exp(curr_logprobs - prev_logprobs)
    ratios_clamped = ratios.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    clip_loss = torch.max(-advantages * ratios, -advantages * ratios_clamped)
    if cfg.ratio_clip_c is not None:
        if cfg.ratio_clip_c <= 1:
            raise ValueError(f"ratio_clip_c={cfg.ratio_clip_c} must be > 1")
        clip_loss = torch.where(advantages < 0,
                                torch.min(clip_loss, -advantages * cfg.ratio_clip_c), clip_loss)
    actor_loss = reduce(clip_loss)
    loss = actor_loss + kl

    with torch.no_grad():
        valid = mask.bool()
        r, rc = ratios.detach()[valid], ratios_clamped.detach()[valid]
        clipped = ((ratios.detach() != ratios_clamped.detach()).float())
        metrics = {
            "loss": float(loss),
            "actor_loss": float(actor_loss),
            "kl_penalty": float(kl) / cfg.reference_policy_kl_penalty
            if cfg.reference_policy_kl_penalty != 0 else 0.0,
            "probs_ratio": float(masked_mean(ratios.detach(), mask, global_valid_toks)),
            "probs_ratio_clamped": float(masked_mean(ratios_clamped.detach(), mask, global_valid_toks)),
            "clip_fraction": float(masked_mean(clipped, mask, global_valid_toks)),
            "token_mult_prob_error": float(mult_prob_error),
            "gen_kl_error": float(gen_kl_error),
            "probs_ratio_min": float(r.min()) if r.numel() else float("inf"),
            "probs_ratio_max": float(r.max()) if r.numel() else float("-inf"),
            "probs_ratio_clamped_min": float(rc.min()) if rc.numel() else float("inf"),
            "probs_ratio_clamped_max": float(rc.max()) if rc.numel() else float("-inf"),
        }
    return loss, metrics
