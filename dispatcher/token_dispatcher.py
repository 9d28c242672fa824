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

Drop-and-pad (``moe_expert_capacity_factor`` with ``moe_pad_expert_input_to_capacity``), static
shapes end to end: Megatron's router then marks exactly ``C = ceil(T * K / E * factor)`` tokens
per expert (``min(C, T)``: tokens that chose the expert, topped up with tokens that did not,
with probability 0), so a token may carry any number of experts. Each token goes once per
destination rank with one slot per expert (``topk_idx [T, E]``, -1 = not routed) through
``Transport.dispatch_fixed``; the received window ``[W * T_MAX, H]`` is gathered, on the device,
into Megatron's expert input layout: per local expert a block of ``W * C`` rows, source-rank
major, each source's rows in its token order, rows beyond its count zeros; ``tokens_per_expert``
is ``[W * C] * L`` from the config (CPU, no host read of counts). Experts therefore see exactly
the rows of Megatron's ``alltoall`` dispatcher in this mode, and with ``gda`` (whose
``dispatch_fixed`` never waits on the host) nothing in the layer's dispatch or combine blocks
the host. Overflow (more than C tokens of one source for one expert) cannot come from Megatron's
router; ``EFA_EP_CAPACITY_OVERFLOW`` says what happens if a routing map has it anyway
(:func:`~efa_ep.dispatcher.settings.capacity_overflow_policy`).

Shared-expert overlap (``moe_shared_expert_overlap``): as Megatron's ``alltoall`` dispatcher,
the shared expert's pieces run around the transport calls on ``SharedExpertMLP.stream``
(all-gather/copy in dispatch_preprocess, fc1 after the dispatch, fc2 and the reduce after the
combine, its output added in combine_postprocess). On CPU the streams are no-ops.

1F1B EP-communication overlap (``overlap_moe_expert_parallel_comm``, optionally with
``delay_wgrad_compute``): Megatron's combined-1F1B schedule splits each layer into nodes,
pre_dispatch (attention, router, step 1), dispatch (step 2, on its communication stream), mlp
(steps 3-4 around the experts), combine (steps 5-6, communication stream), detaches the tensors
between them, and runs micro-batch m+1's forward nodes between micro-batch m's backward nodes,
of the same layer too (in a chunk of n layers, forward layer i pairs with backward layer
n-1-i). What that asks of this dispatcher, and why it holds:

- Per-call state on ``self`` (handle, transport, permutation): only forwards write it, and one
  micro-batch's steps 1-6 of a layer finish before the next forward of that layer starts; the
  backward nodes read only their autograd ctx (the handle travels there).
- Transport calls: every one of a run is in a dispatch or combine node (forward or backward),
  so on one stream, which the transports use as ``torch.cuda.current_stream()``; every rank
  issues them in the schedule's order, the same everywhere.
- Storage: the schedule frees a node's inputs after its forward (Megatron's ``free_input``: the
  dispatch node's, and the mlp node's for any dispatcher but ``alltoall`` with one local expert),
  which must therefore share no storage with anything autograd saved. With the overlap on, step
  1 returns a copy of the tokens (not a view of the pre-MLP norm's output, which the router
  saved), and drop-and-pad's step 3 a copy of its rows (the experts save their input): one
  ``[T, H]`` copy per layer (drop-and-pad: plus one of ``[L * W * C, H]``), where ``alltoall``'s
  permutation copies ``T * K`` rows.

The arithmetic is unchanged: losses and gradients are bitwise those without the overlap and
those of ``alltoall`` with it (tests/dispatcher/test_overlap_1f1b*.py).
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import get_capacity, permute, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .settings import (
    CAPACITY_OVERFLOW_POLICIES, capacity_overflow_policy, current_settings,
    grow_max_tokens_per_rank,
)
# The shared transports live in transport_cache; both names stay importable from here.
from .transport_cache import (  # noqa: F401
    auto_transport_for_group, clear_transport_cache, get_shared_transport, grow_shared_transport,
)
from efa_ep.kernels import Transport
from efa_ep.kernels.base import (
    DispatchInputError, TooManyTokensError, TransportError, collective_device,
    parse_too_many_tokens,
)

# Unsupported Megatron options: (attribute, value that is fine, message). Checked at construction.
_UNSUPPORTED = (
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


def routing_map_to_slots(routing_map: torch.Tensor, probs: torch.Tensor):
    """Drop-and-pad routing: ``routing_map [T, E]`` bool, ``probs [T, E]`` -> ``topk_idx [T, E]``
    int64 (slot e holds expert e where routed, else -1) and ``topk_weights [T, E]`` float32
    (differentiable w.r.t. probs; 0 where not routed). One slot per expert because Megatron's
    capacity padding routes a token to any number of experts. Device-side, no host sync."""
    num_experts = routing_map.shape[1]
    routed = routing_map.bool()
    ids = torch.arange(num_experts, dtype=torch.int64, device=routing_map.device).expand_as(routed)
    topk_idx = torch.where(routed, ids, torch.full_like(ids, -1))
    topk_weights = torch.where(routed, probs, torch.zeros((), dtype=probs.dtype,
                                                          device=probs.device)).float()
    return topk_idx, topk_weights


class PaddedLayout(NamedTuple):
    """Where each row of the padded expert input comes from in a fixed-layout window.

    P = L * W * C rows (per local expert l a block of W * C rows; inside it, source s's rows at
    ``s * C + c`` in its token order). All tensors on the window's device.

    Attributes:
        src_row_P: ``[P]`` int64, window row (``s * T_MAX + j``) of each padded row; 0 where
            ``valid_P`` is False (a pad row).
        slot_P: ``[P]`` int64, top-k slot of the window row that holds this row's local expert.
        valid_P: ``[P]`` bool, a real row (False: a pad row, all zeros).
        scatter_row_P: ``[P]`` int64, ``src_row_P`` where valid, else ``W * T_MAX`` (a dummy row
            one past the window, for index_add).
    """

    src_row_P: torch.Tensor
    slot_P: torch.Tensor
    valid_P: torch.Tensor
    scatter_row_P: torch.Tensor


def padded_layout(recv_topk_idx: torch.Tensor, num_local: int, world: int, t_max: int,
                  capacity: int) -> PaddedLayout:
    """Drop-and-pad layout from a fixed-layout dispatch's ``recv_topk_idx [W * T_MAX, K]`` int64
    (local expert ids, -1 unused; unused window rows all -1). Rows of source s for local expert
    l beyond ``capacity`` are dropped (Megatron's drop-and-pad keeps the first C in token
    order). Static shapes, device-side only: no host sync on any device."""
    dev = recv_topk_idx.device
    rows, k = recv_topk_idx.shape
    used = recv_topk_idx >= 0
    cols = torch.where(used, recv_topk_idx, num_local)  # column L collects the unused slots
    member = torch.zeros(rows, num_local + 1, dtype=torch.bool, device=dev).scatter_(1, cols, True)
    slots = torch.arange(k, dtype=torch.int64, device=dev).expand(rows, k).contiguous()
    slot_of = torch.zeros(rows, num_local + 1, dtype=torch.int64, device=dev).scatter_(1, cols, slots)
    # count[s, l, j]: rows of source s up to window row j (inclusive) that hold local expert l
    count = member[:, :num_local].reshape(world, t_max, num_local).permute(0, 2, 1).to(
        torch.int64).cumsum(2).contiguous()
    want = torch.arange(1, capacity + 1, dtype=torch.int64, device=dev).expand(
        world, num_local, capacity).contiguous()
    j = torch.searchsorted(count, want)  # [W, L, C]: first row whose count reaches c + 1
    valid = j < t_max
    src = torch.arange(world, dtype=torch.int64, device=dev).view(world, 1, 1) * t_max \
        + j.clamp(max=max(t_max - 1, 0))
    src = torch.where(valid, src, torch.zeros((), dtype=torch.int64, device=dev))
    local = torch.arange(num_local, dtype=torch.int64, device=dev).view(1, num_local, 1)
    # [W, L, C] -> [L, W, C]: Megatron's expert-major order
    src_p = src.permute(1, 0, 2).reshape(-1)
    valid_p = valid.permute(1, 0, 2).reshape(-1)
    local_p = local.expand(world, num_local, capacity).permute(1, 0, 2).reshape(-1)
    slot_p = slot_of[src_p, local_p]
    scatter_p = torch.where(valid_p, src_p, torch.full_like(src_p, rows))
    return PaddedLayout(src_p, slot_p, valid_p, scatter_p)


def _rows_where(valid_P: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` where valid, exact zeros elsewhere (stale window rows may hold anything)."""
    mask = valid_P.view(-1, *([1] * (rows.dim() - 1)))
    return torch.where(mask, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _scatter_rows(layout: PaddedLayout, rows_PD: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Padded rows ``[P, D]`` -> window rows ``[num_rows, D]``: each window row the sum, from
    +0.0 in local-expert order (index order on CPU), of its rows; pad rows go nowhere."""
    out = rows_PD.new_zeros((num_rows + 1, rows_PD.shape[1]))
    out.index_add_(0, layout.scatter_row_P, rows_PD)
    return out[:num_rows]


class _DispatchPadded(torch.autograd.Function):
    """x ``[T, H]`` (the transport's dtype), topk_weights ``[T, E]`` float32, one device ->
    padded expert input ``[L * W * C, H]`` in x's dtype and its weights ``[L * W * C]`` float32,
    on x's device, through ``transport.dispatch_fixed`` and device-side gathers only; plus,
    not differentiable, the fixed-layout ``DispatchHandle`` (its ``num_recv_tokens`` is the
    window's ``W * T_MAX`` rows) and the :class:`PaddedLayout` (for ``_CombinePadded``).

    Synchronization: only what ``dispatch_fixed`` does (``gda``: none; the generic default: one
    host wait for its counts). Backward: two ``combine`` calls (rows, then weights), no host
    sync of its own. On CUDA, ``index_add_`` sums a window row's three or more local experts in
    an unspecified order, as Megatron's ``unpermute`` does."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, transport, capacity, num_local):
        recv_x, recv_idx, recv_w, _num_recv, _tpe, handle = transport.dispatch_fixed(
            x.contiguous(), topk_idx, topk_weights.detach().contiguous())
        world, t_max = transport.world_size, transport.cfg.max_tokens_per_rank
        layout = padded_layout(recv_idx, num_local, world, t_max, capacity)
        # Copies out of the window at once (gda's window is reused two ops later).
        padded_x = _rows_where(layout.valid_P, recv_x.index_select(0, layout.src_row_P))
        padded_w = _rows_where(layout.valid_P, recv_w[layout.src_row_P, layout.slot_P])
        ctx.transport, ctx.handle, ctx.layout = transport, handle, layout
        ctx.k = recv_idx.shape[1]
        return padded_x, padded_w, handle, layout

    @staticmethod
    def backward(ctx, grad_padded_x, grad_padded_w, _handle, _layout):
        layout, rows, k = ctx.layout, ctx.handle.num_recv_tokens, ctx.k
        grad_window = _scatter_rows(layout, grad_padded_x.contiguous(), rows)
        grad_x = ctx.transport.combine(grad_window, ctx.handle)
        grad_w = None
        if ctx.needs_input_grad[1]:
            # One value per (row, slot) of a real row, 0 elsewhere: the masked input that
            # combine_topk_weights would build, without reading the window's ids again (gda's
            # window has been reused by now).
            flat = torch.where(layout.valid_P, layout.src_row_P * k + layout.slot_P,
                               torch.full_like(layout.src_row_P, rows * k))
            g = torch.zeros(rows * k + 1, dtype=torch.float32, device=grad_padded_w.device)
            g.index_add_(0, flat, grad_padded_w.float().contiguous())
            grad_w = ctx.transport.combine(g[: rows * k].view(rows, k), ctx.handle)
        ctx.transport.after_backward()
        return grad_x, grad_w, None, None, None, None


class _CombinePadded(torch.autograd.Function):
    """Padded expert output ``[L * W * C, H]`` -> ``[T, H]`` (same dtype and device): rows summed
    per window row (local experts ascending, from +0.0) into the handle's ``W * T_MAX`` window
    rows, then ``transport.combine``; backward replays the dispatch (``dispatch_cached``) and
    gathers the padded layout again, copying out of the transport's window at once. No host
    sync of its own in either direction."""

    @staticmethod
    def forward(ctx, y, transport, handle, layout):
        ctx.transport, ctx.handle, ctx.layout = transport, handle, layout
        return transport.combine(_scatter_rows(layout, y.contiguous(), handle.num_recv_tokens),
                                 handle)

    @staticmethod
    def backward(ctx, grad_out):
        window = ctx.transport.dispatch_cached(grad_out.contiguous(), ctx.handle)
        grad_y = _rows_where(ctx.layout.valid_P, window.index_select(0, ctx.layout.src_row_P))
        return grad_y, None, None, None


class _Dispatch(torch.autograd.Function):
    """x ``[T, H]`` (the transport's dtype), topk_weights ``[T, K]`` float32, one device ->
    recv_x ``[N, H]`` (x's dtype and device), recv_topk_weights ``[N, K]`` float32, and, not
    differentiable, tokens_per_expert ``[L]`` int64 CPU and the ``DispatchHandle`` (which holds
    ``recv_topk_idx [N, K]`` and N for the dispatcher's later steps).

    Synchronization: what ``transport.dispatch`` does (the host waits once, for the counts).
    Backward: ``combine`` (and ``combine_topk_weights`` when the weights need a gradient), then
    ``after_backward``; collective on every rank in the same order."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, transport):
        recv_x, _recv_idx, recv_w, tokens_per_expert, handle = transport.dispatch(
            x.contiguous(), topk_idx, topk_weights.detach().contiguous())
        ctx.transport, ctx.handle = transport, handle
        ctx.mark_non_differentiable(tokens_per_expert)
        return recv_x, recv_w, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w, _tokens_per_expert, _handle):
        # Collective on every rank in the same order: grads are materialized (zeros, never None).
        grad_x = ctx.transport.combine(grad_recv_x.contiguous(), ctx.handle)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = ctx.transport.combine_topk_weights(grad_recv_w.contiguous(), ctx.handle)
        ctx.transport.after_backward()  # deferred device-side errors surface before any step
        return (grad_x,      # x
                grad_w,      # topk_weights
                None,        # topk_idx (integer)
                None)        # transport


class _Combine(torch.autograd.Function):
    """y ``[N, H]`` -> out ``[T, H]`` (y's dtype and device) through ``transport.combine``;
    backward replays the dispatch layout (``dispatch_cached``). Synchronization: the
    transport's (no host wait of its own)."""

    @staticmethod
    def forward(ctx, y, transport, handle):
        ctx.transport, ctx.handle = transport, handle
        return transport.combine(y.contiguous(), handle)

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.transport.dispatch_cached(grad_out.contiguous(), ctx.handle), None, None


def _only_too_many_tokens(error: DispatchInputError) -> bool:
    """Whether every offending rank's words known here say "more tokens than T_MAX". Words this
    rank cannot know (gda's peers learn only that a rank's input was bad) count as yes: the
    rank that knows them says otherwise in the agreement that follows."""
    if isinstance(error, TooManyTokensError):
        return True
    messages = getattr(error, "messages", None)
    if messages is None:  # not an offending-ranks error (e.g. ranks disagree on K)
        return False
    return all(m is None or parse_too_many_tokens(m) is not None for m in messages.values())


def _raise_if_policies_differ(policies, mode: str, error=None) -> None:
    """Raises one line, the same on every rank, when the EP ranks' ``EFA_EP_CAPACITY_OVERFLOW``
    values (rank r's at index r) differ."""
    if len(set(policies)) > 1:
        by = {p: [r for r, q in enumerate(policies) if q == p] for p in sorted(set(policies))}
        raise ValueError(f"EP ranks disagree on EFA_EP_CAPACITY_OVERFLOW ({mode}): "
                         + "; ".join(f"{p!r} on rank(s) {r}" for p, r in by.items())
                         + "; set the same value on every rank") from error


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _free_bytes(device: torch.device) -> int:
    """Free memory where windows for rows on ``device`` would live (bytes; -1 unknown): the
    CUDA device's, else the host's ``MemAvailable`` (which counts reclaimable page cache)."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, RuntimeError):
        pass
    return -1


def _window_bytes_at(transport: Transport, max_tokens_per_rank: int) -> int:
    """Estimated window bytes per rank of ``transport``'s kind and options with windows for
    ``max_tokens_per_rank`` (:func:`efa_ep.kernels.memory.window_bytes`; ``hier``: its stages',
    each scaled from its own T_MAX). 0 for ``torch`` (no window)."""
    from efa_ep.kernels.memory import window_bytes

    cfg = transport.cfg
    if cfg.name == "hier":
        stages = [getattr(transport, a, None) for a in ("network", "local")]
        return sum(_window_bytes_at(t, t.cfg.max_tokens_per_rank * max_tokens_per_rank
                                    // cfg.max_tokens_per_rank)
                   for t in stages if isinstance(t, Transport))
    if cfg.name not in ("gda", "proxy"):
        return 0
    return window_bytes(cfg.name, world=cfg.world_size, hidden=cfg.hidden, dtype=cfg.dtype,
                        max_tokens_per_rank=max_tokens_per_rank, num_experts=cfg.num_experts,
                        max_topk=dict(cfg.options).get("max_topk"))


def _size(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


class EfaTokenDispatcher(MoETokenDispatcher):
    """Megatron ``MoETokenDispatcher`` moving tokens over an efa-ep transport.

    Built by ``MoELayer`` when ``config.moe_token_dispatcher_type == "efa"`` (after
    ``import efa_ep``). The transport comes from :func:`efa_ep.dispatcher.current_settings`
    (``EFA_EP_TRANSPORT``, default ``auto``), with every option resolved there once
    (``DispatcherSettings.options_for``), and is created on the first dispatch, collectively
    over the EP group, then shared by every layer with the same sizes
    (:mod:`efa_ep.dispatcher.transport_cache`).

    Synchronization: dropless and capacity-dropping modes block the host once per dispatch for
    the receive counts (as Megatron's alltoall does). Drop-and-pad mode
    (``moe_pad_expert_input_to_capacity``) uses ``Transport.dispatch_fixed`` and device-side
    ops with static shapes only: the host waits only where the transport's ``dispatch_fixed``
    does (the generic default over ``torch``/``proxy``/``hier``: once for its counts; ``gda``:
    never), and with ``EFA_EP_CAPACITY_OVERFLOW=error`` (one count all-gather per dispatch).

    Windows too small (``EFA_EP_CAPACITY_OVERFLOW``, :func:`capacity_overflow_policy`): a
    dispatch with more than T_MAX tokens on some rank is refused by the transport on every
    rank; the dispatcher then runs one all-gather of five int64 per rank (tokens, whether this
    rank's refusal had another cause, policy, grow limit, free memory) over the EP group, so
    every rank takes the same decision: ranks that disagree on the policy raise one line;
    ``drop``/``error`` (and any other cause) re-raise the transport's error; ``grow`` creates
    the shared transport anew with T_MAX = the group's largest T rounded up to a power of two
    (:func:`~efa_ep.dispatcher.transport_cache.grow_shared_transport`, collective), logs one
    line on the group's rank 0 and replays the dispatch, or raises
    :class:`~efa_ep.kernels.base.TooManyTokensError` on every rank past the grow limit or the
    free memory of any rank. Drop-and-pad mode with ``grow`` grows before ``dispatch_fixed``
    (which over ``gda`` refuses on the offending rank only) from the local T, equal on every
    rank in that mode, with the same all-gather; the common path costs nothing.
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
        # Drop-and-pad: static shapes, capacity from the config (Megatron's get_capacity).
        self.drop_and_pad = bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
        self.capacity_factor = getattr(config, "moe_expert_capacity_factor", None)
        if self.drop_and_pad and self.capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor")
        # EFA_EP_CAPACITY_OVERFLOW in every mode (grow applies to dropless too); ranks agree on
        # it once (drop-and-pad) or when a dispatch is refused (dropless).
        self.capacity_overflow = capacity_overflow_policy(config)
        self.grow_limit = grow_max_tokens_per_rank(config)
        # Every option the transport gets (explicit ones over EFA_EP_PROXY_* & co.), resolved
        # once here; create_transport checks across the EP group that every rank has the same.
        self.transport_options = self.settings.options_for(self.transport_name)
        self.shared_experts = None       # set by set_shared_experts (moe_shared_expert_overlap)
        self.overlap_1f1b = bool(getattr(config, "overlap_moe_expert_parallel_comm", False))
        # Per-call state (non-differentiable metadata; tensors with grads travel via returns).
        # What the last dispatch's handle holds (N, recv_topk_idx [N, K], the fixed layout's
        # W * T_MAX rows) is read from it, never copied here.
        self.hidden_shape = None
        self.topk_idx = None             # [T, K] int64 ([T, E] in drop-and-pad mode)
        self.probs_dtype = None
        self.transport = None            # transport of the last dispatch (it combines the handle)
        self.handle = None               # DispatchHandle of the last dispatch
        self.tokens_per_expert = None    # [L] int64 CPU
        self.local_routing_map = None    # [N, L] bool
        self.sorted_indices = None       # [sum(tokens_per_expert)] int64
        self.capacity = None             # C of the last drop-and-pad dispatch
        self.padded_layout = None        # PaddedLayout of the last drop-and-pad dispatch

    def transport_for(self, x: torch.Tensor) -> Transport:
        """The shared transport for rows like ``x`` (its width H and dtype); created on first
        use, collectively over the EP group. With ``auto`` the first call also finds out, once
        per EP group (collective), whether the group spans hosts: then ``hier``."""
        if self.settings.transport == "auto" and not getattr(self, "_auto_checked", False):
            name, options = auto_transport_for_group(
                self.ep_group, self.transport_name, dict(self.settings.options_for("hier")),
                self.settings.calibration)
            if name != self.transport_name:
                self.transport_name, self.transport_options = name, options
            self._auto_checked = True
        return get_shared_transport(self.transport_name, self.ep_group, self.num_experts,
                                    x.shape[-1], self.settings.max_tokens_per_rank, x.dtype,
                                    self.transport_options)

    def set_shared_experts(self, shared_experts):
        """Takes the layer's ``SharedExpertMLP`` (``moe_shared_expert_overlap``): its pieces then
        run around this dispatcher's transport calls on the shared experts' stream."""
        super().set_shared_experts(shared_experts)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """[S, B, H], [T, E] bool, [T, E] -> (x [T, H], topk_weights [T, K] float32). Local
        (drop-and-pad: K = E; ``EFA_EP_CAPACITY_OVERFLOW=error`` adds one count all-gather)."""
        self.hidden_shape = hidden_states.shape
        x = hidden_states.view(-1, self.hidden_shape[-1])
        if self.overlap_1f1b:
            x = x.clone()  # the 1F1B schedule frees this (see the class docstring)
        self.probs_dtype = probs.dtype
        if self.drop_and_pad:
            self.capacity = get_capacity(num_tokens=routing_map.shape[0] * self.topk,
                                         num_experts=self.num_experts,
                                         capacity_factor=self.capacity_factor)
            if not getattr(self, "_overflow_agreed", False):
                self._agree_on_overflow_policy()
            if self.capacity_overflow == "error":
                self._check_capacity(routing_map)
            self.topk_idx, topk_weights = routing_map_to_slots(routing_map, probs)
        else:
            self.topk_idx, topk_weights = routing_map_to_topk(routing_map, probs, self.topk)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        return x, topk_weights

    def _agree_on_overflow_policy(self) -> None:
        """Once per dispatcher in drop-and-pad mode (collective over the EP group, host
        objects): every rank must use the same ``EFA_EP_CAPACITY_OVERFLOW``; ``error`` adds a
        collective that ``drop`` ranks would never join, ``grow`` one when the windows grow.
        Raises the same one line on every rank otherwise."""
        policies = [None] * self.ep_size
        dist.all_gather_object(policies, self.capacity_overflow, group=self.ep_group)
        _raise_if_policies_differ(policies, "drop-and-pad")
        self._overflow_agreed = True

    def _check_capacity(self, routing_map) -> None:
        """``capacity_overflow=error``: every EP rank raises the same one-line error when a rank
        routes more than C tokens to one expert, or when ranks' token counts (hence C) differ.
        Collective over the EP group; one host read (the policy's price)."""
        counts = routing_map.sum(0).to(torch.int64)
        mine = torch.cat([torch.tensor([routing_map.shape[0]], dtype=torch.int64,
                                       device=counts.device), counts])
        parts = [torch.empty_like(mine) for _ in range(self.ep_size)]
        dist.all_gather(parts, mine, group=self.ep_group)
        table = torch.stack(parts).cpu()
        tokens = table[:, 0].tolist()
        if len(set(tokens)) > 1:
            raise ValueError(
                f"drop-and-pad (moe_pad_expert_input_to_capacity) needs the same number of tokens "
                f"on every EP rank, as Megatron's alltoall dispatcher: got {tokens} (rank r's "
                f"entry is rank r's)")
        over = (table[:, 1:] > self.capacity).nonzero().tolist()
        if over:
            r, e = over[0]
            raise ValueError(
                f"capacity overflow (EFA_EP_CAPACITY_OVERFLOW=error): rank {r} routes "
                f"{int(table[r, 1 + e])} tokens to expert {e} (on EP rank "
                f"{e // self.num_local_experts}); capacity is {self.capacity} (tokens "
                f"{tokens[r]} x top-k {self.topk} / {self.num_experts} experts x factor "
                f"{self.capacity_factor}); {len(over)} (rank, expert) pair(s) over")

    def token_dispatch(self, hidden_states, probs):
        """x [T, H], topk_weights [T, K] -> (recv_x [N, H], recv_topk_weights [N, K] float32);
        drop-and-pad: (padded expert input [L * W * C, H], its weights [L * W * C] float32).
        With ``EFA_EP_CAPACITY_OVERFLOW=grow`` a T over the windows' T_MAX grows them first
        (see the class docstring)."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        if self.drop_and_pad:
            self.transport = self._transport_fitting(hidden_states)
            recv_x, recv_w, self.handle, self.padded_layout = _DispatchPadded.apply(
                hidden_states, probs, self.topk_idx, self.transport, self.capacity,
                self.num_local_experts)
        else:
            self.transport, (recv_x, recv_w, self.tokens_per_expert, self.handle) = \
                self._dispatch_growing(hidden_states, probs)
        if self.shared_experts is not None:
            # After the tokens moved, as Megatron's alltoall (fc1 overlaps the next transfer).
            self.shared_experts.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_w

    def _dispatch_growing(self, x, probs):
        """``(transport, _Dispatch outputs)``: the dispatch on the shared transport; when every
        rank refuses it (an input error), the agreement of the class docstring decides, on
        every rank alike, between raising and growing the windows and replaying."""
        while True:
            transport = self.transport_for(x)
            try:
                return transport, _Dispatch.apply(x, probs, self.topk_idx, transport)
            except DispatchInputError as error:
                table = self._gather_window_needs(transport, x.shape[0], x.device,
                                                  other=not _only_too_many_tokens(error))
                _raise_if_policies_differ([CAPACITY_OVERFLOW_POLICIES[int(p)]
                                           for p in table[:, 2]], "dropless", error)
                tokens, t_max = table[:, 0], transport.cfg.max_tokens_per_rank
                if (self.capacity_overflow != "grow" or bool(table[:, 1].any())
                        or int(tokens.max()) <= t_max):
                    raise
                self._grow(transport, table, error)  # raises past the limits; then replay

    def _transport_fitting(self, x) -> Transport:
        """Drop-and-pad: the shared transport, grown first when ``grow`` is set and ``x``'s T
        is over its T_MAX. Every rank passes the same T in this mode (as Megatron's alltoall
        requires), so every rank decides alike before the dispatch, and ``dispatch_fixed``
        (which over ``gda`` refuses on the offending rank only) never sees a T it cannot hold."""
        transport = self.transport_for(x)
        if self.capacity_overflow == "grow" and x.shape[0] > transport.cfg.max_tokens_per_rank:
            table = self._gather_window_needs(transport, x.shape[0], x.device, other=False)
            transport = self._grow(transport, table)
        return transport

    def _gather_window_needs(self, transport: Transport, tokens: int, device, other: bool):
        """``[W, 5]`` int64 CPU, row r from EP rank r: its T, whether its refusal had a cause
        other than T > T_MAX (1) or not (0), its policy (index in
        ``CAPACITY_OVERFLOW_POLICIES``), its grow limit, its free memory in bytes (-1 unknown).
        One all-gather over the EP group (on its backend's device) and one host read."""
        row = torch.tensor([tokens, int(other),
                            CAPACITY_OVERFLOW_POLICIES.index(self.capacity_overflow),
                            self.grow_limit, _free_bytes(device)],
                           dtype=torch.int64, device=collective_device(self.ep_group))
        parts = [torch.empty_like(row) for _ in range(self.ep_size)]
        dist.all_gather(parts, row, group=self.ep_group)
        return torch.stack(parts).cpu()

    def _grow(self, transport: Transport, table, error=None) -> Transport:
        """The grow every rank of the EP group takes alike from ``table``
        (:meth:`_gather_window_needs`): T_MAX = the largest T, rounded up to a power of two
        and capped at the smallest grow limit; the shared transport of that size replaces
        ``transport`` (collective creation; ``transport`` stays open for the backward of its
        handles). Returns the new transport; rank 0 of the group logs one line.

        Raises:
            TooManyTokensError: on every rank, when the largest T is over the grow limit, or
                the windows would not fit in the free memory of some rank (the old windows
                stay: the call can be retried with fewer tokens).
        """
        tokens = [int(t) for t in table[:, 0]]
        needed = max(tokens)
        who = tokens.index(needed)
        old = transport.cfg.max_tokens_per_rank
        over = {r: t for r, t in enumerate(tokens) if t > old}
        limit = int(table[:, 3].min())

        def refuse(why):
            return TooManyTokensError(
                f"efa-ep: EFA_EP_CAPACITY_OVERFLOW=grow cannot grow the EP windows from {old} "
                f"tokens per rank for rank {who}'s {needed}: {why}",
                needed=over, max_tokens_per_rank=old)

        if needed > limit:
            raise refuse(f"EFA_EP_GROW_MAX_TOKENS_PER_RANK={limit} (the smallest of the EP "
                         f"group) is the most it grows to; raise it, or pass fewer tokens per "
                         f"rank") from error
        new = min(_next_power_of_two(needed), limit)
        try:
            want = _window_bytes_at(transport, new)
        except (TransportError, ValueError) as e:
            raise refuse(f"windows for {new} tokens per rank: {e}") from error
        free = [(int(f), r) for r, f in enumerate(table[:, 4]) if int(f) >= 0]
        if want and free and want > min(free)[0]:
            have, poorest = min(free)
            raise refuse(f"windows for {new} tokens per rank take about {_size(want)} per rank "
                         f"and rank {poorest} has {_size(have)} free; pass fewer tokens per rank "
                         f"or lower EFA_EP_GROW_MAX_TOKENS_PER_RANK") from error
        grown = grow_shared_transport(transport, self.ep_group, new, self.transport_options)
        if dist.get_rank(self.ep_group) == 0:
            logging.getLogger("efa_ep").warning(
                "efa-ep: grew EP windows from %d to %d tokens per rank (rank %d needed %d)",
                old, new, who, needed)
        return grown

    def dispatch_postprocess(self, hidden_states, probs):
        """recv_x [N, H], recv_topk_weights [N, K] -> (expert-major rows, tokens_per_expert [L]
        int64 CPU, permuted_probs [rows] in the router's probs dtype). Local.

        Drop-and-pad: the rows already are Megatron's padded layout; ``tokens_per_expert`` is
        ``W * C`` for every local expert, built on the host from the config (no count read)."""
        if self.drop_and_pad:
            self.tokens_per_expert = torch.full(
                (self.num_local_experts,), self.ep_size * self.capacity, dtype=torch.long)
            if self.overlap_1f1b:
                hidden_states = hidden_states.clone()  # the 1F1B schedule frees its input
            return hidden_states, self.tokens_per_expert, probs.to(self.probs_dtype)
        n, num_local = hidden_states.shape[0], self.num_local_experts
        recv_topk_idx = self.handle.recv_topk_idx  # [N, K] int64 local expert ids, -1 elsewhere
        valid = recv_topk_idx >= 0
        # Column L collects unused slots so they never overwrite a real expert's entry.
        cols = torch.where(valid, recv_topk_idx, num_local)
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
        """Expert outputs [rows, H] -> [N, H], each received row summed over its local experts.
        Drop-and-pad: unchanged (token_combine scatters the padded rows)."""
        if self.drop_and_pad:
            return hidden_states
        return unpermute(hidden_states, self.sorted_indices,
                         restore_shape=torch.Size([self.handle.num_recv_tokens,
                                                   hidden_states.shape[-1]]),
                         routing_map=self.local_routing_map, fused=self.fused)

    def token_combine(self, hidden_states):
        """[N, H] (drop-and-pad: [L * W * C, H]) -> [T, H]: rows back to their sources, float32
        sum over ranks ascending."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        # The transport that made the handle combines it (windows and offsets belong to it).
        if self.drop_and_pad:
            out = _CombinePadded.apply(hidden_states, self.transport, self.handle,
                                       self.padded_layout)
        else:
            out = _Combine.apply(hidden_states, self.transport, self.handle)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
        return out

    def combine_postprocess(self, hidden_states):
        """[T, H] -> the original ``hidden_states`` shape, plus the shared experts' output when
        they are overlapped."""
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output
