"""The verdict: every candidate arm against every baseline (relative and absolute |d loss|
against tolerances), routing flips between arms, bitwise checks, and the one-line result."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from .arms import Arm

# The first word of the printed result line (scripts grep for it).
RESULT_LINE = "loss-match:"


def routing_diff(a, b) -> Optional[Dict[str, Any]]:
    """Per step, how many (layer, token) routing decisions differ between two arms."""
    import numpy as np

    if a is None or b is None or a.shape != b.shape or a.size == 0:
        return None
    per_step = (np.sort(a, -1) != np.sort(b, -1)).any(-1).reshape(a.shape[0], -1).sum(1)
    nz = np.nonzero(per_step)[0]
    return {"decisions_per_step": int(np.prod(a.shape[1:-1])),
            "first_flip_step": int(nz[0]) if nz.size else None,
            "flips_per_step": [int(x) for x in per_step],
            "total_flips": int(per_step.sum())}


def _dloss(cand: Sequence[float], base: Sequence[float]):
    n = min(len(cand), len(base))
    abs_d = [abs(cand[i] - base[i]) for i in range(n)]
    rel_d = [abs_d[i] / abs(base[i]) if base[i] != 0 else (0.0 if abs_d[i] == 0 else math.inf)
             for i in range(n)]
    return abs_d, rel_d


def compare(arms: List[Arm], results: Dict[str, Dict[str, Any]], tol: Dict[str, Any],
            steps: int, assert_equal_to: Sequence[str] = (), routing=None) -> Dict[str, Any]:
    """The verdict. Checks, each recorded with its outcome:

    - every arm finished all ``steps`` with finite losses;
    - each candidate vs each baseline: max |d loss| / |baseline loss| <= ``max_rel_dloss`` and
      max |d loss| <= ``max_abs_dloss`` (a null tolerance is not checked);
      ``per_baseline.<name>`` overrides them for one baseline (``gate: false`` reports that
      baseline's comparison without failing on it);
    - ``bitwise``: each ``efa:*`` arm equals the control arm bit for bit (losses, grad norms and
      final parameters of every rank);
    - ``assert_equal_to``: candidates equal those (imported) arms bit for bit.
    """
    failures: List[str] = []
    ok_arms = []
    for a in arms:
        r = results.get(a.name, {})
        if r.get("error"):
            failures.append(f"arm {a.name} failed: {r['error'].strip().splitlines()[-1][:300]}")
        elif len(r.get("losses", [])) != steps:
            failures.append(f"arm {a.name} has {len(r.get('losses', []))} of {steps} steps")
        elif not all(math.isfinite(x) for x in r["losses"]):
            failures.append(f"arm {a.name} has non-finite losses")
        else:
            ok_arms.append(a.name)
    comparisons = []
    routing = routing or {}
    for c in [a for a in arms if a.role == "candidate" and a.name in ok_arms]:
        for b in [a for a in arms if a.role == "baseline" and a.name in ok_arms]:
            t = {**tol, **((tol.get("per_baseline") or {}).get(b.name) or {})}
            rel_tol, abs_tol = t.get("max_rel_dloss"), t.get("max_abs_dloss")
            abs_d, rel_d = _dloss(results[c.name]["losses"], results[b.name]["losses"])
            i_abs = max(range(len(abs_d)), key=abs_d.__getitem__)
            i_rel = max(range(len(rel_d)), key=rel_d.__getitem__)
            within = (rel_tol is None or rel_d[i_rel] <= rel_tol) and (abs_tol is None or abs_d[i_abs] <= abs_tol)
            gated = t.get("gate", True)
            ok = within or not gated
            comparisons.append({
                "candidate": c.name, "baseline": b.name, "max_abs_dloss": abs_d[i_abs],
                "max_abs_step": i_abs, "max_rel_dloss": rel_d[i_rel], "max_rel_step": i_rel,
                "first_nonzero_step": next((i for i, d in enumerate(abs_d) if d != 0), None),
                "tol_rel": rel_tol, "tol_abs": abs_tol, "gated": gated, "within_tol": within,
                "routing": routing_diff(routing.get(c.name), routing.get(b.name)),
                "abs_dloss": abs_d, "pass": ok})
            if not ok:
                failures.append(
                    f"{c.name} vs {b.name}: max rel |dloss| {rel_d[i_rel]:.3e} (step {i_rel}), "
                    f"max abs {abs_d[i_abs]:.3e} (step {i_abs}) > tol rel={rel_tol} abs={abs_tol}")
    # Spread between the baselines themselves: the floor any candidate is measured against.
    spread = []
    bases = [a.name for a in arms if a.role == "baseline" and a.name in ok_arms]
    for i, b1 in enumerate(bases):
        for b2 in bases[i + 1:]:
            abs_d, rel_d = _dloss(results[b1]["losses"], results[b2]["losses"])
            spread.append({"a": b1, "b": b2, "max_abs_dloss": max(abs_d), "max_rel_dloss": max(rel_d),
                           "routing": routing_diff(routing.get(b1), routing.get(b2))})
    bitwise = []
    bw = tol.get("bitwise") or {}
    if bw.get("enabled"):
        control = bw.get("control", "alltoall")
        for c in [a for a in arms if a.name.startswith("efa:") and a.name in ok_arms]:
            if control not in ok_arms:
                failures.append(f"bitwise check of {c.name}: control arm {control!r} missing")
                continue
            rc, rb = results[c.name], results[control]
            same_loss = rc["losses"] == rb["losses"]
            same_gn = rc["grad_norms"] == rb["grad_norms"]
            same_params = rc.get("param_sha256") == rb.get("param_sha256")
            ok = same_loss and same_gn and same_params
            bitwise.append({"candidate": c.name, "control": control, "identical_losses": same_loss,
                            "identical_grad_norms": same_gn, "identical_final_params": same_params,
                            "pass": ok})
            if not ok:
                failures.append(f"{c.name} vs {control}: not bitwise identical (losses {same_loss}, "
                                f"grad norms {same_gn}, final params {same_params})")
    for ref in assert_equal_to:
        for c in [a for a in arms if a.role == "candidate" and a.name in ok_arms]:
            if results[c.name]["losses"] != results[ref]["losses"]:
                failures.append(f"--assert-equal: {c.name} differs from {ref}")
    gated_cmp = [c for c in comparisons if c["gated"]]
    max_rel = max((c["max_rel_dloss"] for c in gated_cmp), default=math.nan)
    max_abs = max((c["max_abs_dloss"] for c in gated_cmp), default=math.nan)
    return {"pass": not failures, "failures": failures, "max_rel_dloss": max_rel,
            "max_abs_dloss": max_abs, "steps": steps, "arms": [a.name for a in arms],
            "comparisons": comparisons, "baseline_spread": spread, "bitwise": bitwise}


def result_line(verdict: Dict[str, Any], tol: Dict[str, Any]) -> str:
    """The last printed line: the verdict, then each baseline's comparison with its own measured
    value and its own tolerance, e.g.

    ``loss-match: PASS: vs allgather max rel |dloss| 0 <= 1e-05; vs ep1 max rel |dloss| 2.208e-05
    <= 0.0002; bitwise efa == alltoall; steps=50 arms=allgather,ep1,efa:torch,alltoall``

    Per baseline, the measured value is the largest over the candidates, shown for each
    tolerance that baseline has (``max rel`` and/or ``max abs``): ``<=`` within it, ``>`` past
    it with the candidates past it named; a baseline with ``gate: false`` (or no tolerance) is
    shown with the default tolerance's measure and ``(not gated)``. The bitwise check follows,
    and a count of any other failures (listed on the lines before)."""
    def num(x: float) -> str:
        return "0" if x == 0 else f"{x:.3e}"

    measures = (("rel", "max_rel_dloss", "tol_rel"), ("abs", "max_abs_dloss", "tol_abs"))
    default = [m for m in measures if tol.get(m[1]) is not None] or [measures[0]]
    parts, over_count = [], 0
    cmps = verdict.get("comparisons", [])
    for base in dict.fromkeys(c["baseline"] for c in cmps):
        group = [c for c in cmps if c["baseline"] == base]
        gated = group[0].get("gated", True)
        shown = [m for m in measures if group[0].get(m[2]) is not None] if gated else []
        texts = []
        for word, key, tkey in shown or default:
            worst = max(c[key] for c in group)
            t = group[0].get(tkey)
            if not gated or t is None:
                texts.append(f"max {word} |dloss| {num(worst)} (not gated)")
                continue
            over = [c["candidate"] for c in group if c[key] > t]
            texts.append(f"max {word} |dloss| {num(worst)} {'>' if over else '<='} {t:g}"
                         + (f" ({', '.join(over)})" if over else ""))
        over_count += sum(1 for c in group if not c["pass"])
        parts.append(f"vs {base} " + ", ".join(texts))
    bw = verdict.get("bitwise") or []
    if bw:
        control = bw[0]["control"]
        diff = [b["candidate"] for b in bw if not b["pass"]]
        parts.append(f"bitwise {', '.join(diff)} != {control}" if diff else f"bitwise efa == {control}")
    other = len(verdict.get("failures", [])) - over_count - sum(1 for b in bw if not b["pass"])
    if other > 0:
        parts.append(f"{other} other failure{'s' if other > 1 else ''} (listed above)")
    return (f"{RESULT_LINE} {'PASS' if verdict['pass'] else 'FAIL'}: " + "; ".join(parts)
            + f"; steps={verdict['steps']} arms={','.join(verdict['arms'])}")
