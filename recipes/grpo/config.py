"""Config dataclasses of the built-in GRPO trainer: one per section, keys = NeMo-RL's names.

A recipe is a NeMo-RL GRPO YAML (sections ``grpo``, ``loss_fn``, ``policy``, ``logger``, ...)
plus our own ``efa_ep`` section. :func:`trainer_config` turns the resolved dict into these
dataclasses. NeMo-RL's sections carry many keys the built-in trainer has no use for (vLLM,
checkpointing, ...): those are ignored. Our ``efa_ep`` section is strict: an unknown key raises,
naming it. Defaults are NeMo-RL's (``examples/configs/grpo_math_1B.yaml``) except in ``efa_ep``.

Every key these dataclasses declare is type-checked against its annotation when the recipe is
read (:func:`check_recipe_types`, also part of :func:`trainer_config`): Hydra turns
``grpo.max_num_steps=ten`` into the string ``'ten'``, which nothing else would notice until a rank
used it, minutes into the run. An int is accepted where a float is declared (and converted).
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Mapping, Optional, Union

from efa_ep.tiny_moe import TinyMoEConfig


def _type_text(tp) -> str:
    """``int``, ``float or null``, ``string or mapping``, ... for messages."""
    if tp is type(None):
        return "null"
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Union:
        return " or ".join(_type_text(a) for a in sorted(args, key=lambda a: a is type(None)))
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) in (dict, Mapping):
        return "mapping"
    return {int: "int", float: "float", bool: "bool (true or false)", str: "string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _value_text(v) -> str:
    """What a value is, in the recipe's words: ``a string``, ``a float``, ``null``, ..."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a bool"
    if isinstance(v, Mapping):
        return "a mapping"
    if isinstance(v, (list, tuple)):
        return "a list"
    return {int: "an int", float: "a float", str: "a string"}.get(type(v), f"a {type(v).__name__}")


_NO_VALUE = object()


def _coerce(v, tp):
    """``v`` as type ``tp`` (an int where a float is declared becomes a float), or ``_NO_VALUE``
    when it is not one. bool is not an int here: ``true`` for a step count is a mistake."""
    if tp is Any:
        return v
    if tp is type(None):
        return None if v is None else _NO_VALUE
    if typing.get_origin(tp) is Union:
        for a in typing.get_args(tp):
            out = _coerce(v, a)
            if out is not _NO_VALUE:
                return out
        return _NO_VALUE
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) in (dict, Mapping):
        return v if isinstance(v, Mapping) else _NO_VALUE
    if tp is float:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else _NO_VALUE
    if tp is int:
        return v if isinstance(v, int) and not isinstance(v, bool) else _NO_VALUE
    if tp in (bool, str):
        return v if isinstance(v, tp) else _NO_VALUE
    return v  # a type this checker does not know: left to the dataclass


def _default_text(default) -> str:
    """`` (default: x)`` for a hint, or ``""`` for a field without a plain default."""
    if default is dataclasses.MISSING:
        return ""
    if default is None:
        text = "null"
    elif isinstance(default, bool):
        text = str(default).lower()
    else:
        text = repr(default) if default == "" else str(default)
    return f" (default: {text})"


def _checked(cls, name: str, value, where: str):
    """``value`` of field ``name`` of ``cls`` checked against the field's annotation (and
    converted, see :func:`_coerce`). Raises ConfigError naming the key, the value and the type."""
    tp = typing.get_type_hints(cls)[name]
    out = _coerce(value, tp)
    if out is _NO_VALUE:
        from efa_ep.kernels.options import ConfigError

        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        key = f"{where}.{name}"
        raise ConfigError(f"{key}={value!r}: expected {_type_text(tp)}, got {_value_text(value)}",
                          hint=f"{key} takes {_type_text(tp).split(' (')[0]}{_default_text(f.default)}; "
                               f"the type of every key: efa_ep/recipes/grpo/config.py")
    return out


def _checked_values(cls, values, strict: bool, where: str) -> Dict[str, Any]:
    """The keys of ``values`` that ``cls`` declares, each checked and converted; unknown keys
    raise when ``strict`` (NeMo-RL's sections: ignored)."""
    if not isinstance(values, Mapping):
        from efa_ep.kernels.options import ConfigError

        raise ConfigError(f"{where}={values!r}: expected a mapping (a section), got "
                          f"{_value_text(values)}", hint=f"see --print-config for {where}'s keys")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if strict and unknown:
        from efa_ep.kernels.options import ConfigError, did_you_mean

        raise ConfigError(f"{where}: unknown key(s) {unknown}{did_you_mean(unknown[0], fields)}",
                          hint=f"keys of {where}: {', '.join(sorted(fields))}")
    return {name: _checked(cls, name, values[name], where) for name in fields if name in values}


def _build(cls, values: Optional[Mapping[str, Any]], strict: bool, where: str):
    """``cls(**values)`` keeping known fields, each type-checked; nested dataclass fields are
    built recursively."""
    kw = _checked_values(cls, {} if values is None else values, strict, where)
    for name, v in kw.items():
        sub = _NESTED.get((cls.__name__, name))
        if sub is not None and v is not None:
            kw[name] = _build(sub, v, strict, f"{where}.{name}")
    return cls(**kw)


def _check_types(cls, values, strict: bool, where: str) -> None:
    """:func:`_build`'s checks without building (no cross-key checks)."""
    for name, v in _checked_values(cls, values, strict, where).items():
        sub = _NESTED.get((cls.__name__, name))
        if sub is not None and v is not None:
            _check_types(sub, v, strict, f"{where}.{name}")


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
        for name in ("num_prompts_per_step", "num_generations_per_prompt", "max_num_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"grpo.{name}={getattr(self, name)} must be >= 1")
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
        for name in ("train_global_batch_size", "train_micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"policy.{name}={getattr(self, name)} must be >= 1")
        if self.logprob_batch_size is not None and self.logprob_batch_size < 1:
            raise ValueError(f"policy.logprob_batch_size={self.logprob_batch_size} must be >= 1 "
                             f"(or null: train_micro_batch_size)")
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
class DispatcherTransportConfig:
    """``efa_ep.transport``: settings of the ``efa`` dispatcher, exported as ``EFA_EP_*``
    environment variables to every rank / NeMo-RL worker (``efa_ep.dispatcher.settings``)."""

    transport: str = "auto"
    """``auto`` | ``torch`` | ``gda`` | ``proxy`` -> ``EFA_EP_TRANSPORT``."""
    max_tokens_per_rank: Optional[int] = None
    """-> ``EFA_EP_MAX_TOKENS_PER_RANK``; None keeps the dispatcher's default."""
    transport_options: Union[str, Dict[str, Any]] = ""
    """``"k=v,..."`` or a mapping -> ``EFA_EP_TRANSPORT_OPTIONS``."""

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
    transport: DispatcherTransportConfig = dataclasses.field(default_factory=DispatcherTransportConfig)

    def __post_init__(self):
        if self.trainer not in ("auto", "builtin", "nemo_rl"):
            raise ValueError(f"efa_ep.trainer={self.trainer!r}: expected auto, builtin or nemo_rl")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"efa_ep.device={self.device!r}: expected auto, cpu or cuda")
        if self.model.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"efa_ep.model.dtype={self.model.dtype!r}: expected fp32, bf16 or fp16")
        if self.num_threads < 1:
            raise ValueError(f"efa_ep.num_threads={self.num_threads} must be >= 1")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "moe_ffn_hidden_size", "num_moe_experts", "moe_router_topk", "vocab_size",
                     "seq_length"):
            if getattr(self.model, name) < 1:
                raise ValueError(f"efa_ep.model.{name}={getattr(self.model, name)} must be >= 1")


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
    ("EfaEpConfig", "warmup"): WarmupConfig, ("EfaEpConfig", "transport"): DispatcherTransportConfig,
}
_STRICT = {"efa_ep"}
_NESTED_SECTIONS = {name for (owner, name) in _NESTED if owner == "TrainerConfig"}


def check_recipe_types(cfg: Mapping[str, Any]) -> None:
    """Every key of a resolved recipe that these dataclasses declare has a value of its declared
    type; ``efa_ep`` has no unknown key. Only types: the NeMo-RL trainer runs recipes whose sizes
    the built-in trainer's cross-key checks (:class:`TrainerConfig`) do not apply to.

    Raises:
        ConfigError: one line naming the key, the value and the expected type.
    """
    for f in dataclasses.fields(TrainerConfig):
        if f.name in cfg and cfg[f.name] is not None:
            _check_types(_NESTED[("TrainerConfig", f.name)], cfg[f.name],
                         strict=f.name in _STRICT, where=f.name)


# Keys NeMo-RL's path reads from policy.megatron_cfg; the built-in trainer's are in efa_ep.transport.
_NEMO_RL_ONLY = {"policy.megatron_cfg.efa_ep_transport": "efa_ep.transport.transport",
                 "policy.megatron_cfg.efa_ep_max_tokens_per_rank": "efa_ep.transport.max_tokens_per_rank",
                 "policy.megatron_cfg.efa_ep_transport_options": "efa_ep.transport.transport_options"}


def _declared(dotted: str) -> bool:
    """Whether ``dotted`` names a key (or a section) of :class:`TrainerConfig`."""
    cls = TrainerConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if cls is None or part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        cls = _NESTED.get((cls.__name__, part))
        if cls is None:
            return i == len(parts) - 1
    return True


def check_added_keys(overrides) -> None:
    """For the built-in trainer: a ``+key=value`` override (a key the recipe lacks) in a section
    it reads must name a key it reads; otherwise nothing would read it, not even a type check.
    NeMo-RL's path reads other keys, so it does not call this.

    Raises:
        ConfigError: naming the override, the closest key, or where the setting lives instead.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from efa_ep.kernels.options import ConfigError, did_you_mean

    for o in OverridesParser.create().parse_overrides(overrides=list(overrides)):
        key = o.key_or_group
        section = key.split(".")[0]
        if not o.is_add() or section not in _NESTED_SECTIONS or section in _STRICT or _declared(key):
            continue
        if key in _NEMO_RL_ONLY:
            value = o.input_line.split("=", 1)[-1]
            raise ConfigError(f"override {o.input_line}: the built-in trainer does not read {key} "
                              f"(NeMo-RL's path does)",
                              hint=f"for the built-in trainer write {_NEMO_RL_ONLY[key]}={value}")
        parent = key.rpartition(".")[0]
        cls = _section_class(parent) if _declared(parent) else None
        near = did_you_mean(key, [f"{parent}.{f.name}" for f in dataclasses.fields(cls)] if cls else [])
        raise ConfigError(f"override {o.input_line}: the built-in trainer reads no key {key!r}{near}",
                          hint="its keys and their types: efa_ep/recipes/grpo/config.py; see "
                               "--print-config for the recipe's")


def _section_class(dotted: str):
    """The dataclass of section ``dotted`` of :class:`TrainerConfig`, or None."""
    cls = TrainerConfig
    for part in dotted.split("."):
        cls = _NESTED.get((cls.__name__, part)) if cls is not None else None
    return cls


def trainer_config(cfg: Mapping[str, Any]) -> TrainerConfig:
    """Builds :class:`TrainerConfig` from a resolved recipe dict (sections NeMo-RL's; extra keys
    in them ignored; ``efa_ep`` strict; every declared key type-checked)."""
    kw = {}
    for f in dataclasses.fields(TrainerConfig):
        if f.name in cfg and cfg[f.name] is not None:
            kw[f.name] = _build(_NESTED[("TrainerConfig", f.name)], cfg[f.name],
                                strict=f.name in _STRICT, where=f.name)
    return TrainerConfig(**kw)
