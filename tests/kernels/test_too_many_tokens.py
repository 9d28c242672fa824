"""A dispatch with more tokens than ``max_tokens_per_rank`` is refused on every rank with a
:class:`TooManyTokensError` that says what each offending rank needed (the type a caller such
as the efa dispatcher's ``grow`` policy recognises), and the transport stays usable; any other
input error, alone or next to it, stays a plain :class:`DispatchInputError`.
"""
from __future__ import annotations

import pytest
import torch

from efa_ep.distributed import run_ranks
from efa_ep.kernels import transport_status
from efa_ep.kernels.base import (
    DispatchInputError, TooManyTokensError, group_input_error, parse_too_many_tokens,
    too_many_tokens_message,
)

E, H, K, T_MAX = 4, 8, 2, 8


def test_group_input_error_types():
    over = too_many_tokens_message(1, 24, 8)
    assert parse_too_many_tokens(over) == (1, 24, 8)
    assert parse_too_many_tokens(over[:60]) == (1, 24, 8)  # a peer's truncated copy
    assert parse_too_many_tokens("rank 1: topk_idx holds expert id 9; ...") is None
    assert parse_too_many_tokens(None) is None

    e = group_input_error("dispatch #0", {1: over, 0: too_many_tokens_message(0, 9, 8)})
    assert type(e) is TooManyTokensError and isinstance(e, DispatchInputError)
    assert e.needed == {0: 9, 1: 24} and e.max_tokens_per_rank == 8
    assert "invalid input on rank(s) [0, 1]" in str(e) and "x has 24 tokens" in str(e)

    mixed = group_input_error("dispatch #0", {1: over, 0: "rank 0: topk_idx holds NaN"})
    unknown = group_input_error("gda dispatch (op 3)", {1: over, 0: None})
    for err in (mixed, unknown):
        assert type(err) is DispatchInputError, type(err)
        assert err.messages[1] == over


def _worker(rank, world, name, options):
    from efa_ep.kernels import create_transport

    t = create_transport(name, None, E, H, T_MAX, torch.float32, **options)
    out = []
    for tokens in ((T_MAX, 3 * T_MAX), (T_MAX + 1, 2)):  # rank 1 over, then rank 0 over
        g = torch.Generator().manual_seed(rank)
        n = tokens[rank]
        x = torch.randn(n, H, generator=g)
        idx = torch.randint(0, E, (n, K), generator=g)
        w = torch.rand(n, K, generator=g)
        try:
            t.dispatch(x, idx, w)
            out.append(("no error",))
        except DispatchInputError as e:
            out.append((type(e).__name__, getattr(e, "needed", None),
                        getattr(e, "max_tokens_per_rank", None), str(e)))
    # still usable: a dispatch within T_MAX goes through and round-trips
    x = torch.full((T_MAX, H), float(rank + 1))
    idx = torch.arange(T_MAX * K).view(T_MAX, K) % E
    recv_x, _, _, _, h = t.dispatch(x, idx, torch.ones(T_MAX, K))
    back = t.combine(recv_x, h)
    # combine sums a token's rows over the ranks it went to: x times its destination count
    dest = torch.zeros(T_MAX, world).scatter_(1, idx // (E // world), 1.0).sum(1, keepdim=True)
    out.append(torch.equal(back, x * dest))
    t.close()
    return out


def _case(name, **kw):
    why = transport_status().get(name)
    return pytest.param(name, kw, id=name, marks=pytest.mark.skipif(why is not None, reason=str(why)))


@pytest.mark.parametrize("name,options", [
    _case("torch"),
    _case("proxy", provider="tcp"),
    _case("hier", node_size=1, network="torch"),
])
def test_too_many_tokens_raised_on_every_rank(name, options):
    env = {"FI_TCP_IFACE": "lo", "OMP_NUM_THREADS": "1"}
    results = run_ranks(_worker, 2, (name, options), timeout_s=180, env=env)
    for first, second, usable in results:
        assert first[:3] == ("TooManyTokensError", {1: 24}, T_MAX), first
        assert second[:3] == ("TooManyTokensError", {0: 9}, T_MAX), second
        assert "x has 24 tokens > max_tokens_per_rank=8" in first[3]
        assert usable
    assert results[0][0][3] == results[1][0][3]  # the same words on every rank
