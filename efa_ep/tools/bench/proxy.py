"""Benchmarks of the ``proxy`` transport (CPU; optionally the GPU descriptor producer).

Three measurements, one JSON record per cell into ``--out/bench_proxy.json`` plus a PNG:

1. ``roundtrip``: descriptor round trip, ring -> native channel thread -> completion counter
   visible to the producer, the producer being native code (no Python per op). ``len=0`` is the
   no-op marker (no wire); ``len=64`` is an RMA write with immediate data to this process's own
   window through the provider (the target side is the same thread). One process.
2. ``rate``: descriptors/s with 1, 2, 4, 8 channels, ``--rate-n`` descriptors per channel,
   no-op and 64-byte writes (all to self, one process); one native producer thread per channel,
   each channel counting its arrivals in its own counter.
3. ``a2a`` (:mod:`~efa_ep.tools.bench.proxy_dc`): dispatch+combine latency, 2 ranks as
   processes (gloo group for setup), decode (128 tokens/rank) and prefill profiles
   (``--profiles``), hidden 7168, top-8 of 256 experts, bf16, random route
   (``--fresh-routes``: a new one every iteration, each checked after its timed call);
   checked bit-identical against ``torch`` before timing; per iteration the
   slowest rank's wall time, the **host part** (``proxy_host_ms``: the calling thread's wall time
   outside the engine's blocking waits, i.e. layout, packing, copies, checks, reduction and
   Python; the larger rank), and the calling thread's CPU time (``*_cpu_ms``, less sensitive to
   co-tenant load on small shared hosts; it includes the native waits' bounded spinning).
   The cell also times its own wire floor (``wire_ms``: part 4's two rounds with this D+C's
   rows, on the proxy's own wire) interleaved with the arms, so ``proxy_over_wire`` is a ratio
   of two figures taken side by side under the same load.
   ``--starts S`` repeats the cell in S fresh pairs of rank processes (new transports each):
   the record pools every iteration of every start (``proxy_ms``) and gives each start's median
   (``*_start_medians``) and their spread; ``torch`` (gloo) runs interleaved in the same ranks.
4. ``wire``: the floor under a dispatch+combine, 2 ranks as processes: the two wire rounds of
   the decode profile alone (headers, the rows' bytes, footers; dispatch rows of H*2 + 16*top-k
   bytes, combine rows of H*2 bytes, the rows each rank sends in the a2a cell's route), with no
   layout, packing, copies or checks of the rows, for ``--wire-channels`` channel counts; next to
   it one host ``memcpy`` pass of the same bytes on one core (what the shm provider's single-copy
   path costs at least per op). ``wire_ms`` is the slowest rank per iteration.

    python scripts/bench_proxy.py --out runs/bench_proxy [--providers tcp,shm] [--iters 30]
    # the decode D+C figure alone (host part and gloo in the same run), 5 starts x 20 iterations:
    python scripts/bench_proxy.py --out runs/bp --providers shm --skip roundtrip,rate \
        --profiles decode --iters 20 --starts 5

Method: one timing boundary (inputs and route ready ->
combine returned), slowest rank, many repeats with median and min/max, knobs recorded.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

from efa_ep.tools.provenance import cpu_model

from .proxy_dc import EXPERTS, HIDDEN, TOPK, _rank_env, _summary, bench_a2a


def _single_engine(provider: str, num_channels: int, window_bytes: int = 1 << 20, pin: bool = False):
    """One process, world of 1: every descriptor targets this rank's own window over the wire."""
    from efa_ep.kernels.proxy import native

    window = torch.zeros(window_bytes, dtype=torch.uint8, pin_memory=pin)
    rings = torch.zeros(num_channels, 1024, 2, dtype=torch.int64, pin_memory=pin)
    ctrl = torch.zeros(num_channels, native.CTRL_STRIDE, dtype=torch.int64, pin_memory=pin)
    counters = torch.zeros(num_channels * 64, dtype=torch.int64, pin_memory=pin)  # per channel
    eng = native.Engine(provider, 0, 1, num_channels, window.data_ptr(), window_bytes, rings.data_ptr(),
                        1024, ctrl.data_ptr(), counters.data_ptr(), 64, 64, 1_000_000, 0, 1, -1, 30000)
    keep = (window, rings, ctrl, counters)  # the caller holds these while the engine lives
    for c in range(num_channels):
        name, n, key, base = eng.local_info(c)
        eng.set_peers(c, name, [n], [key], [base], 30000)
    return eng, keep


def bench_roundtrip(provider: str, iters: int):
    eng, keep = _single_engine(provider, 1)
    out = []
    try:
        for nbytes in (0, 64):
            eng.bench_roundtrip(0, nbytes, 0, 200, 30000)  # warm-up (connects to self)
            ns = eng.bench_roundtrip(0, nbytes, 1000, iters, 30000)
            out.append({"kind": "roundtrip", "provider": provider, "bytes": nbytes,
                        "us": _summary([v / 1000 for v in ns])})
    finally:
        eng.destroy()
    return out


def bench_rate(provider: str, n: int, repeats: int):
    out = []
    for nc in (1, 2, 4, 8):
        eng, keep = _single_engine(provider, nc, 8 << 20)
        try:
            for nbytes in (0, 64):
                eng.bench_rate(nc, 256, nbytes, 5, 60000)  # warm-up
                rates = []
                for r in range(repeats):
                    ns = eng.bench_rate(nc, n, nbytes, 10 + r, 60000)
                    rates.append(n * nc / (ns / 1e9))
                s = _summary(rates)
                out.append({"kind": "rate", "provider": provider, "channels": nc, "bytes": nbytes,
                            "desc_per_s": s, "desc_per_s_per_channel": s["median"] / nc,
                            "n_per_channel": n})
        finally:
            eng.destroy()
    return out


def bench_gpu_roundtrip(provider: str, iters: int):
    """GPU -> pinned ring -> native channel thread -> counter in pinned memory -> GPU, per op.

    One Triton program does, iters times: store a descriptor into the ring, publish the tail with a
    system-scope release exchange, spin (acquire, system scope) until the counter counts it. The
    floor for this loop, with a bare C thread as the producer, is 3.2 us/op on the H200 host."""
    import triton
    import triton.language as tl
    from efa_ep.kernels.proxy.ring import HostPtr as _HostPtr

    @triton.jit(do_not_specialize=["iters", "w0", "w1", "start"])
    def _rt_kernel(ring_ptr, tail_ptr, cnt_ptr, iters, w0, w1, start, RING: tl.constexpr):
        for i in range(iters):
            n = start + i
            tl.store(ring_ptr + (n % RING) * 2, w0.to(tl.int64))
            tl.store(ring_ptr + (n % RING) * 2 + 1, w1.to(tl.int64))
            tl.atomic_xchg(tail_ptr, (n + 1).to(tl.int64), sem="release", scope="sys")
            c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="sys")
            while c < n + 1:
                c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="sys")

    out = []
    eng, (window, rings, ctrl, counters) = _single_engine(provider, 1, 1 << 20, pin=True)
    try:
        half = (1 << 20) // 2
        done = 0
        for nbytes in (0, 64):
            w0 = (0 << 52) | (0 << 32) | nbytes      # rank 0 (self), message 0
            w1 = (0 << 32) | (half >> 4)
            # the counter of (src 0, msg 0) counts every op of the run cumulatively; op n (global
            # ring position) is complete once it reads >= n + 1 (never zeroed mid-run)
            args = (_HostPtr(rings[0]), _HostPtr(ctrl[0]), _HostPtr(counters))
            _rt_kernel[(1,)](*args, 200, w0, w1, done, RING=1024, num_warps=1)
            torch.cuda.synchronize()
            done += 200
            per_op = []
            for rep in range(5):
                base = done
                t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                _rt_kernel[(1,)](*args, iters, w0, w1, base, RING=1024, num_warps=1)
                t1.record(); torch.cuda.synchronize()
                done += iters
                per_op.append(t0.elapsed_time(t1) * 1e3 / iters)
            out.append({"kind": "gpu_roundtrip", "provider": provider, "bytes": nbytes,
                        "us_per_op": _summary(per_op), "iters_per_launch": iters,
                        "floor_us": 3.2, "ratio_to_floor": statistics.median(per_op) / 3.2})
    finally:
        eng.destroy()
    return out


def _wire_rank(rank, world, provider, tokens, iters, channel_counts, seed, chunk_bytes=None):
    import numpy as np
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.proxy.window import OP_COMBINE, OP_DISPATCH
    from efa_ep.testing.routes import contract_route as make_route

    torch.set_num_threads(1)
    hidden, experts, topk = HIDDEN, EXPERTS, TOPK
    idx, _ = make_route("random", tokens, experts, topk, world, seed + rank)
    # rows this rank sends to each peer in the a2a cell: its tokens picking an expert there
    per_rank = experts // world
    rows_to = [int(((idx // per_rank) == d).any(dim=1).sum()) for d in range(world)]
    got_rows = [None] * world
    dist.all_gather_object(got_rows, rows_to)
    n_recv = [got_rows[r][rank] for r in range(world)]
    row_x, L = hidden * 2, experts // world
    chunk = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    out = []
    for nch in channel_counts:
        px = create_transport("proxy", None, experts, hidden, tokens, torch.bfloat16,
                              provider=provider, num_channels=nch, **chunk)
        wire = px.wire
        counts = np.zeros((world, L), dtype=np.int64)
        for d in range(world):
            counts[d, 0] = rows_to[d] * topk  # any count the header check accepts
        times = []
        for it in range(iters + 3):
            dist.barrier()
            t0 = time.perf_counter()
            wire.begin(OP_DISPATCH, [row_x, 16 * topk], rows_to, extras=counts, fmt=topk)
            wire.exchange()
            wire.finish()
            wire.begin(OP_COMBINE, [row_x], n_recv, n_recv=rows_to, fmt=0)
            wire.exchange()
            wire.finish()
            if it >= 3:
                times.append(time.perf_counter() - t0)
        px.close()
        out.append({"channels": nch, "times": times})
    # one host memcpy pass of one op's bytes to the peer (one core, buffers hot in cache)
    nbytes = sum(n for d, n in enumerate(rows_to) if d != rank) * (row_x + 16 * topk)
    a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    b = torch.empty_like(a)
    b.copy_(a)
    cp = []
    for _ in range(50):
        t0 = time.perf_counter()
        b.copy_(a)
        cp.append(time.perf_counter() - t0)
    return {"cells": out, "copy_s": cp, "bytes_per_op": nbytes, "rows_to": rows_to}


def bench_wire(provider: str, tokens: int, iters: int, channel_counts, starts: int = 1,
               chunk_bytes: int = 0):
    """The two wire rounds of a decode dispatch+combine alone, per channel count (see the module
    docstring, part 4); each start a fresh pair of rank processes."""
    from efa_ep.distributed import run_ranks

    runs = [run_ranks(_wire_rank, 2, (provider, tokens, iters, list(channel_counts), 7 + s, chunk_bytes),
                      timeout_s=900, pg_timeout_s=600, env=_rank_env(provider)) for s in range(starts)]
    out = []
    for i, nch in enumerate(channel_counts):
        per_start = [[max(r["cells"][i]["times"][j] for r in pr) * 1e3 for j in range(iters)] for pr in runs]
        meds = [statistics.median(s) for s in per_start]
        out.append({"kind": "wire", "provider": provider, "profile": "decode", "tokens_per_rank": tokens,
                    "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "dtype": "bfloat16", "ranks": 2,
                    "channels": nch, "chunk_bytes": chunk_bytes or "default", "starts": starts,
                    "iters_per_start": iters, "bytes_per_op_rank0": runs[0][0]["bytes_per_op"],
                    "wire_ms": _summary([v for s in per_start for v in s]),
                    "wire_start_medians_ms": meds})
    cps = [v * 1e3 for pr in runs for r in pr for v in r["copy_s"]]
    out.append({"kind": "host_copy", "provider": provider, "bytes": runs[0][0]["bytes_per_op"],
                "copy_ms": _summary(cps),
                "gb_per_s": runs[0][0]["bytes_per_op"] / (statistics.median(cps) * 1e-3) / 1e9})
    return out


def _plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for prov in sorted({r["provider"] for r in records if r["kind"] == "rate"}):
        for nbytes in (0, 64):
            rs = [r for r in records if r["kind"] == "rate" and r["provider"] == prov and r["bytes"] == nbytes]
            if rs:
                axes[0].errorbar([r["channels"] for r in rs], [r["desc_per_s"]["median"] / 1e6 for r in rs],
                                 yerr=[[(r["desc_per_s"]["median"] - r["desc_per_s"]["min"]) / 1e6 for r in rs],
                                       [(r["desc_per_s"]["max"] - r["desc_per_s"]["median"]) / 1e6 for r in rs]],
                                 marker="o", label=f"{prov} {'no-op' if nbytes == 0 else f'{nbytes} B write'}")
    axes[0].set_xlabel("channels"); axes[0].set_ylabel("M descriptors/s"); axes[0].set_xscale("log", base=2)
    axes[0].legend(fontsize=7); axes[0].set_title("proxy issue rate (1 process, writes to self)")
    a2a = [r for r in records if r["kind"] == "a2a"]
    labels = [f"{r['provider']}{' hmem' if r.get('hmem', 'off') != 'off' else ''}\n{r['profile']}" for r in a2a]
    xs = range(len(a2a))
    axes[1].bar([x - 0.2 for x in xs], [r["proxy_ms"]["median"] for r in a2a], 0.4, label="proxy")
    if all("proxy_host_ms" in r for r in a2a):
        axes[1].bar([x - 0.2 for x in xs], [r["proxy_host_ms"]["median"] for r in a2a], 0.4, fill=False,
                    hatch="//", label="proxy host part")
    axes[1].bar([x + 0.2 for x in xs], [r["torch_ms"]["median"] if "torch_ms" in r else 0 for r in a2a], 0.4,
                label="torch (gloo)")
    axes[1].set_xticks(list(xs)); axes[1].set_xticklabels(labels, fontsize=7)
    axes[1].set_ylabel("dispatch+combine ms (slowest rank, median)"); axes[1].legend(fontsize=7)
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _profile(spec: str, sizes) -> tuple:
    """``decode`` / ``prefill`` (their token counts in ``sizes``) or ``NAME=TOKENS``."""
    name, _, tokens = spec.partition("=")
    if tokens:
        if not tokens.isdigit() or int(tokens) < 1:
            raise SystemExit(f"--profiles: {spec!r}: TOKENS must be a positive integer")
        return name, int(tokens)
    if name not in sizes:
        raise SystemExit(f"--profiles: {spec!r}: expected decode, prefill or NAME=TOKENS")
    return name, sizes[name]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (JSON + PNG)")
    ap.add_argument("--providers", default="tcp,shm")
    ap.add_argument("--iters", type=int, default=30, help="timed dispatch+combine iterations per cell")
    ap.add_argument("--starts", type=int, default=1,
                    help="fresh pairs of rank processes per dispatch+combine cell (spread across starts)")
    ap.add_argument("--rt-iters", type=int, default=2000, help="round trips per cell")
    ap.add_argument("--rate-n", type=int, default=20000, help="descriptors per channel per repeat")
    ap.add_argument("--rate-repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=4096,
                    help="prefill tokens/rank (4096 is the profile; lower it on small hosts and say so)")
    ap.add_argument("--num-channels", type=int, default=None,
                    help="proxy channels of the dispatch+combine cells (default: the transport's, "
                         "4 on hosts with >= 8 CPUs, else 2)")
    ap.add_argument("--gpu-roundtrip", action="store_true", help="also the Triton GPU round trip")
    ap.add_argument("--device", default="cpu", help="device of the dispatch+combine inputs (cuda: host-staged)")
    ap.add_argument("--hmem", default="off", help="proxy window for the dispatch+combine cells: off (host) or cuda (FI_HMEM)")
    ap.add_argument("--chunk-bytes", type=int, default=0,
                    help="bytes per descriptor of the dispatch+combine cells (0: the transport's default)")
    ap.add_argument("--spin-us", type=int, default=None,
                    help="proxy option spin_us of the dispatch+combine cells (default: the transport's)")
    ap.add_argument("--torch-staging", action="store_true",
                    help="CUDA inputs: also the proxy with all its device work as torch ops and the "
                         "proxy with the dispatch's layout on the host (its round in Python steps), "
                         "interleaved in the same ranks")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: roundtrip,rate,a2a,wire")
    ap.add_argument("--wire-channels", default="1,2,4,8",
                    help="channel counts of the wire part (comma list)")
    ap.add_argument("--untimed-torch", action="store_true",
                    help="a2a: torch (gloo) only checks the results and is not timed, so the proxy "
                         "and its wire floor run back to back (no idle gap of a gloo operation "
                         "between them)")
    ap.add_argument("--fresh-routes", action="store_true",
                    help="a2a: a new random route for every iteration (row counts change per call, "
                         "as in training), each checked against torch after its timed call")
    ap.add_argument("--profiles", default="decode,prefill",
                    help="dispatch+combine profiles to run: comma list of decode, prefill, or "
                         "NAME=TOKENS (tokens per rank, e.g. mid=1024)")
    args = ap.parse_args(argv)
    if args.num_channels is None:
        from efa_ep.kernels.proxy.options import default_num_channels
        args.num_channels = default_num_channels()
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    os.makedirs(args.out, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    records = []
    for prov in args.providers.split(","):
        if "roundtrip" not in skip:
            records += bench_roundtrip(prov, args.rt_iters)
            print(json.dumps(records[-2:]), flush=True)
        if args.gpu_roundtrip:
            records += bench_gpu_roundtrip(prov, args.rt_iters)
            print(json.dumps(records[-2:]), flush=True)
        if "rate" not in skip:
            records += bench_rate(prov, args.rate_n, args.rate_repeats)
            print(json.dumps(records[-8:]), flush=True)
        if "wire" not in skip:
            chans = [int(c) for c in args.wire_channels.split(",") if c]
            recs = bench_wire(prov, args.decode_tokens, args.iters, chans, args.starts, args.chunk_bytes)
            records += recs
            for r in recs:
                if r["kind"] == "wire":
                    print(f"[bench_proxy] {prov} wire floor of a decode D+C, {r['channels']} channels: "
                          f"{r['wire_ms']['median']:.3f} ms [p10 {r['wire_ms']['p10']:.3f}, p90 "
                          f"{r['wire_ms']['p90']:.3f}], {r['bytes_per_op_rank0']} B per op", flush=True)
                else:
                    print(f"[bench_proxy] host memcpy of {r['bytes']} B: {r['copy_ms']['median']:.3f} ms "
                          f"({r['gb_per_s']:.1f} GB/s, one core)", flush=True)
        if "a2a" not in skip:
            sizes = {"decode": args.decode_tokens, "prefill": args.prefill_tokens}
            profiles = [_profile(p, sizes) for p in args.profiles.split(",") if p]
            records += bench_a2a(prov, profiles, args.iters, args.num_channels, args.device, args.hmem,
                                 args.starts, args.torch_staging, args.chunk_bytes, args.spin_us,
                                 not args.untimed_torch, args.fresh_routes)
            for r in records[-len(profiles):]:
                print(f"[bench_proxy] {prov} {r['profile']}: proxy D+C {r['proxy_ms']['median']:.3f} ms "
                      f"[p10 {r['proxy_ms']['p10']:.3f}, p90 {r['proxy_ms']['p90']:.3f}] (host part "
                      f"{r['proxy_host_ms']['median']:.3f} ms), "
                      + (f"torch/gloo {r['torch_ms']['median']:.3f} ms, proxy/torch "
                         f"{r['proxy_over_torch']:.2f}, " if "torch_ms" in r else "torch untimed, ")
                      + f"starts {r['starts']} x {r['iters_per_start']}, "
                      f"bit-identical {r['bit_identical_to_torch']}, CPU of both rank processes "
                      f"{r['proxy_proc_cpu_ms']['median']:.3f} ms per D+C "
                      f"({r['wire_proc_cpu_ms']['median']:.3f} per floor), wire floor (interleaved) "
                      f"{r['wire_ms']['median']:.3f} ms, proxy/wire {r['proxy_over_wire']:.2f} (per start "
                      + ", ".join(f"{v:.2f}" for v in r["proxy_over_wire_starts"]) + ")"
                      + "".join(f", {arm} {r[arm + '_ms']['median']:.3f} ms"
                                for arm in ("proxy_torch_staging", "proxy_host_layout")
                                if arm + "_ms" in r), flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
            "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "cpu_model": cpu_model(),
            "load_avg": os.getloadavg(), "libfabric": "system (Debian 1.17)" if not os.path.isdir("/opt/amazon/efa") else "/opt/amazon/efa",
            "spin_us_single_engine": 1_000_000}
    with open(os.path.join(args.out, "bench_proxy.json"), "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    try:
        _plot(records, os.path.join(args.out, "bench_proxy.png"))
    except Exception as e:  # the JSON is the result; the plot is a convenience
        print(f"plot failed: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
