"""Per-step metrics of the built-in trainer: JSONL (always), TensorBoard (if importable), PNG.

Metric names follow NeMo-RL's (``train/reward``, ``train/token_mult_prob_error``,
``timing/train/total_step_time``, ...), so the check scripts read both kinds of run alike.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

JSONL_NAME = "metrics.jsonl"
PNG_NAME = "grpo_curves.png"


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
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
