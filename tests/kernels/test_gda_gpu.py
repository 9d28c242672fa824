"""GPU tests of the ``gda`` transport: W ranks as processes on one GPU (gloo group, torch symmetric
memory with overlapping devices allowed). Start the MPS daemon first, or the processes time-slice
the GPU and every flag round trip costs milliseconds.

Each rank runs the same inputs through ``gda`` (on the GPU) and ``torch`` (the reference, on CPU
tensors over gloo) and compares bit for bit: dispatch outputs, ``tokens_per_expert`` (CPU int64),
the handle's counts and row order, combine, ``dispatch_cached`` and ``combine_topk_weights``.
Skipped without a CUDA GPU.
"""
from __future__ import annotations

import time

import pytest
import torch

from efa_ep.distributed import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
T_MAX = 4096
NUM_EXPERTS = 256

# (route kind, tokens on rank 0 (other ranks get fewer), hidden, top-k)
CASES = [
    ("random", 0, 2048, 8),
    ("random", 1, 2048, 1),
    ("one_rank", 64, 2048, 2),
    ("dropped", 300, 2048, 4),
    ("hot_experts", 128, 7168, 8),
    ("random", 1000, 7168, 3),
    ("dropped", 777, 7168, 6),
    ("random", 4096, 2048, 8),
    ("hot_experts", 4096, 7168, 8),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size(), t.dtype))


def _same(a, b, what, case):
    a, b = _bits(a), _bits(b)
    if a.shape != b.shape or not torch.equal(a, b):
        bad = (a != b).sum().item() if a.shape == b.shape else "shape"
        raise AssertionError(f"{what} differs from torch for {case}: {tuple(a.shape)} vs "
                             f"{tuple(b.shape)}, mismatches {bad}")


def _equal_to_torch(rank, world, cases, options=None):
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    gdas, refs = {}, {}
    for h in sorted({c[2] for c in cases}):
        gdas[h] = create_transport("gda", None, NUM_EXPERTS, h, T_MAX, torch.bfloat16,
                                   **{"timeout_s": 60, **(options or {})})
        refs[h] = create_transport("torch", None, NUM_EXPERTS, h, T_MAX, torch.bfloat16)
    planned = [0]  # compact dispatches of repeated shapes that went to the C++ call
    window = str((options or {}).get("rows_in_window", 0))
    counting = window == "1" and options.get("fast_launch", 4) == 4
    compact = []  # per case: whether the dispatch stored its rows compact
    if counting:
        for tr in gdas.values():
            tr._phases.cpp = _Counting(tr._phases.cpp, planned)
    done = []
    for ci, (kind, t0, h, k) in enumerate(cases):
        case = (world, kind, t0, h, k, rank)
        t = t0 if rank == 0 else max(0, t0 - 37 * rank)
        g = torch.Generator().manual_seed(1000 * ci + rank)
        idx, w = contract_route(kind, t, NUM_EXPERTS, k, world, seed=77 * ci + rank)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        ref = refs[h].dispatch(x, idx, w)
        before = gdas[h].compact_dispatches
        got = gdas[h].dispatch(x.to(dev), idx.to(dev), w.to(dev))
        compact.append(gdas[h].compact_dispatches > before)
        assert compact[-1] == (window == "1") or window == "auto", case
        for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights"), got[:3], ref[:3]):
            _same(a, b, name, case)
        if got[0].numel():  # compact: read in place, no copy; else tensors of their own
            win = gdas[h]._buf.untyped_storage().data_ptr()
            assert (got[0].untyped_storage().data_ptr() == win) == compact[-1], case
            assert (got[2].untyped_storage().data_ptr() == win) == compact[-1], case
        assert got[3].device.type == "cpu" and got[3].dtype == torch.int64, got[3]
        _same(got[3], ref[3], "tokens_per_expert", case)
        hg, hr = got[4], ref[4]
        assert hg.num_send_per_rank == hr.num_send_per_rank, case
        assert hg.num_recv_per_rank == hr.num_recv_per_rank, case
        _same(hg.send_token_idx, hr.send_token_idx, "send_token_idx", case)
        n = hr.num_recv_tokens
        y = torch.randn(n, h, generator=g).to(torch.bfloat16)
        _same(gdas[h].combine(y.to(dev), hg), refs[h].combine(y, hr), "combine", case)
        x2 = torch.randn(t, h, generator=g).to(torch.bfloat16)
        _same(gdas[h].dispatch_cached(x2.to(dev), hg), refs[h].dispatch_cached(x2, hr),
              "dispatch_cached", case)
        gw = torch.randn(n, k, generator=g)
        _same(gdas[h].combine_topk_weights(gw.to(dev), hg), refs[h].combine_topk_weights(gw, hr),
              "combine_topk_weights", case)
        done.append(case)
    for tr in gdas.values():
        tr.check_errors()
        if (options or {}).get("fast_launch") == 4:  # the C++ dispatch ran, not the fallback
            assert tr.cpp_dispatch_off is None, tr.cpp_dispatch_off
        # bound programs go to the GPU as CUDA graphs (memset steps as memset nodes: the layout
        # of a large batch), unless told not to: none refused (graph mode <= 0), and graphs were
        # made. A program bound but never run by the library has none yet, which timing decides
        # (a late peer or counts that need the transport's checks: the early gather falls back)
        progs = {key: p for key, p in tr._phases._progs.items() if p is not None}
        assert progs
        if (options or {}).get("graph_launch", 1):
            assert all(p._desc.graph_mode > 0 for p in progs.values()), \
                [(key, p._desc.graph_mode) for key, p in progs.items() if p._desc.graph_mode <= 0]
            assert any(p.graphed for p in progs.values()), list(progs)
        else:
            assert not any(p.graphed for p in progs.values()), \
                [key for key, p in progs.items() if p.graphed]
        if (options or {}).get("gather_early") == 2:  # the header and gather ran as one graph
            assert any(key[0] == "header_gather" and p.graphed for key, p in progs.items()), \
                list(progs)
    if counting:
        assert planned[0] > 0, "no compact dispatch went to its C++ call"
    dist.barrier()
    return compact if window == "auto" else len(done)


class _Counting:
    """The C++ extension of a transport, counting its compact dispatch calls."""

    def __init__(self, mod, calls):
        self._mod, self._calls = mod, calls

    def __getattr__(self, name):
        return getattr(self._mod, name)

    def dispatch_compact(self, *args):
        res = self._mod.dispatch_compact(*args)
        self._calls[0] += res[0] != 100  # (100: not the plan's case, nothing ran)
        return res


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gda_bit_identical_to_torch(world):
    t0 = time.time()
    counts = run_ranks(_equal_to_torch, world, (CASES,), timeout_s=240, pg_timeout_s=200, env=ENV)
    assert counts == [len(CASES)] * world
    print(f"world={world}: {len(CASES)} cases bit-identical in {time.time() - t0:.1f}s")


# Shapes seen again take the planned path (outputs allocated ahead at the rows the shape's recent
# calls received; with fast_launch=4 the whole dispatch in one C++ call; the 2048-token case's
# outputs, above 16 MiB, are allocated after its count read instead). Each repeat draws new
# routes, so a later call receives more or fewer rows than allocated.
REPEATED = [("random", 128, 7168, 8), ("hot_experts", 128, 7168, 8), ("random", 1, 2048, 1),
            ("dropped", 300, 2048, 4), ("random", 2048, 7168, 8)] * 4


@pytest.mark.parametrize("options", [{"fast_launch": 3}, {"fast_launch": 4},
                                     {"fast_launch": 4, "graph_launch": 0},
                                     {"fast_launch": 4, "gather_early": 2}],
                         ids=["fast3", "fast4", "fast4-no-graphs", "fast4-header-gather"])
def test_gda_repeated_shapes_bit_identical_to_torch(options):
    counts = run_ranks(_equal_to_torch, 2, (REPEATED, options),
                       timeout_s=240, pg_timeout_s=200, env=ENV)
    assert counts == [len(REPEATED)] * 2


@pytest.mark.parametrize("world", [2, 4])
def test_gda_rows_in_window_bit_identical_to_torch(world):
    """Option rows_in_window: the count exchange, the compact stores and the rows read in the
    window give torch's rows, counts and handle (first calls launched from Python, repeats
    through bound programs; one shape 8 times in a row: its C++ calls from the second on copy
    the received ids into the room after their scratch)."""
    cases = CASES + REPEATED[:12] + [("random", 512, 7168, 8)] * 8
    counts = run_ranks(_equal_to_torch, world, (cases, {"rows_in_window": 1}), timeout_s=240,
                       pg_timeout_s=200, env=ENV)
    assert counts == [len(cases)] * world


# one width (one transport): large and small batches in turn, shapes repeated (C++ calls)
AUTO_CASES = [("random", 1000, 7168, 3), ("hot_experts", 128, 7168, 8),
              ("random", 4096, 7168, 8), ("random", 4096, 7168, 8), ("random", 4096, 7168, 8),
              ("dropped", 777, 7168, 6), ("random", 1, 7168, 1), ("hot_experts", 4096, 7168, 8),
              ("random", 0, 7168, 8), ("hot_experts", 128, 7168, 8), ("hot_experts", 128, 7168, 8)]
AUTO_BYTES = 16 << 20


@pytest.mark.parametrize("world", [2, 4])
def test_gda_rows_in_window_auto_switches_per_call_bit_identical(world):
    """Option rows_in_window=auto: a dispatch stores its rows compact exactly when the previous
    dispatch's largest input over the ranks (rank 0's here), as rows to send times the row
    bytes, reached rows_in_window_bytes, on every rank alike; every call, either way and across
    the switches, gives torch's outputs (combine, cached dispatch and weight combine on its
    handle included), the compact ones as views of the window, the others as copies."""
    compact = run_ranks(_equal_to_torch, world,
                        (AUTO_CASES, {"rows_in_window": "auto",
                                      "rows_in_window_bytes": AUTO_BYTES}),
                        timeout_s=240, pg_timeout_s=200, env=ENV)
    row_bytes = 7168 * 2
    want = [False] + [c[1] * min(world, c[3]) * row_bytes >= AUTO_BYTES for c in AUTO_CASES[:-1]]
    assert compact == [want] * world, (compact, want)
    assert any(want) and not all(want)


def _peer_never_arrives(rank, world):
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.base import DispatchInputError, TransportError
    from efa_ep.kernels.gda import PeerTimeoutError

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    tr = create_transport("gda", None, 12, 64, 16, torch.bfloat16, timeout_s=2)
    x = torch.randn(4, 64, device=dev).to(torch.bfloat16)
    idx = torch.tensor([[0, 5], [1, 2], [7, -1], [3, 4]], device=dev)
    w = torch.ones(4, 2, device=dev)
    # 1. a bad expert id on the last rank raises on every rank (no one waits for a deadline)
    bad = idx.clone()
    if rank == world - 1:
        bad[0, 0] = 99
    try:
        tr.dispatch(x, bad, w)
        raise AssertionError("expected DispatchInputError")
    except DispatchInputError as e:
        msg_bad = str(e)
    dist.barrier()
    # 2. the last rank skips a dispatch: the others raise a deadline error naming it
    out = {"bad_input": msg_bad}
    if rank == world - 1:
        time.sleep(6)
    else:
        t0 = time.time()
        try:
            tr.dispatch(x, idx, w)
            raise AssertionError("expected PeerTimeoutError")
        except PeerTimeoutError as e:
            out["timeout"] = str(e)
            out["seconds"] = time.time() - t0
        try:
            tr.dispatch(x, idx, w)
        except TransportError as e:
            out["after"] = str(e)
    dist.barrier()
    return out


def test_gda_deadline_names_missing_rank():
    world = 3
    outs = run_ranks(_peer_never_arrives, world, (), timeout_s=90, pg_timeout_s=60, env=ENV)
    # every rank raises the offending rank's own words (the launch gate's board carries them)
    assert len({o["bad_input"] for o in outs}) == 1, outs
    assert "rank 2: topk_idx holds expert id 99" in outs[0]["bad_input"], outs
    for r in range(world - 1):
        assert f"invalid input on rank(s) [{world - 1}]" in outs[r]["bad_input"], outs[r]
        assert f"source rank(s) [{world - 1}]" in outs[r]["timeout"], outs[r]
        assert 1.5 < outs[r]["seconds"] < 30, outs[r]
        assert "unusable" in outs[r]["after"], outs[r]


def _combine_peer_missing(rank, world, gate):
    """Rank world-1 dispatches but never issues the combine. Returns what each other rank saw."""
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.base import TransportError
    from efa_ep.kernels.gda import PeerTimeoutError

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    tr = create_transport("gda", None, 16, 64, 16, torch.float32, timeout_s=2, launch_gate=gate)
    x = torch.randn(6, 64, device=dev)
    idx = torch.tensor([[0, 5], [1, 12], [7, -1], [3, 4], [15, 8], [9, 2]], device=dev)
    w = torch.ones(6, 2, device=dev)
    recv_x, _, _, _, handle = tr.dispatch(x, idx, w)
    out = {}
    if rank == world - 1:
        time.sleep(7)  # no device call: the others' waits must expire / gate must fire
    else:
        t0 = time.time()
        try:
            y = tr.combine(recv_x, handle)
            out["nan_rows"] = int(torch.isnan(y).all(dim=1).sum())  # syncs on the stream
            out["rows"] = y.shape[0]
            tr.check_errors()
            raise AssertionError("expected PeerTimeoutError")
        except PeerTimeoutError as e:
            out["error"] = str(e)
            out["seconds"] = time.time() - t0
        try:
            tr.dispatch(x, idx, w)
        except TransportError as e:
            out["after"] = str(e)
    dist.barrier()
    return out


@pytest.mark.parametrize("gate", ["off", "on"])
def test_gda_missing_peer_poisons_and_names_the_op(gate):
    """EP 4 on one GPU: a peer that never issues its combine. Without the launch gate the
    device waits expire: every row of the combine is NaN and the error names the op number, its
    kind, the waiting rank and the missing rank. With the gate the host raises the same facts
    before launching any wait. Both within the deadline, then the transport refuses calls."""
    world = 4
    outs = run_ranks(_combine_peer_missing, world, (gate,), timeout_s=120, pg_timeout_s=60,
                     env=ENV)
    for r in range(world - 1):
        o = outs[r]
        assert f"rank {r}: gda combine (op 2)" in o["error"], o
        assert f"source rank(s) [{world - 1}]" in o["error"], o
        assert 1.5 < o["seconds"] < 15, o
        assert "unusable" in o["after"], o
        if gate == "off":
            assert o["nan_rows"] == o["rows"] > 0, o


def _fixed_equals_regular(rank, world, cases):
    """dispatch_fixed's window rows (compacted by the device counts) equal the regular
    dispatch; unused rows are masked; combine, cached dispatch and weight combine through the
    fixed handle equal the regular ones bit for bit; no host sync is needed for any of it."""
    import torch.distributed as dist
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    trs = {h: create_transport("gda", None, NUM_EXPERTS, h, T_MAX, torch.bfloat16, timeout_s=60)
           for h in sorted({c[2] for c in cases})}
    for ci, (kind, t0, h, k) in enumerate(cases):
        case = (world, kind, t0, h, k, rank)
        tr = trs[h]
        t = t0 if rank == 0 else max(0, t0 - 37 * rank)
        g = torch.Generator().manual_seed(1000 * ci + rank)
        idx, w = contract_route(kind, t, NUM_EXPERTS, k, world, seed=77 * ci + rank)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
        idx, w = idx.to(dev), w.to(dev)
        rx, ri, rw, tpe, hr = tr.dispatch(x, idx, w)
        fx, fi, fw, num_recv, ftpe, hf = tr.dispatch_fixed(x, idx, w)
        n = num_recv.tolist()
        assert n == list(hr.num_recv_per_rank), (case, n, hr.num_recv_per_rank)
        used = torch.cat([torch.arange(s * T_MAX, s * T_MAX + n[s], device=dev)
                          for s in range(world)])
        _same(fx[used], rx, "fixed recv_x", case)
        _same(fi[used], ri, "fixed recv_topk_idx", case)
        _same(fw[used], rw, "fixed recv_topk_weights", case)
        _same(ftpe.cpu(), tpe, "fixed tokens_per_expert", case)
        unused = torch.ones(world * T_MAX, dtype=torch.bool, device=dev)
        unused[used] = False
        assert bool((fi[unused] == -1).all()) and bool((fw[unused] == 0).all()), case
        y = torch.randn(rx.shape[0], h, generator=g).to(torch.bfloat16).to(dev)
        yf = torch.zeros(world * T_MAX, h, dtype=torch.bfloat16, device=dev)
        yf[used] = y
        want = tr.combine(y, hr)
        _same(tr.combine(yf, hf), want, "fixed combine", case)
        x2 = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
        want = tr.dispatch_cached(x2, hr)
        _same(tr.dispatch_cached(x2, hf)[used], want, "fixed dispatch_cached", case)
        gw = torch.randn(rx.shape[0], k, generator=g).to(dev)
        gwf = torch.zeros(world * T_MAX, k, device=dev)
        gwf[used] = gw
        rxf, rif, rwf, _, _, hf2 = tr.dispatch_fixed(x, idx, w)  # fresh ids for the weights
        _same(tr.combine_topk_weights(gwf, hf2), tr.combine_topk_weights(gw, hr),
              "fixed combine_topk_weights", case)
    for tr in trs.values():
        tr.check_errors()
    dist.barrier()
    return len(cases)


@pytest.mark.parametrize("world", [2, 4])
def test_gda_fixed_capacity_equals_regular(world):
    counts = run_ranks(_fixed_equals_regular, world, (CASES,), timeout_s=240, pg_timeout_s=200,
                       env=ENV)
    assert counts == [len(CASES)] * world


def _graph_replays_equal_eager(rank, world):
    """A captured fixed-capacity sequence (dispatch_fixed, an expert stand-in, combine,
    dispatch_cached: three ops, padded to four by a barrier op) replayed with new inputs
    written in place equals the regular eager path bit for bit, with eager calls of the same
    transport between replays (the device op counter and the host's stay in step)."""
    from efa_ep.kernels import create_transport
    from efa_ep.testing.routes import contract_route

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    h, k = 2048, 4
    t = 300 - 37 * rank
    tr = create_transport("gda", None, NUM_EXPERTS, h, T_MAX, torch.bfloat16, timeout_s=60)
    xs = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    x2s = torch.empty_like(xs)
    idxs = torch.empty(t, k, dtype=torch.int64, device=dev)
    ws = torch.empty(t, k, dtype=torch.float32, device=dev)

    def fill(i):
        g = torch.Generator().manual_seed(500 * i + rank)
        kind = ("random", "hot_experts", "dropped", "one_rank")[i % 4]
        idx, w = contract_route(kind, t, NUM_EXPERTS, k, world, seed=31 * i + rank)
        idxs.copy_(idx)
        ws.copy_(w)
        xs.copy_(torch.randn(t, h, generator=g).to(torch.bfloat16))
        x2s.copy_(torch.randn(t, h, generator=g).to(torch.bfloat16))

    def step():
        rx, _, _, num_recv, tpe, hf = tr.dispatch_fixed(xs, idxs, ws)
        out = tr.combine((rx.float() * 1.5).to(torch.bfloat16), hf)
        cached = tr.dispatch_cached(x2s, hf)
        return out, cached.clone(), num_recv.clone(), tpe.clone()

    fill(0)
    graph = tr.capture(step, warmup=1)
    assert graph.num_ops == 4, graph.num_ops
    for i in range(6):
        case = (world, rank, i)
        fill(i)
        graph.replay()
        out, cached, num_recv, tpe = graph.outputs
        rx, _, _, tpe_ref, hr = tr.dispatch(xs, idxs, ws)
        _same(out, tr.combine((rx.float() * 1.5).to(torch.bfloat16), hr), "graph combine", case)
        n = num_recv.tolist()
        assert n == list(hr.num_recv_per_rank), (case, n, hr.num_recv_per_rank)
        used = torch.cat([torch.arange(s * T_MAX, s * T_MAX + n[s], device=dev)
                          for s in range(world)])
        _same(cached[used], tr.dispatch_cached(x2s, hr), "graph dispatch_cached", case)
        _same(tpe.cpu(), tpe_ref, "graph tokens_per_expert", case)
    tr.check_errors()
    return graph.num_ops


@pytest.mark.parametrize("world", [2, 4])
def test_gda_graph_replay_equals_eager(world):
    ops = run_ranks(_graph_replays_equal_eager, world, (), timeout_s=240, pg_timeout_s=200,
                    env=ENV)
    assert ops == [4] * world
