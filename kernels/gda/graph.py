"""CUDA graphs of one gda transport's ops: :func:`capture` (``GdaTransport.capture``) and
:class:`GdaGraph`, which replays them with fresh op numbers."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..base import TransportError

if TYPE_CHECKING:
    from .transport import GdaTransport


class GdaGraph:
    """A CUDA graph of one :class:`GdaTransport`'s ops, made by :meth:`GdaTransport.capture`.

    Attributes:
        outputs: what the captured function returned (static tensors; every replay overwrites
            them, so copy what must outlive the next replay).
        num_ops: op numbers one replay consumes (even).
    """

    def __init__(self, transport: GdaTransport, graph, num_ops: int, outputs, first: int,
                 offset: int):
        self._transport, self.graph, self.num_ops, self.outputs = transport, graph, num_ops, outputs
        self._first, self._offset = first, offset

    def replay(self) -> None:
        """Relaunches the captured sequence on the current stream (collective: every rank
        replays its graph the same number of times, in the same order relative to its eager
        calls). No host sync; deadline expiries are deferred as for eager calls.

        The replay's ops take the next op numbers: when eager calls (or another graph) ran
        since this graph's last replay, one small kernel first moves the device base; when an
        odd number of them ran, one barrier op first restores the window parities the graph
        was captured with (so no op writes the window half a peer may still be reading)."""
        tr = self._transport
        tr._check_usable()
        if tr._epoch + self.num_ops + 1 >= 2**31 - 1:
            raise TransportError(f"rank {tr.rank}: gda epoch counter exhausted; recreate")
        if (tr._epoch - self._first) % 2:
            tr._barrier_op()
        base = tr._epoch - self._offset  # captured op i then runs as op tr._epoch + i
        if base != tr._dev_base:
            tr._op_base.add_(base - tr._dev_base)
            tr._dev_base = base
        tr._epoch += self.num_ops
        self.graph.replay()
        tr._dev_base += self.num_ops
        if tr.check_every_call:
            tr.check_errors("graph replay")


def capture(tr: "GdaTransport", fn, *, warmup: int = 1, pool=None) -> GdaGraph:
    """Captures ``fn()`` (collective: every rank captures the same sequence of calls) in a
    CUDA graph and returns a :class:`GdaGraph` whose ``replay()`` reruns it with one host
    launch; ``GdaGraph.outputs`` is what ``fn`` returned (static tensors, overwritten by
    every replay).

    Inside ``fn``: :meth:`GdaTransport.dispatch_fixed` and :meth:`combine` / :meth:`~GdaTransport.dispatch_cached` /
    :meth:`combine_topk_weights` with its handles, plus any other capturable torch work;
    inputs are read from tensors ``fn`` closes over (fill them before each replay, as with
    any CUDA graph). The regular :meth:`~GdaTransport.dispatch` reads counts on the host and raises.
    ``fn`` first runs ``warmup`` times eagerly (kernel compilation happens there, never
    during capture). The graph's op numbers come from a device counter that the graph
    advances by its op count as its last node, so replays interleave freely with eager
    calls (see :meth:`GdaGraph.replay`); an odd op count is padded with one data-free barrier
    op (window parities must repeat on every replay).

    Why no launch gate on replay: one replay enqueues every store and wait of the sequence
    at once, so a wait depends only on peers' kernels of the same or an earlier replay,
    which are in their streams as soon as the peer's host called ``replay()``. A peer that
    never replays is caught by the device deadline (error word, NaN rows, raised by
    :meth:`~GdaTransport.check_errors`).
    Synchronization: capture synchronizes the device once; replay does not block.
    """
    tr._check_usable()
    if tr._capturing:
        raise TransportError(f"rank {tr.rank}: gda capture() is not re-entrant")
    for _ in range(max(0, int(warmup))):
        first = tr._epoch
        fn()
        if (tr._epoch - first) % 2:
            tr._barrier_op()
    torch.cuda.synchronize(tr.device)
    graph = torch.cuda.CUDAGraph()
    first = tr._epoch
    # captured op i (1-based) carries the number op_base[0] + first - dev_base + i
    offset = first - tr._dev_base
    tr._capturing = True
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()
            if (tr._epoch - first) % 2:
                tr._barrier_op()
            num_ops = tr._epoch - first
            tr._op_base.add_(num_ops)  # captured: every replay advances the base
    except BaseException as e:
        tr._break(f"CUDA graph capture failed ({type(e).__name__}: {e})", tr._epoch, "dispatch")
        raise
    finally:
        tr._capturing = False
    # The captured add never ran: replay() moves the base to what the replay needs.
    return GdaGraph(tr, graph, num_ops, outputs, first, offset)
