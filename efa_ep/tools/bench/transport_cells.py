"""Cells of the ``transport`` view: an efa-ep transport's dispatch + combine (``gda`` also in
its fixed and CUDA-graph modes), checked against the ``torch`` transport and timed, with the
network counts of one op."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .cells import Cell
from .rank import (RankContext, all_ranks_ok, cell_inputs, compare_to_reference, finish_record,
                   library_sm_note, sm_budget, time_cell, transport_info, void_record)


def run_transport_cell(ctx: RankContext, cell: Cell) -> Dict[str, Any]:
    """One ``transport`` cell on this rank: the arm's dispatch + combine checked bit for bit
    against the ``torch`` transport, its network counts, then timed; returns the record's body."""
    import torch.distributed as dist

    x, idx, w = cell_inputs(ctx, cell, ctx.rank)
    ref = ctx.transport("torch", (), cell)
    r_recv_x, r_recv_idx, r_recv_w, r_tpe, r_handle = ref.dispatch(x, idx, w)
    r_out = ref.combine(r_recv_x, r_handle)
    t = ctx.transport(cell.arm.transport, cell.arm.options, cell)
    err = None
    if cell.arm.mode != "regular":
        return _run_fixed_cell(ctx, cell, t, (x, idx, w), (r_recv_x, r_recv_idx, r_recv_w, r_tpe,
                                                           r_out, r_handle))
    if cell.arm.transport == "torch":
        check = "reference"
    else:
        try:
            recv_x, recv_idx, recv_w, tpe, handle = t.dispatch(x, idx, w)
            out = t.combine(recv_x, handle)
            for name, got, want in (("recv_x", recv_x, r_recv_x), ("recv_topk_idx", recv_idx, r_recv_idx),
                                    ("recv_topk_weights", recv_w, r_recv_w),
                                    ("tokens_per_expert", tpe, r_tpe), ("combine_out", out, r_out)):
                err = err or compare_to_reference(name, got, want)
        except Exception as e:  # a crashing arm voids its cell; peers learn it via all_ranks_ok
            err = f"{type(e).__name__}: {e}"
        check = "pass" if err is None else "fail"
    ok = all_ranks_ok(err is None)
    info = transport_info(cell.arm.transport, t)
    rows = sum(r_handle.num_send_per_rank)
    total_rows = [None] * ctx.world
    dist.all_gather_object(total_rows, rows)
    if cell.arm.transport == "gda":
        budget = sm_budget(ctx, info.get("num_programs"),
                           "gda store/gather grids: min(rows, num_programs) programs per kernel; "
                           "SMs touched <= min(num_programs, device_sm_count)")
    elif cell.arm.transport == "proxy":
        budget = sm_budget(ctx, None, "proxy: rows move through libfabric, posted by native CPU "
                                      "proxy threads (num_channels in transport_info)")
    else:
        budget = sm_budget(ctx, None, f"{cell.arm.transport}: rows move through "
                           + library_sm_note(ctx.backend))
    rec: Dict[str, Any] = {"check": {"status": check if ok else "fail", "detail": err},
                           "dispatch_rows": sum(total_rows),
                           "dispatch_bytes": sum(total_rows) * cell.hidden * x.element_size(),
                           "collective_bytes": None,
                           "net_counts": net_counts(ctx, t, r_handle, cell.hidden * x.element_size()),
                           "sm_budget": budget, "transport_info": info}
    if not ok:
        return void_record(rec, err or "a peer rank's check failed")

    def once():
        rx, _, _, _, h = t.dispatch(x, idx, w)
        t.combine(rx, h)

    rec = finish_record(rec, time_cell(ctx, once, cell))
    rec["host_us"] = host_per_op(ctx, t, lambda: t.dispatch(x, idx, w),
                                 lambda r: t.combine(r[0], r[-1]))
    return rec


def _run_fixed_cell(ctx: RankContext, cell: Cell, t, inputs, ref) -> Dict[str, Any]:
    """A ``gda:fixed`` / ``gda:graph`` cell: ``dispatch_fixed`` + ``combine`` of the window rows
    (in a CUDA graph for ``graph``), checked against the torch reference first: the used window
    rows (``s * T_MAX + j``, ``j < num_recv[s]``) equal the reference's received rows, ids and
    weights, ``tokens_per_expert`` and the combine output are equal bit for bit."""
    import torch
    import torch.distributed as dist

    x, idx, w = inputs
    r_recv_x, r_recv_idx, r_recv_w, r_tpe, r_out, r_handle = ref
    err, graph = None, None
    try:
        t_max = t.cfg.max_tokens_per_rank
        fx, fi, fw, num_recv, ftpe, fh = t.dispatch_fixed(x, idx, w)
        n = num_recv.tolist()
        used = torch.cat([torch.arange(s * t_max, s * t_max + n[s], device=fx.device)
                          for s in range(ctx.world)])
        for name, got, want in (("recv_x", fx[used], r_recv_x), ("recv_topk_idx", fi[used], r_recv_idx),
                                ("recv_topk_weights", fw[used], r_recv_w),
                                ("tokens_per_expert", ftpe.cpu(), r_tpe)):
            err = err or compare_to_reference(name, got, want)
        if cell.arm.mode == "graph":
            graph = t.capture(lambda: t.combine(*_rows_and_handle(t.dispatch_fixed(x, idx, w))),
                              warmup=2)
            graph.replay()
            out = graph.outputs
        else:
            out = t.combine(fx, fh)
        err = err or compare_to_reference("combine_out", out, r_out)
    except Exception as e:  # a crashing arm voids its cell; peers learn it via all_ranks_ok
        err = f"{type(e).__name__}: {e}"
    ok = all_ranks_ok(err is None)
    info = dict(transport_info(cell.arm.transport, t), mode=cell.arm.mode)
    rows = [None] * ctx.world
    dist.all_gather_object(rows, sum(r_handle.num_send_per_rank))
    rec: Dict[str, Any] = {
        "check": {"status": "pass" if ok else "fail", "detail": err},
        "dispatch_rows": sum(rows), "dispatch_bytes": sum(rows) * cell.hidden * x.element_size(),
        "collective_bytes": None, "net_counts": None, "transport_info": info,
        "sm_budget": sm_budget(ctx, info.get("num_programs"),
                               "gda store grids: min(rows, num_programs) programs per kernel; "
                               "waits one program each")}
    if not ok:
        return void_record(rec, err or "a peer rank's check failed")
    if graph is not None:
        return finish_record(rec, time_cell(ctx, graph.replay, cell))

    def once():
        r = t.dispatch_fixed(x, idx, w)
        t.combine(r[0], r[-1])

    rec = finish_record(rec, time_cell(ctx, once, cell))
    rec["host_us"] = host_per_op(ctx, t, lambda: t.dispatch_fixed(x, idx, w),
                                 lambda r: t.combine(r[0], r[-1]))
    return rec


def host_per_op(ctx: RankContext, t, dispatch, combine) -> Optional[Dict[str, float]]:
    """Host time per op of transport ``t``: the wall time of each Python call minus the time
    the transport reports blocked on the device or on peers (``t.blocked_s``), median over the
    config's ``iters`` D+C after a device sync each, slowest rank. None (on every rank) when the
    transport does not report its blocked time. Collective (one all_gather_object)."""
    import statistics
    import time

    import torch.distributed as dist

    if getattr(t, "blocked_s", None) is None:
        return None
    hd, hc = [], []
    for _ in range(int(ctx.cfg["iters"])):
        ctx.barrier()
        if ctx.device.type == "cuda":
            import torch
            torch.cuda.synchronize(ctx.device)
        b0, t0 = t.blocked_s, time.perf_counter()
        r = dispatch()
        b1, t1 = t.blocked_s, time.perf_counter()
        combine(r)
        t2, b2 = time.perf_counter(), t.blocked_s
        hd.append((t1 - t0) - (b1 - b0))
        hc.append((t2 - t1) - (b2 - b1))
    mine = (statistics.median(hd) * 1e6, statistics.median(hc) * 1e6)
    every = [None] * ctx.world
    dist.all_gather_object(every, mine)
    return {"dispatch": round(max(e[0] for e in every), 2),
            "combine": round(max(e[1] for e in every), 2)}


def _rows_and_handle(dispatched):
    """(recv_x, handle) of a ``dispatch_fixed`` result."""
    return dispatched[0], dispatched[-1]


NET_COUNT_FIELDS = ("messages", "rows", "bytes", "writes", "wire_bytes")


def emulated_node_size(ctx: RankContext) -> int:
    """Ranks per node of this run's layout: ``node_size`` when set (emulated nodes), else the
    ranks per host measured at start."""
    return int(ctx.cfg.get("node_size") or ctx.ranks_per_node)


def net_counts(ctx: RankContext, t, ref_handle, row_bytes: int) -> Dict[str, Any]:
    """Network operations and bytes of one dispatch and one combine, summed over the ranks
    (collective: every rank calls it after the arm's checked dispatch + combine).

    ``dispatch``/``combine``: the arm's own counts (``last_op_counts`` of a counting transport:
    proxy, hier; :class:`~efa_ep.kernels.base.NetOpCounts` for the units), each field summed
    over ranks, plus ``messages_max_rank`` (the busiest rank's messages); None for arms that
    do not count. ``per_rank_cross_node``: what a flat design without aggregation sends to
    ranks of other nodes in one dispatch at this layout (from the torch reference's route:
    destination ranks on other nodes with >= 1 row, rows, payload bytes), the figure hier with
    ``aggregate=0`` must equal. ``node_size``: ranks per node of the layout (emulated or
    measured). Units: messages, rows and writes are counts; bytes and wire_bytes are bytes.
    """
    import torch.distributed as dist

    g = emulated_node_size(ctx)
    me = ctx.rank // g
    cross = [int(v) for r, v in enumerate(ref_handle.num_send_per_rank) if r // g != me]
    mine = {"cross": (sum(1 for v in cross if v), sum(cross), sum(cross) * row_bytes)}
    last = getattr(t, "last_op_counts", None)
    for op in ("dispatch", "combine"):
        c = last.get(op) if isinstance(last, dict) else None
        mine[op] = None if c is None else {f: getattr(c, f) for f in NET_COUNT_FIELDS}
    parts: List[Any] = [None] * ctx.world
    dist.all_gather_object(parts, mine)
    out: Dict[str, Any] = {"node_size": g, "num_nodes": ctx.world // g}
    for op in ("dispatch", "combine"):
        if any(p[op] is None for p in parts):
            out[op] = None
            continue
        out[op] = {f: (None if any(p[op][f] is None for p in parts)
                       else sum(p[op][f] for p in parts)) for f in NET_COUNT_FIELDS}
        out[op]["messages_max_rank"] = max(p[op]["messages"] for p in parts)
    out["per_rank_cross_node"] = {f: sum(p["cross"][i] for p in parts)
                                  for i, f in enumerate(("messages", "rows", "bytes"))}
    out["note"] = ("all ranks, one op; messages = (source, destination rank) pairs with >= 1 "
                   "row over the network; bytes = rows x payload row bytes; writes/wire_bytes = "
                   "libfabric writes the proxy queued (headers, rows with routing metadata, "
                   "footers); flat proxy counts every peer (same-node peers go through "
                   "libfabric too), hier only rows that cross nodes")
    return out
