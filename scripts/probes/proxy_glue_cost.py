#!/usr/bin/env python3
"""What a planned proxy dispatch and combine cost outside their native calls, on any machine.

A planned op (a case that ran before) is its native calls (``efa_devop.c``: the round, the
kernels' launches) plus the glue around them: the Python of ``kernels/proxy/planned.py`` or,
where it is built, one C++ call (``efa_proxy_op.cpp``). This measures the glue: two ranks as
processes, the proxy over libfabric tcp on loopback (a real round), CPU tensors, and a stand-in
device (the launch library's entry points replaced by callbacks that do the kernels' work on the
host: the routing layout, the progress words). Per call, the wall time of the transport's method
minus the time inside its native calls (their step clock, ``efa_devop_step_clock``, which also
holds the stand-in kernels' work) is the glue; median over ``--calls`` calls per arm, both arms
(``EFA_EP_PROXY_CPP=1`` and ``0``) in fresh rank processes, slowest rank. The same for
``PlannedOps.dispatch`` / ``combine`` called directly (``planned``): the rest of the glue is the
transport's method around them (its usability check, the failure guard, the op counters).

    python3 scripts/probes/proxy_glue_cost.py [--calls 300] [--repeats 3]
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

E, H, T, K, MAX_T = 8, 256, 64, 2, 64
_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_size_t)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t)


class _ProgramStruct(ctypes.Structure):  # efa_program_t of efa_launch.h
    _fields_ = [("recs", ctypes.c_void_p), ("num_recs", ctypes.c_int64),
                ("uses", ctypes.c_void_p), ("num_uses", ctypes.c_int64),
                ("vars", ctypes.POINTER(ctypes.c_int64)), ("graph_mode", ctypes.c_int64),
                ("graph", ctypes.c_void_p)]


class _Program:
    """A bound program's record whose variables the glue writes; its launch runs ``work``."""

    def __init__(self, work, programs, num_vars):
        self.work, self._vars = work, (ctypes.c_int64 * num_vars)()
        self._rec = _ProgramStruct(vars=ctypes.cast(self._vars, ctypes.POINTER(ctypes.c_int64)))
        self._addr = ctypes.addressof(self._rec)
        programs[self._addr] = self

    def set_vars(self, values):
        self._vars[:] = list(values)


class _Event:
    cuda_event = 77


def _clock_ns(lib) -> int:
    """Nanoseconds inside the packed ops' native calls since the last read (then reset)."""
    n = lib.efa_devop_step_clock(1, None)
    buf = (ctypes.c_int64 * n)()
    lib.efa_devop_step_clock(1, buf)
    per = n // 3
    return sum(sum(buf[i * per + 1:(i + 1) * per]) for i in range(3))


def _rank(rank, world, calls):
    import numpy as np

    from efa_ep.kernels import create_transport
    from efa_ep.kernels.proxy import native
    from efa_ep.kernels.proxy.planned import PlannedOps, _combine_key, _dispatch_key
    from efa_ep.testing.routes import contract_route

    torch.set_num_threads(1)
    px = create_transport("proxy", None, E, H, MAX_T, torch.float32, provider="tcp",
                          num_channels=2, timeout_s=60)
    px._native_off = None
    planned = px._planned = PlannedOps.create(px)
    programs = {}

    def run(prog, stream, err, n):
        programs[prog].work(tuple(programs[prog]._vars))
        return 0

    keep = (_CB(run), _CB(lambda ev, stream, err, n: 0), _WAIT(lambda ev, err, n: 0))
    planned._fns = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in keep)
    W, cap = world, T * min(world, K)
    counts = torch.zeros(2 + W + E, dtype=torch.int64)
    meta = torch.zeros(cap * 2 * K, dtype=torch.int64)
    progress = torch.zeros(4, dtype=torch.int64)
    in_idx, in_w = torch.zeros(W * MAX_T * K, dtype=torch.int64), torch.zeros(W * MAX_T * K)
    recv_off = torch.zeros(W + 1, dtype=torch.int64)
    num_send, cnt = np.zeros(W, np.int64), np.zeros(E, np.int64)
    scratch, flags = np.zeros(2 * W, np.int64), np.zeros(1, np.int64)

    def front(v):  # the layout and count block (the rows' bytes do not matter here)
        xp, ip, wp, sp = v
        native.route_layout(ip, wp, T, K, E, W, sp, meta.data_ptr(), cap, num_send.ctypes.data,
                            cnt.ctypes.data, scratch.ctypes.data, flags.ctypes.data)
        counts[0] = 0
        counts[1:1 + W] = torch.from_numpy(num_send)
        counts[1 + W:1 + W + E] = torch.from_numpy(cnt)
        progress.fill_(1 << 40)
        counts[-1] = 1

    x = torch.randn(T, H)
    idx, w = contract_route("random", T, E, K, world, seed=rank)
    planned.plan_dispatch(_dispatch_key(x, idx, w), x.device, _Program(front, programs, 4),
                          _Program(lambda v: None, programs, 9), _Event(), counts, meta,
                          progress, 1, cap, 0, in_idx, in_w, recv_off)

    def pack(v):
        op = planned.plans[_combine_key(y, T)].op
        ctypes.memset(op.progress, 0x7f, 8 * op.progress_words)  # every chunk stored

    out = px.dispatch(x, idx, w)
    y = torch.randn(out[0].shape[0], H)
    planned.plan_rows(_combine_key(y, T), y, _Program(pack, programs, 6),
                      _Program(lambda v: None, programs, 7), _Event())
    lib = native.load()
    times = {k: [] for k in ("dispatch", "combine", "planned dispatch", "planned combine")}
    import torch.distributed as dist

    for i in range(2 * calls + 20):
        direct = i % 2  # every other D+C straight through PlannedOps (same rounds)
        dispatch, combine = ((planned.dispatch, planned.combine) if direct
                             else (px.dispatch, px.combine))
        dist.barrier()
        _clock_ns(lib)
        t0 = time.perf_counter_ns()
        out = dispatch(x, idx, w)
        t1 = time.perf_counter_ns()
        d_native = _clock_ns(lib)
        t2 = time.perf_counter_ns()
        combine(y, out[4])
        t3 = time.perf_counter_ns()
        c_native = _clock_ns(lib)
        if i >= 20:
            pre = "planned " if direct else ""
            times[pre + "dispatch"].append((t1 - t0 - d_native) * 1e-3)
            times[pre + "combine"].append((t3 - t2 - c_native) * 1e-3)
    assert planned.calls["dispatch"] >= 2 * calls, planned.calls
    res = {k: statistics.median(v) for k, v in times.items()}
    res["cpp_calls"], res["cpp_off"] = dict(planned.cpp_calls), planned.cpp_off
    px.close()
    return res


KINDS = ("dispatch", "combine", "planned dispatch", "planned combine")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from efa_ep.distributed import run_ranks

    env = {"FI_TCP_IFACE": "lo", "FI_PROVIDER": "tcp", "OMP_NUM_THREADS": "1"}
    best = {}
    for rep in range(args.repeats):
        for arm, flag in (("cpp", "1"), ("python", "0")):
            out = run_ranks(_rank, 2, (args.calls,), timeout_s=600, pg_timeout_s=120,
                            env=dict(env, EFA_EP_PROXY_CPP=flag))
            worst = {k: max(r[k] for r in out) for k in KINDS}
            print(f"repeat {rep} {arm:6s}: glue per call, slowest rank's median, us: " + ", ".join(
                f"{k} {worst[k]:.1f}" for k in KINDS)
                + f" (C++ calls {out[0]['cpp_calls']}; off: {out[0]['cpp_off']})", flush=True)
            for k, v in worst.items():
                best[arm, k] = min(best.get((arm, k), v), v)
    print("best of repeats, us per call (python / cpp): " + ", ".join(
        f"{k} {best['python', k]:.1f} / {best['cpp', k]:.1f}" for k in KINDS))


if __name__ == "__main__":
    main()
