"""Drop-and-pad (capacity) mode and shared-expert overlap of the efa dispatcher in real Megatron
MoE layers (CPU, gloo, several processes), against Megatron's ``alltoall`` dispatcher in the
same mode; and the no-host-sync property of the drop-and-pad path (meta tensors).

- capacity + pad, top-2: output and every gradient (input, router weight, routing probs,
  experts, shared experts) bitwise equal to alltoall; top-4: equal to rounding.
- capacity factors that drop tokens and ones that do not (checked from the router's output).
- shared-expert overlap: equal to the same layer without overlap, and to alltoall with overlap.
"""
import pytest
import torch
import torch.distributed as dist

from efa_ep.distributed import run_ranks

HIDDEN, EXPERTS, SEQ, BATCH, SHARED = 32, 8, 8, 2, 48
# The CPU cases' ranks see no GPU: on a GPU machine Megatron would put the layers' parameters
# on cuda:0 while these inputs stay on the CPU
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _layer(dispatcher, ep, topk, transport=None, transport_options=None, **overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, transformer_config

    cfg = TinyMoEConfig(num_layers=1, hidden_size=HIDDEN, num_moe_experts=EXPERTS,
                        moe_router_topk=topk, ffn_hidden_size=64, moe_ffn_hidden_size=64)
    config = transformer_config(cfg, dispatcher, ep, **overrides)
    if transport:  # per-layer transport choice (settings precedence: config over environment)
        config.efa_ep_transport = transport
        config.efa_ep_transport_options = transport_options
    layer = MoELayer(config, get_submodules(get_gpt_layer_local_submodules(num_experts=EXPERTS).mlp))
    layer.set_layer_number(0)
    return layer


def _run(layer, x, g):
    """Forward + backward; returns (output, input grad, probs grad, {param: grad})."""
    td = layer.token_dispatcher
    probs_grads = []
    original = td.dispatch_preprocess

    def capture(hidden_states, routing_map, probs):
        if probs.requires_grad:
            probs.register_hook(lambda grad: probs_grads.append(grad.clone()))
        return original(hidden_states, routing_map, probs)

    td.dispatch_preprocess = capture
    try:
        x = x.clone().requires_grad_(True)
        out, _ = layer(x)
        out.backward(g)
    finally:
        del td.dispatch_preprocess
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    return out.detach(), x.grad, probs_grads[0], grads


def _compare(a, b, exact, what, rounding=()):
    """None when equal (bitwise, or to rounding; the names in ``rounding`` always to rounding),
    else one line naming what differs."""
    (oa, xa, pa, ga), (ob, xb, pb, gb) = a, b
    pairs = [("output", oa, ob), ("input grad", xa, xb), ("probs grad", pa, pb)]
    pairs += [(f"grad of {n}", ga[n], gb[n]) for n in ga]
    if sorted(ga) != sorted(gb):
        return f"{what}: parameters differ: {sorted(ga)} vs {sorted(gb)}"
    for name, u, v in pairs:
        if exact and name not in rounding and not torch.equal(u, v):
            return f"{what}: {name} not bitwise equal (max diff {(u - v).abs().max().item():.3g})"
        if not exact and not torch.allclose(u, v, rtol=1e-5, atol=1e-6):
            return f"{what}: {name} differs beyond rounding (max diff {(u - v).abs().max().item():.3g})"
    return None


def _capacity_worker(rank, world, topk, factors):
    import os

    os.environ["EFA_EP_TRANSPORT"] = "torch"
    import efa_ep  # noqa: F401
    from megatron.core.typed_torch import apply_module

    from efa_ep.dispatcher.token_dispatcher import EfaTokenDispatcher
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    report = []
    for factor in factors:
        pad = dict(moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=True)
        torch.manual_seed(0)
        ref = _layer("alltoall", world, topk, **pad)
        efa = _layer("efa", world, topk, **pad)
        assert isinstance(efa.token_dispatcher, EfaTokenDispatcher)
        dist.broadcast(ref.router.weight.data, src=0)
        efa.load_state_dict(ref.state_dict())
        torch.manual_seed(100 + rank)
        x = torch.randn(SEQ, BATCH, HIDDEN)
        g = torch.randn(SEQ, BATCH, HIDDEN)
        a, b = _run(ref, x, g), _run(efa, x, g)
        err = _compare(a, b, exact=(topk == 2), what=f"rank {rank} factor {factor} top-{topk}")
        # Tokens the capacity dropped: (token, expert) choices with a zero probability left.
        probs, routing_map = apply_module(efa.router)(x.view(-1, HIDDEN))
        dropped = SEQ * BATCH * topk - int((probs > 0).sum())
        padded = efa.token_dispatcher.tokens_per_expert
        report.append((factor, err, dropped, padded.device.type, padded.tolist(),
                       int(routing_map.sum(0).max())))
    return report


@pytest.mark.parametrize("world,topk", [
    (2, 2), (2, 4),
    pytest.param(4, 2, marks=pytest.mark.slow), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_capacity_pad_equals_alltoall(world, topk):
    # 0.5 drops about half the choices; E / K gives C = T: every token for every expert, no drop
    # (a larger C, over T, breaks Megatron's alltoall in this mode: it reshapes by C).
    factors = (0.5, EXPERTS / topk)
    results = run_ranks(_capacity_worker, world, (topk, factors), timeout_s=300,
                        env=CPU_ONLY)
    dropped = {f: 0 for f in factors}
    for report in results:
        for factor, err, n_dropped, device, tpe, max_col in report:
            assert err is None, err
            capacity = -(-SEQ * BATCH * topk * factor // EXPERTS)  # Megatron's get_capacity
            assert device == "cpu" and tpe == [world * capacity] * (EXPERTS // world), tpe
            assert max_col == min(capacity, SEQ * BATCH)  # the router pads every expert to C
            dropped[factor] += n_dropped
    assert dropped[0.5] > 0 and dropped[EXPERTS / topk] == 0, dropped


def _overlap_worker(rank, world, pad):
    import os

    os.environ["EFA_EP_TRANSPORT"] = "torch"
    import efa_ep  # noqa: F401

    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    extra = dict(moe_shared_expert_intermediate_size=SHARED)
    if pad:
        extra.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    torch.manual_seed(0)
    ref = _layer("alltoall", world, 2, **extra)
    layers = {"alltoall": ref,
              "alltoall+overlap": _layer("alltoall", world, 2, moe_shared_expert_overlap=True, **extra),
              "efa+overlap": _layer("efa", world, 2, moe_shared_expert_overlap=True, **extra),
              "efa": _layer("efa", world, 2, **extra)}
    dist.broadcast(ref.router.weight.data, src=0)
    for layer in layers.values():
        layer.load_state_dict(ref.state_dict())
    assert layers["efa+overlap"].token_dispatcher.shared_experts is not None
    assert layers["efa"].token_dispatcher.shared_experts is None
    torch.manual_seed(100 + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    g = torch.randn(SEQ, BATCH, HIDDEN)
    runs = {name: _run(layer, x, g) for name, layer in layers.items()}
    shared = [n for n in runs["efa"][3] if "shared_experts" in n]
    # With overlap Megatron runs the shared expert after the router, so the input's gradient
    # sums the router's and the shared expert's parts in another order (its config docstring
    # says so): equal to rounding there, bitwise everywhere else; and what alltoall does with
    # overlap, efa does bit for bit.
    return (len(shared),
            _compare(runs["alltoall+overlap"], runs["efa+overlap"], True,
                     f"rank {rank}: efa+overlap vs alltoall+overlap"),
            _compare(runs["alltoall"], runs["efa"], True, f"rank {rank}: efa vs alltoall"),
            _compare(runs["efa"], runs["efa+overlap"], True,
                     f"rank {rank}: efa+overlap vs efa without overlap", rounding=("input grad",)))


@pytest.mark.parametrize("pad", [False, True], ids=["dropless", "capacity-pad"])
def test_shared_expert_overlap(pad):
    for n_shared, *errors in run_ranks(_overlap_worker, 2, (pad,), timeout_s=300, env=CPU_ONLY):
        assert n_shared >= 2
        assert errors == [None] * 3, errors


class _FakeFixedTransport:
    """Stands in for gda: ``dispatch_fixed`` returns fixed-layout tensors on the inputs' device
    without looking at values; ``dispatch`` (the host-syncing one) must not be called."""

    def __init__(self, world, t_max, num_local, device):
        from types import SimpleNamespace

        self.world_size, self.num_local, self.device = world, num_local, device
        self.cfg = SimpleNamespace(max_tokens_per_rank=t_max)
        self.calls = []

    def dispatch(self, *args):
        raise AssertionError("drop-and-pad called the host-syncing Transport.dispatch")

    def dispatch_fixed(self, x, topk_idx, topk_weights):
        from types import SimpleNamespace

        self.calls.append("dispatch_fixed")
        rows, k = self.world_size * self.cfg.max_tokens_per_rank, topk_idx.shape[1]
        dev = self.device
        return (torch.randn(rows, x.shape[1], dtype=x.dtype, device=dev),
                torch.randint(-1, self.num_local, (rows, k), device=dev),
                torch.rand(rows, k, device=dev), torch.zeros(self.world_size, dtype=torch.int64, device=dev),
                torch.zeros(self.num_local, dtype=torch.int64, device=dev),
                SimpleNamespace(num_recv_tokens=rows))  # what the dispatcher reads of a handle

    def combine(self, y, handle):
        self.calls.append(f"combine[{y.shape[0]}x{y.shape[1]}]")
        return y.new_zeros((self.num_tokens, y.shape[1])) + y.sum() * 0

    def dispatch_cached(self, x, handle):
        self.calls.append("dispatch_cached")
        rows = self.world_size * self.cfg.max_tokens_per_rank
        return x.new_ones((rows, x.shape[1])) + x.sum() * 0

    def after_backward(self):
        self.calls.append("after_backward")


def _padded_dispatcher(monkeypatch, world, experts, topk, factor):
    from types import SimpleNamespace

    from efa_ep.dispatcher import settings
    from efa_ep.dispatcher.token_dispatcher import EfaTokenDispatcher

    monkeypatch.setenv("EFA_EP_TRANSPORT", "torch")
    monkeypatch.delenv("EFA_EP_CAPACITY_OVERFLOW", raising=False)
    settings.reset()
    config = SimpleNamespace(num_moe_experts=experts, moe_router_topk=topk,
                             moe_expert_capacity_factor=factor,
                             moe_pad_expert_input_to_capacity=True, moe_permute_fusion=False)
    td = EfaTokenDispatcher(experts, list(range(experts)), config,
                            pg_collection=SimpleNamespace(ep=None, expt_tp=None, tp_ep=None))
    td.ep_size, td.num_local_experts = world, experts // world  # as if on an EP group of `world`
    td._overflow_agreed = True  # no EP group here; the policy agreement runs on real groups
    return td


def _padded_layer_step(td, transport, device, seq=4, batch=3, hidden=16):
    """The dispatcher's six steps, a stand-in expert (rows x probs) and the backward."""
    experts = td.num_experts
    td.transport_for = lambda x: transport
    hs = torch.randn(seq, batch, hidden, device=device, requires_grad=True)
    routing_map = torch.rand(seq * batch, experts, device=device) > 0.5
    probs = torch.rand(seq * batch, experts, device=device, requires_grad=True)
    transport.num_tokens = seq * batch
    x, w = td.dispatch_preprocess(hs, routing_map, probs)
    x, w = td.token_dispatch(x, w)
    rows, tokens_per_expert, permuted_probs = td.dispatch_postprocess(x, w)
    y = td.combine_preprocess(rows * permuted_probs.unsqueeze(-1))
    out = td.combine_postprocess(td.token_combine(y))
    out.backward(torch.ones_like(out))
    return rows, tokens_per_expert, permuted_probs, out, hs.grad, probs.grad


def test_capacity_path_never_reads_device_data_on_the_host(monkeypatch):
    """Drop-and-pad on meta tensors: meta tensors hold no data, so any host read in the path
    (.item(), .tolist(), .cpu(), bool(), nonzero, a data-dependent shape) raises. Also checks
    that it uses dispatch_fixed (never the syncing dispatch) and the transport calls' order."""
    world, experts, topk, factor, t_max = 2, 8, 2, 1.5, 16
    td = _padded_dispatcher(monkeypatch, world, experts, topk, factor)
    transport = _FakeFixedTransport(world, t_max, experts // world, "meta")
    rows, tpe, pprobs, out, gx, gp = _padded_layer_step(td, transport, "meta")
    capacity = -(-12 * topk * factor // experts)  # Megatron's get_capacity for 12 tokens
    n = (experts // world) * world * capacity
    assert rows.device.type == "meta" and rows.shape == (n, 16), rows.shape
    assert pprobs.shape == (n,) and out.shape == (4, 3, 16) and gx.shape == (4, 3, 16)
    assert gp.shape == (12, experts)
    assert tpe.device.type == "cpu" and tpe.tolist() == [world * capacity] * (experts // world)
    assert transport.calls == ["dispatch_fixed", "combine[32x16]", "dispatch_cached",
                               "combine[32x16]", f"combine[32x{experts}]", "after_backward"], \
        transport.calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capacity_path_does_not_sync_cuda(monkeypatch):
    """The same path on CUDA tensors under ``torch.cuda.set_sync_debug_mode("error")``: any
    device-to-host synchronization in the dispatcher's ops raises."""
    world, experts = 2, 8
    td = _padded_dispatcher(monkeypatch, world, experts, 2, 1.0)
    transport = _FakeFixedTransport(world, 16, experts // world, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows, tpe, *_ = _padded_layer_step(td, transport, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rows.is_cuda and tpe.device.type == "cpu"


def _gda_pad_worker(rank, world):
    """torch vs gda transports in drop-and-pad mode on one GPU: bitwise equal; the gda layer's
    forward and backward run under ``set_sync_debug_mode("error")`` (no host sync at all)."""
    import efa_ep  # noqa: F401
    from efa_ep.tiny_moe import init_megatron

    torch.cuda.set_device(rank % torch.cuda.device_count())
    init_megatron(world)
    pad = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    layers = {}
    torch.manual_seed(0)
    for name, options in (("torch", None), ("gda", "check_backward=0")):
        layers[name] = _layer("efa", world, 2, transport=name, transport_options=options,
                              **pad).cuda()
    dist.broadcast(layers["torch"].router.weight.data, src=0)
    layers["gda"].load_state_dict(layers["torch"].state_dict())
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).cuda()
    g = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).cuda()
    runs = {"torch": _run(layers["torch"], x, g)}
    _run(layers["gda"], x, g)  # warm-up: the transport's windows are set up on first use
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runs["gda"] = _run(layers["gda"], x, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert layers["gda"].token_dispatcher.transport.name == "gda"
    return _compare(runs["torch"], runs["gda"], True, f"rank {rank}: gda vs torch, drop-and-pad")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gda_capacity_pad_equals_torch_without_host_sync():
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    assert run_ranks(_gda_pad_worker, 2, timeout_s=300, env=env) == [None, None]


def _overflow_worker(rank, world, policy):
    policy = policy[rank] if isinstance(policy, tuple) else policy
    """A routing map that Megatron's router never makes: rank 1 sends every token to expert 3
    (over capacity). ``error``: every rank raises one line naming rank, expert, count and
    capacity. ``drop``: expert 3's block from rank 1 holds rank 1's first C tokens, in order."""
    import os

    os.environ["EFA_EP_TRANSPORT"] = "torch"
    os.environ["EFA_EP_CAPACITY_OVERFLOW"] = policy
    import efa_ep  # noqa: F401
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    torch.manual_seed(0)
    layer = _layer("efa", world, 2, moe_expert_capacity_factor=1.0,
                   moe_pad_expert_input_to_capacity=True)
    td = layer.token_dispatcher
    tokens = SEQ * BATCH
    capacity = -(-tokens * 2 // EXPERTS)  # 4
    hs = torch.arange(tokens, dtype=torch.float32).view(SEQ, BATCH, 1).expand(
        SEQ, BATCH, HIDDEN) + 1000 * rank
    routing_map = torch.zeros(tokens, EXPERTS, dtype=torch.bool)
    routing_map[torch.arange(tokens), torch.arange(tokens) % EXPERTS] = True
    if rank == 1:
        routing_map[:, 3] = True
    probs = routing_map.float() * 0.5
    try:
        x, w = td.dispatch_preprocess(hs, routing_map, probs)
        rows, tpe, _ = td.dispatch_postprocess(*td.token_dispatch(x, w))
    except ValueError as e:
        return str(e)
    local, l3 = EXPERTS // world, 3 % (EXPERTS // world)
    if 3 // local != rank:
        return None
    block = rows.view(local, world, capacity, HIDDEN)[l3, 1, :, 0]
    return block.tolist()


def test_capacity_overflow_policies():
    msgs = run_ranks(_overflow_worker, 2, ("error",), timeout_s=120, env=CPU_ONLY)
    assert msgs[0] == msgs[1], msgs
    assert "rank 1 routes 16 tokens to expert 3" in msgs[0] and "capacity is 4" in msgs[0], msgs
    # grow: the shapes are static (C from the capacity factor), over-capacity pairs are dropped
    for policy in ("drop", "grow"):
        blocks = run_ranks(_overflow_worker, 2, (policy,), timeout_s=120, env=CPU_ONLY)
        # expert 3 lives on rank 0 (4 local experts); rank 1's tokens are 1000 + t
        assert blocks == [[1000.0, 1001.0, 1002.0, 1003.0], None], (policy, blocks)


def test_capacity_overflow_policies_must_agree():
    """Ranks with different EFA_EP_CAPACITY_OVERFLOW raise the same line instead of waiting in
    a collective that the others never join."""
    msgs = run_ranks(_overflow_worker, 2, (("error", "drop"),), timeout_s=120,
                     env=CPU_ONLY)
    assert msgs[0] == msgs[1], msgs
    assert "disagree on EFA_EP_CAPACITY_OVERFLOW" in msgs[0] and "'drop' on rank(s) [1]" in msgs[0]


def test_capacity_overflow_setting():
    from types import SimpleNamespace

    from efa_ep.dispatcher.settings import ConfigError, capacity_overflow_policy

    assert capacity_overflow_policy(None, {}) == "drop"
    assert capacity_overflow_policy(None, {"EFA_EP_CAPACITY_OVERFLOW": " Error "}) == "error"
    assert capacity_overflow_policy(None, {"EFA_EP_CAPACITY_OVERFLOW": "grow"}) == "grow"
    config = SimpleNamespace(efa_ep_capacity_overflow="drop")  # the config wins
    assert capacity_overflow_policy(config, {"EFA_EP_CAPACITY_OVERFLOW": "error"}) == "drop"
    with pytest.raises(ConfigError, match="EFA_EP_CAPACITY_OVERFLOW='dorp': expected one of"):
        capacity_overflow_policy(None, {"EFA_EP_CAPACITY_OVERFLOW": "dorp"})
