"""The torch reference transport against the brute-force contract reference, and bad input.

Several gloo processes per case; each case runs many routes inside one launch to keep CI short.
"""
import pytest
import torch

from efa_ep.distributed import RankFailure, run_ranks

KINDS = ("random", "hot_experts", "one_rank", "dropped")


def _tokens(rank, case):
    # Uneven T per rank, with T=0 on rank 1 in every other case.
    return 0 if (rank == 1 and case % 2) else 3 + 5 * rank + case


def _contract_worker(rank, world, experts, hidden, topks):
    from efa_ep.testing.routes import contract_route

    from efa_ep.kernels import create_transport
    from efa_ep.testing.reference import reference_combine, reference_dispatch

    t = create_transport("torch", None, experts, hidden, 256, torch.float32)
    checked = 0
    for case, (kind, k) in enumerate([(kind, k) for kind in KINDS for k in topks]):
        data = []
        for r in range(world):
            n = _tokens(r, case)
            idx, w = contract_route(kind, n, experts, k, world, seed=1000 * case + r)
            x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(case * 31 + r))
            data.append((x, idx, w))
        x, idx, w = data[rank]
        rx, ri, rw, tpe, handle = t.dispatch(x, idx, w)
        ref = reference_dispatch(*zip(*data), num_experts=experts)
        exp_x, exp_i, exp_w, exp_c, _ = ref[rank]
        assert torch.equal(rx, exp_x), (kind, k)
        assert torch.equal(ri, exp_i), (kind, k)
        assert torch.equal(rw, exp_w), (kind, k)
        assert tpe.device.type == "cpu" and tpe.dtype == torch.int64
        assert torch.equal(tpe, exp_c), (kind, k, tpe, exp_c)
        ys = [torch.randn(ref[d][0].shape[0], hidden, generator=torch.Generator().manual_seed(9 + d + case))
              for d in range(world)]
        out = t.combine(ys[rank], handle)
        exp_out = reference_combine(ys, [ref[d][4] for d in range(world)], [d[0].shape[0] for d in data])
        assert torch.equal(out, exp_out[rank]), (kind, k)
        # Replay (combine's backward) and the weights' return path (dispatch's backward).
        assert torch.equal(t.dispatch_cached(x, handle), rx)
        back = t.combine_topk_weights(rw, handle)
        assert torch.equal(back, w), (kind, k)
        checked += 1
    return checked


# The contract suite (tests/contract) runs EP 4 with E=16, H=8 and K 1, 2, 3, 8 on every
# transport; here the other EP sizes, and at EP 4 only the K it does not run.
@pytest.mark.parametrize("world,topks", [(1, (1, 8)), (2, (1, 2, 3, 8)), (4, (4,))])
def test_torch_transport_matches_reference(world, topks):
    experts = 16
    counts = run_ranks(_contract_worker, world, (experts, 8, topks), timeout_s=120)
    assert counts == [len(KINDS) * len(topks)] * world


def test_bf16_combine_accumulates_in_fp32():
    assert run_ranks(_bf16_worker, 3, timeout_s=60) == [True] * 3


def _bf16_worker(rank, world):
    from efa_ep.kernels import create_transport

    t = create_transport("torch", None, 6, 4, 16, torch.bfloat16)
    # Every token visits all 3 ranks; partials 1, 2**-8, 2**-8. Accumulated in float32 the sum is
    # 1 + 2**-7, exact in bf16. Accumulated in bf16 it would stay 1.0 (1 + 2**-8 rounds to even).
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 2, 4], [1, 3, 5]])
    rx, *_, h = t.dispatch(x, idx, torch.ones(2, 3))
    y = torch.full_like(rx, 1.0 if rank == 0 else 2 ** -8)
    out = t.combine(y, h)
    return out.dtype == torch.bfloat16 and bool((out.float() == 1 + 2 ** -7).all())


def _mismatch_worker(rank, world):
    from efa_ep.kernels import create_transport

    create_transport("torch", None, 8, 16 if rank == 0 else 32, 64, torch.float32)


def test_mismatched_settings_are_refused_naming_ranks():
    with pytest.raises(RankFailure) as err:
        run_ranks(_mismatch_worker, 2, timeout_s=60, pg_timeout_s=20)
    text = str(err.value)
    assert "disagree" in text and "ranks [0]" in text and "ranks [1]" in text


def test_unknown_and_unavailable_transports_explain_themselves():
    from efa_ep.kernels import TransportError, available_transports, resolve_transport_name, transport_status

    assert "torch" in available_transports()
    with pytest.raises(TransportError, match="unknown transport 'nccl_magic'"):
        resolve_transport_name("nccl_magic")
    status = transport_status()
    for name, why in status.items():
        if why is not None:
            assert "needs" in why  # says what to install
    assert resolve_transport_name("auto") in available_transports()


def _foreign_handle_worker(rank, world):
    """A handle goes back only to the transport object that made it (the owner check of
    kernels/base.py), and a wrong handle is refused on every rank, the transport usable after."""
    from efa_ep.kernels import DispatchInputError, create_transport

    a = create_transport("torch", None, 4, 8, 16, torch.float32)
    b = create_transport("torch", None, 4, 8, 16, torch.float32)
    x, idx, w = torch.randn(3, 8), torch.tensor([[0, 3], [1, 2], [2, -1]]), torch.ones(3, 2)
    recv_x, _, _, _, handle = a.dispatch(x, idx, w)
    own = b.dispatch(x, idx, w)[4]
    out = {}
    try:
        b.combine(recv_x, handle if rank == 1 else own)
    except DispatchInputError as e:
        out["foreign"] = str(e)
    torch.testing.assert_close(a.combine(recv_x, handle), a.combine(recv_x, handle))
    a.close()
    b.close()
    return out


def test_a_handle_of_another_transport_object_is_refused_on_every_rank():
    out = run_ranks(_foreign_handle_worker, 2, timeout_s=120, pg_timeout_s=30)
    assert out[0]["foreign"] == out[1]["foreign"], out
    msg = out[0]["foreign"]
    assert "invalid input on rank(s) [1]" in msg and "another transport object" in msg, msg
