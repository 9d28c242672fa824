"""Network operations per op: the planner's model against what ``efa-ep-bench`` counted.

``efa-ep-bench`` records, for every arm whose transport counts (``proxy``, ``hier``), the
network messages, rows and bytes of one dispatch and one combine summed over the ranks
(``net_counts``; the transports' ``last_op_counts``, :class:`~efa_ep.kernels.base.NetOpCounts`).
This module reads them from bench summaries or raw records and puts each next to
:func:`~efa_ep.tools.plan.model.hier_net` at the same layout, so the traffic the planner
predicts for EP16/EP32 (``hier:agg1``, ``hier:agg0``, flat ``proxy``) is the traffic the
transports count at the layouts that can run here (EP 4 and 8 as emulated nodes).

Design of each arm: ``hier:agg1`` -> ``hier_net(aggregate=1)``, ``hier:agg0`` ->
``hier_net(aggregate=0)``, ``proxy:*`` -> ``hier_net(aggregate=0, node_size=1)`` (the flat
proxy sends every peer's rows through libfabric, same-node peers included).

Only the ``uniform`` route matches the model's assumption (every top-k subset equally likely);
rows of other routes are listed with ``comparable: False``. Units: per rank and op, messages
(peers with >= 1 row), rows, bytes (rows x H x element size).

    efa-ep-plan counts results/plan/hier_counts_cpu.json [more summaries or records ...]
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

from .model import DTYPE_BYTES, hier_net

ROUTE_MODEL = "uniform"
FIELDS = ("messages", "rows", "bytes")


def design_of(arm: str) -> Optional[Dict[str, int]]:
    """``{"aggregate": a, "flat": 0|1}`` of a bench arm name, None for arms without a model."""
    if arm.startswith("hier:agg"):
        return {"aggregate": int(arm[len("hier:agg"):]), "flat": 0}
    if arm == "proxy" or arm.startswith("proxy:"):
        return {"aggregate": 0, "flat": 1}
    return None


def _label(path: str) -> str:
    """``<folder>/<file>`` (bench files share their names; the folder tells the run)."""
    return "/".join(os.path.abspath(path).split(os.sep)[-2:])


def _dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[{"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)]


def _cells(path: str) -> List[Dict[str, Any]]:
    """Summary-like cells (arm, route, shape fields, net_counts) of one bench file."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    if isinstance(doc, dict) and str(doc.get("schema", "")).endswith("-summary"):
        return list(doc.get("cells", []))
    if isinstance(doc, dict) and "counts" in doc and isinstance(doc["counts"], list):
        return list(doc["counts"])  # a shipped collection (see write_collection)
    if isinstance(doc, dict):
        doc = [doc]
    if isinstance(doc, list) and all(isinstance(r, dict) and str(r.get("schema", "")).startswith("efa_ep.bench/")
                                     for r in doc):
        seen, out = set(), []
        for r in doc:
            key = (r.get("arm"), r.get("profile"), r.get("shape"), r.get("route"), r.get("ep_size"))
            if r.get("view") == "transport" and not r.get("void") and key not in seen:
                seen.add(key)
                out.append(r)
        return out
    raise ValueError(f"{path}: not an efa-ep-bench summary, record file or counts collection")


def load(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """One observation per (file, cell, op) with counts: ``arm``, ``route``, ``ep``,
    ``node_size``, ``tokens_per_rank``, ``num_experts``, ``topk``, ``row_bytes``, ``op``,
    ``measured`` (per rank: the all-ranks sum / ep), ``source``.

    Raises:
        FileNotFoundError: a path does not exist. ValueError: a file holds no counts.
    """
    out: List[Dict[str, Any]] = []
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"bench file {path} does not exist")
        got = 0
        for c in _cells(path):
            nc = c.get("net_counts") or {}
            if design_of(str(c.get("arm"))) is None:
                continue
            for op in ("dispatch", "combine"):
                m = nc.get(op)
                if not m:
                    continue
                ep = int(c["ep_size"])
                out.append({"arm": c["arm"], "route": c["route"], "ep": ep,
                            "node_size": int(nc["node_size"]), "tokens_per_rank": int(c["tokens_per_rank"]),
                            "num_experts": int(c["num_experts"]), "topk": int(c["topk"]),
                            "row_bytes": int(c["hidden"]) * _dtype_bytes(c["dtype"]), "op": op,
                            "profile": c.get("profile"), "shape": c.get("shape"),
                            "measured": {f: m[f] / ep for f in FIELDS},
                            "source": c.get("source") or _label(path)})
                got += 1
        if not got:
            raise ValueError(f"{path}: no net_counts of proxy or hier arms in it (run efa-ep-bench "
                             f"with arms.transports=[torch,proxy,hier] node_size=G)")
    return out


def predict(obs: Dict[str, Any]) -> Dict[str, float]:
    """:func:`hier_net` of ``obs``'s arm at its layout: per rank and op messages, rows, bytes."""
    d = design_of(obs["arm"])
    g = 1 if d["flat"] else obs["node_size"]
    h = hier_net(obs["ep"], g, obs["tokens_per_rank"], obs["num_experts"], obs["topk"],
                 obs["row_bytes"], d["aggregate"])
    return {f: h[f] for f in FIELDS}


def compare(obs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each observation with ``predicted``, ``rel_err`` per field ((predicted - measured) /
    measured; None where measured is 0) and ``comparable`` (the route is uniform)."""
    rows = []
    for o in obs:
        p = predict(o)
        err = {f: (None if not o["measured"][f] else (p[f] - o["measured"][f]) / o["measured"][f])
               for f in FIELDS}
        rows.append({**o, "predicted": p, "rel_err": err, "comparable": o["route"] == ROUTE_MODEL})
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    """Markdown: measured vs predicted messages and rows per rank and op."""
    lines = ["| source | arm | EP (nodes x G) | tok/rank | E, k | route | op | messages meas / pred | "
             "rows meas / pred | rows err |", "|" + "---|" * 10]
    for r in rows:
        m, p, e = r["measured"], r["predicted"], r["rel_err"]["rows"]
        err = "-" if e is None else f"{100 * e:+.0f}%" + ("" if r["comparable"] else " (route not uniform)")
        lines.append(f"| {r['source']} | {r['arm']} | {r['ep']} ({r['ep'] // r['node_size']} x {r['node_size']}) | "
                     f"{r['tokens_per_rank']} | {r['num_experts']}, {r['topk']} | {r['route']} | {r['op']} | "
                     f"{m['messages']:.2f} / {p['messages']:.2f} | {m['rows']:.1f} / {p['rows']:.1f} | {err} |")
    comp = [abs(r["rel_err"]["rows"]) for r in rows if r["comparable"] and r["rel_err"]["rows"] is not None]
    if comp:
        comp.sort()
        lines.append(f"\nuniform route: rows |error| median {100 * comp[len(comp) // 2]:.1f}%, max "
                     f"{100 * comp[-1]:.1f}% over {len(comp)} (arm, layout, op) cells")
    return "\n".join(lines)


def write_collection(paths: Sequence[str], out: str, note: str = "") -> Dict[str, Any]:
    """Collects the counting cells of bench summaries ``paths`` into one file ``out`` (what
    ``results/plan/hier_counts_cpu.json`` is), keeping their provenance."""
    cells, sources = [], []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        prov = doc.get("provenance") or {}
        sources.append({"file": _label(path), "run_id": doc.get("run_id"),
                        "date_utc": prov.get("date_utc"), "git": prov.get("git"),
                        "overrides": {k: doc.get("config", {}).get(k) for k in ("ep_size", "node_size", "routes")}})
        for c in doc.get("cells", []):
            if (c.get("net_counts") or {}).get("dispatch") and design_of(str(c.get("arm"))) is not None:
                keep = ("arm", "profile", "shape", "route", "dtype", "ep_size", "tokens_per_rank",
                        "hidden", "num_experts", "topk", "net_counts")
                cell = {**{k: c[k] for k in keep}, "source": _label(path)}
                cell["net_counts"] = {k: v for k, v in c["net_counts"].items() if k != "note"}
                cells.append(cell)
    doc = {"schema": "efa_ep.plan.counts/1", "note": note, "sources": sources,
           "units": "net_counts: all ranks, one op; messages, rows, writes: counts; bytes, "
                    "wire_bytes: bytes (kernels/base.py NetOpCounts)", "counts": cells}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return doc
