"""The efa dispatcher inside real Megatron MoE layers on one GPU, ranks as processes (gloo group,
MPS on): the ``gda`` transport gives forward outputs and every gradient bitwise equal to the
``torch`` transport, and matches a dense single-process reference. Skipped without CUDA."""
import pytest
import torch
import torch.distributed as dist

from efa_ep.distributed import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, EXPERTS, TOPK, SEQ, BATCH = 256, 16, 2, 64, 4


def _layer(transport, ep, dtype, **options):
    """A Megatron MoELayer on CUDA whose efa dispatcher uses ``transport`` with ``options``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, transformer_config

    cfg = TinyMoEConfig(num_layers=1, hidden_size=HIDDEN, num_moe_experts=EXPERTS,
                        moe_router_topk=TOPK, ffn_hidden_size=512, moe_ffn_hidden_size=512,
                        dtype=dtype)
    config = transformer_config(cfg, "efa", ep)
    config.efa_ep_transport = transport  # per-layer transport choice (settings precedence)
    if options:
        config.efa_ep_transport_options = options
    layer = MoELayer(config, get_submodules(get_gpt_layer_local_submodules(num_experts=EXPERTS).mlp))
    layer.set_layer_number(0)
    return layer.cuda()


def _gpu_layer_worker(rank, world, dtype, seed=0, init=True, options=None):
    """One fresh pair of layers (torch, gda) with the same weights and inputs; asserts the
    forward output and every gradient are bitwise equal. ``init``: set up Megatron's groups
    (once per process); ``options``: gda transport options. Ranks use GPU
    ``rank % device_count``."""
    import efa_ep  # noqa: F401
    from efa_ep.tiny_moe import init_megatron

    torch.cuda.set_device(rank % torch.cuda.device_count())
    if init:
        init_megatron(world)
    torch.manual_seed(seed)
    ref = _layer("torch", world, dtype)
    gda = _layer("gda", world, dtype, **(options or {}))
    dist.broadcast(ref.router.weight.data, src=0)
    gda.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(100 + rank + 1000 * seed)
    act_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to("cuda", act_dtype)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to("cuda", act_dtype)
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


@pytest.mark.parametrize("world,dtype", [(2, "fp32"), (2, "bf16"), (4, "fp32"), (4, "bf16"),
                                         (8, "fp32"), (8, "bf16")])
def test_gda_layer_bitwise_equals_torch_transport(world, dtype):
    env = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
    sums = run_ranks(_gpu_layer_worker, world, (dtype,), timeout_s=240, env=env)
    assert all(s > 0 for s in sums)
