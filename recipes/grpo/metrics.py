"""Per-step metrics of the built-in trainer: JSONL (always), TensorBoard (if importable), PNG;
and the run directories they go to.

Metric names follow NeMo-RL's (``train/reward``, ``train/token_mult_prob_error``,
``timing/train/total_step_time``, ...), so the check scripts read both kinds of run alike.

Every run writes into its own directory ``<logger.log_dir>/<UTC start time>/`` and
``<logger.log_dir>/latest`` links to the newest, so a run never overwrites (or, failing,
damages) an earlier one's files; NeMo-RL likewise makes ``logger.log_dir`` a base directory
(its ``exp_NNN`` folders).
"""
from __future__ import annotations

import datetime
import itertools
import json
import math
import os
from typing import Dict, List, Optional

JSONL_NAME = "metrics.jsonl"
PNG_NAME = "grpo_curves.png"
SUMMARY_NAME = "summary.json"
LATEST_NAME = "latest"


def new_run_dir(base: str, now: Optional[datetime.datetime] = None) -> str:
    """Creates and returns ``<base>/<UTC time>`` (``20261201T101530Z``), or that name with
    ``-2``, ``-3``, ... when it is taken (a run started in the same second): ``os.mkdir`` either
    creates the directory or fails, so two runs, even at once, never get the same one."""
    os.makedirs(base, exist_ok=True)
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    for i in itertools.count(1):
        path = os.path.join(base, stamp if i == 1 else f"{stamp}-{i}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def point_latest(run_dir: str) -> Optional[str]:
    """Points ``<run_dir>/../latest`` at ``run_dir`` (a relative symlink, replaced in one
    rename, so a reader never finds it missing); returns the link, or None where it cannot be
    made (no symlinks on that file system, or a real ``latest`` directory in the way)."""
    base, name = os.path.split(os.path.normpath(run_dir))
    link = os.path.join(base, LATEST_NAME)
    tmp = os.path.join(base, f".{LATEST_NAME}.{os.getpid()}.tmp")
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(name, tmp)
        os.replace(tmp, link)
    except OSError:
        if os.path.lexists(tmp):
            os.remove(tmp)
        return None
    return link


class MetricsLogger:
    """Appends ``{"step": s, **metrics}`` to ``<log_dir>/metrics.jsonl``; mirrors to TensorBoard."""

    def __init__(self, log_dir: str, tensorboard: bool = True):
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.jsonl_path = os.path.join(log_dir, JSONL_NAME)
        self._f = open(self.jsonl_path, "w")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=os.path.join(log_dir, "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                self._tb = None

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        self._f.write(json.dumps({"step": step, **clean}) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str) -> List[dict]:
    """The rows of a metrics file; a last line cut short (a run stopped while rank 0 wrote it,
    as on Ctrl-C) is skipped."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
    return rows


def plot_curves(jsonl_path: str, png_path: Optional[str] = None) -> Optional[str]:
    """PNG with reward (train and validation) and KL-to-reference per step; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    rows = read_jsonl(jsonl_path)
    png_path = png_path or os.path.join(os.path.dirname(jsonl_path), PNG_NAME)

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    x, y = series("train/reward")
    ax1.plot(x, y, label="train/reward (sampled)", alpha=0.6)
    if len(y) >= 5:
        k = max(1, len(y) // 20)
        smooth = [sum(y[max(0, i - k):i + 1]) / len(y[max(0, i - k):i + 1]) for i in range(len(y))]
        ax1.plot(x, smooth, label=f"moving mean ({k + 1})")
    vx, vy = series("validation/accuracy")
    if vx:
        ax1.plot(vx, vy, "o-", label="validation/accuracy (greedy)")
    ax1.set_xlabel("GRPO step"), ax1.set_ylabel("reward"), ax1.set_ylim(-0.02, 1.02)
    ax1.legend(fontsize=8), ax1.set_title("reward")
    x, y = series("train/kl_penalty")
    ax2.plot(x, y, color="tab:red")
    ax2.set_xlabel("GRPO step"), ax2.set_ylabel("k3 KL to reference"), ax2.set_title("KL")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
