#!/usr/bin/env python3
"""Host time of each step of a regular gda dispatch and combine, one rank alone on the GPU
(EP 1, no peers, no launch gate): the steps ``GdaTransport.dispatch`` / ``combine`` run, called
one by one here with a clock between them. Median of ``--iters`` calls per step, microseconds;
DeepSeek-V3 decode shape (H 7168 bf16, top-8 of 256, 128 tokens).

    python3 scripts/probes/gda_dispatch_steps.py [--iters 300]
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()
    from efa_ep.distributed import free_port
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    tr = create_transport("gda", None, 256, 7168, 4096, torch.bfloat16, timeout_s=60)
    kern, cfg = tr._kern, tr.cfg
    idx, w = contract_route("random", 128, 256, 8, 1, seed=0)
    idx, w = idx.to(dev), w.to(dev)
    x = torch.randn(128, 7168, device=dev).to(torch.bfloat16)
    steps = {}

    def clock(name, t0):
        t1 = time.perf_counter()
        steps.setdefault(name, []).append((t1 - t0) * 1e6)
        return t1

    for it in range(a.iters + 20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        t0 = t
        error = tr._host_check(x, idx, w)
        t = clock("host_check", t)
        epoch = tr._begin_op("dispatch")
        offs = tr._offs[epoch % 2]
        t = clock("begin_op", t)
        slot, send_idx, per_rank, per_expert, status = kern.layout(
            idx, w, cfg.num_experts, 1, fast=tr.fast_launch)
        t = clock("layout (1 launch)", t)
        kern.dispatch_store(x, idx, w, slot, per_rank, per_expert, status, tr._buf_ptrs,
                            tr._sig_ptrs, tr._done[0:1], **offs, me=0,
                            t_max=cfg.max_tokens_per_rank, num_local=cfg.num_local_experts,
                            **tr._op(epoch), with_meta=True, num_programs=tr.num_programs)
        t = clock("dispatch_store (1 launch)", t)
        tr._issued(epoch, "dispatch")
        tr._note_idx_width(epoch % 2, 8)
        t = clock("issued + idx width", t)
        info, recv_off = kern.recv_header(
            tr._my_sig, tr._hdr[epoch % 2], tr._err, per_rank, tr._hw[epoch % 2],
            num_local=cfg.num_local_experts, t_max=cfg.max_tokens_per_rank, **tr._op(epoch),
            kind="dispatch", **tr._wait_args())
        t = clock("recv_header (1 launch)", t)
        info = info.cpu()
        t = clock("count read (device wait)", t)
        vals = info.tolist()
        n = vals[2]
        t = clock("tolist", t)
        rx = torch.empty(n, 7168, dtype=torch.bfloat16, device=dev)
        ri = torch.empty(n, 8, dtype=torch.int64, device=dev)
        rw = torch.empty(n, 8, dtype=torch.float32, device=dev)
        t = clock("3 x torch.empty", t)
        kern.gather_rows(tr._win_ptr, recv_off, rx, ri, rw, tr._my_sig, tr._err,
                         data_off=offs["data_off"], idx_off=offs["idx_off"], w_off=offs["w_off"],
                         t_max=cfg.max_tokens_per_rank, **tr._op(epoch), wait=False,
                         num_programs=tr.num_programs, **tr._wait_args())
        t = clock("gather_rows (1 launch)", t)
        clock("dispatch total", t0)
        # the real calls, for comparison
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = tr.dispatch(x, idx, w)
        t = clock("GdaTransport.dispatch (wall)", t)
        tr.combine(r[0], r[-1])
        t = clock("GdaTransport.combine (wall)", t)
        torch.cuda.synchronize()
        if it < 20:
            steps.clear()
    tr.check_errors()
    out = {k: round(statistics.median(v), 2) for k, v in steps.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
