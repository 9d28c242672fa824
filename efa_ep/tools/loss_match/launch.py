"""Parent side: launches the ranks (one launch per EP size, retried one arm per launch on
failure) and reads back what each arm wrote."""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional

from .arms import Arm, safe_name
from .train import rank_main


def run_arms(cfg: Dict[str, Any], arms: List[Arm], out_dir: str, fault=None,
             log=print) -> Dict[str, Dict[str, Any]]:
    """Trains every arm (one launch per EP size, retried per arm on failure); returns
    ``{arm name: result dict}`` with ``error`` set for arms that failed."""
    from efa_ep.distributed import run_ranks

    os.makedirs(os.path.join(out_dir, "arms"), exist_ok=True)
    for a in arms:
        stale = os.path.join(out_dir, "arms", safe_name(a.name) + ".json")
        if os.path.exists(stale):
            os.remove(stale)
    env = {"FI_TCP_IFACE": os.environ.get("FI_TCP_IFACE", "lo"),
           "OMP_NUM_THREADS": str(cfg["num_threads"]), "PYTHONWARNINGS": "ignore"}
    by_ep: Dict[int, List[Arm]] = {}
    for a in arms:
        by_ep.setdefault(a.ep_size, []).append(a)

    def load(a: Arm):
        path = os.path.join(out_dir, "arms", safe_name(a.name) + ".json")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        return None

    def launch(group: List[Arm]) -> Optional[str]:
        log(f"[loss-match] launching EP={group[0].ep_size} ranks for arms "
            f"{[a.name for a in group]}", file=sys.stderr)
        res = run_ranks(rank_main, group[0].ep_size, (cfg, group, out_dir, fault),
                        backend=cfg["backend"], timeout_s=float(cfg["timeout_s"]),
                        pg_timeout_s=float(cfg["pg_timeout_s"]), env=env, raise_on_error=False)
        bad = [f"rank {r}: {val}" for r, (ok, val) in enumerate(res) if not ok]
        return "\n".join(bad) if bad else None

    results: Dict[str, Dict[str, Any]] = {}
    for ep, group in by_ep.items():
        groups = [[a] for a in group] if cfg.get("isolate_arms") else [group]
        for g in groups:
            err = launch(g)
            missing = [a for a in g if load(a) is None]
            if err and len(g) > 1 and missing:
                log(f"[loss-match] EP={ep} launch failed; retrying {[a.name for a in missing]} "
                    f"one per launch", file=sys.stderr)
                for a in missing:
                    e = launch([a])
                    if load(a) is None:
                        results[a.name] = {"name": a.name, "error": e or "no result written"}
            elif missing:
                for a in missing:
                    results[a.name] = {"name": a.name, "error": err or "no result written"}
    for a in arms:
        r = load(a)
        if r is not None:
            results[a.name] = r
        elif a.name not in results:
            results[a.name] = {"name": a.name, "error": "no result"}
    return results


def load_routing(out_dir: str, name: str):
    """``[steps, layers, B_global, S, K]`` uint8 expert ids of arm ``name``, or None."""
    import numpy as np

    path = os.path.join(out_dir, "arms", safe_name(name) + ".routing.npy")
    return np.load(path) if os.path.exists(path) else None
