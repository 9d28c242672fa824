"""Reliability of the ``proxy`` transport: peers that err, die or lie never corrupt results.

Every check runs ranks as processes over loopback tcp. The fast subset runs in CI; the full set
(more rounds, EP 2/3/4, shm, every tamper kind, every bad argument) runs with
``EFA_EP_RELIABILITY_FULL=1`` and writes its figures to ``$EFA_EP_RELIABILITY_REPORT`` (JSON).

- randomized rounds against the brute-force reference (``efa_ep/testing/reference.py``), bit for bit;
- bad input on one rank for each argument of each operation: every rank raises the same error
  naming the rank and the tensor, and the transport stays usable;
- tampering by one rank (counts, ids, offsets, message ids, generation, round tag): detected
  with a clear error, never summed;
- a peer that dies or never arrives: the error names it, and the transport then refuses calls.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import time

import pytest
import torch

from efa_ep.distributed import run_ranks
from efa_ep.kernels import proxy as proxy_mod

pytestmark = pytest.mark.skipif(proxy_mod.availability() is not None,
                                reason=f"proxy unavailable: {proxy_mod.availability()}")

FULL = os.environ.get("EFA_EP_RELIABILITY_FULL") == "1"
LOOPBACK = {"FI_TCP_IFACE": "lo", "FI_PROVIDER": "tcp", "OMP_NUM_THREADS": "1"}
SHM_ENV = {"FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "1"}
FAULT_TIMEOUT_S = 2.0


def _record(key, value):
    """Adds figures to the JSON report of the full run (no-op without the env var)."""
    path = os.environ.get("EFA_EP_RELIABILITY_REPORT")
    if not path:
        return
    data = json.load(open(path)) if os.path.exists(path) else {}
    data[key] = value
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --------------------------------------------------------------------------------------------
# Randomized rounds against the reference
# --------------------------------------------------------------------------------------------
def _inputs(world, num_experts, hidden, topk, dtype, tokens, seed):
    """Every rank's inputs from one seed (each rank rebuilds all of them for the reference)."""
    from efa_ep.testing.routes import contract_route

    kinds = ("random", "hot_experts", "dropped", "one_rank")
    xs, idxs, ws = [], [], []
    for r in range(world):
        kind = kinds[(seed + r) % len(kinds)]
        idx, w = contract_route(kind, tokens[r], num_experts, topk, world, seed * 101 + r)
        g = torch.Generator().manual_seed(seed * 7 + r)
        xs.append(torch.randn(tokens[r], hidden, generator=g).to(dtype))
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws


def _check_round(t, rank, world, num_experts, hidden, topk, dtype, tokens, seed):
    """One dispatch / combine / dispatch_cached / combine_topk_weights against the reference;
    returns the names of mismatching outputs."""
    from efa_ep.testing.reference import reference_combine, reference_dispatch

    xs, idxs, ws = _inputs(world, num_experts, hidden, topk, dtype, tokens, seed)
    ref = reference_dispatch(xs, idxs, ws, num_experts)
    rx, ridx, rw, rtpe, sources = ref[rank]
    bad = []
    out = t.dispatch(xs[rank], idxs[rank], ws[rank])
    for name, a, b in (("recv_x", rx, out[0]), ("recv_topk_idx", ridx, out[1]),
                       ("recv_topk_weights", rw, out[2]), ("tokens_per_expert", rtpe, out[3])):
        if not _bits_equal(a, b):
            bad.append(name)
    g = torch.Generator().manual_seed(seed * 13 + 5)
    ys = [torch.randn(len(ref[d][4]), hidden, generator=g).to(dtype) for d in range(world)]
    want = reference_combine(ys, [ref[d][4] for d in range(world)], tokens)[rank]
    if not _bits_equal(want, t.combine(ys[rank], out[4])):
        bad.append("combine")
    xs2 = [torch.randn(tokens[r], hidden, generator=torch.Generator().manual_seed(seed * 17 + r)).to(dtype)
           for r in range(world)]
    want_c = (torch.stack([xs2[s][tk] for (s, tk) in sources]) if sources
              else torch.empty(0, hidden, dtype=dtype))
    if not _bits_equal(want_c, t.dispatch_cached(xs2[rank], out[4])):
        bad.append("dispatch_cached")
    # combine_topk_weights: slot k of token t gets the owner's row value
    gws = [torch.randn(len(ref[d][4]), topk, generator=torch.Generator().manual_seed(seed * 19 + d))
           for d in range(world)]
    want_w = torch.zeros(tokens[rank], topk)
    for d in range(world):
        for i, (s, tk) in enumerate(ref[d][4]):
            if s == rank:
                for k in range(topk):
                    if ref[d][1][i, k] >= 0:
                        want_w[tk, k] = gws[d][i, k]
    if not _bits_equal(want_w, t.combine_topk_weights(gws[rank], out[4])):
        bad.append("combine_topk_weights")
    return bad


def _random_rounds_rank(rank, world, configs, rounds, seed0):
    """configs: (num_experts, hidden, dtype name, options); each gets ``rounds`` random rounds."""
    from efa_ep.kernels import create_transport

    torch.set_num_threads(1)
    n_rounds, mismatches = 0, []
    for ci, (num_experts, hidden, dtype_name, opts) in enumerate(configs):
        dtype = getattr(torch, dtype_name)
        t = create_transport("proxy", None, num_experts, hidden, 48, dtype, **opts)
        for i in range(rounds):
            seed = seed0 + 1000 * ci + i
            g = torch.Generator().manual_seed(seed)
            topk = int(torch.randint(1, min(6, num_experts) + 1, (1,), generator=g))
            tokens = [int(v) for v in torch.randint(0, 49, (world,), generator=g)]
            if i % 5 == 0:
                tokens[i % world] = 0
            bad = _check_round(t, rank, world, num_experts, hidden, topk, dtype, tokens, seed)
            n_rounds += 1
            if bad:
                mismatches.append((ci, i, bad))
        t.close()
    return n_rounds, mismatches


def _run_random(world, configs, rounds, env=None, seed0=1):
    t0 = time.monotonic()
    out = run_ranks(_random_rounds_rank, world, (configs, rounds, seed0), timeout_s=600,
                    pg_timeout_s=120, env=env or LOOPBACK)
    for rank, (_, mism) in enumerate(out):
        assert not mism, f"rank {rank}: mismatches (config, round, outputs): {mism}"
    return out[0][0], time.monotonic() - t0


def test_top1_and_chunked_headers_bit_identical():
    """Top-1 routing where a rank receives 0 rows (combine_topk_weights used to fail there on a
    stride-(1, 0) empty tensor), and count headers cut into several chunks: L=32 local experts
    at chunk_bytes=256 and L=128 at chunk_bytes=1024; then a few random rounds (the fast
    subset's share of the randomized test)."""
    out = run_ranks(_top1_and_chunks_rank, 2, (), timeout_s=240, pg_timeout_s=60, env=LOOPBACK)
    for rank, (_, mism) in enumerate(out):
        assert not mism, f"rank {rank}: mismatches (config, round, outputs): {mism}"


def _top1_and_chunks_rank(rank, world):
    from efa_ep.kernels import create_transport

    torch.set_num_threads(1)
    # top-1, every token to rank 0's experts: rank 1 receives nothing
    t = create_transport("proxy", None, 4, 8, 16, torch.float32, provider="tcp", timeout_s=20)
    idx = torch.tensor([[0], [1], [0]], dtype=torch.int64)
    w = torch.rand(3, 1)
    out = t.dispatch(torch.randn(3, 8), idx, w)
    assert out[0].shape[0] == (6 if rank == 0 else 0)
    g = t.combine_topk_weights(torch.randn(out[0].shape[0], 1), out[4])
    assert g.shape == (3, 1)
    t.close()
    for num_experts, chunk in ((64, 256), (256, 1024)):
        t = create_transport("proxy", None, num_experts, 16, 32, torch.float32, provider="tcp",
                             timeout_s=20, chunk_bytes=chunk, num_channels=2)
        assert t.hdr_chunks > 1, (t.hdr_len, chunk)
        for i in range(3):
            tokens = [32, 7] if i != 1 else [0, 32]
            bad = _check_round(t, rank, world, num_experts, 16, 4 if i else 1, torch.float32, tokens, 40 + i)
            assert not bad, (num_experts, chunk, i, bad)
        t.close()
    return _random_rounds_rank(rank, world, RANDOM_CONFIGS_EP2, 3, 1)


RANDOM_CONFIGS_EP2 = [
    (8, 24, "float32", {"provider": "tcp", "num_channels": 2, "chunk_bytes": 256, "timeout_s": 30}),
    (12, 16, "bfloat16", {"provider": "tcp", "num_channels": 1, "timeout_s": 30, "inject_reorder": 1,
                          "chunk_bytes": 512})]


@pytest.mark.skipif(not FULL, reason="fast subset: a few random rounds run in the top-1 test")
def test_randomized_rounds_against_reference():
    """Random T (0 included), K (1..6), routes and dtypes; every output equals the reference."""
    total, elapsed = _run_random(2, RANDOM_CONFIGS_EP2, 60)
    figures = {"ep2_tcp": {"rounds": total, "mismatches": 0, "seconds": round(elapsed, 1)}}
    if FULL:
        for world, e in ((3, 12), (4, 16)):
            cfgs = [(e, 24, "float32", {"provider": "tcp", "num_channels": 4, "chunk_bytes": 256,
                                        "timeout_s": 60, "inject_reorder": 1}),
                    (e, 16, "bfloat16", {"provider": "tcp", "num_channels": 2, "timeout_s": 60})]
            n, s = _run_random(world, cfgs, 40, seed0=100 * world)
            figures[f"ep{world}_tcp"] = {"rounds": n, "mismatches": 0, "seconds": round(s, 1)}
        if proxy_mod.native.probe("shm") is None:
            cfgs = [(8, 24, "float32", {"provider": "shm", "num_channels": 3, "chunk_bytes": 256,
                                        "timeout_s": 30, "inject_reorder": 1})]
            n, s = _run_random(2, cfgs, 60, env=SHM_ENV, seed0=7)
            figures["ep2_shm"] = {"rounds": n, "mismatches": 0, "seconds": round(s, 1)}
    _record("random_rounds", figures)


# --------------------------------------------------------------------------------------------
# Bad input on one rank, for every argument of every operation
# --------------------------------------------------------------------------------------------
def _bad_cases(full):
    """(operation, argument named in the error, how rank 1 breaks it). The fast subset keeps what
    the contract suite (tests/contract/test_contract_cases.py, every transport) does not check
    with the same words: meta tensors, and the weight gradient named as proxy names it; an
    expert id out of range and combine rows of a wrong count run there (``expert_out_of_range``,
    ``combine_rows``) and here only in the full set."""
    cases = [
        ("dispatch", "x", "meta"),
        ("combine_topk_weights", "grad_recv_topk_weights", "wrong_k"),
        ("dispatch_cached", "x", "meta"),
    ]
    if full:
        cases += [
            ("dispatch", "topk_idx", "expert_id"), ("combine", "y", "rows"),
            ("dispatch", "x", "shape"), ("dispatch", "x", "dtype"), ("dispatch", "x", "too_many"),
            ("dispatch", "topk_idx", "dtype"), ("dispatch", "topk_idx", "meta"),
            ("dispatch", "topk_idx", "shape"), ("dispatch", "topk_weights", "nan"),
            ("dispatch", "topk_weights", "shape"), ("dispatch", "topk_weights", "meta"),
            ("dispatch", "topk_weights", "dtype"),
            ("combine", "y", "meta"), ("combine", "y", "int"), ("combine", "handle", "not_handle"),
            ("combine", "y", "not_tensor"),
            ("combine_topk_weights", "grad_recv_topk_weights", "meta"),
            ("combine_topk_weights", "grad_recv_topk_weights", "rows"),
            ("dispatch_cached", "x", "rows"), ("dispatch_cached", "x", "int"),
            ("dispatch_cached", "handle", "not_handle"),
        ]
    return cases


def _break(kind, t):
    """A broken version of tensor t (or a non-tensor)."""
    if kind == "meta":
        return t.to("meta")
    if kind == "rows":
        return t[:-1] if t.shape[0] else torch.zeros(3, *t.shape[1:], dtype=t.dtype)
    if kind == "wrong_k":
        return torch.zeros(t.shape[0], t.shape[1] + 1, dtype=t.dtype)
    if kind == "int":
        return t.to(torch.int32)
    if kind == "dtype":
        return t.to(torch.float64 if t.dtype != torch.float64 else torch.float32)
    if kind == "shape":
        return t[:, :-1]
    if kind == "nan":
        t = t.clone()
        t.view(-1)[0] = float("nan")
        return t
    if kind == "expert_id":
        t = t.clone()
        t[0, 0] = 99
        return t
    if kind == "too_many":
        return torch.zeros(100, t.shape[1], dtype=t.dtype)
    if kind in ("not_tensor", "not_handle"):
        return [1, 2, 3]
    raise ValueError(kind)


def _bad_input_rank(rank, world, cases):
    from efa_ep.kernels import DispatchInputError, create_transport

    torch.set_num_threads(1)
    t = create_transport("proxy", None, 8, 16, 16, torch.float32, provider="tcp", timeout_s=20)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 16, generator=g)
    idx = torch.tensor([[0, 5], [2, 7], [1, 3], [4, 6], [0, 1], [6, 7]], dtype=torch.int64)
    w = torch.rand(6, 2, generator=g)
    results = []
    for op, arg, kind in cases:
        out = t.dispatch(x, idx, w)
        args = {"x": x, "topk_idx": idx, "topk_weights": w, "y": out[0], "handle": out[4],
                "grad_recv_topk_weights": torch.randn(out[0].shape[0], 2, generator=g)}
        if rank == 1:
            args[arg] = _break(kind, args[arg]) if arg != "handle" else [1, 2, 3]
        fn = {"dispatch": lambda: t.dispatch(args["x"], args["topk_idx"], args["topk_weights"]),
              "combine": lambda: t.combine(args["y"], args["handle"]),
              "dispatch_cached": lambda: t.dispatch_cached(args["x"], args["handle"]),
              "combine_topk_weights": lambda: t.combine_topk_weights(args["grad_recv_topk_weights"],
                                                                     args["handle"])}[op]
        start = time.monotonic()
        try:
            fn()
            msg = "no error"
        except DispatchInputError as e:
            msg = str(e)
        results.append((msg, time.monotonic() - start))
    # still usable: a valid round after all of that
    out = t.dispatch(x, idx, w)
    y = t.combine(out[0], out[4])
    t.close()
    return results, y.shape[0]


def test_bad_input_on_one_rank_raises_the_same_error_everywhere():
    cases = _bad_cases(FULL)
    out = run_ranks(_bad_input_rank, 2, (cases,), timeout_s=300, pg_timeout_s=60, env=LOOPBACK)
    (res0, n0), (res1, n1) = out
    worst = 0.0
    for (op, arg, kind), (m0, s0), (m1, s1) in zip(cases, res0, res1):
        assert m0 == m1, f"{op} {arg} {kind}: ranks raise different errors:\n{m0}\n{m1}"
        assert "invalid input on rank(s) [1]" in m0 and "rank 1" in m0, (op, arg, kind, m0)
        named = {"handle": "handle", "grad_recv_topk_weights": "grad_recv_topk_weights"}.get(arg, arg)
        if kind != "too_many":
            assert named in m0, (op, arg, kind, m0)
        worst = max(worst, s0, s1)
    assert n0 == 6 and n1 == 6
    assert worst < 5, worst  # raised through the header exchange, not after a deadline
    _record("bad_input", {"cases": len(cases), "ranks": 2, "max_seconds_to_error": round(worst, 3)})


def _timeout_disagreement_rank(rank, world):
    """EFA_EP_PROXY_TIMEOUT_S differs across ranks: the settings resolve it into the options,
    and create_transport's one agreement check refuses them on every rank."""
    from efa_ep.dispatcher.settings import environment_options
    from efa_ep.kernels import TransportError, create_transport

    os.environ["EFA_EP_PROXY_TIMEOUT_S"] = "5" if rank == 0 else "7"
    try:
        opts = {**environment_options("proxy"), "provider": "tcp"}
        create_transport("proxy", None, 4, 8, 16, torch.float32, **opts).close()
        return "no error"
    except TransportError as e:
        return str(e)
    finally:
        os.environ.pop("EFA_EP_PROXY_TIMEOUT_S", None)




# --------------------------------------------------------------------------------------------
# Tampering, dead and never-arriving peers
# --------------------------------------------------------------------------------------------
# kind -> words the victim's (rank 0's) error must contain
TAMPER_EXPECT = {
    "ids": "local expert id 999",
    "rows": "rank 1 declares",
    "rows_consistent": "dispatch data says",
    "capacity": "capacity is 0..16",
    "chunks": "chunks",
    "expert_counts": "per-expert counts",
    "tag": "stale or replayed header",
    "msg": "stray or replayed write from rank 1",
    "replay": "stray or replayed write from rank 1",
    "gen": "generation",
    "offset": "rank 1",
    "mark": "chunk mark 255",
}
FAST_TAMPER = ("ids", "rows_consistent", "msg")


def _fault_rank(rank, world, kinds, timeout_s, path="host"):
    """For each tamper kind: rank 1 tampers, every rank runs one dispatch; returns per kind
    (error or 'no error', seconds to it, error of the call after it, whether a ProtocolError).
    ``path`` "device": the transport's CUDA-input path on CPU tensors (its kernels under the
    Triton interpreter, its rounds the native packed ones where no Python tampering runs);
    "copies": the host window reached only through copies of the stage, as a device window's
    rounds reach theirs (headers, footers and error texts read from the stage)."""
    import torch.distributed as dist

    from efa_ep.kernels import TransportError, create_transport
    from efa_ep.kernels.base import ProtocolError

    torch.set_num_threads(1)
    x = torch.randn(8, 16)
    idx = torch.tensor([[k % 8, (k + 3) % 8] for k in range(8)], dtype=torch.int64)
    w = torch.rand(8, 2)
    results = {}
    for kind in kinds:
        if rank == 1:
            os.environ["EFA_EP_PROXY_TAMPER"] = kind
        # rows_consistent: one chunk per plane, so extra rows change no chunk count
        chunk = 1 << 16 if kind == "rows_consistent" else 256
        t = create_transport("proxy", None, 8, 16, 16, torch.float32, provider="tcp",
                             timeout_s=timeout_s, num_channels=2, chunk_bytes=chunk)
        os.environ.pop("EFA_EP_PROXY_TAMPER", None)
        if path == "device":
            t.device_kernels, t.device_layout = "always", True
        elif path == "copies":
            t.wire.through_copies()
        start, protocol = time.monotonic(), False
        try:
            out = t.dispatch(x, idx, w)
            t.combine(out[0], out[4])
            msg = "no error"
        except TransportError as e:
            msg = str(e)
            protocol = isinstance(e, ProtocolError)
        took = time.monotonic() - start
        try:
            t.dispatch(x, idx, w)
            after = "no error"
        except TransportError as e:
            after = str(e)
        results[kind] = (msg, took, after, protocol)
        t.close(barrier=False)
        dist.barrier()  # both ranks are past this kind (the tamperer may have waited it out)
    return results


@pytest.mark.parametrize("path", ["host", "copies", pytest.param("device", marks=pytest.mark.slow)])
def test_tampering_is_detected_and_never_summed(path):
    """``device``: the victim runs the CUDA-input path's rounds (device layout, the packed
    native rounds) on CPU tensors, its kernels under the Triton interpreter. ``copies``: every
    rank's rounds reach the window only through the stage, as over a device window."""
    kinds = list(TAMPER_EXPECT) if FULL else list(FAST_TAMPER)
    env = dict(LOOPBACK)
    if path == "device":
        kinds = [k for k in kinds if k != "offset"]  # (the engine's fault: the same either way)
        kinds += [] if "mark" in kinds else ["mark"]
        env["TRITON_INTERPRET"] = "1"
    else:
        kinds = [k for k in kinds if k != "mark"]  # (only the packed rounds mark their chunks)
    if path == "copies" and not FULL:
        kinds += ["rows", "tag"]  # header checks read from the stage's copy of the headers
    out = run_ranks(_fault_rank, 2, (kinds, FAULT_TIMEOUT_S, path), timeout_s=400,
                    pg_timeout_s=120, env=env)
    victim = out[0]
    figures, failures = {}, []
    for kind in kinds:
        msg, took, after, protocol = victim[kind]
        figures[kind] = round(took, 3)
        if TAMPER_EXPECT[kind] not in msg:
            failures.append(f"{kind}: error {msg!r} lacks {TAMPER_EXPECT[kind]!r}")
        # data that fails validation is a ProtocolError, also when the engine rejects a write
        # ("offset": the provider refuses the write and drops the connection, so the victim sees
        # a failed transfer, a PeerFailure)
        if kind != "offset" and not protocol:
            failures.append(f"{kind}: not a ProtocolError: {msg!r}")
        # broken afterwards: the next call refuses with the original error
        if not ("broken" in after and msg[:60] in after):
            failures.append(f"{kind}: next call gave {after!r}")
        if took >= FAULT_TIMEOUT_S + 1:
            failures.append(f"{kind}: took {took:.2f}s")  # detected, not waited out
    assert not failures, "\n".join(failures)
    if path != "host":
        return
    _record("tamper", {"kinds": len(kinds), "seconds_to_error": figures,
                       "errors": {k: victim[k][0][:240] for k in kinds}})


def _dead_or_absent_rank(rank, world, mode, timeout_s):
    from efa_ep.kernels import TransportError, create_transport

    torch.set_num_threads(1)
    t = create_transport("proxy", None, 4, 8, 16, torch.float32, provider="tcp", num_channels=2,
                         timeout_s=timeout_s)
    idx = torch.tensor([[0, 3], [2, 1]], dtype=torch.int64)
    t.dispatch(torch.ones(2, 8), idx, torch.ones(2, 2))  # one good round first
    # ...finished on both ranks: rank 1 may finish receiving while rank 0 still waits for its
    # own writes' completions, and a death then would hit that round, not the next call
    torch.distributed.barrier()
    if rank == 1:
        if mode == "killed":
            os._exit(0)  # dies without closing anything
        time.sleep(timeout_s + 3)  # never arrives at the next call
        return "absent"
    time.sleep(0.3)
    start = time.monotonic()
    kinds = []
    try:
        t.dispatch(torch.ones(2, 8), idx, torch.ones(2, 2))
        msg = "no error"
    except TransportError as e:
        msg = str(e)
        kinds.append(_kinds(e))
    took = time.monotonic() - start
    try:
        t.combine(torch.ones(1, 8), None)
        after = "no error"
    except TransportError as e:
        after = str(e)
        kinds.append(_kinds(e))
    t.close()
    return msg, took, after, kinds


def _kinds(e):
    """The contract's error kinds ``e`` is an instance of (names, for the parent process)."""
    from efa_ep.kernels import base

    return [k for k in ("PeerFailure", "ProtocolError", "TransportBroken", "DispatchInputError")
            if isinstance(e, getattr(base, k))]


@pytest.mark.parametrize("mode", ["killed", pytest.param("absent", marks=pytest.mark.skipif(
    not FULL, reason="deadline case: EFA_EP_RELIABILITY_FULL=1"))])
def test_dead_or_absent_peer_is_named_and_breaks_the_transport(mode):
    out = run_ranks(_dead_or_absent_rank, 2, (mode, FAULT_TIMEOUT_S), timeout_s=90, pg_timeout_s=30,
                    env=LOOPBACK, raise_on_error=False)
    ok, val = out[0]
    assert ok, val
    msg, took, after, kinds = val
    assert "rank 1" in msg, msg
    assert "broken" in after and "rank 1" in after, after
    # the README's error kinds: a lost or late peer is a PeerFailure, then TransportBroken
    assert kinds == [["PeerFailure"], ["TransportBroken"]], (kinds, msg, after)
    if mode == "killed":
        assert took < 1.5, (took, msg)  # the provider's refusal, well before the deadline
    else:
        assert FAULT_TIMEOUT_S - 0.2 < took < FAULT_TIMEOUT_S + 2, (took, msg)
    _record(f"peer_{mode}", {"seconds_to_error": round(took, 3), "error": msg[:200]})


# --------------------------------------------------------------------------------------------
# The window: keys, interface, memory
# --------------------------------------------------------------------------------------------
def _window_rank(rank, world):
    from efa_ep.kernels import create_transport

    os.environ.pop("FI_TCP_IFACE", None)  # the transport must pick the group's interface itself
    t1 = create_transport("proxy", None, 4, 8, 16, torch.float32, provider="tcp", num_channels=2)
    t2 = create_transport("proxy", None, 4, 8, 16, torch.float32, provider="tcp", num_channels=2)
    keys = []
    addrs = []
    for t in (t1, t2):
        for c in range(t.num_channels):
            name, n, key, _ = t.engine.local_info(c)
            keys.append(key)
            family = struct.unpack("<H", name[:2])[0]
            addrs.append(socket.inet_ntoa(name[4:8]) if family == socket.AF_INET else f"family {family}")
    mem = t1.memory_report()
    x = torch.randn(4, 8)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], dtype=torch.int64)
    out = t1.dispatch(x, idx, torch.ones(4, 2))
    t1.close()
    t2.close()
    # a timeout_s that differs across ranks (env var, outside the options) is refused
    refused = _timeout_disagreement_rank(rank, world)
    return keys, addrs, mem, t1.bind_address, out[0].shape[0], refused


def test_window_keys_random_interface_bound_memory_reported_timeout_agreed():
    out = run_ranks(_window_rank, 2, (), timeout_s=120, pg_timeout_s=30,
                    env={"FI_PROVIDER": "tcp", "OMP_NUM_THREADS": "1"})
    all_keys = [k for keys, *_ in out for k in keys]
    assert len(set(all_keys)) == len(all_keys), all_keys  # random per transport and channel
    assert not any(0x5EED0000 <= k < 0x5EED0000 + 64 for k in all_keys), all_keys
    for keys, addrs, mem, bound, rows, refused in out:
        assert ("disagree" in refused and "'timeout_s': 5.0" in refused
                and "'timeout_s': 7.0" in refused), refused
        assert bound == "127.0.0.1", bound
        assert set(addrs) == {"127.0.0.1"}, addrs  # not the external interface
        assert mem["window"] > 0 and mem["num_channels"] == 2 and "per_channel" in mem, mem
        assert rows > 0
    _record("memory", out[0][2])
