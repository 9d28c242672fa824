"""``efa-ep-bench``: runs the starts (each a fresh launch of all ranks), writes records,
summary, table and plots; the command line."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

from . import __doc__ as PACKAGE_DOC
from .arms import resolve_arms, timing_modes, validate_config
from .cells import build_cells
from .features import layer_features
from .report import add_reference_ratios, box_plots, markdown_table, summarize_records
from .schema import SCHEMA, timing_boundary
from .start import start_main


def rank_env(cfg: Dict[str, Any]) -> Dict[str, str]:
    """``cfg["env"]``, the variables every rank gets, as strings; its ``EFA_EP_*`` entries
    checked against their declarations (:data:`efa_ep.kernels.core.variables.VARIABLES`).

    Raises:
        ConfigError: an undeclared ``EFA_EP_*`` name (with the closest one) or a value its
            declaration refuses, naming ``env.<variable>``.
    """
    from efa_ep.dispatcher.settings import VARIABLE
    from efa_ep.kernels.options import ConfigError, did_you_mean

    env = {str(k): str(v) for k, v in (cfg.get("env") or {}).items()}
    for name, value in env.items():
        if not name.startswith("EFA_EP_"):
            continue
        v = VARIABLE.get(name)
        if v is None:
            raise ConfigError(f"env.{name}: not an efa-ep variable{did_you_mean(name, VARIABLE)}",
                              hint="the variables: python3 -m efa_ep.tools.config --settings-table")
        if v.transport:  # a per-option variable: its transport's schema checks it
            v.option.convert(value, f"env.{name}")
        elif not v.read_by:
            v.convert(value, f"env.{name}")
    return env


def run(cfg: Dict[str, Any], log=print) -> Dict[str, Any]:
    """The whole benchmark of ``cfg`` minus argument parsing: ``starts`` launches of all ranks,
    then ``bench_records.jsonl``, ``bench_summary.json``, ``bench_table.md`` and plots in
    ``out_dir``; returns the summary (with ``table`` and ``plots``)."""
    from efa_ep.distributed import run_ranks
    from efa_ep.kernels import available_transports

    validate_config(cfg)
    out_dir = os.path.abspath(cfg["out_dir"])
    os.makedirs(out_dir, exist_ok=True)
    arms, not_run = resolve_arms(cfg, available_transports())
    cells = build_cells(cfg, arms)
    if not cells:
        raise ValueError("no cell to run: no arm of this config is available here")
    world = int(cfg["ep_size"])
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + hashlib.sha1(os.urandom(8)).hexdigest()[:6]
    env = {"FI_TCP_IFACE": os.environ.get("FI_TCP_IFACE", "lo"), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": str(cfg["num_threads"])}
    env.update(rank_env(cfg))
    records: List[Dict[str, Any]] = []
    failed_starts: List[Dict[str, Any]] = []
    jsonl = os.path.join(out_dir, "bench_records.jsonl")
    t0 = time.perf_counter()
    try:
        from tqdm import tqdm

        bar = tqdm(total=int(cfg["starts"]) * len(cells), unit="cell", desc="efa-ep-bench",
                   disable=not cfg.get("progress", True), file=sys.stderr)
    except ImportError:
        bar = None
    with open(jsonl, "w") as f:
        for start in range(int(cfg["starts"])):
            res = run_ranks(start_main, world, (cfg, start, cells, run_id), backend=cfg["backend"],
                            timeout_s=float(cfg["start_timeout_s"]), pg_timeout_s=float(cfg["pg_timeout_s"]),
                            env=env, raise_on_error=False)
            ok, val = res[0]
            if all(o for o, _ in res):
                for rec in add_reference_ratios(val):
                    f.write(json.dumps(rec) + "\n")
                records.extend(val)
            else:
                errs = "\n".join(f"rank {r}: {v}" for r, (o, v) in enumerate(res) if not o)
                failed_starts.append({"start": start, "error": errs[-4000:]})
                log(f"[bench] start {start} failed:\n{errs[-2000:]}", file=sys.stderr)
            f.flush()
            if bar is not None:
                bar.update(len(cells))
    if bar is not None:
        bar.close()
    rows = summarize_records(records, cfg)
    meta = {"ep_size": world, "not_run": not_run}
    summary = {"schema": SCHEMA + "-summary", "run_id": run_id, "config": cfg,
               "wall_seconds": round(time.perf_counter() - t0, 1), "not_run": not_run,
               "failed_starts": failed_starts, "timing_boundary": {m: timing_boundary(m) for m in timing_modes(cfg)},
               "provenance": records[0]["provenance"] if records else None, "cells": rows}
    with open(os.path.join(out_dir, "bench_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    table = markdown_table(rows, cfg, meta)
    with open(os.path.join(out_dir, "bench_table.md"), "w") as f:
        f.write(table)
    summary["plots"] = (box_plots(records, out_dir, layer_features(cfg)) if cfg.get("plots", True)
                        else [])
    summary["table"] = table
    return summary


def _environment_help() -> str:
    from efa_ep.dispatcher.settings import help_lines

    return ("environment (from this shell, or +env.<VARIABLE>=... for the ranks only; arms set their own transport "
            "and options; meanings: python3 -m efa_ep.tools.config --settings-table):\n"
            + "\n".join(help_lines()))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..config import config_names

    parser = argparse.ArgumentParser(
        prog="efa-ep-bench", description=PACKAGE_DOC.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides: key=value changes a config key (starts=30, \"arms.transports=[torch,proxy]\", "
               "timing=steady); +key=value adds one.\n"
               f"configs: {', '.join(config_names('bench'))} (--quick: a CI smoke run, about a "
               "minute on 2 cores; the default runs >= 20 starts and takes tens of minutes).\n"
               "writes: out_dir (default ./bench_out; --quick: ./bench_quick): bench_records.jsonl, "
               "bench_summary.json, bench_table.md, bench_<profile>.png.\nexit codes: 0 ok, 1 a failed start or a void "
               "cell, 2 bad settings.\n" + _environment_help())
    parser.add_argument("--config-name", default=None, help="conf/bench/<name>.yaml (default: default)")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: conf/bench/quick.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    from efa_ep.kernels.options import ConfigError
    from ..config import compose

    name = args.config_name or ("quick" if args.quick else "default")
    try:
        cfg = compose("bench", name, args.overrides)
        # Settings that cannot run are refused here, in one line, before any rank starts: each
        # key's value, their combinations, and the arms they ask for.
        validate_config(cfg)
        rank_env(cfg)
        from efa_ep.kernels import available_transports

        if not build_cells(cfg, resolve_arms(cfg, available_transports())[0]):
            raise ValueError("no cell to run: no arm of this config is available here")
    except (ConfigError, ValueError) as e:
        print(f"efa-ep-bench: error: {e}", file=sys.stderr)
        if getattr(e, "hint", None):
            print(f"  hint: {e.hint}", file=sys.stderr)
        return 2
    try:
        summary = run(cfg)
    except Exception:
        traceback.print_exc()
        print("bench: FAIL error (see traceback above)")
        return 1
    print(summary["table"])
    voids = sum(r["n_void"] for r in summary["cells"])
    print(f"bench: records={sum(r['latency_us']['n'] for r in summary['cells'])} cells={len(summary['cells'])} "
          f"void={voids} failed_starts={len(summary['failed_starts'])} "
          f"out={os.path.abspath(cfg['out_dir'])} wall={summary['wall_seconds']}s")
    return 0 if not summary["failed_starts"] and voids == 0 else 1
