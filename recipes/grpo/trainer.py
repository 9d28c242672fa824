"""The built-in GRPO trainer: one process per EP rank, all running :func:`_rank_main`.

Per GRPO step (NeMo-RL's ``grpo_train`` order), on every rank for its share of the prompts:

1. sample ``num_prompts_per_step / EP`` prompts, repeat each ``num_generations_per_prompt`` times;
2. generate by sampling from the policy itself (full forward per new token, no KV cache; every
   rank runs the same number of forwards: ``max_new_tokens``, or fewer when *all* ranks are done,
   agreed by an all-reduce), keeping the sampler's logprobs;
3. rewards from the task; advantages per prompt group (leave-one-out, std-normalised);
4. ``prev_logprobs`` recomputed by a no-grad forward of the policy, ``reference_logprobs`` by the
   frozen reference copy (skipped when β = 0);
5. ``samples / train_global_batch_size`` optimizer steps, each accumulating microbatches of
   ``train_micro_batch_size``, loss normalised by the global batch's valid tokens (all ranks);
   gradients averaged over data-parallel ranks (expert grads over the expert-DP group), the
   global norm (expert shards included) clipped to ``max_grad_norm``, then Adam.

Every MoE layer moves its tokens with the dispatcher named by
``policy.megatron_cfg.moe_token_dispatcher_type`` (``efa`` by default).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .algorithm import clipped_pg_loss, grpo_advantages
from .config import TrainerConfig
from .task import make_task
from .policy import (
    _all_reduce, _efa_transport_setting, _forward, generate, global_grad_norm, token_logprobs,
)
from .preflight import check_before_start, check_task_fits, rank_env
from .progress import _RankZeroLog

# Summed over microbatches and ranks (each is a share of the global mean); the rest min/max.
_SHARE_METRICS = ("loss", "actor_loss", "kl_penalty", "probs_ratio", "probs_ratio_clamped",
                  "clip_fraction", "token_mult_prob_error", "gen_kl_error")


# ----------------------------------------------------------------------------- rank main
def _device(cfg: TrainerConfig, rank: int) -> torch.device:
    want = cfg.efa_ep.device
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("efa_ep.device=cuda but torch.cuda.is_available() is False")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def quiet_megatron() -> Optional[str]:
    """Silences Megatron's per-module "Transformer Engine / Apex is not installed" warnings
    (a dozen per rank on a CPU machine) and returns the one line that says the same, or None
    when both are installed. Call before Megatron is imported."""
    import importlib.util
    import warnings

    warnings.filterwarnings("ignore", message=r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed")
    missing = [n for n, mod in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
               if importlib.util.find_spec(mod) is None]
    if not missing:
        return None
    return (f"Megatron: {' and '.join(missing)} not installed, so Megatron uses its PyTorch "
            f"implementations (expected on CPU; its per-module warnings are silenced)")


@dataclasses.dataclass
class _RankRun:
    """One rank's run, as set up by :func:`_setup_rank`: the trainer config, the rank's device,
    the task, the policy model (``model_cfg``: its :class:`efa_ep.tiny_moe.TinyMoEConfig`;
    ``dispatcher``: its ``moe_token_dispatcher_type``) and rank 0's log."""

    rank: int
    world: int
    cfg: TrainerConfig
    device: torch.device
    task: Any
    model_cfg: Any
    dispatcher: str
    policy: torch.nn.Module
    log: "_RankZeroLog"
    dispatch_counts: List[int] = dataclasses.field(default_factory=list)
    """Calls of each policy MoE layer's ``token_dispatch`` (:func:`_count_dispatches`)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclasses.dataclass(frozen=True)
class _BatchSizes:
    """A rank's batch sizes per GRPO step; rows are samples (prompt x generation)."""

    prompts_per_rank: int       # prompts this rank samples per step
    num_global_batches: int     # optimizer steps per GRPO step
    rows_per_global_batch: int  # this rank's rows of one global batch
    micro_batch: int            # rows per training forward + backward
    logprob_batch: int          # rows per no-grad logprob forward

    @classmethod
    def of(cls, cfg: TrainerConfig, world: int) -> "_BatchSizes":
        g, pol = cfg.grpo, cfg.policy
        return cls(prompts_per_rank=g.num_prompts_per_step // world,
                   num_global_batches=(g.num_prompts_per_step * g.num_generations_per_prompt)
                   // pol.train_global_batch_size,
                   rows_per_global_batch=pol.train_global_batch_size // world,
                   micro_batch=pol.train_micro_batch_size,
                   logprob_batch=pol.logprob_batch_size or pol.train_micro_batch_size)


class _ValidationSet(NamedTuple):
    """This rank's share of the fixed validation problems: ``prompts [N, P]`` on the rank's
    device, their answers, and the problem count over all ranks."""

    prompts: torch.Tensor
    answers: list
    num_problems: int


class _UpdateStats(NamedTuple):
    """What one GRPO step's policy update measured on this rank: the loss metrics' shares of
    the global mean (:data:`_SHARE_METRICS`), the probability-ratio minima and maxima, and the
    global gradient norm of every optimizer step (before clipping)."""

    sums: Dict[str, float]
    mins: Dict[str, float]
    maxs: Dict[str, float]
    grad_norms: List[float]


def _rank_main(rank: int, world: int, cfg_dict: dict) -> dict:
    """One rank of the built-in trainer, end to end: set up, the optional supervised
    warm-start, the frozen reference and the optimizer, validation before GRPO, the GRPO steps
    (validation on its period), then rank 0's summary (the other ranks: their dispatcher use)."""
    run = _setup_rank(rank, world, cfg_dict)
    g = run.cfg.grpo
    # Every sampling of this rank (warm-start batches, prompts, generations) draws from it.
    rank_gen = torch.Generator().manual_seed(g.seed * 1000 + rank)
    warmup_nonfinite_step = _warm_start(run, rank_gen)
    reference = _frozen_reference(run)
    params, optimizer = _grpo_optimizer(run)
    val_set = _validation_set(run)
    sizes = _BatchSizes.of(run.cfg, world)

    history: List[dict] = []
    if g.val_at_start or g.val_period > 0:
        acc = _validate(run, val_set, rank_gen)
        if run.is_main:
            run.log.metrics.log(0, {"validation/accuracy": acc})
        history.append({"step": 0, "validation/accuracy": acc})
        run.log.info(f"validation accuracy (greedy, {val_set.num_problems} problems) before GRPO: "
                     f"{acc:.3f}")

    bar = run.log.bar(g.max_num_steps, "GRPO")
    run_t0 = time.time()
    for step in range(1, g.max_num_steps + 1):
        metrics = _grpo_step(run, reference, params, optimizer, sizes, rank_gen)
        if _validates_after(g, step):
            metrics["validation/accuracy"] = _validate(run, val_set, rank_gen)
        _log_step(run, step, metrics, history, bar)
    if bar is not None:
        bar.close()
    return _finish(run, history, wall=time.time() - run_t0,
                   warmup_nonfinite_step=warmup_nonfinite_step)


def _setup_rank(rank: int, world: int, cfg_dict: dict) -> _RankRun:
    """Everything before training: signals, threads and device, Megatron's process groups
    (EP = ``world``), the task, the policy model (checked to use the configured dispatcher in
    every layer) and rank 0's log."""
    import signal

    from .config import trainer_config

    # Ctrl-C reaches every process of the terminal's group; the launcher alone handles it (it
    # stops the ranks, then writes the partial run's plot), so ranks do not die mid-collective
    # with a traceback each. run() starts the ranks with SIGINT already blocked (inherited at
    # spawn, before this line could run); blocking it again covers another way of starting
    # them. Ignoring it would not hold: loading libfabric (transport auto probes the proxy)
    # installs a handler that ends the process with status 1.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    megatron_note = quiet_megatron()
    cfg = trainer_config(cfg_dict)
    torch.set_num_threads(max(1, cfg.efa_ep.num_threads))
    device = _device(cfg, rank)
    import efa_ep  # noqa: F401  (registers the efa dispatcher)
    from efa_ep.tiny_moe import build_gpt_moe, init_megatron

    pol = cfg.policy
    mcfg = pol.megatron_cfg
    init_megatron(world, seed=cfg.grpo.seed)
    task = make_task(cfg.efa_ep.task)
    model_cfg = dataclasses.replace(cfg.efa_ep.model, freeze_router=mcfg.freeze_moe_router)
    if pol.precision in ("bfloat16", "bf16") and device.type == "cuda":
        model_cfg = dataclasses.replace(model_cfg, dtype="bf16")
    check_task_fits(cfg)
    dispatcher = mcfg.moe_token_dispatcher_type
    policy = build_gpt_moe(model_cfg, dispatcher=dispatcher, device=device)
    log = _RankZeroLog(cfg, rank == 0)
    if megatron_note:
        log.info(megatron_note)
    log.info(f"policy: tiny Megatron GPT-MoE ({model_cfg.num_layers} layers, "
             f"{model_cfg.num_moe_experts} experts top-{model_cfg.moe_router_topk}, hidden "
             f"{model_cfg.hidden_size}), moe_token_dispatcher_type={dispatcher!r}, EP={world}, "
             f"device={device.type}, transport={_efa_transport_setting()}")
    if dispatcher == "efa":
        from efa_ep.dispatcher.token_dispatcher import EfaTokenDispatcher

        n = sum(isinstance(getattr(m, "token_dispatcher", None), EfaTokenDispatcher)
                for m in policy.modules())
        if n != model_cfg.num_layers:
            raise RuntimeError(f"expected {model_cfg.num_layers} EfaTokenDispatcher layers, found {n}")
    return _RankRun(rank, world, cfg, device, task, model_cfg, dispatcher, policy, log,
                    dispatch_counts=_count_dispatches(policy))


def _moe_dispatchers(model) -> list:
    """The token dispatcher of each MoE layer of ``model``, in layer order."""
    return [m.token_dispatcher for m in model.modules()
            if getattr(m, "token_dispatcher", None) is not None]


def _count_dispatches(model) -> List[int]:
    """A list that counts, per MoE layer of ``model``, the calls of its dispatcher's
    ``token_dispatch`` (wrapped on the instance; Megatron's ``MoELayer`` calls it there): the
    verdict's evidence that every layer moved its tokens with the configured dispatcher."""
    dispatchers = _moe_dispatchers(model)
    counts = [0] * len(dispatchers)
    for i, d in enumerate(dispatchers):
        inner = d.token_dispatch

        def counted(*args, _i=i, _inner=inner, **kwargs):
            counts[_i] += 1
            return _inner(*args, **kwargs)

        d.token_dispatch = counted
    return counts


def _dispatch_report(run: _RankRun) -> dict:
    """This rank's dispatcher use: the class the MoE layers built, their count, the dispatches
    per layer, and (``efa``) the transports that moved the tokens (``auto`` resolved)."""
    dispatchers = _moe_dispatchers(run.policy)
    transports = sorted({d.transport.cfg.name for d in dispatchers
                         if getattr(getattr(d, "transport", None), "cfg", None) is not None})
    return {"class": type(dispatchers[0]).__name__ if dispatchers else None,
            "layers": len(dispatchers), "dispatches": list(run.dispatch_counts),
            "transports": transports}


def _warm_start(run: _RankRun, rank_gen: torch.Generator) -> Optional[int]:
    """Optional supervised warm-start (``efa_ep.warmup``): ``sft_steps`` Adam steps of
    cross-entropy on the task's worked examples, so the GRPO reward does not start at 0.
    Returns the first warm-start step (1-based) whose loss was not finite, or None."""
    w = run.cfg.efa_ep.warmup
    if w.sft_steps <= 0:
        return None
    from efa_ep.tiny_moe import sync_grads

    policy, log = run.policy, run.log
    nonfinite_step = None
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=w.lr)
    t0 = time.time()
    bar = log.bar(w.sft_steps, "warm-start (SFT)")
    for step in range(w.sft_steps):
        tokens, loss_mask = run.task.sft_batch(w.batch_size, rank_gen)
        tokens, loss_mask = tokens.to(run.device), loss_mask.to(run.device)
        logits = _forward(policy, tokens)[:, :-1].float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                             reduction="none").view_as(loss_mask)
        loss = (ce * loss_mask).sum() / loss_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_grads(policy)
        opt.step()
        loss_value = loss.item()
        if nonfinite_step is None and not math.isfinite(loss_value):
            nonfinite_step = step + 1
        if bar is not None:
            bar.set_postfix(loss=f"{loss_value:.3f}")
            bar.update(1)
        if run.is_main and (step + 1) % max(1, w.sft_steps // 4) == 0:
            log.metrics.log(-w.sft_steps + step + 1, {"warmup/sft_loss": loss_value})
    if bar is not None:
        bar.close()
    log.info(f"warm-start: {w.sft_steps} SFT steps in {time.time() - t0:.1f}s, "
             f"final loss {loss.item():.3f}")
    return nonfinite_step


def _frozen_reference(run: _RankRun) -> Optional[torch.nn.Module]:
    """A frozen copy of the policy for the KL penalty, or None when β
    (``loss_fn.reference_policy_kl_penalty``) is 0."""
    if run.cfg.loss_fn.reference_policy_kl_penalty == 0:
        return None
    from efa_ep.tiny_moe import build_gpt_moe

    reference = build_gpt_moe(run.model_cfg, dispatcher=run.dispatcher, device=run.device)
    reference.load_state_dict(run.policy.state_dict())
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


def _grpo_optimizer(run: _RankRun):
    """``(params, optimizer)``: the policy's trainable parameters and AdamW over them
    (``policy.megatron_cfg.optimizer``)."""
    oc = run.cfg.policy.megatron_cfg.optimizer
    params = [p for p in run.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=oc.lr, betas=(oc.adam_beta1, oc.adam_beta2),
                                  eps=oc.adam_eps, weight_decay=oc.weight_decay)
    return params, optimizer


def _validation_set(run: _RankRun) -> _ValidationSet:
    """The same fixed problems on every run (their own seed), split evenly over the ranks."""
    world, rank = run.world, run.rank
    val_gen = torch.Generator().manual_seed(12345)
    n_val = (run.cfg.grpo.max_val_samples // world) * world
    val_prompts_all, val_answers_all = run.task.sample(n_val, val_gen)
    per = n_val // world
    return _ValidationSet(prompts=val_prompts_all[rank * per:(rank + 1) * per].to(run.device),
                          answers=val_answers_all[rank * per:(rank + 1) * per],
                          num_problems=n_val)


def _validate(run: _RankRun, val_set: _ValidationSet, rank_gen: torch.Generator) -> float:
    """Greedy accuracy of the policy on the validation problems of all ranks (collective)."""
    tokens, _, _ = generate(run.policy, val_set.prompts, run.cfg.policy.generation, rank_gen,
                            greedy=True)
    r = run.task.reward(tokens[:, run.task.prompt_len:].cpu(), val_set.answers)
    hits = torch.tensor([r.sum().item(), float(len(r))], device=run.device)
    _all_reduce(hits)
    return (hits[0] / hits[1]).item()


def _validates_after(g, step: int) -> bool:
    """Whether GRPO step ``step`` ends with a validation (``grpo.val_period``, and the last step
    with ``val_period`` > 0 or ``val_at_end``)."""
    return (g.val_period > 0 and (step % g.val_period == 0 or step == g.max_num_steps)
            or (g.val_at_end and step == g.max_num_steps))


def _grpo_step(run: _RankRun, reference, params, optimizer, sizes: _BatchSizes,
               rank_gen: torch.Generator) -> Dict[str, float]:
    """One GRPO step on this rank, in NeMo-RL's ``grpo_train`` order (the module docstring's
    steps 1-5); returns the step's metrics reduced over all ranks."""
    g, pol = run.cfg.grpo, run.cfg.policy
    gen_cfg, task, policy, device = pol.generation, run.task, run.policy, run.device
    t0 = time.time()
    # 1-2. prompts x generations, sampled from the policy
    prompts, answers = task.sample(sizes.prompts_per_rank, rank_gen)
    prompts = prompts.repeat_interleave(g.num_generations_per_prompt, 0).to(device)
    answers = [a for a in answers for _ in range(g.num_generations_per_prompt)]
    group_ids = torch.arange(sizes.prompts_per_rank).repeat_interleave(g.num_generations_per_prompt)
    policy.eval()
    tokens, mask, gen_lp = generate(policy, prompts, gen_cfg, rank_gen)
    t_gen = time.time() - t0
    # 3. rewards and advantages (groups are whole on one rank)
    rewards = task.reward(tokens[:, task.prompt_len:].cpu(), answers)
    adv = grpo_advantages(group_ids, rewards, g.normalize_rewards,
                          g.use_leave_one_out_baseline, g.advantage_clip_low,
                          g.advantage_clip_high).to(device)
    # 4. prev logprobs recomputed by the trainer; reference logprobs
    prev_lp = token_logprobs(policy, tokens, task.prompt_len, gen_cfg, sizes.logprob_batch)
    ref_lp = (token_logprobs(reference, tokens, task.prompt_len, gen_cfg, sizes.logprob_batch)
              if reference is not None else None)
    t_lp = time.time() - t0 - t_gen
    # 5. policy update
    policy.train()
    stats = _policy_update(run, params, optimizer, sizes, tokens, mask, gen_lp, prev_lp, ref_lp,
                           adv)
    return _step_metrics(run, stats, rewards, mask, prompts, t0, t_gen, t_lp)


def _policy_update(run: _RankRun, params, optimizer, sizes: _BatchSizes, tokens, mask, gen_lp,
                   prev_lp, ref_lp, adv) -> _UpdateStats:
    """Step 5: ``num_global_batches`` optimizer steps over this rank's rows (``tokens [N, P+T]``,
    ``mask``/``gen_lp``/``prev_lp``/``ref_lp [N, T]``, ``adv [N]``), each accumulating
    microbatches; the loss is normalised by the global batch's valid tokens (all ranks), the
    gradients averaged over data-parallel ranks, the global norm clipped to
    ``policy.max_grad_norm``, then AdamW."""
    from efa_ep.tiny_moe import sync_grads

    pol, lcfg, task, policy = run.cfg.policy, run.cfg.loss_fn, run.task, run.policy
    gen_cfg, mb = pol.generation, sizes.micro_batch
    sums: Dict[str, float] = {k: 0.0 for k in _SHARE_METRICS}
    mins = {"probs_ratio_min": math.inf, "probs_ratio_clamped_min": math.inf}
    maxs = {"probs_ratio_max": -math.inf, "probs_ratio_clamped_max": -math.inf}
    grad_norms = []
    for gb in range(sizes.num_global_batches):
        rows = slice(gb * sizes.rows_per_global_batch, (gb + 1) * sizes.rows_per_global_batch)
        counts = torch.tensor([mask[rows].sum().item(),
                               float((mask[rows].sum(-1) > 0).sum().item())], device=run.device)
        _all_reduce(counts)
        global_valid_toks, global_valid_seqs = counts[0], counts[1]
        optimizer.zero_grad(set_to_none=True)
        for start in range(rows.start, rows.stop, mb):
            r = slice(start, min(start + mb, rows.stop))
            curr = token_logprobs(policy, tokens[r], task.prompt_len, gen_cfg, mb, grad=True)
            loss, m = clipped_pg_loss(curr, prev_lp[r], gen_lp[r],
                                      ref_lp[r] if ref_lp is not None else None,
                                      adv[r], mask[r], global_valid_toks, lcfg, global_valid_seqs)
            # sync_grads averages over DP ranks; the global-token normaliser wants a sum.
            (loss * run.world).backward()
            for k in _SHARE_METRICS:
                sums[k] += m[k] / sizes.num_global_batches
            for k in mins:
                mins[k] = min(mins[k], m[k])
            for k in maxs:
                maxs[k] = max(maxs[k], m[k])
        sync_grads(policy)
        norm = global_grad_norm(policy)
        grad_norms.append(norm.item())
        if pol.max_grad_norm:
            coef = pol.max_grad_norm / (norm.item() + 1e-6)
            if coef < 1:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        optimizer.step()
    return _UpdateStats(sums, mins, maxs, grad_norms)


def _step_metrics(run: _RankRun, stats: _UpdateStats, rewards, mask, prompts, t0: float,
                  t_gen: float, t_lp: float) -> Dict[str, float]:
    """The step's metrics over all ranks (collective): the loss metrics summed, the ratio
    extremes min/max-reduced, reward and generated tokens per sample, timings and rates."""
    sums, mins, maxs = stats.sums, stats.mins, stats.maxs
    device = run.device
    red = torch.tensor([sums[k] for k in _SHARE_METRICS]
                       + [rewards.sum().item(), float(len(rewards)), mask.sum().item(),
                          float(prompts.numel())], dtype=torch.float64, device=device)
    _all_reduce(red)
    mn = torch.tensor([mins[k] for k in mins], device=device)
    mx = torch.tensor([maxs[k] for k in maxs], device=device)
    _all_reduce(mn, dist.ReduceOp.MIN)
    _all_reduce(mx, dist.ReduceOp.MAX)
    step_time = time.time() - t0
    vals = red.tolist()
    n_share = len(_SHARE_METRICS)
    reward_mean = vals[n_share] / vals[n_share + 1]
    gen_tokens, prompt_tokens = vals[n_share + 2], vals[n_share + 3]
    metrics = {f"train/{k}": vals[i] for i, k in enumerate(_SHARE_METRICS)}
    metrics.update({f"train/{k}": v for k, v in zip(mins, mn.tolist())})
    metrics.update({f"train/{k}": v for k, v in zip(maxs, mx.tolist())})
    metrics.update({
        "train/reward": reward_mean,
        "train/grad_norm": sum(stats.grad_norms) / len(stats.grad_norms),
        "train/mean_gen_tokens_per_sample": gen_tokens / vals[n_share + 1],
        "train/lr": run.cfg.policy.megatron_cfg.optimizer.lr,
        "timing/train/total_step_time": step_time,
        "timing/train/generation": t_gen,
        "timing/train/logprobs": t_lp,
        "timing/train/policy_training": step_time - t_gen - t_lp,
        "performance/tokens_per_sec": (gen_tokens + prompt_tokens) / step_time,
        "performance/generated_tokens_per_sec": gen_tokens / max(t_gen, 1e-9),
    })
    return metrics


def _log_step(run: _RankRun, step: int, metrics: Dict[str, float], history: List[dict],
              bar) -> None:
    """Rank 0 logs the step's metrics; every rank keeps them in ``history``; the progress bar
    shows reward, KL, seconds per step and the latest validation accuracy."""
    if run.is_main:
        run.log.metrics.log(step, metrics)
    history.append({"step": step, **metrics})
    if bar is not None:
        post = {"reward": f"{metrics['train/reward']:.2f}",
                "kl": f"{metrics['train/kl_penalty']:.4f}",
                "s/step": f"{metrics['timing/train/total_step_time']:.2f}"}
        if "validation/accuracy" in metrics:
            post["val"] = f"{metrics['validation/accuracy']:.2f}"
        bar.set_postfix(post)
        bar.update(1)


def _finish(run: _RankRun, history: List[dict], wall: float,
            warmup_nonfinite_step: Optional[int] = None) -> dict:
    """Rank 0 closes its metrics files, plots the curves (``logger.plot``) and returns the
    run's summary; every rank's result carries its dispatcher use (``dispatch``)."""
    dispatch = _dispatch_report(run)
    if not run.is_main:
        return {"rank": run.rank, "dispatch": dispatch}
    run.log.metrics.close()
    png = None
    if run.cfg.logger.plot:
        from .metrics import plot_curves

        png = plot_curves(run.log.metrics.jsonl_path)
    summary = _summary(history, wall, run.log.metrics.jsonl_path, png)
    summary.update(dispatch=dispatch, warmup_nonfinite_step=warmup_nonfinite_step)
    return summary


def _summary(history: List[dict], wall: float, jsonl: str, png: Optional[str]) -> dict:
    from .verdict import first_nonfinite

    rewards = [h["train/reward"] for h in history if "train/reward" in h]
    vals = [h["validation/accuracy"] for h in history if "validation/accuracy" in h]
    k = max(1, min(10, len(rewards) // 5))
    return {
        "steps": len(rewards),
        "grpo_wall_s": wall,
        "reward_first": rewards[0] if rewards else None,
        "reward_start": sum(rewards[:k]) / k if rewards else None,
        "reward_end": sum(rewards[-k:]) / k if rewards else None,
        "reward_window": k,
        "val_accuracy_start": vals[0] if vals else None,
        "val_accuracy_end": vals[-1] if vals else None,
        "token_mult_prob_error_max": max((h["train/token_mult_prob_error"] for h in history
                                          if "train/token_mult_prob_error" in h), default=None),
        "nonfinite": first_nonfinite(history),
        "metrics_jsonl": jsonl,
        "png": png,
    }


# ----------------------------------------------------------------------------- entry
def run(cfg_dict: dict, log: Callable[[str], None] = print) -> dict:
    """Runs the built-in trainer on a resolved recipe dict; returns rank 0's summary, with
    every rank's dispatcher use as ``dispatch`` (a list in rank order).

    Starts ``policy.megatron_cfg.expert_model_parallel_size`` ranks as local processes (gloo on
    CPU or when ranks share a GPU; NCCL with one GPU per rank), with the ``efa_ep.transport``
    settings exported as ``EFA_EP_*`` environment variables, and with SIGINT blocked: Ctrl-C is
    the caller's (KeyboardInterrupt here; the ranks are killed).

    Raises:
        ConfigError / ValueError: a setting is wrong (checked before any rank starts).
        RankFailure: a rank failed (its error and traceback inside).
    """
    from efa_ep.distributed import run_ranks
    from .config import trainer_config

    cfg = trainer_config(cfg_dict)  # validate before spawning
    check_before_start(cfg)
    world = cfg.world_size
    use_cuda = cfg.efa_ep.device == "cuda" or (cfg.efa_ep.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if use_cuda and torch.cuda.device_count() >= world else "gloo"
    env, _ = rank_env(cfg)
    os.makedirs(cfg.logger.log_dir, exist_ok=True)
    t0 = time.time()
    results = run_ranks(_rank_main, world, (cfg_dict,), backend=backend,
                        timeout_s=cfg.efa_ep.timeout_s, pg_timeout_s=300.0, env=env,
                        ranks_block_sigint=True)
    summary = results[0]
    summary["dispatch"] = [r["dispatch"] for r in results]
    summary["total_wall_s"] = time.time() - t0
    summary["world_size"] = world
    summary["backend"] = backend
    return summary
