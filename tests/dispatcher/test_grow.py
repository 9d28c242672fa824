"""``EFA_EP_CAPACITY_OVERFLOW=grow``: the efa dispatcher enlarges the EP windows collectively
when a dispatch needs more than ``max_tokens_per_rank`` (T_MAX) tokens on some rank, and
replays it (real Megatron MoE layers, CPU, gloo, two processes, T_MAX 8).

- dropless, top-2, fp32: outputs and every gradient bitwise equal to Megatron's ``alltoall``
  across grows (8 -> 32 -> 64, never shrinking), one transport creation per grow on every rank,
  one log line per grow on the group's rank 0, and the backward of a forward made before a grow
  (its handle belongs to the replaced transport) still right; over ``torch`` and ``proxy``.
- ``error``, the grow limit, and ranks with different policies: the same clear error on every
  rank, and no transport created.
- drop-and-pad: the same T on every rank grows the windows before the fixed-layout dispatch;
  bitwise equal to ``alltoall``.
- settings: ``grow`` and the limit are read and checked before ranks start (one line each).
"""
import pytest
import torch
import torch.distributed as dist

from efa_ep.distributed import run_ranks
from efa_ep.kernels import transport_status

HIDDEN, EXPERTS, TOPK, T_MAX = 16, 8, 2, 8
ENV = {"EFA_EP_MAX_TOKENS_PER_RANK": str(T_MAX), "FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "1"}


def _layer(dispatcher, ep, policy=None, grow_limit=None, **overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, transformer_config

    cfg = TinyMoEConfig(num_layers=1, hidden_size=HIDDEN, num_moe_experts=EXPERTS,
                        moe_router_topk=TOPK, ffn_hidden_size=32, moe_ffn_hidden_size=32)
    config = transformer_config(cfg, dispatcher, ep, **overrides)
    if policy:  # the config attribute wins over EFA_EP_CAPACITY_OVERFLOW
        config.efa_ep_capacity_overflow = policy
    if grow_limit:
        config.efa_ep_grow_max_tokens_per_rank = grow_limit
    layer = MoELayer(config, get_submodules(get_gpt_layer_local_submodules(num_experts=EXPERTS).mlp))
    layer.set_layer_number(0)
    return layer


def _watch(rank):
    """Records (T_MAX of every transport the cache creates, efa_ep log lines) on this rank."""
    import logging

    from efa_ep.dispatcher import transport_cache

    created, lines = [], []
    real = transport_cache.create_transport

    def create(name, group, num_experts, hidden, max_tokens_per_rank, dtype, **options):
        created.append(max_tokens_per_rank)
        return real(name, group, num_experts, hidden, max_tokens_per_rank, dtype, **options)

    transport_cache.create_transport = create

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("efa_ep")
    logger.addHandler(Lines())
    logger.setLevel(logging.INFO)
    return created, lines


def _batch(tokens, rank, seed):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return (torch.randn(tokens // 2, 2, HIDDEN, generator=g),
            torch.randn(tokens // 2, 2, HIDDEN, generator=g))


def _steps(layer, batches):
    """Forward of every batch, then the backwards in reverse order (the first forward's
    backward runs last, after the later batches' grows); returns outputs, input grads and the
    accumulated parameter grads."""
    outs, xs = [], []
    for x, _ in batches:
        x = x.clone().requires_grad_(True)
        out, _ = layer(x)
        outs.append(out)
        xs.append(x)
    for out, (_, g) in reversed(list(zip(outs, batches))):
        out.backward(g)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    return [o.detach() for o in outs], [x.grad for x in xs], grads


def _diff(a, b, what):
    (oa, xa, ga), (ob, xb, gb) = a, b
    pairs = [(f"output {i}", u, v) for i, (u, v) in enumerate(zip(oa, ob))]
    pairs += [(f"input grad {i}", u, v) for i, (u, v) in enumerate(zip(xa, xb))]
    pairs += [(f"grad of {n}", ga[n], gb[n]) for n in ga]
    for name, u, v in pairs:
        if u.shape != v.shape or not torch.equal(u, v):
            return f"{what}: {name} differs"
    return None


def _refused(layer, x):
    try:
        layer(x)
    except ValueError as e:  # DispatchInputError, TooManyTokensError, the disagreement
        return type(e).__name__, str(e)
    return ("no error",)


def _dropless_worker(rank, world, transport):
    import efa_ep  # noqa: F401
    from efa_ep.dispatcher.transport_cache import clear_transport_cache, close_retired_transports
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    created, lines = _watch(rank)
    report = {}
    over = torch.randn(12, 2, HIDDEN)  # 24 tokens > T_MAX on both ranks

    # Refusals first, while the windows hold T_MAX = 8.
    report["error"] = _refused(_layer("efa", world, "error"), over)
    report["limit"] = _refused(_layer("efa", world, "grow", grow_limit=16), over)
    report["mixed"] = _refused(_layer("efa", world, ("grow", "drop")[rank]), over)
    report["created before grow"] = list(created)
    clear_transport_cache()
    del created[:]

    torch.manual_seed(0)
    ref = _layer("alltoall", world)
    efa = _layer("efa", world, "grow")
    dist.broadcast(ref.router.weight.data, src=0)
    efa.load_state_dict(ref.state_dict())
    # A fits; B needs 24 on rank 1 (20 on rank 0): 8 -> 32, while A's graph is alive.
    first = [_batch(8, rank, 1), _batch((20, 24)[rank], rank, 2)]
    report["A, B"] = _diff(_steps(ref, first), _steps(efa, first), f"rank {rank}: A, B")
    report["T_MAX after B"] = efa.token_dispatcher.transport.cfg.max_tokens_per_rank
    # C needs 40 on rank 0: 32 -> 64; D (16 tokens) does not shrink it.
    for name, tokens in (("C", (40, 8)), ("D", (16, 16))):
        batch = [_batch(tokens[rank], rank, 3 if name == "C" else 4)]
        report[name] = _diff(_steps(ref, batch), _steps(efa, batch), f"rank {rank}: {name}")
        report[f"T_MAX after {name}"] = efa.token_dispatcher.transport.cfg.max_tokens_per_rank
    report["created"] = list(created)
    report["lines"] = [m for m in lines if "grew EP windows" in m]
    report["retired closed"] = close_retired_transports()  # the 8 and the 32 windows
    clear_transport_cache()
    return report


def _needs(name):
    why = transport_status().get(name)
    return pytest.param(name, id=name, marks=pytest.mark.skipif(why is not None, reason=str(why)))


@pytest.mark.parametrize("transport", [_needs("torch"), _needs("proxy")])
def test_grow_dropless_equals_alltoall(transport):
    env = dict(ENV, EFA_EP_TRANSPORT=transport)
    if transport == "proxy":
        env["EFA_EP_TRANSPORT_OPTIONS"] = "provider=tcp"
    reports = run_ranks(_dropless_worker, 2, (transport,), timeout_s=300, env=env)
    for rank, r in enumerate(reports):
        kind, text = r["error"]
        assert kind == "TooManyTokensError" and "x has 24 tokens > max_tokens_per_rank=8" in text
        kind, text = r["limit"]
        assert kind == "TooManyTokensError", r["limit"]
        assert "cannot grow the EP windows from 8 tokens per rank for rank 0's 24" in text
        assert "EFA_EP_GROW_MAX_TOKENS_PER_RANK=16" in text
        kind, text = r["mixed"]
        assert "disagree on EFA_EP_CAPACITY_OVERFLOW (dropless)" in text, r["mixed"]
        assert "'drop' on rank(s) [1]" in text and "'grow' on rank(s) [0]" in text
        assert r["created before grow"] == [T_MAX]  # refused: nothing created beyond the first
        assert r["A, B"] is None and r["C"] is None and r["D"] is None, r
        assert (r["T_MAX after B"], r["T_MAX after C"], r["T_MAX after D"]) == (32, 64, 64)
        assert r["created"] == [T_MAX, 32, 64], r["created"]
        assert r["retired closed"] == 2
        want = (["efa-ep: grew EP windows from 8 to 32 tokens per rank (rank 1 needed 24)",
                 "efa-ep: grew EP windows from 32 to 64 tokens per rank (rank 0 needed 40)"]
                if rank == 0 else [])
        assert r["lines"] == want, r["lines"]
    for key in ("error", "limit", "mixed"):
        assert reports[0][key] == reports[1][key]  # the same words on every rank


def _padded_worker(rank, world):
    import efa_ep  # noqa: F401
    from efa_ep.dispatcher.transport_cache import clear_transport_cache
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world)
    created, lines = _watch(rank)
    pad = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    torch.manual_seed(0)
    ref = _layer("alltoall", world, **pad)
    efa = _layer("efa", world, "grow", **pad)
    dist.broadcast(ref.router.weight.data, src=0)
    efa.load_state_dict(ref.state_dict())
    batches = [_batch(8, rank, 1), _batch(24, rank, 2)]  # the same T on every rank
    err = _diff(_steps(ref, batches), _steps(efa, batches), f"rank {rank}: drop-and-pad")
    t_max = efa.token_dispatcher.transport.cfg.max_tokens_per_rank
    clear_transport_cache()
    return err, t_max, list(created), [m for m in lines if "grew EP windows" in m]


def test_grow_drop_and_pad_equals_alltoall():
    reports = run_ranks(_padded_worker, 2, timeout_s=300, env=dict(ENV, EFA_EP_TRANSPORT="torch"))
    for rank, (err, t_max, created, lines) in enumerate(reports):
        assert err is None, err
        assert t_max == 32 and created == [T_MAX, 32], (t_max, created)
        assert lines == (["efa-ep: grew EP windows from 8 to 32 tokens per rank (rank 0 needed 24)"]
                         if rank == 0 else []), lines


def test_grow_settings():
    from types import SimpleNamespace

    from efa_ep.dispatcher.settings import (
        ConfigError, capacity_overflow_policy, check_environment, grow_max_tokens_per_rank,
    )

    assert capacity_overflow_policy(None, {"EFA_EP_CAPACITY_OVERFLOW": "grow"}) == "grow"
    assert capacity_overflow_policy(None, {}) == "drop"
    assert grow_max_tokens_per_rank(None, {}) == 1 << 24
    assert grow_max_tokens_per_rank(None, {"EFA_EP_GROW_MAX_TOKENS_PER_RANK": "4096"}) == 4096
    config = SimpleNamespace(efa_ep_grow_max_tokens_per_rank=64)
    assert grow_max_tokens_per_rank(config, {"EFA_EP_GROW_MAX_TOKENS_PER_RANK": "4096"}) == 64
    base = {"EFA_EP_TRANSPORT": "torch"}
    check_environment({**base, "EFA_EP_CAPACITY_OVERFLOW": "grow"}, check_available=False)
    for env, words in (({"EFA_EP_CAPACITY_OVERFLOW": "grwo"},
                        "EFA_EP_CAPACITY_OVERFLOW='grwo': expected one of drop, error, grow; "
                        "did you mean 'grow'?"),
                       ({"EFA_EP_GROW_MAX_TOKENS_PER_RANK": "0"},
                        "EFA_EP_GROW_MAX_TOKENS_PER_RANK='0' must be in [1, 16777216]")):
        with pytest.raises(ConfigError) as e:
            check_environment({**base, **env}, check_available=False)
        assert str(e.value) == words and "\n" not in str(e.value)


def test_grow_refuses_windows_beyond_free_memory(monkeypatch):
    """The decision every rank takes from the gathered table: windows for the grown T_MAX
    (efa_ep.kernels.memory.window_bytes) over the free memory of some rank raise on every rank
    before any transport is created; within it, the cap is the group's smallest grow limit."""
    from types import SimpleNamespace

    from efa_ep.dispatcher.token_dispatcher import EfaTokenDispatcher
    from efa_ep.kernels import TooManyTokensError, TransportConfig
    from efa_ep.kernels.memory import window_bytes

    cfg = TransportConfig(name="proxy", world_size=2, num_experts=EXPERTS, hidden=1024,
                          max_tokens_per_rank=T_MAX, dtype=torch.float32)
    transport = SimpleNamespace(cfg=cfg)
    need = window_bytes("proxy", world=2, hidden=1024, dtype=torch.float32,
                        max_tokens_per_rank=32, num_experts=EXPERTS)
    grown = []
    td = SimpleNamespace(ep_group=None, transport_options=())
    # columns: tokens, other cause, policy (2 = grow), grow limit, free bytes (-1 unknown)
    table = torch.tensor([[20, 0, 2, 1 << 24, -1], [24, 0, 2, 1 << 24, need - 1]])
    with pytest.raises(TooManyTokensError) as e:
        EfaTokenDispatcher._grow(td, transport, table)
    assert e.value.needed == {0: 20, 1: 24} and e.value.max_tokens_per_rank == T_MAX
    assert "from 8 tokens per rank for rank 1's 24: windows for 32 tokens per rank take " \
           "about" in str(e.value) and "rank 1 has" in str(e.value), str(e.value)

    import efa_ep.dispatcher.token_dispatcher as td_mod

    monkeypatch.setattr(td_mod, "grow_shared_transport",
                        lambda old, group, t_max, options: grown.append(t_max) or old)
    monkeypatch.setattr(td_mod.dist, "get_rank", lambda group: 1)  # not rank 0: no log line
    table[1, 4] = need
    table[0, 3] = 28  # rank 0's limit caps the power of two
    assert EfaTokenDispatcher._grow(td, transport, table) is transport
    assert grown == [28]
