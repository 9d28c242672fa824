#!/usr/bin/env python3
"""Where does the time of a ``hier`` dispatch + combine go, stage by stage?

``--world`` ranks as processes on one host, nodes emulated with ``--node-size`` (CUDA inputs on
``cuda:0`` under MPS, or ``--device cpu``), the network stage ``proxy`` over ``--provider``, the
local stage ``auto`` (``gda`` on a GPU, ``torch`` on CPU), Qwen3-30B-A3B shape (H 2048 bf16, top-8
of 128), ``--tokens`` per rank. Every call hier makes into a stage or a collective of its own
(the group's status exchange) is timed with a wall clock; the rest
of the D+C is hier's own Python and torch work between them, of which the named helpers (the
routing copied to the host, the input checks, the flat send layout, the
index arrays copied to the device, the status exchange's start) are timed too, each as
"(own) ..."; on a GPU the wait for the device's work still queued when combine returned is
timed too; what is left is the permutation's gathers, numpy and the handle (``--cprofile``
prints rank 0's Python profile of the timed calls to attribute it). Each D+C starts
after a barrier
(as the benchmarks time it); per rank, the mean per D+C of each step, microseconds. A step's
time includes waiting for the slowest peer to arrive there.

    python3 scripts/probes/hier_host_profile.py [--world 4] [--node-size 2] [--tokens 128]
"""
import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


#: hier's own helpers timed apart: (module, name, how the probe names it)
OWN_STEPS = (
    ("efa_ep.kernels.hier.transport", "validate_dispatch_inputs", "the input checks"),
    ("efa_ep.kernels.hier.transport", "routing_on_host", "the routing copied to the host"),
    ("efa_ep.kernels.hier.transport", "flat_send", "the flat send layout"),
    ("efa_ep.kernels.hier.transport", "to_device", "the index arrays copied to the device"),
    ("efa_ep.kernels.hier.refusing", "start_agreement", "the status exchange's start"),
)


def _time_own_steps(acc):
    """Wraps each of :data:`OWN_STEPS` in its module with a wall clock into ``acc``."""
    import importlib

    for mod_name, name, what in OWN_STEPS:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, name)

        def timed(*a, _fn=fn, _what=f"(own) {what}", **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_what] += time.perf_counter() - t0
        setattr(mod, name, timed)


def _rank(rank, world, node_size, tokens, iters, device, provider, channels, options,
          cprofile=False):
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.set_num_threads(1)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tr = create_transport("hier", None, 128, 2048, max(tokens, 128), torch.bfloat16,
                          node_size=node_size, provider=provider, num_channels=channels,
                          **options)
    acc = collections.defaultdict(float)
    stage = tr._stage

    def timed(fn, *a):
        t0 = time.perf_counter()
        try:
            return stage(fn, *a)
        finally:
            acc[tr._where(fn)[0]] += time.perf_counter() - t0  # hier's own name of the step

    tr._stage = timed
    _time_own_steps(acc)
    idx, w = contract_route("random", tokens, 128, 8, world, 7 + rank)
    x = torch.randn(tokens, 2048).to(torch.bfloat16)
    x, idx, w = x.to(dev), idx.to(dev), w.to(dev)

    def dc():
        r = tr.dispatch(x, idx, w)
        tr.combine(r[0], r[4])
        if dev.type == "cuda":  # (the device's work queued after combine returned)
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            acc["the device's tail after combine returned"] += time.perf_counter() - t0

    for _ in range(5):
        dc()
    acc.clear()
    total = 0.0
    prof = None
    if cprofile and rank == 0:
        import cProfile
        prof = cProfile.Profile()
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        dc()
        if prof is not None:
            prof.disable()
        total += time.perf_counter() - t0
    if prof is not None:
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(f"== rank 0: cProfile of {iters} D+C (tottime, s)\n{text.getvalue()}", flush=True)
    steps = {k: v / iters * 1e6 for k, v in acc.items()}
    local = getattr(tr.local, "name", type(tr.local).__name__)
    tr.close()
    return total / iters * 1e6, steps, local


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--node-size", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda:0", help="the ranks' device (all ranks on it)")
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="another hier option (e.g. spin_us=0 for its network stage); repeatable")
    ap.add_argument("--json", help="also write the per-rank steps here")
    ap.add_argument("--cprofile", action="store_true",
                    help="also print rank 0's cProfile of the timed calls (its walls inflate)")
    a = ap.parse_args()
    from efa_ep.distributed import run_ranks

    env = {"FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "1"}
    options = {}
    for kv in a.option:
        key, _, value = kv.partition("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    res = run_ranks(_rank, a.world, (a.node_size, a.tokens, a.iters, a.device, a.provider,
                                     a.channels, options, a.cprofile), timeout_s=900, env=env)
    out = []
    for rank, (wall, steps, local) in enumerate(res):
        rest = wall - sum(steps.values())  # (the own steps are outside the stages' calls)
        print(f"== rank {rank}: hier EP {a.world} = {a.world // a.node_size} x {a.node_size}, "
              f"{a.device}, local stage {local}, {a.tokens} tok/rank: D+C {wall:.0f} us")
        for k, v in sorted(steps.items(), key=lambda kv: -kv[1]):
            print(f"   {k:48s} {v:9.0f} us")
        print(f"   {'(hier own work between the steps)':48s} {rest:9.0f} us")
        out.append({"rank": rank, "dc_us": wall, "steps_us": steps, "rest_us": rest})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "ranks": out}, f, indent=1)


if __name__ == "__main__":
    main()
