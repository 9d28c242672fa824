#!/usr/bin/env python3
"""Two gda option sets timed against each other in the same rank processes, interleaved.

Leases of one GPU host differ by up to 30% in an eager D+C and fresh rank processes by ~15%,
so two settings run in separate starts (``gda_gpu_check.py --options``) often cannot resolve a
few microseconds. Here every rank creates two transports, A (``--a``) and B (``--b``), and
alternates their D+C call by call (A then B, then B then A), so both see the same processes,
the same host load and the same GPU state. Per profile: each arm's D+C (CUDA events around the
dispatch and the combine, as ``gda_gpu_check.py``), its host time per dispatch and combine
(wall minus ``blocked_s``), and the median over iterations of B's D+C over A's in the same
pair; the slowest rank's medians are reported. Both arms are checked first: combine(dispatch(x))
bit-identical to the expected sum, and A's outputs bit-identical to B's.

EP ranks as processes on one GPU (MPS on, as ``gda_gpu_check.py``), DeepSeek-V3 shape (H 7168
bf16, top-8 of 256), decode 128 and prefill 4096 tokens per rank (or a number of tokens per rank
as a profile's name), random routes.

    python3 scripts/probes/gda_ab.py --b layout_in_store=0 [--a k=v,...] [--worlds 2,4]
        [--profiles decode,512,prefill] [--iters 300] [--starts 2] [--out FILE.json]
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

HIDDEN, EXPERTS, TOPK, T_MAX = 7168, 256, 8, 4096
PROFILES = {"decode": 128, "prefill": 4096}
WARMUP = 20


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _one(tr, x, idx, w, events, host):
    """One D+C of ``tr`` between three CUDA events; appends its host times (us)."""
    b0, t0 = tr.blocked_s, time.perf_counter()
    events[0].record()
    r = tr.dispatch(x, idx, w)
    events[1].record()
    b1, t1 = tr.blocked_s, time.perf_counter()
    out = tr.combine(r[0], r[-1])
    events[2].record()
    t2 = time.perf_counter()
    host.append(((t1 - t0 - (b1 - b0)) * 1e6, (t2 - t1 - (tr.blocked_s - b1)) * 1e6))
    return r, out


def _rank(rank, world, a, b, profiles, iters):
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    arms = {name: create_transport("gda", None, EXPERTS, HIDDEN, T_MAX, torch.bfloat16,
                                   **{"timeout_s": 60, **opts})
            for name, opts in (("A", a), ("B", b))}
    out = {}
    for prof in profiles:
        t = PROFILES[prof] if prof in PROFILES else int(prof)
        idx, w = contract_route("random", t, EXPERTS, TOPK, world, seed=1234 + rank)
        idx, w = idx.to(dev), w.to(dev)
        g = torch.Generator(device=dev).manual_seed(99 + rank)
        x = torch.randn(t, HIDDEN, device=dev, generator=g).to(torch.bfloat16)
        dest = torch.zeros(t, world, dtype=torch.bool, device=dev)
        valid = idx >= 0
        rows = torch.arange(t, device=dev).unsqueeze(1).expand_as(idx)
        dest[rows[valid], (idx // (EXPERTS // world))[valid]] = True
        want = (x.float() * dest.sum(1, keepdim=True).float()).to(torch.bfloat16)
        got = {}
        for name, tr in arms.items():
            for _ in range(WARMUP):  # binds every program and plan, sizes the outputs
                r = tr.dispatch(x, idx, w)
                back = tr.combine(r[0], r[-1])
            got[name] = (r[0].clone(), r[3].clone(), back.clone())
        torch.cuda.synchronize()
        ok = all(torch.equal(_bits(v[2]), _bits(want)) for v in got.values()) and \
            torch.equal(_bits(got["A"][0]), _bits(got["B"][0])) and \
            torch.equal(got["A"][1], got["B"][1])
        dist.barrier()
        evs = {n: [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
               for n in arms}
        host = {n: [] for n in arms}
        for i in range(iters):
            for name in (("A", "B") if i % 2 == 0 else ("B", "A")):
                _one(arms[name], x, idx, w, evs[name][i], host[name])
        torch.cuda.synchronize()
        dist.barrier()
        dc = {n: [e[0].elapsed_time(e[2]) * 1e3 for e in evs[n]] for n in arms}
        out[prof] = dict(
            ok=ok, tokens=t,
            **{f"{n}_dc_us": statistics.median(dc[n]) for n in arms},
            **{f"{n}_host_dispatch_us": statistics.median(h[0] for h in host[n]) for n in arms},
            **{f"{n}_host_combine_us": statistics.median(h[1] for h in host[n]) for n in arms},
            b_over_a=statistics.median(bv / av for av, bv in zip(dc["A"], dc["B"])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", default="", help="arm A's gda options, k=v,... (default: none)")
    ap.add_argument("--b", required=True, help="arm B's gda options, k=v,...")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--profiles", default="decode,prefill")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--starts", type=int, default=2, help="fresh rank processes per EP size")
    ap.add_argument("--out", default=None, help="JSON record")
    args = ap.parse_args()
    from efa_ep.distributed import run_ranks
    from efa_ep.kernels.options import parse_options_text, validate_options

    a, b = (validate_options("gda", parse_options_text(v, f"--{n}"), where=f"--{n}") for n, v in
            (("a", args.a), ("b", args.b)))
    profiles = args.profiles.split(",")
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=torch.cuda.get_device_name(0), torch=torch.__version__, a=a, b=b,
                  iters=args.iters, cells=[])
    print(f"A = {a or 'defaults'}, B = {b}; slowest rank's medians, us; B/A of those, and per "
          f"rank the median of B's D+C over A's in the same pair")
    for start in range(args.starts):
        for world in (int(v) for v in args.worlds.split(",")):
            res = run_ranks(_rank, world, (a, b, profiles, args.iters), timeout_s=600,
                            pg_timeout_s=500,
                            env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
            for prof in profiles:
                per = [r[prof] for r in res]
                cell = dict(world=world, start=start, profile=prof,
                            ok=all(p["ok"] for p in per), per_rank=per,
                            **{k: max(p[k] for p in per) for k in per[0]
                               if k.endswith("_us")},
                            b_over_a_per_rank=[p["b_over_a"] for p in per])
                record["cells"].append(cell)
                print(f"EP {world} start {start} {prof:8s} ok={'y' if cell['ok'] else 'N'} "
                      f"A {cell['A_dc_us']:.1f} (hD {cell['A_host_dispatch_us']:.1f}, hC "
                      f"{cell['A_host_combine_us']:.1f})  B {cell['B_dc_us']:.1f} (hD "
                      f"{cell['B_host_dispatch_us']:.1f}, hC {cell['B_host_combine_us']:.1f})  "
                      f"B/A {cell['B_dc_us'] / cell['A_dc_us']:.3f} (paired, per rank: "
                      f"{', '.join(f'{v:.3f}' for v in cell['b_over_a_per_rank'])})",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
