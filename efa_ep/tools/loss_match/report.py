"""Outputs besides the JSON report: the loss plot, and per-arm ``"<step> <loss>"`` files
(export, and import as a baseline arm)."""
from __future__ import annotations

import os
from typing import List, Optional

from .arms import Arm, safe_name


def plot(path: str, arms: List[Arm], results, verdict, title: str) -> Optional[str]:
    """Loss curves (top) and per-step |d loss| of each candidate vs each baseline (log axis)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    for a in arms:
        r = results.get(a.name, {})
        if r.get("losses"):
            ax1.plot(r["losses"], label=f"{a.name} ({a.role}, EP={a.ep_size})",
                     linestyle="-" if a.role == "baseline" else "--")
    ax1.set_ylabel("loss (global batch mean)")
    ax1.legend(fontsize=8)
    ax1.set_title(title, fontsize=10)
    floor = 1e-17
    for c in verdict["comparisons"]:
        d = [x if x > 0 else floor for x in c["abs_dloss"]]
        zeros = sum(1 for x in c["abs_dloss"] if x == 0)
        ax2.semilogy(d, marker=".", linewidth=0.8,
                     label=f"{c['candidate']} vs {c['baseline']}"
                           + (f" ({zeros} steps exactly 0, drawn at {floor:g})" if zeros else ""))
    ax2.set_ylabel("|d loss| (log)")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def export_result(directory: str, results) -> List[str]:
    """One ``<arm>.txt`` per arm: ``"<step> <repr(loss)>"`` per line."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, r in results.items():
        if r.get("losses"):
            p = os.path.join(directory, safe_name(name) + ".txt")
            with open(p, "w") as f:
                f.writelines(f"{i} {x!r}\n" for i, x in enumerate(r["losses"]))
            paths.append(p)
    return paths


def import_result(path: str) -> List[float]:
    """Reads a ``"<step> <loss>"`` file; steps must be 0, 1, 2, ..."""
    losses = []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            step, value = line.split()
            if int(step) != len(losses):
                raise ValueError(f"{path}:{n + 1}: expected step {len(losses)}, got {step}")
            losses.append(float(value))
    return losses
