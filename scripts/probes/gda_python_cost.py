#!/usr/bin/env python3
"""The Python host cost of gda's eager ops, on a machine without a GPU.

A :class:`~efa_ep.kernels.gda.GdaTransport` is assembled around CPU tensors (no windows, no
peers) with a stand-in for its native library (:mod:`efa_ep.testing.gda_host`: binds each
program's variables, launches nothing, writes plausible counts where a header kernel would). Every dispatch, combine, cached dispatch and weight combine then runs the transport's
real Python path, bound plans and native-call argument packing included, and the wall time per
call is what that Python costs. Use it to compare two versions of the hot path on the CPU
machine; device costs (launches, waits) are not in it: measure those on a GPU with
``scripts/gpu/gda_gpu_check.py``. The machine's speed drifts: compare versions in one run of
this script each, alternated, and read the best of several medians.

    python3 scripts/probes/gda_python_cost.py [--calls 2000] [--repeats 6] [--paths python,cpp]
        [--fixed | --rows-in-window] [--tokens 4096] [--profile]

``--fixed``: the fixed-capacity dispatch (``dispatch_fixed``) and the ops along its handle.
``--rows-in-window``: the regular dispatch with its rows stored compact and read in the window
(option ``rows_in_window``, the large-batch path of ``auto``; the window in host memory).

Shape: DeepSeek-V3 (H 7168 bf16, top-8 of 256, ``--tokens`` per rank: 128, decode), EP 2.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from efa_ep.testing.gda_host import (  # noqa: E402
    header_info, host_only_transport, stand_in_library, with_host_window,
)

W, E, H, T_MAX, K, T = 2, 256, 7168, 4096, 8, 128


def _calls(tr, x, idx, w, calls: int):
    """``calls`` rounds of the four ops: the median seconds of each."""
    times = ([], [], [], [])
    dispatch = tr.dispatch_fixed if tr.probe_fixed else tr.dispatch
    for _ in range(calls):
        t0 = time.perf_counter()
        r = dispatch(x, idx, w)
        t1 = time.perf_counter()
        tr.combine(r[0], r[-1])
        t2 = time.perf_counter()
        tr.dispatch_cached(x, r[-1])
        t3 = time.perf_counter()
        tr.combine_topk_weights(r[2], r[-1])
        t4 = time.perf_counter()
        for acc, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            acc.append(dt)
    return [statistics.median(acc) * 1e6 for acc in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls of each op per repeat")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--paths", default="python",
                    help="comma list: python (fast_launch 3), cpp (4: the C++ dispatch); the "
                         "paths alternate within each repeat")
    ap.add_argument("--fixed", action="store_true",
                    help="time dispatch_fixed and the ops along its handle")
    ap.add_argument("--rows-in-window", action="store_true",
                    help="time the regular dispatch with its rows read in the window")
    ap.add_argument("--tokens", type=int, default=T,
                    help="tokens per rank (default 128: decode; 4096: prefill)")
    ap.add_argument("--profile", action="store_true", help="then a cProfile of D+C")
    a = ap.parse_args()
    t = a.tokens
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        L = E // W
        lib = stand_in_library(tmp)
        # T rows from each source, T to each destination, 8 (token, expert) pairs per expert
        trs = {p: host_only_transport(lib, world=W, num_experts=E, hidden=H, t_max=T_MAX,
                                      info=header_info(W, L, [t] * W, [t] * W,
                                                       [t * W * K // E] * L),
                                      cpp=p == "cpp")
               for p in a.paths.split(",")}
        x = torch.randn(t, H).to(torch.bfloat16)
        idx = torch.randint(0, E, (t, K))
        w = torch.rand(t, K)
        for tr in trs.values():
            if a.rows_in_window:
                with_host_window(tr)
            tr.probe_fixed = a.fixed
            dispatch = tr.dispatch_fixed if a.fixed else tr.dispatch
            for _ in range(200):  # binds every program and plan
                r = dispatch(x, idx, w)
                tr.combine(r[0], r[-1])
                tr.dispatch_cached(x, r[-1])
                tr.combine_topk_weights(r[2], r[-1])
        best = {}
        for _ in range(a.repeats):
            for p, tr in trs.items():
                med = _calls(tr, x, idx, w, a.calls)
                best[p] = med if p not in best else [min(b, m) for b, m in zip(best[p], med)]
        for p, b in best.items():
            print("%s: Python host cost per call, best of %d medians of %d calls (us): dispatch "
                  "%.1f, combine %.1f, cached dispatch %.1f, weight combine %.1f"
                  % ((p, a.repeats, a.calls) + tuple(b)))
        if a.profile:
            import cProfile
            import pstats
            tr = next(iter(trs.values()))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                r = tr.dispatch_fixed(x, idx, w) if a.fixed else tr.dispatch(x, idx, w)
                tr.combine(r[0], r[-1])
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
