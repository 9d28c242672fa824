"""What a transport is built with and what a dispatch hands to the later ops of its
layout: the settings agreed by every rank, the handle and its per-transport state, network
counters."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .errors import TransportError


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
        self._last: dict = {}    # op -> NetOpCounts, or the five counts add() took (built late)
        self._totals: dict = {}  # op -> [calls, then the five sums (None: never counted)]

    @property
    def last(self) -> dict:
        """``{op: NetOpCounts}`` of the most recent call of each op."""
        out = {}
        for op, c in self._last.items():
            out[op] = c if isinstance(c, NetOpCounts) else NetOpCounts(op, *c)
        return out

    def last_of(self, op: str) -> Optional[tuple]:
        """The five counts (messages, rows, bytes, writes, wire_bytes) of ``op``'s most recent
        call, or None: :attr:`last`'s entry without building every op's record."""
        c = self._last.get(op)
        if c is None or not isinstance(c, NetOpCounts):
            return c
        return tuple(getattr(c, f) for f in self._FIELDS)

    def record(self, counts: NetOpCounts) -> None:
        self._last[counts.op] = counts
        self._sum(counts.op, tuple(getattr(counts, f) for f in self._FIELDS))

    def add(self, op: str, messages: int, rows: int, nbytes: int, writes: int,
            wire_bytes: int) -> None:
        """:meth:`record` of ``NetOpCounts(op, messages, rows, nbytes, writes, wire_bytes)``
        without building it (the per-op hot path: Python ints only)."""
        counts = (messages, rows, nbytes, writes, wire_bytes)
        self._last[op] = counts
        self._sum(op, counts)

    def _sum(self, op: str, counts) -> None:
        tot = self._totals.get(op)
        if tot is None:
            tot = self._totals[op] = [0, None, None, None, None, None]
        tot[0] += 1
        for i, v in enumerate(counts, 1):
            if v is not None:
                tot[i] = (tot[i] or 0) + int(v)

    def totals(self) -> dict:
        return {op: dict(zip(("calls",) + self._FIELDS, t)) for op, t in self._totals.items()}


_new, _set = object.__new__, object.__setattr__


def frozen_with(cls, fields: dict):
    """An instance of the frozen dataclass ``cls`` whose fields are ``fields`` (every field by
    name, defaults included), set at once: the per-op hot path's handle and state. A frozen
    dataclass's own ``__init__`` sets each field through ``object.__setattr__``, about 2 us for a
    handle and its state on a fast host. No ``__post_init__`` runs: for classes without one."""
    obj = _new(cls)
    _set(obj, "__dict__", fields)
    return obj


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
