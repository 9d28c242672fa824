"""``efa-ep-grpo``: run a GRPO recipe with NeMo-RL when it is importable, else the built-in trainer.

Usage::

    efa-ep-grpo --config <recipe.yaml | shipped recipe name> [key=value | +key=value ...]
    efa-ep-grpo [group=choice | key=value ...]        # no --config: compose efa_ep/conf/grpo.yaml

Overrides use NeMo-RL's rules (Hydra's override parser, struct mode): an existing key takes
``a.b=v``, a new key needs ``+a.b=v`` (e.g. ``+policy.megatron_cfg.efa_ep_transport=gda``).

Which trainer runs: ``efa_ep.trainer`` in the recipe (``auto`` by default): ``auto`` picks NeMo-RL
if ``import nemo_rl.algorithms.grpo`` works, else the built-in trainer; ``builtin`` / ``nemo_rl``
force one. The first log line says which one runs and why.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

LOG_PREFIX = "[efa-ep grpo]"


def _log(msg: str) -> None:
    print(f"{LOG_PREFIX} {msg}", flush=True)


def nemo_rl_available() -> Tuple[bool, str]:
    """``(True, version)`` if NeMo-RL's GRPO can be imported, else ``(False, reason)``."""
    try:
        import nemo_rl  # noqa: F401
        from nemo_rl.algorithms import grpo  # noqa: F401
    except Exception as e:  # the PyPI placeholder has no nemo_rl.algorithms
        return False, f"{type(e).__name__}: {e}"
    return True, getattr(sys.modules["nemo_rl"], "__version__", "unknown version")


def choose_trainer(cfg: dict) -> Tuple[str, str]:
    """``("nemo_rl" | "builtin", why)`` for a resolved recipe."""
    want = (cfg.get("efa_ep") or {}).get("trainer", "auto")
    if want == "builtin":
        return "builtin", "efa_ep.trainer=builtin"
    ok, info = nemo_rl_available()
    if want == "nemo_rl":
        if not ok:
            raise RuntimeError(f"efa_ep.trainer=nemo_rl but NeMo-RL is not importable ({info}); "
                               f"install it from git (PyPI 'nemo-rl' is a placeholder) or set "
                               f"efa_ep.trainer=builtin")
        return "nemo_rl", f"efa_ep.trainer=nemo_rl, NeMo-RL {info}"
    if want != "auto":
        raise ValueError(f"efa_ep.trainer={want!r}: expected auto, builtin or nemo_rl")
    if ok:
        return "nemo_rl", f"NeMo-RL {info} is importable"
    return "builtin", f"NeMo-RL is not importable ({info})"


def parse_args(argv: Optional[Sequence[str]] = None):
    parser = argparse.ArgumentParser(
        prog="efa-ep-grpo", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="recipe YAML (a path, or the name of a recipe shipped in "
                             "efa_ep/recipes); omit to compose efa_ep/conf/grpo.yaml")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    parser.add_argument("--summary-json", default=None,
                        help="write the run summary (start/end reward, wall time) here")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}; overrides are key=value / +key=value")
    return args, overrides


def load(args, overrides: List[str]) -> dict:
    from efa_ep.recipes.config_loader import compose_conf, load_recipe

    if args.config:
        return load_recipe(args.config, overrides)
    return compose_conf(overrides)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, overrides = parse_args(argv)
    t0 = time.time()
    cfg = load(args, overrides)
    trainer, why = choose_trainer(cfg)
    if trainer == "nemo_rl":
        _log(f"trainer: NeMo-RL GRPO with the efa-ep Megatron policy-worker extension ({why})")
    else:
        _log(f"trainer: built-in GRPO trainer (NeMo-RL's algorithm and config names), not NeMo-RL: {why}")
    _log(f"config: {args.config or 'efa_ep/conf/grpo.yaml (Hydra compose)'}"
         + (f"; overrides: {' '.join(overrides)}" if overrides else ""))
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg, sort_keys=False))
        return 0
    if trainer == "nemo_rl":
        from efa_ep.recipes.nemo_rl_ext import run_nemo_rl_grpo

        run_nemo_rl_grpo(cfg, config_path=args.config, overrides=overrides)
        return 0
    from efa_ep.recipes.grpo.trainer import run

    summary = run(cfg)
    summary["launcher_wall_s"] = time.time() - t0
    _log(f"done in {summary['launcher_wall_s']:.1f}s ({summary['steps']} GRPO steps, "
         f"{summary['grpo_wall_s']:.1f}s in the GRPO loop)")
    _log(f"train/reward: first {summary['reward_first']:.3f}; mean of first "
         f"{summary['reward_window']} steps {summary['reward_start']:.3f} -> mean of last "
         f"{summary['reward_window']} steps {summary['reward_end']:.3f}")
    if summary.get("val_accuracy_start") is not None:
        _log(f"validation/accuracy (greedy): {summary['val_accuracy_start']:.3f} -> "
             f"{summary['val_accuracy_end']:.3f}")
    _log(f"metrics: {summary['metrics_jsonl']}" + (f"; curves: {summary['png']}" if summary.get("png") else ""))
    if args.summary_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary_json)), exist_ok=True)
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
