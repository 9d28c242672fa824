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


def flat_send(idx: np.ndarray, world: int, num_experts: int) -> Tuple[np.ndarray, tuple]:
    """The flat (one hop per rank) send layout of validated routing ``idx`` (``[T, K]`` int64
    numpy, -1 none) that the handle reports: a token goes to every rank that holds one of its
    experts, once. Returns (send_token_idx ``[S]`` int64 numpy, rank-major, tokens ascending;
    rows per destination rank, ``world`` ints)."""
    t = idx.shape[0]
    dest = np.where(idx >= 0, idx // (num_experts // world), world)  # (world: no expert)
    sent = np.zeros((world + 1, t), dtype=bool)  # [rank, token], rank-major for nonzero
    sent[dest, np.arange(t)[:, None]] = True
    sent = sent[:world]
    return np.nonzero(sent)[1], tuple(sent.sum(1).tolist())


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
