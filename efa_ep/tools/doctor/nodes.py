"""The doctor's multi-node mode: started by torchrun or Slurm on every rank of a job.

Detected from the environment (:func:`launch_env`): torchrun's ``WORLD_SIZE`` > 1 with ``RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; or Slurm's
``SLURM_PROCID`` / ``SLURM_NTASKS`` (> 1) with ``MASTER_ADDR`` given (``MASTER_PORT`` default
29500). Without them the doctor runs on one node as before.

Every rank, in order, each step ending in a collective so that no rank waits alone:

1. a gloo process group from the environment (``init_method=env://``) with a deadline
   (:func:`pg_timeout_s`: it bounds the rendezvous and every later collective);
2. the config is composed on every rank and any rank's bad setting ends every rank with 2;
3. ``LOCAL_RANK`` 0 of each node gathers its host and runs the per-node checks; every node's
   lines reach every rank (``all_gather_object``); rank 0 prints them grouped by node (node
   rank and host name, so two "nodes" on one host stay apart) and one ``nodes agree`` line:
   ``fail`` where versions (python, torch, triton, megatron-core, libfabric, the native ABI) or
   the proxy's provider differ across nodes, ``warn`` where GPU / EFA-device counts do;
4. a cross-node self-test over the whole group with :func:`.selftest.selftest_worker` (the same
   check bit for bit against ``torch`` and the same timing as the loopback one): ``torch``, then
   ``proxy`` over ``efa`` where every node has it usable, else ``tcp`` (``+selftest.provider=...``
   overrides it on a rank), then ``hier`` with ``node_size`` = ranks per node (network stage:
   the proxy); each an ``ok``/``fail`` line with its fixed cost per op ``[M]``;
5. rank 0 prints the verdict (for the config's layout, with rank 0's node as "this host") and the
   last line; the other ranks print nothing. Every rank exits with rank 0's code.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .checks import Check

DEFAULT_PORT = "29500"


def launch_env(environ=None) -> Optional[Dict[str, Any]]:
    """The job this process is one rank of, or None (run on one node, as before): ``launcher``
    (torchrun | slurm), ``rank``, ``world``, ``local_rank``, ``node_rank``, ``master_addr``,
    ``master_port``."""
    env = os.environ if environ is None else environ

    def num(key: str) -> Optional[int]:
        try:
            return int(env[key])
        except (KeyError, ValueError):
            return None

    tr = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if (num("WORLD_SIZE") or 0) > 1 and all(env.get(k) for k in tr):
        local_world = max(1, num("LOCAL_WORLD_SIZE") or 1)
        node = num("GROUP_RANK")
        if node is None:
            node = num("NODE_RANK")
        rank = num("RANK") or 0
        return {"launcher": "torchrun", "rank": rank, "world": num("WORLD_SIZE"),
                "local_rank": num("LOCAL_RANK") or 0,
                "node_rank": node if node is not None else rank // local_world,
                "master_addr": env["MASTER_ADDR"], "master_port": env["MASTER_PORT"]}
    if (num("SLURM_NTASKS") or 0) > 1 and num("SLURM_PROCID") is not None and env.get("MASTER_ADDR"):
        return {"launcher": "slurm", "rank": num("SLURM_PROCID"), "world": num("SLURM_NTASKS"),
                "local_rank": num("SLURM_LOCALID") or 0,
                "node_rank": num("SLURM_NODEID") if num("SLURM_NODEID") is not None else num("SLURM_PROCID"),
                "master_addr": env["MASTER_ADDR"], "master_port": env.get("MASTER_PORT") or DEFAULT_PORT}
    return None


def pg_timeout_s(cfg: Optional[Dict[str, Any]]) -> float:
    """The process group's deadline: the rendezvous and each collective (the slowest node's
    checks, which may build the native library; one arm of the self-test). 2 x
    ``selftest.timeout_s`` + 30 s (120 s when the config did not compose)."""
    try:
        return 2 * float(cfg["selftest"]["timeout_s"]) + 30
    except (TypeError, KeyError, ValueError):
        return 120.0


def init_group(le: Dict[str, Any], timeout_s: float) -> None:
    """gloo from the environment (``env://``); Slurm's variables are exported as torchrun's."""
    import torch.distributed as dist

    os.environ.update(RANK=str(le["rank"]), WORLD_SIZE=str(le["world"]), MASTER_ADDR=le["master_addr"],
                      MASTER_PORT=str(le["master_port"]), LOCAL_RANK=str(le["local_rank"]))
    dist.init_process_group("gloo", init_method="env://", rank=le["rank"], world_size=le["world"],
                            timeout=datetime.timedelta(seconds=timeout_s))


def gather(obj: Any) -> List[Any]:
    import torch.distributed as dist

    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------------------------
# Nodes: identities, per-node checks, agreement
# ----------------------------------------------------------------------------------------------
def node_table(ids: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``[{"key": (node_rank, host), "node_rank", "host", "ranks": [...]}]`` in node order."""
    nodes: Dict[Tuple[int, str], List[int]] = {}
    for i in ids:
        nodes.setdefault((int(i["node_rank"]), i["host"]), []).append(int(i["rank"]))
    return [{"key": k, "node_rank": k[0], "host": k[1], "ranks": sorted(r)} for k, r in sorted(nodes.items())]


def node_size(nodes: Sequence[Dict[str, Any]]) -> Tuple[Optional[int], Optional[str]]:
    """``(ranks per node, None)`` when every node holds the same number of consecutive ranks
    (what ``hier``'s ``node_size`` means), else ``(None, why not)``."""
    sizes = {len(n["ranks"]) for n in nodes}
    if len(sizes) != 1:
        return None, f"nodes hold different numbers of ranks ({', '.join(str(len(n['ranks'])) for n in nodes)})"
    size = sizes.pop()
    for n in nodes:
        r = n["ranks"]
        if r != list(range(r[0], r[0] + size)) or r[0] % size:
            return None, f"node {n['node_rank']} ({n['host']}) holds ranks {r}, not a consecutive block"
    return size, None


FACTS = [
    # (what, how to read it from a Host, status when it differs, the fix)
    ("python", lambda h: h.python, "fail", "run the same Python on every node (one image)"),
    ("torch", lambda h: h.versions.get("torch"), "fail", "install the same torch on every node (one image)"),
    ("triton", lambda h: h.versions.get("triton"), "fail", "install the same triton on every node"),
    ("megatron-core", lambda h: h.versions.get("megatron-core"), "fail",
     "install the same megatron-core on every node (megatron-core==0.19.2)"),
    ("libfabric", lambda h: h.libfabric.get("version"), "fail",
     "use the same libfabric on every node (the AWS EFA installer's, /opt/amazon/efa)"),
    ("native ABI", lambda h: h.native.get("abi"), "fail",
     "rebuild the native library from one efa-ep checkout on every node"),
    ("provider efa", lambda h: "usable" if h.providers.get("efa") is None else "unusable", "fail",
     "every node needs the efa provider (EFA installer, EFA-enabled instances), or none uses it"),
    ("proxy", lambda h: "runs" if h.transports.get("proxy") is None else "cannot run", "fail",
     "fix the libfabric / native library lines of the nodes where it cannot run"),
    ("gpus", lambda h: h.gpus, "warn", "use one instance type for every node (same GPU count)"),
    ("efa devices", lambda h: len(h.efa_devices), "warn", "use one instance type for every node"),
]


def agreement_check(hosts: Sequence[Tuple[Dict[str, Any], Any]]) -> Check:
    """``nodes agree``: ``hosts`` is ``[(node, Host)]``; every fact of :data:`FACTS` compared."""
    diffs, status, fixes = [], "ok", []
    data: Dict[str, Any] = {}
    for what, read, level, fix in FACTS:
        vals = {}
        for n, h in hosts:
            try:
                vals[f"node {n['node_rank']} ({n['host']})"] = read(h)
            except Exception as e:  # a malformed host: say so rather than stop
                vals[f"node {n['node_rank']} ({n['host']})"] = f"?{type(e).__name__}"
        data[what] = vals
        if len({repr(v) for v in vals.values()}) > 1:
            diffs.append(f"{what}: " + ", ".join(f"{v} on {k}" for k, v in vals.items()))
            fixes.append(fix)
            if level == "fail" or status == "ok":
                status = level
    if not diffs:
        return Check("nodes agree", "ok", f"{len(hosts)} node(s): same python, torch, triton, megatron-core, "
                     "libfabric, native ABI, providers, GPU and EFA-device counts", data=data)
    return Check("nodes agree", status, "; ".join(diffs), "; ".join(dict.fromkeys(fixes)), data)


def node_part(cfg: Dict[str, Any], lay, le: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """On LOCAL_RANK 0: this node's Host and checks (never raises); elsewhere None."""
    if le["local_rank"] != 0:
        return None
    from . import checks as checks_mod
    from . import probes

    try:
        h = checks_mod.gather_host()
        found = checks_mod.run_checks(h, lay)
        return {"host": h, "checks": found, "error": None}
    except Exception as e:
        return {"host": None, "checks": [Check("node checks", "fail", f"gathering this node failed: "
                                               f"{type(e).__name__}: {e}", "report this with the --json output")],
                "error": f"{type(e).__name__}: {e}"}
    finally:
        probes.cleanup()


# ----------------------------------------------------------------------------------------------
# The cross-node self-test
# ----------------------------------------------------------------------------------------------
def plan_cross_arms(hosts: Sequence[Any], size: Optional[int], why_no_hier: Optional[str],
                    provider_override: Optional[str] = None):
    """The arms over the whole group: ``torch``, ``proxy:<p>``, ``hier:<p>`` (p: ``efa`` when
    every node has it usable, else ``tcp``; ``provider_override`` replaces it on this rank)."""
    from .selftest import Arm

    p = "efa" if hosts and all(h is not None and h.providers.get("efa") is None for h in hosts) else "tcp"
    p = provider_override or p
    arms = [Arm("torch", "torch"), Arm(f"proxy:{p}", "proxy", (("provider", p),))]
    if size is None:
        arms.append(Arm(f"hier:{p}", "hier", skip=f"hier needs the same consecutive ranks per node: {why_no_hier}"))
    else:
        arms.append(Arm(f"hier:{p}", "hier", (("node_size", size), ("provider", p))))
    return arms


def cross_shape(st: Dict[str, Any], world: int) -> Dict[str, Any]:
    """The self-test shape for ``world`` ranks: ``num_experts`` rounded up to a multiple of it."""
    shape = {k: st[k] for k in ("tokens", "hidden", "num_experts", "topk", "dtype")}
    e = int(shape["num_experts"])
    shape["num_experts"] = max(world, -(-e // world) * world)
    return shape


def run_cross_selftest(st_cfg: Dict[str, Any], local_st: Dict[str, Any], hosts: Sequence[Any],
                       nodes: Sequence[Dict[str, Any]], le: Dict[str, Any]) -> Dict[str, Any]:
    """Every rank: the cross-node arms through :func:`.selftest.selftest_worker` (``st_cfg``:
    rank 0's selftest keys, the same on every rank; ``local_st``: this rank's, for its
    provider override). Returns the self-test document with ``checks`` (meaningful on rank 0)."""
    import torch.distributed as dist

    from .selftest import arm_check, selftest_worker

    world, rank = dist.get_world_size(), dist.get_rank()
    size, why = node_size(nodes)
    arms = plan_cross_arms(hosts, size, why, local_st.get("provider"))
    runnable = [a for a in arms if a.skip is None]
    shape = cross_shape(st_cfg, world)
    t0 = time.perf_counter()
    error = None
    try:
        mine = selftest_worker(rank, world, runnable, shape, int(st_cfg["iters"]), int(st_cfg["warmup"]),
                               max(0.5, float(st_cfg["arm_budget_s"])))
    except Exception as e:  # outside the per-arm agreements: peers learn it below or by the deadline
        mine, error = [], f"rank {rank}: {type(e).__name__}: {e}"
    everyone = gather({"results": mine, "error": error})
    node_of = {r: n for n in nodes for r in n["ranks"]}
    results: Dict[str, Dict[str, Any]] = {}
    for i, res in enumerate(everyone[0]["results"]):
        res = dict(res)
        if res["status"] != "ok" and "on a peer rank" in res["detail"]:
            for r, other in enumerate(everyone):
                o = other["results"][i] if i < len(other["results"]) else None
                if o and "on a peer rank" not in o["detail"]:
                    n = node_of.get(r, {})
                    res["detail"] = f"rank {r} (node {n.get('node_rank')} {n.get('host')}): {o['detail']}"
                    break
        results[res["label"]] = res
    error = error or next((e["error"] for e in everyone if e["error"]), None)
    where = (f"{world} ranks on {len(nodes)} node(s)" + (f", {size} per node" if size else ""))
    checks = [arm_check(a, results.get(a.label), error, shape, world, prefix="cross-node", where=where)
              for a in arms]
    return {"arms": [dict(dataclasses.asdict(a), options=dict(a.options)) for a in arms],
            "results": list(results.values()), "checks": checks, "wall_s": round(time.perf_counter() - t0, 2),
            "error": error, "shape": shape, "ranks": world, "nodes": len(nodes), "node_size": size}


# ----------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------
def main_nodes(le: Dict[str, Any], config_name: str, overrides: Sequence[str], as_json: bool) -> int:
    """Every rank of the job: see the module docstring. Returns the exit code, the same on every
    rank (0 no failed check, 1 a failed check, 2 bad settings on some rank)."""
    import sys

    import torch.distributed as dist

    from efa_ep.kernels.options import ConfigError

    from ..config import compose
    from .cli import check_config, layout_of
    from .verdict import make_inputs

    t0 = time.perf_counter()
    cfg, lay, inputs, err = None, None, None, None
    try:
        cfg = compose("doctor", config_name, overrides)
        check_config(cfg)
        lay = layout_of(cfg)
        inputs = make_inputs(cfg, lay)
    except (ConfigError, ValueError, KeyError, FileNotFoundError) as e:
        err = f"{e}" + (f"\n  hint: {e.hint}" if getattr(e, "hint", None) else "")
    host = socket.gethostname()
    init_group(le, pg_timeout_s(cfg))
    try:
        me = {"rank": le["rank"], "local_rank": le["local_rank"], "node_rank": le["node_rank"], "host": host,
              "error": err}
        ids = gather(me)
        bad = [i for i in ids if i["error"]]
        if bad:
            if le["rank"] == 0:
                for i in bad:
                    print(f"efa-ep-doctor: error: rank {i['rank']} (node {i['node_rank']} {i['host']}): {i['error']}",
                          file=sys.stderr)
            return 2
        nodes = node_table(ids)
        parts = gather(node_part(cfg, lay, le))
        by_node = []
        for n in nodes:
            first = next((parts[r] for r in n["ranks"] if parts[r] is not None), None)
            by_node.append((n, first))
        hosts = [(n, p["host"]) for n, p in by_node if p and p["host"] is not None]
        agree = agreement_check(hosts)
        st = None
        if cfg["selftest"].get("enabled", True):
            obj = [dict(cfg["selftest"])]
            dist.broadcast_object_list(obj, src=0)
            st = run_cross_selftest(obj[0], cfg["selftest"], [h for _, h in hosts], nodes, le)
        code = [0]
        if le["rank"] == 0:
            code[0] = report(cfg, lay, inputs, le, nodes, by_node, agree, st, t0, as_json)
            sys.stdout.flush()
        dist.broadcast_object_list(code, src=0)
        return int(code[0])
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def report(cfg, lay, inputs, le, nodes, by_node, agree, st, t0, as_json: bool) -> int:
    """Rank 0: prints the report (or the JSON document); returns the exit code."""
    import json

    from . import checks as checks_mod
    from .cli import SCHEMA, final_line
    from .verdict import verdict

    out = (lambda *a, **k: None) if as_json else print
    h0 = next((p["host"] for _, p in by_node if p and p["host"] is not None), None)
    world = sum(len(n["ranks"]) for n in nodes)
    out(f"efa-ep-doctor: {world} ranks on {len(nodes)} node(s) ({le['launcher']}) for {cfg['model']} on "
        f"{lay.nodes} x {cfg['fabric']}, {lay.gpus_per_node} GPUs/node, EP {lay.ep}")
    node_checks: List[Check] = []
    node_docs = []
    for n, p in by_node:
        h = p["host"] if p else None
        what = f"{h.cpus} CPUs, {h.gpus} GPU(s)" if h is not None else "no host facts"
        out(f"node {n['node_rank']} {n['host']} (ranks {_ranks(n['ranks'])}; {what})")
        found = p["checks"] if p else [Check("node checks", "fail", "no rank of this node reported its checks")]
        for c in found:
            out(f"  {c.line()}")
        node_checks += [dataclasses.replace(c, data={**c.data, "node": n["node_rank"], "host": n["host"]})
                        for c in found]
        node_docs.append({"node_rank": n["node_rank"], "name": n["host"], "ranks": n["ranks"],
                          "host": h.to_dict() if h is not None else None, "checks": [c.to_dict() for c in found]})
    out(agree.line())
    cross = st["checks"] if st else [Check("cross-node", "skip", "selftest.enabled=false: no transport was run")]
    for c in cross:
        out(c.line())
    all_checks = node_checks + [agree] + cross
    broken = [c for c in cross if c.status == "fail" and c.name.split(" ", 1)[-1].split(":")[0] in ("proxy", "hier")]
    if h0 is not None and broken and lay.spans_nodes:
        # What auto runs across nodes did not work across these nodes: the verdict says so.
        why = f"the cross-node self-test failed ({', '.join(c.name for c in broken)})"
        h0 = dataclasses.replace(h0, transports={**h0.transports, "proxy": why})
    if h0 is not None:
        v = verdict(h0, lay, cfg, all_checks, st, inputs=inputs)
    else:
        v = {"lines": ["advice: stay on alltoall - no node reported its host"], "advice": "stay on alltoall"}
    for ln in v["lines"]:
        out(f"verdict  {ln}")
    counts = {s: sum(1 for c in all_checks if c.status == s) for s in checks_mod.STATUSES}
    doc = {
        "schema": SCHEMA, "mode": "nodes",
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "launcher": le["launcher"], "world_size": world, "nodes": node_docs,
        "layout": {"nodes": lay.nodes, "gpus_per_node": lay.gpus_per_node, "ep": lay.ep,
                   "ranks_per_host": lay.ranks_per_host},
        "config": cfg, "checks": [c.to_dict() for c in all_checks],
        "selftest": None if st is None else {k: val for k, val in st.items() if k != "checks"},
        "verdict": {k: val for k, val in v.items() if k != "lines"},
        "summary": {**counts, "advice": v["advice"], "wall_s": round(time.perf_counter() - t0, 1)},
    }
    out(final_line(doc))
    if as_json:
        print(json.dumps(doc, indent=1, default=str))
    return 1 if counts["fail"] else 0


def _ranks(r: Sequence[int]) -> str:
    return f"{r[0]}-{r[-1]}" if len(r) > 1 and list(r) == list(range(r[0], r[-1] + 1)) else ",".join(map(str, r))


__all__ = ["launch_env", "main_nodes", "agreement_check", "node_table", "node_size", "plan_cross_arms",
           "cross_shape", "run_cross_selftest"]
