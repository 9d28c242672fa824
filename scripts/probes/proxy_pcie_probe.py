#!/usr/bin/env python3
"""How fast do the proxy's host-staging kernels move rows over PCIe, by grid size?

One process on one GPU, the DeepSeek-V3 prefill shape (H 7168 bf16, top-8 of 256, ``--tokens``
per rank, EP 2 as rank 0 of 2 with a random route): :func:`~efa_ep.kernels.proxy.device.pack_dispatch`
(GPU stores of the rows for the peer into pinned host memory) and
:func:`~efa_ep.kernels.proxy.device.gather_dispatch` (GPU loads of the peer's rows from pinned
host memory), each at several program counts (``--programs``, as multiples of the SM count),
against the copy engine moving the same bytes (``copy_`` between device and pinned memory).
Median of ``--iters`` CUDA-event timings per cell; GB/s of the rows that cross PCIe. The
outputs of every grid are compared bit for bit with the first grid's.

    python3 scripts/probes/proxy_pcie_probe.py [--tokens 4096] [--programs 1,2,4,8]
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def _time(fn, iters):
    ts = []
    for _ in range(iters + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(ts[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--programs", default="1,2,4,8", help="program counts, as multiples of the SMs")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", help="also write the cells here")
    a = ap.parse_args()
    from efa_ep.kernels.gda import launches as kern
    from efa_ep.kernels.proxy import device as dk
    from efa_ep.testing.routes import contract_route

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    t, k, e, w, h, me = a.tokens, 8, 256, 2, 7168, 0
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    idx, wts = contract_route("random", t, e, k, w, 0)
    idx, wts = idx.to(dev), wts.to(dev)
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    o_send, words = kern._layout_offsets(t, e, w, k)[5::2]
    scratch = torch.empty(words, dtype=torch.int64, device=dev)
    meta = torch.empty(t * min(w, k) * 2 * k, dtype=torch.int64, pin_memory=True)
    counts = torch.empty(2 + w + e, dtype=torch.int64, pin_memory=True)  # + the ready word
    plane = torch.zeros(t * h * 2 + 4096, dtype=torch.uint8, pin_memory=True)
    lay = kern.layout(idx, wts, e, w, scratch=scratch)
    torch.cuda.synchronize()
    num_send = [int(v) for v in lay[2].tolist()]
    n_peer = num_send[1]
    nbytes = n_peer * h * 2
    cells = []
    ref_plane = None
    for m in [int(v) for v in a.programs.split(",")]:
        nprog = m * sms
        progress = torch.zeros(dk.pack_grid(t * min(w, k), nprog), dtype=torch.int64,
                               pin_memory=True)
        chunk_rows = t * min(w, k)  # one chunk: the kernel's rate without the chunk releases

        def pack():
            dk.pack_dispatch(x, idx, wts, lay, me, plane, meta, counts, progress, chunk_rows,
                             num_programs=nprog)

        s = _time(pack, a.iters)
        same = True
        if ref_plane is None:
            ref_plane = plane[:nbytes].clone()
        else:
            same = torch.equal(ref_plane, plane[:nbytes])
        cells.append({"kernel": "pack_dispatch (GPU stores to host)", "programs": nprog,
                      "us": s * 1e6, "gbps": nbytes / s / 1e9, "bit_identical": same})
    # the peer's rows come back from the same pinned plane (as if it were the receive region)
    n = num_send[0] + n_peer
    recv_off = torch.tensor([0, num_send[0], n], dtype=torch.int64).pin_memory()
    in_idx = torch.zeros(n * k, dtype=torch.int64, pin_memory=True)
    in_w = torch.zeros(n * k, dtype=torch.float32, pin_memory=True)
    src_ptrs = torch.tensor([0, plane.data_ptr()], dtype=torch.int64, device=dev)
    send_token_idx = scratch[o_send:o_send + max(1, t * w)]
    ref_out = None
    for m in [int(v) for v in a.programs.split(",")]:
        nprog = m * sms
        out_x = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
        out_i = torch.empty(n, k, dtype=torch.int64, device=dev)
        out_w = torch.empty(n, k, dtype=torch.float32, device=dev)

        def gather():
            dk.gather_dispatch(x, send_token_idx, src_ptrs, recv_off, in_idx.view(n, k),
                               in_w.view(n, k), out_x, out_i, out_w, me=me, own_start=0,
                               num_programs=nprog)

        s = _time(gather, a.iters)
        same = True
        if ref_out is None:
            ref_out = out_x.clone()
        else:
            same = torch.equal(ref_out, out_x)
        cells.append({"kernel": "gather_dispatch (GPU loads from host)", "programs": nprog,
                      "us": s * 1e6, "gbps": nbytes / s / 1e9, "bit_identical": same})
    dsrc = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    s = _time(lambda: plane[:nbytes].copy_(dsrc, non_blocking=True), a.iters)
    cells.append({"kernel": "copy engine device -> pinned", "programs": 0, "us": s * 1e6,
                  "gbps": nbytes / s / 1e9, "bit_identical": True})
    s = _time(lambda: dsrc.copy_(plane[:nbytes], non_blocking=True), a.iters)
    cells.append({"kernel": "copy engine pinned -> device", "programs": 0, "us": s * 1e6,
                  "gbps": nbytes / s / 1e9, "bit_identical": True})
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, {t} tokens, {n_peer} rows to the peer "
          f"({nbytes / 1e6:.1f} MB across PCIe per op)")
    for c in cells:
        print(f"  {c['kernel']:40s} programs {c['programs']:5d}  {c['us']:9.1f} us  "
              f"{c['gbps']:6.1f} GB/s  same bits {c['bit_identical']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tokens": t, "sms": sms, "bytes": nbytes, "cells": cells}, f, indent=1)


if __name__ == "__main__":
    main()
