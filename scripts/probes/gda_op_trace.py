#!/usr/bin/env python3
"""Where the host time of an eager gda dispatch and combine goes, per step, with peers.

EP ranks as processes on one GPU (MPS on), DeepSeek-V3 shape (H 7168 bf16, top-8 of 256,
``--tokens`` per rank, default 128: decode), the default ``fast_launch=4`` (``--options``
k=v,... sets others): after warm-up every dispatch and combine goes through its one C++ call
(:mod:`efa_ep.kernels.gda.cpp_op`), whose host-time trace is turned on here. Per op, medians
over ``--iters`` calls of the slowest rank, microseconds:

* ``py_in``: from the Python call to the C++ call's entry (the transport's Python before it);
* ``cpp_pre``: the C++ call's input check, allocations and program variables;
* ``launch``: the native call minus its waits (the kernel launches, the count check);
* ``gate``, ``sync``: the native call's waits for the peers (launch gate) and the device;
* ``cpp_post``: after the native call until the result is built (views, counts), of which
  ``ids_copy`` (a compact dispatch's: ``rows_in_window``) allocates and copies the received ids;
* ``py_out``: from there back to the caller (the result tuple, the handle, Python after it);
* ``free``: dropping the previous call's outputs and handle (the caller's, outside the call).

    python3 scripts/probes/gda_op_trace.py [--worlds 2,4] [--iters 300] [--tokens 4096] \
        [--options rows_in_window=1] [--out FILE.json]
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

STEPS = ("py_in", "cpp_pre", "launch", "gate", "sync", "cpp_post", "ids_copy", "py_out",
         "wall", "free")


def _steps(p0, p1, tr, free_ns=0):
    """The steps (us) of one op from its Python bounds ``p0``/``p1``, the C++ trace and the
    time its caller took to drop the previous call's result."""
    t0, t1, t2, t3, sync, gate, c0, c1 = tr
    native = t2 - t1
    return dict(py_in=(t0 - p0) / 1e3, cpp_pre=(t1 - t0) / 1e3,
                launch=(native - sync - gate) / 1e3, gate=gate / 1e3, sync=sync / 1e3,
                cpp_post=(t3 - t2) / 1e3, ids_copy=(c1 - c0) / 1e3, py_out=(p1 - t3) / 1e3,
                wall=(p1 - p0) / 1e3, free=free_ns / 1e3)


def _rank(rank, world, iters, tokens, options):
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    tr = create_transport("gda", None, 256, 7168, max(4096, tokens), torch.bfloat16,
                          **{"timeout_s": 60, **options})
    cpp = tr._phases.cpp
    if cpp is None:
        raise RuntimeError(f"the C++ dispatch is off here: {tr._phases.cpp_off}")
    idx, w = contract_route("random", tokens, 256, 8, world, seed=1234 + rank)
    idx, w = idx.to(dev), w.to(dev)
    x = torch.randn(tokens, 7168, device=dev).to(torch.bfloat16)
    for _ in range(20):
        r = tr.dispatch(x, idx, w)
        tr.combine(r[0], r[-1])
    torch.cuda.synchronize()
    dist.barrier()
    clock = time.perf_counter_ns
    disp, comb = [], []
    cpp.trace(True)
    for _ in range(iters):
        p0 = clock()
        rn = tr.dispatch(x, idx, w)
        p1 = clock()
        td = cpp.trace(True)
        f0 = clock()
        r = rn  # (the previous call's outputs and handle go here)
        f1 = clock()
        p2 = clock()
        tr.combine(r[0], r[-1])
        p3 = clock()
        tc = cpp.trace(True)
        if td[0] < p0 or tc[0] < p2:
            raise RuntimeError("a call did not take the C++ path (no trace stamp)")
        disp.append(_steps(p0, p1, td, f1 - f0))
        comb.append(_steps(p2, p3, tc))
        del rn
    cpp.trace(False)
    torch.cuda.synchronize()
    dist.barrier()
    out = {op: {s: statistics.median(c[s] for c in calls) for s in STEPS}
           for op, calls in (("dispatch", disp), ("combine", comb))}
    out["copies"] = _copy_costs(r[2], iters, clock)
    return out


def _copy_costs(rows, iters: int, clock):
    """Host time (us, median, no device wait) of copying ``rows`` (a dispatch output: with
    ``rows_in_window`` a view of the window) with ``clone``, against the same for a tensor of
    the caching allocator and for an empty allocation alone."""
    plain = torch.empty_like(rows)
    res = {}
    for name, fn in (("clone_output", rows.clone), ("clone_plain", plain.clone),
                     ("empty_like", lambda: torch.empty_like(plain))):
        ts = []
        for _ in range(iters):
            t0 = clock()
            fn()
            ts.append((clock() - t0) / 1e3)
        res[name] = statistics.median(ts)
    torch.cuda.synchronize()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    ap.add_argument("--options", default="", help="gda options k=v,...")
    ap.add_argument("--out", default=None, help="JSON record of every rank's medians")
    a = ap.parse_args()
    from efa_ep.distributed import run_ranks
    from efa_ep.kernels.options import parse_options_text, validate_options

    options = validate_options("gda", parse_options_text(a.options, "--options"),
                               where="--options")

    record = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), iters=a.iters,
                  tokens=a.tokens, options=options,
                  torch=torch.__version__, device=torch.cuda.get_device_name(0), worlds={})
    for world in (int(v) for v in a.worlds.split(",")):
        res = run_ranks(_rank, world, (a.iters, a.tokens, options), timeout_s=300, pg_timeout_s=250,
                        env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
        record["worlds"][world] = res
        for op in ("dispatch", "combine"):
            slow = max(res, key=lambda r: r[op]["wall"])[op]
            print(f"EP {world} {op:8s} (slowest rank, median us): " +
                  ", ".join(f"{s} {slow[s]:.1f}" for s in STEPS), flush=True)
        print(f"EP {world} copies of recv_topk_weights {res[0]['copies']} (rank 0, host us)",
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
