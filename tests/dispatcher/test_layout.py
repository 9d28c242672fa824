"""The efa dispatcher's layout math (``efa_ep.dispatcher.layout``) on the CPU, one process:

- ``routing_map_to_topk``: hand-written ids and weights, -1 padding, the gradient reaching only
  selected probs, the more-than-K check;
- ``expert_major_order``: a hand-written case, and equality (rows, weights, gradients, the
  unpermuted sum) with Megatron's ``permute``/``unpermute`` over the ``[N, L]`` routing map;
- the dropless path's six steps on meta tensors with a stand-in transport: no host read of
  device data (meta tensors hold none), and the transport calls in order.
"""
import pytest
import torch

from efa_ep.dispatcher.layout import expert_major_order, routing_map_to_topk


def test_routing_map_to_topk_by_hand():
    routing_map = torch.tensor([[0, 1, 0, 1, 0],
                                [1, 0, 0, 0, 1],
                                [0, 0, 1, 0, 0],   # kept one expert (a capacity drop): -1 pad
                                [0, 0, 0, 0, 0]], dtype=torch.bool)
    probs = (torch.arange(20, dtype=torch.float32).view(4, 5) + 1) * routing_map
    probs.requires_grad_(True)
    idx, w = routing_map_to_topk(routing_map, probs, 2)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    assert idx.tolist() == [[1, 3], [0, 4], [2, -1], [-1, -1]]
    assert w.tolist() == [[2.0, 4.0], [6.0, 10.0], [13.0, 0.0], [0.0, 0.0]]
    w.backward(torch.full_like(w, 3.0))
    assert torch.equal(probs.grad, 3.0 * routing_map.float())  # nothing reaches unselected probs


def test_routing_map_to_topk_refuses_more_than_k():
    routing_map = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    with pytest.raises(ValueError, match="more than moe_router_topk=2"):
        routing_map_to_topk(routing_map, torch.rand(1, 4), 2)


def test_expert_major_order_by_hand():
    # rows 0..2, K = 2, L = 2: expert 0 has rows 1, 2; expert 1 has rows 0, 1, 2
    recv_topk_idx = torch.tensor([[1, -1], [0, 1], [1, 0]])
    slot, row = expert_major_order(recv_topk_idx, 2, 5)
    assert slot.tolist() == [2, 5, 0, 3, 4]
    assert row.tolist() == [1, 2, 0, 1, 2]


def _random_recv(n, k, num_local, gen):
    """[N, K] local ids, each row a random subset of the local experts (possibly none)."""
    idx = torch.full((n, k), -1, dtype=torch.int64)
    for r in range(n):
        m = int(torch.randint(0, min(k, num_local) + 1, (1,), generator=gen))
        experts = torch.randperm(num_local, generator=gen)[:m]
        slots = torch.randperm(k, generator=gen)[:m]
        idx[r, slots] = experts
    return idx


@pytest.mark.parametrize("n,k,num_local,probs_dtype", [
    (37, 8, 32, torch.float32), (50, 2, 4, torch.float32), (64, 8, 3, torch.float64),
    (20, 4, 64, torch.bfloat16), (0, 2, 4, torch.float32),
])
def test_expert_major_order_equals_megatron_permute(n, k, num_local, probs_dtype):
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    gen = torch.Generator().manual_seed(n * 1000 + k * 10 + num_local)
    recv_idx = _random_recv(n, k, num_local, gen)
    x = torch.randn(n, 16, generator=gen)
    w = torch.rand(n, k, generator=gen).masked_fill(recv_idx < 0, 0.0)
    g_rows = None
    results = []
    for ours in (False, True):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if ours:
            num_rows = int((recv_idx >= 0).sum())
            slot, sorted_indices = expert_major_order(recv_idx, num_local, num_rows)
            rows = xi.index_select(0, sorted_indices)
            probs = wi.reshape(-1).index_select(0, slot).to(probs_dtype)
        else:  # Megatron's permute over the [N, L] map and probs (what the dispatcher did)
            valid = recv_idx >= 0
            cols = torch.where(valid, recv_idx, num_local)
            local_probs = wi.new_zeros((n, num_local + 1)).scatter(
                1, cols, torch.where(valid, wi, 0.0))[:, :num_local].to(probs_dtype)
            local_map = torch.zeros(n, num_local + 1, dtype=torch.bool).scatter_(
                1, cols, True)[:, :num_local].contiguous()
            rows, probs, sorted_indices, _, _ = permute(
                xi, local_map, probs=local_probs, num_out_tokens=int(local_map.sum()))
        if g_rows is None:
            g_rows = torch.randn(rows.shape, generator=gen)
            g_probs = torch.randn(probs.shape, generator=gen).to(probs_dtype)
        combined = unpermute(rows * 1.5, sorted_indices, restore_shape=torch.Size([n, 16]))
        ((rows * g_rows).sum() + (probs * g_probs).sum()).backward()
        results.append((rows.detach(), probs.detach(), combined.detach(), xi.grad, wi.grad))
    assert results[1][1].dtype == probs_dtype
    names = ("rows", "probs", "unpermuted sum", "x grad", "weights grad")
    for name, want, got in zip(names, *results):
        assert want.shape == got.shape and torch.equal(want, got), name


class _FakeTransport:
    """Stands in for a transport's dropless calls: outputs on the inputs' device without
    looking at values, ``tokens_per_expert`` on the host as the contract says."""

    def __init__(self, num_recv, num_local, device):
        self.num_recv, self.num_local, self.device = num_recv, num_local, device
        self.calls = []

    def dispatch(self, x, topk_idx, topk_weights):
        from types import SimpleNamespace

        self.calls.append("dispatch")
        self.num_tokens = x.shape[0]
        n, k, dev = self.num_recv, topk_idx.shape[1], self.device
        recv_idx = torch.randint(-1, self.num_local, (n, k), device=dev)
        tokens_per_expert = torch.full((self.num_local,), 3, dtype=torch.int64)  # host
        handle = SimpleNamespace(num_recv_tokens=n, recv_topk_idx=recv_idx)
        return (torch.randn(n, x.shape[1], dtype=x.dtype, device=dev), recv_idx,
                torch.rand(n, k, device=dev), tokens_per_expert, handle)

    def combine(self, y, handle):
        self.calls.append(f"combine[{y.shape[0]}x{y.shape[1]}]")
        return y.new_zeros((self.num_tokens, y.shape[1])) + y.sum() * 0

    def combine_topk_weights(self, g, handle):
        self.calls.append(f"combine_topk_weights[{g.shape[0]}x{g.shape[1]}]")
        return g.new_zeros((self.num_tokens, g.shape[1])) + g.sum() * 0

    def dispatch_cached(self, x, handle):
        self.calls.append("dispatch_cached")
        return x.new_ones((self.num_recv, x.shape[1])) + x.sum() * 0

    def after_backward(self):
        self.calls.append("after_backward")


def _dropless_dispatcher(monkeypatch, world, experts, topk):
    from types import SimpleNamespace

    from efa_ep.dispatcher import settings
    from efa_ep.dispatcher.token_dispatcher import EfaTokenDispatcher

    monkeypatch.setenv("EFA_EP_TRANSPORT", "torch")
    settings.reset()
    config = SimpleNamespace(num_moe_experts=experts, moe_router_topk=topk,
                             moe_permute_fusion=False)
    td = EfaTokenDispatcher(experts, list(range(experts)), config,
                            pg_collection=SimpleNamespace(ep=None, expt_tp=None, tp_ep=None))
    td.ep_size, td.num_local_experts = world, experts // world  # as if on an EP group of `world`
    return td


def _dropless_step(td, transport, device, seq=4, batch=3, hidden=16):
    td.transport_for = lambda x: transport
    experts, tokens = td.num_experts, seq * batch
    hs = torch.randn(seq, batch, hidden, device=device, requires_grad=True)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=device)
    probs = torch.rand(tokens, experts, device=device, requires_grad=True)
    x, w = td.dispatch_preprocess(hs, routing_map, probs)
    x, w = td.token_dispatch(x, w)
    rows, tokens_per_expert, permuted_probs = td.dispatch_postprocess(x, w)
    y = td.combine_preprocess(rows * permuted_probs.unsqueeze(-1))
    out = td.combine_postprocess(td.token_combine(y))
    out.backward(torch.ones_like(out))
    return rows, tokens_per_expert, permuted_probs, out, hs.grad, probs.grad


def test_dropless_path_never_reads_device_data_on_the_host(monkeypatch):
    """The dropless steps on meta tensors (any .item(), .tolist(), bool(), nonzero or
    data-dependent shape raises on them): the only count read is of the host
    ``tokens_per_expert``; the transport sees dispatch, combine, then the backward's cached
    dispatch, combine and weight combine."""
    world, experts, topk, n_recv = 2, 8, 2, 10
    td = _dropless_dispatcher(monkeypatch, world, experts, topk)
    transport = _FakeTransport(n_recv, experts // world, "meta")
    rows, tpe, pprobs, out, gx, gp = _dropless_step(td, transport, "meta")
    assert rows.device.type == "meta" and rows.shape == (12, 16), rows.shape  # 4 experts x 3
    assert pprobs.shape == (12,) and out.shape == (4, 3, 16) and gx.shape == (4, 3, 16)
    assert gp.shape == (12, experts) and tpe.device.type == "cpu"
    assert transport.calls == ["dispatch", "combine[10x16]", "dispatch_cached", "combine[10x16]",
                               "combine_topk_weights[10x2]", "after_backward"], transport.calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dropless_path_does_not_sync_cuda(monkeypatch):
    """The dispatcher's own dropless code on CUDA tensors under
    ``torch.cuda.set_sync_debug_mode("error")`` (the stand-in transport makes no sync)."""
    td = _dropless_dispatcher(monkeypatch, 2, 8, 2)
    transport = _FakeTransport(10, 4, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows, tpe, *_ = _dropless_step(td, transport, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rows.is_cuda and tpe.device.type == "cpu"
