"""The status exchange: per-destination int64 headers that every rank enters before any row
moves, so all ranks refuse bad input together; checks of what peers send back."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .checks import STATUS_BAD_INPUT, STATUS_BAD_RECEIVED, STATUS_INPUT_BITS, collective_device, describe_status, group_input_error
from .errors import DispatchInputError, ProtocolError


# The status exchange ---------------------------------------------------------------------
#
# The one rule every operation follows: it starts with a small all-to-all of per-destination
# int64 headers, one row per destination rank, and every rank enters it, even one whose inputs
# are bad (its status field is then set and its data fields are zero). After that exchange every
# rank knows every rank's status, so all of them refuse the operation together, with the same
# message, before any row moves: no peer is left waiting, receives rows of the wrong size (gloo
# aborts the process on that), or pairs its rows with another operation's.
#
# Header fields (one row per destination, int64). The width is the same for every operation of a
# transport (OP_HEADER_FIELDS + extra), so ranks that disagree on the operation still exchange
# equally sized headers and the disagreement is reported, not fatal.
H_STATUS, H_OP, H_SEQ, H_K, H_D, H_DTYPE, H_REF, H_ROWS, H_AUX = range(9)
OP_HEADER_FIELDS = 9

# ``H_STATUS`` holds the status word (``STATUS_*`` above).

OP_CODES = {"dispatch": 1, "combine": 2, "dispatch_cached": 3, "combine_topk_weights": 4}
_OP_NAMES = {v: k for k, v in OP_CODES.items()}
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4,
                torch.int64: 5, torch.int32: 6, torch.uint8: 7, torch.int8: 8}
_DTYPE_NAMES = {v: str(k) for k, v in _DTYPE_CODES.items()}


def dtype_code(dtype) -> int:
    """Small integer naming ``dtype`` in a status header (-1 when not a known dtype)."""
    return _DTYPE_CODES.get(dtype, -1)


def new_op_header(world: int, num_extra: int, device, *, op: str, seq: int, k: int = -1,
                  d: int = -1, dtype=None, ref: int = -1) -> torch.Tensor:
    """``[W, OP_HEADER_FIELDS + num_extra]`` int64 on ``device``, every row filled with the
    fields every destination gets (``H_ROWS``, ``H_AUX`` and the extra fields start at 0)."""
    h = torch.zeros(world, OP_HEADER_FIELDS + num_extra, dtype=torch.int64, device=device)
    h[:, H_OP] = OP_CODES[op]
    h[:, H_SEQ] = seq
    h[:, H_K] = k
    h[:, H_D] = d
    h[:, H_DTYPE] = dtype_code(dtype) if dtype is not None else -1
    h[:, H_REF] = ref
    return h


def _ranks_by_value(col) -> str:
    groups: dict = {}
    for r, v in enumerate(col):
        groups.setdefault(v, []).append(r)
    return ", ".join(f"rank(s) {rs}: {v}" for v, rs in groups.items())


def exchange_status(group, rank: int, op: str, seq: int, header_WF: torch.Tensor,
                    error: Optional[str], describe: Optional[Callable[[int], Optional[str]]] = None,
                    agree: tuple = (), all_to_all: Optional[Callable] = None):
    """The status exchange that starts every operation (see the comment above).

    Args:
        group: the EP process group. rank: this rank in it.
        op: operation name (a key of ``OP_CODES``); seq: this transport's operation counter,
            equal on every rank that runs the same call sequence.
        header_WF: ``[W, F]`` int64 from :func:`new_op_header` on any device; ``H_STATUS`` may
            hold device-computed flags (no sync needed before the exchange).
        error: this rank's host-side input error (None when the host checks passed); sets
            ``STATUS_BAD_INPUT``.
        describe: called with this rank's status bits when they are non-zero but ``error`` is
            None; returns the detailed message (e.g. :func:`describe_value_errors`).
        agree: header fields every rank must send with the same value (``H_K``, ``H_D``,
            ``H_DTYPE``, ``H_REF``); a disagreement is an input error of the group.
        all_to_all: ``fn(out, inp)`` performing the exchange (default
            ``dist.all_to_all_single``); transports pass theirs to wrap failures.

    Returns:
        ``(send_WF, recv_WF)`` int64 CPU tensors: the headers this rank sent (row r went to
        rank r) and received (row r came from rank r).

    Raises (on every rank, with the same message):
        DispatchInputError: a rank's inputs were invalid, or ranks disagree on a field of
            ``agree``. The transport stays usable.
        ProtocolError: ranks ran different operations (op or seq differ), or a rank reported
            invalid received data (``STATUS_BAD_RECEIVED``). The caller marks itself broken.

    Synchronization: one all-to-all on :func:`collective_device` and one host copy of the
    headers (the host must know every status before any row moves). Error paths add one
    ``all_gather_object`` so every rank raises the offending rank's own words.
    """
    device = collective_device(group)
    send = header_WF.to(device)
    if error is not None:
        send[:, H_STATUS] = send[:, H_STATUS] | STATUS_BAD_INPUT
    recv = torch.empty_like(send)
    (all_to_all or (lambda o, i: dist.all_to_all_single(o, i, group=group)))(recv, send)
    both = torch.stack([send, recv]).cpu()
    send, recv = both[0], both[1]
    status = recv[:, H_STATUS].tolist()  # row r came from rank r, so this is every rank's status
    world = len(status)
    tag = f"{op} #{seq}"
    if any(status):
        mine = int(send[0, H_STATUS])
        own = None
        if mine:
            own = error if error is not None else (describe(mine) if describe else None)
            if own is None:
                own = f"rank {rank}: {describe_status(mine)}"
        msgs = [None] * world
        dist.all_gather_object(msgs, own, group=group)
        bad = [r for r in range(world) if status[r]]
        # Bad received data outranks bad input: the transport is broken either way.
        if not any(s & STATUS_BAD_RECEIVED for s in status):
            raise group_input_error(tag, {r: msgs[r] for r in bad if status[r] & STATUS_INPUT_BITS})
        words = "; ".join(m for m in msgs if m)
        raise ProtocolError(
            f"{tag} refused on every rank of the EP group: rank(s) {bad} received invalid data "
            f"earlier: {words}")
    ops = recv[:, H_OP].tolist()
    seqs = recv[:, H_SEQ].tolist()
    if len(set(ops)) > 1 or len(set(seqs)) > 1:
        calls = [f"{_OP_NAMES.get(o, o)} #{q}" for o, q in zip(ops, seqs)]
        raise ProtocolError(
            f"the EP group's ranks are running different operations, refused on every rank "
            f"({_ranks_by_value(calls)}); every rank must issue the same calls in the same order")
    what = {H_K: "top-k K (topk_idx.shape[1])", H_D: "row width D",
            H_DTYPE: "row dtype", H_REF: "handle (the dispatch it came from, by number)"}
    for f in agree:
        col = recv[:, f].tolist()
        if len(set(col)) > 1:
            shown = [_DTYPE_NAMES.get(v, v) for v in col] if f == H_DTYPE else (
                [f"dispatch #{v}" for v in col] if f == H_REF else col)
            raise DispatchInputError(
                f"{tag} refused on every rank of the EP group: ranks disagree on the "
                f"{what[f]}: {_ranks_by_value(shown)}; every rank must pass the same")
    return send, recv


def check_received_counts(rank: int, num_recv_rows_W, num_recv_per_expert_WL, k: int,
                          max_rows: int) -> Optional[str]:
    """Validates a dispatch's received count header before any buffer is sized from it.

    Args:
        num_recv_rows_W: W ints, rows each source announced. num_recv_per_expert_WL: ``[W, L]``
            int64 CPU, (row, local expert) pairs each source announced. k: K. max_rows: the
            most rows one source may send (``max_tokens_per_rank``: a token goes at most once
            to a rank).

    Returns:
        None, or a message naming this rank, the source rank, the field and the bound.
    """
    for src, n in enumerate(num_recv_rows_W):
        per_expert = num_recv_per_expert_WL[src]
        if n < 0 or n > max_rows:
            return (f"rank {rank}: rank {src} announced {n} rows; expected 0 <= rows <= "
                    f"max_tokens_per_rank={max_rows}")
        if bool((per_expert < 0).any()):
            return (f"rank {rank}: rank {src} announced negative per-expert counts "
                    f"{per_expert.tolist()}")
        total = int(per_expert.sum())
        # every received row holds between 1 and K of this rank's experts
        if not (n <= total <= n * k):
            return (f"rank {rank}: rank {src} announced {n} rows but {total} (row, local expert) "
                    f"pairs; expected rows <= pairs <= rows * K (K={k})")
    return None


def received_metadata_errors(recv_topk_idx_NK: torch.Tensor, num_recv_rows_W,
                             num_recv_per_expert_WL: torch.Tensor,
                             num_local_experts: int) -> torch.Tensor:
    """Bitmask (int64 scalar on ``recv_topk_idx``'s device, no host sync) of the source ranks
    whose received rows fail validation: a local expert id outside [-1, L), a row holding
    none of this rank's experts, or per-expert counts that differ from the announced ones.
    Bit r is source rank r (r < 62; higher ranks share bit 62)."""
    dev = recv_topk_idx_NK.device
    world = len(num_recv_rows_W)
    n = recv_topk_idx_NK.shape[0]
    if n == 0 and not bool((num_recv_per_expert_WL != 0).any()):
        return torch.zeros((), dtype=torch.int64, device=dev)
    src = torch.repeat_interleave(torch.arange(world, device=dev),
                                  torch.tensor(list(num_recv_rows_W), device=dev), output_size=n)
    ids = recv_topk_idx_NK
    ok_ids = (ids >= 0) & (ids < num_local_experts)
    bad_row = ((ids < -1) | (ids >= num_local_experts)).any(1) | ~ok_ids.any(1)
    bad_src = torch.zeros(world, dtype=torch.int64, device=dev).index_add_(
        0, src, bad_row.to(torch.int64)) > 0
    key = torch.where(ok_ids, src.unsqueeze(1) * num_local_experts + ids,
                      torch.full_like(ids, world * num_local_experts))
    # index_add_, not bincount: bincount reads its input's max on the host (a sync on CUDA)
    counts = torch.zeros(world * num_local_experts + 1, dtype=torch.int64, device=dev).index_add_(
        0, key.reshape(-1), torch.ones(key.numel(), dtype=torch.int64, device=dev))
    counts = counts[: world * num_local_experts].view(world, num_local_experts)
    bad_src = bad_src | (counts != num_recv_per_expert_WL.to(dev)).any(1)
    # Bit r for source r < 62; sources >= 62 share bit 62 (a sum of distinct powers of two is
    # their OR, and stays below 2**63).
    low = bad_src[:62].to(torch.int64) << torch.arange(min(world, 62), device=dev)
    high = bad_src[62:].any().to(torch.int64) << 62
    return low.sum() + high
