"""A line profile of a few hot functions, for the host-cost probes (``scripts/probes``); needs
the optional ``line_profiler`` package."""
from __future__ import annotations

import io
from typing import Callable, Sequence


def line_profile(fns: Sequence[Callable], step: Callable[[], object], calls: int) -> str:
    """Runs ``step()`` ``calls`` times under line_profiler over ``fns``; returns its report
    (microseconds; line_profiler's own cost is in the times, roughly tripling them)."""
    from line_profiler import LineProfiler

    lp = LineProfiler(*fns)
    lp.enable()
    for _ in range(calls):
        step()
    lp.disable()
    out = io.StringIO()
    lp.print_stats(stream=out, output_unit=1e-6, stripzeros=True)
    return out.getvalue()
