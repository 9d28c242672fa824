"""``hier``'s routing bookkeeping on the host: the routing copied from the device once, the flat
send layout its handle reports, the rows its local stage forwards per source node, and the
index arrays copied to the device at once. Copies between a GPU and the host go through
:class:`PinnedStage` buffers that live as long as the transport."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch


class PinnedStage:
    """Pinned host buffers of one transport, reused by every call: one per purpose (``name``),
    grown to the largest size asked for. Why: a pinned allocation per copy (``pin_memory``,
    ``torch.empty(pin_memory=True)``) is host time on every op, a pageable copy
    (``Tensor.cpu()``) is slower still. Before a buffer is written again, the upload that last
    read it (:meth:`uploaded`) is waited for; a download is read only after the caller's
    synchronization. One thread at a time (the transport's calls)."""

    def __init__(self):
        self._bufs: Dict[str, torch.Tensor] = {}
        self._reads: Dict[str, torch.cuda.Event] = {}

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A pinned CPU tensor of ``shape`` and ``dtype`` on buffer ``name`` (its previous
        contents are no longer read by the device)."""
        read = self._reads.pop(name, None)
        if read is not None:
            read.synchronize()
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < nbytes:
            grown = max(nbytes, 2 * buf.numel() if buf is not None else 0, 64)
            buf = self._bufs[name] = torch.empty(grown, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes].view(dtype).view(tuple(int(s) for s in shape))

    def uploaded(self, name: str, device) -> None:
        """Marks buffer ``name`` as read by copies queued on ``device``'s current stream."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        self._reads[name] = ev


def routing_on_host(topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    stage: Optional[PinnedStage] = None):
    """``(ids, weights)`` as numpy arrays (``[T, K]`` int64 and float32, shapes already
    checked): a device's routing copied into pinned memory (``stage``'s buffers, valid until
    its next call, else new ones) with one synchronization of the current stream, a host's
    viewed in place."""
    if not topk_idx.is_cuda:
        return topk_idx.detach().numpy(), topk_weights.detach().numpy()
    if stage is None:
        idx = torch.empty(topk_idx.shape, dtype=torch.int64, pin_memory=True)
        w = torch.empty(topk_weights.shape, dtype=torch.float32, pin_memory=True)
    else:
        idx = stage.take("routing ids", topk_idx.shape, torch.int64)
        w = stage.take("routing weights", topk_weights.shape, torch.float32)
    idx.copy_(topk_idx.detach(), non_blocking=True)
    w.copy_(topk_weights.detach(), non_blocking=True)
    torch.cuda.current_stream(topk_idx.device).synchronize()
    return idx.numpy(), w.numpy()


def _sent_to(idx: np.ndarray, experts_per_rank: int, ranks: int) -> np.ndarray:
    """``[T, ranks]`` bool: token t goes to rank r (it holds one of the token's experts; ``idx``
    ``[T, K]`` int64 numpy, -1 none): the contract's send layout, each rank once."""
    t = idx.shape[0]
    dest = np.where(idx >= 0, idx // experts_per_rank, ranks)
    is_in = np.zeros((t, ranks + 1), dtype=bool)
    is_in[np.arange(t)[:, None], dest] = True
    return is_in[:, :ranks]


def flat_send(idx: np.ndarray, world: int, num_experts: int) -> Tuple[np.ndarray, tuple]:
    """The flat (one hop per rank) send layout of validated routing ``idx`` (``[T, K]`` int64
    numpy) that the handle reports: (send_token_idx ``[S]`` int64 numpy, rank-major, tokens
    ascending; rows per destination rank, ``world`` ints)."""
    is_in_wt = _sent_to(idx, num_experts // world, world).T
    send_token = np.nonzero(is_in_wt)[1].astype(np.int64)
    return send_token, tuple(int(v) for v in is_in_wt.sum(1))


def to_device(arrays: Sequence[np.ndarray], device, stage: Optional[PinnedStage] = None,
              name: str = "indices") -> List[torch.Tensor]:
    """int64 numpy ``arrays`` as tensors on ``device``, in one copy (through pinned memory to a
    GPU: ``stage``'s buffer ``name`` when given, without waiting for it; views of one
    tensor)."""
    arrays = [np.asarray(a, dtype=np.int64) for a in arrays]
    device = torch.device(device)
    if device.type == "cuda" and stage is not None:
        host = stage.take(name, (sum(len(a) for a in arrays),), torch.int64)
        np.concatenate(arrays, out=host.numpy())
        t = host.to(device, non_blocking=True)
        stage.uploaded(name, device)
    else:
        t = torch.from_numpy(np.concatenate(arrays))
        if device.type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for a in arrays:
        out.append(t[at:at + len(a)])
        at += len(a)
    return out


def forward_counts(ids: torch.Tensor, num_recv_net: Sequence[int], experts_per_rank: int,
                   node_size: int, stage: Optional[PinnedStage] = None) -> np.ndarray:
    """``[G, N]`` int64 numpy: of the network stage's received rows (``ids`` ``[R, K]`` int64,
    any device, the node's expert ids, -1 none; ``num_recv_net[m]`` rows from node m,
    node-major), how many the local stage sends to each of the node's ``node_size`` ranks
    (``experts_per_rank`` experts each): a row goes to every local rank that holds one of its
    experts, once (the contract's send layout). A device's ids are copied through ``stage``
    (one synchronization of the current stream) when given."""
    g = node_size
    if ids.is_cuda and stage is not None:
        host = stage.take("received ids", ids.shape, torch.int64)
        host.copy_(ids, non_blocking=True)
        torch.cuda.current_stream(ids.device).synchronize()
        ids = host.numpy()
    else:
        ids = ids.cpu().numpy()
    upto = np.zeros((ids.shape[0] + 1, g), dtype=np.int64)
    np.cumsum(_sent_to(ids, experts_per_rank, g), axis=0, out=upto[1:])
    bounds = np.concatenate([[0], np.cumsum(num_recv_net)])
    return np.ascontiguousarray((upto[bounds[1:]] - upto[bounds[:-1]]).T)
