"""The efa dispatcher inside real Megatron MoE layers (CPU, gloo, several processes).

- efa vs Megatron's alltoall dispatcher: same weights and input, fp32, top-2: output and every
  gradient (input, router, experts) bitwise equal.
- efa vs a dense single-process reference (all experts local): allclose.
- Megatron's dispatcher_dropless_test round-trip recipe (probs 1/top-k, identity) holds.
"""
import pytest
import torch
import torch.distributed as dist

from efa_ep.distributed import run_ranks

HIDDEN, EXPERTS, TOPK, SEQ, BATCH = 64, 8, 2, 8, 2


def _layer(dispatcher, ep):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, transformer_config

    cfg = TinyMoEConfig(num_layers=1, hidden_size=HIDDEN, num_moe_experts=EXPERTS,
                        moe_router_topk=TOPK, ffn_hidden_size=128, moe_ffn_hidden_size=128)
    config = transformer_config(cfg, dispatcher, ep)
    submodules = get_submodules(get_gpt_layer_local_submodules(num_experts=EXPERTS).mlp)
    layer = MoELayer(config, submodules)
    layer.set_layer_number(0)
    return layer


def _moe_layer_worker(rank, world, transport):
    import os

    os.environ["EFA_EP_TRANSPORT"] = transport
    import efa_ep  # noqa: F401
    from efa_ep.dispatcher.token_dispatcher import EfaTokenDispatcher
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    torch.manual_seed(0)
    ref = _layer("alltoall", world)
    efa = _layer("efa", world)
    assert isinstance(efa.token_dispatcher, EfaTokenDispatcher), type(efa.token_dispatcher)
    dist.broadcast(ref.router.weight.data, src=0)
    efa.load_state_dict(ref.state_dict())
    torch.manual_seed(100 + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ref, _ = ref(x1)
    out_efa, _ = efa(x2)
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    out_efa.backward(g)
    assert torch.equal(out_efa, out_ref), (out_efa - out_ref).abs().max()
    assert torch.equal(x2.grad, x1.grad), (x2.grad - x1.grad).abs().max()
    n_params = 0
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), efa.named_parameters()):
        assert n1 == n2 and p1.grad is not None and p2.grad is not None, n1
        assert torch.equal(p2.grad, p1.grad), (n1, (p2.grad - p1.grad).abs().max())
        n_params += 1

    # Dense single-process reference: every expert on every rank.
    def gather(ws):
        w = torch.stack(ws)
        parts = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(parts, w)
        return torch.cat(parts)

    w1 = gather([e.linear_fc1.weight.detach() for e in efa.experts.local_experts])
    w2 = gather([e.linear_fc2.weight.detach() for e in efa.experts.local_experts])
    tokens = x.reshape(-1, HIDDEN)
    logits = tokens @ efa.router.weight.detach().t()
    top_logits, top_idx = torch.topk(logits, TOPK, dim=-1)
    top_p = torch.softmax(top_logits, dim=-1)
    dense = torch.zeros_like(tokens)
    act = efa.config.activation_func
    for e in range(EXPERTS):
        gate = (top_p * (top_idx == e)).sum(-1, keepdim=True)
        dense = dense + gate * (act(tokens @ w1[e].t()) @ w2[e].t())
    torch.testing.assert_close(out_efa.reshape(-1, HIDDEN), dense, rtol=1e-5, atol=1e-5)
    return n_params, efa.token_dispatcher.tokens_per_expert.device.type, efa.token_dispatcher.transport.name


def _needs(world, name):
    from efa_ep.kernels import transport_status

    why = transport_status().get(name)
    return pytest.param(world, name, id=f"{world}-{name}",
                        marks=pytest.mark.skipif(why is not None, reason=str(why)))


@pytest.mark.parametrize("world,transport", [
    (1, "torch"), (2, "torch"),
    pytest.param(4, "torch", marks=pytest.mark.slow),  # EP 4 below runs over hier and auto
    _needs(2, "proxy"),  # end to end over libfabric (tcp on loopback)
    # 2 emulated nodes x 2 ranks (network stage: torch); auto below covers hier with the proxy
    pytest.param(4, "hier", marks=pytest.mark.slow),
    # auto on an EP group across (emulated) hosts runs hier (network stage: proxy over tcp)
    pytest.param(4, "auto", id="4-auto", marks=_needs(4, "proxy").marks),
])
def test_efa_layer_bitwise_equals_alltoall(world, transport):
    env = {"proxy": {"EFA_EP_TRANSPORT_OPTIONS": "provider=tcp"},
           "hier": {"EFA_EP_TRANSPORT_OPTIONS": "node_size=2,network=torch"},
           "auto": {"EFA_EP_NODE_SIZE": "2", "EFA_EP_PROXY_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"},
           }.get(transport, {})
    results = run_ranks(_moe_layer_worker, world, (transport,), timeout_s=240, env=env)
    want = {"auto": "hier"}.get(transport, "torch" if world == 1 else transport)
    for n_params, tpe_device, ran in results:
        assert n_params >= 3 and tpe_device == "cpu"
        assert ran == want or (world == 1 and ran == "torch"), (transport, ran)


def _roundtrip_worker(rank, world):
    import efa_ep  # noqa: F401
    from megatron.core.typed_torch import apply_module

    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    torch.manual_seed(0)
    layer = _layer("efa", world)
    td = layer.token_dispatcher
    torch.manual_seed(7 + rank)
    hs = torch.randn(SEQ, BATCH, HIDDEN)
    ans = hs.clone()
    hs.requires_grad_(True)
    probs, routing_map = apply_module(layer.router)(hs)
    probs = torch.ones_like(probs) / TOPK
    h, p = td.dispatch_preprocess(hs, routing_map, probs)
    h, p = td.token_dispatch(h, p)
    h, tokens_per_expert, permuted_probs = td.dispatch_postprocess(h, p)
    assert h.shape[0] == int(tokens_per_expert.sum())
    assert tokens_per_expert.device.type == "cpu" and tokens_per_expert.dtype == torch.int64
    h = h * permuted_probs.unsqueeze(-1)
    h = td.combine_preprocess(h)
    h = td.token_combine(h)
    out = td.combine_postprocess(h)
    torch.testing.assert_close(out, ans)
    torch.autograd.backward(out, hs)
    torch.testing.assert_close(hs.grad, ans)
    return tokens_per_expert.tolist()


def test_megatron_dropless_roundtrip():
    counts = run_ranks(_roundtrip_worker, 2, timeout_s=120)
    # Every (token, expert) pair of both ranks lands on exactly one expert.
    assert sum(sum(c) for c in counts) == 2 * SEQ * BATCH * TOPK


def _after_backward_worker(rank, world):
    """The layer's backward ends with transport.after_backward(); an error it raises (gda: a
    device-side deadline that expired) stops loss.backward() before any optimizer step."""
    import os

    os.environ["EFA_EP_TRANSPORT"] = "torch"
    import efa_ep  # noqa: F401
    from efa_ep.kernels import TransportError
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    torch.manual_seed(0)
    layer = _layer("efa", world)
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    out, _ = layer(x)
    transport = layer.token_dispatcher.transport
    calls = []

    def failing():
        calls.append(1)
        raise TransportError(f"rank {rank}: simulated expired wait")

    transport.after_backward = failing
    try:
        out.sum().backward()
        outcome = "no error"
    except TransportError as e:
        outcome = str(e)
    del transport.after_backward  # the shared transport is reused by later tests in this process
    return len(calls), outcome, x.grad is None


def test_backward_raises_deferred_transport_errors():
    for calls, outcome, no_grad in run_ranks(_after_backward_worker, 2, timeout_s=120):
        assert calls == 1 and "simulated expired wait" in outcome and no_grad
