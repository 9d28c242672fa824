"""The ``hier`` transport (local stage inside emulated nodes, network stage across them) against
the brute-force contract reference and the ``torch`` transport, on CPU: ranks are gloo
processes, nodes are emulated with ``node_size``; the network stage runs ``proxy`` over tcp on
loopback (EP 4) or ``torch`` (EP 8, to keep CI short). Dispatch, cached dispatch and the
weight combine must be bit-identical; combine bit-identical when every token has at most two
destination ranks, else equal to rounding (sums grouped by node)."""
import pytest
import torch

from efa_ep.distributed import RankFailure, run_ranks

KINDS = ("random", "skewed", "one_rank", "dropped")


def _tokens(rank, case):
    return 0 if (rank == 1 and case % 3 == 1) else 2 + 3 * rank + 2 * case


def _hier_worker(rank, world, node_size, network, experts, hidden, topks, dtype_name):
    from routes import make_route

    from efa_ep.kernels import create_transport
    from efa_ep.kernels.reference import reference_combine, reference_dispatch

    dtype = getattr(torch, dtype_name)
    opts = dict(node_size=node_size, network=network)
    if network == "proxy":
        opts.update(provider="tcp", num_channels=2, timeout_s=30)
    t = create_transport("hier", None, experts, hidden, 64, dtype, **opts)
    assert t.name == "hier" and t.num_nodes == world // node_size
    assert t.stage_names == (network if world > node_size else "torch", "torch")
    checked = 0
    for case, (kind, k) in enumerate([(kind, k) for kind in KINDS for k in topks]):
        data = []
        for r in range(world):
            n = _tokens(r, case)
            idx, w = make_route(kind, n, experts, k, world, seed=1000 * case + r)
            g = torch.Generator().manual_seed(case * 31 + r)
            data.append((torch.randn(n, hidden, generator=g).to(dtype), idx, w))
        x, idx, w = data[rank]
        rx, ri, rw, tpe, handle = t.dispatch(x, idx, w)
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
        exp_out = reference_combine(ys, [ref[d][4] for d in range(world)],
                                    [d[0].shape[0] for d in data])[rank]
        if k <= 2:
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
    t.close()
    return checked


@pytest.mark.parametrize("world,node_size,network,topks,dtype", [
    (4, 2, "proxy", (1, 2, 8), "float32"),
    (8, 4, "torch", (2, 4), "bfloat16"),
    (8, 2, "torch", (1, 8), "float32"),
    (4, 4, "torch", (2,), "float32"),
])
def test_hier_matches_reference(world, node_size, network, topks, dtype):
    counts = run_ranks(_hier_worker, world, (node_size, network, 32, 8, topks, dtype),
                       timeout_s=240)
    assert counts == [len(KINDS) * len(topks)] * world


def _bad_input_worker(rank, world):
    from efa_ep.kernels import create_transport

    t = create_transport("hier", None, 8, 4, 16, torch.float32, node_size=2, network="torch")
    x = torch.randn(3, 4)
    idx = torch.tensor([[0, 5], [1, 7], [3, -1]])
    if rank == 3:
        idx = idx.clone()
        idx[1, 0] = 42
    try:
        t.dispatch(x, idx, torch.ones(3, 2))
    except Exception as e:  # every rank must raise, naming rank 3
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_hier_bad_input_raises_on_every_rank():
    msgs = run_ranks(_bad_input_worker, 4, (), timeout_s=180)
    assert all(m.startswith("DispatchInputError") for m in msgs), msgs
    assert "rank 3" in msgs[3] and all("[3]" in m for m in msgs[:3]), msgs


def _layout_worker(rank, world):
    from efa_ep.kernels import create_transport

    create_transport("hier", None, 8, 4, 16, torch.float32, node_size=3, network="torch")


def test_hier_refuses_a_node_size_that_does_not_divide():
    with pytest.raises(RankFailure, match="node_size=3 must divide the EP group size 4"):
        run_ranks(_layout_worker, 4, (), timeout_s=60)


def _hier_gpu_worker(rank, world, node_size, topks, network):
    """Ranks as processes on the GPU(s): local stage gda (NVLink stores / shared GPU), network
    stage ``network`` (proxy over shm with host staging, or torch); compared with the reference
    bit for bit."""
    from routes import make_route

    from efa_ep.kernels import create_transport
    from efa_ep.kernels.reference import reference_combine, reference_dispatch

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    experts, hidden = 64, 256
    opts = dict(provider="shm", num_channels=2, timeout_s=60) if network == "proxy" else {}
    t = create_transport("hier", None, experts, hidden, 256, torch.bfloat16, node_size=node_size,
                         network=network, **opts)
    assert t.stage_names == (network, "gda"), t.stage_names
    checked = 0
    for case, (kind, k) in enumerate([(kind, k) for kind in KINDS for k in topks]):
        data = []
        for r in range(world):
            n = 17 * (r + 1) + case
            idx, w = make_route(kind, n, experts, k, world, seed=1000 * case + r)
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
        if k <= 2:
            assert torch.equal(out, exp_out), (kind, k)
        else:
            torch.testing.assert_close(out.float(), exp_out.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(t.combine_topk_weights(rw, handle).cpu(), w), (kind, k)
        checked += 1
    t.close()
    return checked


def _network_param(name):
    from efa_ep.kernels import transport_status

    why = transport_status().get(name) if name == "proxy" else None
    return pytest.param(name, marks=pytest.mark.skipif(why is not None, reason=str(why)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("network", [_network_param("torch"), _network_param("proxy")])
def test_hier_gpu_gda_local(network):
    """EP 4 as 2 emulated nodes x 2 ranks on the GPU (MPS when they share one)."""
    counts = run_ranks(_hier_gpu_worker, 4, (2, (2, 8), network), timeout_s=300,
                       env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "FI_TCP_IFACE": "lo"})
    assert counts == [len(KINDS) * 2] * 4


def test_auto_choice_uses_hier_across_hosts_and_the_calibration_for_k():
    import os

    from efa_ep.kernels import auto_choice, resolve_transport_name

    cal = os.path.join(os.path.dirname(__file__), "..", "..", "results", "plan", "calibration.json")
    name, opts, why = auto_choice(16, 8, {}, cal)
    assert name == "hier" and 1 <= opts["num_channels"] <= 8, (opts, why)
    assert "from the calibration" in why and "calibration.json" in why
    assert auto_choice(16, 8, {"num_channels": 3}, cal)[1] == {"num_channels": 3}  # user wins
    assert auto_choice(16, 8, {}, None) == ("hier", {}, "EP group spans 2 hosts: hier")
    one = auto_choice(8, 8, {}, cal)
    assert one[0] == resolve_transport_name("auto") and one[1] == {}
