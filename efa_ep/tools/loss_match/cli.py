"""``efa-ep-loss-match``: the whole run (arms, training launches, verdict, report files) and
the command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, Optional, Sequence

from .arms import Arm, resolve_arms, validate_config
from .corpus import markov_entropy
from .launch import load_routing, run_arms
from .report import export_result, import_result, plot
from .verdict import RESULT_LINE, compare, result_line

SCHEMA = "efa_ep.loss_match/1"


def run(cfg: Dict[str, Any], *, fault=None, import_paths: Sequence[str] = (),
        assert_equal: bool = False, export_dir: Optional[str] = None, log=print) -> Dict[str, Any]:
    """The whole command minus argument parsing: returns the report dict (also written)."""
    from efa_ep.kernels import available_transports

    from ..provenance import collect

    validate_config(cfg)
    out_dir = os.path.abspath(cfg["out_dir"])
    os.makedirs(out_dir, exist_ok=True)
    available = available_transports()
    only = cfg["arms"].get("transports")
    if only:
        available = [t for t in available if t in only]
    arms = resolve_arms(cfg, available)
    t0 = time.perf_counter()
    results = run_arms(cfg, arms, out_dir, fault=fault, log=log)
    imported = []
    for p in import_paths:
        name = "file:" + os.path.splitext(os.path.basename(p))[0]
        arms.append(Arm(name, "baseline", "imported", 0))
        results[name] = {"name": name, "losses": import_result(p), "grad_norms": [], "error": None}
        imported.append(name)
    tol = cfg["tolerance"]
    routing = {a.name: load_routing(out_dir, a.name) for a in arms}
    verdict = compare(arms, results, tol, int(cfg["steps"]),
                      assert_equal_to=imported if assert_equal else (), routing=routing)
    report = {
        "schema": SCHEMA, "config": cfg, "fault": fault, "provenance": collect(),
        "available_transports": available, "wall_seconds": round(time.perf_counter() - t0, 1),
        "loss_floor_markov_entropy": markov_entropy(cfg["model"]["vocab_size"], cfg["data"]["seed"],
                                                    cfg["data"]["branching"]),
        "arms": {a.name: {**dataclasses.asdict(a), **results.get(a.name, {})} for a in arms},
        "tolerance": tol, "verdict": {k: v for k, v in verdict.items() if k != "comparisons"},
        "comparisons": verdict["comparisons"],
    }
    report["result_line"] = result_line(verdict, tol)
    for r in results.values():
        r.pop("_routing", None)
    with open(os.path.join(out_dir, "loss_match.json"), "w") as f:
        json.dump(report, f, indent=1)
    m = cfg["model"]
    title = (f"loss-match {m['dtype']} {cfg['device']} EP={cfg['ep_size']} steps={cfg['steps']} "
             f"L={m['num_layers']} E={m['num_moe_experts']} top{m['moe_router_topk']} "
             f"H={m['hidden_size']}: {'PASS' if verdict['pass'] else 'FAIL'}")
    report["plot"] = plot(os.path.join(out_dir, "loss_match.png"), arms, results, verdict, title)
    if export_dir:
        report["exported"] = export_result(export_dir, results)
    return report


def _flip_text(r) -> str:
    if not r:
        return ""
    if r["first_flip_step"] is None:
        return "; routing identical"
    return (f"; routing flips: {r['total_flips']} of {r['decisions_per_step']}x{len(r['flips_per_step'])}"
            f" token-layer decisions, first at step {r['first_flip_step']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from efa_ep.dispatcher.settings import help_lines

    from ..config import config_names

    parser = argparse.ArgumentParser(
        prog="efa-ep-loss-match",
        usage="efa-ep-loss-match [--config-name NAME] [options] [key=value ...]",
        description="Train the same tiny Megatron GPT-MoE once per dispatcher arm (Megatron's "
                    "allgather and EP=1 as baselines; efa on every transport usable here and "
                    "Megatron's alltoall as candidates) and compare the per-step losses. Prints "
                    "PASS/FAIL last; exit 0 on PASS, 1 on FAIL, 2 for a bad setting.",
        epilog=f"""\
configs (--config-name, efa_ep/conf/loss_match/): {', '.join(config_names('loss_match'))}
  cpu (default): fp32, EP 2 over gloo, 50 steps; about 3-5 minutes on a 2-core CPU machine
  ci: the same, 20 steps (what tests/test_loss_match.py runs); about 1-2 minutes
  gpu_bf16: bf16, 100 steps, both ranks on cuda:0
overrides (key=value, any key of the config), e.g.:
  steps=20 ep_size=4 arms.candidates=[alltoall] out_dir=/tmp/lm
output: <out_dir>/loss_match.json (every loss, the comparisons, provenance) and
  <out_dir>/loss_match.png; out_dir defaults to ./loss_match_out (ci: ./loss_match_ci)
environment (every rank reads it; each efa arm sets its own transport and options; meanings:
python3 -m efa_ep.tools.config --settings-table):
{chr(10).join(help_lines())}""",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", default="cpu", metavar="NAME",
                        help="a config of efa_ep/conf/loss_match (default cpu)")
    parser.add_argument("--export-result", metavar="DIR",
                        help="also write one <arm>.txt per arm, 'step loss' per line")
    parser.add_argument("--import-result", metavar="FILE", action="append", default=[],
                        help="add a 'step loss' file from an earlier run as a baseline arm "
                             "(repeatable)")
    parser.add_argument("--assert-equal", action="store_true",
                        help="every candidate must equal every imported arm bit for bit")
    parser.add_argument("--fault", choices=["weight_noise", "drop_partial"],
                        help="self-test: perturb --fault-arm so that the check must FAIL")
    parser.add_argument("--fault-arm", default="efa:torch", metavar="ARM",
                        help="the arm --fault perturbs (default efa:torch)")
    parser.add_argument("--fault-scale", type=float, default=1e-3, metavar="X",
                        help="size of the weight_noise perturbation (default 1e-3)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    from efa_ep.kernels.options import ConfigError
    from ..config import compose

    try:
        cfg = compose("loss_match", args.config_name, args.overrides)
        # Settings that cannot run are refused here, in one line, before any rank starts.
        validate_config(cfg)
    except (ConfigError, ValueError) as e:
        print(f"efa-ep-loss-match: error: {e}", file=sys.stderr)
        if getattr(e, "hint", None):
            print(f"  hint: {e.hint}", file=sys.stderr)
        return 2
    fault = None
    if args.fault:
        fault = {"kind": args.fault, "arm": args.fault_arm, "scale": args.fault_scale}
    try:
        report = run(cfg, fault=fault, import_paths=args.import_result,
                     assert_equal=args.assert_equal, export_dir=args.export_result)
    except Exception:
        traceback.print_exc()
        print(f"{RESULT_LINE} FAIL error (see traceback above)")
        return 1
    v = report["verdict"]
    for c in report["comparisons"]:
        print(f"  {c['candidate']:>14} vs {c['baseline']:<10} max_abs={c['max_abs_dloss']:.3e} "
              f"max_rel={c['max_rel_dloss']:.3e} (step {c['max_rel_step']}) "
              f"tol={c['tol_rel'] if c['tol_rel'] is not None else c['tol_abs']} "
              f"{('ok' if c['within_tol'] else 'OVER') if c['gated'] else 'info (not gated)'}"
              f"{_flip_text(c['routing'])}")
    for s in v["baseline_spread"]:
        print(f"  baseline spread {s['a']} vs {s['b']}: max_abs={s['max_abs_dloss']:.3e} "
              f"max_rel={s['max_rel_dloss']:.3e}{_flip_text(s['routing'])}")
    for b in v["bitwise"]:
        print(f"  bitwise {b['candidate']} vs {b['control']}: "
              f"{'identical' if b['pass'] else 'DIFFERENT'} (losses {b['identical_losses']}, "
              f"grad norms {b['identical_grad_norms']}, params {b['identical_final_params']})")
    for f in v["failures"]:
        print(f"  FAIL: {f}")
    print(f"  report: {os.path.join(os.path.abspath(cfg['out_dir']), 'loss_match.json')}")
    print(report["result_line"], flush=True)
    return 0 if v["pass"] else 1
