"""Loading the tools' Hydra configs from ``efa_ep.conf`` (checkout or install alike), and the
check that every ``key=value`` override names a key that exists.

``conf/`` is the package ``efa_ep.conf``; its subfolders (``loss_match/``, ``bench/``) hold
YAML files. The config directory is found from the imported package's location, so the same
code works from a source checkout (``efa_ep`` maps the top-level folders) and from a wheel.

Hydra's own answer to a misspelled key (``grpo.max_num_stepz=3``) is "To append to your config
use +grpo.max_num_stepz=3", which adds a key nothing reads; :func:`check_override_keys` answers
"did you mean grpo.max_num_steps" instead, before Hydra sees the override. A misspelled preset
(``model=qwen3_30b``) is answered by :func:`check_group_choices` with the presets there are.

Values are checked too: :data:`SETTINGS` says, per tool, what each key must hold (``starts`` an
integer >= 1, ``warmup`` >= 0, ...), and :func:`compose` refuses a meaningless value in one line
naming the key, the value and what is expected (:func:`check_settings`), before any rank starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

from efa_ep.kernels.options import ConfigError, Option, did_you_mean


def config_dir(group: str) -> str:
    """Absolute path of ``efa_ep/conf/<group>``."""
    import efa_ep.conf

    path = os.path.join(os.path.dirname(os.path.abspath(efa_ep.conf.__file__)), group)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"config folder {path} is missing (expected the packaged "
                                f"efa_ep.conf/{group}/*.yaml)")
    return path


def config_names(group: str) -> List[str]:
    """The config names of ``efa_ep/conf/<group>`` (``cpu``, ``ci``, ...), for help texts."""
    return sorted(f[:-5] for f in os.listdir(config_dir(group)) if f.endswith(".yaml"))


def config_groups(group: str) -> Dict[str, List[str]]:
    """The config groups of ``efa_ep/conf/<group>`` (its subfolders holding YAML files) and the
    choices of each: ``{"model": ["deepseek_v3", ...], "fabric": [...]}`` for ``plan``."""
    root = config_dir(group)
    out = {}
    for sub in sorted(os.listdir(root)):
        path = os.path.join(root, sub)
        if os.path.isdir(path):
            names = sorted(f[:-5] for f in os.listdir(path) if f.endswith(".yaml"))
            if names:
                out[sub] = names
    return out


def _dotted_keys(cfg: Mapping[str, Any], prefix: str = "") -> List[str]:
    out = []
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        out.append(key)
        if isinstance(v, Mapping):
            out.extend(_dotted_keys(v, key + "."))
    return out


def _has_key(cfg: Mapping[str, Any], dotted: str) -> bool:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def suggest_key(cfg: Mapping[str, Any], dotted: str) -> str:
    """The existing key closest to ``dotted``: a sibling when its section exists (a long shared
    prefix would make any key of the section look close), else any key, or ``""``."""
    parent, _, leaf = dotted.rpartition(".")
    if not parent or _has_key(cfg, parent):
        node: Any = cfg
        for part in filter(None, parent.split(".")):
            node = node[part]
        if not isinstance(node, Mapping):
            return ""
        close = difflib.get_close_matches(leaf, [str(k) for k in node], n=1, cutoff=0.8)
        return (f"{parent}.{close[0]}" if parent else close[0]) if close else ""
    close = difflib.get_close_matches(dotted, _dotted_keys(cfg), n=1, cutoff=0.8)
    return close[0] if close else ""


def check_override_keys(cfg: Mapping[str, Any], overrides: Sequence[str],
                        groups: Iterable[str] = (), where: str = "override",
                        keys_hint: str = "see --print-config for the keys there are") -> None:
    """Raises ConfigError for a ``key=value`` override whose key is not in ``cfg``.

    ``+key=value`` (add), ``++key=value`` (force) and ``~key`` (delete) are left to Hydra, and so
    are group choices (``transport=gda``) for the names in ``groups``. ``keys_hint`` is the hint
    when no key is close (where the keys can be read).
    """
    parsed = _parse_overrides(overrides, where)
    groups = set(groups)
    for o in parsed:
        if o.is_add() or o.is_force_add() or o.is_delete():
            continue
        key = o.key_or_group
        if key in groups or _has_key(cfg, key):
            continue
        near = suggest_key(cfg, key)
        if near:
            raise ConfigError(f"{where} {o.input_line}: no key {key!r}; did you mean {near!r}?",
                              hint=f"write {near}={o.input_line.split('=', 1)[-1]}; a new key would "
                                   f"be +{o.input_line} (nothing reads it unless code does)")
        raise ConfigError(f"{where} {o.input_line}: no key {key!r} in the config; a new key needs "
                          f"+{o.input_line}", hint=keys_hint)


def _parse_overrides(overrides: Sequence[str], where: str = "override") -> list:
    """Hydra's parsed overrides, or ConfigError (Hydra's grammar error, first line only)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides=list(overrides))
    except Exception as e:
        raise ConfigError(f"{where}: cannot parse {list(overrides)}: {str(e).splitlines()[0]}",
                          hint="overrides look like key=value, +new.key=value or ~key; quote a value "
                               "holding '=' or ',': key='a=1,b=2'") from None


def check_group_choices(group: str, overrides: Sequence[str], where: str = "command line") -> None:
    """Raises ConfigError, one line listing the choices (and the closest one), for an override
    that picks a preset a config group does not have (``model=qwen3_30b`` in ``plan``); Hydra's
    own answer is a multi-line "Could not find 'model/qwen3_30b'"."""
    groups = config_groups(group)
    if not groups:
        return
    for o in _parse_overrides(overrides, where):
        if o.is_delete() or o.key_or_group not in groups:
            continue
        value, names = o.value(), groups[o.key_or_group]
        if isinstance(value, str) and value not in names:
            raise ConfigError(f"{where}: {o.key_or_group}={value!r} is not one of {', '.join(names)}"
                              f"{did_you_mean(value, names)}")


# ----------------------------------------------------------------------------------------------
# The values each tool's config keys must hold
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setting(Option):
    """One key of a tool's config: an :class:`~efa_ep.kernels.options.Option` (type, choices,
    inclusive ``min``/``max``) whose ``key`` is dotted and may name every entry of a section
    (``profiles.*.tokens_per_rank``) or every item of a list (``token_sweep[]``).

    Attributes (besides Option's):
        above, below: exclusive bounds (``gemm_efficiency`` in (0, 1]), or None.
        nullable: null is a valid value (the config's "automatic" / "not checked").
    """

    above: Optional[float] = None
    below: Optional[float] = None
    nullable: bool = False

    def expected(self) -> str:
        """What a valid value is, in words: ``an integer >= 1``, ``a number in (0, 1]``."""
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        what = {int: "an integer", float: "a number", str: "a string"}[self.type]
        lo = (f"({_num(self.above)}" if self.above is not None else
              f"[{_num(self.min)}" if self.min is not None else None)
        hi = (f"{_num(self.below)})" if self.below is not None else
              f"{_num(self.max)}]" if self.max is not None else None)
        if lo and hi:
            what += f" in {lo}, {hi}"
        elif lo:
            what += (" > " if lo[0] == "(" else " >= ") + lo[1:]
        elif hi:
            what += (" < " if hi[-1] == ")" else " <= ") + hi[:-1]
        return what + (" or null" if self.nullable else "")

    def convert(self, value: Any, where: str) -> Any:
        """``value`` converted and checked, or ConfigError: ``<where>: <key>=<value> must be
        <expected>`` with the key's doc as the hint."""
        if value is None and self.nullable:
            return None
        try:
            out = super().convert(value, where)
        except ConfigError as e:  # Option's wording of the bounds, in this setting's terms
            if self.choices is not None:
                raise ConfigError(str(e), hint=self._hint()) from None
            raise ConfigError(f"{where}: {self.key}={value!r} must be {self.expected()}",
                              hint=self._hint()) from None
        if (self.above is not None and out <= self.above) or (self.below is not None and out >= self.below):
            raise ConfigError(f"{where}: {self.key}={value!r} must be {self.expected()}",
                              hint=self._hint())
        return out

    def _hint(self) -> str:
        return f"{self.key.split('[', 1)[0]}: {self.doc}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _s(key: str, type_: type, doc: str, **kw) -> Setting:
    return Setting(key, type_, None, doc, **kw)


def _entries(node: Any, parts: Sequence[str], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """``(concrete key, value)`` of every entry a setting's key names in ``node``; absent keys
    give none (whether a key exists is :func:`check_override_keys`' business)."""
    if not parts:
        yield prefix, node
        return
    head, rest = parts[0], parts[1:]
    each = head.endswith("[]")
    name = head[:-2] if each else head
    if not isinstance(node, Mapping):
        return
    if name == "*":
        for k, v in node.items():
            yield from _entries(v, rest, f"{prefix}.{k}" if prefix else str(k))
        return
    if name not in node:
        return
    key, value = (f"{prefix}.{name}" if prefix else name), node[name]
    if not each:
        yield from _entries(value, rest, key)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _entries(item, rest, f"{key}[{i}]")


def check_settings(cfg: Mapping[str, Any], settings: Iterable[Setting],
                   where: Union[str, Callable[[str], str]] = "config") -> None:
    """Raises ConfigError for the first value of ``cfg`` that ``settings`` refuse: one line
    ``<where>: <key>=<value> must be <expected>``, the key's doc as the hint. ``where`` is a
    string or a function of the concrete key (say whether the command line or a file set it)."""
    for s in settings:
        for key, value in _entries(cfg, s.key.split(".")):
            dataclasses.replace(s, key=key).convert(value, where(key) if callable(where) else where)


_POS = {"min": 1}           # a count: an integer >= 1
_SECONDS = {"above": 0}     # a deadline: > 0 seconds

# Per config group (``efa_ep/conf/<group>``): what each key must hold. Checks that need several
# keys at once live with the tool (``bench.validate_config``, ``loss_match.validate_config``, the
# planner's ``Inputs``).
SETTINGS: Dict[str, Tuple[Setting, ...]] = {
    "bench": (
        _s("ep_size", int, "ranks launched (= EP size)", **_POS),
        _s("node_size", int, "emulated ranks per node; null: ranks per host", nullable=True, **_POS),
        _s("backend", str, "process group backend", choices=("gloo", "nccl")),
        _s("ranks_per_gpu", int, "ranks sharing a GPU when it cannot be measured; null: measured",
           nullable=True, **_POS),
        _s("num_threads", int, "torch threads per rank", **_POS),
        _s("dtype", str, "dtype of the transport view's rows", choices=("bf16", "fp32", "fp16")),
        _s("profiles.*.tokens_per_rank", int, "tokens each rank dispatches in this profile", **_POS),
        _s("shapes.*.hidden", int, "hidden size of this shape", **_POS),
        _s("shapes.*.num_experts", int, "experts of this shape", **_POS),
        _s("shapes.*.topk", int, "experts per token of this shape", **_POS),
        _s("routes[]", str, "routes of the transport view", choices=("balanced", "skewed", "uniform")),
        _s("skew", float, "Zipf exponent of the skewed route (0: every expert equally likely)", min=0),
        _s("arms.proxy_channels[]", int, "num_channels of a proxy arm", min=1, max=64),
        _s("layer.hidden", int, "hidden size of the layer view", **_POS),
        _s("layer.ffn_hidden_size", int, "expert FFN width of the layer view", **_POS),
        _s("layer.num_experts", int, "experts of the layer view", **_POS),
        _s("layer.topk", int, "experts per token of the layer view", **_POS),
        _s("layer.tokens_per_rank", int, "tokens per rank of the layer view", **_POS),
        _s("layer.micro_batch", int, "sequences per rank the layer's tokens are split into", **_POS),
        _s("layer.capacity_factor", float, "pad: moe_expert_capacity_factor", above=0),
        _s("layer.shared_expert_intermediate_size", int, "shared expert width; null: ffn_hidden_size",
           nullable=True, **_POS),
        _s("layer.dtype", str, "dtype of the layer view", choices=("bf16", "fp32", "fp16")),
        _s("starts", int, "independent launches per cell (>= 20 for a meaningful interval)", **_POS),
        _s("steady_iters", int, "back-to-back iterations per steady-state sample", **_POS),
        _s("warmup", int, "excluded samples per cell and start (0: none)", min=0),
        _s("iters", int, "measured samples per cell and start", **_POS),
        _s("alpha", float, "1 - confidence of the median's interval", above=0, below=1),
        _s("min_n_for_ci", int, "fewest starts for a bootstrap interval (else min/median/max)", **_POS),
        _s("start_timeout_s", float, "deadline of one start, seconds", **_SECONDS),
        _s("pg_timeout_s", float, "process group timeout, seconds", **_SECONDS),
    ),
    "loss_match": (
        *(_s(f"model.{k}", int, f"the tiny GPT-MoE's {k} (efa_ep.tiny_moe.TinyMoEConfig)", **_POS) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
            "moe_ffn_hidden_size", "num_moe_experts", "moe_router_topk", "vocab_size",
            "seq_length")),
        _s("model.dtype", str, "parameter and activation dtype", choices=("fp32", "bf16")),
        _s("model.init_std", float, "std of the seeded initial weights", above=0),
        _s("data.branching", int, "successors per token of the Markov corpus", **_POS),
        _s("ep_size", int, "expert-parallel size of the EP arms (= ranks launched)", **_POS),
        _s("steps", int, "optimizer steps per arm", **_POS),
        _s("global_batch", int, "sequences per step over all ranks (a multiple of ep_size)", **_POS),
        _s("optimizer.lr", float, "Adam learning rate", above=0),
        _s("optimizer.betas[]", float, "Adam betas", min=0, below=1),
        _s("optimizer.eps", float, "Adam eps", min=0),
        _s("optimizer.weight_decay", float, "Adam weight decay", min=0),
        _s("backend", str, "process group backend", choices=("gloo", "nccl")),
        _s("num_threads", int, "torch threads per rank", **_POS),
        _s("timeout_s", float, "deadline of one launch, seconds", **_SECONDS),
        _s("pg_timeout_s", float, "process group timeout, seconds", **_SECONDS),
        *(_s(k, float, "tolerance on max |d loss| (null: not checked)", min=0, nullable=True) for k in (
            "tolerance.max_rel_dloss", "tolerance.max_abs_dloss",
            "tolerance.per_baseline.*.max_rel_dloss", "tolerance.per_baseline.*.max_abs_dloss")),
    ),
    "plan": (
        _s("nodes", int, "nodes of the job", **_POS),
        _s("gpus_per_node", int, "GPUs per node", **_POS),
        _s("ep", int, "expert-parallel size (ranks per EP group)", **_POS),
        _s("tp", int, "tensor-parallel size", **_POS),
        _s("tokens_per_rank", int, "tokens per rank per micro-batch; null: seq_length x micro_batch / tp",
           nullable=True, **_POS),
        _s("micro_batches_per_step", int, "micro-batches per rank per optimizer step", **_POS),
        _s("gemm_efficiency", float, "fraction of the GPU's bf16 peak the expert GEMMs reach",
           above=0, max=1),
        _s("max_channels", int, "proxy channels K tried: 1..max_channels", min=1, max=64),
        _s("chunk_bytes", int, "proxy bytes per descriptor", min=16, max=(1 << 32) - 1),
        _s("proxy_same_node", str, "how same-node rows travel", choices=("channels", "nvlink")),
        _s("max_tokens_per_rank", int, "window sizing; null: tokens_per_rank", nullable=True, **_POS),
        _s("memory_budget", float, "fraction of HBM the experts' weights + grads + optimizer may take",
           above=0, max=1),
        _s("win_margin", float, "efa wins only if its D+C <= win_margin x the best Megatron path",
           above=0),
        _s("token_sweep[]", int, "tokens per rank on the plot's x axis", **_POS),
        *(_s(f"model.{k}", int, doc, **_POS) for k, doc in (
            ("hidden", "hidden size"), ("num_experts", "routed experts per MoE layer"),
            ("topk", "experts per token"), ("moe_layers", "MoE layers"),
            ("moe_ffn_hidden", "per-expert FFN width"), ("seq_length", "tokens per sequence"),
            ("micro_batch", "sequences per micro-batch"))),
        *(_s(f"fabric.{k}", float, doc, above=0) for k, doc in (
            ("hbm_gb", "GB of HBM per GPU"), ("nvlink_gbps", "NVLink GB/s per GPU per direction"),
            ("efa_nics", "EFA NICs per node"), ("efa_gbps_per_nic", "GB/s per EFA NIC"),
            ("gpu_tflops_bf16", "dense bf16 TFLOPS per GPU"))),
    ),
}


def hydra_error(e: Exception, overrides: Sequence[str]) -> ConfigError:
    """Hydra's multi-line composition error as one line plus a hint (the options it lists)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else type(e).__name__
    listed = []
    if any(ln.startswith("Available options") for ln in lines):
        i = next(i for i, ln in enumerate(lines) if ln.startswith("Available options"))
        for ln in lines[i + 1:]:
            if ln.startswith("Config search path"):
                break
            listed.append(ln)
    hint = f"available: {', '.join(listed)}" if listed else "see --help for the config groups"
    return ConfigError(f"overrides {list(overrides)}: {first}", hint=hint)


def compose(group: str, config_name: str, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Composes ``conf/<group>/<config_name>.yaml`` with Hydra override strings
    (``steps=20``, ``arms.candidates=[alltoall]``) and returns a plain resolved dict.

    Raises:
        ConfigError: an unknown config name, an override of a key that does not exist or of a
            preset a group does not have, or a value :data:`SETTINGS` refuses.
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    names = config_names(group)
    if config_name not in names:
        raise ConfigError(f"config {config_name!r} is not in efa_ep/conf/{group}"
                          f"{did_you_mean(config_name, names)}", hint=f"configs: {', '.join(names)}")
    check_group_choices(group, overrides)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(group), version_base="1.3"):
        if overrides:
            base = OmegaConf.to_container(hydra_compose(config_name=config_name), resolve=False)
            check_override_keys(base, overrides,
                                keys_hint=f"the keys are in efa_ep/conf/{group}/{config_name}.yaml "
                                          f"and the configs its defaults include")
        try:
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        except Exception as e:
            raise hydra_error(e, overrides) from e
    out = OmegaConf.to_container(cfg, resolve=True)
    given = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]

    def where(key: str) -> str:
        bare = key.split("[", 1)[0]
        return ("command line" if any(bare == g or bare.startswith(g + ".") for g in given)
                else f"config {config_name}")

    check_settings(out, SETTINGS.get(group, ()), where)
    return out


# ----------------------------------------------------------------------------------------------
# The EFA_EP_* settings table of the docs (declared in efa_ep.kernels.core.variables.VARIABLES)
# ----------------------------------------------------------------------------------------------
TABLE_START = "<!-- settings-table:start -->"
TABLE_END = "<!-- settings-table:end -->"
#: files (relative to the checkout) holding the generated table between the two markers
TABLE_FILES = ("README.md", "docs/cluster.md")
_TABLE_NOTE = ("<!-- generated from efa_ep.kernels.core.variables.VARIABLES; refresh with "
               "python3 -m efa_ep.tools.config --settings-table --write -->")


def settings_table() -> str:
    """The marked region's content: a note saying where it comes from, then the table."""
    from efa_ep.dispatcher.settings import markdown_table

    return f"{_TABLE_NOTE}\n{markdown_table()}"


def with_settings_table(text: str, where: str = "text") -> str:
    """``text`` with the region between :data:`TABLE_START` and :data:`TABLE_END` replaced by
    :func:`settings_table`; ValueError naming ``where`` when the markers are missing."""
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"{where}: no {TABLE_START} ... {TABLE_END} region")
    head = text[:start + len(TABLE_START)]
    return f"{head}\n{settings_table()}{text[end:]}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python3 -m efa_ep.tools.config --settings-table [--write]``: prints the settings table,
    or rewrites it in :data:`TABLE_FILES` of this checkout."""
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m efa_ep.tools.config",
                                description="The EFA_EP_* settings table, from their declarations.")
    p.add_argument("--settings-table", action="store_true", required=True,
                   help="print the Markdown table of every EFA_EP_* variable")
    p.add_argument("--write", action="store_true",
                   help=f"rewrite the marked region of {', '.join(TABLE_FILES)} instead")
    a = p.parse_args(argv)
    if not a.write:
        print(settings_table(), end="")
        return 0
    from .provenance import repo_root

    for rel in TABLE_FILES:
        path = os.path.join(repo_root(), rel)
        with open(path) as f:
            text = f.read()
        new = with_settings_table(text, rel)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            print(f"updated {rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
