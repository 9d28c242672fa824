"""Loading the tools' Hydra configs from ``efa_ep.conf`` (checkout or install alike).

``conf/`` is the package ``efa_ep.conf``; its subfolders (``loss_match/``, ``bench/``) hold
YAML files. The config directory is found from the imported package's location, so the same
code works from a source checkout (``efa_ep`` maps the top-level folders) and from a wheel.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Sequence


def config_dir(group: str) -> str:
    """Absolute path of ``efa_ep/conf/<group>``."""
    import efa_ep.conf

    path = os.path.join(os.path.dirname(os.path.abspath(efa_ep.conf.__file__)), group)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"config folder {path} is missing (expected the packaged "
                                f"efa_ep.conf/{group}/*.yaml)")
    return path


def compose(group: str, config_name: str, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Composes ``conf/<group>/<config_name>.yaml`` with Hydra override strings
    (``steps=20``, ``arms.candidates=[alltoall]``) and returns a plain resolved dict."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(group), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)
