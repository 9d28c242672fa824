"""The transports' handles made on the per-op hot path (``frozen_with``) are the dataclasses
their constructors make: equal field by field, frozen, every field present."""
import dataclasses

import pytest
import torch

from efa_ep.kernels.base import DispatchHandle
from efa_ep.kernels.core.handles import frozen_with
from efa_ep.kernels.gda.window import GdaDispatchState
from efa_ep.kernels.proxy.round_ops import ProxyHandleState


def _fields(cls, **values):
    return {f.name: values[f.name] for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("state_cls, state", [
    (GdaDispatchState, dict(owner=3, slot_TW=torch.zeros(2, 2), recv_offsets=None, epoch=9,
                            fixed=True, num_recv_W=torch.ones(2))),
    (ProxyHandleState, dict(owner=4, send_token_idx_cpu=None)),
])
def test_frozen_with_makes_what_the_constructor_makes(state_cls, state):
    idx = torch.arange(6).view(3, 2)
    st_fast, st = frozen_with(state_cls, _fields(state_cls, **state)), state_cls(**state)
    handle = dict(num_tokens=3, num_recv_tokens=5, topk_idx=idx, send_token_idx=idx[0],
                  num_send_per_rank=(2, 3), num_recv_per_rank=(1, 4), recv_topk_idx=idx)
    fast = frozen_with(DispatchHandle, _fields(DispatchHandle, **handle, state=st_fast))
    slow = DispatchHandle(**handle, state=st)
    for name in (f.name for f in dataclasses.fields(DispatchHandle)):
        if name != "state":
            assert getattr(fast, name) is getattr(slow, name), name
    for name in (f.name for f in dataclasses.fields(state_cls)):
        assert getattr(fast.state, name) is getattr(slow.state, name), name
    assert type(fast) is DispatchHandle and type(fast.state) is state_cls
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.num_tokens = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.state.owner = 5


def test_the_hot_paths_handles_hold_every_field():
    """gda's C++ dispatch result and the proxy's handles: every field of the handle and of its
    state is set (a field left out would raise only when a later op reads it)."""
    import types

    from efa_ep.kernels.gda import cpp_op
    from efa_ep.kernels.proxy.round_ops import RoundOps

    idx = torch.arange(6).view(3, 2)
    made = [cpp_op._handle(torch.zeros(3, 4), idx, torch.zeros(5, 4), idx, idx[0], (2, 3),
                           (1, 4), 7, idx, idx[0], 11),
            RoundOps._handle(types.SimpleNamespace(uid=8), 3, idx, idx[0], None, [2, 3],
                             [1, 4], idx)]
    for h in made:
        assert set(vars(h)) == {f.name for f in dataclasses.fields(DispatchHandle)}
        assert set(vars(h.state)) == {f.name for f in dataclasses.fields(type(h.state))}
        assert h.num_recv_tokens == 5 and h.state.owner in (7, 8)


def test_net_counter_last_of_one_op_either_way_it_was_recorded():
    from efa_ep.kernels.base import NetCounter, NetOpCounts

    c = NetCounter()
    assert c.last_of("combine") is None
    c.add("dispatch", 1, 2, 3, None, 5)
    c.record(NetOpCounts("combine", messages=6, rows=7, bytes=8, writes=9, wire_bytes=10))
    assert c.last_of("dispatch") == (1, 2, 3, None, 5)
    assert c.last_of("combine") == (6, 7, 8, 9, 10)
    assert c.last["dispatch"] == NetOpCounts("dispatch", 1, 2, 3, None, 5)
