"""Benchmark harness: statistics, record schema, routes, the group's collective device, the raw
collective arm, the timing modes, and a --quick CPU run."""
import json
import math
import os

import pytest

from efa_ep.testing.routes import bench_route
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


def test_collapse_probability_by_hand():
    # n=3: the bootstrap median equals the min iff >= 2 of 3 draws hit it: 3 x 2/27 + 1/27 = 7/27.
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
    bal = [bench_route("balanced", t, e, k, r, world, 1)[0] for r in range(world)]
    counts = torch.bincount(torch.cat(bal).flatten(), minlength=e)
    assert counts.min() == counts.max() == world * t * k // e
    for idx in bal:
        assert all(len(set(row)) == k for row in idx.tolist())  # distinct experts per token
    skew = [bench_route("skewed", t, e, k, r, world, 1, skew=1.2)[0] for r in range(world)]
    st = bench.route_stats(skew, e, world)
    assert st["expert_max_over_mean"] > 5
    for idx in skew:
        assert all(len(set(row)) == k for row in idx.tolist())
    assert bench.route_stats(bal, e, world)["expert_max_over_mean"] == 1.0
    _, w = bench_route("skewed", t, e, k, 0, world, 1)
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
    """compare_to_reference reports a differing tensor; a void record carries the reason and no timings."""
    import torch

    assert bench.compare_to_reference("recv_x", torch.ones(2, 2), torch.ones(2, 2)) is None
    msg = bench.compare_to_reference("combine_out", torch.ones(2, 2), torch.zeros(2, 2))
    assert "combine_out" in msg and "differs" in msg
    recs = [{"view": "transport", "profile": "decode", "shape": "s", "route": "balanced", "dtype": "bf16",
             "arm": a, "num_channels": None, "tokens_per_rank": 8, "hidden": 4, "num_experts": 4,
             "topk": 2, "ep_size": 2, "void": v, "void_reason": "combine_out: differs" if v else None,
             "start_median_us": None if v else 10.0, "route_stats": {}}
            for a, v in (("torch", False), ("proxy:k1", True))]
    rows = bench.summarize_records(recs, compose("bench", "quick"))
    bad = next(r for r in rows if r["arm"] == "proxy:k1")
    assert bad["n_void"] == 1 and bad["latency_us"]["n"] == 0 and "differs" in bad["void_reasons"][0]


# --- the group's collective device -------------------------------------------------------------
@pytest.mark.parametrize("backend,cuda,expected", [
    ("gloo", False, "cpu"), ("gloo", True, "cpu"), ("nccl", True, "cuda:1"),
    ("cpu:gloo,cuda:nccl", True, "cuda:1"),
])
def test_collective_device_per_backend(monkeypatch, backend, cuda, expected):
    """An NCCL group's collectives take tensors on the current GPU, never the CPU (the bug this
    guards: a CPU flag handed to all_reduce on an NCCL group, "No backend type associated with
    device type cpu"); gloo's take CPU tensors even when the ranks compute on a GPU."""
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert str(bench.collective_device(None)) == expected


class _StrictGroup:
    """Stands in for ``torch.distributed`` on one rank of a group whose collectives accept only
    tensors on ``device`` (as an NCCL group accepts only CUDA tensors)."""

    def __init__(self, device):
        self.device = device
        self.calls = []
        self.ReduceOp = __import__("torch.distributed", fromlist=["ReduceOp"]).ReduceOp

    def _check(self, name, t):
        self.calls.append((name, str(t.device)))
        if str(t.device) != self.device:
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")

    def all_reduce(self, t, op=None, group=None):
        self._check("all_reduce", t)

    def broadcast(self, t, src=0, group=None):
        self._check("broadcast", t)


def test_control_collectives_use_the_groups_device(monkeypatch):
    """Every control collective of the benchmark asks :func:`bench.collective_device` and puts its
    tensor there. The strict group accepts only tensors on the device the helper names; the
    helper is pointed at ``meta`` (a device no CPU default would hit), so a hard-coded CPU tensor
    fails here just as it fails on an NCCL group."""
    import torch
    import torch.distributed as dist

    strict = _StrictGroup("meta")
    # the control collectives live in bench.rank and look the helper up there
    monkeypatch.setattr(bench.rank, "collective_device", lambda group=None: torch.device("meta"))
    for name in ("all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, getattr(strict, name))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: 1)  # a meta flag has no value
    assert bench.all_ranks_ok(True) is True
    bench.broadcast_(torch.zeros(3, device="meta"), src=0)
    assert strict.calls == [("all_reduce", "meta"), ("broadcast", "meta")]


def test_loss_match_collectives_use_the_groups_device():
    """loss-match's control collectives (loss sum, grad-norm) take the group's device."""
    import inspect

    from efa_ep.tools import loss_match

    src = inspect.getsource(loss_match.train._train_arm)
    assert 'to("cpu")' not in src.split("dist.all_reduce(total")[0].split("Reported loss")[1]
    assert "collective_device(dp_group)" in src and "collective_device(ep_group)" in src


# --- the raw collective arm and the timing modes -------------------------------------------------
def test_nccl_arm_needs_an_nccl_group():
    quick = compose("bench", "quick")
    arms, not_run = bench.resolve_arms(quick, ["torch"])  # gloo, auto: listed as not run, with why
    assert "nccl" not in [a.name for a in arms]
    assert "NCCL process group" in not_run["nccl"] and "backend=gloo" in not_run["nccl"]
    with pytest.raises(ValueError, match="needs an NCCL process group; this run's group is backend=gloo"):
        bench.resolve_arms({**quick, "arms": {**quick["arms"], "nccl_arm": "require"}}, ["torch"])
    nccl = {**quick, "backend": "nccl", "device": "cuda"}
    arms, not_run = bench.resolve_arms(nccl, ["torch"])
    raw = [a for a in arms if a.collective]
    assert [(a.name, a.collective, a.transport) for a in raw] == [("nccl", "nccl", None)]
    assert "nccl" not in not_run
    with pytest.raises(ValueError, match="nccl_arm=gloo requires backend=gloo"):
        bench.resolve_arms({**nccl, "arms": {**quick["arms"], "nccl_arm": "gloo"}}, ["torch"])
    arms, _ = bench.resolve_arms({**quick, "arms": {**quick["arms"], "nccl_arm": "gloo"}}, ["torch"])
    assert [a.name for a in arms if a.collective] == ["a2a:gloo"]  # never labelled nccl
    arms, not_run = bench.resolve_arms({**quick, "arms": {**quick["arms"], "nccl_arm": False}}, ["torch"])
    assert not any(a.collective for a in arms) and "nccl" not in not_run
    with pytest.raises(ValueError, match="backend=nccl requires device=cuda"):
        bench.validate_config({**quick, "backend": "nccl"})
    with pytest.raises(ValueError, match="one rank per GPU"):
        bench.validate_config({**quick, "backend": "nccl", "device": "cuda:0"})
    gpu = compose("bench", "gpu_nccl")
    assert (gpu["backend"], gpu["device"], gpu["arms"]["nccl_arm"]) == ("nccl", "cuda", "require")
    assert gpu["timing"] == ["single", "steady"] and gpu["starts"] >= 6
    bench.validate_config(gpu)


def test_timing_modes_and_cells():
    quick = compose("bench", "quick")
    assert bench.timing_modes(quick) == ["single"]
    both = {**quick, "timing": ["single", "steady"]}
    arms, _ = bench.resolve_arms(both, ["torch"])
    cells = bench.build_cells(both, arms)
    assert {c.timing for c in cells} == {"single", "steady"} and len({c.key for c in cells}) == len(cells)
    assert len(cells) == 2 * len(bench.build_cells(quick, arms))
    with pytest.raises(ValueError, match="timing="):
        bench.timing_modes({**quick, "timing": "pipelined"})
    with pytest.raises(ValueError, match="steady_iters >= 1"):
        bench.timing_modes({**quick, "timing": "steady", "steady_iters": 0})
    assert "elapsed" not in bench.timing_boundary("single") and "/ steady_iters" in bench.timing_boundary("steady")
    assert "MoELayer" in bench.timing_boundary("steady", "layer")


def test_steady_timing_divides_by_the_loop_and_single_times_one_call():
    import time as _time

    calls, barriers = [], []

    def fn():
        calls.append(1)
        _time.sleep(0.002)

    out = bench.time_samples(fn, warmup=1, iters=2, timing="steady", steady_iters=5,
                             barrier=lambda: barriers.append(1))
    assert len(calls) == 3 * 5 and len(barriers) == 3 and len(out) == 2
    assert all(0.0015 < t < 0.05 for t in out)  # per iteration, not per 5-iteration loop
    calls.clear()
    out = bench.time_samples(fn, warmup=0, iters=3, timing="single")
    assert len(calls) == 3 and len(out) == 3


def test_pack_rows_round_trip():
    import torch

    x = torch.randn(5, 6).to(torch.bfloat16)
    idx = torch.tensor([[0, -1], [1, 2], [-1, 3], [0, 1], [2, -1]])
    w = torch.rand(5, 2)
    rows = bench.pack_rows(x, idx, w)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 6 * 2 + 2 * 8 + 2 * 4)
    gx, gi, gw = bench.unpack_rows(rows, 6, 2, torch.bfloat16)
    assert torch.equal(gx, x) and torch.equal(gi, idx) and torch.equal(gw, w)


def test_gloo_run_of_the_raw_arm_in_both_timing_modes(tmp_path):
    """A real 2-rank gloo start: the raw all_to_all_single arm (a2a:gloo) checked against the
    torch transport, then timed, in single and steady mode; records carry mode and provenance."""
    out = tmp_path / "bg"
    cfg = compose("bench", "quick", [
        f"out_dir={out}", "progress=false", "plots=false", "arms.transports=[torch]", "arms.nccl_arm=gloo",
        "layer.enabled=false", "starts=1", "warmup=0", "iters=2", "timing=[single,steady]",
        "steady_iters=2", "routes=[skewed]", "~profiles.prefill"])
    summary = bench.run(cfg, log=lambda *a, **k: None)
    assert not summary["failed_starts"], summary["failed_starts"]
    records = [json.loads(l) for l in (out / "bench_records.jsonl").read_text().splitlines()]
    assert {(r["arm"], r["timing"]) for r in records} == {
        (a, m) for a in ("torch", "a2a:gloo") for m in ("single", "steady")}
    for r in records:
        assert set(bench.RECORD_FIELDS) <= set(r), set(bench.RECORD_FIELDS) - set(r)
        assert not r["void"] and r["collective_backend"] == "gloo" and r["ranks_per_node"] == 2
        assert r["clock"] == "host perf_counter"
        assert r["steady_iters"] == (2 if r["timing"] == "steady" else 1)
        assert r["provenance"]["process_group"] == {"backend": "gloo", "world_size": 2}
        assert "loaded" in r["provenance"]["versions"]["nccl"]
    raw = [r for r in records if r["arm"] == "a2a:gloo"]
    torch_rec = next(r for r in records if r["arm"] == "torch")
    for r in raw:
        assert r["check"]["status"] == "pass" and r["transport"] is None
        cb = r["collective_bytes"]
        # same rows as the dispatcher: payload + K ids + K weights out, payload back
        assert r["dispatch_rows"] == torch_rec["dispatch_rows"]
        assert cb["combine"] == r["dispatch_bytes"] == torch_rec["dispatch_bytes"]
        assert cb["dispatch"] == r["dispatch_rows"] * (r["hidden"] * 2 + r["topk"] * 12)
    cells = summary["cells"]
    assert all(c["collective_arm"] == "a2a:gloo" for c in cells)
    assert all(c["vs_collective"] == 1.0 for c in cells if c["arm"] == "a2a:gloo")
    assert "vs a2a:gloo" in summary["table"] and "| steady |" in summary["table"]


def test_hier_arms_and_their_options():
    cfg = compose("bench", "quick", ["arms.transports=[torch,proxy,hier]", "node_size=2", "ep_size=4"])
    arms, _ = bench.resolve_arms(cfg, ["torch", "proxy", "hier"])
    hier = {a.name: dict(a.options) for a in arms if a.transport == "hier"}
    want = {"aggregate": 1, "node_size": 2}, {"aggregate": 0, "node_size": 2}
    assert hier == {"hier:agg1": want[0], "hier:agg0": want[1], "efa:hier:agg1": want[0],
                    "efa:hier:agg0": want[1]}
    # "*" stays the flat transports (hier needs a layout)
    assert not [a for a in bench.resolve_arms(compose("bench", "quick"), ["torch", "hier"])[0] if a.transport == "hier"]
    with pytest.raises(ValueError, match="arms.hier_aggregate: aggregate=2 is not one of 0, 1"):
        bench.resolve_arms(compose("bench", "quick", ["arms.transports=[torch,hier]", "arms.hier_aggregate=[2]"]),
                           ["torch", "hier"])
    with pytest.raises(ValueError, match="node_size=3 must be a positive integer dividing ep_size=4"):
        bench.validate_config(compose("bench", "quick", ["node_size=3", "ep_size=4"]))


def test_gda_mode_arms():
    """gda runs as one arm per arms.gda_modes entry; the GPU configs time all three."""
    cfg = compose("bench", "quick", ["arms.transports=[torch,gda]", "arms.gda_modes=[regular,fixed,graph]",
                                     "layer.enabled=false"])
    arms, _ = bench.resolve_arms(cfg, ["torch", "gda"])
    assert [(a.name, a.mode) for a in arms if a.transport == "gda"] == [
        ("gda", "regular"), ("gda:fixed", "fixed"), ("gda:graph", "graph")]
    assert [a.mode for a in arms if a.transport == "torch"] == ["regular"]
    for name in ("gpu", "gpu_nccl"):
        assert compose("bench", name)["arms"]["gda_modes"] == ["regular", "fixed", "graph"]
    with pytest.raises(ValueError, match="arms.gda_modes: 'fast' is not one of regular, fixed, graph"):
        bench.resolve_arms(compose("bench", "quick", ["arms.transports=[torch,gda]",
                                                      "arms.gda_modes=[fast]"]), ["torch", "gda"])


def test_network_counts_of_hier_and_proxy_at_an_emulated_layout(tmp_path):
    """EP 4 as 2 emulated nodes: hier with and without aggregation and the flat proxy, each
    checked against torch, then their network counts (all ranks, one op) in records and table."""
    out = tmp_path / "bh"
    cfg = compose("bench", "quick", [
        f"out_dir={out}", "progress=false", "plots=false", "arms.transports=[torch,proxy,hier]",
        "arms.proxy_channels=[1]", "ep_size=4", "node_size=2", "layer.enabled=false", "starts=1",
        "warmup=0", "iters=1", "routes=[uniform]", "~profiles.decode"])
    summary = bench.run(cfg, log=lambda *a, **k: None)
    assert not summary["failed_starts"], summary["failed_starts"]
    recs = {r["arm"]: r for r in (json.loads(l) for l in (out / "bench_records.jsonl").read_text().splitlines())}
    assert set(recs) == {"torch", "proxy:k1", "hier:agg1", "hier:agg0"}
    assert all(r["check"]["status"] in ("reference", "pass") and not r["void"] for r in recs.values())
    assert recs["torch"]["net_counts"]["dispatch"] is None   # torch does not count
    nc = {a: recs[a]["net_counts"] for a in ("proxy:k1", "hier:agg1", "hier:agg0")}
    cross = nc["hier:agg0"]["per_rank_cross_node"]
    assert all(n["node_size"] == 2 and n["num_nodes"] == 2 and n["per_rank_cross_node"] == cross
               for n in nc.values())
    d1, d0, dp = (nc[a]["dispatch"] for a in ("hier:agg1", "hier:agg0", "proxy:k1"))
    # no aggregation: exactly the flat route's cross-node rows; aggregation: fewer of everything
    assert (d0["messages"], d0["rows"], d0["bytes"]) == (cross["messages"], cross["rows"], cross["bytes"])
    assert d0["messages"] == 8 and d1["messages"] == 4 and dp["messages"] == 12   # 64 tokens/rank
    for key in ("messages", "rows", "bytes", "writes", "wire_bytes"):
        assert d1[key] < d0[key] < dp[key], key
    assert dp["rows"] < recs["proxy:k1"]["dispatch_rows"]   # rows to the rank itself stay off the wire
    for a in nc:
        c = nc[a]["combine"]
        assert c["rows"] == nc[a]["dispatch"]["rows"] and c["writes"] > 0, a  # the rows come back
    table = summary["table"]
    assert "### Network operations per op" in table and "| hier:agg0 | 2 x 2 | 8 |" in table
    cell = next(c for c in summary["cells"] if c["arm"] == "hier:agg1")
    assert cell["net_counts"]["dispatch"] == d1


# --- the layer view's training features ------------------------------------------------------
def test_layer_features_config_checks(capsys):
    """layer.features is checked before any rank starts: an unknown feature is one line (exit
    code 2); pad needs a capacity that fits the batch; combinations are checked."""
    rc = bench.main(["--quick", "layer.features=[plain,padd]", "progress=false"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == [
        "efa-ep-bench: error: layer.features: 'padd' is not a feature; expected one of plain, "
        "pad, shared, shared_overlap (or several joined with +)"]
    quick = compose("bench", "quick")
    assert bench.layer_features(quick) == ["plain"]  # the default: today's cell only
    bench.validate_config(compose("bench", "quick", ["layer.features=[plain,pad+shared_overlap]"]))
    for features, match in (("[pad,pad]", "listed twice"), ("[]", "is empty"),
                            ("[shared+shared_overlap]", "combines shared and shared_overlap"),
                            ("[plain+pad]", "combines plain")):
        with pytest.raises(ValueError, match=match):
            bench.validate_config(compose("bench", "quick", [f"layer.features={features}"]))
    # quick layer: 32 tokens top-2 of 8 experts; factor 5 gives C = 40 > 32 tokens
    with pytest.raises(ValueError, match=r"capacity 40 tokens per expert exceeds tokens_per_rank=32"):
        bench.validate_config(compose("bench", "quick", ["layer.features=[pad]", "layer.capacity_factor=5"]))
    with pytest.raises(ValueError, match="layer.capacity_overflow='spill'"):
        bench.validate_config(compose("bench", "quick", ["layer.features=[pad]",
                                                         "layer.capacity_overflow=spill"]))
    with pytest.raises(ValueError, match="layer.max_tokens_per_rank=16 must be"):
        bench.validate_config(compose("bench", "quick", ["layer.max_tokens_per_rank=16"]))
    # what each feature sets, for both dispatchers; what the efa dispatcher needs on top
    lay = quick["layer"]
    assert bench.megatron_overrides("plain", lay) == {}
    assert bench.megatron_overrides("pad+shared_overlap", lay) == {
        "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True,
        "moe_shared_expert_intermediate_size": lay["ffn_hidden_size"], "moe_shared_expert_overlap": True}
    assert bench.megatron_overrides("shared", lay)["moe_shared_expert_overlap"] is False
    opts, attrs = bench.efa_settings("pad", lay, "gda", (("max_topk", 4),), 128)
    assert dict(opts) == {"max_topk": 128} and attrs == {"efa_ep_capacity_overflow": "drop"}
    assert bench.efa_settings("pad", lay, "torch", (), 128) == ((), {"efa_ep_capacity_overflow": "drop"})
    assert bench.efa_settings("shared_overlap", lay, "gda", (), 128) == ((), {})


def test_gpu_layer_features_config():
    """The GPU config: layer view only, alltoall and efa over gda, every feature; EP 2 as two
    processes on one GPU at the Qwen3-30B-A3B layer shape."""
    cfg = compose("bench", "gpu_layer_features")
    bench.validate_config(cfg)
    assert (cfg["ep_size"], cfg["device"], cfg["ranks_per_gpu"], cfg["backend"]) == (2, "cuda:0", 2, "gloo")
    lay = cfg["layer"]
    gpu = compose("bench", "gpu")["layer"]
    assert {k: lay[k] for k in ("hidden", "ffn_hidden_size", "num_experts", "topk", "dtype")} == {
        k: gpu[k] for k in ("hidden", "ffn_hidden_size", "num_experts", "topk", "dtype")}
    assert cfg["starts"] == 6 and not bench.transport_view(cfg)
    arms, not_run = bench.resolve_arms(cfg, ["torch", "gda", "proxy"])
    assert [a.name for a in arms] == ["alltoall", "efa:gda"] and not not_run
    cells = bench.build_cells(cfg, arms)
    assert {(c.arm.name, c.feature) for c in cells} == {
        (a, f) for a in ("alltoall", "efa:gda") for f in ("plain", "pad", "shared", "shared_overlap")}
    assert len(cells) == 8 and all(c.arm.view == "layer" for c in cells)
    # without gda the efa arm is listed as not run, not silently dropped
    arms, not_run = bench.resolve_arms(cfg, ["torch"])
    assert [a.name for a in arms] == ["alltoall"] and "efa:gda" in not_run


def test_layer_view_features_on_cpu(tmp_path):
    """The layer view on CPU (torch transport, EP 2, tiny shapes): every (arm x feature) cell
    ran, none void, each efa layer checked against alltoall in the same feature before timing;
    records, summary and table carry the feature and the ratio to alltoall in that feature."""
    out = tmp_path / "bl"
    features = ["plain", "pad", "shared_overlap"]
    cfg = compose("bench", "quick", [
        f"out_dir={out}", "progress=false", "transport_view=false", "layer.transports=[torch]",
        f"layer.features=[{','.join(features)}]", "starts=1", "warmup=1", "iters=2"])
    summary = bench.run(cfg, log=lambda *a, **k: None)
    assert not summary["failed_starts"], summary["failed_starts"]
    records = [json.loads(l) for l in (out / "bench_records.jsonl").read_text().splitlines()]
    assert sorted((r["arm"], r["feature"]) for r in records) == sorted(
        (a, f) for a in ("alltoall", "efa:torch") for f in features)
    for r in records:
        assert set(bench.RECORD_FIELDS) <= set(r), set(bench.RECORD_FIELDS) - set(r)
        assert r["view"] == "layer" and not r["void"], r["void_reason"]
        assert len(r["slowest_us"]) == 2 and r["vs_reference"] > 0
        info = r["transport_info"]
        assert info["feature"] == r["feature"]
        assert info["megatron"] == bench.megatron_overrides(r["feature"], cfg["layer"])
        if r["arm"] == "alltoall":
            assert r["check"]["status"] == "reference" and r["vs_reference"] == 1.0
            continue
        # efa: output and input grad compared with alltoall in the same mode, and equal
        assert r["check"]["status"] == "pass" and r["check"]["detail"] is None
        assert f"vs alltoall in feature {r['feature']}" in r["check"]["compared"]
        assert info["static_shapes"] == (r["feature"] == "pad")
        assert info["shared_expert_overlap"] == (r["feature"] == "shared_overlap")
        assert info["capacity_overflow"] == "drop"
        ref = next(a for a in records if a["arm"] == "alltoall" and a["feature"] == r["feature"])
        assert math.isclose(r["vs_reference"], r["start_median_us"] / ref["start_median_us"], rel_tol=1e-3)
    rows = {(c["arm"], c["feature"]): c for c in summary["cells"]}
    assert len(rows) == 6 and all(c["n_void"] == 0 and c["latency_us"]["n"] == 1 for c in rows.values())
    for f in features:
        efa, a2a = rows[("efa:torch", f)], rows[("alltoall", f)]
        assert math.isclose(efa["vs_reference"], efa["latency_us"]["median"] / a2a["latency_us"]["median"])
        assert math.isclose(efa["vs_plain"], efa["latency_us"]["median"]
                            / rows[("efa:torch", "plain")]["latency_us"]["median"])
    table = summary["table"]
    assert "| timing | feature |" in table and "vs alltoall (same feature)" in table
    assert "vs plain (same arm)" in table and "### Dispatch + combine" not in table
    for f in features:
        assert table.count(f"| single | {f} |") == 2
    assert summary["plots"] and all(os.path.exists(p) for p in summary["plots"])


def test_host_per_op_subtracts_the_time_a_transport_reports_blocked(tmp_path):
    """host_per_op: the dispatch of this fake transport blocks for all of its wall time (host
    ~0), its combine spins on the host for >= 2 ms and reports nothing blocked (host >= 2 ms);
    a transport without ``blocked_s`` gets None; the report's median keeps both ops."""
    import time
    import types

    import torch
    import torch.distributed as dist

    from efa_ep.tools.bench.report import _host_median
    from efa_ep.tools.bench.transport_cells import host_per_op

    class Fake:
        blocked_s = 0.0

        def dispatch(self):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 1e-3:
                pass
            self.blocked_s += time.perf_counter() - t0
            return ("rows", "handle")

        def combine(self, r):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 2e-3:
                pass

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ctx = types.SimpleNamespace(cfg={"iters": 5}, device=torch.device("cpu"), world=1,
                                    barrier=lambda: None)
        t = Fake()
        h = host_per_op(ctx, t, t.dispatch, t.combine)
        assert h["combine"] >= 2000.0, h
        assert 0.0 <= h["dispatch"] < 1000.0, h
        assert host_per_op(ctx, object(), t.dispatch, t.combine) is None
    finally:
        dist.destroy_process_group()
    recs = [{"void": False, "host_us": {"dispatch": d, "combine": 2 * d}} for d in (1.0, 3.0, 2.0)]
    assert _host_median(recs + [{"void": True, "host_us": None}]) == {"dispatch": 2.0, "combine": 4.0}
    assert _host_median([{"void": False, "host_us": None}]) is None
