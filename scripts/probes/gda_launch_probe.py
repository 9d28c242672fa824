#!/usr/bin/env python3
"""Host cost of the pieces of a gda op, one process on the GPU (no peers): a Triton launch
through ``kernel[grid]`` and through :class:`efa_ep.kernels.launch.FastKernel` (1 and 30
arguments), a native program (:class:`efa_ep.kernels.native_launch.Program`) of 1 and 3 empty
kernels, ``torch.empty`` on the device, a small device-to-host copy, and the gda wait wrapper.
Median of ``--iters`` host-timed calls each, microseconds; the stream is synchronized between
groups, never inside one. Run several at once (MPS on) to see what launches cost when ranks
share the GPU.

    python3 scripts/probes/gda_launch_probe.py [--iters 2000] [--threads N]
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _empty1(p):
    pass


@triton.jit
def _empty30(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9,
             C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
             C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr,
             C8: tl.constexpr, C9: tl.constexpr):
    pass


def _time(fn, iters):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from efa_ep.kernels.gda import launches as kern
    from efa_ep.kernels.launch import FastKernel

    dev = torch.device("cuda", 0)
    t = torch.zeros(64, dtype=torch.int64, device=dev)
    ts = [torch.zeros(16, dtype=torch.int64, device=dev) for _ in range(10)]
    args30 = tuple(ts) + tuple(range(3, 13)) + tuple(range(10))
    f1, f30 = FastKernel(_empty1), FastKernel(_empty30)
    from efa_ep.kernels import native_launch as nl
    stream = torch.cuda.current_stream(dev).cuda_stream
    native = {}
    if nl.availability() is None:
        for n in (1, 3):
            prog = nl.Program([nl.KernelStep(f1, (1,), (t,), 4)] * n, (t,))
            native[f"native_{n}x1arg"] = _time(lambda: prog.run((t.data_ptr(),), stream),
                                               a.iters)
    sig = torch.zeros(4, dtype=torch.int32, device=dev) + 5
    err = torch.zeros(3, dtype=torch.int64, device=dev)
    res = dict(
        mps="CUDA_MPS_PIPE_DIRECTORY" in os.environ, pid=os.getpid(),
        torch_threads=torch.get_num_threads(), fast_enabled=f1.enabled,
        jit_1arg=_time(lambda: _empty1[(1,)](t), a.iters),
        fast_1arg=_time(lambda: f1.launch((1,), (t,), 4), a.iters),
        jit_30arg=_time(lambda: _empty30[(1,)](*args30), a.iters),
        fast_30arg=_time(lambda: f30.launch((1,), args30, 4), a.iters),
        **native,
        torch_empty=_time(lambda: torch.empty(128, 7168, dtype=torch.bfloat16, device=dev),
                          a.iters),
        d2h_small=_time(lambda: t.cpu(), a.iters // 4),
        wait_wrapper=_time(lambda: kern.wait_for_sources(
            sig, err, epoch=1, kind="combine", timeout_ns=10**9, max_spins=2**31 - 1,
            use_globaltimer=True), a.iters),
        cpu_sum=_time(lambda: torch.arange(130).view(2, 65)[:, 2:].sum(0), a.iters),
    )
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}))


if __name__ == "__main__":
    main()
