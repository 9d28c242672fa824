"""``hier``'s routing bookkeeping on the host: the routing copied from the device once, the flat
send layout its handle reports (whose counts are also the rows the rail peers forward inside
their nodes), and the index arrays copied to the device at once."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import torch


def routing_on_host(topk_idx: torch.Tensor, topk_weights: torch.Tensor):
    """``(ids, weights)`` as numpy arrays (``[T, K]`` int64 and float32, shapes already
    checked): a device's routing copied into pinned memory with one synchronization of the
    current stream, a host's viewed in place."""
    if not topk_idx.is_cuda:
        return topk_idx.detach().numpy(), topk_weights.detach().numpy()
    idx = torch.empty(topk_idx.shape, dtype=torch.int64, pin_memory=True)
    w = torch.empty(topk_weights.shape, dtype=torch.float32, pin_memory=True)
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


def to_device(arrays: Sequence[np.ndarray], device) -> List[torch.Tensor]:
    """int64 numpy ``arrays`` as tensors on ``device``, in one copy (through pinned memory to a
    GPU, without waiting for it; views of one tensor)."""
    flat = np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays])
    t = torch.from_numpy(flat)
    if torch.device(device).type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for a in arrays:
        out.append(t[at:at + len(a)])
        at += len(a)
    return out
