"""The status word of an operation and the input checks every transport runs: one message
naming the rank, the tensor and what was expected, raised on every rank of the group."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .errors import DispatchInputError, TooManyTokensError, TransportError
from .handles import TransportConfig


# The status word --------------------------------------------------------------------------
#
# One int64 per rank and operation, carried by every transport's count exchange (``torch``: the
# ``H_STATUS`` field of :func:`exchange_status`'s headers; ``proxy``: its wire header;
# ``gda``: word 0 of the header it stores into each peer's window). 0 = fine; otherwise bits:
STATUS_OK = 0
#: an expert id outside [-1, E) (device-computed: :func:`value_error_flags`, gda's layout kernel)
STATUS_BAD_EXPERT_ID = 1
#: a NaN/Inf routing weight (device-computed, as above)
STATUS_NON_FINITE_WEIGHT = 2
#: a host-side input check failed; the rank's own message says which tensor and why
STATUS_BAD_INPUT = 4
#: this rank found data received in an earlier operation invalid (a deferred device check)
STATUS_BAD_RECEIVED = 8
#: the bits that mean "this rank's input was invalid" (the transport stays usable)
STATUS_INPUT_BITS = STATUS_BAD_EXPERT_ID | STATUS_NON_FINITE_WEIGHT | STATUS_BAD_INPUT


def describe_status(bits: int, num_experts: Optional[int] = None) -> str:
    """Words for a non-zero status word, without reading any tensor (a rank that knows only the
    bits, e.g. ``gda`` after its one host copy): ``"expert ids outside ...; NaN/Inf ..."``."""
    words = []
    if bits & STATUS_BAD_EXPERT_ID:
        bound = f"num_experts={num_experts}" if num_experts is not None else "num_experts"
        words.append(f"topk_idx holds expert ids outside -1 (no expert) or 0 <= id < {bound}")
    if bits & STATUS_NON_FINITE_WEIGHT:
        words.append("topk_weights holds NaN/Inf (expected finite float32)")
    if bits & STATUS_BAD_INPUT:
        words.append("a host-side input check failed")
    if bits & STATUS_BAD_RECEIVED:
        words.append("data received in an earlier operation failed validation")
    unknown = bits & ~(STATUS_INPUT_BITS | STATUS_BAD_RECEIVED)
    if unknown:
        words.append(f"unknown status bits {unknown:#x}")
    return "; ".join(words)


def validate_dispatch_inputs(
    cfg: TransportConfig, rank: int, x: torch.Tensor, topk_idx: torch.Tensor,
    topk_weights: torch.Tensor, value_checks: bool = True,
) -> Optional[str]:
    """Checks one rank's dispatch inputs against the contract.

    Returns None when valid, else a message naming the rank, the tensor and what was expected.
    It returns instead of raising so a transport can tell its peers about the failure through
    the count exchange before raising (nobody is left waiting).

    ``value_checks=False`` skips the checks that read tensor values (expert range, NaN), which
    cost a device-to-host sync on GPU; a transport that does so must fold
    :func:`value_error_flags` into its count exchange instead.
    """
    who = f"rank {rank}"
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            return f"{who}: {name} must be a tensor, got {type(t).__name__}"
    if x.dim() != 2 or x.shape[1] != cfg.hidden:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        return f"{who}: x must be [num_tokens, {cfg.hidden}], got {shape}"
    if x.dtype != cfg.dtype:
        return f"{who}: x must be {cfg.dtype} (the transport's dtype), got {x.dtype}"
    t = x.shape[0]
    if t > cfg.max_tokens_per_rank:
        return too_many_tokens_message(rank, t, cfg.max_tokens_per_rank)
    if topk_idx.dim() != 2 or topk_idx.shape[0] != t:
        return f"{who}: topk_idx must be [{t}, K], got {tuple(topk_idx.shape)}"
    if topk_idx.dtype != torch.int64:
        return f"{who}: topk_idx must be torch.int64, got {topk_idx.dtype}"
    if topk_weights.shape != topk_idx.shape:
        return (f"{who}: topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, "
                f"got {tuple(topk_weights.shape)}")
    if topk_weights.dtype != torch.float32:
        return f"{who}: topk_weights must be torch.float32, got {topk_weights.dtype}"
    if topk_idx.device != x.device or topk_weights.device != x.device:
        return (f"{who}: x, topk_idx and topk_weights must share a device, got "
                f"{x.device}, {topk_idx.device}, {topk_weights.device}")
    if value_checks and topk_idx.numel():
        return describe_value_errors(cfg, rank, topk_idx, topk_weights)
    return None


def value_error_flags(cfg: TransportConfig, topk_idx: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
    """Status bits (int64 scalar on the inputs' device, no host sync): ``STATUS_BAD_EXPERT_ID``
    for an expert id outside [-1, E), ``STATUS_NON_FINITE_WEIGHT`` for a NaN/Inf weight.
    :func:`describe_value_errors` explains non-zero flags."""
    if not topk_idx.numel():
        return torch.zeros((), dtype=torch.int64, device=topk_idx.device)
    bad_id = ((topk_idx < -1) | (topk_idx >= cfg.num_experts)).any().to(torch.int64)
    bad_w = (~torch.isfinite(topk_weights)).any().to(torch.int64)
    return bad_id * STATUS_BAD_EXPERT_ID + bad_w * STATUS_NON_FINITE_WEIGHT


def describe_value_errors(cfg: TransportConfig, rank: int, topk_idx: torch.Tensor,
                          topk_weights: torch.Tensor) -> Optional[str]:
    """The value checks with their messages (syncs with the device; error path or CPU)."""
    who = f"rank {rank}"
    if topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= cfg.num_experts:
            bad = hi if hi >= cfg.num_experts else lo
            return (f"{who}: topk_idx holds expert id {bad}; expected -1 (no expert) or "
                    f"0 <= id < num_experts={cfg.num_experts}")
        if not bool(torch.isfinite(topk_weights).all()):
            n_bad = int((~torch.isfinite(topk_weights)).sum())
            return f"{who}: topk_weights holds {n_bad} NaN/Inf value(s); expected finite float32"
    return None


def rows_input_error(rank: int, what: str, t, num_rows: int, *, width: Optional[int] = None,
                     device: Optional[torch.device] = None) -> Optional[str]:
    """The host-side check of a ``[num_rows, D]`` operand of ``combine`` (``y``),
    ``dispatch_cached`` (``x``) or ``combine_topk_weights`` (its gradient); no values read.

    Args:
        rank: this rank (named in the message). what: the operand as the user knows it
            (``"combine input y"``). t: the operand. num_rows: rows the handle expects (N for
            combine, T for a cached dispatch). width: D when it is fixed (K for the weight
            combine), else any. device: the dispatch's device, when the operand must be on it.

    Returns:
        None, or one line naming the rank, the operand, what was expected and what came.
    """
    who = f"rank {rank}"
    if not isinstance(t, torch.Tensor):
        return f"{who}: {what} must be a tensor, got {type(t).__name__}"
    if t.dim() != 2 or t.shape[0] != num_rows or (width is not None and t.shape[1] != width):
        want = f"[{num_rows}, {width if width is not None else 'D'}]"
        return f"{who}: {what} must be {want} (rows of the matching dispatch), got {list(t.shape)}"
    if t.device.type == "meta":
        return f"{who}: {what} must hold data, got a meta tensor"
    if device is not None and t.device != device:
        return f"{who}: {what} must be on {device} (the dispatch's device), got {t.device}"
    return None


def too_many_tokens_message(rank: int, tokens: int, max_tokens_per_rank: int) -> str:
    """The words of a rank whose ``x`` has more rows than T_MAX; every transport's dispatch
    check (:func:`validate_dispatch_inputs`) says it this way, and :func:`parse_too_many_tokens`
    reads it back from the text that reached a peer (``proxy`` carries only text)."""
    return (f"rank {rank}: x has {tokens} tokens > max_tokens_per_rank={max_tokens_per_rank}; "
            f"create the transport with a larger max_tokens_per_rank (Megatron dispatcher: "
            f"EFA_EP_MAX_TOKENS_PER_RANK, or EFA_EP_CAPACITY_OVERFLOW=grow)")


_TOO_MANY_TOKENS = re.compile(r"rank (\d+): x has (\d+) tokens > max_tokens_per_rank=(\d+);")


def parse_too_many_tokens(message: Optional[str]) -> Optional[Tuple[int, int, int]]:
    """``(rank, tokens, max_tokens_per_rank)`` when ``message`` is
    :func:`too_many_tokens_message`'s (its start survives a peer's truncation), else None."""
    m = _TOO_MANY_TOKENS.match(message) if isinstance(message, str) else None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def group_input_error(tag: str, messages) -> DispatchInputError:
    """The one error every rank of the EP group raises when ranks passed invalid input:
    ``"<tag> refused on every rank of the EP group: invalid input on rank(s) [r, ...]: <each
    offending rank's own words>"``. The caller raises it (the transport stays usable).

    A :class:`TooManyTokensError` (its ``needed`` says how many tokens each offending rank
    passed) when every offending rank's words are known here and each is
    :func:`too_many_tokens_message`'s; else a :class:`DispatchInputError`. Either carries
    ``messages``.

    Args:
        tag: the operation, e.g. ``"dispatch #3"`` or ``"proxy combine"``.
        messages: ``{offending rank: its own message}`` (naming the tensor and what was
            expected); None where this rank cannot know the words (that rank's error has them).
    """
    bad = sorted(messages)
    words = "; ".join(messages[r] or f"rank {r}: invalid input (its own error names the tensor)"
                      for r in bad)
    text = f"{tag} refused on every rank of the EP group: invalid input on rank(s) {bad}: {words}"
    parsed = {r: parse_too_many_tokens(messages[r]) for r in bad}
    if bad and all(parsed.values()):
        err: DispatchInputError = TooManyTokensError(
            text, needed={r: p[1] for r, p in parsed.items()},
            max_tokens_per_rank=max(p[2] for p in parsed.values()))
    else:
        err = DispatchInputError(text)
    err.messages = dict(messages)
    return err


def agree_on_input(group, rank: int, tag: str, error: Optional[str], device=None) -> None:
    """For an operation without a status exchange of its own (``hier``: each stage's exchange
    covers only its rail or node): every rank of ``group`` tells whether its input is valid,
    and if any is not, every rank raises the same :func:`group_input_error`.

    Args:
        error: this rank's input error (None when valid). device: where the flags live
            (default :func:`collective_device`).

    Synchronization: one all-to-all of one int64 per rank pair (each rank's status to every
    rank) into one tensor and a host read; the error path adds one ``all_gather_object`` so
    every rank raises the offending ranks' own words.
    """
    finish_agreement(start_agreement(group, error, device), tag)


@dataclasses.dataclass
class PendingAgreement:
    """A status exchange in flight (:func:`start_agreement`); :func:`finish_agreement` ends it.
    ``words``: ``[W, 1 + P]`` int64, row r from rank r (column 0 its status, then its payload
    for this rank)."""

    group: object
    error: Optional[str]
    words: torch.Tensor
    work: object


def start_agreement(group, error: Optional[str], device=None,
                    payload=None) -> PendingAgreement:
    """Starts :func:`agree_on_input`'s exchange without waiting for it (``async_op``): the
    caller may do other collective work on *other* groups meanwhile (every rank the same), then
    calls :func:`finish_agreement`, which waits and raises. Nothing else may run on ``group``
    in between.

    The exchange is an all-to-all of each rank's status word to every rank, an all-gather in
    effect: gloo's all-gather is a ring of W - 1 steps, its all-to-all one step of pairwise
    sends (4 ranks on one host: 0.8 ms against 3.1 ms a call on 2 cores). ``payload``
    (optional, ``[W]`` or ``[W, P]`` integers on the host, numpy or torch): row r rides to rank
    r with the status word, which :func:`finish_agreement` returns (untrusted: the caller
    bounds it)."""
    device = device if device is not None else collective_device(group)
    world = dist.get_world_size(group)
    extra = (np.asarray(payload, dtype=np.int64).reshape(world, -1) if payload is not None
             else np.empty((world, 0), dtype=np.int64))
    words = np.empty((world, 1 + extra.shape[1]), dtype=np.int64)  # (numpy: cheaper per call)
    words[:, 0] = STATUS_BAD_INPUT if error else STATUS_OK
    words[:, 1:] = extra
    mine = torch.from_numpy(words)
    if torch.device(device).type == "cuda":  # (pinned: a pageable copy would sync the stream)
        mine = mine.pin_memory().to(device, non_blocking=True)
    words = torch.empty_like(mine)
    work = dist.all_to_all_single(words, mine, group=group, async_op=True)
    return PendingAgreement(group, error, words, work)


def finish_agreement(pending: PendingAgreement, tag: str):
    """Waits for ``pending`` and raises :func:`group_input_error` on every rank of its group
    when any rank's input was invalid (then one ``all_gather_object`` of the ranks' words).
    Returns the payload the ranks sent this rank: ``[W, P]`` int64 numpy (row r from rank r;
    ``P = 0`` without one), untrusted."""
    pending.work.wait()
    words = pending.words.cpu().numpy()
    status = words[:, 0].tolist()
    if any(status):
        world = len(status)
        msgs = [None] * world
        dist.all_gather_object(msgs, pending.error, group=pending.group)
        raise group_input_error(tag, {r: msgs[r] for r in range(world) if status[r]})
    return words[:, 1:]


def check_group_agreement(cfg: TransportConfig, group, rank: int,
                          resolved_options: Optional[dict] = None) -> None:
    """Refuses setup when the EP group's ranks disagree on the transport configuration.

    Every rank all-gathers its ``cfg.fingerprint()`` (name, sizes, dtype and every option passed
    to ``create_transport``, e.g. ``timeout_s``) plus ``resolved_options``: the values a
    transport actually uses after defaults and environment variables (``EFA_EP_*``), so a knob
    that reached only some ranks through their environment is refused too. A mismatch raises
    on every rank with the ranks named. Bounded by the process group's timeout, never a silent
    hang.
    """
    world = dist.get_world_size(group)
    mine = cfg.fingerprint()
    if resolved_options:
        mine += f" resolved={dict(sorted((str(k), _canonical(v)) for k, v in resolved_options.items()))}"
    fps = [None] * world
    dist.all_gather_object(fps, mine, group=group)
    if len(set(fps)) > 1:
        groups: dict = {}
        for r, fp in enumerate(fps):
            groups.setdefault(fp, []).append(r)
        lines = "; ".join(f"ranks {rs}: {fp}" for fp, rs in groups.items())
        raise TransportError(
            f"rank {rank}: the EP group's ranks disagree on the transport setup: {lines}")


def _canonical(v):
    # 60 and 60.0 are the same deadline: compare numbers by value, not by spelling.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return repr(float(v))


def collective_device(group) -> torch.device:
    """The device that small control tensors (status headers) must live on for ``group``'s
    backend: the current CUDA device for NCCL, the CPU for gloo (and any other backend)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
