"""Benchmark harness (issue 7): statistics, record schema, routes, and a --quick CPU run."""
import json
import math
import os

import pytest

from efa_ep.tools import bench, bench_stats
from efa_ep.tools.config import compose


# --- statistics -------------------------------------------------------------------------------
def test_slowest_rank_is_max_across_ranks_per_iteration():
    per_rank = [[1.0, 5.0, 2.0], [3.0, 1.0, 2.5], [2.0, 2.0, 9.0]]
    assert bench_stats.slowest_rank(per_rank) == [3.0, 5.0, 9.0]
    # Not the max of per-rank medians, not rank 0's times.
    assert bench_stats.slowest_rank(per_rank) != per_rank[0]
    with pytest.raises(ValueError):
        bench_stats.slowest_rank([[1.0], [1.0, 2.0]])


def test_collapse_probability_matches_the_seed_review():
    # n=3: the bootstrap median equals the min with probability 7/27 (seed 004, finding 2).
    assert math.isclose(bench_stats.median_collapse_probability(3), 7 / 27)
    assert bench_stats.median_collapse_probability(5) > 0.025
    assert bench_stats.median_collapse_probability(20) < 1e-6


@pytest.mark.parametrize("n", [1, 3, 5, 9])
def test_small_n_reports_min_median_max_not_an_interval(n):
    vals = [float(v) for v in range(100, 100 + n)]
    s = bench_stats.summarize(vals)
    assert s["interval"] == "min-median-max" and s["ci_low"] is None
    assert s["min"] == 100 and s["max"] == 99 + n and s["n"] == n
    assert f"n={n}" in s["interval_note"]
    assert "min" in bench_stats.format_stats(s) and "[" not in bench_stats.format_stats(s)


def test_bootstrap_interval_does_not_collapse_for_n20():
    vals = [100.0 + ((7 * i) % 20) for i in range(20)]  # 100..119, shuffled
    s = bench_stats.summarize(vals)
    assert s["interval"] == "bootstrap"
    assert s["min"] < s["ci_low"] <= s["median"] <= s["ci_high"] < s["max"]
    assert bench_stats.summarize(vals) == s  # seeded: reruns agree


def test_rotation_puts_every_cell_first_once():
    cells = list("abcd")
    firsts = [bench.rotate(cells, s)[0] for s in range(4)]
    assert sorted(firsts) == cells and bench.rotate(cells, 5) == list("bcda")


# --- routes -----------------------------------------------------------------------------------
def test_balanced_route_is_balanced_and_skewed_is_not():
    import torch

    world, t, e, k = 2, 128, 256, 8
    bal = [bench.make_route("balanced", t, e, k, r, world, 1)[0] for r in range(world)]
    counts = torch.bincount(torch.cat(bal).flatten(), minlength=e)
    assert counts.min() == counts.max() == world * t * k // e
    for idx in bal:
        assert all(len(set(row)) == k for row in idx.tolist())  # distinct experts per token
    skew = [bench.make_route("skewed", t, e, k, r, world, 1, skew=1.2)[0] for r in range(world)]
    st = bench.route_stats(skew, e, world)
    assert st["expert_max_over_mean"] > 5
    for idx in skew:
        assert all(len(set(row)) == k for row in idx.tolist())
    assert bench.route_stats(bal, e, world)["expert_max_over_mean"] == 1.0
    _, w = bench.make_route("skewed", t, e, k, 0, world, 1)
    assert w.dtype == torch.float32 and torch.allclose(w.sum(1), torch.ones(t))


# --- configs and arms -------------------------------------------------------------------------
def test_configs_and_arms():
    default = compose("bench", "default")
    assert default["starts"] >= 20 and default["dtype"] == "bf16" and default["scaled"]
    gpu = compose("bench", "gpu")
    assert gpu["shapes"]["deepseek_v3"] == {"hidden": 7168, "num_experts": 256, "topk": 8}
    assert gpu["shapes"]["qwen3_30b_a3b"] == {"hidden": 2048, "num_experts": 128, "topk": 8}
    assert gpu["profiles"]["decode"]["tokens_per_rank"] == 128
    assert gpu["profiles"]["prefill"]["tokens_per_rank"] == 4096 and not gpu["scaled"]
    arms, not_run = bench.resolve_arms(default, ["torch", "gda", "proxy"])
    names = [a.name for a in arms]
    assert names[:6] == ["torch", "gda", "proxy:k1", "proxy:k2", "proxy:k4", "proxy:k8"]
    assert {"alltoall", "efa:torch", "efa:gda", "efa:proxy"} <= set(names)
    assert [a.num_channels for a in arms if a.transport == "proxy" and a.view == "transport"] == [1, 2, 4, 8]
    assert set(not_run) >= {"deep_ep", "uccl_ep", "nccl_ep"} or all(
        "adapter" in v or "not installed" in v for v in not_run.values())
    cells = bench.build_cells(default, arms)
    assert len({c.key for c in cells}) == len(cells)


# --- the quick run ----------------------------------------------------------------------------
def test_quick_run_schema_and_outputs(tmp_path, capsys):
    out = tmp_path / "bq"
    rc = bench.main(["--quick", f"out_dir={out}", "progress=false"])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    records = [json.loads(l) for l in (out / "bench_records.jsonl").read_text().splitlines()]
    cfg = compose("bench", "quick")
    summary = json.loads((out / "bench_summary.json").read_text())
    n_cells = len(summary["cells"])
    assert len(records) == cfg["starts"] * n_cells
    for r in records:
        assert set(bench.RECORD_FIELDS) <= set(r), set(bench.RECORD_FIELDS) - set(r)
        assert r["schema"] == bench.SCHEMA and not r["void"]
        assert len(r["slowest_us"]) == cfg["iters"] and len(r["per_rank_median_us"]) == cfg["ep_size"]
        # slowest-rank: per-iteration max over ranks is >= every rank's median
        assert r["start_median_us"] >= min(r["per_rank_median_us"])
        assert r["check"]["status"] in ("reference", "pass")
        prov = r["provenance"]
        assert prov["git"]["commit"] is not None or prov["git"] == {"commit": None, "dirty": None}
        assert prov["versions"]["torch"] and "nccl" in prov["versions"] and "libfabric" in prov["versions"]
        assert "mps" in prov and prov["cpu"]["model"]
    # every start ran every cell, in a rotated order
    orders = {}
    for r in records:
        orders.setdefault(r["start"], {})[r["order_index"]] = (r["view"], r["arm"], r["profile"], r["route"])
    assert orders[0][0] != orders[1][0]
    assert {r["arm"] for r in records if r["view"] == "layer"} >= {"alltoall", "efa:torch"}
    for c in summary["cells"]:
        assert c["latency_us"]["n"] == cfg["starts"] and c["latency_us"]["interval"] == "min-median-max"
    assert (out / "bench_table.md").read_text().count("| decode |") >= 1
    assert any(p.endswith(".png") for p in os.listdir(out))
    assert "bench: records=" in text


def test_failed_check_voids_the_cell(monkeypatch):
    """_compare reports a differing tensor; a void record carries the reason and no timings."""
    import torch

    assert bench._compare("recv_x", torch.ones(2, 2), torch.ones(2, 2)) is None
    msg = bench._compare("combine_out", torch.ones(2, 2), torch.zeros(2, 2))
    assert "combine_out" in msg and "differs" in msg
    recs = [{"view": "transport", "profile": "decode", "shape": "s", "route": "balanced", "dtype": "bf16",
             "arm": a, "num_channels": None, "tokens_per_rank": 8, "hidden": 4, "num_experts": 4,
             "topk": 2, "ep_size": 2, "void": v, "void_reason": "combine_out: differs" if v else None,
             "start_median_us": None if v else 10.0, "route_stats": {}}
            for a, v in (("torch", False), ("proxy:k1", True))]
    rows = bench.summarize_records(recs, compose("bench", "quick"))
    bad = next(r for r in rows if r["arm"] == "proxy:k1")
    assert bad["n_void"] == 1 and bad["latency_us"]["n"] == 0 and "differs" in bad["void_reasons"][0]
