"""Reliability of the ``torch`` transport: peers that err, die, stall or lie never corrupt results.

Fast subset (CI, three launches: spawning ranks is most of its time): randomized rounds against
the brute-force reference with bad input on one rank for every argument of every operation mixed
in; options that differ across ranks, the launcher's sockets on loopback only, ranks running
different operations, tampered routing metadata and a slow peer; a killed peer. ``EFA_EP_RELIABILITY_FULL=1`` runs many more rounds, EP 2/3/4
and every tampering case. ``EFA_EP_RELIABILITY_REPORT=<file>`` appends one JSON line per test
with its figures (rounds, faults injected, mismatches, time to error).
"""
import json
import os
import time

import pytest
import torch

from efa_ep.distributed import run_ranks

FULL = os.environ.get("EFA_EP_RELIABILITY_FULL") == "1"
full_only = pytest.mark.skipif(not FULL, reason="set EFA_EP_RELIABILITY_FULL=1 for the full set")


def _report(name, **figures):
    path = os.environ.get("EFA_EP_RELIABILITY_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(test=name, **figures)) + "\n")


# Bad input on one rank: (operation, argument, variant, words the message must contain).
BAD_CASES = [
    ("dispatch", "x", "dtype", "x must be torch.float32"),
    ("dispatch", "x", "width", "x must be [num_tokens, 8]"),
    ("dispatch", "x", "not_tensor", "x must be a tensor"),
    ("dispatch", "x", "too_many_tokens", "max_tokens_per_rank=32"),
    ("dispatch", "x", "meta", "must share a device"),
    ("dispatch", "topk_idx", "dtype", "topk_idx must be torch.int64"),
    ("dispatch", "topk_idx", "rows", "topk_idx must be ["),
    ("dispatch", "topk_idx", "expert_range", "expected -1 (no expert) or 0 <= id < num_experts"),
    ("dispatch", "topk_idx", "k_differs", "ranks disagree on the top-k K"),
    ("dispatch", "topk_weights", "dtype", "topk_weights must be torch.float32"),
    ("dispatch", "topk_weights", "shape", "topk_weights must have topk_idx's shape"),
    ("dispatch", "topk_weights", "nan", "NaN/Inf"),
    ("combine", "y", "rows", "combine input y must be ["),
    ("combine", "y", "not_tensor", "combine input y must be a tensor"),
    ("combine", "y", "width", "ranks disagree on the row width D"),
    ("combine", "y", "dtype", "ranks disagree on the row dtype"),
    ("combine", "handle", "none", "handle must be the DispatchHandle"),
    ("combine", "handle", "stale", "ranks disagree on the handle"),
    ("dispatch_cached", "x", "rows", "cached dispatch input x must be ["),
    ("dispatch_cached", "x", "not_tensor", "cached dispatch input x must be a tensor"),
    ("dispatch_cached", "x", "width", "ranks disagree on the row width D"),
    ("dispatch_cached", "x", "dtype", "ranks disagree on the row dtype"),
    ("dispatch_cached", "handle", "none", "handle must be the DispatchHandle"),
    ("dispatch_cached", "handle", "stale", "ranks disagree on the handle"),
    ("combine_topk_weights", "grad", "k", "combine_topk_weights input must be ["),
    ("combine_topk_weights", "grad", "dtype", "combine_topk_weights input must be ["),
    ("combine_topk_weights", "grad", "rows", "combine_topk_weights input grad must be ["),
    ("combine_topk_weights", "handle", "none", "handle must be the DispatchHandle"),
    ("combine_topk_weights", "handle", "stale", "ranks disagree on the handle"),
]


def _all_inputs(world, seed, experts, hidden, k, max_tokens, dtype, kind=None):
    """Every rank's (x, topk_idx, topk_weights), the same on every rank (shared seed)."""
    from efa_ep.testing.routes import contract_route

    g = torch.Generator().manual_seed(seed)
    kinds = ("random", "hot_experts", "one_rank", "dropped")
    data = []
    for r in range(world):
        n = int(torch.randint(0, max_tokens + 1, (1,), generator=g))
        if n and int(torch.randint(0, 5, (1,), generator=g)) == 0:
            n = 0  # T = 0 often
        kd = kind or kinds[int(torch.randint(0, len(kinds), (1,), generator=g))]
        idx, w = contract_route(kd, n, experts, k, world, seed=seed * 17 + r)
        x = torch.randn(n, hidden, generator=g).to(dtype)
        data.append((x, idx, w))
    return data


def _check_round(t, rank, world, data, experts, seed):
    """One dispatch / combine / dispatch_cached / combine_topk_weights round; returns the
    names of the outputs that differ from the reference (empty when all match)."""
    from efa_ep.testing.reference import reference_combine, reference_dispatch

    x, idx, w = data[rank]
    rx, ri, rw, tpe, handle = t.dispatch(x, idx, w)
    ref = reference_dispatch(*zip(*data), num_experts=experts)
    ex, ei, ew, ec, _ = ref[rank]
    bad = [n for n, a, b in (("recv_x", rx, ex), ("recv_topk_idx", ri, ei),
                             ("recv_topk_weights", rw, ew), ("tokens_per_expert", tpe, ec))
           if not torch.equal(a, b)]
    g = torch.Generator().manual_seed(seed + 7)
    ys = [torch.randn(ref[d][0].shape[0], x.shape[1], generator=g).to(x.dtype) for d in range(world)]
    out = t.combine(ys[rank], handle)
    exp = reference_combine(ys, [ref[d][4] for d in range(world)], [d[0].shape[0] for d in data])
    if not torch.equal(out, exp[rank]):
        bad.append("combine")
    if not torch.equal(t.dispatch_cached(x, handle), rx):
        bad.append("dispatch_cached")
    if not torch.equal(t.combine_topk_weights(rw, handle), w):
        bad.append("combine_topk_weights")
    return bad


def _bad_case(t, rank, world, case_no, case, data):
    """Runs one bad-input case (bad rank = case_no % world); returns (type, message, seconds)."""
    from efa_ep.kernels import DispatchInputError

    op, arg, variant, _ = case
    bad_rank = case_no % world
    x, idx, w = data[rank]
    mine = rank == bad_rank
    rx, ri, rw, tpe, h_old = t.dispatch(x, idx, w)
    rx, ri, rw, tpe, h = t.dispatch(x, idx, w)  # same layout, a later dispatch: h_old is stale
    if op == "dispatch":
        args = [x, idx, w]
        if mine:
            n, k = idx.shape
            bad = {
                ("x", "dtype"): lambda: x.double(),
                ("x", "width"): lambda: torch.zeros(n, x.shape[1] + 1, dtype=x.dtype),
                ("x", "not_tensor"): lambda: x.tolist(),
                ("x", "too_many_tokens"): lambda: torch.zeros(t.cfg.max_tokens_per_rank + 1, x.shape[1]),
                ("x", "meta"): lambda: x.to("meta"),
                ("topk_idx", "dtype"): lambda: idx.int(),
                ("topk_idx", "rows"): lambda: torch.zeros(n + 1, k, dtype=torch.int64),
                ("topk_idx", "expert_range"): lambda: torch.full_like(idx, t.cfg.num_experts),
                ("topk_idx", "k_differs"): lambda: torch.cat([idx, torch.full((n, 1), -1)], 1),
                ("topk_weights", "dtype"): lambda: w.double(),
                ("topk_weights", "shape"): lambda: torch.zeros(n, k + 1),
                ("topk_weights", "nan"): lambda: torch.full_like(w, float("nan")),
            }[(arg, variant)]()
            if variant == "too_many_tokens":
                args = [bad, torch.zeros(bad.shape[0], idx.shape[1], dtype=torch.int64),
                        torch.zeros(bad.shape[0], idx.shape[1])]
            elif variant == "k_differs":
                args = [x, bad, torch.cat([w, torch.zeros(n, 1)], 1)]
            elif variant == "expert_range" and n == 0:
                args = [x[:1] if x.shape[0] else torch.zeros(1, x.shape[1]),
                        torch.full((1, k), t.cfg.num_experts), torch.ones(1, k)]
            elif variant == "nan" and n == 0:
                args = [torch.zeros(1, x.shape[1]), torch.zeros(1, k, dtype=torch.int64),
                        torch.full((1, k), float("nan"))]
            else:
                args[["x", "topk_idx", "topk_weights"].index(arg)] = bad
        call = lambda: t.dispatch(*args)  # noqa: E731
    else:
        rows_in = {"combine": rx, "dispatch_cached": x, "combine_topk_weights": rw}[op]
        handle = h
        if mine:
            if arg == "handle":
                handle = None if variant == "none" else h_old
            else:
                rows_in = {
                    "rows": lambda: torch.zeros(rows_in.shape[0] + 1, rows_in.shape[1], dtype=rows_in.dtype),
                    "not_tensor": lambda: rows_in.tolist(),
                    "width": lambda: torch.zeros(rows_in.shape[0], rows_in.shape[1] + 1, dtype=rows_in.dtype),
                    "dtype": lambda: rows_in.double(),
                    "k": lambda: torch.zeros(rows_in.shape[0], rows_in.shape[1] + 1),
                }[variant]()
        fn = getattr(t, op)
        call = lambda: fn(rows_in, handle)  # noqa: E731
    t0 = time.monotonic()
    try:
        call()
        return ("none", "no error", time.monotonic() - t0)
    except DispatchInputError as e:
        return ("DispatchInputError", str(e), time.monotonic() - t0)
    except Exception as e:  # reported to the parent, which fails the test
        return (type(e).__name__, str(e), time.monotonic() - t0)


def _transport(cache, experts, hidden, dtype):
    """One transport per (E, H, dtype), created collectively on first use (every rank draws
    the same configurations, so they create them in the same order)."""
    from efa_ep.kernels import create_transport

    key = (experts, hidden, dtype)
    if key not in cache:
        cache[key] = create_transport("torch", None, experts, hidden, 32, dtype)
    return cache[key]


def _suite_worker(rank, world, rounds, seed, num_faults):
    """Randomized rounds against the reference; between rounds, ``num_faults`` bad-input cases
    cycling through BAD_CASES (fault i: case i % len(BAD_CASES), bad rank i % world)."""
    transports = {}
    g = torch.Generator().manual_seed(seed)
    mismatches, first_mismatch, results = 0, None, []
    every = max(1, rounds // max(1, num_faults))

    def fault(i):
        tf = _transport(transports, 8 * world, 8, torch.float32)
        case = BAD_CASES[i % len(BAD_CASES)]
        cdata = _all_inputs(world, seed * 7 + i, 8 * world, 8, 2, 32, torch.float32)
        results.append((i,) + _bad_case(tf, rank, world, i, case, cdata))

    for rnd in range(rounds):
        experts = world * int(torch.randint(1, 9, (1,), generator=g))
        hidden = (8, 24)[int(torch.randint(0, 2, (1,), generator=g))]
        dtype = (torch.float32, torch.bfloat16)[int(torch.randint(0, 2, (1,), generator=g))]
        k = int(torch.randint(1, min(experts, 8) + 1, (1,), generator=g))
        t = _transport(transports, experts, hidden, dtype)
        data = _all_inputs(world, seed * 1000 + rnd, experts, hidden, k, 32, dtype)
        bad = _check_round(t, rank, world, data, experts, seed * 1000 + rnd)
        if bad:
            mismatches += 1
            first_mismatch = first_mismatch or (rnd, (experts, hidden, str(dtype)), k, bad)
        if len(results) < num_faults and rnd % every == every - 1:
            fault(len(results))
    while len(results) < num_faults:  # fewer rounds than faults: the rest back to back
        fault(len(results))
    # Still usable after every refused call: one more checked round on the bad-input transport.
    if num_faults:
        data = _all_inputs(world, seed + 99, 8 * world, 8, 2, 32, torch.float32)
        if _check_round(_transport(transports, 8 * world, 8, torch.float32), rank, world, data,
                        8 * world, seed + 99):
            mismatches += 1
    return dict(rounds=rounds, mismatches=mismatches, first_mismatch=first_mismatch,
                faults=len(results), results=results)


def _check_suite(outs, world):
    assert all(o["mismatches"] == 0 for o in outs), [o["first_mismatch"] for o in outs]
    times = []
    for i in range(outs[0]["faults"]):
        case = BAD_CASES[i % len(BAD_CASES)]
        per_rank = [o["results"][i] for o in outs]
        kinds = {r[1] for r in per_rank}
        msgs = {r[2] for r in per_rank}
        bad_rank = i % world
        assert kinds == {"DispatchInputError"}, (case, per_rank)
        assert len(msgs) == 1, (case, msgs)  # every rank raises the same error
        msg = msgs.pop()
        assert case[3] in msg, (case, msg)
        assert f"[{bad_rank}]" in msg, (case, msg)  # names the offending rank
        times += [r[3] for r in per_rank]
    return times


def test_random_rounds_with_bad_input_on_one_rank_fast():
    t0 = time.monotonic()
    outs = run_ranks(_suite_worker, 2, (12, 1, len(BAD_CASES)), timeout_s=120, pg_timeout_s=30)
    times = _check_suite(outs, 2)
    _report("fast_random_and_bad_input", world=2, rounds=12, faults=outs[0]["faults"],
            mismatches=0, max_time_to_error_s=max(times), wall_s=time.monotonic() - t0)


@full_only
@pytest.mark.parametrize("world,rounds", [(2, 2000), (3, 1000), (4, 800)])
def test_random_rounds_with_bad_input_on_one_rank_full(world, rounds):
    t0 = time.monotonic()
    # a fault every 4th round: every case on every rank as the bad one, several times
    outs = run_ranks(_suite_worker, world, (rounds, 100 + world, rounds // 4), timeout_s=1800,
                     pg_timeout_s=60)
    times = _check_suite(outs, world)
    _report("full_random_and_bad_input", world=world, rounds=rounds, faults=outs[0]["faults"],
            mismatches=0, median_time_to_error_s=sorted(times)[len(times) // 2],
            max_time_to_error_s=max(times), wall_s=time.monotonic() - t0)


# --- failures: different operations, killed and slow peers ---------------------------------

def _desync_worker(rank, world):
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.base import ProtocolError, TransportBroken

    t = create_transport("torch", None, 4, 8, 16, torch.float32)
    x = torch.randn(3, 8)
    idx = torch.tensor([[0, 2], [1, 3], [2, -1]])
    rx, ri, rw, tpe, h = t.dispatch(x, idx, torch.rand(3, 2))
    out = {}
    try:  # rank 0 combines while rank 1 replays the dispatch: equal-size headers, no abort
        t.combine(rx, h) if rank == 0 else t.dispatch_cached(x, h)
    except ProtocolError as e:
        out["first"] = str(e)
    try:
        t.dispatch(x, idx, torch.rand(3, 2))
    except TransportBroken as e:
        out["later"] = str(e)
    return out


def _check_desync(outs):
    firsts = {o.get("first") for o in outs}
    assert len(firsts) == 1, outs  # the same words on both ranks
    first = firsts.pop()
    assert "rank(s) [0]: combine #2" in first and "rank(s) [1]: dispatch_cached #2" in first, first
    for o in outs:  # later calls refuse without communicating, carrying the original error
        assert "broken" in o["later"] and o["first"] in o["later"], o


def _peer_fault_worker(rank, world, fault, victim, deadline_s=None):
    """``fault``: ``kill`` (the victim SIGKILLs itself after a dispatch) or ``slow`` (it sleeps
    past the deadline); the others time their next combine. ``deadline_s``: the transport runs
    on a new group with that timeout (the launch's own timeout stays long, so a slow start of
    the processes never trips the rendezvous)."""
    import datetime
    import signal

    import torch.distributed as dist

    from efa_ep.kernels import create_transport
    from efa_ep.kernels.base import PeerFailure, TransportBroken

    group = None
    if deadline_s is not None:
        group = dist.new_group(timeout=datetime.timedelta(seconds=deadline_s))
        dist.barrier()  # in step on the long-deadline group first: a slow start is not the fault
    t = create_transport("torch", group, 2 * world, 8, 16, torch.float32)
    x = torch.randn(3, 8)
    idx = torch.tensor([[0, 2], [1, 3], [2, -1]])
    rx, ri, rw, tpe, h = t.dispatch(x, idx, torch.rand(3, 2))
    if rank == victim:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(os.environ["SLOW_S"]))
        return {"slept": True}
    out = {}
    t0 = time.monotonic()
    try:
        t.combine(rx, h)
        out["first"] = "no error"
    except PeerFailure as e:
        out["first"] = str(e)
    out["time_to_error_s"] = time.monotonic() - t0
    try:
        t.combine(rx, h)
    except TransportBroken as e:
        out["later"] = str(e)
    return out


def test_killed_peer_is_named_quickly_and_the_transport_stays_broken():
    res = run_ranks(_peer_fault_worker, 3, ("kill", 1), timeout_s=90, pg_timeout_s=30,
                    raise_on_error=False, env={"SLOW_S": "0"})
    assert not res[1][0]  # the killed rank never reports
    times = []
    for r in (0, 2):
        ok, out = res[r]
        assert ok, out
        assert "combine #2" in out["first"] and "peer rank(s) [1] exited" in out["first"], out
        assert out["time_to_error_s"] < 10, out  # the closed connection, not the 30 s deadline
        assert out["first"] in out["later"], out
        times.append(out["time_to_error_s"])
    _report("killed_peer", world=3, faults=1, max_time_to_error_s=max(times), pg_timeout_s=30)


def _check_slow(out):
    assert "missed the deadline" in out["first"] and "combine #2" in out["first"], out
    assert 1.5 < out["time_to_error_s"] < 6, out
    assert out["first"] in out["later"], out


# --- tampering: a peer that lies about counts or routing metadata --------------------------

def _tamper_worker(rank, world, what):
    from efa_ep.kernels import TransportError, create_transport
    from efa_ep.kernels.base import ProtocolError, TransportBroken
    from efa_ep.kernels.base import H_ROWS, OP_HEADER_FIELDS

    t = create_transport("torch", None, 4, 8, 16, torch.float32)
    x = torch.randn(3, 8)
    idx = torch.tensor([[0, 2], [1, 3], [0, -1]])
    if rank == 1:
        real = t._all_to_all

        def lying(op, seq, stage, out, inp, *splits):
            inp = inp.clone()
            if stage == "the status exchange" and op == "dispatch":
                if what == "rows":
                    inp[0, H_ROWS] += t.cfg.max_tokens_per_rank + 5
                elif what == "per_expert":
                    inp[0, OP_HEADER_FIELDS] += 1
            elif stage == "the all-to-all of routing metadata" and what == "ids" and splits[1][0]:
                inp[0, 0] = 999  # first row for rank 0: a local expert id rank 0 does not have
            return real(op, seq, stage, out, inp, *splits)

        t._all_to_all = lying
    out = {}
    try:
        t.dispatch(x, idx, torch.rand(3, 2))
        out["first"] = "no error"
    except TransportError as e:
        out["first"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        try:
            t.dispatch(x, idx, torch.rand(3, 2))
        except TransportBroken as e:
            out["later"] = str(e)
        assert isinstance(out, dict) and ProtocolError
    return out


TAMPER = [("ids", "local expert ids in [-1, 2)"),
          ("rows", "rank 1 announced 24 rows; expected 0 <= rows <= max_tokens_per_rank=16"),
          ("per_expert", "per-expert counts equal to the announced ones")]


def _check_tamper(out, needle):
    assert out["first"].startswith("ProtocolError") and needle in out["first"], out
    assert "rank(s) [1]" in out["first"] or "rank 1 announced" in out["first"], out
    assert out["first"].split(": ", 1)[1] in out["later"], out


@full_only
@pytest.mark.parametrize("what,needle", TAMPER)
def test_tampered_counts_and_ids_are_detected_not_used(what, needle):
    res = run_ranks(_tamper_worker, 2, (what,), timeout_s=90, pg_timeout_s=5, raise_on_error=False)
    ok, out = res[0]
    assert ok, out
    _check_tamper(out, needle)
    _report("tamper", case=what, faults=1, detected=True)


# --- setup: options must agree; the launcher listens on loopback only ----------------------

def _listening(pid):
    """(address hex, port) of the TCP sockets ``pid`` listens on (from /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                p = line.split()
                if p[3] == "0A" and p[9] in inodes:  # 0A = LISTEN
                    addr, port = p[1].split(":")
                    out.append((addr, int(port, 16)))
    return out


def _setup_worker(rank, world, parent_pid):
    from efa_ep.kernels import TransportError, create_transport

    msgs = {}
    try:
        create_transport("torch", None, 4, 8, 16, torch.float32, timeout_s=5.0 + rank)
        msgs["options"] = "accepted"
    except TransportError as e:
        msgs["options"] = str(e)
    t = create_transport("torch", None, 4, 8, 16, torch.float32, timeout_s=5.0)  # still usable
    # Values a transport resolves from its environment are compared too, by value (60 == 60.0).
    from efa_ep.kernels.base import check_group_agreement, collective_device
    msgs["device"] = str(collective_device(t.group))  # gloo: control tensors on the CPU
    check_group_agreement(t.cfg, t.group, rank, resolved_options={"timeout_s": (60, 60.0)[rank]})
    try:
        check_group_agreement(t.cfg, t.group, rank, resolved_options={"timeout_s": 60 + rank})
        msgs["resolved"] = "accepted"
    except TransportError as e:
        msgs["resolved"] = str(e)
    t.dispatch(torch.zeros(0, 8), torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1))
    store_port = int(os.environ["MASTER_PORT"])
    msgs["store"] = [a for a in _listening(parent_pid) if a[1] == store_port]
    msgs["mine"] = _listening(os.getpid())
    return msgs


def _misc_worker(rank, world, parent_pid):
    # One launch for several checks (spawning ranks dominates CI time): setup first, then ranks
    # running different operations (both raise after the same exchange, the group stays in
    # step), then a lying peer (its metadata arrives in full, so the group stays in step too).
    out = dict(setup=_setup_worker(rank, world, parent_pid), desync=_desync_worker(rank, world),
               tamper=_tamper_worker(rank, world, "ids"))
    # Last, on a group of its own with a 2 s deadline: rank 1 sleeps 3.5 s before its combine.
    os.environ["SLOW_S"] = "3.5"
    out["slow"] = _peer_fault_worker(rank, world, "slow", 1, 2.0)
    return out


def test_setup_desync_tampering_and_slow_peer_fast():
    outs = run_ranks(_misc_worker, 2, (os.getpid(),), timeout_s=90, pg_timeout_s=20)
    for o in outs:
        o = o["setup"]
        assert "disagree" in o["options"] and "timeout_s': 5.0" in o["options"] \
            and "timeout_s': 6.0" in o["options"], o["options"]
        assert o["device"] == "cpu", o
        assert "disagree" in o["resolved"] and "'61.0'" in o["resolved"], o["resolved"]
        assert o["store"], o  # the launcher serves the store ...
        loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
        for addr, port in o["store"] + o["mine"]:  # ... and nothing listens beyond loopback
            assert addr in loopback, (addr, port, o)
    _check_desync([o["desync"] for o in outs])
    _check_tamper(outs[0]["tamper"], TAMPER[0][1])
    assert outs[1]["tamper"]["first"] == "no error"  # the liar itself did not notice
    _check_slow(outs[0]["slow"])
    _report("fast_setup_desync_tamper", faults=3, detected=3)
    _report("slow_peer", world=2, faults=1, time_to_error_s=outs[0]["slow"]["time_to_error_s"],
            deadline_s=2.0)


# --- in-process checks of the validators (no ranks) ----------------------------------------

def test_received_count_and_metadata_validators():
    from efa_ep.kernels.base import (
        check_received_counts, ranks_in_mask, received_metadata_errors,
    )

    ok = torch.tensor([[2, 1], [0, 0], [1, 0]])
    assert check_received_counts(0, [2, 0, 1], ok, 2, 16) is None
    assert "rank 2 announced 17 rows" in check_received_counts(0, [2, 0, 17], ok, 2, 16)
    assert "rank 0 announced 2 rows but 5" in check_received_counts(
        0, [2, 0, 1], torch.tensor([[4, 1], [0, 0], [1, 0]]), 2, 16)
    assert "negative" in check_received_counts(0, [2, 0, 1], torch.tensor([[3, -1], [0, 0], [1, 0]]), 2, 16)
    ids = torch.tensor([[0, -1], [1, 0], [0, -1]])  # rows from sources 0, 0, 2
    assert int(received_metadata_errors(ids, [2, 0, 1], ok, 2)) == 0
    bad = ids.clone()
    bad[2, 0] = 999  # out of range from source 2
    assert ranks_in_mask(int(received_metadata_errors(bad, [2, 0, 1], ok, 2)), 3) == [2]
    none = ids.clone()
    none[0] = -1  # a row with none of this rank's experts, from source 0
    assert ranks_in_mask(int(received_metadata_errors(none, [2, 0, 1], ok, 2)), 3) == [0]
    counts = ok.clone()
    counts[0, 1] = 0  # announced per-expert counts that differ from the ids
    assert ranks_in_mask(int(received_metadata_errors(ids, [2, 0, 1], counts, 2)), 3) == [0]
    phantom = torch.zeros(3, 2, dtype=torch.int64)
    phantom[1, 0] = 1  # counts announced by a source that sent no rows
    assert ranks_in_mask(int(received_metadata_errors(ids[:0], [0, 0, 0], phantom, 2)), 3) == [1]
    assert ranks_in_mask(1 << 62, 70) == [62]  # ranks >= 62 share the top bit
