#!/usr/bin/env python3
"""A Megatron MoE layer's forward + backward over ``efa:gda`` at a training shape: step time and
the share of it spent in the dispatcher's host code. (GPU; several ranks on one GPU need MPS.)

Shape (Qwen3-30B-A3B-like): hidden 2048, 128 experts top-8, expert FFN 768, 4096 tokens per rank
(sequence 4096 x micro-batch 1), bf16, dropless, EP ``--world`` as processes on one GPU.

Per step: CUDA events around forward + backward; the figure is the slowest rank's median over
``--steps`` steps after ``--warmup``. Dispatcher host time per step: the wall time of the ``efa``
dispatcher's six steps (forward) and of its autograd functions' backward (outermost calls only),
minus the time its transport reports blocked on the device or on peers (``blocked_s``, where the
transport has it; without it the figure includes the one count read per dispatch and is marked
``includes_wait``). The record also splits it by wrapped step (``host_ms_by_step``: each
step's median over the timed steps).

    python3 scripts/gpu/gda_layer_host.py [--world 4] [--steps 10] [--options fast_launch=0]

The code measured is the installed ``efa_ep`` (its checkout is recorded); for a before/after
comparison install the other checkout in place first (``scripts/gpu/gpu_perop_check.sh`` step
``layer_before`` does).

Writes ``$OUT/gda_layer_host<tag>.json`` and prints one line per rank and a summary.
"""
import argparse
import functools
import json
import os
import statistics
import time

HIDDEN, EXPERTS, TOPK, FFN, TOKENS = 2048, 128, 8, 768, 4096


class _HostClock:
    """Accumulates the wall time of outermost wrapped calls, minus the transport's blocked time."""

    def __init__(self):
        self.depth = 0
        self.total = 0.0
        self.by_name = {}  # wrapped name -> host seconds (outermost calls)
        self.transports = lambda: ()  # the transports whose blocked_s counts (read per call)

    def blocked(self):
        return sum(getattr(t, "blocked_s", 0.0) or 0.0 for t in self.transports())

    def wrap(self, fn, name=None, profiler=None):
        clock = self
        name = name or fn.__name__

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if clock.depth:
                return fn(*args, **kwargs)
            clock.depth += 1
            b0 = clock.blocked()
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                if profiler is not None:
                    profiler.disable()
                host = (time.perf_counter() - t0) - (clock.blocked() - b0)
                clock.total += host
                clock.by_name[name] = clock.by_name.get(name, 0.0) + host
                clock.depth -= 1
        return timed


def _rank(rank, world, steps, warmup, options, profile_step=""):
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist

    import efa_ep  # noqa: F401
    from efa_ep.dispatcher import token_dispatcher as td
    from efa_ep.tiny_moe import TinyMoEConfig, init_megatron, transformer_config

    clock = _HostClock()
    prof = cProfile.Profile() if profile_step else None

    def wrap(fn, name):
        return clock.wrap(fn, name, prof if name == profile_step else None)

    for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                 "combine_preprocess", "token_combine", "combine_postprocess"):
        setattr(td.EfaTokenDispatcher, name, wrap(getattr(td.EfaTokenDispatcher, name), name))
    for cls_name in ("_Dispatch", "_Combine", "_DispatchPadded", "_CombinePadded"):
        cls = getattr(td, cls_name, None)
        if cls is not None:
            cls.backward = staticmethod(wrap(cls.backward, f"{cls_name}.backward"))

    torch.cuda.set_device(rank % torch.cuda.device_count())
    init_megatron(world)
    torch.manual_seed(0)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    cfg = TinyMoEConfig(num_layers=1, hidden_size=HIDDEN, num_moe_experts=EXPERTS,
                        moe_router_topk=TOPK, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
                        dtype="bf16", num_attention_heads=16)
    config = transformer_config(cfg, "efa", world)
    config.efa_ep_transport = "gda"
    if options:
        config.efa_ep_transport_options = options
    layer = MoELayer(config, get_submodules(get_gpt_layer_local_submodules(
        num_experts=EXPERTS).mlp))
    layer.set_layer_number(0)
    layer = layer.cuda()
    dist.broadcast(layer.router.weight.data, src=0)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, 1, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    g = torch.randn(TOKENS, 1, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    # the dispatcher makes its transport in its first dispatch: read it at every wrapped call
    clock.transports = lambda: (layer.token_dispatcher.transport,)
    step_ms, host_ms, by_name = [], [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        dist.barrier()
        for p in layer.parameters():
            p.grad = None
        xi = x.clone().requires_grad_(True)
        h0, n0 = clock.total, dict(clock.by_name)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out, _ = layer(xi)
        out.backward(g)
        e1.record()
        torch.cuda.synchronize()
        if i >= warmup:
            step_ms.append(e0.elapsed_time(e1))
            host_ms.append((clock.total - h0) * 1e3)
            by_name.append({k: (v - n0.get(k, 0.0)) * 1e3 for k, v in clock.by_name.items()})
    tr = layer.token_dispatcher.transport
    profile = ""
    if prof is not None:  # every call of the step, warm-up included
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
        profile = buf.getvalue()
    return dict(rank=rank, profile=profile, transport=tr.name, step_ms=statistics.median(step_ms),
                step_ms_all=step_ms, host_ms=statistics.median(host_ms),
                host_ms_by_step={k: statistics.median(d.get(k, 0.0) for d in by_name)
                                 for k in sorted(by_name[-1])},
                includes_wait=not hasattr(tr, "blocked_s"),
                fast_launch=getattr(tr, "fast_launch", None))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--options", default="", help="gda options k=v,...")
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile-step", default="",
                    help="a wrapped step (e.g. _Dispatch.backward) to run under cProfile; each "
                         "rank prints its top functions by own time")
    args = ap.parse_args()
    import torch

    import efa_ep.dispatcher
    from efa_ep.distributed import run_ranks

    repo = os.path.dirname(os.path.dirname(os.path.abspath(efa_ep.dispatcher.__file__)))

    options = dict(kv.split("=", 1) for kv in args.options.split(",") if kv)
    res = run_ranks(_rank, args.world, (args.steps, args.warmup, options, args.profile_step),
                    timeout_s=500,
                    pg_timeout_s=400, env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
    step = max(r["step_ms"] for r in res)
    host = max(r["host_ms"] for r in res)
    rec = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               device=torch.cuda.get_device_name(0), torch=torch.__version__,
               mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), repo=repo, options=options,
               shape=dict(hidden=HIDDEN, experts=EXPERTS, topk=TOPK, ffn=FFN, tokens=TOKENS,
                          dtype="bf16", world=args.world, steps=args.steps),
               step_ms=step, dispatcher_host_ms=host, host_share=host / step, per_rank=res)
    out_dir = os.environ.get("OUT", os.path.join(repo, "outputs"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"gda_layer_host{args.tag}.json"), "w") as f:
        json.dump(rec, f, indent=1)
    for r in res:
        print(f"rank {r['rank']}: step {r['step_ms']:.2f} ms, dispatcher host {r['host_ms']:.2f} ms"
              f"{' (includes the count wait)' if r['includes_wait'] else ''}; by step: "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_by_step"].items()))
        if r["profile"]:
            print(f"rank {r['rank']}: cProfile of {args.profile_step} (own time)\n{r['profile']}")
    print(f"layer fwd+bwd EP {args.world} H {HIDDEN} E {EXPERTS} top-{TOPK} {TOKENS} tok/rank bf16 "
          f"{options or ''}: step {step:.2f} ms (slowest rank median of {args.steps}), "
          f"dispatcher host {host:.2f} ms = {100 * host / step:.1f}%")


if __name__ == "__main__":
    main()
