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
policy). A
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
  ``combine_topk_weights`` (:func:`rows_input_error`), and the rows a weight combine sends
  back (:func:`local_weight_grads`);
- the handle's owner: every transport's ``DispatchHandle.state`` is a :class:`HandleState`
  dataclass naming the transport object that made it, checked by
  :meth:`Transport.handle_error` (a handle of another transport object is refused);
- sizes: :func:`ceil_div` (pieces of ``b`` that hold ``a``) and :func:`align_up` (the next
  multiple of an alignment).

Where each piece lives (this module re-exports them; import from here): ``core/errors.py`` the
error kinds, ``core/handles.py`` settings, handles and counters, ``core/routing.py`` routing math
and sizes, ``core/checks.py`` the status word and input checks, ``core/exchange.py`` the status
exchange and checks of what peers send, ``core/contract.py`` the :class:`Transport` base class.
"""
from __future__ import annotations

from .core.errors import (  # noqa: F401
    TransportError, TransportUnavailable, ConfigError, DispatchInputError, TooManyTokensError,
    ProtocolError, PeerFailure, TransportBroken, error_for_errno,
)
from .core.handles import (  # noqa: F401
    TransportConfig, NetOpCounts, NetCounter, HandleState, DispatchHandle, FixedLayoutState,
)
from .core.routing import (  # noqa: F401
    SendLayout, count_sends, compute_send_layout, ranks_in_mask, float_bits_to_int64, int64_to_float_bits,
    reduce_rows_by_rank, ceil_div, align_up, nbytes_of,
)
from .core.checks import (  # noqa: F401
    STATUS_OK, STATUS_BAD_EXPERT_ID, STATUS_NON_FINITE_WEIGHT, STATUS_BAD_INPUT, STATUS_BAD_RECEIVED, STATUS_INPUT_BITS,
    describe_status, validate_dispatch_inputs, value_error_flags, describe_value_errors, rows_input_error, too_many_tokens_message,
    parse_too_many_tokens, group_input_error, agree_on_input, start_agreement, finish_agreement,
    check_group_agreement, collective_device,
)
from .core.exchange import (  # noqa: F401
    H_STATUS, H_OP, H_SEQ, H_K, H_D, H_DTYPE,
    H_REF, H_ROWS, H_AUX, OP_HEADER_FIELDS, OP_CODES, dtype_code,
    new_op_header, exchange_status, check_received_counts, received_metadata_errors,
)
from .core.contract import (  # noqa: F401
    Transport, local_weight_grads,
)

__all__ = [
    "Transport", "TransportConfig", "DispatchHandle", "HandleState", "FixedLayoutState",
    "NetOpCounts", "NetCounter", "SendLayout", "TransportError", "TransportUnavailable", "ConfigError",
    "DispatchInputError", "TooManyTokensError", "ProtocolError", "PeerFailure", "TransportBroken",
    "compute_send_layout", "count_sends", "validate_dispatch_inputs", "value_error_flags",
    "describe_value_errors", "rows_input_error", "group_input_error", "too_many_tokens_message",
    "parse_too_many_tokens", "agree_on_input", "start_agreement", "finish_agreement",
    "check_group_agreement", "reduce_rows_by_rank", "collective_device", "exchange_status",
    "new_op_header", "dtype_code", "check_received_counts", "received_metadata_errors",
    "ranks_in_mask", "OP_CODES", "OP_HEADER_FIELDS", "H_STATUS", "H_OP", "H_SEQ", "H_K", "H_D",
    "H_DTYPE", "H_REF", "H_ROWS", "H_AUX", "STATUS_OK", "STATUS_BAD_EXPERT_ID",
    "STATUS_NON_FINITE_WEIGHT", "STATUS_BAD_INPUT", "STATUS_BAD_RECEIVED", "STATUS_INPUT_BITS",
    "describe_status", "float_bits_to_int64", "int64_to_float_bits", "ceil_div", "align_up",
    "nbytes_of", "error_for_errno", "local_weight_grads",
]
