"""How a calibration file (:mod:`~efa_ep.tools.plan.calibrate`) is shown: its parameters and
held-out predictions as Markdown tables, and the predicted-vs-measured plot
(``efa-ep-plan calibrate`` writes them next to the file)."""
from __future__ import annotations

from typing import Any, Dict, Optional


def validation_table(doc: Dict[str, Any]) -> str:
    v = doc["validation"]
    lines = ["| group | held out | tokens/rank or K | measured | predicted | error |", "|---|---|---|---|---|---|"]
    for r in v["rows"]:
        tk = r["tokens_per_rank"] if r["tokens_per_rank"] is not None else f"K={r.get('channels')}"
        lines.append(f"| {r['group']} | {r['held_out']} | {tk} | {r['measured']:.4g} {r['unit']} | "
                     f"{r['predicted']:.4g} {r['unit']} | {100 * r['rel_err']:+.0f}% |")
    if v["median_abs_rel_err"] is not None:
        lines.append(f"\nheld-out |error|: median {100 * v['median_abs_rel_err']:.0f}%, "
                     f"max {100 * v['max_abs_rel_err']:.0f}% over {len(v['rows'])} predictions")
    for n in v["not_held_out"]:
        lines.append(f"- {n}")
    return "\n".join(lines)


def params_table(doc: Dict[str, Any]) -> str:
    lines = ["| parameter | value | unit | tag | source |", "|---|---|---|---|---|"]
    for k, p in doc["params"].items():
        val = f"{p['value']:.4g}" if isinstance(p["value"], (int, float)) else str(p["value"])
        lines.append(f"| {k} | {val} | {p['unit']} | {p['tag']} | {p['source']} |")
    return "\n".join(lines)


def validation_plot(doc: Dict[str, Any], path: str) -> Optional[str]:
    """Predicted vs measured (log-log, y = x line) for the held-out rows; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = doc["validation"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
    for ax, kind, unit in ((axes[0], "dc", "D+C us"), (axes[1], "rate", "M descriptors/s")):
        rr = [r for r in rows if r["kind"] == kind]
        for g in sorted({r["group"] for r in rr}):
            pts = [r for r in rr if r["group"] == g]
            ax.scatter([r["measured"] for r in pts], [r["predicted"] for r in pts], label=g, s=22)
        if rr:
            lo = min(min(r["measured"], r["predicted"]) for r in rr) * 0.7
            hi = max(max(r["measured"], r["predicted"]) for r in rr) * 1.4
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit} (held out)")
        ax.legend(fontsize=7)
        ax.set_title("dispatch+combine, shape held out" if kind == "dc" else "proxy rate, record file held out",
                     fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
