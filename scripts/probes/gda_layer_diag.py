#!/usr/bin/env python3
"""Diagnostic (H200): where does the Megatron MoE layer's backward over ``gda`` differ from the
same layer over ``torch`` (EP 4, bf16)? Runs the torch layer twice (baseline determinism) and the
gda layer once on identical inputs and prints, per rank, how many elements of the output, x.grad
and every parameter grad differ, by how much, and which routing the differing tokens had.

    PYTHONPATH=. python3 scripts/probes/gda_layer_diag.py [--world 4] [--dtype bf16] [--deterministic]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def _worker(rank, world, dtype, deterministic, names):
    import torch.distributed as dist

    import efa_ep  # noqa: F401
    from efa_ep.tiny_moe import init_megatron
    from efa_ep.testing.moe_layer import HIDDEN, MICRO_BATCH, SEQ_LEN, efa_moe_layer

    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.set_device(0)
    init_megatron(world)
    torch.manual_seed(0)
    every = {"torch_a": ("torch", {}), "torch_b": ("torch", {}),
             "proxy": ("proxy", {"provider": "tcp", "num_channels": 2}), "gda": ("gda", {}),
             "gda_sync_each_call": ("gda", {"check_every_call": 1}),
             "gda_4_programs": ("gda", {"num_programs": 4})}
    layers = {k: efa_moe_layer(every[k][0], world, dtype, **every[k][1])
              for k in ["torch_a"] + [n for n in names if n != "torch_a"]}
    dist.broadcast(layers["torch_a"].router.weight.data, src=0)
    for k in layers:
        if k != "torch_a":
            layers[k].load_state_dict(layers["torch_a"].state_dict())
    gen = torch.Generator().manual_seed(100 + rank)
    act = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    x = torch.randn(SEQ_LEN, MICRO_BATCH, HIDDEN, generator=gen).to("cuda", act)
    g = torch.randn(SEQ_LEN, MICRO_BATCH, HIDDEN, generator=gen).to("cuda", act)
    import time

    res, notes = {}, []
    for name, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, _ = layer(xi)
        out.backward(g)
        torch.cuda.synchronize()
        note = f"{time.perf_counter() - t0:.2f}s"
        t = layer.token_dispatcher.transport
        if hasattr(t, "check_errors"):  # gda defers device-side deadline errors: ask
            try:
                t.check_errors("layer fwd+bwd")
                note += " no deadline expired"
            except Exception as e:
                note += f" {type(e).__name__}: {e}"
        notes.append(f"rank {rank} {name}: {note}")
        assert layer.token_dispatcher.transport.name == name.split("_")[0], layer.token_dispatcher.transport.name
        res[name] = {"out": out.detach(), "x.grad": xi.grad,
                     **{f"grad {n}": p.grad for n, p in layer.named_parameters()}}
    torch.cuda.synchronize()
    lines = []
    for pair in [("torch_a", k) for k in layers if k != "torch_a"]:
        a, b = res[pair[0]], res[pair[1]]
        for key in a:
            d = (a[key].float() - b[key].float()).abs()
            n = int((a[key] != b[key]).sum())
            if n:
                lines.append(f"rank {rank} {pair[0]} vs {pair[1]} {key}: {n} of {d.numel()} differ, "
                             f"max {float(d.max()):.3e}, max |ref| {float(a[key].float().abs().max()):.3e}")
        if pair[1].startswith("gda"):
            dx = (a["x.grad"] != b["x.grad"]).reshape(-1, HIDDEN).any(1)
            if int(dx.sum()):
                lines.append(f"rank {rank} {pair[1]}: tokens with differing x.grad rows: "
                             f"{dx.nonzero().flatten().tolist()[:12]} ({int(dx.sum())} of {dx.numel()})")
    if not lines:
        lines.append(f"rank {rank}: all bitwise equal")
    return notes + lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--layers", default="torch_a,torch_b,gda",
                    help="comma list of torch_a, torch_b, proxy, gda, gda_sync_each_call, gda_4_programs")
    a = ap.parse_args()
    from efa_ep.distributed import run_ranks

    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    out = run_ranks(_worker, a.world, (a.dtype, a.deterministic, a.layers.split(",")), timeout_s=240, env=env,
                    raise_on_error=False)
    for r, (ok, val) in enumerate(out):
        print("\n".join(val) if ok else f"rank {r} failed: {val}")


if __name__ == "__main__":
    main()
