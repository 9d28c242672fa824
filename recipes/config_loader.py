"""Loads a recipe the way NeMo-RL's ``nemo_rl/utils/config.py`` does, without NeMo-RL.

- ``defaults:`` (a path or a list of paths, relative to the file) loads parents recursively and
  merges them with ``OmegaConf.merge``, later entries winning; a section with ``_override_: true``
  replaces the parent's section instead of merging.
- Resolvers ``${mul:a,b}``, ``add``, ``div``, ``max``.
- Overrides go through Hydra's ``OverridesParser`` in struct mode: ``a.b=v`` for an existing key,
  ``+a.b=v`` to add one, ``++a.b=v`` to force, ``~a.b`` to delete.

Behaviour matches NeMo-RL at commit 7ea279ab, so a recipe that loads here loads there.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from efa_ep.kernels.options import ConfigError

RECIPES_DIR = Path(__file__).resolve().parent


def register_resolvers() -> None:
    for name, fn in (("add", lambda a, b: a + b), ("mul", lambda a, b: a * b),
                     ("div", lambda a, b: a / b), ("max", lambda a, b: max(a, b))):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _merge_with_override(base: DictConfig, child: DictConfig) -> DictConfig:
    for key in list(child.keys()):
        if OmegaConf.is_missing(child, key):
            continue
        if isinstance(child[key], DictConfig) and child[key].get("_override_", False):
            child[key].pop("_override_")
            if key in base:
                base.pop(key)
    return OmegaConf.merge(base, child)


def load_config(path: Union[str, Path], base_dir: Optional[Path] = None) -> DictConfig:
    """The recipe at ``path`` with its ``defaults`` chain merged (not yet resolved)."""
    path = Path(path)
    base_dir = Path(base_dir) if base_dir is not None else path.parent
    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        raise ValueError(f"{path}: a recipe must be a mapping, got {type(cfg).__name__}")
    if "defaults" in cfg:
        defaults = cfg.pop("defaults")
        if isinstance(defaults, (str, Path)):
            defaults = [defaults]
        elif isinstance(defaults, ListConfig):
            defaults = [str(d) for d in defaults]
        base = OmegaConf.create({})
        for d in defaults:
            parent = Path(d) if str(d).startswith("/") else base_dir / str(d)
            base = _merge_with_override(base, load_config(parent, parent.parent))
        cfg = _merge_with_override(base, cfg)
    return cfg


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Hydra override strings applied in struct mode (new keys need ``+``)."""
    if not overrides:
        return cfg
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from efa_ep.tools.config import check_override_keys

    # A misspelled key gets "did you mean", not Hydra's advice to add it with "+".
    check_override_keys(OmegaConf.to_container(cfg, resolve=False), overrides)
    OmegaConf.set_struct(cfg, True)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
        ConfigLoaderImpl._apply_overrides_to_config(overrides=parsed, cfg=cfg)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"could not apply overrides {list(overrides)}: {first}",
                          hint="an existing key takes a.b=v, a new one +a.b=v") from e
    finally:
        OmegaConf.set_struct(cfg, False)
    return cfg


def find_recipe(name: Union[str, Path]) -> Path:
    """A path as given if it exists, else a recipe shipped in this package (``name`` with or
    without ``.yaml``, searched under ``recipes/`` and ``recipes/llm/``)."""
    p = Path(name)
    if p.is_file():
        return p
    stem = p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml"
    for cand in (RECIPES_DIR / stem, RECIPES_DIR / "llm" / stem):
        if cand.is_file():
            return cand
    shipped = sorted(str(q.relative_to(RECIPES_DIR)) for q in RECIPES_DIR.rglob("*.yaml")
                     if "nemo_rl_base" not in q.parts)
    from efa_ep.kernels.options import did_you_mean

    raise ConfigError(f"--config {str(name)!r}: no such file, and no shipped recipe of that name"
                      f"{did_you_mean(stem, [Path(q).name for q in shipped])}",
                      hint=f"shipped recipes: {', '.join(shipped)}")


def load_recipe(path: Union[str, Path], overrides: Sequence[str] = (), resolve: bool = True):
    """``load_config`` + overrides (+ ``to_container(resolve=True)`` when ``resolve``)."""
    register_resolvers()
    cfg = apply_overrides(load_config(find_recipe(path)), overrides)
    return OmegaConf.to_container(cfg, resolve=True) if resolve else cfg


def compose_conf(overrides: Sequence[str] = (), config_name: str = "grpo") -> dict:
    """Our own Hydra config tree (``efa_ep/conf``: groups model, transport, grpo) composed with
    ``overrides`` (group choices like ``transport=gda`` and key overrides)."""
    from hydra import compose, initialize_config_dir

    register_resolvers()
    conf_dir = str(RECIPES_DIR.parent / "conf") if (RECIPES_DIR.parent / "conf").is_dir() else None
    if conf_dir is None:
        import efa_ep.conf

        conf_dir = os.path.dirname(efa_ep.conf.__file__)
    with initialize_config_dir(config_dir=os.path.abspath(conf_dir), version_base=None):
        if overrides:
            from efa_ep.tools.config import check_override_keys

            base = OmegaConf.to_container(compose(config_name=config_name), resolve=False)
            groups = [d for d in os.listdir(conf_dir) if os.path.isdir(os.path.join(conf_dir, d))]
            check_override_keys(base, overrides, groups=groups)
        try:
            cfg = compose(config_name=config_name, overrides=list(overrides))
        except Exception as e:
            from efa_ep.tools.config import hydra_error

            raise hydra_error(e, overrides) from e
    return OmegaConf.to_container(cfg, resolve=True)
