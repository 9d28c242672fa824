"""The proxy benchmark's wire part (:mod:`efa_ep.tools.bench.proxy`, behind
``scripts/bench_proxy.py``): it runs the two wire rounds of a dispatch+combine alone between
two rank processes and reports the bytes each op moved.

CPU, shm provider, tiny sizes (CI has 2 cores); what is checked is that the rounds really run
(the engine counts the bytes it posted) and that the record says what was measured, not a time.
"""
from __future__ import annotations

import pytest

from efa_ep.kernels import proxy as proxy_mod

pytestmark = pytest.mark.skipif(proxy_mod.availability() is not None,
                                reason=f"proxy unavailable: {proxy_mod.availability()}")


def test_wire_part_moves_the_decode_rows_and_reports_them():
    from efa_ep.tools.bench import proxy as bp

    tokens, iters = 8, 3
    recs = bp.bench_wire("shm", tokens, iters, [1, 2])
    wires = [r for r in recs if r["kind"] == "wire"]
    assert [r["channels"] for r in wires] == [1, 2]
    for r in wires:
        assert r["wire_ms"]["n"] == iters and r["wire_ms"]["min"] > 0
        # rank 0's rows to its peer: each of its tokens picking an expert on rank 1, of
        # H*2 + 16*top-k bytes (the route is the a2a cell's, seed 7)
        assert r["bytes_per_op_rank0"] % (7168 * 2 + 16 * 8) == 0
        assert 0 < r["bytes_per_op_rank0"] // (7168 * 2 + 16 * 8) <= tokens
    copy = [r for r in recs if r["kind"] == "host_copy"]
    assert len(copy) == 1 and copy[0]["bytes"] == wires[0]["bytes_per_op_rank0"]


def test_fresh_routes_time_a_new_route_per_iteration_and_check_each():
    """``--fresh-routes``: every timed iteration dispatches another route (row counts change
    per call, as in training) and its outputs are compared with torch's after the timing; a
    proxy that returned the wrong rows for any of them would clear ``bit_identical_to_torch``."""
    from efa_ep.tools.bench import proxy as bp

    iters = 2
    (rec,) = bp.bench_a2a("shm", [("decode", 8)], iters, 1, time_torch=False, fresh_routes=True)
    assert rec["route"] == "random, fresh per iteration"
    assert rec["bit_identical_to_torch"] is True
    assert rec["proxy_ms"]["n"] == iters and rec["wire_ms"]["n"] == iters
