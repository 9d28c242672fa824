#!/usr/bin/env python3
"""Host time of kernel launches against CUDA graph launches, ranks as processes on one GPU.

Answers whether running an op's kernels as one small CUDA graph (its nodes' parameters set per
call, then one ``cuGraphLaunch``) costs the host less than launching them one by one
(``cuLaunchKernel``, what ``kernels/native/efa_launch.c`` does). Each rank process launches a
Triton kernel with ``--params`` runtime arguments (like the transport's kernels) and ``--grid``
programs, per call: ``n`` launches (kind ``launch``), one graph of ``n`` nodes with every node's
parameters set first (``graph_set``) or not (``graph``), for n = 1, 2, 3; the kinds alternate in
rounds. Reports each rank's median host time per call and writes JSON.

    python3 scripts/probes/launch_cost.py [--ranks 2] [--calls 400] [--rounds 6] [--out F]

Needs a GPU, a C compiler and Triton; start MPS first when ranks > 1 share the GPU.
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _lib():
    out = os.path.join(tempfile.gettempdir(), f"liblaunch_cost_{os.getuid()}.so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", os.path.join(HERE, "launch_cost.c"), "-ldl",
                    "-o", out], check=True)
    lib = ctypes.CDLL(out)
    lib.measure.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                            ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_int64,
                            ctypes.c_int, ctypes.c_void_p]
    lib.num_params.argtypes = [ctypes.c_int64]
    return lib


def _kernel(nargs: int):
    import triton

    names = [f"a{i}" for i in range(nargs - 1)]
    src = (f"def k(p, {', '.join(names)}):\n"
           f"    if tl.program_id(0) == 0:\n"
           f"        tl.store(p, {' + '.join(names)})\n")
    path = os.path.join(tempfile.gettempdir(), f"launch_cost_kernel_{nargs}.py")
    with open(path, "w") as f:
        f.write("import triton.language as tl\n" + src)
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"launch_cost_kernel_{nargs}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return triton.jit(do_not_specialize=names)(mod.k), names


def _rank(rank, args, q):
    torch.cuda.set_device(0)
    lib = _lib()
    if lib.init():
        q.put((rank, {"error": "driver entry points missing"}))
        return
    kern, names = _kernel(args.params)
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    ck = kern[(args.grid,)](out, *range(3, 3 + len(names)), num_warps=4)
    ck._init_handles()
    fn = ck.function
    n = lib.num_params(fn)
    values = (ctypes.c_int64 * 64)(out.data_ptr(), *range(3, 3 + n - 1))
    stream = torch.cuda.current_stream().cuda_stream
    torch.cuda.synchronize()
    res = {}
    ns = (ctypes.c_int64 * args.calls)()
    kinds = [("launch", 0), ("graph_set", 1), ("graph", 2)]
    for _ in range(args.rounds):
        for nk in (1, 2, 3):
            for name, kind in kinds:
                vals = (ctypes.c_int64 * 64)(*values)  # (slot 1 changes per call, in C)
                rc = lib.measure(kind, fn, nk, vals, n, args.grid, 128, stream, args.calls, ns)
                if rc:
                    q.put((rank, {"error": f"{name} n={nk}: CUDA error {rc}"}))
                    return
                res.setdefault(f"{name}{nk}", []).append(statistics.median(ns) / 1e3)
    q.put((rank, {"params": n, "grid": args.grid,
                  "median_us": {k: statistics.median(v) for k, v in res.items()},
                  "round_medians_us": res}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--params", type=int, default=24, help="runtime arguments of the kernel")
    ap.add_argument("--grid", type=int, default=66)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    for r in sorted(got):
        med = got[r].get("median_us", got[r])
        print(f"rank {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              if isinstance(med, dict) and "error" not in med else f"rank {r}: {med}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": args.ranks, "calls": args.calls, "rounds": args.rounds,
                       "results": got}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
