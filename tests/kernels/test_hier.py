"""The ``hier`` transport (local stage inside emulated nodes, network stage across them) against
the brute-force contract reference and the ``torch`` transport, on CPU: ranks are gloo
processes, nodes are emulated with ``node_size``; the network stage runs ``proxy`` over tcp on
loopback (EP 4) or ``torch`` (EP 8, to keep CI short), with ``aggregate=1`` (once per node) and
``aggregate=0`` (once per destination rank). Dispatch, cached dispatch and the weight combine
must be bit-identical; combine bit-identical when every token has at most two destination
ranks or all of them on one node, else equal to rounding (sums grouped). The network counts
(``last_op_counts``) must equal a brute-force count from the routes, and with a proxy network
the writes it reports must equal the native engine's own counter.

Bad input on one rank and a peer that exits: the contract suite (tests/contract, hier as 2 nodes
with a proxy network). hier meets both in its own status exchange over the whole group, which
runs under the stages (a rank with bad input calls them with no rows, or with no handle: the
stages refuse it on their groups), so every rank raises the exchange's error. On the GPU the
worker below also checks that with gda as the local stage."""
import time

import pytest
import torch

from efa_ep.distributed import RankFailure, run_ranks
from efa_ep.testing.routes import contract_route

# one_node: every token's experts on one node (a different node per token), over several ranks
KINDS = ("random", "hot_experts", "one_rank", "dropped", "one_node")
ENV = {"FI_TCP_IFACE": "lo"}


def _tokens(rank, case):
    return 0 if (rank == 1 and case % 3 == 1) else 2 + 3 * rank + 2 * case


def _expected_counts(data, rank, world, node_size, experts, aggregate, row_bytes):
    """Brute force from every rank's route: (dispatch messages, rows, bytes) this rank sends
    across nodes, and the rows it sends back across nodes in combine."""
    n_nodes = world // node_size
    per_rank = experts // world
    node = rank // node_size

    def dests(idx):  # [T, W] bool: token t has an expert on rank r
        out = torch.zeros(idx.shape[0], world, dtype=torch.bool)
        for j in range(idx.shape[1]):
            ok = idx[:, j] >= 0
            out[ok.nonzero().flatten(), idx[ok, j] // per_rank] = True
        return out

    if aggregate or n_nodes == 1:  # rail peers: same local index on other nodes
        def sends(src):
            d = dests(data[src][1]).view(-1, n_nodes, node_size).any(2)
            return [int(d[:, m].sum()) for m in range(n_nodes) if m != src // node_size]
        back = [sends(rank % node_size + m * node_size)[node - (node > m)]
                for m in range(n_nodes) if m != node]
    else:
        def sends(src):
            d = dests(data[src][1])
            return [int(d[:, r].sum()) for r in range(world) if r // node_size != src // node_size]
        back = [int(dests(data[s][1])[:, rank].sum()) for s in range(world)
                if s // node_size != node]
    out = sends(rank)
    return (sum(1 for v in out if v), sum(out), sum(out) * row_bytes), sum(back)


def _hier_worker(rank, world, node_size, network, experts, hidden, topks, dtype_name, aggregate):
    from efa_ep.kernels import create_transport
    from efa_ep.testing.reference import reference_combine, reference_dispatch

    dtype = getattr(torch, dtype_name)
    opts = dict(node_size=node_size, network=network, aggregate=aggregate)
    if network == "proxy":
        opts.update(provider="tcp", num_channels=2, timeout_s=30)
    t = create_transport("hier", None, experts, hidden, 64, dtype, **opts)
    assert t.name == "hier" and t.num_nodes == world // node_size and t.aggregate == aggregate
    assert t.stage_names == (network if world > node_size else "torch", "torch")
    checked = 0
    for case, (kind, k) in enumerate([(kind, k) for kind in KINDS for k in topks]):
        data = []
        for r in range(world):
            n = _tokens(r, case)
            idx, w = contract_route(kind, n, experts, k, world, seed=1000 * case + r,
                                    node_size=node_size)
            g = torch.Generator().manual_seed(case * 31 + r)
            data.append((torch.randn(n, hidden, generator=g).to(dtype), idx, w))
        x, idx, w = data[rank]
        rx, ri, rw, tpe, handle = t.dispatch(x, idx, w)
        row_bytes = hidden * x.element_size()
        want_d, want_back = _expected_counts(data, rank, world, node_size, experts, aggregate,
                                             row_bytes)
        got_d = t.last_op_counts["dispatch"]
        assert (got_d.messages, got_d.rows, got_d.bytes) == want_d, (kind, k, got_d, want_d)
        assert (got_d.writes is None) == (network != "proxy" or world == node_size), got_d
        ref = reference_dispatch(*zip(*data), num_experts=experts)
        exp_x, exp_i, exp_w, exp_c, sources = ref[rank]
        assert torch.equal(rx, exp_x), (kind, k, rank)
        assert torch.equal(ri, exp_i), (kind, k)
        assert torch.equal(rw, exp_w), (kind, k)
        assert torch.equal(tpe, exp_c), (kind, k)
        assert handle.num_recv_per_rank == tuple(
            sum(1 for s, _ in sources if s == src) for src in range(world)), (kind, k)
        ys = [torch.randn(ref[d][0].shape[0], hidden,
                          generator=torch.Generator().manual_seed(9 + d + case)).to(dtype)
              for d in range(world)]
        out = t.combine(ys[rank], handle)
        got_c = t.last_op_counts["combine"]
        assert (got_c.rows, got_c.bytes) == (want_back, want_back * row_bytes), (kind, k, got_c)
        exp_out = reference_combine(ys, [ref[d][4] for d in range(world)],
                                    [d[0].shape[0] for d in data])[rank]
        if k <= 2 or kind in ("one_node", "one_rank"):
            assert torch.equal(out, exp_out), (kind, k, (out - exp_out).abs().max())
        else:
            tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(out.float(), exp_out.float(), **tol)
        assert torch.equal(t.dispatch_cached(x, handle), rx)
        x32s = [torch.randn(d[0].shape[0], 3, generator=torch.Generator().manual_seed(case + r))
                for r, d in enumerate(data)]
        got32 = t.dispatch_cached(x32s[rank], handle)
        want32 = (torch.stack([x32s[s][tk] for s, tk in sources]) if sources
                  else torch.empty(0, 3))
        assert torch.equal(got32, want32), (kind, k)
        back = t.combine_topk_weights(rw, handle)
        assert torch.equal(back, w), (kind, k)
        checked += 1
    if network == "proxy" and world > node_size:
        # every write the counts name was posted by the native engine, and nothing else
        # (its counter also has the warm-up round: one 16-byte write per channel and peer)
        net = t.network
        net.wire.quiesce()
        posted = sum(c["posted"] for c in net.stats())
        warm = net.num_channels * (net.world_size - 1)
        assert posted == net.wire.posted["writes"], (posted, net.wire.posted)
        ops = t.op_totals()
        assert sum(v["writes"] for v in ops.values()) + warm == posted, (ops, posted, warm)
        assert ops["dispatch"]["calls"] == checked and ops["dispatch_cached"]["calls"] == 2 * checked
    t.close()
    return checked


@pytest.mark.parametrize("aggregate", [1, 0])
@pytest.mark.parametrize("world,node_size,network,topks,dtype", [
    (4, 2, "proxy", (1, 2, 8), "float32"),
    # EP 8: the long randomized sets (`pytest -m slow`, CI's second step)
    pytest.param(8, 4, "torch", (2, 4), "bfloat16", marks=pytest.mark.slow),
    pytest.param(8, 2, "torch", (1, 8), "float32", marks=pytest.mark.slow),
    (4, 4, "torch", (2,), "float32"),
])
def test_hier_matches_reference(world, node_size, network, topks, dtype, aggregate):
    counts = run_ranks(_hier_worker, world, (node_size, network, 32, 8, topks, dtype, aggregate),
                       timeout_s=300, env=ENV)
    assert counts == [len(KINDS) * len(topks)] * world


def _fewer_ops_worker(rank, world, node_size, network):
    """The same route through aggregate=1 and aggregate=0: every token has experts on several
    ranks of one remote node (and none elsewhere)."""
    from efa_ep.kernels import create_transport

    experts, hidden, k = 32, 8, 4
    n_nodes, per_rank = world // node_size, experts // world
    node = rank // node_size
    far = (node + 1) % n_nodes
    t_tok = 6 + rank
    # expert j of the far node's rank j % node_size: k experts over min(k, G) ranks of it
    first = far * node_size * per_rank
    idx = torch.tensor([[first + (j % node_size) * per_rank + (j // node_size) % per_rank
                         for j in range(k)]] * t_tok)
    w = torch.rand(t_tok, k, generator=torch.Generator().manual_seed(rank))
    x = torch.randn(t_tok, hidden, generator=torch.Generator().manual_seed(7 + rank))
    got = {}
    opts = dict(provider="tcp", num_channels=1, timeout_s=30) if network == "proxy" else {}
    for agg in (1, 0):
        t = create_transport("hier", None, experts, hidden, 16, torch.float32, node_size=node_size,
                             network=network, aggregate=agg, **opts)
        rx, _, _, _, h = t.dispatch(x, idx, w)
        out = t.combine(rx, h)
        got[agg] = {op: t.last_op_counts[op].as_dict() for op in ("dispatch", "combine")}
        got[agg]["out"] = out
        t.close()
    assert torch.equal(got[0].pop("out"), got[1].pop("out"))  # one remote node: exact in both
    return got


@pytest.mark.parametrize("world,node_size,network", [
    (4, 2, "proxy"), pytest.param(8, 4, "torch", marks=pytest.mark.slow)])
def test_aggregation_sends_fewer_network_ops(world, node_size, network):
    res = run_ranks(_fewer_ops_worker, world, (node_size, network), timeout_s=300, env=ENV)
    for rank, got in enumerate(res):
        for op in ("dispatch", "combine"):
            a1, a0 = got[1][op], got[0][op]
            # one message to the rail peer vs one per destination rank of the far node
            assert a1["messages"] == 1 and a0["messages"] == min(4, node_size), (rank, op, a1, a0)
            assert a1["rows"] == 6 + rank if op == "dispatch" else a1["rows"] > 0
            assert a0["rows"] == a0["messages"] * a1["rows"] if op == "dispatch" else True
            for key in ("messages", "rows", "bytes"):
                assert a1[key] < a0[key], (rank, op, key, a1, a0)
            if network == "proxy":
                assert a1["writes"] < a0["writes"] and a1["wire_bytes"] < a0["wire_bytes"], (a1, a0)
            else:
                assert a1["writes"] is None and a0["writes"] is None


def _bad_option_worker(rank, world, key, value):
    from efa_ep.kernels import create_transport

    try:
        create_transport("hier", None, 8, 4, 16, torch.float32,
                         **{"node_size": 2, "network": "torch", key: value})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("key,value,expect", [
    ("aggregate", 2, "aggregate=2 is not one of 0, 1"),
    ("aggregate", "yes", "aggregate='yes' is not an integer"),
    ("network", "nccl", "network='nccl' is not one of proxy, torch"),
    ("node_size", 0, "node_size=0 must be >= 1"),
])
def test_hier_bad_option_is_one_line(key, value, expect):
    msgs = run_ranks(_bad_option_worker, 2, (key, value), timeout_s=120)
    for m in msgs:
        assert m.startswith("TransportError") and expect in m and "\n" not in m, m


def test_hier_schema_refuses_bad_aggregate_in_the_launcher():
    from efa_ep.kernels.options import ConfigError, validate_options

    assert validate_options("hier", {"aggregate": "0"}, where="X") == {"aggregate": 0}
    with pytest.raises(ConfigError, match=r"X: aggregate='2' is not one of 0, 1"):
        validate_options("hier", {"aggregate": "2"}, where="X")
    with pytest.raises(ConfigError, match="did you mean 'aggregate'"):
        validate_options("hier", {"agregate": "1"}, where="X")


def _layout_worker(rank, world):
    from efa_ep.kernels import create_transport

    create_transport("hier", None, 8, 4, 16, torch.float32, node_size=3, network="torch")


def test_hier_refuses_a_node_size_that_does_not_divide():
    with pytest.raises(RankFailure, match="node_size=3 must divide the EP group size 4"):
        run_ranks(_layout_worker, 4, (), timeout_s=60)


def _hier_gpu_worker(rank, world, node_size, topks, network, aggregate):
    """Ranks as processes on the GPU(s): local stage gda (NVLink stores / shared GPU), network
    stage ``network`` (proxy over shm with host staging, or torch), ``aggregate`` 1 or 0;
    compared with the reference bit for bit."""
    from efa_ep.kernels import create_transport
    from efa_ep.testing.reference import reference_combine, reference_dispatch

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    experts, hidden = 64, 256
    opts = dict(provider="shm", num_channels=2, timeout_s=60) if network == "proxy" else {}
    t = create_transport("hier", None, experts, hidden, 256, torch.bfloat16, node_size=node_size,
                         network=network, aggregate=aggregate, **opts)
    assert t.stage_names == (network, "gda"), t.stage_names
    checked = 0
    for case, (kind, k) in enumerate([(kind, k) for kind in KINDS for k in topks]):
        data = []
        for r in range(world):
            n = 17 * (r + 1) + case
            idx, w = contract_route(kind, n, experts, k, world, seed=1000 * case + r,
                                    node_size=node_size)
            g = torch.Generator().manual_seed(case * 31 + r)
            data.append((torch.randn(n, hidden, generator=g).to(torch.bfloat16), idx, w))
        x, idx, w = data[rank]
        rx, ri, rw, tpe, handle = t.dispatch(x.to(dev), idx.to(dev), w.to(dev))
        ref = reference_dispatch(*zip(*data), num_experts=experts)
        exp_x, exp_i, exp_w, exp_c, _ = ref[rank]
        assert torch.equal(rx.cpu(), exp_x) and torch.equal(ri.cpu(), exp_i), (kind, k)
        assert torch.equal(rw.cpu(), exp_w) and torch.equal(tpe.cpu(), exp_c), (kind, k)
        ys = [torch.randn(ref[d][0].shape[0], hidden,
                          generator=torch.Generator().manual_seed(9 + d + case)).to(torch.bfloat16)
              for d in range(world)]
        out = t.combine(ys[rank].to(dev), handle).cpu()
        exp_out = reference_combine(ys, [ref[d][4] for d in range(world)],
                                    [d[0].shape[0] for d in data])[rank]
        if k <= 2 or kind in ("one_node", "one_rank"):
            assert torch.equal(out, exp_out), (kind, k)
        else:
            torch.testing.assert_close(out.float(), exp_out.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(t.combine_topk_weights(rw, handle).cpu(), w), (kind, k)
        assert torch.equal(t.dispatch_cached(x.to(dev), handle).cpu(), exp_x), (kind, k)
        checked += 1
    # Bad input on rank 1 along a handle (rows of the wrong shape, a foreign handle): every rank
    # raises the group's error naming it (the stages refuse a call without handle, no rank waits
    # out a deadline), and the handle still works after.
    from efa_ep.kernels.base import DispatchInputError

    y, xd = ys[rank].to(dev), x.to(dev)
    for call in (lambda: t.combine(y.view(-1) if rank == 1 else y, handle),
                 lambda: t.dispatch_cached(xd, "not a handle" if rank == 1 else handle),
                 lambda: t.combine_topk_weights(rw[:, :1] if rank == 1 else rw, handle)):
        t0 = time.time()
        with pytest.raises(DispatchInputError, match=r"invalid input on rank\(s\) \[1\]"):
            call()
        assert time.time() - t0 < 30, "waited out a deadline instead of refusing"
    assert torch.equal(t.dispatch_cached(xd, handle).cpu(), exp_x)
    t.close()
    return checked


def _network_param(name):
    from efa_ep.kernels import transport_status

    why = transport_status().get(name) if name == "proxy" else None
    return pytest.param(name, marks=pytest.mark.skipif(why is not None, reason=str(why)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("aggregate", [1, 0])
@pytest.mark.parametrize("network", [_network_param("torch"), _network_param("proxy")])
def test_hier_gpu_gda_local(network, aggregate):
    """EP 4 as 2 emulated nodes x 2 ranks on the GPU (MPS when they share one)."""
    counts = run_ranks(_hier_gpu_worker, 4, (2, (2, 8), network, aggregate), timeout_s=300,
                       env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "FI_TCP_IFACE": "lo"})
    assert counts == [len(KINDS) * 2] * 4


def test_auto_choice_uses_hier_across_hosts_and_the_calibration_for_k():
    import os

    from efa_ep.dispatcher.transport_cache import channels_from_calibration
    from efa_ep.kernels import auto_choice, resolve_transport_name

    cal = channels_from_calibration(os.path.join(
        os.path.dirname(__file__), "..", "..", "results", "plan", "calibration.json"))
    name, opts, why = auto_choice(16, 8, {}, cal)
    assert name == "hier" and 1 <= opts["num_channels"] <= 8, (opts, why)
    assert "from the calibration" in why and "calibration.json" in why
    assert auto_choice(16, 8, {"num_channels": 3}, cal)[1] == {"num_channels": 3}  # user wins
    assert auto_choice(16, 8, {}, None) == ("hier", {}, "EP group spans 2 hosts: hier")
    one = auto_choice(8, 8, {}, cal)
    assert one[0] == resolve_transport_name("auto") and one[1] == {}


def test_net_counter_add_equals_record():
    """The proxy's per-op accounting (``NetCounter.add``, plain ints) keeps what ``record`` of
    the same ``NetOpCounts`` keeps: the last counts per op, and totals that stay None for a
    field never counted."""
    from efa_ep.kernels.base import NetCounter, NetOpCounts

    a, b = NetCounter(), NetCounter()
    ops = [("dispatch", 2, 10, 640, 7, 900), ("combine", 1, 4, 256, 3, 300),
           ("dispatch", 0, 0, 0, 2, 32)]
    for op, *counts in ops:
        a.add(op, *counts)
        b.record(NetOpCounts(op, *counts))
    assert a.last == b.last and a.last["dispatch"] == NetOpCounts("dispatch", 0, 0, 0, 2, 32)
    assert a.totals() == b.totals() == {
        "dispatch": {"calls": 2, "messages": 2, "rows": 10, "bytes": 640, "writes": 9,
                     "wire_bytes": 932},
        "combine": {"calls": 1, "messages": 1, "rows": 4, "bytes": 256, "writes": 3,
                    "wire_bytes": 300}}
    c = NetCounter()
    c.record(NetOpCounts("dispatch", 1, 2, 3))  # no proxy engine: writes never counted
    assert c.totals()["dispatch"]["writes"] is None and c.last["dispatch"].writes is None


def test_flat_send_counts_are_the_rows_rail_peers_forward():
    """hier's rail peer on node n forwards, to each local rank d, the rows of a source it
    received from the network stage (the source's tokens with an expert on node n, ids made
    local to the node) that hold one of d's experts, once: that is the source's flat send count
    to EP rank n * G + d, which is why those counts can ride with the status exchange."""
    import numpy as np

    from efa_ep.kernels.base import compute_send_layout
    from efa_ep.kernels.hier.routing import flat_send

    g = torch.Generator().manual_seed(3)
    for nodes, node_size, per_rank, k in ((2, 2, 4, 3), (3, 4, 2, 8), (1, 2, 8, 1)):
        world, per_node = nodes * node_size, node_size * per_rank
        experts = world * per_rank
        tokens = int(torch.randint(0, 9, (1,), generator=g))
        ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :k]
        ids = torch.where(torch.rand(tokens, k, generator=g) < 0.3, torch.full_like(ids, -1),
                          ids)
        _, flat = flat_send(ids.numpy(), world, experts)
        for n in range(nodes):
            on_node = (ids >= n * per_node) & (ids < (n + 1) * per_node)
            rows = ids[on_node.any(1)]  # what the rail peer on node n receives
            local = torch.where((rows >= n * per_node) & (rows < (n + 1) * per_node),
                                rows - n * per_node, torch.full_like(rows, -1))
            fwd = compute_send_layout(local, per_node, node_size).num_tokens_per_rank_W
            assert fwd.tolist() == list(flat[n * node_size:(n + 1) * node_size]), (n, fwd, flat)
        assert np.sum(flat) <= tokens * min(k, world)


def _lying_counts_worker(rank, world):
    """EP 4 as 2 nodes x 2, network torch, local torch; rank 1 tells rank 0 (its node peer,
    which forwards rank 3's rows to it too) one row too many in the counts that ride with the
    status exchange. Returns (error type or None, text)."""
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.hier import transport as hier_transport

    if rank == 1:
        honest = hier_transport.flat_send

        def lying(*a):
            send, counts = honest(*a)
            return send, (counts[0] + 1,) + tuple(counts[1:])
        hier_transport.flat_send = lying
    t = create_transport("hier", None, 8, 16, 16, torch.float32, node_size=2, network="torch",
                         local="torch", timeout_s=30)
    idx, w = contract_route("random", 6, 8, 2, world, seed=rank, node_size=2)
    try:
        t.dispatch(torch.randn(6, 16), idx, w)
        return None, ""
    except Exception as e:  # noqa: BLE001 (the test names what it expects)
        return type(e).__name__, str(e)


def test_forward_counts_that_do_not_add_up_are_a_protocol_violation():
    """The counts peers send with the status exchange are bounded before use: counts that do
    not add up to the rows the local stage received from the forwarding node peer break hier
    on the receiver with a ProtocolError naming the ranks (no permutation is built from
    them)."""
    out = run_ranks(_lying_counts_worker, 4, (), timeout_s=120, env={"OMP_NUM_THREADS": "1"})
    kind, text = out[0]
    assert kind == "ProtocolError", out[0]
    assert ("protocol violation: hier's forward counts of ranks [1, 3] (forwarded by rank 1)"
            in text), text
    assert out[2] == (None, "") and out[3] == (None, ""), out  # the other node is not involved
