"""Assert metric thresholds on a GRPO run, like NeMo-RL's ``tests/check_metrics.py``.

    python -m efa_ep.recipes.checks.check_metrics <metrics.jsonl | log dir> 'expr' ['expr' ...]

``data[metric][step]`` (steps as strings, as NeMo-RL's JSON dump has them) comes from the built-in
trainer's ``metrics.jsonl`` or, for NeMo-RL runs, from the TensorBoard event files under the log
dir. Helpers: ``min``, ``max``, ``mean(series, start=None, end=None)`` (Python slice over the
step-ordered values; ``mean(s, -11, -1)`` = 10 steps before the last), ``median``,
``ratio_above(series, x)``, ``last(series)``, ``first(series)``. Exit status 1 if any fails.
"""
from __future__ import annotations

import builtins
import glob
import json
import os
import statistics
import sys
from typing import Dict


def _ordered(series):
    if isinstance(series, dict):
        return [v for _, v in sorted(series.items(), key=lambda kv: float(kv[0]))]
    return list(series)


def load_metrics(path: str) -> Dict[str, Dict[str, float]]:
    """``{metric: {step: value}}`` from a JSONL file, a dir with ``metrics.jsonl``, or a dir of
    TensorBoard event files (searched recursively; the newest run dir wins on conflicts)."""
    if os.path.isdir(path):
        jsonl = sorted(glob.glob(os.path.join(path, "**", "metrics.jsonl"), recursive=True),
                       key=os.path.getmtime)
        if jsonl:
            path = jsonl[-1]
    data: Dict[str, Dict[str, float]] = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                step = str(row.pop("step"))
                for k, v in row.items():
                    if isinstance(v, (int, float)):
                        data.setdefault(k, {})[step] = float(v)
        return data
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no metrics.jsonl or TensorBoard events under {path}")
    for d in dict.fromkeys(os.path.dirname(f) for f in files):
        acc = EventAccumulator(d, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                data.setdefault(tag, {})[str(ev.step)] = float(ev.value)
    return data


def helpers() -> dict:
    def mean(series, start=None, end=None, ignore_top_p=0.0):
        vals = _ordered(series)[start:end]
        if ignore_top_p:
            vals = sorted(vals)[: max(1, int(len(vals) * (1 - ignore_top_p)))]
        return statistics.fmean(vals)

    return {
        "min": lambda s: builtins.min(_ordered(s)), "max": lambda s: builtins.max(_ordered(s)),
        "mean": mean, "median": lambda s: statistics.median(_ordered(s)),
        "ratio_above": lambda s, x: sum(v > x for v in _ordered(s)) / len(_ordered(s)),
        "first": lambda s: _ordered(s)[0], "last": lambda s: _ordered(s)[-1],
    }


def check(data, expressions) -> bool:
    ok = True
    env = {"data": data, **helpers()}
    for expr in expressions:
        try:
            passed = bool(eval(expr, {"__builtins__": {}}, env))
            detail = ""
        except Exception as e:  # a missing metric is a failure, reported as such
            passed, detail = False, f" ({type(e).__name__}: {e})"
        print(f"{'PASS' if passed else 'FAIL'}: {expr}{detail}", flush=True)
        ok &= passed
    return ok


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__)
        return 2
    return 0 if check(load_metrics(argv[0]), argv[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
