#!/usr/bin/env python3
"""Probe (GPU, MPS on): does a spinning kernel of one process block another process's host calls?

Two processes share one GPU as MPS clients. Process A launches a Triton kernel (``--spin-programs``
programs of 4 warps) that spins for ``--spin-s`` seconds on ``%globaltimer`` (no flags, no peers). While it spins, process B
times host calls that may need the CUDA context idle:

    triton_module_load   loading an already compiled Triton kernel (``_init_handles``:
                         cuModuleLoadData), what a kernel's first use in a process does
    torch_lazy_kernel    first launch of a torch kernel never used in this process (CUDA lazy
                         loading of a library module)
    cuda_malloc          a new 1 GiB block from the caching allocator (cudaMalloc)
    loaded_launch_sync   launch of an already loaded kernel plus a sync of B's own stream

and the same calls once more with nobody spinning (the control). ``--same-process``: the spin runs
on a side stream of the process that times the calls. A call that takes about the
spin time while A spins, and milliseconds in the control, waits for A's kernel: a wait that
spins until B issues a store would then never end (until its deadline). Prints one JSON line.

    python3 scripts/probes/gda_stall_probe.py [--spin-s 3]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _spin_kernel_src():
    import triton
    import triton.language as tl

    @triton.jit
    def spin(out_ptr, ns):
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                       is_pure=False, pack=1)
        t = t0
        while t - t0 < ns:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                          is_pure=False, pack=1)
        tl.store(out_ptr, t - t0)

    @triton.jit
    def add_one(x_ptr, C: tl.constexpr):
        tl.store(x_ptr, tl.load(x_ptr) + C)

    return spin, add_one


CALLS = ("triton_module_load", "torch_lazy_kernel", "cuda_malloc", "loaded_launch_sync")


def _proc_a(ev_ready, go, done, spin_s, programs, q):
    import torch

    spin, _ = _spin_kernel_src()
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    spin[(1,)](out, 1000)  # loaded now
    torch.cuda.synchronize()
    ev_ready.set()
    for i in range(len(CALLS)):
        go[i].wait()
        spin[(programs,)](out, int(spin_s * 1e9))
        torch.cuda.synchronize()
        done[i].set()


def _call(name, variant):
    """Times one host call; ``variant`` makes every call new to the process (no cache)."""
    import torch

    if name == "triton_module_load":
        _, add_one = _spin_kernel_src()
        x = torch.zeros(1, dtype=torch.float32, device="cuda")
        ck = add_one.warmup(x, C=variant, grid=(1,))  # compiled, not loaded yet
        t0 = time.perf_counter()
        ck._init_handles()
    elif name == "torch_lazy_kernel":
        y = torch.rand(4096, device="cuda")
        fn = [torch.special.bessel_j0, torch.special.bessel_j1][variant - 1]
        t0 = time.perf_counter()
        fn(y)
    elif name == "cuda_malloc":
        t0 = time.perf_counter()
        big = torch.empty((1 << 30) * variant, dtype=torch.uint8, device="cuda")
        del big
    else:
        x = torch.zeros(1, device="cuda")
        torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        x.add_(1)
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - t0


def _proc_b(ev_ready, go, done, spin_s, q):
    import torch

    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    ev_ready.wait()
    res = {}
    for i, name in enumerate(CALLS):
        go[i].set()
        time.sleep(0.3)  # A's kernel is spinning now
        res[f"while_spinning.{name}_s"] = _call(name, 1)
        done[i].wait()
    for name in CALLS:
        res[f"control.{name}_s"] = _call(name, 2)
    q.put(res)


def _same_process(spin_s, programs):
    """The spinning kernel and the timed calls in one process (one context, one stream each)."""
    import torch

    spin, _ = _spin_kernel_src()
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    spin[(1,)](out, 1000)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    res = {}
    for variant, tag in ((1, "while_spinning"), (2, "control")):
        for name in CALLS:
            if tag == "while_spinning":
                with torch.cuda.stream(side):
                    spin[(programs,)](out, int(spin_s * 1e9))
                time.sleep(0.3)
            res[f"{tag}.{name}_s"] = _call(name, variant)
            torch.cuda.synchronize()
    return res


def main():
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spin-s", type=float, default=3.0)
    ap.add_argument("--spin-programs", type=int, default=1, help="programs of the spinning grid")
    ap.add_argument("--same-process", action="store_true",
                    help="spin on a side stream of the process that times the calls")
    args = ap.parse_args()
    if args.same_process:
        res = {"spin_s": args.spin_s, "spin_programs": args.spin_programs, "same_process": True}
        res.update({k: round(v, 4) for k, v in _same_process(args.spin_s,
                                                             args.spin_programs).items()})
        print(json.dumps(res))
        return
    ctx = mp.get_context("spawn")
    ev_ready, q = ctx.Event(), ctx.Queue()
    go, done = [ctx.Event() for _ in CALLS], [ctx.Event() for _ in CALLS]
    pa = ctx.Process(target=_proc_a, args=(ev_ready, go, done, args.spin_s, args.spin_programs, q))
    pb = ctx.Process(target=_proc_b, args=(ev_ready, go, done, args.spin_s, q))
    pa.start(), pb.start()
    res = {"spin_s": args.spin_s, "spin_programs": args.spin_programs, "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
           "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default: lazy)")}
    res.update({k: round(v, 4) for k, v in q.get(timeout=120).items()})
    pa.join(30), pb.join(30)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
