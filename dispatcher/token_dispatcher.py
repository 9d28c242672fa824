"""``EfaTokenDispatcher``: Megatron's six-step dispatcher interface over an efa-ep transport.

Workflow (T local tokens, E experts, L = E / EP local experts, K = moe_router_topk, H hidden):

1. dispatch_preprocess: ``routing_map [T, E]`` bool + ``probs [T, E]`` -> ``topk_idx [T, K]``
   int64 (ascending expert ids, -1 padding) and ``topk_weights [T, K]`` float32. Local only.
2. token_dispatch: the transport sends each token once per destination rank (DeepEP-style);
   returns ``recv_x [N, H]`` and ``recv_topk_weights [N, K]``. The only host sync: receive counts.
3. dispatch_postprocess: local permutation into expert-major order, the rows and weights that
   Megatron's ``permute`` would gather from an ``[N, L]`` map, found with one sort of ``[N, K]``
   keys (:func:`~efa_ep.dispatcher.layout.expert_major_order`) -> ``(dispatched_input
   [sum(tokens_per_expert), H], tokens_per_expert [L] int64 CPU, permuted_probs [sum])``. Row
   order inside an expert is (source rank, source token), the same as Megatron's ``alltoall``
   dispatcher, so experts see identical inputs.
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
  saved), dropless step 2 a copy of the received rows (``gda``'s share their storage with the
  handle's layout, or with option ``rows_in_window`` are its window) and drop-and-pad's step 3
  a copy of its rows (the experts save their input): one ``[T, H]`` and one ``[N, H]`` copy per
  layer (drop-and-pad: ``[T, H]`` and ``[L * W * C, H]``), where ``alltoall``'s permutation
  copies ``T * K`` rows.

The arithmetic is unchanged: losses and gradients are bitwise those without the overlap and
those of ``alltoall`` with it (tests/dispatcher/test_overlap_1f1b*.py).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import get_capacity, permute, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

# The autograd functions and layout math live in their own modules; their names stay
# importable from here.
from .autograd_functions import _Combine, _CombinePadded, _Dispatch, _DispatchPadded  # noqa: F401
from .capacity import (
    free_bytes, next_power_of_two, only_too_many_tokens, raise_if_policies_differ, size_text,
    window_bytes_at,
)
from .layout import (  # noqa: F401
    PaddedLayout, expert_major_order, padded_layout, routing_map_to_slots, routing_map_to_topk,
)
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
        self.sorted_indices = None       # [sum(tokens_per_expert)] int64 (fused: TE's row map)
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
        raise_if_policies_differ(policies, "drop-and-pad")
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
            if self.overlap_1f1b:
                # The 1F1B schedule frees the storage of its mlp node's input (these rows)
                # after the node's forward, and may run another micro-batch's combine before
                # this one's permute: gda's rows share one allocation with the handle's layout,
                # or (rows_in_window) are views of its window. The schedule gets rows of their
                # own.
                recv_x, recv_w = recv_x.clone(), recv_w.clone()
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
                                                  other=not only_too_many_tokens(error))
                raise_if_policies_differ([CAPACITY_OVERFLOW_POLICIES[int(p)]
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
                            self.grow_limit, free_bytes(device)],
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
        new = min(next_power_of_two(needed), limit)
        try:
            want = window_bytes_at(transport, new)
        except (TransportError, ValueError) as e:
            raise refuse(f"windows for {new} tokens per rank: {e}") from error
        free = [(int(f), r) for r, f in enumerate(table[:, 4]) if int(f) >= 0]
        if want and free and want > min(free)[0]:
            have, poorest = min(free)
            raise refuse(f"windows for {new} tokens per rank take about {size_text(want)} per "
                         f"rank and rank {poorest} has {size_text(have)} free; pass fewer tokens "
                         f"per rank or lower EFA_EP_GROW_MAX_TOKENS_PER_RANK") from error
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
        num_rows = int(self.tokens_per_expert.sum())  # a CPU tensor: no device sync
        recv_topk_idx = self.handle.recv_topk_idx  # [N, K] int64 local expert ids, -1 elsewhere
        if self.fused:
            return self._permute_fused(hidden_states, probs, recv_topk_idx, num_rows)
        slot, self.sorted_indices = expert_major_order(recv_topk_idx, self.num_local_experts,
                                                       num_rows)
        # Megatron's permute gathers the same rows and weights from an [N, L] map and [N, L]
        # probs; gathering from [N, K] directly skips building both (and their backward).
        permuted = hidden_states.index_select(0, self.sorted_indices)
        permuted_probs = probs.reshape(-1).index_select(0, slot).to(self.probs_dtype)
        return permuted, self.tokens_per_expert, permuted_probs

    def _permute_fused(self, hidden_states, probs, recv_topk_idx, num_rows):
        """``moe_permute_fusion``: Megatron's fused permute (Transformer Engine), which takes
        the ``[N, L]`` routing map and probs; its ``row_id_map`` goes to the fused unpermute."""
        n, num_local = hidden_states.shape[0], self.num_local_experts
        valid = recv_topk_idx >= 0
        # Column L collects unused slots so they never overwrite a real expert's entry.
        cols = torch.where(valid, recv_topk_idx, num_local)
        local_probs = probs.new_zeros((n, num_local + 1)).scatter(
            1, cols, torch.where(valid, probs, torch.zeros((), dtype=probs.dtype, device=probs.device)))
        local_probs = local_probs[:, :num_local].to(self.probs_dtype)
        local_map = torch.zeros(n, num_local + 1, dtype=torch.bool, device=hidden_states.device)
        local_map.scatter_(1, cols, True)
        local_routing_map = local_map[:, :num_local].contiguous()
        permuted, permuted_probs, self.sorted_indices, _, _ = permute(
            hidden_states, local_routing_map, probs=local_probs, num_out_tokens=num_rows,
            fused=True)
        return permuted, self.tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states):
        """Expert outputs [rows, H] -> [N, H], each received row summed over its local experts
        (Megatron's ``unpermute``: from +0.0, in expert order on CPU). Drop-and-pad: unchanged
        (token_combine scatters the padded rows)."""
        if self.drop_and_pad:
            return hidden_states
        return unpermute(hidden_states, self.sorted_indices,
                         restore_shape=torch.Size([self.handle.num_recv_tokens,
                                                   hidden_states.shape[-1]]),
                         fused=self.fused)

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
