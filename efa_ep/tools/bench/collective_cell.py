"""The raw collective arm (``nccl``, or ``a2a:gloo`` for CPU tests): ``all_to_all_single`` of
the bytes dispatch + combine move, checked against the ``torch`` transport and timed."""
from __future__ import annotations

from typing import Any, Dict

from .arms import nccl_arm_refusal
from .cells import Cell
from .rank import (RankContext, all_ranks_ok, cell_inputs, compare_to_reference, finish_record,
                   library_sm_note, sm_budget, time_cell, void_record)


def pack_rows(x_SD, topk_idx_SK, topk_weights_SK):
    """Dispatch rows as the wire carries them: ``[S, D*elem + 8K + 4K]`` uint8, each row its
    payload bytes, then K int64 local expert ids, then K float32 weights (bit patterns)."""
    import torch

    def as_bytes(t):
        return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)

    return torch.cat([as_bytes(x_SD), as_bytes(topk_idx_SK), as_bytes(topk_weights_SK)], dim=1)


def unpack_rows(rows_SB, hidden: int, topk: int, dtype):
    """Inverse of :func:`pack_rows`: ``(x [S, D] dtype, topk_idx [S, K] int64, weights [S, K] f32)``."""
    import torch

    nx = hidden * torch.empty((), dtype=dtype).element_size()
    x = rows_SB[:, :nx].contiguous().view(dtype)
    idx = rows_SB[:, nx:nx + 8 * topk].contiguous().view(torch.int64)
    w = rows_SB[:, nx + 8 * topk:].contiguous().view(torch.float32)
    return x, idx, w


def run_collective_cell(ctx: RankContext, cell: Cell) -> Dict[str, Any]:
    """The raw collective arm: ``all_to_all_single`` of the bytes dispatch + combine move.

    Dispatch-sized exchange: each sent row with its routing metadata (:func:`pack_rows`), with
    the torch transport's per-destination row counts; then a combine-sized exchange of the
    received payload rows back to their sources. Send buffers are built before the boundary
    (no index_select, no reduction inside: this is the floor of moving the same bytes). Checked
    before timing: the received rows, ids and weights equal the torch transport's dispatch
    outputs, and the combine-sized exchange returns exactly the rows sent.
    """
    import torch
    import torch.distributed as dist

    from efa_ep.kernels.base import compute_send_layout

    if ctx.backend != cell.arm.collective:
        raise RuntimeError(f"arm {cell.arm.name} needs a {cell.arm.collective} process group, this "
                           f"rank's group is {ctx.backend}: "
                           + (nccl_arm_refusal(ctx.backend) if cell.arm.collective == "nccl" else ""))
    x, idx, w = cell_inputs(ctx, cell, ctx.rank)
    ref = ctx.transport("torch", (), cell)
    r_recv_x, r_recv_idx, r_recv_w, _, r_handle = ref.dispatch(x, idx, w)
    num_send, num_recv = list(r_handle.num_send_per_rank), list(r_handle.num_recv_per_rank)
    layout = compute_send_layout(idx, cell.num_experts, ctx.world, num_rows=sum(num_send))
    send_x = x.index_select(0, layout.send_token_idx_S)
    send_w = torch.where(layout.send_topk_idx_SK >= 0, w.index_select(0, layout.send_token_idx_S),
                         torch.zeros((), dtype=torch.float32, device=w.device))
    send_rows = pack_rows(send_x, layout.send_topk_idx_SK, send_w)
    recv_rows = send_rows.new_empty((sum(num_recv), send_rows.shape[1]))
    back_x = send_x.new_empty(send_x.shape)
    combine_rows = r_recv_x.contiguous()  # identity experts: combine sends the received rows back
    err = None
    try:
        dist.all_to_all_single(recv_rows, send_rows, num_recv, num_send)
        dist.all_to_all_single(back_x, combine_rows, num_send, num_recv)
        got_x, got_idx, got_w = unpack_rows(recv_rows, cell.hidden, cell.topk, x.dtype)
        for name, got, want in (("recv_x", got_x, r_recv_x), ("recv_topk_idx", got_idx, r_recv_idx),
                                ("recv_topk_weights", got_w, r_recv_w),
                                ("combine_rows", back_x, send_x)):
            err = err or compare_to_reference(name, got, want)
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    ok = all_ranks_ok(err is None)
    totals = [None] * ctx.world
    dist.all_gather_object(totals, (sum(num_send), sum(num_send) * send_rows.shape[1],
                                    sum(num_send) * send_x.shape[1] * send_x.element_size()))
    rec: Dict[str, Any] = {
        "check": {"status": "pass" if ok else "fail", "detail": err},
        "dispatch_rows": sum(t[0] for t in totals),
        "dispatch_bytes": sum(t[0] for t in totals) * cell.hidden * x.element_size(),
        "net_counts": None,
        "collective_bytes": {"dispatch": sum(t[1] for t in totals),
                             "combine": sum(t[2] for t in totals),
                             "row_bytes_dispatch": int(send_rows.shape[1]),
                             "row_bytes_combine": int(send_x.shape[1] * send_x.element_size()),
                             "note": "all ranks' bytes per D+C: dispatch rows carry payload + K "
                                     "int64 ids + K float32 weights, combine rows the payload"},
        "sm_budget": sm_budget(ctx, None, "all_to_all_single through " + library_sm_note(ctx.backend)),
        "transport_info": {"op": "torch.distributed.all_to_all_single", "backend": ctx.backend,
                           "exchanges": ["dispatch-sized", "combine-sized"]},
    }
    if not ok:
        return void_record(rec, err or "a peer rank's check failed")

    def once():
        dist.all_to_all_single(recv_rows, send_rows, num_recv, num_send)
        dist.all_to_all_single(back_x, combine_rows, num_send, num_recv)

    return finish_record(rec, time_cell(ctx, once, cell))
