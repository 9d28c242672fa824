"""The transport contract every efa-ep transport implements, and the routing layout they share.

Symbols (used as shape suffixes near the kernels):
    W: EP group size (ranks).            r: a rank of the group, 0 <= r < W.
    E: global experts.                   L = E // W: experts per rank (local experts).
    T: tokens on this rank (may be 0).   H: hidden size.      K: top-k slots per token.
    S: rows this rank sends = number of (token, destination rank) pairs.
    N: rows this rank receives = sum over sources of the rows they send here.

Contract (other code and checks rely on it):

``dispatch(x_TH, topk_idx_TK, topk_weights_TK) -> (recv_x_NH, recv_topk_idx_NK,
recv_topk_weights_NK, tokens_per_expert_L, handle)``

- Experts are split evenly and contiguously: expert ``e`` lives on rank ``e // L`` as local
  expert ``e % L``. A token goes **once** to each destination rank owning at least one of its
  experts (DeepEP-style de-duplication).
- ``recv_x`` rows are ordered by (source rank, source token index). ``recv_topk_idx`` holds
  local expert ids, -1 where the slot's expert lives elsewhere (or was -1 at the source);
  ``recv_topk_weights`` float32, 0 where ``recv_topk_idx`` is -1. ``tokens_per_expert`` is an
  int64 **CPU** tensor counting (received row, local expert) pairs.

``combine(y_NH, handle) -> out_TH``: for each source token, the sum of its rows' ``y`` over
destination ranks in ascending rank order, accumulated in float32 starting from +0.0 and
returned in ``y``'s dtype. Every transport must agree bit for bit with ``torch``.

Two further operations serve autograd (the Megatron dispatcher's backward passes):

- ``dispatch_cached(x_TH, handle) -> recv_x_NH``: replays a dispatch's layout for new rows
  (combine's backward).
- ``combine_topk_weights(grad_NK, handle) -> grad_TK``: returns to each source token, slot by
  slot, the value held by the row of the rank that owns that slot's expert (dispatch's backward
  for the routing weights). The base class implements it with ``combine``.

Fixed layout (static shapes; drop-and-pad training, decode):

``dispatch_fixed(x_TH, topk_idx_TK, topk_weights_TK) -> (recv_x, recv_topk_idx,
recv_topk_weights, num_recv_W, tokens_per_expert_L, handle)``: the same rows as ``dispatch``,
laid out in ``W * T_MAX`` rows (``T_MAX = max_tokens_per_rank``): rows ``s * T_MAX + j`` for
``j < num_recv_W[s]`` hold source s's rows in its token order; every other row has ids -1 and
weights 0 (its ``recv_x`` row is unspecified: mask with ids >= 0). ``num_recv_W`` ``[W]`` and
``tokens_per_expert`` ``[L]`` are int64 **on x's device**. ``combine``, ``dispatch_cached`` and
``combine_topk_weights`` accept the handle, with rows in the same ``[W * T_MAX, D]`` layout (rows
of unused slots are ignored). ``gda`` implements it with no host sync (its result is a view of
its window, valid until its op two calls later); the base class's generic default runs the
regular ``dispatch`` (one host sync, for the counts) and copies the rows into the layout.

Errors. Every operation is collective, and a rank that finds bad input still takes part in the
operation's status exchange (:func:`exchange_status`) with its error set, so every rank raises
the same :class:`DispatchInputError`, naming the offending rank, the tensor and what was
expected, before any row moves; the transport stays usable. When every offending rank's only
fault is more tokens than T_MAX, the error is a :class:`TooManyTokensError` carrying how many
each passed, so a caller can enlarge the windows and replay (the efa dispatcher's ``grow``
policy; gda's other ranks learn no text and see a plain :class:`DispatchInputError`). A
deadline, a dead peer (:class:`PeerFailure`) or received data that fails validation
(:class:`ProtocolError`) breaks the transport on the ranks that see it; later calls raise
:class:`TransportBroken` carrying the original error. Everything received is validated
before use (:func:`check_received_counts`, :func:`received_metadata_errors`).

What every transport shares from here (one definition each):

- the status word of an operation (``STATUS_*`` bits, :func:`describe_status`), which the
  ``torch`` headers, the ``proxy`` wire headers and the ``gda`` window headers all carry;
- the one error every rank raises for a group's bad input (:func:`group_input_error`, and
  :func:`agree_on_input` for a transport without a status exchange of its own);
- the host-side check of a ``[rows, D]`` operand of ``combine`` / ``dispatch_cached`` /
  ``combine_topk_weights`` (:func:`rows_input_error`);
- the handle's owner: every transport's ``DispatchHandle.state`` is a :class:`HandleState`
  dataclass naming the transport object that made it, checked by
  :meth:`Transport.handle_error` (a handle of another transport object is refused);
- sizes: :func:`ceil_div` (pieces of ``b`` that hold ``a``) and :func:`align_up` (the next
  multiple of an alignment).
"""
from __future__ import annotations

import abc
import dataclasses
import functools
import itertools
import re
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist


class TransportError(RuntimeError):
    """A transport cannot run here, was set up inconsistently, or a peer misbehaved."""


class TransportUnavailable(TransportError):
    """The named transport cannot run on this machine; the message says why and what to install."""


class DispatchInputError(TransportError, ValueError):
    """A rank passed tensors that break the contract (shape, dtype, expert range, NaN).

    The transport stays usable: the operation was refused on every rank before any row moved.

    Attributes:
        messages: ``{offending rank: its own words, or None where this rank cannot know them}``
            when the error is a group's (:func:`group_input_error`); None otherwise (e.g. ranks
            that disagree on K, or a check on this rank only).
    """

    messages: Optional[dict] = None


class TooManyTokensError(DispatchInputError):
    """Every offending rank of the EP group passed more tokens than the transport's
    ``max_tokens_per_rank`` (T_MAX), and nothing else is known to be wrong: the windows are too
    small for this call. Raised by :func:`group_input_error`, so on every rank with the same
    message wherever the offending ranks' words reach every rank (``torch``, ``proxy``,
    ``hier``); ``gda``'s window header carries no text, so its other ranks raise a plain
    :class:`DispatchInputError` naming the rank.

    Attributes:
        needed: ``{offending rank: its T}`` (tokens of its ``x``).
        max_tokens_per_rank: the refusing transport's T_MAX.
    """

    def __init__(self, message: str, needed: dict, max_tokens_per_rank: int):
        super().__init__(message)
        self.needed = dict(needed)
        self.max_tokens_per_rank = int(max_tokens_per_rank)


class ProtocolError(TransportError):
    """Data received from a peer failed validation (counts over capacity, per-expert counts that
    disagree with the rows, expert ids out of range), or the ranks ran different operations.
    The transport that raises it is broken afterwards (see :class:`TransportBroken`)."""


class PeerFailure(TransportError):
    """A collective failed: a peer died, closed its connection, or missed the deadline. The
    message names the operation and, where the backend or the host tells, the peer rank(s)."""


class TransportBroken(TransportError):
    """The transport failed earlier (deadline, dead peer, protocol violation) and refuses every
    later call; the message carries the original error. Create a new transport to continue."""


def error_for_errno(code: int, message: str) -> TransportError:
    """The error kind of a failed native wait or transfer (``code``: negative errno): a deadline
    or a lost peer is a :class:`PeerFailure` (``EIO``: the proxy engine failed because a
    channel's writes to a peer failed; the message names the peer), a protocol violation a
    :class:`ProtocolError`, anything else a plain :class:`TransportError`."""
    import errno

    if code in (-errno.ETIMEDOUT, -errno.EIO, -errno.ECONNRESET, -errno.EPIPE,
                -errno.ECONNABORTED, -errno.ENOTCONN, -errno.EHOSTUNREACH):
        return PeerFailure(message)
    if code in (-errno.EPROTO, -errno.EBADMSG):
        return ProtocolError(message)
    return TransportError(message)


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """What every rank of an EP group must agree on; checked at setup across the group.

    Attributes:
        name: transport name (``torch``, ``gda``, ``proxy``).
        world_size: W, ranks in the EP group.
        num_experts: E, global experts; must be a multiple of W.
        hidden: H, row width of ``x`` in elements.
        max_tokens_per_rank: upper bound on T for any rank; sizes fixed windows.
        dtype: dtype of ``x`` rows (``recv_x`` has it too).
        options: transport-specific knobs (sorted (key, value) pairs so the config is hashable).
    """

    name: str
    world_size: int
    num_experts: int
    hidden: int
    max_tokens_per_rank: int
    dtype: torch.dtype
    options: tuple = ()

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    def __post_init__(self):
        if self.world_size < 1:
            raise TransportError(f"world_size={self.world_size} must be >= 1")
        if self.num_experts < 1 or self.num_experts % self.world_size:
            raise TransportError(
                f"num_experts={self.num_experts} must be a positive multiple of the EP group size "
                f"{self.world_size} (experts are split evenly and contiguously over ranks)"
            )
        if self.hidden < 1:
            raise TransportError(f"hidden={self.hidden} must be >= 1")
        if self.max_tokens_per_rank < 0:
            raise TransportError(f"max_tokens_per_rank={self.max_tokens_per_rank} must be >= 0")

    def fingerprint(self) -> str:
        return (
            f"name={self.name} world_size={self.world_size} num_experts={self.num_experts} "
            f"hidden={self.hidden} max_tokens_per_rank={self.max_tokens_per_rank} "
            f"dtype={self.dtype} options={dict(self.options)}"
        )


@dataclasses.dataclass(frozen=True)
class NetOpCounts:
    """What one operation on one rank handed to the network (the cross-node stage), counted by
    the transport on the host while it runs (no extra synchronization; read it after the call).

    Transports that count expose ``last_op_counts`` (``{op: NetOpCounts}``, the most recent call
    of each op on this rank) and ``op_totals()`` (sums since creation). Counts are this rank's
    sends only; sum over the ranks for the group's figure.

    Attributes:
        op: ``dispatch``, ``dispatch_cached``, ``combine`` or ``combine_topk_weights``.
        messages: destination ranks that got at least one row over the network in this op
            (count). A rank's rows to one destination are one message; the proxy cuts it into
            ``chunk_bytes`` writes plus a footer (see ``writes``).
        rows: rows sent over the network (count).
        bytes: payload bytes of those rows (bytes): rows x the bytes of the row moved (dispatch,
            dispatch_cached: D x x's element size; combine: D x y's element size;
            combine_topk_weights: K x 4). Routing metadata, headers and footers are not in it.
        writes: libfabric writes (descriptors) the proxy posted for this op, headers and footers
            included (count); None when no proxy engine carries the network stage.
        wire_bytes: bytes of those writes (bytes): headers, rows with their routing metadata,
            footers; None likewise.
    """

    op: str
    messages: int = 0
    rows: int = 0
    bytes: int = 0
    writes: Optional[int] = None
    wire_bytes: Optional[int] = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class NetCounter:
    """The per-transport record behind ``last_op_counts`` and ``op_totals()`` (host only).

    ``last``: ``{op: NetOpCounts}`` of the most recent call of each op. :meth:`totals`:
    ``{op: {"calls": n, "messages": .., "rows": .., "bytes": .., "writes": .., "wire_bytes": ..}}``
    summed over every call since creation (``writes``/``wire_bytes`` None where never counted).
    """

    _FIELDS = ("messages", "rows", "bytes", "writes", "wire_bytes")

    def __init__(self):
        self.last: dict = {}
        self._totals: dict = {}

    def record(self, counts: NetOpCounts) -> None:
        self.last[counts.op] = counts
        tot = self._totals.setdefault(counts.op, {"calls": 0, **{f: None for f in self._FIELDS}})
        tot["calls"] += 1
        for f in self._FIELDS:
            v = getattr(counts, f)
            if v is not None:
                tot[f] = (tot[f] or 0) + int(v)

    def totals(self) -> dict:
        return {op: dict(t) for op, t in self._totals.items()}


@dataclasses.dataclass(frozen=True)
class HandleState:
    """Base of every transport's ``DispatchHandle.state`` (each transport subclasses it with the
    private state its combine and cached dispatch need: window offsets, message ids, ...).

    Attributes:
        owner: :attr:`Transport.uid` of the transport object that made the handle (unique in
            the process); :meth:`Transport.handle_error` refuses a handle of another object.
    """

    owner: int


@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """What a dispatch leaves for its combine and for both backward passes.

    Attributes:
        num_tokens: T, rows of the dispatch's ``x`` on this rank.
        num_recv_tokens: N, rows received.
        topk_idx: ``[T, K]`` int64, the dispatch's global expert ids (-1 = none), x's device.
        send_token_idx: ``[S]`` int64, x's device: source token of each sent row, grouped by
            destination rank ascending, token index ascending inside a group.
        num_send_per_rank: W ints, rows sent to each rank (host).
        num_recv_per_rank: W ints, rows received from each rank (host).
        recv_topk_idx: ``[N, K]`` int64 local expert ids (-1 elsewhere), x's device.
        state: the transport's private state, a :class:`HandleState` dataclass naming the
            transport object that made the handle (window offsets, message ids, ...).
    """

    num_tokens: int
    num_recv_tokens: int
    topk_idx: torch.Tensor
    send_token_idx: torch.Tensor
    num_send_per_rank: tuple
    num_recv_per_rank: tuple
    recv_topk_idx: torch.Tensor
    state: HandleState


@dataclasses.dataclass(frozen=True)
class SendLayout:
    """Where each token goes, computed locally from ``topk_idx`` (no communication).

    Attributes:
        dest_rank_TK: ``[T, K]`` int64 destination rank of each slot, -1 for an unused slot.
        is_token_in_rank_TW: ``[T, W]`` bool, token t is sent to rank r.
        num_tokens_per_rank_W: ``[W]`` int64 rows sent to each rank.
        num_tokens_per_expert_E: ``[E]`` int64 (token, expert) pairs per global expert.
        send_token_idx_S: ``[S]`` int64 source token of each sent row (rank-major, token order).
        send_rank_S: ``[S]`` int64 destination rank of each sent row.
        send_topk_idx_SK: ``[S, K]`` int64 local expert ids as seen by the destination, -1
            where the slot's expert is on another rank.
        send_slot_TW: ``[T, W]`` int64 row index of (token, rank) inside that rank's block of
            rows from this source, -1 where the token is not sent to the rank.
    """

    dest_rank_TK: torch.Tensor
    is_token_in_rank_TW: torch.Tensor
    num_tokens_per_rank_W: torch.Tensor
    num_tokens_per_expert_E: torch.Tensor
    send_token_idx_S: torch.Tensor
    send_rank_S: torch.Tensor
    send_topk_idx_SK: torch.Tensor
    send_slot_TW: torch.Tensor


def _tokens_in_rank(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    num_local = num_experts // world_size
    # Out-of-range ids count as unused here so that counting never indexes out of bounds; the
    # transport reports them (value_error_flags) before any row moves.
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    dest = torch.where(valid, topk_idx // num_local, torch.full_like(topk_idx, -1))
    is_in = torch.zeros(topk_idx.shape[0], world_size, dtype=torch.bool, device=topk_idx.device)
    if topk_idx.numel():
        rows = torch.arange(topk_idx.shape[0], device=topk_idx.device).unsqueeze(1).expand_as(dest)
        is_in[rows[valid], dest[valid]] = True
    return valid, dest, is_in


def _counts(topk_idx, valid, is_in, num_experts: int):
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_idx.device)
    per_expert.index_add_(0, torch.where(valid, topk_idx, num_experts).reshape(-1),
                          torch.ones(topk_idx.numel(), dtype=torch.int64, device=topk_idx.device))
    return is_in.sum(0).to(torch.int64), per_expert[:num_experts]


def count_sends(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    """Counts only, with no device-to-host sync: ``(num_tokens_per_rank_W [W] int64,
    num_tokens_per_expert_E [E] int64)`` on ``topk_idx``'s device (see :class:`SendLayout`)."""
    valid, _, is_in = _tokens_in_rank(topk_idx, num_experts, world_size)
    return _counts(topk_idx, valid, is_in, num_experts)


def compute_send_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int,
                        num_rows: Optional[int] = None) -> SendLayout:
    """Routing layout of one rank's tokens (the reference the Triton layout kernel must match).

    Args:
        topk_idx: ``[T, K]`` int64, any device; global expert ids, -1 marks an unused slot.
            Must already be validated (ids in [-1, E)).
        num_experts: E. world_size: W.
        num_rows: S if the host already knows it (e.g. after the count exchange): the row
            indices are then built without a device-to-host sync.

    Returns:
        SendLayout on ``topk_idx``'s device. Deterministic: slots come from prefix sums over
        token order, never from atomics.
    """
    num_local = num_experts // world_size
    valid, dest, is_in = _tokens_in_rank(topk_idx, num_experts, world_size)
    num_per_rank, num_per_expert = _counts(topk_idx, valid, is_in, num_experts)
    # Rank-major row order: transpose so that nonzero() walks rank by rank, tokens ascending.
    is_in_t = is_in.t()
    nz = is_in_t.nonzero() if num_rows is None else torch.nonzero_static(is_in_t, size=num_rows)
    send_rank = nz[:, 0].contiguous()
    send_token = nz[:, 1].contiguous()
    # Slot of (token, rank) inside rank's block: exclusive prefix sum down the token axis.
    slot = torch.cumsum(is_in.to(torch.int64), dim=0) - 1
    slot = torch.where(is_in, slot, torch.full_like(slot, -1))
    src_idx = topk_idx[send_token]  # [S, K]
    owner = dest[send_token]
    send_topk = torch.where(
        owner == send_rank.unsqueeze(1), src_idx - send_rank.unsqueeze(1) * num_local,
        torch.full_like(src_idx, -1),
    )
    return SendLayout(dest, is_in, num_per_rank, num_per_expert, send_token, send_rank, send_topk, slot)


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

    Synchronization: one all-gather of one int64 per rank and a host read; the error path adds
    one ``all_gather_object`` so every rank raises the offending ranks' own words.
    """
    device = device if device is not None else collective_device(group)
    world = dist.get_world_size(group)
    flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    mine = torch.tensor([STATUS_BAD_INPUT if error else STATUS_OK], dtype=torch.int64,
                        device=device)
    dist.all_gather(flags, mine, group=group)
    status = torch.cat(flags).tolist()
    if any(status):
        msgs = [None] * world
        dist.all_gather_object(msgs, error, group=group)
        raise group_input_error(tag, {r: msgs[r] for r in range(world) if status[r]})


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


def ranks_in_mask(mask: int, world: int) -> list:
    """Source ranks named by a :func:`received_metadata_errors` bitmask."""
    return [r for r in range(min(world, 63)) if (mask >> min(r, 62)) & 1]


def float_bits_to_int64(w: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 carrying the exact bit pattern (so weights ride with int64 ids)."""
    return w.contiguous().view(torch.int32).to(torch.int64)


def int64_to_float_bits(v: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`float_bits_to_int64`."""
    return v.to(torch.int32).view(torch.float32)


@dataclasses.dataclass(frozen=True)
class FixedLayoutState(HandleState):
    """``DispatchHandle.state`` of the generic :meth:`Transport.dispatch_fixed`.

    Attributes:
        owner: see :class:`HandleState`.
        inner: the handle of the regular dispatch the fixed layout was built from.
        rows_N: ``[N]`` int64, x's device: fixed-layout row (``s * T_MAX + j``) of received row i.
        num_recv_W: ``[W]`` int64, x's device: rows received from each source.
    """

    inner: DispatchHandle
    rows_N: torch.Tensor
    num_recv_W: torch.Tensor


def _accept_fixed_layout(name: str, fn):
    """Wraps a subclass's ``combine`` / ``dispatch_cached`` / ``combine_topk_weights`` so that a
    handle of the generic :meth:`Transport.dispatch_fixed` is translated to its regular handle
    (rows ``[W * T_MAX, D]`` <-> ``[N, D]``, on the tensors' device, no host sync). Other handles
    pass through untouched."""

    @functools.wraps(fn)
    def method(self, t, handle, *args, **kwargs):
        st = getattr(handle, "state", None)
        if not isinstance(st, FixedLayoutState):
            return fn(self, t, handle, *args, **kwargs)
        if name == "dispatch_cached":
            out = fn(self, t, st.inner, *args, **kwargs)
            full = out.new_zeros((handle.num_recv_tokens, out.shape[1]))
            return full.index_copy_(0, st.rows_N, out)
        if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == handle.num_recv_tokens:
            t = t.index_select(0, st.rows_N)
        # else: passed on as is; the regular op refuses its shape on every rank (status exchange)
        return fn(self, t, st.inner, *args, **kwargs)

    method._fixed_layout_aware = True
    return method


class Transport(abc.ABC):
    """Base class of every transport. Subclasses implement ``dispatch``, ``combine`` and
    ``dispatch_cached``; see the module docstring for the contract. ``dispatch_fixed`` has a
    generic default (one host sync); a subclass overrides it to avoid the sync.

    Synchronization: every call is collective over ``group`` and returns once this rank's outputs
    are ready on the current stream; the host learns the receive counts once per dispatch
    (``tokens_per_expert`` is a CPU tensor), so dispatch is not CUDA-graph capturable.
    """

    name: str = "?"
    #: the :class:`HandleState` subclass in the handles this transport's dispatch makes
    state_type: type = HandleState
    #: seconds this transport's calls spent blocked on the device or on peers since it was
    #: created (a call's wall time minus its growth is the host time the call itself costs);
    #: None where the transport does not measure it
    blocked_s: Optional[float] = None

    def __init__(self, cfg: TransportConfig, group):
        self.cfg = cfg
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        #: this transport object's number, unique in the process (``HandleState.owner``)
        self.uid = next(_TRANSPORT_UIDS)
        if self.world_size != cfg.world_size:
            raise TransportError(
                f"rank {self.rank}: group has {self.world_size} ranks, config says {cfg.world_size}")

    def handle_error(self, handle) -> Optional[str]:
        """The owner check of every transport: None when ``handle`` is a :class:`DispatchHandle`
        made by this transport object's dispatch, else one line naming this rank and what the
        handle is instead. Host only; transports route the message through their status
        exchange (so every rank refuses together) or raise it."""
        st = getattr(handle, "state", None)
        if not isinstance(handle, DispatchHandle) or not isinstance(st, self.state_type):
            got = (type(handle).__name__ if not isinstance(handle, DispatchHandle) else
                   f"a DispatchHandle with {type(st).__name__} state (another kind of transport)")
            return (f"rank {self.rank}: handle must be the DispatchHandle returned by this "
                    f"{self.name} transport's dispatch, got {got}")
        if st.owner != self.uid:
            return (f"rank {self.rank}: handle comes from another transport object ({self.name} "
                    f"transport #{st.owner}; this is #{self.uid}): pass a handle to the transport "
                    f"whose dispatch made it")
        return None

    def handle_state(self, handle):
        """``handle.state`` (a :attr:`state_type`) after :meth:`handle_error`; raises its message
        as :class:`DispatchInputError` on this rank only."""
        error = self.handle_error(handle)
        if error is not None:
            raise DispatchInputError(error)
        return handle.state

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Every transport accepts handles of the generic dispatch_fixed without knowing of it.
        for name in ("combine", "dispatch_cached", "combine_topk_weights"):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_fixed_layout_aware", False):
                setattr(cls, name, _accept_fixed_layout(name, fn))

    def dispatch_fixed(self, x, topk_idx, topk_weights):
        """Dispatch into the fixed layout of the module docstring (static shapes).

        Args: as :meth:`dispatch` (``x`` ``[T, H]`` cfg.dtype, ``topk_idx`` ``[T, K]`` int64,
        ``topk_weights`` ``[T, K]`` float32, one device).

        Returns:
            recv_x ``[W * T_MAX, H]`` cfg.dtype (unused rows zero here), recv_topk_idx
            ``[W * T_MAX, K]`` int64 (local ids, -1 unused), recv_topk_weights ``[W * T_MAX, K]``
            float32, num_recv_W ``[W]`` int64, tokens_per_expert ``[L]`` int64 (both on x's
            device), handle (for ``combine`` / ``dispatch_cached`` / ``combine_topk_weights``
            with rows in the same layout).

        Synchronization: this generic default is the regular :meth:`dispatch`, so the host
        blocks once for the counts; the copy into the layout is device-side. Transports that
        can fill the layout without the host (``gda``) override it.
        """
        recv_x, recv_idx, recv_w, tokens_per_expert, h = self.dispatch(x, topk_idx, topk_weights)
        world, t_max, dev = self.world_size, self.cfg.max_tokens_per_rank, recv_x.device
        counts = [int(n) for n in h.num_recv_per_rank]
        rows = torch.cat([torch.arange(n, dtype=torch.int64) + s * t_max
                          for s, n in enumerate(counts)]).to(dev)
        n_rows, k = world * t_max, recv_idx.shape[1]
        out_x = recv_x.new_zeros((n_rows, recv_x.shape[1])).index_copy_(0, rows, recv_x)
        out_idx = torch.full((n_rows, k), -1, dtype=torch.int64, device=dev).index_copy_(
            0, rows, recv_idx)
        out_w = torch.zeros((n_rows, k), dtype=torch.float32, device=dev).index_copy_(
            0, rows, recv_w)
        num_recv = torch.tensor(counts, dtype=torch.int64).to(dev)
        handle = DispatchHandle(
            num_tokens=h.num_tokens, num_recv_tokens=n_rows, topk_idx=h.topk_idx,
            send_token_idx=h.send_token_idx, num_send_per_rank=h.num_send_per_rank,
            num_recv_per_rank=h.num_recv_per_rank, recv_topk_idx=out_idx,
            state=FixedLayoutState(owner=self.uid, inner=h, rows_N=rows, num_recv_W=num_recv))
        return out_x, out_idx, out_w, num_recv, tokens_per_expert.to(dev), handle

    @abc.abstractmethod
    def dispatch(self, x, topk_idx, topk_weights):
        """See the module docstring. Returns (recv_x, recv_topk_idx, recv_topk_weights,
        tokens_per_expert, handle)."""

    @abc.abstractmethod
    def combine(self, y, handle: DispatchHandle):
        """See the module docstring. ``y`` [N, D] (D is usually H) -> [T, D] in y's dtype."""

    @abc.abstractmethod
    def dispatch_cached(self, x, handle: DispatchHandle):
        """Replays ``handle``'s layout: row i of the result is ``x[source token of row i]``."""

    def combine_topk_weights(self, grad_recv_topk_weights, handle: DispatchHandle):
        """``[N, K]`` float32 -> ``[T, K]`` float32: slot k of token t gets the value from the
        row of the rank owning expert ``topk_idx[t, k]`` (0 for unused slots).

        Each slot is non-zero in exactly one destination row once the -1 slots are masked, and
        0.0 + v == v exactly, so a float32 combine returns the values unchanged.
        """
        masked = torch.where(handle.recv_topk_idx >= 0, grad_recv_topk_weights.float(),
                             torch.zeros((), dtype=torch.float32, device=grad_recv_topk_weights.device))
        return self.combine(masked.contiguous(), handle)

    def after_backward(self) -> None:
        """Called by the dispatcher once its backward ops of a layer have been issued (the last
        collective of that layer's backward). Transports that defer device-side errors raise
        them here, so a step never applies gradients computed from rows that did not arrive.
        Default: nothing (errors were raised by the calls themselves)."""

    def close(self) -> None:
        """Releases windows, threads and endpoints. Idempotent."""


_TRANSPORT_UIDS = itertools.count(1)


def reduce_rows_by_rank(rows_SD: torch.Tensor, send_token_idx_S: torch.Tensor,
                        num_send_per_rank, num_tokens: int) -> torch.Tensor:
    """Float32 sum over destination ranks in ascending rank order, starting from +0.0.

    Args:
        rows_SD: ``[S, D]`` rows returned by the ranks, grouped by rank ascending.
        send_token_idx_S: ``[S]`` int64 source token of each row.
        num_send_per_rank: W ints, group sizes.
        num_tokens: T.
    Returns:
        ``[T, D]`` float32. Inside one rank's group each token appears at most once, so
        ``index_add_`` per group adds exactly one value per token: the order is rank order.
    """
    out = torch.zeros(num_tokens, rows_SD.shape[1], dtype=torch.float32, device=rows_SD.device)
    start = 0
    for n in num_send_per_rank:
        if n:
            out.index_add_(0, send_token_idx_S[start:start + n], rows_SD[start:start + n].float())
        start += n
    return out


# Sizes ------------------------------------------------------------------------------------
def ceil_div(a, b):
    """``ceil(a / b)`` for non-negative integers: how many pieces of ``b`` hold ``a`` (chunks of
    a message, token blocks of a grid). Works elementwise on integer numpy arrays and torch tensors
    too."""
    return -(-a // b)


def align_up(n, alignment: int):
    """The smallest multiple of ``alignment`` that is >= ``n`` (byte offsets and sizes of window
    regions). Works elementwise on integer numpy arrays and torch tensors too."""
    return ceil_div(n, alignment) * alignment


def nbytes_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


__all__ = [
    "Transport", "TransportConfig", "DispatchHandle", "HandleState", "FixedLayoutState",
    "NetOpCounts", "NetCounter", "SendLayout", "TransportError", "TransportUnavailable",
    "DispatchInputError", "TooManyTokensError", "ProtocolError", "PeerFailure", "TransportBroken",
    "compute_send_layout", "count_sends", "validate_dispatch_inputs", "value_error_flags",
    "describe_value_errors", "rows_input_error", "group_input_error", "too_many_tokens_message",
    "parse_too_many_tokens", "agree_on_input",
    "check_group_agreement", "reduce_rows_by_rank", "collective_device", "exchange_status",
    "new_op_header", "dtype_code", "check_received_counts", "received_metadata_errors",
    "ranks_in_mask", "OP_CODES", "OP_HEADER_FIELDS", "H_STATUS", "H_OP", "H_SEQ", "H_K", "H_D",
    "H_DTYPE", "H_REF", "H_ROWS", "H_AUX", "STATUS_OK", "STATUS_BAD_EXPERT_ID",
    "STATUS_NON_FINITE_WEIGHT", "STATUS_BAD_INPUT", "STATUS_BAD_RECEIVED", "STATUS_INPUT_BITS",
    "describe_status", "float_bits_to_int64", "int64_to_float_bits", "ceil_div", "align_up",
    "nbytes_of",
]
