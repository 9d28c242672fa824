"""``efa-ep-grpo``: run a GRPO recipe with NeMo-RL when it is importable, else the built-in trainer.

Usage::

    efa-ep-grpo --config <recipe.yaml | shipped recipe name> [key=value | +key=value ...]
    efa-ep-grpo [group=choice | key=value ...]        # no --config: compose efa_ep/conf/grpo.yaml

Overrides use NeMo-RL's rules (Hydra's override parser, struct mode): an existing key takes
``a.b=v``, a new key needs ``+a.b=v`` (e.g. ``+policy.megatron_cfg.efa_ep_transport=gda``); a
misspelled key is refused with the closest existing one.

Which trainer runs: ``efa_ep.trainer`` in the recipe (``auto`` by default): ``auto`` picks NeMo-RL
if ``import nemo_rl.algorithms.grpo`` works, else the built-in trainer; ``builtin`` / ``nemo_rl``
force one. The first log line says that Ctrl-C is handled, the next one which trainer runs and
why.

Built-in trainer: every run writes into its own directory ``<logger.log_dir>/<UTC start
time>/`` (metrics.jsonl, tensorboard/, grpo_curves.png, summary.json; rank_errors.log if a rank
failed), and ``<logger.log_dir>/latest`` links to it; the recipe's ``logger.log_dir`` is
``runs/<recipe>``. The last line of a finished run is its verdict
(:mod:`efa_ep.recipes.grpo.verdict`): ``verdict: PASS - <what was checked>`` or
``verdict: FAIL - <why>``.

Exit codes: 0 done, verdict PASS; 1 the run failed: a rank failed (its first error on one line,
every traceback in ``<run directory>/rank_errors.log``) or the verdict is FAIL; 2 a setting is
wrong (one line naming it, before any rank starts: every key's type included); 130 interrupted
(Ctrl-C at any moment once the launcher has said it handles it: one ``interrupted ...`` line;
the partial run's metrics and plot are written).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import threading
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
                         (NeMo-RL; the built-in trainer refuses keys it does not read)
  efa_ep.transport.transport=torch|proxy|gda|auto   the efa dispatcher's transport
  efa_ep.transport.transport_options='num_channels=4,provider=tcp'   (proxy knobs)
  policy.megatron_cfg.moe_token_dispatcher_type=alltoall            A/B against Megatron's
  logger.log_dir=DIR     each run writes into DIR/<UTC start time>/ (metrics.jsonl, tensorboard/,
                         grpo_curves.png, summary.json); DIR/latest links to the newest run
without --config, Hydra groups of efa_ep/conf/grpo.yaml: transport=auto|torch|gda|proxy

shipped recipes (--config NAME):
{recipes}

run time: grpo_tiny_moe_efa.yaml (200 warm-start steps + 600 GRPO steps, EP 2) takes about
3-6 minutes on a 2-core CPU machine; grpo.max_num_steps=20 is a quick look (under a minute
after start-up). The llm/ recipes need NeMo-RL and p5en nodes.

environment: EFA_EP_TRANSPORT, EFA_EP_TRANSPORT_OPTIONS, EFA_EP_MAX_TOKENS_PER_RANK apply
where the recipe's efa_ep.transport keys are auto / null / empty; all are checked before
ranks start.
exit codes: 0 done (verdict PASS), 1 a rank failed or verdict FAIL, 2 a setting is wrong,
130 interrupted (partial plot written).
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
                        help="also write the run summary (status, verdict, run directory, "
                             "start/end reward and accuracy, wall time, paths) as JSON to this "
                             "file (every run also writes it to its directory as summary.json)")
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


_REPEAT_S = 0.5
"""Seconds after a SIGINT that raised during which another one only counts."""


class _CtrlC:
    """Ctrl-C for the whole command, armed first thing in :func:`main`.

    The terminal's SIGINT reaches the launcher and its ranks (one process group). The ranks
    start with it blocked (``run_ranks(..., ranks_block_sigint=True)``) and never act on it; here
    it raises KeyboardInterrupt wherever the launcher is (loading the recipe, starting the
    ranks, waiting for them, reporting), which :func:`main` turns into the ``interrupted`` line
    and exit 130 after the ranks are stopped. Every SIGINT is also counted, so one whose
    exception a library swallowed still ends the command as interrupted. A SIGINT within
    :data:`_REPEAT_S` of the last one that raised (a key held or pressed twice) is only counted,
    and so is every SIGINT once :meth:`settle` is called (the launcher is stopping, or has
    decided the run's outcome): the stop and the report are not cut short.
    """

    def __init__(self):
        self.count = 0
        self.raising = True
        self.last_raise = -math.inf
        self.previous = None
        self.armed = False

    def arm(self) -> bool:
        """Installs the handler (main thread only; False elsewhere). Also where the command
        started with SIGINT ignored, as a script's background job does (``cmd &``): a SIGINT
        sent to the run's process group is meant for the run; ignored here, the run would go
        on to the end."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self.previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._handler)
        self.armed = True
        return True

    def _handler(self, signum, frame):
        self.count += 1
        now = time.monotonic()
        if self.raising and now - self.last_raise > _REPEAT_S:
            self.last_raise = now
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        return self.count > 0

    def check(self) -> None:
        """Raises KeyboardInterrupt if a SIGINT came (its exception may have been swallowed)."""
        if self.requested:
            raise KeyboardInterrupt

    def settle(self) -> None:
        self.raising = False

    def disarm(self) -> None:
        if self.armed and self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.armed = False


class _Run:
    """What :func:`main` knows about the run so far, for the ``interrupted`` line."""

    def __init__(self):
        self.t0 = time.time()
        self.tcfg = None      # TrainerConfig, once the recipe is checked (built-in trainer)
        self.run_dir = None   # the run's directory, once made
        self.trainer = None   # "builtin" | "nemo_rl", once chosen
        self.summary_json = None


def main(argv: Optional[Sequence[str]] = None, sigint_held: Sequence = ()) -> int:
    """Runs the command; returns its exit code (see the module docstring). Called with ``argv``
    (from Python), the caller's SIGINT handler is put back on return; from the command line a
    SIGINT after the outcome is decided is ignored, so it cannot change the exit code.
    ``sigint_held``: SIGINTs an entry script caught before this module was imported (non-empty:
    the command is interrupted at once)."""
    ctrl_c, state = _CtrlC(), _Run()
    armed = ctrl_c.arm()
    try:
        if sigint_held:
            raise KeyboardInterrupt
        args, overrides = parse_args(argv)
        state.summary_json = args.summary_json
        if armed:
            _log("Ctrl-C stops the run at any moment: the ranks are stopped, the steps done are "
                 "kept and plotted, exit 130")
        try:
            return _main(args, overrides, ctrl_c, state)
        except (ValueError, FileNotFoundError) as e:
            # ConfigError and the recipe dataclasses' checks: one line, before any rank starts.
            ctrl_c.check()
            ctrl_c.settle()
            _error(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__,
                   getattr(e, "hint", "") or "see efa-ep-grpo --help")
            return 2
    except KeyboardInterrupt:
        ctrl_c.settle()
        return _interrupted(state)
    finally:
        ctrl_c.settle()
        if argv is not None:
            ctrl_c.disarm()
        elif ctrl_c.armed:
            # The outcome is decided. Python's exit resets a handler installed from Python to
            # the default (a SIGINT would then end the process as killed, not with this exit
            # code); an ignored SIGINT stays ignored.
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _main(args, overrides: List[str], ctrl_c: _CtrlC, state: _Run) -> int:
    cfg = load(args, overrides)
    from .grpo.config import check_recipe_types

    check_recipe_types(cfg)
    trainer, why = choose_trainer(cfg)
    state.trainer = trainer
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
        ctrl_c.check()
        return 0
    from efa_ep.distributed import RankFailure
    from .grpo.config import check_added_keys, trainer_config
    from .grpo.metrics import new_run_dir, point_latest
    from .grpo.trainer import check_before_start, run

    check_added_keys(overrides)
    tcfg = trainer_config(cfg)
    check_before_start(tcfg)
    state.tcfg = tcfg
    ctrl_c.check()
    # Only now, with every setting checked: a refused run leaves no directory behind.
    state.run_dir = run_dir = new_run_dir(tcfg.logger.log_dir)
    latest = point_latest(run_dir)
    cfg = dict(cfg, logger=dict(cfg.get("logger") or {}, log_dir=run_dir))
    state.tcfg = tcfg = dataclasses.replace(tcfg, logger=dataclasses.replace(tcfg.logger, log_dir=run_dir))
    _log(f"run directory: {run_dir}" + (f" ({latest} points to it)" if latest else ""))
    try:
        summary = run(cfg)
    except RankFailure as e:
        ctrl_c.settle()
        if ctrl_c.requested or (e.failures and all(text.startswith("KeyboardInterrupt")
                                                   for _, text in e.failures)):
            return _interrupted(state)
        return _rank_failed(e, tcfg, state)
    return _finished(summary, tcfg, ctrl_c, state)


def _finished(summary: dict, tcfg, ctrl_c: _CtrlC, state: _Run) -> int:
    """The finished run's report; its last line the verdict (exit 0 on PASS, 1 on FAIL)."""
    from .grpo.verdict import verdict

    summary["launcher_wall_s"] = time.time() - state.t0
    _log(f"done in {summary['launcher_wall_s']:.1f}s ({summary['steps']} GRPO steps, "
         f"{summary['grpo_wall_s']:.1f}s in the GRPO loop)")
    if summary.get("reward_start") is not None:
        _log(f"train/reward: first {summary['reward_first']:.3f}; mean of first "
             f"{summary['reward_window']} steps {summary['reward_start']:.3f} -> mean of last "
             f"{summary['reward_window']} steps {summary['reward_end']:.3f}")
    if summary.get("val_accuracy_start") is not None:
        _log(f"validation/accuracy (greedy): {summary['val_accuracy_start']:.3f} -> "
             f"{summary['val_accuracy_end']:.3f}")
    passed, text = verdict(summary, tcfg)
    summary.update(status="pass" if passed else "fail", verdict=text)
    # A Ctrl-C up to here ends as interrupted; from here on the verdict stands.
    ctrl_c.settle()
    ctrl_c.check()
    _write_summary(state, summary)
    files = ", ".join(f for f in ("metrics.jsonl", "grpo_curves.png", "tensorboard/", "summary.json")
                      if os.path.exists(os.path.join(state.run_dir, f.rstrip("/"))))
    _log(f"run directory: {state.run_dir}: {files}")
    _log(f"verdict: {text}")
    return 0 if passed else 1


def _write_summary(state: _Run, summary: dict) -> None:
    """``summary.json`` in the run's directory, and the ``--summary-json`` file if given."""
    from .grpo.metrics import SUMMARY_NAME

    summary = dict(summary, run_dir=state.run_dir)
    paths = [os.path.join(state.run_dir, SUMMARY_NAME)] if state.run_dir else []
    if state.summary_json:
        paths.append(state.summary_json)
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)


ERROR_LOG_NAME = "rank_errors.log"


def _rank_failed(e, tcfg, state: Optional[_Run] = None) -> int:
    """One line: the first failing rank's error; every rank's traceback goes to a file in the
    run's directory. What the ranks logged before is kept, and plotted."""
    log_dir = tcfg.logger.log_dir
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, ERROR_LOG_NAME)
    with open(path, "w") as f:
        f.write(str(e) + "\n")
    failures = e.failures or [(-1, str(e))]
    step = _last_step(tcfg)
    at = f" at step {step} of {tcfg.grpo.max_num_steps}" if step else ""
    if state is not None:
        _write_summary(state, {"status": "rank_failed", "steps": step, "rank_errors": path})
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


def _interrupted(state: _Run) -> int:
    """Ctrl-C: stop what is left of the ranks, say where the run stopped (one line), plot what
    it logged, exit 130 (128 + SIGINT)."""
    import multiprocessing

    # run_ranks stops its ranks on the way out; one it could not reach is stopped here.
    for p in multiprocessing.active_children():
        p.kill()
        p.join(timeout=5)
    wall_s = time.time() - state.t0
    tcfg = state.tcfg
    if state.run_dir is None:
        what = ("NeMo-RL's run: its logs are under logger.log_dir" if state.trainer == "nemo_rl"
                else "before the run started (nothing was written)")
        print(f"{LOG_PREFIX} interrupted after {wall_s:.0f}s, {what}", file=sys.stderr, flush=True)
        return 130
    step = _last_step(tcfg)
    total = tcfg.grpo.max_num_steps
    if step:
        where = f"interrupted at step {step} of {total} after {wall_s:.0f}s"
    else:
        where = f"interrupted before the first GRPO step (of {total}) after {wall_s:.0f}s"
    _write_summary(state, {"status": "interrupted", "steps": step})
    print(f"{LOG_PREFIX} {where}; run directory: {state.run_dir}", file=sys.stderr, flush=True)
    _plot_partial(tcfg)
    return 130


if __name__ == "__main__":
    sys.exit(main())
