"""The ``efa`` dispatcher's autograd functions: each pairs a transport call with its backward.

Dispatch's backward is a combine (plus ``combine_topk_weights`` for the routing weights'
gradient); combine's backward is a dispatch replaying the cached handle. Forward saves only the
transport, the handle and (drop-and-pad) the padded layout on ``ctx``; backward returns one
slot per input. Every rank runs the same transport calls in the same order, forward and
backward: the calls are collective.
"""
from __future__ import annotations

import torch

from .layout import padded_layout, rows_where, scatter_rows


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
        padded_x = rows_where(layout.valid_P, recv_x.index_select(0, layout.src_row_P))
        padded_w = rows_where(layout.valid_P, recv_w[layout.src_row_P, layout.slot_P])
        ctx.transport, ctx.handle, ctx.layout = transport, handle, layout
        ctx.k = recv_idx.shape[1]
        return padded_x, padded_w, handle, layout

    @staticmethod
    def backward(ctx, grad_padded_x, grad_padded_w, _handle, _layout):
        layout, rows, k = ctx.layout, ctx.handle.num_recv_tokens, ctx.k
        grad_window = scatter_rows(layout, grad_padded_x.contiguous(), rows)
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
        return transport.combine(scatter_rows(layout, y.contiguous(), handle.num_recv_tokens),
                                 handle)

    @staticmethod
    def backward(ctx, grad_out):
        window = ctx.transport.dispatch_cached(grad_out.contiguous(), ctx.handle)
        grad_y = rows_where(ctx.layout.valid_P, window.index_select(0, ctx.layout.src_row_P))
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
