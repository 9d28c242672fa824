"""Bad input on one rank of a ``gda`` group: every rank raises the same
:class:`~efa_ep.kernels.base.DispatchInputError`, with the offending rank's own words, and the
transport stays usable.

How the words travel: the launch gate's board (:class:`~.gate.LaunchGate`). A dispatch carries
a bad status in the window header, so every rank sees which ranks refused after its count read
and reads their words from the board (a value error found on the device is described by its
own rank after that read, then posted). An op without a status in the window (combine, cached
dispatch, weight combine) is refused on the host: the offending rank posts its words and the
op's bad flag, then still takes part in the op as a signal-only op (:func:`signal_only_op`),
so every epoch stays in step; every rank checks the flag once past the op's gate
(:func:`raise_if_refused`). Without the gate (``launch_gate=off``) or inside a CUDA graph
capture only the dispatch's status travels: a refused combine breaks the transport and the
peers' waits expire.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..base import DispatchInputError, describe_status, describe_value_errors, group_input_error
from .gate import OP_KINDS, PeerTimeoutError


def dispatch_input_error(tr, epoch: int, bad: dict, error: Optional[str], topk_idx,
                         topk_weights) -> DispatchInputError:
    """The one error of a refused dispatch, the same on every rank.

    Args:
        tr: the :class:`~.transport.GdaTransport`. epoch: the dispatch's op number.
        bad: ``{source rank: its non-zero header status}``. error: this rank's host-side words
            (already posted), or None. topk_idx, topk_weights: this rank's inputs (``[T, K]``,
            on the device), described when the device found this rank's values bad (syncs:
            error path only).
    """
    cfg, gate, me = tr.cfg, tr._gate, tr.rank
    words = {}
    if error is not None:
        words[me] = error
    elif me in bad:
        words[me] = describe_value_errors(cfg, me, topk_idx, topk_weights) or \
            f"rank {me}: {describe_status(bad[me], cfg.num_experts)}"
        if gate is not None:
            gate.post_text(epoch, words[me])
    for s in sorted(bad):
        if s != me:  # a peer's words never coming (it died first): its status stands in
            text = gate.text_of(s, epoch, tr.timeout_s) if gate is not None else None
            words[s] = text or f"rank {s}: {describe_status(bad[s], cfg.num_experts)}"
    return group_input_error(f"gda dispatch (op {epoch})", words)


def refuse(tr, msg: str, kind: str) -> None:
    """This rank's input to an op of ``kind`` without a status in the window is bad (``msg``
    names the rank, the tensor and what was expected): takes part in the op without rows and
    raises the group's error, or, without the gate, breaks the transport and raises ``msg``."""
    if tr._gate is None or tr._capturing:
        tr._break(msg, tr._epoch + 1, kind)
        raise DispatchInputError(msg)
    epoch = tr._begin_op(kind)
    tr._gate.mark_bad(epoch, msg)
    signal_only_op(tr, epoch, kind)
    raise_if_refused(tr, epoch, kind)


def signal_only_op(tr, epoch: int, kind: str) -> None:
    """Op ``epoch`` moving no data: one single-program store launch that only signals every
    peer (one row routed nowhere), the launch gate, and the wait for every peer's signal."""
    kern = tr._kern
    if getattr(tr, "_no_rows", None) is None:
        tr._no_rows = (torch.zeros(1, 16, dtype=torch.uint8, device=tr.device),
                       torch.full((1, tr.world_size), -1, dtype=torch.int64, device=tr.device))
    row, nowhere = tr._no_rows
    kern.dispatch_store(row, None, None, nowhere, None, None, None, tr._buf_ptrs, tr._sig_ptrs,
                        tr._done[0:1], **tr._offs[epoch % 2], me=tr.rank,
                        t_max=tr.cfg.max_tokens_per_rank, num_local=tr.cfg.num_local_experts,
                        **tr._op(epoch), with_meta=False, num_programs=1)
    tr._issued(epoch, kind)
    kern.wait_for_sources(tr._my_sig, tr._err, **tr._op(epoch), kind=kind, **tr._wait_args())


def raise_if_refused(tr, epoch: int, kind: str) -> None:
    """After an op without a status in the window, past its launch gate: raises the group's
    :class:`DispatchInputError` if a rank refused op ``epoch`` (this rank's outputs of the op
    are then garbage; nobody returns them). One shared-memory read when nobody did."""
    gate = tr._gate
    if gate is None or tr._capturing or not gate.bad_at(epoch):
        return
    words = {}
    for s in range(tr.world_size):
        text = gate.text_of(s, epoch, 0.0)  # posted before the flag: present or absent
        if text is not None:
            words[s] = text
    raise group_input_error(f"gda {kind} (op {epoch})", words)


def raise_missing(tr, bits: int, record: int) -> None:
    """Raises :class:`~.gate.PeerTimeoutError` for the error word ``(bits, record)`` of
    transport ``tr`` (no-op if ``bits`` is 0), breaking it: the op whose wait expired, its
    kind and the source ranks that never signalled."""
    if not bits:
        return
    epoch, kind = divmod(int(record), 8)
    what = OP_KINDS.get(kind, "op")
    missing = [s for s in range(tr.world_size) if (bits >> s) & 1]
    msg = (f"rank {tr.rank}: gda {what} (op {epoch}) gave up after {tr.timeout_s:g}s "
           f"waiting for source rank(s) {missing}: they never signalled (crashed, hung, or "
           f"skipped this collective call); outputs of that op and later ones are NaN")
    tr._break(msg, epoch, what)
    raise PeerTimeoutError(msg)
