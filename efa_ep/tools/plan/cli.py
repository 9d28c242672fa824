"""``efa-ep-plan``: should an MoE training job use the efa dispatcher, and how?

Usage::

    efa-ep-plan model=qwen3_30b_a3b fabric=p5en nodes=2 gpus_per_node=8 ep=16 tokens_per_rank=128
    efa-ep-plan model=deepseek_v3 fabric=p6-b200 nodes=4 ep=32 micro_batches_per_step=16
    efa-ep-plan calibrate results/h200/bench_proxy.json results/plan/measured_h200x2.jsonl ...
    efa-ep-plan counts results/plan/hier_counts_cpu.json   # network counts: bench vs model
    efa-ep-plan memory --ep 8,16,32 --max-tokens-per-rank 2048   # window memory per rank

The plan prints its tables and ends with one line
``plan: verdict=<dense|capacity|efa> transport=<name> num_channels=<n> dc_us=<D+C per layer> bound=<...>``
(``transport``: gda, proxy, hier:agg1, hier:agg0, alltoall or allgather; ``hier:aggN`` is
``EFA_EP_TRANSPORT=hier`` with ``aggregate=N``)
and writes ``plan.json`` and ``plan.png`` into ``out_dir`` (default ``./plan_<model>_<fabric>``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Optional, Sequence

from . import calibrate as cal_mod
from . import calibration_report
from . import report
from .model import Fig, Inputs, make_plan
from .presets import FABRICS, MODELS

_MODEL_KEYS = ("hidden", "num_experts", "topk", "moe_layers", "moe_ffn_hidden", "seq_length", "micro_batch", "dtype")
_PLAN_KEYS = ("nodes", "gpus_per_node", "ep", "tp", "tokens_per_rank", "micro_batches_per_step", "gemm_efficiency",
              "max_channels", "chunk_bytes", "proxy_same_node", "max_tokens_per_rank", "memory_budget", "win_margin")


def repo_root() -> str:
    from ..provenance import repo_root as rr

    return rr()


def shipped_calibration() -> str:
    return os.path.join(repo_root(), "results", "plan", "calibration.json")


def inputs_from_config(cfg: Dict[str, Any], overrides: Sequence[str] = ()) -> Inputs:
    """Builds :class:`Inputs` from a composed ``conf/plan`` config; keys given on the command line
    get the source 'command line'."""
    m, f = cfg["model"], cfg["fabric"]
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    sources = {"model": f"model preset {m['name']}: {MODELS.get(m['name'], 'conf/plan/model/' + m['name'] + '.yaml')}",
               "fabric": f"fabric preset {f['name']}: {FABRICS.get(f['name'], 'conf/plan/fabric/' + f['name'] + '.yaml')}"}
    for key in given:
        sources[key.split(".")[-1]] = f"command line ({key})"
    kw = {k: m[k] for k in _MODEL_KEYS}
    kw.update({k: cfg[k] for k in _PLAN_KEYS})
    return Inputs(model=m["name"], fabric=f["name"], gpu=f["gpu"], hbm_gb=float(f["hbm_gb"]),
                  nvlink_gbps=float(f["nvlink_gbps"]),
                  efa_gbps_per_node=float(f["efa_nics"]) * float(f["efa_gbps_per_nic"]),
                  gpu_tflops_bf16=float(f["gpu_tflops_bf16"]), sources=sources, **kw)


def load_calibration(path: Optional[str], log=print) -> Dict[str, Fig]:
    """The calibration at ``path``; with None, the shipped one if this checkout has it, else the
    built-in assumed defaults (said so on stderr)."""
    if path:
        return cal_mod.read(path)
    shipped = shipped_calibration()
    if os.path.exists(shipped):
        return cal_mod.read(shipped)
    log(f"efa-ep-plan: no calibration file ({shipped} missing); using built-in assumed defaults",
        file=sys.stderr)
    return cal_mod.default_calibration()


def run_plan(cfg: Dict[str, Any], overrides: Sequence[str] = (), log=print) -> Dict[str, Any]:
    inp = inputs_from_config(cfg, overrides)
    cal = load_calibration(cfg.get("calibration"), log)
    plan = make_plan(inp, cal)
    out_dir = os.path.abspath(cfg.get("out_dir") or f"plan_{inp.model}_{inp.fabric}")
    os.makedirs(out_dir, exist_ok=True)
    rows = report.sweep(inp, cal, cfg.get("token_sweep") or [inp.tokens_per_rank])
    doc = report.to_json(plan, cal, rows, {"overrides": list(overrides), "config": cfg})
    with open(os.path.join(out_dir, "plan.json"), "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
        fh.write("\n")
    png = report.plot(plan, rows, os.path.join(out_dir, "plan.png"))
    log(report.tables(plan, cal))
    log(f"wrote {os.path.join(out_dir, 'plan.json')}" + (f" and {png}" if png else " (no matplotlib: no plan.png)"))
    log(report.final_line(plan))
    return doc


def calibrate_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="efa-ep-plan calibrate",
        description="Fit the planner's per-operation costs (launch and host overheads, per-descriptor "
                    "cost and channel scaling of the proxy, link efficiencies) from this project's "
                    "benchmark records, write a calibration file, and show how well it predicts "
                    "records it was not fitted on.",
        epilog="Record files: efa-ep-bench bench_records.jsonl or bench_summary.json, "
               "scripts/bench_proxy.py JSON, planner record files (*.jsonl). With no files, the "
               "records shipped in results/ are used.")
    p.add_argument("records", nargs="*", help="benchmark record files to fit (default: the ones in results/)")
    p.add_argument("--out", default=None,
                   help="calibration file to write (default: results/plan/calibration.json of this checkout)")
    p.add_argument("--provider", default="shm",
                   help="which provider's descriptor rates give the proxy's per-descriptor cost and channel "
                        "scaling (default shm: the lowest per-write cost measured here)")
    p.add_argument("--desc-bytes", type=int, default=64, help="descriptor write size of those rates (default 64)")
    a = p.parse_args(list(argv))
    files = a.records or cal_mod.default_record_files(repo_root())
    if not files:
        p.error("no record files given and none found in results/")
    out = a.out or shipped_calibration()
    try:
        doc = cal_mod.calibrate(files, provider=a.provider, desc_bytes=a.desc_bytes)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"efa-ep-plan calibrate: {e}", file=sys.stderr)
        return 2
    cal_mod.write(doc, out)
    base = os.path.splitext(out)[0]
    md = calibration_report.params_table(doc) + "\n\nHeld-out predictions (fit without the held-out shape / file):\n\n" + \
        calibration_report.validation_table(doc) + "\n"
    with open(base + "_validation.md", "w") as fh:
        fh.write(md)
    png = calibration_report.validation_plot(doc, base + "_validation.png")
    print(md)
    v = doc["validation"]
    err = f"{100 * v['median_abs_rel_err']:.0f}%" if v["median_abs_rel_err"] is not None else "-"
    print(f"calibrate: params={len(doc['params'])} records={len(files)} held_out={len(v['rows'])} "
          f"median_abs_err={err} out={out}" + (f" plot={png}" if png else ""))
    return 0


def shipped_counts() -> str:
    return os.path.join(repo_root(), "results", "plan", "hier_counts_cpu.json")


def counts_main(argv: Sequence[str]) -> int:
    from . import counts as counts_mod

    p = argparse.ArgumentParser(
        prog="efa-ep-plan counts",
        description="Network messages and rows per rank and op that efa-ep-bench counted (proxy and "
                    "hier arms, net_counts) next to the planner's prediction at the same layout.",
        epilog="Files: efa-ep-bench bench_summary.json or bench_records.jsonl of a run with "
               "arms.transports=[torch,proxy,hier] node_size=G routes=[uniform]; default: the "
               "shipped results/plan/hier_counts_cpu.json. Exit codes: 0 ok, 2 bad input.")
    p.add_argument("files", nargs="*")
    p.add_argument("--collect", default=None, metavar="OUT",
                   help="also write the counting cells of the given summaries into OUT (one file)")
    a = p.parse_args(list(argv))
    files = a.files or [shipped_counts()]
    try:
        rows = counts_mod.compare(counts_mod.load(files))
        if a.collect:
            counts_mod.write_collection(files, a.collect, note="efa-ep-plan counts --collect")
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"efa-ep-plan counts: {e}", file=sys.stderr)
        return 2
    print(counts_mod.table(rows))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        return calibrate_main(argv[1:])
    if argv and argv[0] == "counts":
        return counts_main(argv[1:])
    if argv and argv[0] == "memory":
        from .memory import main as memory_main

        return memory_main(argv[1:])
    p = argparse.ArgumentParser(
        prog="efa-ep-plan", description=__doc__.split("\n\n")[0],
        epilog="Positional arguments are Hydra overrides: model=<qwen3_30b_a3b|moonlight_16b_a3b|"
               "deepseek_v3|kimi_k2> fabric=<p5|p5en|p6-b200|p6-b300> nodes=N gpus_per_node=G ep=P "
               "tokens_per_rank=T, any key of conf/plan/default.yaml, or model.<key>=... "
               "`efa-ep-plan calibrate --help` fits a calibration from bench records; "
               "`efa-ep-plan counts --help` compares the network counts of bench runs with the model; "
               "`efa-ep-plan memory --help` sizes the transports' windows per rank.")
    p.add_argument("--config-name", default="default", help="conf/plan/<name>.yaml (default: default)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from ..config import compose

    try:
        cfg = compose("plan", a.config_name, a.overrides)
        run_plan(cfg, a.overrides)
    except (ValueError, KeyError, FileNotFoundError) as e:
        # one line (a misspelled preset lists the presets there are), plus a hint where there is one
        print(f"efa-ep-plan: error: {e}", file=sys.stderr)
        if getattr(e, "hint", None):
            print(f"  hint: {e.hint}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
