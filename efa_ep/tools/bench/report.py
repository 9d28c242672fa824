"""The parent's outputs from the records of all starts: each record's ratio to the reference
arm of its start, one summary row per cell, the markdown table (latency, tokens/s, ratios,
network counts) and box plots per profile (and per feature in the layer view)."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

from .. import bench_stats
from .arms import timing_modes
from .features import layer_features
from .schema import COLLECTIVE_ARM_NAMES, timing_boundary

# The arm every other arm of a view is compared with, in the same cell (and feature).
REFERENCE_ARMS = {"transport": "torch", "layer": "alltoall"}


def _cell_of(r: Dict[str, Any]) -> Tuple:
    """A record's or summary row's cell, without the arm (records of older runs have no
    timing or feature)."""
    return (r["view"], r["profile"], r["shape"], r["route"], r["dtype"], r.get("timing", "single"),
            r.get("feature"))


def add_reference_ratios(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Sets each record's ``vs_reference``: its start median over that of the reference arm
    (:data:`REFERENCE_ARMS`) in the same cell and feature of the same start; None when either
    is void or the reference did not run. Returns ``records``."""
    ref = {(r["start"],) + _cell_of(r): r for r in records
           if r["arm"] == REFERENCE_ARMS.get(r["view"]) and not r["void"]}
    for r in records:
        base = ref.get((r["start"],) + _cell_of(r))
        value = (bench_stats.ratio(r["start_median_us"], base["start_median_us"])
                 if base is not None and not r["void"] else None)
        r["vs_reference"] = round(value, 4) if value is not None else None
    return records


def summarize_records(records: List[Dict[str, Any]], cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One summary row per cell: n (non-void starts), n_void, stats of the per-start medians,
    tokens/s, the ratio to the reference arm (``torch`` / ``alltoall``) of the same cell and
    feature, the layer view's ratio to the same arm in feature ``plain`` (``vs_plain``) and,
    where a raw collective arm ran, the ratio to it (``vs_collective``)."""
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(_cell_of(r) + (r["arm"],), []).append(r)
    rows = []
    for key, recs in groups.items():
        view, profile, shape, route, dtype, timing, feature, arm = key
        good = [r["start_median_us"] for r in recs if not r["void"]]
        st = bench_stats.summarize(good, alpha=float(cfg["alpha"]), min_n_for_ci=int(cfg["min_n_for_ci"]),
                                   seed=int(cfg["seed"]))
        r0 = recs[0]
        tok_s = (r0["ep_size"] * r0["tokens_per_rank"] / (st["median"] * 1e-6)) if st["median"] else None
        rows.append({"view": view, "profile": profile, "shape": shape, "route": route, "dtype": dtype,
                     "timing": timing, "feature": feature, "arm": arm,
                     "num_channels": r0["num_channels"],
                     "tokens_per_rank": r0["tokens_per_rank"],
                     "hidden": r0["hidden"], "num_experts": r0["num_experts"], "topk": r0["topk"],
                     "ep_size": r0["ep_size"], "n_void": sum(1 for r in recs if r["void"]),
                     "void_reasons": sorted({(r["void_reason"] or "")[:200] for r in recs if r["void"]}),
                     "latency_us": st, "tokens_per_s": tok_s, "route_stats": r0["route_stats"],
                     "collective": r0["arm"] in COLLECTIVE_ARM_NAMES,
                     # deterministic per cell (same route every start): the first record's
                     "net_counts": next((r.get("net_counts") for r in recs
                                         if not r["void"] and r.get("net_counts")), None),
                     "host_us": _host_median(recs)})
    by_key = {_cell_of(r) + (r["arm"],): r for r in rows}
    for r in rows:
        cell = _cell_of(r)
        ref = by_key.get(cell + (REFERENCE_ARMS[r["view"]],))
        r["vs_reference"] = bench_stats.ratio(r["latency_us"]["median"],
                                              ref["latency_us"]["median"] if ref else None)
        plain = (by_key.get(cell[:-1] + ("plain", r["arm"])) if r["view"] == "layer" else None)
        r["vs_plain"] = bench_stats.ratio(r["latency_us"]["median"],
                                          plain["latency_us"]["median"] if plain else None)
        coll = next((by_key[cell + (a,)] for a in COLLECTIVE_ARM_NAMES if cell + (a,) in by_key), None)
        r["vs_collective"] = bench_stats.ratio(r["latency_us"]["median"],
                                               coll["latency_us"]["median"] if coll else None)
        r["collective_arm"] = coll["arm"] if coll else None
    order = {f: i for i, f in enumerate(layer_features(cfg))}
    rows.sort(key=lambda r: (r["view"] != "transport", r["timing"], r["profile"], r["shape"],
                             r["route"], order.get(r["feature"], len(order)), str(r["feature"]),
                             r["arm"]))
    return rows


def _host_median(recs: List[Dict[str, Any]]) -> Any:
    """Median over starts of the records' host time per op (``{"dispatch", "combine"}`` us),
    or None when no record has one."""
    import statistics

    hs = [r.get("host_us") for r in recs if not r["void"] and r.get("host_us")]
    if not hs:
        return None
    return {op: round(statistics.median(h[op] for h in hs), 2) for op in ("dispatch", "combine")}


def markdown_table(rows: List[Dict[str, Any]], cfg: Dict[str, Any], meta: Dict[str, Any]) -> str:
    """The run's markdown: method line, timing boundaries, one table per view, the network
    counts table and the arms not run."""
    modes = timing_modes(cfg)
    lines = [f"Slowest-rank latency in us: median of per-start medians, with a bootstrap interval "
             f"of the median where n allows ({int(100 * (1 - float(cfg['alpha'])))}%), else min/max. "
             f"EP={meta['ep_size']}, dtype {cfg['dtype']}, device {cfg['device']}, backend "
             f"{cfg['backend']}, starts {cfg['starts']} x {cfg['iters']} samples "
             f"(+{cfg['warmup']} warm-up)."]
    views = [v for v in ("transport", "layer") if any(r["view"] == v for r in rows)]
    for m in modes:
        extra = f" (steady_iters={cfg.get('steady_iters')})" if m == "steady" else ""
        for view in views or ["transport"]:
            what = "" if views == ["transport"] or not views else f", {view} view"
            lines.append(f"Timing `{m}`{extra}{what}: {timing_boundary(m, view)}.")
    if cfg.get("scaled"):
        lines.append(f"**Scaled shapes:** {cfg.get('scale_note')}")
    coll = sorted({r["collective_arm"] for r in rows if r.get("collective_arm")})
    for view, ref in REFERENCE_ARMS.items():
        vr = [r for r in rows if r["view"] == view]
        if not vr:
            continue
        layer = view == "layer"
        title = ("Dispatch + combine" if not layer
                 else "MoE layer forward + backward (Megatron MoELayer)")
        vs_coll = not layer and coll
        vs_plain = layer and any(r["feature"] not in (None, "plain") for r in vr)
        host = not layer and any(r.get("host_us") for r in vr)
        head = (f"| timing | {'feature' if layer else 'profile'} | shape (H, E, top-k, tok/rank) | "
                f"route | arm | latency us | tokens/s (aggregate) | vs {ref}"
                + (" (same feature)" if layer else "") + " |"
                + (f" vs {'/'.join(coll)} |" if vs_coll else "")
                + (" vs plain (same arm) |" if vs_plain else "")
                + (" host us per op (D / C) |" if host else "") + " void |")
        lines += ["", f"### {title}", ""]
        if vs_plain:
            lines += [_FEATURES_NOTE, ""]
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for r in vr:
            shape = f"{r['shape']} ({r['hidden']}, {r['num_experts']}, {r['topk']}, {r['tokens_per_rank']})"
            tps = f"{r['tokens_per_s']:.3g}" if r["tokens_per_s"] else "-"
            vs = f"{r['vs_reference']:.3f}" if r["vs_reference"] else "-"
            vc = (f" {r['vs_collective']:.3f} |" if r.get("vs_collective") else " - |") if vs_coll else ""
            vp = (f" {r['vs_plain']:.3f} |" if r.get("vs_plain") else " - |") if vs_plain else ""
            second = (r.get("feature") or "plain") if layer else r["profile"]
            hu = r.get("host_us")
            hc = ((f" {hu['dispatch']:.0f} / {hu['combine']:.0f} |" if hu else " - |")
                  if host else "")
            lines.append(f"| {r['timing']} | {second} | {shape} | {r['route']} | {r['arm']} | "
                         f"{bench_stats.format_stats(r['latency_us'])} | {tps} | {vs} |{vc}{vp}{hc} "
                         f"{r['n_void']} |")
    lines += net_counts_table(rows)
    if meta.get("not_run"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in meta["not_run"].items())]
    return "\n".join(lines) + "\n"


_FEATURES_NOTE = (
    "Features (`layer.features`): plain = dropless, no shared expert; pad = drop-and-pad "
    "capacity mode (efa: static shapes through dispatch_fixed); shared = a shared expert run "
    "after the routed experts; shared_overlap = the same shared expert overlapped with the "
    "transfers. alltoall runs in the same mode as efa in every feature.")


def _n(v) -> str:
    return "-" if v is None else (f"{v / 1e3:.1f}k" if v >= 1e4 else str(v))


def net_counts_table(rows: List[Dict[str, Any]]) -> List[str]:
    """Markdown lines: network operations and bytes per dispatch and combine of every counting
    arm (all ranks, one op), next to the cross-node figure of a flat design at the same layout;
    empty when no arm counted."""
    counted = [r for r in rows if r["view"] == "transport" and (r.get("net_counts") or {}).get("dispatch")]
    if not counted:
        return []
    lines = ["", "### Network operations per op (all ranks, one dispatch / one combine)", "",
             "messages = (source, destination rank) pairs with >= 1 row on the network; "
             "writes = libfabric writes queued (headers and footers included); bytes = row "
             "payload, wire bytes = everything written. Flat proxy: every peer goes through "
             "libfabric; hier: only rows that cross nodes. `flat x-node` = destination ranks on "
             "other nodes with >= 1 row, rows (what no aggregation sends across nodes).", "",
             "| timing | profile | shape | route | arm | nodes x G | D msgs | D rows | D bytes | "
             "D writes | D wire bytes | C msgs | C writes | C wire bytes | flat x-node msgs / rows |",
             "|" + "---|" * 15]
    for r in counted:
        nc = r["net_counts"]
        d, c, x = nc["dispatch"], nc.get("combine") or {}, nc["per_rank_cross_node"]
        lines.append(f"| {r['timing']} | {r['profile']} | {r['shape']} | {r['route']} | {r['arm']} | "
                     f"{nc['num_nodes']} x {nc['node_size']} | {_n(d['messages'])} | {_n(d['rows'])} | "
                     f"{_n(d['bytes'])} | {_n(d['writes'])} | {_n(d['wire_bytes'])} | "
                     f"{_n(c.get('messages'))} | {_n(c.get('writes'))} | {_n(c.get('wire_bytes'))} | "
                     f"{_n(x['messages'])} / {_n(x['rows'])} |")
    return lines


def box_plots(records: List[Dict[str, Any]], out_dir: str,
              features: Sequence[str] = ()) -> List[str]:
    """One PNG per profile: per-start medians of every arm, grouped by shape, route, timing and
    (layer view) feature, features in the order of ``features`` (others after, by name)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    profiles = sorted({r["profile"] for r in records})
    for prof in profiles:
        recs = [r for r in records if r["profile"] == prof and not r["void"]]

        def group_of(r):
            return (r["shape"], r["route"], r.get("timing", "single"), r.get("feature") or "")

        rank = {f: i for i, f in enumerate(features)}
        groups = sorted({group_of(r) for r in recs},
                        key=lambda g: g[:3] + (rank.get(g[3], len(rank)), g[3]))
        arms = sorted({r["arm"] for r in recs}, key=lambda a: (a not in ("torch", "alltoall"), a))
        if not groups:
            continue
        fig, axes = plt.subplots(1, len(groups), figsize=(max(5, 3.2 * len(groups)), 4.2), squeeze=False)
        for ax, group in zip(axes[0], groups):
            shape, route, timing, feature = group
            data, labels = [], []
            for a in arms:
                vals = [r["start_median_us"] for r in recs if group_of(r) == group and r["arm"] == a]
                if vals:
                    data.append(vals)
                    labels.append(f"{a}\nn={len(vals)}")
            ax.boxplot(data, showfliers=True)
            ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7, rotation=30)
            ax.set_title(f"{shape} / {route} / {timing}" + (f"\nfeature {feature}" if feature else ""),
                         fontsize=9)
            ax.set_ylabel("slowest-rank latency, us")
        fig.suptitle(f"profile {prof}: per-start medians", fontsize=10)
        fig.tight_layout()
        p = os.path.join(out_dir, f"bench_{prof}.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths
