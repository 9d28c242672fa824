"""Fitting the planner's per-operation costs from this project's benchmark records.

Inputs (any mix; the format is recognised per file):

- ``efa-ep-bench`` raw records (``bench_records.jsonl``, schema ``efa_ep.bench/1``) and its
  summary (``bench_summary.json``): dispatch+combine latency per cell;
- ``scripts/bench_proxy.py`` output (``{"meta": ..., "records": [...]}``): proxy descriptor
  rates per channel count (``rate``) and GPU descriptor round trips (``gpu_roundtrip``);
- planner records (``efa_ep.plan.record/1`` lines): figures measured by this project that no
  bench file holds (e.g. the two-GPU NVLink runs, ``results/plan/measured_h200x2.jsonl``);
- ``scripts/gpu/gda_gpu_check.py`` output (``gda_gpu_check*.json``: ranks as processes on one
  GPU): its regular (eager, dropless) dispatch+combine cells, the median over starts per EP size
  and profile.

Every dispatch+combine observation becomes ``(group, shape, bytes, us)`` where ``group`` is the
arm on one kind of link (``gda@nvlink``, ``gda@hbm`` = ranks sharing one GPU, ``proxy:k2@hbm``,
``torch@hbm``, ``nccl_a2a@nvlink``) and ``bytes`` the model's bytes of one D+C
(:func:`dc_bytes`: one rank's; on ``hbm`` summed over the ranks, which share the one GPU's memory,
so EP sizes compare). Each group is fitted with ``us = 2 x fixed + bytes / rate`` (least squares);
a group measured on several dates is fitted once per date (:func:`dc_groups`).
The planner uses gda's fixed cost from the newest gda records on any link (host work: with the
shipped records, the current code on one H200, ``gda@hbm``), gda's link efficiency from
``gda@nvlink`` (two GPUs), ``nccl_a2a@nvlink`` (fixed cost and link efficiency), the
proxy's descriptor rates (per-descriptor cost, channel-scaling exponent ``alpha`` in
``rate(num_channels) = rate(1) x num_channels**alpha``) and the GPU round trip. Parameters the records cannot give
(EFA-specific rates: no EFA here) come from the measured DeepEP-on-EFA study (p5en, EP16),
tagged so.

Held-out check: groups with two or more shapes are refitted without each shape in turn and
predict it; descriptor rates of one record file are predicted from the others' alpha.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .model import DTYPE_BYTES, Fig, p_rank
from .presets import deepep_efa_figures

SCHEMA = "efa_ep.plan.calibration/1"
NVLINK4_GBPS = 450.0   # H200 NVLink 4, GB/s per direction (NVIDIA spec: 900 GB/s bidirectional)
P5EN_EFA_NODE_GBPS = 400.0  # 16 x 200 Gb/s

# Parameters the planner needs and what they mean (units in the names).
PARAMS = {
    "gda_fixed_us": "host + launch cost of one gda op (dispatch or combine), us",
    "gda_link_eff": "fraction of the NVLink spec bandwidth gda stores reach",
    "nccl_fixed_us": "fixed cost of one NCCL all-to-all op, us",
    "nccl_link_eff": "fraction of NVLink spec bandwidth NCCL all-to-all reaches",
    "nccl_efa_eff": "fraction of EFA spec bandwidth NCCL reaches across nodes",
    "proxy_fixed_us": "fixed cost of one proxy op (host work + GPU descriptor round trip), us",
    "proxy_post_us": "CPU cost of posting one descriptor on one channel, us",
    "proxy_channel_alpha": "channel scaling exponent: rate(num_channels) = rate(1) x num_channels**alpha",
    "proxy_channel_gbps": "bytes one proxy channel moves per second over EFA, GB/s",
    "hier_fixed_us": "fixed cost of one hier op: both stages' host work, the group's status "
                     "exchange and the permutation, us",
}


def default_calibration() -> Dict[str, Fig]:
    """Used when no calibration file exists: every value assumed (the shipped file replaces it)."""
    s = deepep_efa_figures()
    a = "assumed default (no calibration file; run `efa-ep-plan calibrate`)"
    return {"_name": Fig("built-in defaults", "", "assumed", a),
            "gda_fixed_us": Fig(300.0, "us", "assumed", a), "gda_link_eff": Fig(0.5, "fraction", "assumed", a),
            "nccl_fixed_us": Fig(50.0, "us", "assumed", a), "nccl_link_eff": Fig(0.65, "fraction", "assumed", a),
            "nccl_efa_eff": Fig(0.28, "fraction", "assumed", a), "proxy_fixed_us": Fig(305.0, "us", "assumed", a),
            "proxy_post_us": Fig(0.25, "us", "assumed", a), "proxy_channel_alpha": Fig(0.75, "", "assumed", a),
            "proxy_channel_gbps": s["proxy_channel_gbps_efa"],
            "hier_fixed_us": Fig(605.0, "us", "assumed", a + ": proxy_fixed_us + gda_fixed_us")}


def hier_from_stages(params: Dict[str, Fig], why: str) -> Fig:
    """``hier_fixed_us`` as its stages' sum, ``proxy_fixed_us + gda_fixed_us`` of ``params``
    (tagged derived; ``why``: why no measured hier figure applies)."""
    pf, gf = float(params["proxy_fixed_us"].value), float(params["gda_fixed_us"].value)
    return Fig(round(pf + gf, 2), "us", "derived",
               f"proxy_fixed_us {pf:.1f} + gda_fixed_us {gf:.1f} (its network stage's and local "
               f"stage's fixed costs; {why})")


def _fitted_fixed(name: str, fit: Dict[str, Any], what: str) -> Fig:
    """The fixed cost per op of the fitted group ``name`` (``fit``), tagged measured; ``what``:
    what the records are."""
    return Fig(round(fit["fixed_us"], 2), "us", "measured",
               f"fit of {name} D+C = 2 x fixed + bytes / rate (n={fit['n']}, {what}): "
               + "; ".join(fit["sources"]))


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
def dc_bytes(tokens: int, hidden: int, num_experts: int, topk: int, ep: int, dtype: str) -> float:
    """Bytes one rank sends to other ranks in one dispatch + one combine (uniform routing)."""
    return 2.0 * tokens * (ep - 1) * p_rank(num_experts, topk, ep) * hidden * DTYPE_BYTES[dtype]


def _rel(path: str) -> str:
    """``path`` relative to the repository root when inside it (stable names in shipped files)."""
    from ..provenance import repo_root

    ap, root = os.path.abspath(path), repo_root()
    return os.path.relpath(ap, root) if ap.startswith(root + os.sep) else ap


def _dtype(d: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(d, d)


def _obs(group, shape, tokens, hidden, experts, topk, ep, dtype, us, source, nbytes=None, lo=None, hi=None,
         date="?"):
    if nbytes is None:
        nbytes = dc_bytes(tokens, hidden, experts, topk, ep, _dtype(dtype))
    if group.endswith("@hbm"):
        nbytes *= ep   # every rank on one GPU: they share its memory, so the bytes of all ranks count
    return {"kind": "dc", "group": group, "shape": shape, "tokens_per_rank": tokens, "hidden": hidden,
            "num_experts": experts, "topk": topk, "ep_size": ep, "bytes": nbytes, "us": float(us),
            "min_us": lo, "max_us": hi, "source": source, "date": str(date)[:10]}


def _arm_group(arm: str) -> str:
    """Bench arm name -> fit group prefix: the bench's raw NCCL all_to_all_single arm (``nccl``,
    the same bytes as the efa dispatch) feeds the NCCL parameters."""
    return "nccl_a2a" if arm == "nccl" else arm


def _bench_link(device: str, ranks_per_gpu, ep: int) -> str:
    if str(device).startswith("cpu"):
        return "cpu"
    if str(device) in ("cuda:0",) or (ranks_per_gpu and int(ranks_per_gpu) > 1):
        return "hbm"  # every rank on one GPU: 'remote' stores are local HBM writes
    return "nvlink"


def load(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """Observations from every file in ``paths`` (see the module docstring for formats).

    Raises:
        FileNotFoundError: a path does not exist. ValueError: a file is in no known format.
    """
    out: List[Dict[str, Any]] = []
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"record file {path} does not exist")
        with open(path) as f:
            text = f.read()
        name = _rel(path)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        try:
            doc = json.loads(text)
            docs = None
        except json.JSONDecodeError:
            doc = None
            docs = [json.loads(ln) for ln in lines]
        if isinstance(doc, dict) and "records" in doc and "meta" in doc:
            out += _from_bench_proxy(doc, name)
        elif isinstance(doc, dict) and "copy_ceiling_tbps" in doc and "cells" in doc:
            out += _from_gda_check(doc, name)
        elif isinstance(doc, dict) and str(doc.get("schema", "")).endswith("-summary"):
            out += _from_bench_summary(doc, name)
        elif docs is not None or isinstance(doc, dict):
            got = 0
            bench_cells: Dict[Tuple, List[Dict[str, Any]]] = {}
            for r in docs if docs is not None else [doc]:
                sch = str(r.get("schema", ""))
                if sch == "efa_ep.plan.record/1":
                    out.append(_from_plan_record(r, name))
                    got += 1
                elif sch in ("efa_ep.bench/1", "efa_ep.bench/2") and r.get("view") == "transport" \
                        and not r.get("void") and r.get("timing", "single") == "single":
                    key = (r["arm"], r["profile"], r["shape"], r["route"], r["dtype"], r["ep_size"])
                    bench_cells.setdefault(key, []).append(r)
                    got += 1
            for (arm, prof, shape, route, dtype, ep), recs in bench_cells.items():
                r0 = recs[0]
                vals = [r["start_median_us"] for r in recs]
                link = _bench_link(r0.get("device", ""), r0.get("ranks_per_gpu"), ep)
                date = (r0.get("provenance") or {}).get("date_utc", "?")
                out.append(_obs(f"{_arm_group(arm)}@{link}", shape, r0["tokens_per_rank"], r0["hidden"], r0["num_experts"],
                                r0["topk"], ep, dtype, statistics.median(vals),
                                f"{name} ({date}, n={len(vals)} starts, {prof}/{route})",
                                lo=min(vals), hi=max(vals), date=date))
            if not got:
                raise ValueError(f"{path}: no efa-ep-bench or planner records in it")
        else:
            raise ValueError(f"{path}: not a bench record file, bench summary, bench_proxy output or "
                             f"planner record file")
    return out


def _from_bench_summary(doc, name) -> List[Dict[str, Any]]:
    cfg = doc.get("config", {})
    date = (doc.get("provenance") or {}).get("date_utc", "?")
    gpu = ((doc.get("provenance") or {}).get("gpu") or {}).get("name", "cpu")
    out = []
    for c in doc.get("cells", []):
        if c.get("view") != "transport" or not c["latency_us"].get("median") \
                or c.get("timing", "single") != "single":
            continue
        link = _bench_link(cfg.get("device", ""), cfg.get("ranks_per_gpu"), c["ep_size"])
        st = c["latency_us"]
        out.append(_obs(f"{_arm_group(c['arm'])}@{link}", c["shape"], c["tokens_per_rank"], c["hidden"], c["num_experts"],
                        c["topk"], c["ep_size"], c["dtype"], st["median"],
                        f"{name} ({date}, {gpu}, EP {c['ep_size']}, n={st.get('n')} starts, "
                        f"{c['profile']}/{c['route']})", lo=st.get("min"), hi=st.get("max"), date=date))
    return out


def _from_gda_check(doc, name) -> List[Dict[str, Any]]:
    """The regular-mode cells of a ``gda_gpu_check`` run (every rank on one GPU: ``gda@hbm``):
    per EP size and cell, the median over starts of the slowest rank's median D+C. Cells that
    failed their bitwise check or their run are left out."""
    shape = doc["shape"]
    date = str(doc.get("date", "?"))[:10]
    by: Dict[Tuple[int, str], List[Dict[str, Any]]] = {}
    for c in doc["cells"]:
        if "error" in c or not c.get("ok") or c["cell"].count("/") != 1:  # route/profile only
            continue
        by.setdefault((c["world"], c["cell"]), []).append(c)
    out = []
    for (world, cell), cs in sorted(by.items()):
        tot = [c["total_us"] for c in cs]
        tokens = cs[0].get("tokens") or cs[0]["per_rank"][0]["tokens"]
        host = statistics.median(c.get("host_dispatch_us", 0.0) + c.get("host_combine_us", 0.0)
                                 for c in cs)
        out.append(_obs("gda@hbm", f"H{shape['hidden']}/E{shape['experts']}/k{shape['topk']}", tokens,
                        shape["hidden"], shape["experts"], shape["topk"], world, shape["dtype"],
                        statistics.median(tot),
                        f"{name} ({date}, {doc.get('device')}, EP {world} as processes on one GPU, "
                        f"n={len(tot)} starts, {cell}, eager regular mode; host time per D+C "
                        f"{host:.0f} us)", lo=min(tot), hi=max(tot), date=date))
    if not out:
        raise ValueError(f"{name}: no passing regular-mode cells in this gda_gpu_check run")
    return out


def _from_plan_record(r, name) -> Dict[str, Any]:
    nbytes = None
    if r["arm"] == "nccl_a2a":   # rows per peer given: bytes as sent (no dedup model)
        nbytes = 2.0 * r["rows_per_peer"] * (r["ep_size"] - 1) * r["hidden"] * DTYPE_BYTES[r["dtype"]]
    st = r["dc_us"]
    return _obs(f"{r['arm']}@{r['link']}", f"H{r['hidden']}/E{r['num_experts']}/k{r['topk']}",
                r["tokens_per_rank"], r["hidden"], r["num_experts"], r["topk"], r["ep_size"], r["dtype"],
                st["median"], f"{name}: {r['source']} ({r['date']}, {r['machine']})", nbytes=nbytes,
                lo=st.get("min"), hi=st.get("max"), date=r["date"])


def _from_bench_proxy(doc, name) -> List[Dict[str, Any]]:
    meta = doc.get("meta", {})
    src = f"{name} ({meta.get('date', '?')}, {meta.get('cpus', '?')} cores, libfabric {meta.get('libfabric', '?')})"
    out = []
    for r in doc["records"]:
        if r["kind"] == "rate":
            out.append({"kind": "rate", "provider": r["provider"], "channels": r["channels"],
                        "bytes": r["bytes"], "per_s": r["desc_per_s"]["median"], "file": name, "source": src})
        elif r["kind"] == "gpu_roundtrip":
            out.append({"kind": "gpu_roundtrip", "provider": r["provider"], "bytes": r["bytes"],
                        "us": r["us_per_op"]["median"], "file": name, "source": src})
        elif r["kind"] == "a2a" and r.get("bit_identical_to_torch") and r.get("device") == "cuda":
            # D+C of CUDA inputs staged through host memory: the host work per op of the GPU path
            starts = r.get("proxy_start_medians_ms") or [r["proxy_ms"]["median"]]
            date = str(meta.get("date", "?"))[:10]
            out.append(_obs(f"proxy@{r['provider']}", f"H{r['hidden']}/E{r['experts']}/k{r['topk']}",
                            r["tokens_per_rank"], r["hidden"], r["experts"], r["topk"], r["ranks"],
                            r["dtype"], 1e3 * r["proxy_ms"]["median"],
                            f"{src}: {r['profile']} D+C of CUDA inputs, {r.get('num_channels')} "
                            f"channels, {r.get('starts', 1)} starts x {r.get('iters_per_start')}",
                            lo=1e3 * min(starts), hi=1e3 * max(starts), date=date))
    return out


# ----------------------------------------------------------------------------------------------
# Fitting
# ----------------------------------------------------------------------------------------------
def fit_linear(obs: Sequence[Dict[str, Any]]) -> Tuple[float, float]:
    """Least squares of the relative error of ``us = 2 x fixed + bytes x slope`` -> (fixed us per
    op, slope us per B): every record counts by its error over its own time, so a decode cell
    weighs as much as a prefill cell 20x its time (an absolute fit lets the largest cell set the
    intercept, the fixed cost that small batches are made of). One distinct byte count: slope 0,
    fixed = mean / 2. A negative fit is clipped at 0."""
    xs = [o["bytes"] for o in obs]
    ys = [o["us"] for o in obs]
    n = len(xs)
    if len(set(xs)) < 2:
        return sum(ys) / n / 2, 0.0
    # minimize sum(((2 f + x s) - y) / y)^2: normal equations of a = 2 f, s with weights 1 / y^2
    w = [1.0 / (y * y) for y in ys]
    s0 = sum(w)
    s1, s2 = sum(wi * x for wi, x in zip(w, xs)), sum(wi * x * x for wi, x in zip(w, xs))
    t0, t1 = sum(wi * y for wi, y in zip(w, ys)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = s0 * s2 - s1 * s1
    slope = max(0.0, (s0 * t1 - s1 * t0) / det) if det > 0 else 0.0
    fixed = max(0.0, (t0 - slope * s1) / s0 / 2)
    return fixed, slope


def fit_alpha(rates: Sequence[Dict[str, Any]]) -> Tuple[float, float, int]:
    """Channel-scaling exponent from descriptor rates: least squares through the origin of
    ``log(rate(num_channels) / rate(1))`` on ``log num_channels`` per (file, provider, bytes).
    Returns (alpha, median per-descriptor cost on one channel in us, number of points)."""
    groups: Dict[Tuple, Dict[int, float]] = {}
    for r in rates:
        groups.setdefault((r["file"], r["provider"], r["bytes"]), {})[int(r["channels"])] = r["per_s"]
    num = den = 0.0
    n = 0
    posts = []
    for g in groups.values():
        if 1 not in g:
            continue
        posts.append(1e6 / g[1])
        for nc, v in g.items():
            if nc > 1:
                x, y = math.log(nc), math.log(v / g[1])
                num += x * y
                den += x * x
                n += 1
    if not n:
        raise ValueError("descriptor-rate records need one channel and more than one channel for the same "
                         "provider and size")
    return num / den, statistics.median(posts), n


def dc_groups(obs: Sequence[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """The D+C observations by fit group. A group measured on several dates is split into one
    group per date, named ``<group> <YYYY-MM-DD>`` (e.g. ``gda@hbm 2026-12-02``): records of
    different dates may be of different code (gda's host path changed between the 2026-11-29
    bench and the 2026-12-02 records), and one fit across them describes neither."""
    by: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for o in obs:
        if o["kind"] == "dc":
            by.setdefault(o["group"], {}).setdefault(o.get("date", "?"), []).append(o)
    out: Dict[str, List[Dict[str, Any]]] = {}
    for g, dates in by.items():
        if len(dates) == 1:
            out[g] = next(iter(dates.values()))
        else:
            for d, os_ in dates.items():
                out[f"{g} {d}"] = os_
    return out


def newest_group(fits: Dict[str, Dict[str, Any]], prefix: str,
                 links: Sequence[str] = ("nvlink", "hbm")) -> Optional[str]:
    """The fitted group of arm ``prefix`` (e.g. ``gda``) on one of ``links`` with the newest
    measurement date; on equal dates the earlier link in ``links`` wins. None when there is none."""
    best, key = None, None
    for g, f in fits.items():
        base = g.split(" ")[0]
        arm, _, link = base.partition("@")
        if arm != prefix or link not in links:
            continue
        k = (f.get("date") or "?", -list(links).index(link))
        if key is None or k > key:
            best, key = g, k
    return best


def calibrate(paths: Sequence[str], provider: str = "shm", desc_bytes: int = 64) -> Dict[str, Any]:
    """Fits every parameter from the records in ``paths``; returns the calibration document
    (``params``: name -> Fig dict; ``groups``: every fitted group; ``validation``: held-out rows).

    gda's fixed cost per op is host work (launches, the count read), not link time, so it comes
    from the newest gda records on any link (:func:`newest_group`: the current code; with the
    shipped records, the one-H200 ``gda@hbm`` records of 2026-12-02). gda's link efficiency
    needs a real NVLink: it comes from the ``gda@nvlink`` fit's rate (its slope: the difference
    between its shapes, which the fixed cost cancels out of)."""
    obs = load(paths)
    groups = dc_groups(obs)
    fits = {}
    for g, os_ in sorted(groups.items()):
        fixed, slope = fit_linear(os_)
        pred = [2 * fixed + o["bytes"] * slope for o in os_]
        rel = [abs(p - o["us"]) / o["us"] for p, o in zip(pred, os_)]
        fits[g] = {"fixed_us": fixed, "gbps": (1e-3 / slope) if slope > 0 else None, "n": len(os_),
                   "shapes": sorted({o["shape"] for o in os_}), "max_abs_rel_err": max(rel),
                   "date": max(o.get("date", "?") for o in os_),
                   "sources": sorted({o["source"].split(" (")[0] for o in os_})}
    params: Dict[str, Fig] = {}
    study = deepep_efa_figures()

    def from_group(g: Optional[str], what: str, name: Optional[str] = None) -> Dict[str, Any]:
        if g not in fits:
            raise ValueError(f"no records for {name or g} ({what}); pass a file with them (e.g. "
                             f"results/plan/measured_h200x2.jsonl)")
        return fits[g]

    nv_name = newest_group(fits, "gda", ("nvlink",))
    nv = from_group(nv_name, "gda over NVLink", "gda@nvlink")
    fx_name = newest_group(fits, "gda")
    fx = fits[fx_name]
    src = "; ".join(fx["sources"])
    why = ("" if fx_name == nv_name else
           f"; the newest gda records ({fx['date']}; gda@nvlink: {nv['date']}): the fixed cost is host work, "
           f"not link time")
    # the same date's gda fits on the other link (ranks sharing one GPU), named for comparison:
    # a host's speed moves the fixed cost as much as the code does
    same_day = [f"{g}: {f['fixed_us']:.0f} us" for g, f in sorted(fits.items())
                if g != fx_name and g.split("@")[0] == "gda" and f.get("date") == fx["date"]]
    if same_day:
        why += f" (the same day's other gda fits: {', '.join(same_day)})"
    params["gda_fixed_us"] = Fig(round(fx["fixed_us"], 2), "us", "measured",
                                 f"fit of {fx_name} D+C = 2 x fixed + bytes / rate (n={fx['n']}, max |error| "
                                 f"{100 * fx['max_abs_rel_err']:.0f}%){why}: {src}")
    params["gda_link_eff"] = Fig(round(nv["gbps"] / NVLINK4_GBPS, 4), "fraction", "derived",
                                 f"fitted {nv_name} rate {nv['gbps']:.0f} GB/s (slope of its fit, n={nv['n']}, "
                                 f"{nv['date']}) / NVLink 4 spec {NVLINK4_GBPS:g} GB/s per direction: "
                                 + "; ".join(nv["sources"]))
    gda = fx
    nc_name = newest_group(fits, "nccl_a2a", ("nvlink",))
    nc = from_group(nc_name, "NCCL all-to-all over NVLink", "nccl_a2a@nvlink")
    src = "; ".join(nc["sources"])
    params["nccl_fixed_us"] = Fig(round(nc["fixed_us"], 2), "us", "measured",
                                  f"fit of {nc_name} (n={nc['n']}): {src}")
    params["nccl_link_eff"] = Fig(round(nc["gbps"] / NVLINK4_GBPS, 4), "fraction", "derived",
                                  f"fitted nccl_a2a@nvlink rate {nc['gbps']:.0f} GB/s / {NVLINK4_GBPS:g} GB/s")
    params["nccl_efa_eff"] = Fig(round(study["node_injection_gbps"].value / P5EN_EFA_NODE_GBPS, 4), "fraction",
                                 "derived", f"node injection {study['node_injection_gbps'].value:g} GB/s "
                                            f"({study['node_injection_gbps'].source}) / p5en spec {P5EN_EFA_NODE_GBPS:g} GB/s")
    rates = [o for o in obs if o["kind"] == "rate" and o["provider"] == provider and o["bytes"] == desc_bytes]
    if not rates:
        raise ValueError(f"no proxy descriptor-rate records for provider={provider} bytes={desc_bytes} "
                         f"(bench_proxy.py output, e.g. results/h200/bench_proxy.json)")
    alpha, post, npts = fit_alpha(rates)
    rsrc = "; ".join(sorted({r["source"] for r in rates}))
    params["proxy_channel_alpha"] = Fig(round(alpha, 4), "", "measured",
                                        f"fit of log(rate_K/rate_1) on log K, {provider} {desc_bytes} B writes, "
                                        f"{npts} points: {rsrc}")
    params["proxy_post_us"] = Fig(round(post, 4), "us", "measured",
                                  f"1 / rate at K=1, {provider} {desc_bytes} B writes (median over files; "
                                  f"{provider}, not efa: a lower bound for EFA): {rsrc}")
    px_name = newest_group(fits, "proxy", (provider,))
    if px_name is not None:
        params["proxy_fixed_us"] = _fitted_fixed(
            px_name, fits[px_name], f"{provider} wire, CUDA inputs staged through host memory: the "
                                    f"host work of the GPU path per op")
    else:
        rts = [o for o in obs if o["kind"] == "gpu_roundtrip" and o["provider"] == provider]
        rt = statistics.median(o["us"] for o in rts) if rts else 3.2
        rt_src = ("median GPU descriptor round trip " + "; ".join(sorted({o["source"] for o in rts}))) \
            if rts else "floor 3.2 us: a bare C thread's round trip on the H200 host (no round-trip records given)"
        params["proxy_fixed_us"] = Fig(round(gda["fixed_us"] + rt, 2), "us", "derived",
                                       f"gda_fixed_us {gda['fixed_us']:.1f} (same host work per op: launches, "
                                       f"one host sync) + descriptor round trip {rt:.2f} us ({rt_src})")
    params["proxy_channel_gbps"] = study["proxy_channel_gbps_efa"]
    hx_name = newest_group(fits, "hier:agg1", ("hbm", "nvlink"))
    if hx_name is not None:
        params["hier_fixed_us"] = _fitted_fixed(
            hx_name, fits[hx_name], f"nodes emulated on one host: both stages' host work per op, "
                                    f"the network stage on the host's {provider} wire")
    else:
        params["hier_fixed_us"] = hier_from_stages(params, "no hier records given")
    doc = {"schema": SCHEMA, "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "inputs": [_rel(p) for p in paths], "provider": provider, "desc_bytes": desc_bytes,
           "params": {k: v.to_dict() for k, v in params.items()}, "groups": fits,
           "validation": validate(obs, provider, desc_bytes)}
    return doc


def validate(obs: Sequence[Dict[str, Any]], provider: str = "shm", desc_bytes: int = 64) -> Dict[str, Any]:
    """Held-out predictions: per D+C group (:func:`dc_groups`) with >= 2 shapes, leave one shape out, fit on the
    rest, predict it (a group of one shape measured at >= 2 EP sizes: leave one EP size out,
    held_out ``EP <n>``); per descriptor-rate file, predict its rates on more than one channel from
    its own one-channel rate and the alpha fitted on the other files. Rows: group, held_out, measured_us, predicted_us,
    rel_err (predicted / measured - 1)."""
    rows = []
    groups = dc_groups(obs)
    not_held = []
    for g, os_ in sorted(groups.items()):
        shapes = sorted({o["shape"] for o in os_})
        eps = sorted({o["ep_size"] for o in os_})
        if len(shapes) >= 2:
            key, held = (lambda o: o["shape"]), shapes
        elif len(eps) >= 2:
            key, held = (lambda o: f"EP {o['ep_size']}"), [f"EP {e}" for e in eps]
        else:
            not_held.append(f"{g}: one shape and one EP size ({len(os_)} points) - fitted, not held out")
            continue
        for s in held:
            train = [o for o in os_ if key(o) != s]
            fixed, slope = fit_linear(train)
            for o in os_:
                if key(o) == s:
                    p = 2 * fixed + o["bytes"] * slope
                    rows.append({"kind": "dc", "group": g, "held_out": s, "tokens_per_rank": o["tokens_per_rank"],
                                 "measured": o["us"], "predicted": p, "unit": "us", "rel_err": p / o["us"] - 1,
                                 "source": o["source"]})
    rates = [o for o in obs if o["kind"] == "rate" and o["provider"] == provider and o["bytes"] == desc_bytes]
    files = sorted({r["file"] for r in rates})
    if len(files) >= 2:
        for f in files:
            try:
                alpha, _, _ = fit_alpha([r for r in rates if r["file"] != f])
            except ValueError:
                continue
            mine = {int(r["channels"]): r for r in rates if r["file"] == f}
            if 1 not in mine:
                continue
            for nc, r in sorted(mine.items()):
                if nc > 1:
                    p = mine[1]["per_s"] * nc ** alpha
                    rows.append({"kind": "rate", "group": f"proxy rate {provider} {desc_bytes} B", "held_out": f,
                                 "tokens_per_rank": None, "channels": nc, "measured": r["per_s"] / 1e6,
                                 "predicted": p / 1e6, "unit": "M desc/s", "rel_err": p / r["per_s"] - 1,
                                 "source": r["source"]})
    errs = [abs(r["rel_err"]) for r in rows]
    return {"rows": rows, "not_held_out": not_held,
            "median_abs_rel_err": statistics.median(errs) if errs else None,
            "max_abs_rel_err": max(errs) if errs else None}


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------
def write(doc: Dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")


def read(path: str) -> Dict[str, Fig]:
    """The parameters of calibration file ``path`` as Figs (plus ``_name`` = the path).

    Raises:
        FileNotFoundError, ValueError: missing file, other schema, or a missing parameter.
    """
    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r} is not {SCHEMA!r}")
    params = {k: Fig.from_dict(v) for k, v in doc["params"].items()}
    if "hier_fixed_us" not in params and {"proxy_fixed_us", "gda_fixed_us"} <= set(params):
        # a file from before hier's own parameter: its stages' sum, as such files priced it
        params["hier_fixed_us"] = hier_from_stages(
            params, f"{path} has no hier_fixed_us; rebuild it with `efa-ep-plan calibrate` and "
                    f"hier's records for a measured one")
    missing = sorted(set(PARAMS) - set(params))
    if missing:
        raise ValueError(f"{path}: calibration lacks {missing}; rebuild it with `efa-ep-plan calibrate`")
    from ..provenance import repo_root

    ap, root = os.path.abspath(path), repo_root()
    name = os.path.relpath(ap, root) if ap.startswith(root + os.sep) else ap
    params["_name"] = Fig(name, "", "measured", f"calibration file {name} ({doc.get('created_utc')})")
    return params


def default_record_files(root: str) -> List[str]:
    """The record files in ``results/`` the shipped calibration is built from."""
    cands = ["results/h200/bench_ep4/bench_summary.json", "results/h200/bench_proxy.json",
             "results/h200/bench_proxy_run1_cpu_gather.json", "results/plan/measured_h200x2.jsonl",
             "results/gda_perop/gda_gpu_check_carve_2026-12-03.json",
             "results/gda_perop/gda_gpu_check_layout_lis1_1_2026-12-03.json",
             "results/gda_perop/gda_gpu_check_layout_lis1_2_2026-12-03.json",
             "results/gda_perop/gda_gpu_check_np_default_2026-12-04.json",
             "results/gda_perop/gda_gpu_check_np528_2026-12-04.json",
             "results/gda_perop/gda_gpu_check_2026-12-05T0430.json",
             "results/gda_perop/gda_gpu_check_2026-12-05T1333.json",
             "results/gda_perop/gda_gpu_check_2026-12-05T1755.json",
             "results/h200/bench_proxy_cuda_sizes_one_call_2026-12-03.json",
             "results/h200/bench_proxy_cuda_sizes_early_reads_2026-12-03.json",
             "results/h200/bench_proxy_cuda_sizes_cpp_2026-12-04.json",
             "results/h200/bench_proxy_cuda_sizes_2026-12-05T0425.json",
             "results/h200/bench_proxy_reader_grid_after_2026-12-05T1722.json",
             "results/h200/bench_proxy_reader_grid_after2_2026-12-05T1722.json",
             "results/h200/bench_hier_ep4_one_call/bench_summary.json",
             "results/h200/bench_hier_ep4_early_reads/bench_summary.json",
             "results/h200/bench_hier_ep4_2026-12-05T1330/bench_summary.json",
             "results/h200/bench_hier_ep4_2026-12-05T1335/bench_summary.json",
             "results/h200/bench_hier_ep4_2026-12-05T1720/bench_summary.json",
             "results/h200x2/bench_gpu_nccl_2026-12-04T1151/bench_summary.json",
             "results/h200x2/bench_gpu_nccl_2026-12-04T1158/bench_summary.json"]
    return [os.path.join(root, c) for c in cands if os.path.exists(os.path.join(root, c))]
