"""The error kinds every transport raises (one hierarchy; ``str(e)`` names the rank)."""
from __future__ import annotations

from typing import Optional


class TransportError(RuntimeError):
    """A transport cannot run here, was set up inconsistently, or a peer misbehaved."""


class TransportUnavailable(TransportError):
    """The named transport cannot run on this machine; the message says why and what to install."""


class ConfigError(TransportError, ValueError):
    """A setting is wrong (an option, an environment variable, a recipe key), found before any
    rank starts or any byte moves. ``str(e)`` is one line naming where, what and the value;
    ``hint`` says what to do (shown on its own line by the command-line tools)."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


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
