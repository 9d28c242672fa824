#!/usr/bin/env python3
"""What does one launch of the proxy's device kernels cost on this GPU host (one process)?

Times, per call and without synchronizing between calls, the host wall time of: a trivial
Triton kernel, ``torch.index_select`` of a decode's rows, and the proxy's receive kernel
(``gather_dispatch``) and combine reduction (``reduce_combine``) at the DeepSeek-V3 decode shape
(H 7168 bf16, top-8, 128 tokens, EP 2) with their host buffers in pinned memory; then the same
calls with a stream synchronization after each (launch + kernel + sync). Median of ``--iters``.

    python3 scripts/probes/proxy_launch_probe.py [--iters 200]
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
def _noop_kernel(p, n):
    if tl.program_id(0) == 0:
        tl.store(p, n)


def _time(fn, iters, sync):
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.current_stream().synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from efa_ep.kernels.proxy import device as dk

    dev = torch.device("cuda", 0)
    T, H, K, W, me = 128, 7168, 8, 2, 0
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    n = T  # rows received from the peer + own rows
    n_peer = T // 2
    send_idx = torch.arange(T, device=dev, dtype=torch.int64)
    window = torch.zeros(W * n_peer * H * 2 + 4096, dtype=torch.uint8, pin_memory=True)
    src_ptrs = torch.tensor([window.data_ptr(), window.data_ptr()], dtype=torch.int64, device=dev)
    recv_off = torch.tensor([0, T - n_peer, T], dtype=torch.int64, pin_memory=True)
    in_idx = torch.zeros(n, K, dtype=torch.int64, pin_memory=True)
    in_w = torch.zeros(n, K, dtype=torch.float32, pin_memory=True)
    out_x = torch.empty(n, H, dtype=torch.bfloat16, device=dev)
    out_idx = torch.empty(n, K, dtype=torch.int64, device=dev)
    out_w = torch.empty(n, K, dtype=torch.float32, device=dev)
    send_off = torch.tensor([0, T - n_peer, T], dtype=torch.int64, pin_memory=True)
    out_c = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    calls = {
        "triton_noop": lambda: _noop_kernel[(1,)](flag, 1),
        "torch_index_select": lambda: torch.index_select(x, 0, send_idx, out=out_x),
        "gather_dispatch": lambda: dk.gather_dispatch(
            x, send_idx, src_ptrs, recv_off, in_idx, in_w, out_x, out_idx, out_w, me=me,
            own_start=0, num_programs=sms),
        "reduce_combine": lambda: dk.reduce_combine(
            x, send_idx, send_off, src_ptrs, out_c, me=me, own_start=0, num_programs=sms),
    }
    for fn in calls.values():  # compile and warm up
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    res = {}
    for name, fn in calls.items():
        res[name] = {"launch_us": _time(fn, args.iters, False), "launch_and_sync_us": _time(fn, args.iters, True)}
        print(f"[launch_probe] {name}: launch {res[name]['launch_us']:.1f} us, launch+kernel+sync "
              f"{res[name]['launch_and_sync_us']:.1f} us", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "launch_probe.json"), "w") as f:
            json.dump({"torch": torch.__version__, "triton": triton.__version__,
                       "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
