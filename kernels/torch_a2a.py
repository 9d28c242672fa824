"""The ``torch`` transport: the reference, built on ``torch.distributed.all_to_all_single``.

Runs on any backend with all-to-all (gloo on CPU, NCCL on GPU). Three collectives per dispatch:
a count exchange (which also carries each rank's input-validation status, so a bad input on one
rank raises on every rank instead of leaving peers waiting), the rows, and the routing metadata
(local expert ids and the float32 weights' bit patterns packed into one int64 tensor).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from efa_ep.kernels.base import (
    DispatchHandle, DispatchInputError, Transport, compute_send_layout, count_sends,
    describe_value_errors, float_bits_to_int64, int64_to_float_bits, reduce_rows_by_rank,
    validate_dispatch_inputs, value_error_flags,
)

_STATUS_OK, _STATUS_BAD_INPUT = 0, 1


def availability():
    """None: the torch transport runs wherever torch.distributed does."""
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    return None


def exchange_counts(t: Transport, error, topk_idx, topk_weights, device):
    """All-to-all of per-destination headers ``[status, rows, rows per local expert...]``.

    ``status`` carries this rank's input check without a host sync: the host-side check
    (``error``, shapes and dtypes) or the device-side value flags. After the one sync every
    rank knows every peer's status, so a bad input raises on every rank, naming the rank(s),
    and the offending rank raises its own detailed message. Nobody is left waiting.

    Returns:
        (num_send_per_rank list, num_recv_per_rank list, tokens_per_expert [L] int64 CPU).
    """
    cfg, world = t.cfg, t.world_size
    send = torch.zeros(world, 2 + cfg.num_local_experts, dtype=torch.int64, device=device)
    if error is not None:
        send[:, 0] = _STATUS_BAD_INPUT
    else:
        send[:, 0] = value_error_flags(cfg, topk_idx, topk_weights)
        num_per_rank, num_per_expert = count_sends(topk_idx, cfg.num_experts, world)
        send[:, 1] = num_per_rank
        send[:, 2:] = num_per_expert.view(world, cfg.num_local_experts)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=t.group)
    # The one host sync per dispatch (Megatron needs counts on the host): send and receive
    # headers come over together.
    both = torch.stack([send, recv]).cpu()
    send, recv = both[0], both[1]
    if error is None and int(send[0, 0]) != _STATUS_OK:
        error = describe_value_errors(cfg, t.rank, topk_idx, topk_weights)
    if error is not None:
        raise DispatchInputError(error)
    bad = [r for r in range(world) if int(recv[r, 0]) != _STATUS_OK]
    if bad:
        raise DispatchInputError(
            f"rank {t.rank}: EP peer rank(s) {bad} passed invalid dispatch inputs (see their error)")
    return send[:, 1].tolist(), recv[:, 1].tolist(), recv[:, 2:].sum(0)


class TorchTransport(Transport):
    """Reference transport; see ``efa_ep.kernels.base`` for the contract.

    Synchronization: blocking collectives on the current stream (NCCL) or the host (gloo); the
    CPU waits once per dispatch for the counts. Not CUDA-graph capturable.
    """

    name = "torch"

    def dispatch(self, x, topk_idx, topk_weights):
        cfg, world = self.cfg, self.world_size
        error = validate_dispatch_inputs(cfg, self.rank, x, topk_idx, topk_weights,
                                         value_checks=False)
        device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
        num_send, num_recv, tokens_per_expert = exchange_counts(self, error, topk_idx,
                                                                topk_weights, device)
        layout = compute_send_layout(topk_idx, cfg.num_experts, world, num_rows=sum(num_send))
        send_x = x.index_select(0, layout.send_token_idx_S)
        n_recv = sum(num_recv)
        recv_x = x.new_empty((n_recv, x.shape[1]))
        dist.all_to_all_single(recv_x, send_x, num_recv, num_send, group=self.group)
        # Weights travel as exact float32 bit patterns beside the ids: one collective, lossless.
        send_w = torch.where(layout.send_topk_idx_SK >= 0,
                             topk_weights.index_select(0, layout.send_token_idx_S),
                             torch.zeros((), dtype=torch.float32, device=x.device))
        send_meta = torch.cat([layout.send_topk_idx_SK, float_bits_to_int64(send_w)], dim=1)
        k = topk_idx.shape[1]
        recv_meta = send_meta.new_empty((n_recv, 2 * k))
        dist.all_to_all_single(recv_meta, send_meta.contiguous(), num_recv, num_send, group=self.group)
        recv_topk_idx = recv_meta[:, :k].contiguous()
        recv_topk_weights = int64_to_float_bits(recv_meta[:, k:]).contiguous()
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=n_recv, topk_idx=topk_idx,
            send_token_idx=layout.send_token_idx_S, num_send_per_rank=tuple(num_send),
            num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_topk_idx)
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle

    def dispatch_cached(self, x, handle):
        if x.dim() != 2 or x.shape[0] != handle.num_tokens:
            raise DispatchInputError(
                f"rank {self.rank}: cached dispatch input must be [{handle.num_tokens}, D], "
                f"got {tuple(x.shape)}")
        send_x = x.index_select(0, handle.send_token_idx)
        recv_x = x.new_empty((handle.num_recv_tokens, x.shape[1]))
        dist.all_to_all_single(recv_x, send_x, list(handle.num_recv_per_rank),
                               list(handle.num_send_per_rank), group=self.group)
        return recv_x

    def combine(self, y, handle):
        self._check_combine_input(y, handle)
        back = y.new_empty((sum(handle.num_send_per_rank), y.shape[1]))
        dist.all_to_all_single(back, y.contiguous(), list(handle.num_send_per_rank),
                               list(handle.num_recv_per_rank), group=self.group)
        out = reduce_rows_by_rank(back, handle.send_token_idx, handle.num_send_per_rank,
                                  handle.num_tokens)
        return out.to(y.dtype)
