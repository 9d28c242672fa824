#!/usr/bin/env python3
"""Where does the time of a decode dispatch + combine over ``proxy`` (CUDA inputs) go?

Two ranks as processes on the GPU (MPS on; rank r on GPU r where the host has several;
``--device cpu``: CPU rows, no GPU), the proxy over
``--provider`` with a host window,
DeepSeek-V3 decode shape (H 7168 bf16, top-8 of 256, ``--tokens`` per rank). Each step of an
operation is wrapped with a wall-clock timer (no extra synchronization, so a step's time is what
the calling thread spends in it: launches, copies, waits); rank 0 prints per D+C the mean time
of every step, the sum, and the rest (Python between the steps), and the packed operations'
native calls step by step (their step clock: per dispatch, dispatch finish and combine call,
the calling thread's time in each step). Then a cProfile of rank 0 lists the functions with the
most own time.

    python3 scripts/probes/proxy_host_profile.py [--provider shm] [--iters 200] [--staging kernels|layout|torch]
"""
import argparse
import collections
import cProfile
import inspect
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def _wrap(owner, name, acc):
    fn = getattr(owner, name)
    static = isinstance(inspect.getattr_static(owner, name), staticmethod)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[f"{getattr(owner, '__name__', owner)}.{name}"] += time.perf_counter() - t0
    setattr(owner, name, staticmethod(timed) if static else timed)


STEP_NAMES = ("before", "quiesce", "launch", "wait_reads", "begin", "post", "complete", "reads",
              "done")  # EFA_STEP_* of efa_proxy.h, 0 first
CLOCK_CALLS = ("dispatch", "dispatch_finish", "rows")  # efa_devop.c's kinds of call


def _step_clock(native, on: bool) -> dict:
    """efa_devop_step_clock: per kind of native call, its calls and seconds per step, summed since
    the last read; then reset, on or off."""
    import ctypes

    lib = native.load()
    n = lib.efa_devop_step_clock(int(on), None)
    buf = (ctypes.c_int64 * n)()
    lib.efa_devop_step_clock(int(on), buf)
    per, out = len(STEP_NAMES) + 1, {}
    for i, kind in enumerate(CLOCK_CALLS):
        row = buf[i * per:(i + 1) * per]
        out[kind] = {"calls": row[0], **{s: v * 1e-9 for s, v in zip(STEP_NAMES, row[1:])}}
    return out


def _rank(rank, world, provider, tokens, iters, staging, channels, device="cuda", programs=True,
          lines=False):
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.gda import launches as gda_kernels
    from efa_ep.kernels.proxy import device as device_kernels, native, planned, wire, transport
    from efa_ep.testing.routes import contract_route

    torch.set_num_threads(1)
    if device == "cuda":  # one GPU per rank where the host has several (ranks share one else)
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    px = create_transport("proxy", None, 256, 7168, tokens, torch.bfloat16, provider=provider,
                          num_channels=channels, timeout_s=60)
    px.device_kernels = staging != "torch"
    px.device_layout = staging == "layout"  # (the transport's default for CUDA inputs)
    if not programs:
        px._native_off = "--no-programs"
    idx, w = contract_route("random", tokens, 256, 8, world, seed=rank)
    idx, w = idx.to(dev), w.to(dev)
    x = torch.randn(tokens, 7168, device=dev).to(torch.bfloat16)

    def dc():
        o = px.dispatch(x, idx, w)
        px.combine(o[0], o[4])
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(20):
        dc()
    acc = collections.defaultdict(float)
    # CPU rows on a host window: each op is two native calls (post, complete), timed per kind
    op_call = native.NativeOp.call

    def timed_call(self, kind, step):
        t0 = time.perf_counter()
        try:
            return op_call(self, kind, step)
        finally:
            acc[f"NativeOp.{kind}.{step}"] += time.perf_counter() - t0
    native.NativeOp.call = timed_call
    for owner, names in ((gda_kernels, ["layout"]),
                         (device_kernels, ["pack_dispatch", "gather_dispatch", "reduce_combine"]),
                         (native, ["unpack_meta", "route_layout"]),
                         (wire.Wire, ["quiesce", "begin", "exchange", "finish"]),
                         (transport.ProxyTransport, ["_sync", "_wait_reads", "_pack_rows", "_route",
                                                     "_reduce_torch", "_gather_into", "_checked",
                                                     "_receive_device", "_unpack_meta"]),
                         (planned.PlannedOps, ["_run", "_finish_dispatch"]),
                         (torch.cuda, ["synchronize"])):
        for n in names:
            _wrap(owner, n, acc)
    import torch.distributed as dist

    dist.barrier()
    w0 = px.wire.wait_seconds()
    _step_clock(native, True)
    t0 = time.perf_counter()
    for _ in range(iters):
        dc()
    wall = (time.perf_counter() - t0) / iters
    clock = _step_clock(native, False)
    steps_wait = (px.wire.wait_seconds() - w0) / iters * 1e6
    steps = {k: v / iters * 1e6 for k, v in acc.items()}  # the timed loop's, not cProfile's
    steps["(blocked in the engine's waits, all steps)"] = steps_wait
    for kind, per in clock.items():  # the native calls' steps, per D+C
        if per["calls"]:
            for name in STEP_NAMES[1:]:
                if per[name]:
                    steps[f"native {kind}: {name}"] = per[name] / iters * 1e6
    prof = cProfile.Profile()
    dist.barrier()
    prof.enable()
    for _ in range(min(iters, 100)):
        dc()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    if lines:  # where inside the hot functions (line_profiler's own cost included)
        from efa_ep.kernels.proxy import device_path, hostop, round_ops
        from efa_ep.testing.line_profile import line_profile

        s.write(line_profile([planned.PlannedOps.dispatch, planned.PlannedOps.combine,
                              device_path.DevicePath._dispatch_device,
                               device_path.DevicePath._gather_outputs,
                               round_ops.RoundOps._combine, round_ops.RoundOps._pack_send_area,
                               round_ops.RoundOps._reduce_device, transport.ProxyTransport._guarded,
                               hostop.HostOps._post, hostop.HostOps._begin],
                              dc, min(iters, 200)))
    px.close()
    return wall * 1e6, steps, s.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--channels", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="device of the inputs (cpu: the host-memory path, no GPU needed)")
    ap.add_argument("--staging", default="layout", choices=["kernels", "layout", "torch"],
                    help="layout: the dispatch's layout and packing on the device, the rounds in "
                         "native calls (the default transport); kernels: the receive and "
                         "reduction kernels only, the layout on the host; torch: torch ops only")
    ap.add_argument("--no-programs", action="store_true",
                    help="launch the device kernels from Python (compiled launchers), not as "
                         "native programs")
    ap.add_argument("--lines", action="store_true",
                    help="then a line profile of the hot functions (needs line_profiler)")
    args = ap.parse_args()
    from efa_ep.distributed import run_ranks

    env = {"FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "1"}
    res = run_ranks(_rank, 2, (args.provider, args.tokens, args.iters, args.staging, args.channels,
                                      args.device, not args.no_programs, args.lines),
                    timeout_s=600, env=env)
    for rank, (wall, steps, prof) in enumerate(res):
        print(f"== rank {rank}: {args.device} inputs, {args.staging} staging, "
              f"{'no ' if args.no_programs else ''}native programs, {args.provider}, "
              f"D+C {wall:.1f} us per iteration")
        for k, v in sorted(steps.items(), key=lambda kv: -kv[1]):
            print(f"   {k:45s} {v:9.1f} us")
        print(f"   {'(sum of wrapped steps, nested ones twice)':45s} {sum(steps.values()):9.1f} us")
        if rank == 0:
            print(prof[:40000 if args.lines else 6000])


if __name__ == "__main__":
    main()
