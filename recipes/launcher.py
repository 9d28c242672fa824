"""``efa-ep-grpo``: run a GRPO recipe with NeMo-RL when it is importable, else the built-in trainer.

Usage::

    efa-ep-grpo --config <recipe.yaml | shipped recipe name> [key=value | +key=value ...]
    efa-ep-grpo [group=choice | key=value ...]        # no --config: compose efa_ep/conf/grpo.yaml

Overrides use NeMo-RL's rules (Hydra's override parser, struct mode): an existing key takes
``a.b=v``, a new key needs ``+a.b=v`` (e.g. ``+policy.megatron_cfg.efa_ep_transport=gda``); a
misspelled key is refused with the closest existing one.

Which trainer runs: ``efa_ep.trainer`` in the recipe (``auto`` by default): ``auto`` picks NeMo-RL
if ``import nemo_rl.algorithms.grpo`` works, else the built-in trainer; ``builtin`` / ``nemo_rl``
force one. The first log line says which one runs and why.

Exit codes: 0 done; 1 a rank failed (its first error on one line, every traceback in
``<logger.log_dir>/rank_errors.log``); 2 a setting is wrong (one line naming it, before any rank
starts); 130 interrupted (Ctrl-C: the partial run's metrics and plot are written).
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


_EPILOG = """\
overrides (after the options; NeMo-RL's rules):
  key=value              change a key the recipe has, e.g. grpo.max_num_steps=50
  +key=value             add a key it lacks, e.g. +policy.megatron_cfg.efa_ep_transport=gda
  efa_ep.transport.transport=torch|proxy|gda|auto   the efa dispatcher's transport
  efa_ep.transport.transport_options='num_channels=4,provider=tcp'   (proxy knobs)
  policy.megatron_cfg.moe_token_dispatcher_type=alltoall            A/B against Megatron's
  logger.log_dir=DIR     where metrics.jsonl, TensorBoard events and grpo_curves.png go
without --config, Hydra groups of efa_ep/conf/grpo.yaml: transport=auto|torch|gda|proxy

shipped recipes (--config NAME):
{recipes}

run time: grpo_tiny_moe_efa.yaml (200 warm-start steps + 600 GRPO steps, EP 2) takes about
3-6 minutes on a 2-core CPU machine; grpo.max_num_steps=20 is a quick look (under a minute
after start-up). The llm/ recipes need NeMo-RL and p5en nodes.

environment: EFA_EP_TRANSPORT, EFA_EP_TRANSPORT_OPTIONS, EFA_EP_MAX_TOKENS_PER_RANK apply
where the recipe's efa_ep.transport keys are auto / null / empty; all are checked before
ranks start.
exit codes: 0 done, 1 a rank failed, 2 a setting is wrong, 130 interrupted (partial plot written).
"""


def _shipped_recipes() -> str:
    from .config_loader import RECIPES_DIR

    names = sorted(str(q.relative_to(RECIPES_DIR)) for q in RECIPES_DIR.rglob("*.yaml")
                   if "nemo_rl_base" not in q.parts)
    return "\n".join(f"  {n}" for n in names)


def parse_args(argv: Optional[Sequence[str]] = None):
    parser = argparse.ArgumentParser(
        prog="efa-ep-grpo", usage="efa-ep-grpo [--config RECIPE] [options] [key=value | +key=value ...]",
        description="Run a NeMo-RL GRPO recipe: with NeMo-RL when it is importable, else with "
                    "efa-ep's built-in trainer (the tiny MoE recipe runs anywhere, CPU included).",
        epilog=_EPILOG.format(recipes=_shipped_recipes()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="recipe YAML (a path, or the name of a recipe shipped in "
                             "efa_ep/recipes); omit to compose efa_ep/conf/grpo.yaml")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    parser.add_argument("--summary-json", default=None,
                        help="also write the run summary (start/end reward and accuracy, wall "
                             "time, paths) as JSON to this file")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}; overrides are key=value / +key=value")
    return args, overrides


def load(args, overrides: List[str]) -> dict:
    from .config_loader import compose_conf, load_recipe

    if args.config:
        return load_recipe(args.config, overrides)
    return compose_conf(overrides)


def _error(msg: str, hint: str = "") -> None:
    print(f"efa-ep-grpo: error: {msg}", file=sys.stderr, flush=True)
    if hint:
        print(f"  hint: {hint}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command; returns its exit code (see the module docstring)."""
    args, overrides = parse_args(argv)
    try:
        return _main(args, overrides)
    except (ValueError, FileNotFoundError) as e:
        # ConfigError and the recipe dataclasses' checks: one line, before any rank starts.
        _error(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__,
               getattr(e, "hint", "") or "see efa-ep-grpo --help")
        return 2


def _main(args, overrides: List[str]) -> int:
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
        from efa_ep.dispatcher.settings import check_environment
        from .nemo_rl_ext import run_nemo_rl_grpo, transport_env

        # The workers run elsewhere (Ray): check the schema here, not availability.
        check_environment(transport_env(cfg), check_available=False)
        run_nemo_rl_grpo(cfg, config_path=args.config, overrides=overrides)
        return 0
    from efa_ep.distributed import RankFailure
    from .grpo.config import trainer_config
    from .grpo.trainer import check_before_start, run

    tcfg = trainer_config(cfg)
    check_before_start(tcfg)
    try:
        summary = run(cfg)
    except KeyboardInterrupt:
        return _interrupted(tcfg, time.time() - t0)
    except RankFailure as e:
        if e.failures and all(text.startswith("KeyboardInterrupt") for _, text in e.failures):
            return _interrupted(tcfg, time.time() - t0)
        return _rank_failed(e, tcfg)
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


ERROR_LOG_NAME = "rank_errors.log"


def _rank_failed(e, tcfg) -> int:
    """One line: the first failing rank's error; every rank's traceback goes to a file. What
    the ranks logged before is kept, and plotted."""
    log_dir = tcfg.logger.log_dir
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, ERROR_LOG_NAME)
    with open(path, "w") as f:
        f.write(str(e) + "\n")
    failures = e.failures or [(-1, str(e))]
    step = _last_step(tcfg)
    at = f" at step {step} of {tcfg.grpo.max_num_steps}" if step else ""
    if all("did not report within" in t for _, t in failures):
        _error(f"the run did not finish within efa_ep.timeout_s={tcfg.efa_ep.timeout_s:g}s "
               f"(ranks stopped{at})",
               f"a busy machine runs slower: raise efa_ep.timeout_s; logs: {path}")
        _plot_partial(tcfg)
        return 1
    # A rank that raised explains more than one that only died or timed out after it.
    reported = [(r, t) for r, t in failures if "without reporting" not in t and "did not report" not in t]
    rank, text = (reported or failures)[0]
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), text)
    others = len(failures) - 1
    _error(f"rank {rank} failed{at}: {first}" + (f" ({others} other rank(s) failed after it)" if others else ""),
           f"full tracebacks of every rank: {path}")
    _plot_partial(tcfg)
    return 1


def _last_step(tcfg) -> int:
    from .grpo.metrics import JSONL_NAME, read_jsonl

    jsonl = os.path.join(tcfg.logger.log_dir, JSONL_NAME)
    rows = read_jsonl(jsonl) if os.path.exists(jsonl) else []
    return max((r["step"] for r in rows if "train/reward" in r), default=0)


def _plot_partial(tcfg) -> None:
    from .grpo.metrics import JSONL_NAME, plot_curves

    jsonl = os.path.join(tcfg.logger.log_dir, JSONL_NAME)
    if _last_step(tcfg) and tcfg.logger.plot:
        png = plot_curves(jsonl)
        _log(f"partial run: metrics {jsonl}" + (f"; curves {png}" if png else ""))


def _interrupted(tcfg, wall_s: float) -> int:
    """Ctrl-C: say where the run stopped, plot what it logged, exit 130 (128 + SIGINT)."""
    step = _last_step(tcfg)
    total = tcfg.grpo.max_num_steps
    if step:
        where = f"interrupted at step {step} of {total} after {wall_s:.0f}s"
    else:
        where = f"interrupted before the first GRPO step (of {total}) after {wall_s:.0f}s"
    print(f"{LOG_PREFIX} {where}", file=sys.stderr, flush=True)
    _plot_partial(tcfg)
    return 130


if __name__ == "__main__":
    sys.exit(main())
