"""Statistics of the benchmark: slowest rank, per-start medians, honest intervals.

Why the interval logic is careful (an EP benchmark's published intervals were [min, max] by
construction): a percentile bootstrap of the median over n starts returns exactly [min, max] whenever the
probability that a resampled median equals the sample minimum is at least alpha/2 (for n=3 that
probability is 7/27 = 0.26). Such an interval carries no confidence information. So a bootstrap
interval is reported only when n >= ``min_n_for_ci`` *and* that probability is below alpha/2;
otherwise the summary gives min / median / max and says why.
"""
from __future__ import annotations

import math
import random
import statistics
from typing import Dict, List, Optional, Sequence


def slowest_rank(times_per_rank: Sequence[Sequence[float]]) -> List[float]:
    """``[ranks][iterations]`` -> ``[iterations]``: per iteration, the time of the slowest rank
    (an all-to-all finishes when its last rank finishes)."""
    if not times_per_rank:
        return []
    n = len(times_per_rank[0])
    if any(len(t) != n for t in times_per_rank):
        raise ValueError(f"ranks reported different iteration counts: {[len(t) for t in times_per_rank]}")
    return [max(t[i] for t in times_per_rank) for i in range(n)]


def median_collapse_probability(n: int) -> float:
    """P(the bootstrap median of n distinct values equals the sample minimum).

    The resampled median equals the minimum iff at least floor(n/2)+1 of the n draws hit the
    minimum (each with probability 1/n). By symmetry the same holds for the maximum."""
    if n < 1:
        return 1.0
    need = n // 2 + 1
    p = 1.0 / n
    return sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(need, n + 1))


def bootstrap_median_ci(values: Sequence[float], alpha: float = 0.05, n_boot: int = 2000,
                        seed: int = 0):
    """Percentile bootstrap interval of the median (seeded, so reruns agree)."""
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(n_boot))
    lo = meds[max(0, int(math.floor(alpha / 2 * n_boot)))]
    hi = meds[min(n_boot - 1, int(math.ceil((1 - alpha / 2) * n_boot)) - 1)]
    return lo, hi


def summarize(values: Sequence[float], alpha: float = 0.05, min_n_for_ci: int = 10,
              n_boot: int = 2000, seed: int = 0) -> Dict[str, object]:
    """n, min, median, max always; a bootstrap interval of the median only where it can carry
    information (see module docstring). ``interval`` is ``"bootstrap"`` or ``"min-median-max"``
    and ``interval_note`` says why."""
    vals = sorted(float(v) for v in values)
    n = len(vals)
    out: Dict[str, object] = {"n": n}
    if n == 0:
        out.update(median=None, min=None, max=None, interval="none", interval_note="no samples")
        return out
    out.update(median=statistics.median(vals), min=vals[0], max=vals[-1])
    collapse = median_collapse_probability(n)
    if n < min_n_for_ci:
        out.update(interval="min-median-max", ci_low=None, ci_high=None,
                   interval_note=f"n={n} < {min_n_for_ci}: no interval, report min/median/max "
                                 f"(a bootstrap would be [min, max] with probability "
                                 f"{collapse:.2f} per bound)")
    elif collapse >= alpha / 2:
        out.update(interval="min-median-max", ci_low=None, ci_high=None,
                   interval_note=f"n={n}: bootstrap would collapse to [min, max] "
                                 f"(P={collapse:.3f} >= {alpha / 2})")
    else:
        lo, hi = bootstrap_median_ci(vals, alpha, n_boot, seed)
        out.update(interval="bootstrap", ci_low=lo, ci_high=hi, ci_level=1 - alpha,
                   interval_note=f"percentile bootstrap of the median, {n_boot} resamples")
    return out


def format_stats(s: Dict[str, object], scale: float = 1.0, unit: str = "") -> str:
    """``"123.4 [120.1, 130.2] (n=20)"`` or ``"123.4 (min 110.0, max 140.0, n=5)"``."""
    if not s.get("n"):
        return "-"
    med = s["median"] * scale
    if s["interval"] == "bootstrap":
        return f"{med:.1f}{unit} [{s['ci_low'] * scale:.1f}, {s['ci_high'] * scale:.1f}] (n={s['n']})"
    return f"{med:.1f}{unit} (min {s['min'] * scale:.1f}, max {s['max'] * scale:.1f}, n={s['n']})"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b
