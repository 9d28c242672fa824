"""What a plan prints and writes: tables (every figure with its tag), ``plan.json``, ``plan.png``."""
from __future__ import annotations

import dataclasses
import math
import textwrap
from typing import Any, Dict, List, Optional, Sequence

from .model import Fig, Inputs, Plan, make_plan

_TAG = {"measured": "M", "derived": "D", "assumed": "A"}
WIDTH = 132   # printed lines wrap at word boundaries to this width (sources are never cut)


def wrap(first: str, text: str, indent: int = 0, width: int = WIDTH) -> List[str]:
    """``first`` + ``text`` wrapped at spaces to ``width`` columns, continuation lines indented
    by ``indent`` (a word longer than a line is kept whole, not cut)."""
    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=" " * indent,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


def _b(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


def _f(fig: Optional[Fig], fmt: str = "{:.1f}") -> str:
    if fig is None:
        return "-"
    return f"{fmt.format(fig.value)} [{_TAG[fig.tag]}]"


def input_figs(inp: Inputs) -> Dict[str, Fig]:
    """The plan's inputs as assumed figures with their sources."""
    out = {}
    model_src = inp.src("model", f"model preset {inp.model}")
    fab_src = inp.src("fabric", f"fabric preset {inp.fabric}")
    for name in ("hidden", "num_experts", "topk", "moe_layers", "moe_ffn_hidden", "seq_length", "micro_batch", "dtype"):
        out[name] = Fig(getattr(inp, name), "", "assumed", inp.src(name, model_src))
    for name, unit in (("nodes", ""), ("gpus_per_node", ""), ("ep", ""), ("tp", ""), ("tokens_per_rank", "tokens"),
                       ("micro_batches_per_step", "")):
        out[name] = Fig(getattr(inp, name), unit, "assumed", inp.src(name, "layout input"))
    for name, unit in (("hbm_gb", "GB"), ("nvlink_gbps", "GB/s per direction"), ("efa_gbps_per_node", "GB/s"),
                       ("gpu_tflops_bf16", "TFLOPS")):
        out[name] = Fig(getattr(inp, name), unit, "assumed", inp.src(name, fab_src))
    for name, unit in (("gemm_efficiency", "fraction"), ("memory_budget", "fraction"), ("win_margin", ""),
                       ("chunk_bytes", "B"), ("proxy_same_node", "")):
        out[name] = Fig(getattr(inp, name), unit, "assumed", inp.src(name, "modelling choice (conf/plan/default.yaml)"))
    return out


def tables(plan: Plan, cal: Dict[str, Fig]) -> str:
    inp, tr = plan.inputs, plan.traffic
    L: List[str] = []
    L.append(f"efa-ep-plan: {inp.model} on {inp.nodes} x {inp.fabric} ({inp.gpus_per_node} GPUs/node), EP {inp.ep} "
             f"({inp.group_nodes} node(s) per EP group, {inp.ranks_per_node} ranks per node), "
             f"{inp.tokens_per_rank} tokens/rank, {inp.dtype}")
    L.append("tags: [M] measured, [D] derived, [A] assumed; sources in plan.json")
    L.append("")
    L.append("Calibration (" + str(cal.get("_name", Fig("-", "", "assumed", "")).value) + ")")
    for k, v in cal.items():
        if k.startswith("_"):
            continue
        head = f"  {k:22s} {v.value:>10.4g} {v.unit:9s} [{_TAG[v.tag]}] "
        L += wrap(head, v.source, indent=len(head))
    L.append("")
    L.append("Bytes per rank (efa dispatcher: one row per destination rank)")
    L.append(f"  {'':24s} {'NVLink':>12s} {'EFA':>12s}")
    for label, key in (("one op (D or C)", "op"), ("one layer, training", "layer_train"), ("one step", "step")):
        nv = tr[f"efa_bytes_nvlink_{key}"]
        ef = tr[f"efa_bytes_efa_{key}"]
        L.append(f"  {label:24s} {_b(nv.value):>12s} {_b(ef.value):>12s}   [{_TAG[nv.tag]}] {ef.source}")
    L.append(f"  destination ranks per token {tr['rows_per_token'].value:.2f} [D] ({tr['p_rank'].source})")
    L.append(f"  Megatron alltoall per op: NVLink {_b(tr['a2a_bytes_nvlink_op'].value)}, EFA {_b(tr['a2a_bytes_efa_op'].value)} [D]; "
             f"allgather per op: NVLink {_b(tr['ag_bytes_nvlink_op'].value)}, EFA {_b(tr['ag_bytes_efa_op'].value)} [D]")
    L.append("")
    g = plan.compute
    L.append(f"Expert GEMM per layer and micro-batch: forward {g['gemm_fwd_us'].value:.1f} us, fwd+bwd "
             f"{g['gemm_train_us'].value:.1f} us [D] ({g['gemm_fwd_us'].source})")
    L.append("")
    L.append("Predicted dispatch + combine per MoE layer (forward, one micro-batch)")
    L.append(f"  {'path':10s} {'K':>2s} {'D us':>14s} {'C us':>14s} {'D+C us':>14s} {'share':>12s} {'per step ms':>14s}  bound")
    for name, p in plan.paths.items():
        if not p.applicable:
            L.append(f"  {name:10s}  -  not applicable: {p.why_not}")
            continue
        sh = plan.shares[name]
        st = plan.step[name]
        nc = str(p.num_channels) if name == "proxy" or name.startswith("hier") else "-"
        L.append(f"  {name:10s} {nc:>2s} {_f(p.d_us):>14s} {_f(p.c_us):>14s} {_f(p.dc_us):>14s} "
                 f"{_f(sh, '{:.3f}'):>12s} {st.value / 1e3:>10.2f} [D]  {p.bound}")
    px = plan.paths["proxy"]
    if px.applicable:
        L.append("  proxy D+C by channels K: " + ", ".join(f"K={nc} {v:.0f}" for nc, v in px.by_channels.items()) + " us [D]")
        t = px.terms
        L.append(f"  proxy op at K={px.num_channels}: fixed {t['fixed']:.1f} + max(issue {t['issue']:.1f} "
                 f"(posts {t['post']:.1f}, channel copy {t['channel_copy']:.1f}, {t['msgs']:.0f} descriptors), "
                 f"wire {t['wire']:.1f}, NVLink {t['nvlink']:.1f}) us; EFA NIC "
                 f"{100 * px.extra['nic_utilisation'].value:.1f}% used, scale-out {px.extra['so_gbps'].value:.1f} GB/s [D]")
    L += hier_lines(plan)
    L.append(f"  step totals: expert GEMM {plan.step['gemm'].value / 1e3:.2f} ms per step [D] "
             f"({inp.moe_layers} MoE layers x {inp.micro_batches_per_step} micro-batches)")
    L.append("")
    m = plan.memory
    L.append("Memory per rank")
    for k in ("gda_window_bytes", "proxy_window_bytes", "proxy_engine_bytes", "expert_bytes_per_gpu_no_ep",
              "expert_bytes_per_gpu_ep", "hbm_budget_bytes"):
        L.append(f"  {k:28s} {_b(m[k].value):>10s} [{_TAG[m[k].tag]}] {m[k].source}")
    L.append("")
    L += wrap(f"Verdict: {plan.verdict} - ", plan.reason, indent=4)
    return "\n".join(L)


def hier_lines(plan: Plan) -> List[str]:
    """The hier designs side by side: EFA messages, rows, bytes, descriptors and NVLink bytes
    per rank and op, and D+C (empty when the group lives on one node)."""
    tr = plan.traffic
    if not all(plan.paths.get(n) is not None and plan.paths[n].applicable for n in ("hier:agg1", "hier:agg0")):
        return []
    L = ["  hier per rank and op (agg1: once per destination node via the rail peer, then NVLink; "
         "agg0: once per destination rank, no forwarding) [D]:",
         f"    {'design':10s} {'EFA msgs':>9s} {'EFA rows':>10s} {'EFA bytes':>10s} {'descs':>6s} "
         f"{'NVLink bytes':>12s} {'D+C us':>9s}  K"]
    for n in ("hier:agg1", "hier:agg0"):
        p = plan.paths[n]
        L.append(f"    {n:10s} {tr[n + '_efa_messages_op'].value:>9.2f} {tr[n + '_efa_rows_op'].value:>10.1f} "
                 f"{_b(tr[n + '_efa_bytes_op'].value):>10s} {tr[n + '_descriptors_op'].value:>6.0f} "
                 f"{_b(tr[n + '_nvlink_bytes_op'].value):>12s} {p.dc_us.value:>9.1f}  {p.num_channels}")
    L.append("    (hier:agg1 is what `auto` runs across nodes; the verdict ranks both designs with proxy and "
             "Megatron)")
    return L


def final_line(plan: Plan) -> str:
    """The one line other tools parse (format fixed; ``transport`` is a path name: gda, proxy,
    hier:agg1 / hier:agg0 = ``EFA_EP_TRANSPORT=hier`` with ``aggregate=1`` / ``0``, alltoall,
    allgather)."""
    return (f"plan: verdict={plan.verdict} transport={plan.transport} num_channels={plan.num_channels} "
            f"dc_us={plan.dc_us:.1f} bound={plan.bound}")


def sweep(inp: Inputs, cal: Dict[str, Fig], tokens: Sequence[int]) -> List[Dict[str, Any]]:
    rows = []
    for t in tokens:
        p = make_plan(dataclasses.replace(inp, tokens_per_rank=int(t), max_tokens_per_rank=None), cal)
        row = {"tokens_per_rank": int(t), "verdict": p.verdict, "transport": p.transport,
               "num_channels": p.num_channels}
        for n, pr in p.paths.items():
            if pr.applicable:
                row[n] = pr.dc_us.value
        if p.paths["proxy"].applicable:
            row["proxy_k1"] = p.paths["proxy"].by_channels[1]
        rows.append(row)
    return rows


def to_json(plan: Plan, cal: Dict[str, Fig], sweep_rows, extra: Dict[str, Any]) -> Dict[str, Any]:
    d = lambda figs: {k: v.to_dict() for k, v in figs.items()}  # noqa: E731
    return {
        "schema": "efa_ep.plan/1",
        "inputs": d(input_figs(plan.inputs)),
        "calibration": d({k: v for k, v in cal.items()}),
        "traffic": d(plan.traffic), "compute": d(plan.compute), "memory": d(plan.memory),
        "paths": {k: v.to_dict() for k, v in plan.paths.items()},
        "share_of_step": d(plan.shares), "per_step_us": d(plan.step),
        "verdict": plan.verdict, "transport": plan.transport, "num_channels": plan.num_channels,
        "reason": plan.reason, "ranking": plan.ranking, "bound": plan.bound, "dc_us": plan.dc_us,
        "line": final_line(plan),
        "sweep": sweep_rows, **extra,
    }


def plot(plan: Plan, sweep_rows, path: str) -> Optional[str]:
    """Predicted D+C vs tokens per rank for every path, verdict regions shaded; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    inp = plan.inputs
    xs = [r["tokens_per_rank"] for r in sweep_rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"dense": "#dddddd", "capacity": "#fde2b8", "efa": "#c8ecc8"}
    for i, r in enumerate(sweep_rows):
        lo = math.sqrt(xs[i - 1] * xs[i]) if i else xs[0] / 1.2
        hi = math.sqrt(xs[i] * xs[i + 1]) if i + 1 < len(xs) else xs[-1] * 1.2
        ax.axvspan(lo, hi, color=colors[r["verdict"]], alpha=0.6, lw=0)
    styles = {"gda": ("gda (NVLink)", "-"), "proxy": ("proxy, best K", "-"), "proxy_k1": ("proxy K=1", ":"),
              "alltoall": ("Megatron alltoall (NCCL)", "--"), "allgather": ("Megatron allgather (NCCL)", "-."),
              "hier:agg1": ("hier, once per node", "-"), "hier:agg0": ("hier, once per rank", ":")}
    for key, (label, ls) in styles.items():
        ys = [r.get(key) for r in sweep_rows]
        if any(y is not None for y in ys):
            ax.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], ls,
                    marker="o", ms=3, label=label)
    ax.axvline(inp.tokens_per_rank, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank per micro-batch")
    ax.set_ylabel("predicted dispatch + combine per MoE layer, us")
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color=c, alpha=0.6, label=f"verdict {v}") for v, c in colors.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    ax.set_title(f"{inp.model} on {inp.nodes} x {inp.fabric}, EP {inp.ep}: verdict {plan.verdict} at "
                 f"{inp.tokens_per_rank} tok/rank (line)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
