"""The test process's side of the conformance suite: which transports run here, one launch per
(transport, kind of launch) shared by every test that reads it, and the parametrization with
the known differences marked.

A launch that fails is remembered as failed (not retried per test): its tests fail with the
launch's error.
"""
from __future__ import annotations

from typing import Dict, Optional

import pytest
import torch

import contract_workers as cw
from efa_ep.distributed import RankFailure, run_ranks

try:
    from markers import requires_gpu  # tests/markers.py (tests/ is on sys.path under pytest)
except ImportError:  # pragma: no cover
    requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_RUNS: Dict[tuple, tuple] = {}


def unavailable(name: str) -> Optional[str]:
    """Why ``name`` cannot run here (hier's network stage here is ``proxy``), or None."""
    from efa_ep.kernels import transport_status

    status = transport_status()
    why = status.get(cw.base_name(name))
    if why is None and name == "hier":
        why = status.get("proxy")
    return why


def launch(kind: str, name: str):
    """Results of launch ``kind`` (``healthy``, ``faults`` or ``midop``) of transport ``name``, run once per
    session. Skips when the transport cannot run here; fails when the launch failed."""
    key = (kind, name)
    if key not in _RUNS:
        why = unavailable(name)
        if why is not None:
            _RUNS[key] = ("skip", f"{name} unavailable here: {why}")
        elif kind == "healthy":
            try:
                _RUNS[key] = ("ok", run_ranks(cw.healthy_worker, cw.HEALTHY_WORLD, (name,),
                                              timeout_s=240, pg_timeout_s=60, env=cw.ENV))
            except RankFailure as e:
                _RUNS[key] = ("fail", f"the {name} launch failed: {e}")
        elif kind == "midop":
            try:
                _RUNS[key] = ("ok", run_ranks(cw.midop_worker, cw.MIDOP_WORLD, (name,),
                                              timeout_s=240, pg_timeout_s=60, env=cw.ENV))
            except RankFailure as e:
                _RUNS[key] = ("fail", f"the {name} mid-operation launch failed: {e}")
        else:
            # the exiting peer reports nothing: rank 0 returns every rank's results
            res = run_ranks(cw.fault_worker, cw.FAULT_WORLD, (name,), timeout_s=240,
                            pg_timeout_s=60, env=cw.ENV, raise_on_error=False)
            ok, val = res[0]
            _RUNS[key] = ("ok", val) if ok else ("fail", f"the {name} fault launch failed: {val}")
    status, value = _RUNS[key]
    if status == "skip":
        pytest.skip(value)
    if status == "fail":
        pytest.fail(value, pytrace=False)
    return value


def transport_params(differences: Optional[Dict[str, str]] = None, skip: Optional[Dict[str, str]] = None):
    """One ``pytest.param`` per transport: gda marked with the GPU markers; a transport in
    ``differences`` (``{name: reason}``) is a strict xfail with that reason (a known difference
    from the contract: a finding, not a weaker assertion); one in ``skip`` is skipped."""
    params = []
    for name in cw.TRANSPORTS:
        marks = []
        if cw.base_name(name) == "gda":
            marks += [requires_gpu, pytest.mark.gpu]
        if differences and name in differences:
            marks.append(pytest.mark.xfail(reason=differences[name], strict=True))
        if skip and name in skip:
            marks.append(pytest.mark.skip(reason=skip[name]))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def case_params(cases, differences: Optional[Dict[tuple, str]] = None):
    """``(case, transport)`` params for every case and transport; ``differences``:
    ``{(case, transport): reason}`` strict xfails."""
    out = []
    for case in cases:
        for p in transport_params():
            name = p.values[0]
            marks = list(p.marks)
            reason = (differences or {}).get((case, name))
            if reason:
                marks.append(pytest.mark.xfail(reason=reason, strict=True))
            out.append(pytest.param(case, name, marks=marks, id=f"{case}-{name}"))
    return out
