"""``efa-ep-doctor``: will the ``efa`` dispatcher work on this host, and pay off for your job?

Usage::

    efa-ep-doctor                                   # qwen3_30b_a3b on 2 x p5en, EP 16
    efa-ep-doctor model=deepseek_v3 fabric=p5en nodes=4 ep=32 tokens_per_rank=128
    efa-ep-doctor --json > doctor.json              # the same, machine-readable
    efa-ep-doctor selftest.enabled=false            # local checks and the verdict only

One line per check (``ok`` / ``warn`` / ``fail`` / ``skip``, with the fix), one per transport of
the loopback self-test (bit-identical to ``torch``, fixed cost per op measured), the verdict
(what ``auto`` runs, its predicted D+C against Megatron ``alltoall``, the advice), and a last
line ``doctor: ok=N warn=N fail=N skip=N advice=<...> wall_s=<...>``. Changes nothing on the
machine (a missing native library is built into a temporary folder and removed) and never
leaves loopback. Exit codes: 0 no failed check, 1 a failed check, 2 bad settings.

Under torchrun or Slurm (``WORLD_SIZE`` > 1 with torchrun's variables, or ``SLURM_NTASKS`` > 1
with ``MASTER_ADDR``) it runs on every rank of the job instead (:mod:`.nodes`): the checks once
per node, grouped by node on rank 0 with a ``nodes agree`` line, a cross-node self-test of
``proxy`` and ``hier`` against ``torch`` over the whole group, and one verdict; only rank 0
prints, and every rank exits with the same code::

    torchrun --nnodes 2 --nproc-per-node 8 ... -m efa_ep.tools.doctor nodes=2 gpus_per_node=8
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import time
from typing import Any, Dict, Optional, Sequence

SCHEMA = "efa_ep.doctor/1"


def check_config(cfg: Dict[str, Any]) -> None:
    """Refuses a meaningless value of the doctor's own keys in one line (ConfigError) before
    anything runs; the planner checks the model and layout (:func:`.verdict.make_inputs`)."""
    from efa_ep.kernels.options import ConfigError, Option

    st = cfg["selftest"]
    for key, node, opt in (
            ("tokens_per_rank", cfg, Option("tokens_per_rank", int, None, "tokens per rank", min=1)),
            ("ranks", st, Option("selftest.ranks", int, 2, "processes of the self-test", min=2, max=8)),
            ("tokens", st, Option("selftest.tokens", int, 64, "tokens per rank", min=1)),
            ("hidden", st, Option("selftest.hidden", int, 256, "hidden size", min=1)),
            ("num_experts", st, Option("selftest.num_experts", int, 8, "experts", min=1)),
            ("topk", st, Option("selftest.topk", int, 2, "experts per token", min=1)),
            ("dtype", st, Option("selftest.dtype", str, "bf16", "rows' dtype", choices=("bf16", "fp16", "fp32"))),
            ("iters", st, Option("selftest.iters", int, 20, "timed samples per transport", min=1)),
            ("warmup", st, Option("selftest.warmup", int, 3, "warm-up samples per transport", min=0)),
            ("arm_budget_s", st, Option("selftest.arm_budget_s", float, 2.0, "timed seconds per transport",
                                        min=0.01)),
            ("timeout_s", st, Option("selftest.timeout_s", float, 45, "the self-test's deadline", min=1))):
        if node.get(key) is not None:
            node[key] = opt.convert(node[key], "override")
    if st.get("enabled", True):
        if st["num_experts"] % st["ranks"] or st["topk"] > st["num_experts"]:
            raise ConfigError(f"override: selftest.num_experts={st['num_experts']} must be a multiple of "
                              f"selftest.ranks={st['ranks']} and >= selftest.topk={st['topk']}",
                              hint="e.g. selftest.ranks=2 selftest.num_experts=8 selftest.topk=2")


def layout_of(cfg: Dict[str, Any]):
    """The :class:`~.checks.Layout` of the doctor's config (``ep`` null = nodes x gpus_per_node)."""
    from efa_ep.kernels.options import ConfigError

    from .checks import Layout

    try:
        nodes, gpn = int(cfg["nodes"]), int(cfg["gpus_per_node"])
        ep = int(cfg["ep"]) if cfg.get("ep") is not None else nodes * gpn
    except (TypeError, ValueError) as e:
        raise ConfigError(f"nodes, gpus_per_node and ep must be integers: {e}",
                          hint="e.g. nodes=2 gpus_per_node=8 ep=16") from None
    if min(nodes, gpn, ep) < 1:
        raise ConfigError(f"nodes={nodes}, gpus_per_node={gpn}, ep={ep} must be >= 1",
                          hint="e.g. nodes=2 gpus_per_node=8 ep=16")
    return Layout(nodes=nodes, gpus_per_node=gpn, ep=ep)


def run_doctor(cfg: Dict[str, Any], log=print, host=None) -> Dict[str, Any]:
    """Runs every check, the self-test and the verdict for ``cfg`` (a composed
    ``conf/doctor`` config); returns the JSON document and prints the lines through ``log``
    (None: silent). ``host``: a prebuilt :class:`~.checks.Host` (tests); default: this one."""
    from . import checks as checks_mod
    from . import probes
    from .selftest import run_selftest
    from .verdict import make_inputs, verdict

    t0 = time.perf_counter()
    out = log or (lambda *a, **k: None)
    check_config(cfg)
    lay = layout_of(cfg)
    inputs = make_inputs(cfg, lay)  # a preset or layout the planner refuses stops here
    try:
        h = host if host is not None else checks_mod.gather_host()
        out(f"efa-ep-doctor: {socket.gethostname()} ({h.cpus} CPUs, {h.gpus} GPU(s)) for {cfg['model']} "
            f"on {lay.nodes} x {cfg['fabric']}, {lay.gpus_per_node} GPUs/node, EP {lay.ep}")
        found = checks_mod.run_checks(h, lay)
        for c in found:
            out(c.line())
        st = None
        if cfg["selftest"].get("enabled", True):
            st = run_selftest(h, cfg["selftest"])
            for c in st["checks"]:
                out(c.line())
            gda = next((c for c in st["checks"] if c.name == "selftest gda"), None)
            found = [checks_mod.update_symm_mem(c, gda) if c.name == "symmetric memory" else c for c in found]
        skipped = [] if st else [checks_mod.Check("selftest", "skip", "selftest.enabled=false: no transport was run")]
        for c in skipped:
            out(c.line())
        all_checks = found + (st["checks"] if st else skipped)
        v = verdict(h, lay, cfg, all_checks, st, inputs=inputs)
        for ln in v["lines"]:
            out(f"verdict  {ln}")
    finally:
        probes.cleanup()
    counts = {s: sum(1 for c in all_checks if c.status == s) for s in checks_mod.STATUSES}
    wall = round(time.perf_counter() - t0, 1)
    doc = {
        "schema": SCHEMA,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"name": socket.gethostname(), **h.to_dict()},
        "layout": {"nodes": lay.nodes, "gpus_per_node": lay.gpus_per_node, "ep": lay.ep,
                   "ranks_per_host": lay.ranks_per_host},
        "config": cfg,
        "checks": [c.to_dict() for c in all_checks],
        "selftest": None if st is None else {k: v for k, v in st.items() if k != "checks"},
        "verdict": {k: val for k, val in v.items() if k != "lines"},
        "summary": {**counts, "advice": v["advice"], "wall_s": wall},
    }
    out(final_line(doc))
    return doc


def final_line(doc: Dict[str, Any]) -> str:
    s = doc["summary"]
    return (f"doctor: ok={s['ok']} warn={s['warn']} fail={s['fail']} skip={s['skip']} "
            f"advice={s['advice'].replace(' ', '-')} wall_s={s['wall_s']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from efa_ep.dispatcher.settings import help_lines

    from ..config import config_names

    p = argparse.ArgumentParser(
        prog="efa-ep-doctor", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides: key=value of conf/doctor/default.yaml: model=<qwen3_30b_a3b|moonlight_16b_a3b|"
               "deepseek_v3|kimi_k2> fabric=<p5|p5en|p6-b200|p6-b300> nodes=N gpus_per_node=G ep=P "
               "tokens_per_rank=T, selftest.<key>=... (selftest.enabled=false skips the loopback self-test).\n"
               f"configs: {', '.join(config_names('doctor'))}.\n"
               "exit codes: 0 no failed check, 1 a failed check, 2 bad settings.\n"
               "environment checked by the 'efa_ep settings' line (meanings: python3 -m "
               "efa_ep.tools.config --settings-table):\n" + "\n".join(help_lines()))
    p.add_argument("--config-name", default="default", help="conf/doctor/<name>.yaml (default: default)")
    p.add_argument("--json", action="store_true", help="print the machine-readable document instead of the lines")
    p.add_argument("--print-config", action="store_true", help="print the composed config and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    from efa_ep.kernels.options import ConfigError

    from ..config import compose
    from .nodes import launch_env, main_nodes

    le = None if a.print_config else launch_env()
    if le is not None:  # one rank of a torchrun / Slurm job: the multi-node mode (nodes.py)
        return main_nodes(le, a.config_name, a.overrides, a.json)
    try:
        cfg = compose("doctor", a.config_name, a.overrides)
        if a.print_config:
            print(json.dumps(cfg, indent=1))
            return 0
        doc = run_doctor(cfg, log=None if a.json else print)
    except (ConfigError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"efa-ep-doctor: error: {e}", file=sys.stderr)
        if getattr(e, "hint", None):
            print(f"  hint: {e.hint}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    return 1 if doc["summary"]["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
