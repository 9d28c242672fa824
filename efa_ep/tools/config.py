"""Loading the tools' Hydra configs from ``efa_ep.conf`` (checkout or install alike), and the
check that every ``key=value`` override names a key that exists.

``conf/`` is the package ``efa_ep.conf``; its subfolders (``loss_match/``, ``bench/``) hold
YAML files. The config directory is found from the imported package's location, so the same
code works from a source checkout (``efa_ep`` maps the top-level folders) and from a wheel.

Hydra's own answer to a misspelled key (``grpo.max_num_stepz=3``) is "To append to your config
use +grpo.max_num_stepz=3", which adds a key nothing reads; :func:`check_override_keys` answers
"did you mean grpo.max_num_steps" instead, before Hydra sees the override.
"""
from __future__ import annotations

import difflib
import os
from typing import Any, Dict, Iterable, List, Mapping, Sequence

from efa_ep.kernels.options import ConfigError


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
                        groups: Iterable[str] = (), where: str = "override") -> None:
    """Raises ConfigError for a ``key=value`` override whose key is not in ``cfg``.

    ``+key=value`` (add), ``++key=value`` (force) and ``~key`` (delete) are left to Hydra, and so
    are group choices (``transport=gda``) for the names in ``groups``.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except Exception as e:  # Hydra's grammar error, first line only
        raise ConfigError(f"{where}: cannot parse {list(overrides)}: {str(e).splitlines()[0]}",
                          hint="overrides look like key=value, +new.key=value or ~key; quote a value "
                               "holding '=' or ',': key='a=1,b=2'") from None
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
                          f"+{o.input_line}", hint="see --print-config for the keys there are")


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
        ConfigError: an unknown config name, or an override of a key that does not exist.
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    names = config_names(group)
    if config_name not in names:
        from efa_ep.kernels.options import did_you_mean

        raise ConfigError(f"config {config_name!r} is not in efa_ep/conf/{group}"
                          f"{did_you_mean(config_name, names)}", hint=f"configs: {', '.join(names)}")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(group), version_base="1.3"):
        if overrides:
            base = OmegaConf.to_container(hydra_compose(config_name=config_name), resolve=False)
            check_override_keys(base, overrides)
        try:
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        except Exception as e:
            raise hydra_error(e, overrides) from e
    return OmegaConf.to_container(cfg, resolve=True)
