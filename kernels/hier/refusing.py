"""``hier``'s operations under the group's status exchange, without waiting for it first.

Every rank of the EP group must raise together when one rank's input is bad, and no rank may
wait in a stage for a peer that will never come. The exchange (each rank's status word to every
rank of the EP group, :func:`~efa_ep.kernels.base.start_agreement`) is started without waiting,
the op's two stages run on the rail and the node, then the exchange's result decides. A rank
whose own input was refused still calls both stages: a dispatch with no rows (every stage
accepts them), an op along a handle (combine, weight combine, cached dispatch) with no handle,
which each stage's own checks refuse on every rank of the stage's group (its status exchange);
those ranks then call their next stage with no handle too. In two steps (node then rail, or
rail then node) every rank has called each stage once, so no stage waits for a missing peer,
and the exchange names the rank and its input on every rank. A stage that refused for a reason
of its own (the exchange then finds every input good) raises its own error on the ranks it
reached.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..base import DispatchInputError, finish_agreement, start_agreement


class RefusingStages:
    """The stage calls of one op of ``hier`` (a :class:`~efa_ep.kernels.hier.transport.
    HierTransport`) under its started status exchange (see the module); ``error``: this rank's
    refusal of its own input, or None; ``payload``: integers that ride to each rank with the
    status word (:func:`~efa_ep.kernels.base.start_agreement`). :meth:`complete` runs the op's
    stages, each through :meth:`run`, then waits for the exchange; a body that needs the
    payload waits for it itself (:meth:`status`) once both stages were called."""

    def __init__(self, hier, op: str, error: Optional[str], payload=None):
        hier._begin(op)
        self.hier, self.op = hier, op
        self.refused = error is not None  # from here on every stage is called to refuse
        self.stage_error: Optional[DispatchInputError] = None
        self._pending = start_agreement(hier.group, error, hier._ctl, payload)
        self._outcome = None  # (received payload, None) or (None, the exchange's exception)

    def run(self, fn, rows, handle):
        """``fn(rows, handle)`` through ``hier._stage``, or, once this op was refused on this
        rank, ``fn`` with no rows and no handle (the stage refuses it on every rank of its
        group). Returns the stage's output, or None when it refused."""
        if self.refused:
            rows, handle = torch.empty(0), None
        try:
            return self.hier._stage(fn, rows, handle)
        except DispatchInputError as e:
            self.refused = True
            self.stage_error = self.stage_error or e
            return None

    def status(self):
        """Waits for the exchange once (later calls repeat its outcome): raises the group's
        input error when a rank's input was bad, else returns the payload the ranks sent this
        rank (``[W, P]`` int64 numpy, untrusted). Call it only after every stage was called
        (a peer may be waiting in one for this rank)."""
        if self._outcome is None:
            try:
                self._outcome = (self.hier._stage(finish_agreement, self._pending,
                                                  f"hier {self.op}"), None)
            except Exception as e:  # noqa: BLE001 (kept and raised again to every caller)
                self._outcome = (None, e)
        received, error = self._outcome
        if error is not None:
            raise error
        return received

    def complete(self, body):
        """``body()`` (the op's stages through :meth:`run`), then the exchange: raises the
        group's input error on every rank when a rank's input was bad, else a stage's own
        refusal where one was raised; returns ``body``'s result. When a stage failed otherwise
        (a peer missing its deadline: hier is broken by it), that failure is raised, after the
        exchange's wait (collective and started), whose own failure it would only repeat."""
        try:
            out = body()
        except DispatchInputError as e:  # a stage's refusal outside run(): the group's error wins
            self.stage_error, out = self.stage_error or e, None
        except BaseException:
            try:
                self.status()
            except Exception:  # noqa: BLE001 (the stage's failure is the one to report)
                pass
            raise
        self.status()
        if self.stage_error is not None:
            raise self.stage_error
        return out
