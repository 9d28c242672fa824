"""The checked receive of a ``gda`` regular dispatch whose native call did not gather: the
counts its header read checked (untrusted: they come from the peers), then the outputs
allocated and the received rows gathered."""
from __future__ import annotations

import torch

from . import refusal
from ..base import STATUS_OK, ProtocolError


def receive(tr, vals, recv_offsets, epoch: int, k: int, error, topk_idx, topk_weights):
    """A regular dispatch of transport ``tr`` after its count read, when its native call did not
    gather: the counts ``vals`` (the header's info) checked (a source's bad input, error bits,
    counts outside their bounds raise), the outputs allocated and the received rows gathered
    (with ``rows_in_window``: views of the window, see :mod:`.compact`).
    Returns (recv_x, recv_topk_idx, recv_topk_weights, rows sent per destination, rows
    received per source)."""
    cfg, world = tr.cfg, tr.world_size
    if vals[0]:
        tr.check_errors()
    hdr_len = tr.layout.hdr_len
    end = 1 + world * hdr_len
    num_send = vals[end:end + world]
    statuses = vals[1:end:hdr_len]
    if error is not None or any(statuses):
        bad = {s: v for s, v in enumerate(statuses) if v != STATUS_OK}
        raise refusal.dispatch_input_error(tr, epoch, bad, error, topk_idx, topk_weights)
    num_recv = vals[2:end:hdr_len]
    t_max = cfg.max_tokens_per_rank
    if min(num_recv) < 0 or max(num_recv) > t_max:  # peers' counts are untrusted
        msg = (f"rank {tr.rank}: gda dispatch (op {epoch}): source rank(s) "
               f"{[s for s, r in enumerate(num_recv) if not 0 <= r <= t_max]} announced row "
               f"counts {num_recv} outside [0, max_tokens_per_rank={t_max}]")
        tr._break(msg, epoch, "dispatch")
        raise ProtocolError(msg)
    per_expert = vals[end + world:]
    n = sum(num_recv)
    # (row, local expert) pairs: at most k per received row
    if per_expert and (min(per_expert) < 0 or sum(per_expert) > n * k):
        msg = (f"rank {tr.rank}: gda dispatch (op {epoch}): the sources' rows per local "
               f"expert {per_expert} are not counts of the {n} rows received with top-{k}")
        tr._break(msg, epoch, "dispatch")
        raise ProtocolError(msg)
    if tr.rows_in_window:  # stored compact: the rows are in the window (module compact)
        offs = tr._offs[epoch % 2]
        recv_x = tr._region(offs["data_off"], n * cfg.hidden * tr._elem, cfg.dtype)
        recv_idx = tr._region(offs["idx_off"], n * k * 8, torch.int64).view(n, k).clone()
        recv_w = tr._region(offs["w_off"], n * k * 4, torch.float32).view(n, k)
        return recv_x.view(n, cfg.hidden), recv_idx, recv_w, num_send, num_recv
    dev = tr.device
    recv_x = torch.empty(n, cfg.hidden, dtype=cfg.dtype, device=dev)
    recv_idx = torch.empty(n, k, dtype=torch.int64, device=dev)
    recv_w = torch.empty(n, k, dtype=torch.float32, device=dev)
    tr._phases.gather(recv_offsets, recv_x, recv_idx, recv_w, epoch)
    return recv_x, recv_idx, recv_w, num_send, num_recv
