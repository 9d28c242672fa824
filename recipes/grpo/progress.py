"""What rank 0 of the GRPO trainer prints: its log lines and the progress line."""
from __future__ import annotations

import sys
import time
from typing import Callable


from .config import TrainerConfig


class _RankZeroLog:
    """Rank 0 prints, owns the metrics files and the progress bars; other ranks stay quiet."""

    def __init__(self, cfg: TrainerConfig, is_main: bool):
        self.is_main = is_main
        self.progress = cfg.logger.progress_bar
        self.metrics = None
        if is_main:
            from .metrics import MetricsLogger

            self.metrics = MetricsLogger(cfg.logger.log_dir, cfg.logger.tensorboard_enabled)

    def info(self, msg: str) -> None:
        if self.is_main:
            print(f"[efa-ep grpo] {msg}", flush=True)

    def bar(self, total: int, desc: str):
        """tqdm on a terminal; a one-line status every ``_LINE_PERIOD_S`` otherwise (a bar
        redrawn with carriage returns fills a log file with hundreds of KB of noise)."""
        if not (self.is_main and self.progress):
            return None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
        return _LineProgress(total, desc, self.info)


_LINE_PERIOD_S = 30.0


class _LineProgress:
    """The part of tqdm's API the trainer uses, printing ``desc n/total (p%): k=v ..., eta``
    at most every ``_LINE_PERIOD_S`` seconds and at the end."""

    def __init__(self, total: int, desc: str, emit: Callable[[str], None]):
        self.total, self.desc, self.emit = total, desc, emit
        self.n, self.post = 0, {}
        self.t0 = self.last = time.time()

    def set_postfix(self, post=None, **kw):
        self.post = dict(post or {}, **kw)

    def update(self, k: int = 1):
        self.n += k
        now = time.time()
        if now - self.last >= _LINE_PERIOD_S or self.n >= self.total:
            self.last = now
            rate = (now - self.t0) / max(self.n, 1)
            eta = rate * (self.total - self.n)
            post = " ".join(f"{key}={val}" for key, val in self.post.items())
            self.emit(f"{self.desc} {self.n}/{self.total} ({100 * self.n // max(self.total, 1)}%)"
                      + (f": {post}" if post else "")
                      + (f", eta {eta:.0f}s" if self.n < self.total else f", {now - self.t0:.0f}s"))

    def close(self):
        pass
