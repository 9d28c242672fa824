"""``EfaTokenDispatcher``: Megatron's six-step dispatcher interface over an efa-ep transport.

Workflow (T local tokens, E experts, L = E / EP local experts, K = moe_router_topk, H hidden):

1. dispatch_preprocess: ``routing_map [T, E]`` bool + ``probs [T, E]`` -> ``topk_idx [T, K]``
   int64 (ascending expert ids, -1 padding) and ``topk_weights [T, K]`` float32. Local only.
2. token_dispatch: the transport sends each token once per destination rank (DeepEP-style);
   returns ``recv_x [N, H]`` and ``recv_topk_weights [N, K]``. The only host sync: receive counts.
3. dispatch_postprocess: local permutation into expert-major order with Megatron's ``permute``
   -> ``(dispatched_input [sum(tokens_per_expert), H], tokens_per_expert [L] int64 CPU,
   permuted_probs [sum])``. Row order inside an expert is (source rank, source token), the same
   as Megatron's ``alltoall`` dispatcher, so experts see identical inputs.
4. combine_preprocess: Megatron's ``unpermute`` (unweighted scatter-add; the experts applied the
   probs) -> ``[N, H]``: each received row summed over its local experts.
5. token_combine: the transport returns rows to their sources and sums them over ranks in
   ascending rank order in float32 -> ``[T, H]``.
6. combine_postprocess: restore ``hidden_states``' shape.

Autograd: dispatch's backward is a combine (and returns the routing weights' gradient through
``combine_topk_weights``); combine's backward is a dispatch replaying the cached handle.

Numerics: for top-2 (and any routing whose experts on one rank are contiguous in the top-k
order, e.g. top-1) forward and backward are bitwise equal to ``alltoall``. For K > 2 with two
or more experts on one rank, the per-token sum is grouped by rank ((a+b)+(c+d) vs ((a+b)+c)+d),
so results agree to rounding, not bitwise.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from megatron.core.transformer.moe.moe_utils import permute, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from efa_ep.dispatcher.settings import current_settings
from efa_ep.kernels import Transport, create_transport

# Unsupported Megatron options: (attribute, value that is fine, message). Checked at construction.
_UNSUPPORTED = (
    ("moe_pad_expert_input_to_capacity", False,
     "capacity padding (drop-and-pad) is not implemented by the efa dispatcher yet"),
    ("moe_shared_expert_overlap", False,
     "shared-expert overlap needs the alltoall/flex stream machinery; set it False"),
    ("overlap_moe_expert_parallel_comm", False,
     "1F1B EP-communication overlap is not supported by the efa dispatcher yet"),
    ("moe_router_padding_for_quantization", False,
     "router padding for FP8/FP4 is not supported by the efa dispatcher yet"),
    ("moe_router_padding_for_fp8", False,
     "router padding for FP8 is not supported by the efa dispatcher yet"),
)


def check_supported(config) -> None:
    """Raises ValueError naming the first Megatron option the efa dispatcher cannot honour."""
    for attr, ok_value, why in _UNSUPPORTED:
        value = getattr(config, attr, ok_value)
        if bool(value) != bool(ok_value):
            raise ValueError(
                f"moe_token_dispatcher_type='efa' does not support {attr}={value!r}: {why}")
    etp = getattr(config, "expert_tensor_parallel_size", 1) or 1
    if etp != 1:
        raise ValueError(
            f"moe_token_dispatcher_type='efa' requires expert_tensor_parallel_size=1, got {etp}")
    if not getattr(config, "num_moe_experts", None):
        raise ValueError("moe_token_dispatcher_type='efa' needs num_moe_experts to be set")


# One transport per (group, sizes, dtype, settings), shared by every layer: windows are
# allocated once. Keyed by the group's object id plus the config fingerprint.
_TRANSPORTS: Dict[Tuple, Transport] = {}


def get_shared_transport(name: str, group, num_experts: int, hidden: int,
                         max_tokens_per_rank: int, dtype: torch.dtype, options: tuple) -> Transport:
    """Returns the process-wide transport for these settings, creating it (collectively) once."""
    key = (name, id(group), num_experts, hidden, max_tokens_per_rank, dtype, options)
    t = _TRANSPORTS.get(key)
    if t is None:
        t = create_transport(name, group, num_experts, hidden, max_tokens_per_rank, dtype,
                             **dict(options))
        _TRANSPORTS[key] = t
    return t


def clear_transport_cache() -> None:
    """Closes and forgets every shared transport (tests, process-group teardown)."""
    for t in _TRANSPORTS.values():
        t.close()
    _TRANSPORTS.clear()


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """``routing_map [T, E]`` bool, ``probs [T, E]`` -> ``topk_idx [T, K]`` int64 (selected
    experts ascending, -1 padding where a token kept fewer than K, e.g. capacity drops) and
    ``topk_weights [T, K]`` float32 (differentiable w.r.t. probs; 0 at -1)."""
    num_tokens, num_experts = routing_map.shape
    if num_tokens == 0:
        return (torch.empty(0, topk, dtype=torch.int64, device=routing_map.device),
                probs.new_zeros((0, topk), dtype=torch.float32) + probs.sum() * 0)
    arange = torch.arange(num_experts, device=routing_map.device)
    keyed = torch.where(routing_map.bool(), arange, num_experts)  # unselected sort last
    sorted_ids = keyed.sort(dim=1).values[:, :topk]
    if not routing_map.is_cuda and int(routing_map.sum(1).max()) > topk:  # no GPU sync
        raise ValueError(f"routing_map selects more than moe_router_topk={topk} experts for a token")
    valid = sorted_ids < num_experts
    topk_idx = torch.where(valid, sorted_ids, -1).to(torch.int64)
    gathered = probs.gather(1, torch.where(valid, sorted_ids, 0))
    topk_weights = torch.where(valid, gathered, torch.zeros((), dtype=gathered.dtype,
                                                             device=gathered.device)).float()
    return topk_idx, topk_weights


class _Dispatch(torch.autograd.Function):
    """x [T, H], topk_weights [T, K] -> recv_x [N, H], recv_topk_weights [N, K]."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, transport, out_meta):
        recv_x, recv_idx, recv_w, tokens_per_expert, handle = transport.dispatch(
            x.contiguous(), topk_idx, topk_weights.detach().contiguous())
        ctx.transport, ctx.handle = transport, handle
        out_meta.update(handle=handle, recv_topk_idx=recv_idx, tokens_per_expert=tokens_per_expert)
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        # Collective on every rank in the same order: grads are materialized (zeros, never None).
        grad_x = ctx.transport.combine(grad_recv_x.contiguous(), ctx.handle)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = ctx.transport.combine_topk_weights(grad_recv_w.contiguous(), ctx.handle)
        ctx.transport.after_backward()  # deferred device-side errors surface before any step
        return (grad_x,      # x
                grad_w,      # topk_weights
                None,        # topk_idx (integer)
                None,        # transport
                None)        # out_meta


class _Combine(torch.autograd.Function):
    """y [N, H] -> out [T, H]; backward replays the dispatch layout."""

    @staticmethod
    def forward(ctx, y, transport, handle):
        ctx.transport, ctx.handle = transport, handle
        return transport.combine(y.contiguous(), handle)

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.transport.dispatch_cached(grad_out.contiguous(), ctx.handle), None, None


class EfaTokenDispatcher(MoETokenDispatcher):
    """Megatron ``MoETokenDispatcher`` moving tokens over an efa-ep transport.

    Built by ``MoELayer`` when ``config.moe_token_dispatcher_type == "efa"`` (after
    ``import efa_ep``). The transport comes from :func:`efa_ep.dispatcher.current_settings`
    (``EFA_EP_TRANSPORT``, default ``auto``) and is created on the first dispatch, collectively
    over the EP group, then shared by every layer with the same sizes.

    Synchronization: the host blocks once per dispatch for the receive counts (as Megatron's
    alltoall does), so the layer is not CUDA-graph capturable.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        check_supported(config)
        if self.tp_size != 1:
            raise ValueError(f"efa dispatcher requires expert tensor-parallel size 1, got {self.tp_size}")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        if self.num_experts != num_local_experts * self.ep_size:
            raise ValueError(f"num_moe_experts={self.num_experts} != num_local_experts "
                             f"{num_local_experts} x ep_size {self.ep_size}")
        self.topk = config.moe_router_topk
        self.settings = current_settings(config)
        self.transport_name = self.settings.resolved_transport()
        self.fused = bool(getattr(config, "moe_permute_fusion", False))
        # Per-call state (non-differentiable metadata; tensors with grads travel via returns).
        self.hidden_shape = None
        self.topk_idx = None             # [T, K] int64
        self.probs_dtype = None
        self.transport = None            # transport of the last dispatch
        self.handle = None               # DispatchHandle of the last dispatch
        self.recv_topk_idx = None        # [N, K] int64 local expert ids
        self.tokens_per_expert = None    # [L] int64 CPU
        self.local_routing_map = None    # [N, L] bool
        self.sorted_indices = None       # [sum(tokens_per_expert)] int64
        self.num_recv_tokens = None

    def transport_for(self, x: torch.Tensor) -> Transport:
        s = self.settings
        return get_shared_transport(self.transport_name, self.ep_group, self.num_experts,
                                    x.shape[-1], s.max_tokens_per_rank, x.dtype, s.transport_options)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """[S, B, H], [T, E] bool, [T, E] -> (x [T, H], topk_weights [T, K] float32). Local."""
        self.hidden_shape = hidden_states.shape
        x = hidden_states.view(-1, self.hidden_shape[-1])
        self.probs_dtype = probs.dtype
        self.topk_idx, topk_weights = routing_map_to_topk(routing_map, probs, self.topk)
        return x, topk_weights

    def token_dispatch(self, hidden_states, probs):
        """x [T, H], topk_weights [T, K] -> (recv_x [N, H], recv_topk_weights [N, K] float32)."""
        meta: dict = {}
        self.transport = self.transport_for(hidden_states)
        recv_x, recv_w = _Dispatch.apply(hidden_states, probs, self.topk_idx, self.transport, meta)
        self.handle = meta["handle"]
        self.recv_topk_idx = meta["recv_topk_idx"]
        self.tokens_per_expert = meta["tokens_per_expert"]
        return recv_x, recv_w

    def dispatch_postprocess(self, hidden_states, probs):
        """recv_x [N, H], recv_topk_weights [N, K] -> (expert-major rows, tokens_per_expert [L]
        int64 CPU, permuted_probs [rows] in the router's probs dtype). Local."""
        n, num_local = hidden_states.shape[0], self.num_local_experts
        self.num_recv_tokens = n
        valid = self.recv_topk_idx >= 0
        # Column L collects unused slots so they never overwrite a real expert's entry.
        cols = torch.where(valid, self.recv_topk_idx, num_local)
        local_probs = probs.new_zeros((n, num_local + 1)).scatter(
            1, cols, torch.where(valid, probs, torch.zeros((), dtype=probs.dtype, device=probs.device)))
        local_probs = local_probs[:, :num_local].to(self.probs_dtype)
        local_map = torch.zeros(n, num_local + 1, dtype=torch.bool, device=hidden_states.device)
        local_map.scatter_(1, cols, True)
        self.local_routing_map = local_map[:, :num_local].contiguous()
        num_rows = int(self.tokens_per_expert.sum())
        permuted, permuted_probs, self.sorted_indices, _, _ = permute(
            hidden_states, self.local_routing_map, probs=local_probs, num_out_tokens=num_rows,
            fused=self.fused)
        return permuted, self.tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states):
        """Expert outputs [rows, H] -> [N, H], each received row summed over its local experts."""
        return unpermute(hidden_states, self.sorted_indices,
                         restore_shape=torch.Size([self.num_recv_tokens, hidden_states.shape[-1]]),
                         routing_map=self.local_routing_map, fused=self.fused)

    def token_combine(self, hidden_states):
        """[N, H] -> [T, H]: rows back to their sources, float32 sum over ranks ascending."""
        # The transport that made the handle combines it (windows and offsets belong to it).
        return _Combine.apply(hidden_states, self.transport, self.handle)

    def combine_postprocess(self, hidden_states):
        """[T, H] -> the original ``hidden_states`` shape."""
        return hidden_states.view(self.hidden_shape)
