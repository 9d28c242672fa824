"""The ``Transport`` base class: the contract's operations, the generic fixed-capacity
layout, the handle owner check (see :mod:`efa_ep.kernels.base` for the contract)."""
from __future__ import annotations

import abc
import functools
import itertools
from typing import Optional

import torch
import torch.distributed as dist

from .errors import DispatchInputError, TransportError
from .handles import DispatchHandle, FixedLayoutState, HandleState, TransportConfig


def _accept_fixed_layout(name: str, fn):
    """Wraps a subclass's ``combine`` / ``dispatch_cached`` / ``combine_topk_weights`` so that a
    handle of the generic :meth:`Transport.dispatch_fixed` is translated to its regular handle
    (rows ``[W * T_MAX, D]`` <-> ``[N, D]``, on the tensors' device, no host sync). Other handles
    pass through untouched."""

    @functools.wraps(fn)
    def method(self, t, handle, *args, **kwargs):
        st = getattr(handle, "state", None)
        if not isinstance(st, FixedLayoutState):
            return fn(self, t, handle, *args, **kwargs)
        if name == "dispatch_cached":
            out = fn(self, t, st.inner, *args, **kwargs)
            full = out.new_zeros((handle.num_recv_tokens, out.shape[1]))
            return full.index_copy_(0, st.rows_N, out)
        if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == handle.num_recv_tokens:
            t = t.index_select(0, st.rows_N)
        # else: passed on as is; the regular op refuses its shape on every rank (status exchange)
        return fn(self, t, st.inner, *args, **kwargs)

    method._fixed_layout_aware = True
    return method


def local_weight_grads(grad_recv_topk_weights: torch.Tensor,
                       recv_topk_idx: torch.Tensor) -> torch.Tensor:
    """The rows a weight combine sends back: ``[N, K]`` -> ``[N, K]`` float32, contiguous, on
    the same device, with every slot whose received id is -1 (an expert on another rank) set to
    0, so each (token, slot) is non-zero in exactly one destination's row. Row-major strides
    even when empty (``torch.where`` can return stride 0 there, which a byte view refuses). The
    zero is a host scalar: two kernels (mask, select), no fill of a device zero."""
    out = torch.where(recv_topk_idx >= 0, grad_recv_topk_weights.float(), 0.0)
    if out.numel() and out.is_contiguous() and out.stride(-1) == 1:
        return out
    return torch.empty(tuple(out.shape), dtype=out.dtype, device=out.device).copy_(out)


class Transport(abc.ABC):
    """Base class of every transport. Subclasses implement ``dispatch``, ``combine`` and
    ``dispatch_cached``; see the module docstring for the contract. ``dispatch_fixed`` has a
    generic default (one host sync); a subclass overrides it to avoid the sync.

    Synchronization: every call is collective over ``group`` and returns once this rank's outputs
    are ready on the current stream; the host learns the receive counts once per dispatch
    (``tokens_per_expert`` is a CPU tensor), so dispatch is not CUDA-graph capturable.
    """

    name: str = "?"
    #: the :class:`HandleState` subclass in the handles this transport's dispatch makes
    state_type: type = HandleState
    #: seconds this transport's calls spent blocked on the device or on peers since it was
    #: created (a call's wall time minus its growth is the host time the call itself costs);
    #: None where the transport does not measure it
    blocked_s: Optional[float] = None

    def __init__(self, cfg: TransportConfig, group):
        self.cfg = cfg
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        #: this transport object's number, unique in the process (``HandleState.owner``)
        self.uid = next(_TRANSPORT_UIDS)
        if self.world_size != cfg.world_size:
            raise TransportError(
                f"rank {self.rank}: group has {self.world_size} ranks, config says {cfg.world_size}")

    def handle_error(self, handle) -> Optional[str]:
        """The owner check of every transport: None when ``handle`` is a :class:`DispatchHandle`
        made by this transport object's dispatch, else one line naming this rank and what the
        handle is instead. Host only; transports route the message through their status
        exchange (so every rank refuses together) or raise it."""
        st = getattr(handle, "state", None)
        if not isinstance(handle, DispatchHandle) or not isinstance(st, self.state_type):
            got = (type(handle).__name__ if not isinstance(handle, DispatchHandle) else
                   f"a DispatchHandle with {type(st).__name__} state (another kind of transport)")
            return (f"rank {self.rank}: handle must be the DispatchHandle returned by this "
                    f"{self.name} transport's dispatch, got {got}")
        if st.owner != self.uid:
            return (f"rank {self.rank}: handle comes from another transport object ({self.name} "
                    f"transport #{st.owner}; this is #{self.uid}): pass a handle to the transport "
                    f"whose dispatch made it")
        return None

    def handle_state(self, handle):
        """``handle.state`` (a :attr:`state_type`) after :meth:`handle_error`; raises its message
        as :class:`DispatchInputError` on this rank only."""
        error = self.handle_error(handle)
        if error is not None:
            raise DispatchInputError(error)
        return handle.state

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Every transport accepts handles of the generic dispatch_fixed without knowing of it.
        for name in ("combine", "dispatch_cached", "combine_topk_weights"):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_fixed_layout_aware", False):
                setattr(cls, name, _accept_fixed_layout(name, fn))

    def dispatch_fixed(self, x, topk_idx, topk_weights):
        """Dispatch into the fixed layout of the module docstring (static shapes).

        Args: as :meth:`dispatch` (``x`` ``[T, H]`` cfg.dtype, ``topk_idx`` ``[T, K]`` int64,
        ``topk_weights`` ``[T, K]`` float32, one device).

        Returns:
            recv_x ``[W * T_MAX, H]`` cfg.dtype (unused rows zero here), recv_topk_idx
            ``[W * T_MAX, K]`` int64 (local ids, -1 unused), recv_topk_weights ``[W * T_MAX, K]``
            float32, num_recv_W ``[W]`` int64, tokens_per_expert ``[L]`` int64 (both on x's
            device), handle (for ``combine`` / ``dispatch_cached`` / ``combine_topk_weights``
            with rows in the same layout).

        Synchronization: this generic default is the regular :meth:`dispatch`, so the host
        blocks once for the counts; the copy into the layout is device-side. Transports that
        can fill the layout without the host (``gda``) override it.
        """
        recv_x, recv_idx, recv_w, tokens_per_expert, h = self.dispatch(x, topk_idx, topk_weights)
        world, t_max, dev = self.world_size, self.cfg.max_tokens_per_rank, recv_x.device
        counts = [int(n) for n in h.num_recv_per_rank]
        rows = torch.cat([torch.arange(n, dtype=torch.int64) + s * t_max
                          for s, n in enumerate(counts)]).to(dev)
        n_rows, k = world * t_max, recv_idx.shape[1]
        out_x = recv_x.new_zeros((n_rows, recv_x.shape[1])).index_copy_(0, rows, recv_x)
        out_idx = torch.full((n_rows, k), -1, dtype=torch.int64, device=dev).index_copy_(
            0, rows, recv_idx)
        out_w = torch.zeros((n_rows, k), dtype=torch.float32, device=dev).index_copy_(
            0, rows, recv_w)
        num_recv = torch.tensor(counts, dtype=torch.int64).to(dev)
        handle = DispatchHandle(
            num_tokens=h.num_tokens, num_recv_tokens=n_rows, topk_idx=h.topk_idx,
            send_token_idx=h.send_token_idx, num_send_per_rank=h.num_send_per_rank,
            num_recv_per_rank=h.num_recv_per_rank, recv_topk_idx=out_idx,
            state=FixedLayoutState(owner=self.uid, inner=h, rows_N=rows, num_recv_W=num_recv))
        return out_x, out_idx, out_w, num_recv, tokens_per_expert.to(dev), handle

    @abc.abstractmethod
    def dispatch(self, x, topk_idx, topk_weights):
        """See the module docstring. Returns (recv_x, recv_topk_idx, recv_topk_weights,
        tokens_per_expert, handle)."""

    @abc.abstractmethod
    def combine(self, y, handle: DispatchHandle):
        """See the module docstring. ``y`` [N, D] (D is usually H) -> [T, D] in y's dtype."""

    @abc.abstractmethod
    def dispatch_cached(self, x, handle: DispatchHandle):
        """Replays ``handle``'s layout: row i of the result is ``x[source token of row i]``."""

    def combine_topk_weights(self, grad_recv_topk_weights, handle: DispatchHandle):
        """``[N, K]`` float32 -> ``[T, K]`` float32: slot k of token t gets the value from the
        row of the rank owning expert ``topk_idx[t, k]`` (0 for unused slots).

        Each slot is non-zero in exactly one destination row once the -1 slots are masked, and
        0.0 + v == v exactly, so a float32 combine returns the values unchanged.
        """
        return self.combine(local_weight_grads(grad_recv_topk_weights, handle.recv_topk_idx),
                            handle)

    def after_backward(self) -> None:
        """Called by the dispatcher once its backward ops of a layer have been issued (the last
        collective of that layer's backward). Transports that defer device-side errors raise
        them here or, inside a backward pass, when that pass ends, so a step never applies
        gradients computed from rows that did not arrive. Default: nothing (errors were raised
        by the calls themselves)."""

    def close(self) -> None:
        """Releases windows, threads and endpoints. Idempotent."""


_TRANSPORT_UIDS = itertools.count(1)
