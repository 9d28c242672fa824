"""Config dataclasses of the built-in GRPO trainer: one per section, keys = NeMo-RL's names.

A recipe is a NeMo-RL GRPO YAML (sections ``grpo``, ``loss_fn``, ``policy``, ``logger``, ...)
plus our own ``efa_ep`` section. :func:`trainer_config` turns the resolved dict into these
dataclasses. NeMo-RL's sections carry many keys the built-in trainer has no use for (vLLM,
checkpointing, ...): those are ignored. Our ``efa_ep`` section is strict: an unknown key raises,
naming it. Defaults are NeMo-RL's (``examples/configs/grpo_math_1B.yaml``) except in ``efa_ep``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

from efa_ep.tiny_moe import TinyMoEConfig


def _build(cls, values: Optional[Mapping[str, Any]], strict: bool, where: str):
    """``cls(**values)`` keeping known fields; nested dataclass fields are built recursively."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if strict and unknown:
        from efa_ep.kernels.options import ConfigError, did_you_mean

        raise ConfigError(f"{where}: unknown key(s) {unknown}{did_you_mean(unknown[0], fields)}",
                          hint=f"keys of {where}: {', '.join(sorted(fields))}")
    kw = {}
    for name, f in fields.items():
        if name not in values:
            continue
        v = values[name]
        sub = _NESTED.get((cls.__name__, name))
        kw[name] = _build(sub, v, strict, f"{where}.{name}") if sub is not None and v is not None else v
    return cls(**kw)


@dataclasses.dataclass
class GRPOConfig:
    """The ``grpo`` section (NeMo-RL's ``GRPOConfig``); keys the built-in trainer uses."""

    num_prompts_per_step: int = 32
    """Distinct prompts per step; split over the data-parallel ranks."""
    num_generations_per_prompt: int = 16
    """Samples per prompt: the group of the leave-one-out baseline."""
    max_num_steps: int = 1000000
    """GRPO steps to run."""
    max_num_epochs: int = 1
    """Unused by the synthetic task (its prompt stream is endless)."""
    seed: int = 42
    """Seed of prompt sampling and generation."""
    normalize_rewards: bool = True
    """Divide advantages by the group reward std where std > 0."""
    use_leave_one_out_baseline: bool = True
    """Baseline of each sample = mean reward of the *other* samples of its prompt."""
    advantage_clip_low: Optional[float] = None
    """Optional lower clip of advantages."""
    advantage_clip_high: Optional[float] = None
    """Optional upper clip of advantages."""
    val_period: int = 10
    """Validate (greedy accuracy on a fixed held-out set) every this many steps; <= 0 never."""
    val_at_start: bool = False
    """Validate before the first step."""
    val_at_end: bool = False
    """Validate after the last step."""
    max_val_samples: int = 256
    """Size of the held-out validation set."""

    def __post_init__(self):
        if self.num_generations_per_prompt < 2 and self.use_leave_one_out_baseline:
            raise ValueError(f"num_generations_per_prompt={self.num_generations_per_prompt} "
                             f"requires use_leave_one_out_baseline=false (needs >= 2 samples)")


@dataclasses.dataclass
class ClippedPGLossConfig:
    """The ``loss_fn`` section (NeMo-RL's ``ClippedPGLossConfig``)."""

    reference_policy_kl_penalty: float = 0.01
    """β of the KL-to-reference term; 0 skips the reference model."""
    reference_policy_kl_type: str = "k3"
    """KL estimator: k1, k2 or k3."""
    kl_input_clamp_value: Optional[float] = 20.0
    """Clamp of ``log(pi_ref / pi)`` before the estimator."""
    kl_output_clamp_value: Optional[float] = 10.0
    """Clamp of the per-token KL."""
    ratio_clip_min: float = 0.2
    """Ratio clamped below at ``1 - ratio_clip_min``."""
    ratio_clip_max: float = 0.2
    """Ratio clamped above at ``1 + ratio_clip_max``."""
    ratio_clip_c: Optional[float] = None
    """Dual-clip constant (> 1) for negative advantages; None disables."""
    use_on_policy_kl_approximation: bool = False
    """Weight the KL by ``pi / pi_gen`` instead of 1."""
    use_importance_sampling_correction: bool = False
    """Not supported by the built-in trainer (its sampler is the policy itself)."""
    token_level_loss: bool = True
    """Mean over all valid tokens of the global batch (True) or per sequence first (False)."""
    truncated_importance_sampling_type: Optional[str] = None
    """Not supported by the built-in trainer."""
    sequence_level_importance_ratios: bool = False
    """GSPO; not supported by the built-in trainer."""
    use_cispo: bool = False
    """Not supported by the built-in trainer."""
    disable_ppo_ratio: bool = False
    """Not supported by the built-in trainer."""
    force_on_policy_ratio: bool = False
    """Not supported by the built-in trainer."""
    positive_example_nll_weight: float = 0.0
    """Not supported by the built-in trainer (must be 0)."""

    def __post_init__(self):
        for name in ("use_importance_sampling_correction", "sequence_level_importance_ratios",
                     "use_cispo", "disable_ppo_ratio", "force_on_policy_ratio"):
            if getattr(self, name):
                raise ValueError(f"loss_fn.{name}=true is not supported by the built-in trainer; "
                                 f"run the recipe with NeMo-RL, or set it to false")
        if self.truncated_importance_sampling_type is not None or self.positive_example_nll_weight:
            raise ValueError("loss_fn.truncated_importance_sampling_type / positive_example_nll_weight "
                             "are not supported by the built-in trainer")
        if self.reference_policy_kl_type not in ("k1", "k2", "k3"):
            raise ValueError(f"loss_fn.reference_policy_kl_type={self.reference_policy_kl_type!r}: "
                             f"expected k1, k2 or k3")


@dataclasses.dataclass
class GenerationConfig:
    """``policy.generation``: sampling from the policy itself (no vLLM, no KV cache)."""

    max_new_tokens: int = 8
    """Tokens sampled per response; every rank runs this many forwards unless all are done."""
    temperature: float = 1.0
    """Logits are divided by it (also when recomputing logprobs, as NeMo-RL does)."""
    top_p: float = 1.0
    """Nucleus sampling; 1.0 disables."""
    top_k: Optional[int] = None
    """Top-k sampling; None disables."""


@dataclasses.dataclass
class OptimizerConfig:
    """``policy.megatron_cfg.optimizer`` (Adam)."""

    lr: float = 5.0e-6
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8


@dataclasses.dataclass
class MegatronConfig:
    """``policy.megatron_cfg``: the keys the built-in trainer reads."""

    expert_model_parallel_size: int = 2
    """EP size = number of local ranks the built-in trainer starts."""
    moe_token_dispatcher_type: str = "efa"
    """``efa`` (ours) or Megatron's ``alltoall`` / ``allgather`` for A/B runs."""
    freeze_moe_router: bool = True
    """Router weights get no gradient (NeMo-RL's default for RL)."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)


@dataclasses.dataclass
class PolicyConfig:
    """``policy``: batch sizes, sequence length, precision, grad clip, generation, Megatron."""

    train_global_batch_size: int = 512
    """Samples per optimizer step (all ranks); steps per GRPO step = samples / this."""
    train_micro_batch_size: int = 4
    """Samples per forward/backward on one rank (gradient accumulation)."""
    logprob_batch_size: Optional[int] = None
    """Samples per no-grad logprob forward; None = train_micro_batch_size."""
    max_total_sequence_length: int = 512
    """Prompt + response must fit."""
    precision: str = "float32"
    """float32 | bfloat16 (bfloat16 only on GPU)."""
    max_grad_norm: Optional[float] = 1.0
    """Global gradient-norm clip (expert shards included); None disables."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    megatron_cfg: MegatronConfig = dataclasses.field(default_factory=MegatronConfig)

    def __post_init__(self):
        if self.precision not in _PRECISIONS:
            raise ValueError(f"policy.precision={self.precision!r}: expected one of "
                             f"{', '.join(_PRECISIONS)}")


_PRECISIONS = ("float32", "bfloat16", "bf16")


@dataclasses.dataclass
class TaskConfig:
    """``efa_ep.task``: the verifiable synthetic task (see :mod:`efa_ep.recipes.grpo.task`)."""

    name: str = "addition"
    """``addition``: ``"ab+cd="`` -> the sum; reward 1 for an exact answer."""
    num_digits: int = 2
    """Digits per operand (zero-padded in the prompt)."""
    reverse_answer: bool = False
    """Write the sum least-significant digit first (easier for tiny models)."""

    def __post_init__(self):
        if self.name != "addition":
            raise ValueError(f"efa_ep.task.name={self.name!r}: only 'addition' is shipped")
        if not 1 <= self.num_digits <= 4:
            raise ValueError(f"efa_ep.task.num_digits={self.num_digits} must be in 1..4")


@dataclasses.dataclass
class WarmupConfig:
    """``efa_ep.warmup``: optional supervised warm-start so reward is not stuck at 0."""

    sft_steps: int = 0
    """Cross-entropy steps on (prompt, answer) pairs before GRPO; 0 disables."""
    lr: float = 3.0e-3
    """Adam learning rate of the warm-start."""
    batch_size: int = 64
    """Samples per rank per warm-start step."""


@dataclasses.dataclass
class TransportConfig:
    """``efa_ep.transport``: settings of the ``efa`` dispatcher, exported as ``EFA_EP_*``
    environment variables to every rank / NeMo-RL worker (``efa_ep.dispatcher.settings``)."""

    transport: str = "auto"
    """``auto`` | ``torch`` | ``gda`` | ``proxy`` -> ``EFA_EP_TRANSPORT``."""
    max_tokens_per_rank: Optional[int] = None
    """-> ``EFA_EP_MAX_TOKENS_PER_RANK``; None keeps the dispatcher's default."""
    transport_options: str = ""
    """``"k=v,..."`` -> ``EFA_EP_TRANSPORT_OPTIONS``."""

    def __post_init__(self):
        # The transport's option schema checks every key here, naming the recipe key, so a
        # typo fails in the launcher instead of in every rank after the model is built.
        from efa_ep.dispatcher.settings import DispatcherSettings

        DispatcherSettings(
            transport=self.transport,
            max_tokens_per_rank=self.max_tokens_per_rank or DispatcherSettings.max_tokens_per_rank,
            transport_options=self.transport_options or "",
            sources=("efa_ep.transport.transport", "efa_ep.transport.max_tokens_per_rank",
                     "efa_ep.transport.transport_options"))

    def env(self) -> Dict[str, str]:
        out = {"EFA_EP_TRANSPORT": self.transport}
        if self.max_tokens_per_rank:
            out["EFA_EP_MAX_TOKENS_PER_RANK"] = str(int(self.max_tokens_per_rank))
        if self.transport_options:
            opts = self.transport_options
            out["EFA_EP_TRANSPORT_OPTIONS"] = (",".join(f"{k}={v}" for k, v in opts.items())
                                               if isinstance(opts, dict) else str(opts))
        return out


@dataclasses.dataclass
class EfaEpConfig:
    """Our ``efa_ep`` section (strict). NeMo-RL ignores it; the launcher reads it."""

    trainer: str = "auto"
    """``auto`` (NeMo-RL if importable, else built-in), ``builtin`` or ``nemo_rl``."""
    device: str = "auto"
    """Built-in trainer: ``auto`` (cuda if available), ``cpu`` or ``cuda``."""
    num_threads: int = 1
    """torch intra-op threads per rank (ranks share the machine's cores)."""
    timeout_s: float = 3600.0
    """Deadline for the whole built-in run (ranks are killed after it)."""
    model: TinyMoEConfig = dataclasses.field(default_factory=TinyMoEConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    warmup: WarmupConfig = dataclasses.field(default_factory=WarmupConfig)
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)

    def __post_init__(self):
        if self.trainer not in ("auto", "builtin", "nemo_rl"):
            raise ValueError(f"efa_ep.trainer={self.trainer!r}: expected auto, builtin or nemo_rl")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"efa_ep.device={self.device!r}: expected auto, cpu or cuda")
        if self.model.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"efa_ep.model.dtype={self.model.dtype!r}: expected fp32, bf16 or fp16")
        if self.num_threads < 1:
            raise ValueError(f"efa_ep.num_threads={self.num_threads} must be >= 1")


@dataclasses.dataclass
class LoggerConfig:
    """``logger``: where metrics go."""

    log_dir: str = "logs"
    """JSONL, TensorBoard events and the PNG go here."""
    tensorboard_enabled: bool = True
    """Write TensorBoard events (if ``torch.utils.tensorboard`` imports)."""
    plot: bool = True
    """efa-ep extra: PNG of reward and KL curves at the end (matplotlib)."""
    progress_bar: bool = True
    """efa-ep extra: tqdm progress bar on rank 0."""


@dataclasses.dataclass
class TrainerConfig:
    """Everything the built-in trainer reads, from a resolved recipe."""

    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    loss_fn: ClippedPGLossConfig = dataclasses.field(default_factory=ClippedPGLossConfig)
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    logger: LoggerConfig = dataclasses.field(default_factory=LoggerConfig)
    efa_ep: EfaEpConfig = dataclasses.field(default_factory=EfaEpConfig)

    def __post_init__(self):
        p, g = self.policy, self.grpo
        ep = p.megatron_cfg.expert_model_parallel_size
        samples = g.num_prompts_per_step * g.num_generations_per_prompt
        if g.num_prompts_per_step % ep:
            raise ValueError(f"grpo.num_prompts_per_step={g.num_prompts_per_step} must be a "
                             f"multiple of policy.megatron_cfg.expert_model_parallel_size={ep}")
        if samples % p.train_global_batch_size or p.train_global_batch_size % ep:
            raise ValueError(
                f"policy.train_global_batch_size={p.train_global_batch_size} must divide "
                f"num_prompts_per_step*num_generations_per_prompt={samples} and be a multiple of "
                f"expert_model_parallel_size={ep}")
        if self.efa_ep.model.num_moe_experts % ep:
            raise ValueError(f"efa_ep.model.num_moe_experts={self.efa_ep.model.num_moe_experts} "
                             f"must be a multiple of expert_model_parallel_size={ep}")

    @property
    def world_size(self) -> int:
        return self.policy.megatron_cfg.expert_model_parallel_size


_NESTED = {
    ("TrainerConfig", "grpo"): GRPOConfig, ("TrainerConfig", "loss_fn"): ClippedPGLossConfig,
    ("TrainerConfig", "policy"): PolicyConfig, ("TrainerConfig", "logger"): LoggerConfig,
    ("TrainerConfig", "efa_ep"): EfaEpConfig,
    ("PolicyConfig", "generation"): GenerationConfig, ("PolicyConfig", "megatron_cfg"): MegatronConfig,
    ("MegatronConfig", "optimizer"): OptimizerConfig,
    ("EfaEpConfig", "model"): TinyMoEConfig, ("EfaEpConfig", "task"): TaskConfig,
    ("EfaEpConfig", "warmup"): WarmupConfig, ("EfaEpConfig", "transport"): TransportConfig,
}
_STRICT = {"efa_ep"}


def trainer_config(cfg: Mapping[str, Any]) -> TrainerConfig:
    """Builds :class:`TrainerConfig` from a resolved recipe dict (sections NeMo-RL's; extra keys
    in them ignored; ``efa_ep`` strict)."""
    kw = {}
    for f in dataclasses.fields(TrainerConfig):
        if f.name in cfg and cfg[f.name] is not None:
            kw[f.name] = _build(_NESTED[("TrainerConfig", f.name)], cfg[f.name],
                                strict=f.name in _STRICT, where=f.name)
    return TrainerConfig(**kw)
