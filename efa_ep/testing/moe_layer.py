"""Megatron ``MoELayer`` builders and per-rank workers of the GPU layer tests, shared by
``tests/dispatcher/test_moe_layer_gpu.py`` and the GPU scripts (``gda_layer_diag.py``,
``gda_layer_graph.py``, ``gda_stress.py``).

The layer: hidden :data:`HIDDEN`, :data:`NUM_EXPERTS` experts top-:data:`TOPK`, FFN
:data:`FFN_HIDDEN`; inputs ``[SEQ_LEN, MICRO_BATCH, HIDDEN]`` per rank. Workers run on GPU
``rank % device_count`` inside :func:`efa_ep.distributed.run_ranks` (a gloo group; several
ranks per GPU need MPS). Megatron is imported inside the functions, so importing this module
needs only torch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

HIDDEN, NUM_EXPERTS, TOPK, FFN_HIDDEN = 256, 16, 2, 512
SEQ_LEN, MICRO_BATCH = 64, 4
ACT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def efa_moe_layer(transport: str, ep: int, dtype: str, config_overrides=None, **options):
    """A Megatron ``MoELayer`` on the current CUDA device whose ``efa`` dispatcher uses
    ``transport`` with transport ``options`` (per-layer choice: config attributes beat the
    environment). ``dtype``: ``fp32`` | ``bf16``; ``config_overrides``: TransformerConfig
    fields (e.g. capacity settings). Needs :func:`efa_ep.tiny_moe.init_megatron` first."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, transformer_config

    cfg = TinyMoEConfig(num_layers=1, hidden_size=HIDDEN, num_moe_experts=NUM_EXPERTS,
                        moe_router_topk=TOPK, ffn_hidden_size=FFN_HIDDEN,
                        moe_ffn_hidden_size=FFN_HIDDEN, dtype=dtype)
    config = transformer_config(cfg, "efa", ep, **(config_overrides or {}))
    config.efa_ep_transport = transport  # per-layer transport choice (settings precedence)
    if options:
        config.efa_ep_transport_options = options
    layer = MoELayer(config, get_submodules(get_gpt_layer_local_submodules(num_experts=NUM_EXPERTS).mlp))
    layer.set_layer_number(0)
    return layer.cuda()


def gda_vs_torch_layer_worker(rank, world, dtype, seed=0, init=True, options=None) -> float:
    """One fresh pair of layers (``torch``, ``gda``) with the same weights and inputs; asserts
    the forward output and every gradient are bitwise equal and returns sum |output| (> 0 when
    the layer did something). ``init``: set up Megatron's groups (once per process);
    ``options``: gda transport options."""
    import efa_ep  # noqa: F401
    from efa_ep.tiny_moe import init_megatron

    torch.cuda.set_device(rank % torch.cuda.device_count())
    if init:
        init_megatron(world)
    torch.manual_seed(seed)
    ref = efa_moe_layer("torch", world, dtype)
    gda = efa_moe_layer("gda", world, dtype, **(options or {}))
    dist.broadcast(ref.router.weight.data, src=0)
    gda.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(100 + rank + 1000 * seed)
    act_dtype = ACT_DTYPES[dtype]
    x = torch.randn(SEQ_LEN, MICRO_BATCH, HIDDEN, generator=gen).to("cuda", act_dtype)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.randn(SEQ_LEN, MICRO_BATCH, HIDDEN, generator=gen).to("cuda", act_dtype)
    results = {}
    for name, layer, xi in (("torch", ref, x1), ("gda", gda, x2)):
        out, _ = layer(xi)
        out.backward(g)
        results[name] = out
        assert layer.token_dispatcher.transport.name == name, layer.token_dispatcher.transport.name
    torch.cuda.synchronize()
    assert torch.equal(results["gda"], results["torch"]), (results["gda"] - results["torch"]).abs().max()
    assert torch.equal(x2.grad, x1.grad)
    for (n, p1), (_, p2) in zip(ref.named_parameters(), gda.named_parameters()):
        assert p1.grad is not None and torch.equal(p2.grad, p1.grad), n
    return float(results["gda"].float().abs().sum())


def capacity_graph_worker(rank, world, dtype, replays=3, time_iters=0) -> dict:
    """Drop-and-pad (capacity) mode over ``gda``: a Megatron MoELayer's forward + backward
    captured in one CUDA graph with ``GdaTransport.capture`` (no host sync anywhere in it) and
    replayed with new inputs equals the same layer run eagerly, bit for bit (output, input
    grad, every parameter grad), with eager runs of the same transport between replays.

    Returns ``{"ops": gda ops per replay, "timing": None or {"eager_us", "graph_us",
    "num_ops"}}``; ``time_iters`` > 0 also times eager vs replayed fwd+bwd (CUDA events, per
    iteration; measured, not asserted)."""
    import efa_ep  # noqa: F401
    from efa_ep.tiny_moe import init_megatron

    torch.cuda.set_device(rank % torch.cuda.device_count())
    init_megatron(world)
    torch.manual_seed(0)
    pad = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    layer = efa_moe_layer("gda", world, dtype, config_overrides=pad)
    dist.broadcast(layer.router.weight.data, src=0)
    act = ACT_DTYPES[dtype]
    gen = torch.Generator().manual_seed(100 + rank)

    def inputs():
        return (torch.randn(SEQ_LEN, MICRO_BATCH, HIDDEN, generator=gen).to("cuda", act),
                torch.randn(SEQ_LEN, MICRO_BATCH, HIDDEN, generator=gen).to("cuda", act))

    def eager(x, g):
        for p in layer.parameters():
            p.grad = None
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi)
        out.backward(g)
        return [out.detach().clone(), xi.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    x0, g0 = inputs()
    eager(x0, g0)  # creates the transport (first dispatch)
    tr = layer.token_dispatcher.transport
    assert tr.name == "gda" and layer.token_dispatcher.drop_and_pad
    static_x = x0.clone().requires_grad_(True)
    static_g = g0.clone()

    def step():
        static_x.grad = None
        for p in layer.parameters():
            p.grad = None
        out, _ = layer(static_x)
        out.backward(static_g)
        return [out, static_x.grad] + [p.grad for p in layer.parameters()]

    graph = tr.capture(step, warmup=2)
    names = ["output", "input grad"] + [n for n, _ in layer.named_parameters()]
    for i in range(replays):
        x, g = inputs()
        with torch.no_grad():
            static_x.copy_(x)
        static_g.copy_(g)
        graph.replay()
        got = [t.detach().clone() for t in graph.outputs]
        want = eager(x, g)
        for name, a, b in zip(names, got, want):
            assert torch.equal(a, b), (f"rank {rank} replay {i}: {name} differs from eager, max "
                                       f"diff {(a.float() - b.float()).abs().max().item():.3g}")
    tr.check_errors()
    timing = None
    if time_iters:
        def timed(fn):
            torch.cuda.synchronize()
            dist.barrier()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(time_iters):
                fn()
            e1.record()
            torch.cuda.synchronize()
            return e0.elapsed_time(e1) * 1e3 / time_iters
        timing = dict(eager_us=timed(lambda: eager(x, g)), graph_us=timed(graph.replay),
                      num_ops=graph.num_ops)
        tr.check_errors()
    return dict(ops=graph.num_ops, timing=timing)
