"""``EFA_EP_FALLBACK=alltoall``: when the efa transport cannot be created (or fails its self-test)
on some EP rank, every rank agrees and builds Megatron's alltoall dispatcher, whose numerics then
are alltoall's bit for bit; without it the error stays one line on every rank. CPU, gloo, real
Megatron MoE layers (as tests/dispatcher/test_moe_layer.py builds them)."""
import logging
import os

import pytest
import torch
import torch.distributed as dist

from efa_ep.distributed import run_ranks

HIDDEN, EXPERTS, TOPK, SEQ, BATCH = 32, 8, 2, 4, 2


def _layer(dispatcher, ep, **attrs):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, transformer_config

    cfg = TinyMoEConfig(num_layers=1, hidden_size=HIDDEN, num_moe_experts=EXPERTS,
                        moe_router_topk=TOPK, ffn_hidden_size=64, moe_ffn_hidden_size=64)
    config = transformer_config(cfg, dispatcher, ep)
    for k, v in attrs.items():
        setattr(config, k, v)
    layer = MoELayer(config, get_submodules(get_gpt_layer_local_submodules(num_experts=EXPERTS).mlp))
    layer.set_layer_number(0)
    return layer


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run_both(ref, layer, rank):
    """Forward and backward of both layers on this rank's tokens; True when the output and every
    gradient are bitwise equal."""
    dist.broadcast(ref.router.weight.data, src=0)
    layer.load_state_dict(ref.state_dict())
    for p in ref.parameters():  # the reference layer serves several comparisons
        p.grad = None
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out1, _ = ref(x1)
    out2, _ = layer(x2)
    g = torch.randn(out1.shape, generator=torch.Generator().manual_seed(200 + rank))
    out1.backward(g)
    out2.backward(g)
    same = torch.equal(out1, out2) and torch.equal(x1.grad, x2.grad)
    for (_, p1), (_, p2) in zip(ref.named_parameters(), layer.named_parameters()):
        same = same and p1.grad is not None and torch.equal(p1.grad, p2.grad)
    return same


def _dispatcher_name(layer) -> str:
    return type(layer.token_dispatcher).__name__


def _provider_worker(rank, world):
    """proxy with provider efa on rank 1 (absent here), tcp on rank 0: without a fallback the
    first forward raises one line on every rank; with EFA_EP_FALLBACK=alltoall every rank builds
    Megatron's alltoall dispatcher and matches it bit for bit."""
    os.environ["EFA_EP_PROXY_PROVIDER"] = "efa" if rank == 1 else "tcp"
    import efa_ep  # noqa: F401
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    handler = _Lines()
    logging.getLogger("efa_ep").addHandler(handler)
    torch.manual_seed(0)
    ref = _layer("alltoall", world)
    plain = _layer("efa", world)
    assert _dispatcher_name(plain) == "EfaTokenDispatcher"
    try:
        plain(torch.randn(SEQ, BATCH, HIDDEN))
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    os.environ["EFA_EP_FALLBACK"] = "alltoall"
    layer = _layer("efa", world)
    return {"error": error, "dispatcher": _dispatcher_name(layer),
            "type_kept": layer.config.moe_token_dispatcher_type,
            "bitwise": _run_both(ref, layer, rank), "log": handler.lines}


def _proxy_usable():
    from efa_ep.kernels import transport_status

    return transport_status().get("proxy")


@pytest.mark.skipif(_proxy_usable() is not None, reason=str(_proxy_usable()))
def test_missing_provider_on_one_rank_falls_back_at_ep2():
    res = run_ranks(_provider_worker, 2, timeout_s=240, pg_timeout_s=60,
                    env={"EFA_EP_TRANSPORT": "proxy", "FI_TCP_IFACE": "lo"})
    for rank, r in enumerate(res):
        # without the fallback: one line, on every rank
        assert r["error"] is not None and "\n" not in r["error"], (rank, r["error"])
        assert r["dispatcher"] == "MoEAlltoAllTokenDispatcher", (rank, r)
        assert r["type_kept"] == "efa" and r["bitwise"], (rank, r)
    assert len(res[0]["log"]) == 1 and not res[1]["log"], res
    line = res[0]["log"][0]
    assert "EFA_EP_FALLBACK=alltoall" in line and "rank 1" in line and "'efa'" in line, line


def _agreement_worker(rank, world):
    """EP 4 over torch with the fallback on: a healthy group keeps efa (bitwise alltoall, top-2);
    a probe transport that fails on rank 1 after its creation, and a self-test that fails on
    rank 2, each make every rank build alltoall."""
    import efa_ep  # noqa: F401
    from efa_ep.dispatcher import transports
    from efa_ep.kernels import TransportError
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    handler = _Lines()
    logging.getLogger("efa_ep").addHandler(handler)
    torch.manual_seed(0)
    ref = _layer("alltoall", world)
    out = {}
    healthy = _layer("efa", world, efa_ep_fallback="alltoall")
    out["healthy"] = (_dispatcher_name(healthy), _run_both(ref, healthy, rank))

    transports.reset()
    real_create = transports.create_probe_transport

    def failing_create(*args, **kwargs):
        t = real_create(*args, **kwargs)  # the collective part runs on every rank
        raise TransportError(f"rank {rank}: simulated setup failure after creation")

    if rank == 1:
        transports.create_probe_transport = failing_create
    layer = _layer("efa", world, efa_ep_fallback="alltoall")
    transports.create_probe_transport = real_create
    out["factory"] = (_dispatcher_name(layer), _run_both(ref, layer, rank))

    transports.reset()
    real_check = transports.round_trip_problem
    if rank == 2:
        transports.round_trip_problem = lambda *a, **k: (real_check(*a, **k)
                                                         or "self-test: simulated mismatch")
    layer = _layer("efa", world, efa_ep_fallback="alltoall")
    transports.round_trip_problem = real_check
    out["selftest"] = (_dispatcher_name(layer), _run_both(ref, layer, rank))
    out["log"] = handler.lines
    return out


def test_failed_creation_or_selftest_on_one_rank_falls_back_at_ep4():
    res = run_ranks(_agreement_worker, 4, timeout_s=300, pg_timeout_s=60,
                    env={"EFA_EP_TRANSPORT": "torch"})
    for rank, r in enumerate(res):
        assert r["healthy"] == ("EfaTokenDispatcher", True), (rank, r)
        assert r["factory"] == ("MoEAlltoAllTokenDispatcher", True), (rank, r)
        assert r["selftest"] == ("MoEAlltoAllTokenDispatcher", True), (rank, r)
    assert all(not r["log"] for r in res[1:]), [r["log"] for r in res]
    first, second = res[0]["log"]
    assert "rank 1: TransportError: simulated setup failure after creation" in first, first
    assert "rank 2: self-test: simulated mismatch" in second, second


def test_fallback_setting(monkeypatch):
    from efa_ep.dispatcher import settings

    monkeypatch.delenv("EFA_EP_FALLBACK", raising=False)
    assert settings.fallback_dispatcher() is None
    monkeypatch.setenv("EFA_EP_FALLBACK", " AllToAll ")
    assert settings.fallback_dispatcher() == "alltoall"

    class Cfg:
        efa_ep_fallback = "none"  # the config attribute wins over the environment

    assert settings.fallback_dispatcher(Cfg()) is None
    monkeypatch.setenv("EFA_EP_FALLBACK", "alltoal")
    with pytest.raises(settings.ConfigError, match="EFA_EP_FALLBACK='alltoal'.*did you mean 'alltoall'"):
        settings.fallback_dispatcher()
    Cfg.efa_ep_fallback = "allgather"
    with pytest.raises(settings.ConfigError, match="config.efa_ep_fallback='allgather'"):
        settings.fallback_dispatcher(Cfg())


def test_launcher_check_leaves_an_unavailable_transport_to_the_fallback():
    from efa_ep.dispatcher import settings

    env = {"EFA_EP_TRANSPORT": "gda"}
    if torch.cuda.is_available():
        pytest.skip("gda may run here")
    with pytest.raises(settings.ConfigError, match="cannot run on this machine"):
        settings.check_environment(env)
    assert settings.check_environment({**env, "EFA_EP_FALLBACK": "alltoall"}).transport == "gda"
    with pytest.raises(settings.ConfigError, match="EFA_EP_FALLBACK"):
        settings.check_environment({**env, "EFA_EP_FALLBACK": "yes"})


def test_reasons_are_joined_by_rank():
    from efa_ep.dispatcher.transports import join_reasons

    assert join_reasons([None, "rank 1: x", "x", "y"]) == "ranks 1, 2: x; rank 3: y"
