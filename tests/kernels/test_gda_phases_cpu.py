"""The launch gate between two native op phases (``GdaPhases._gated``), with stand-ins for the
programs and the transport (the real ones need a GPU; ``test_gda_gpu.py`` runs them).

What is pinned: when the native call passed the gate, the second phase is not launched again;
when a peer was late, the transport's own gate wait (deadline, failed peers) runs before the
second phase is launched, and its errors propagate without a launch; the time waiting for peers
is counted as blocked; a completion word that never comes breaks the transport with an error
naming the op."""
import types

import pytest

from efa_ep.kernels import native_launch as nl
from efa_ep.kernels.gda import phases as ph


class _Prog:
    def __init__(self, log, name, status=None, flag_seen=True):
        self.log, self.name, self.status, self.flag_seen = log, name, status, flag_seen

    def run_gated(self, values, second, values2, stream, gate, world, rank, record, spin_ns,
                  flag, value, wait_ns):
        self.log.append(("gated", self.name, second.name, gate, record, flag, value))
        return self.status, 0.5, 0.25

    def run(self, values, stream):
        self.log.append(("run", self.name, values))

    def run_wait(self, values, stream, flag, value, wait_ns):
        self.log.append(("wait", self.name, values, flag, value))
        return 0.125 if self.flag_seen else None


def _phases(log, fail=None):
    def await_peers(epoch, kind):
        log.append(("await", epoch, kind))
        if fail is not None:
            raise fail

    def device_late(epoch, kind, waited_s):
        log.append(("late", epoch, kind))
        raise TimeoutError(f"op {epoch} {kind}")

    tr = types.SimpleNamespace(_gate=types.SimpleNamespace(address=4096), world_size=2, rank=1,
                               blocked_s=0.0, _await_peers=await_peers,
                               _device_late=device_late)
    p = ph.GdaPhases.__new__(ph.GdaPhases)
    p.tr, p._dev, p._flag_wait_ns = tr, 0, 10**9
    return p, tr


@pytest.fixture(autouse=True)
def _no_stream(monkeypatch):
    monkeypatch.setattr(ph, "_stream", lambda dev: 0)


def test_gate_passed_in_the_native_call_launches_nothing_more():
    log = []
    p, tr = _phases(log)
    first = (_Prog(log, "store", status=nl.RAN), (1,))
    waited = p._gated(first, _Prog(log, "reduce"), (2,), 7, "combine", 64)
    assert log == [("gated", "store", "reduce", 4096, 7 * 8 + 2, 64, 7 * 8 + 2)]
    assert waited == 0.5 and tr.blocked_s == 0.25


def test_a_late_peer_hands_over_to_the_transport_wait_then_the_second_phase_runs():
    log = []
    p, tr = _phases(log)
    first = (_Prog(log, "front", status=nl.GATE_LATE), (1,))
    waited = p._gated(first, _Prog(log, "header"), (3,), 9, "dispatch", 64)
    assert log[1:] == [("await", 9, "dispatch"), ("wait", "header", (3,), 64, 9 * 8 + 1)]
    assert waited == 0.125
    log.clear()
    p._gated((_Prog(log, "store", status=nl.GATE_LATE), (1,)), _Prog(log, "reduce"), (4,), 10,
             "combine")
    assert log[1:] == [("await", 10, "combine"), ("run", "reduce", (4,))]


def test_a_completion_word_that_never_comes_raises_naming_the_op():
    for status, second in ((nl.FLAG_LATE, True), (nl.GATE_LATE, False)):
        log = []
        p, _ = _phases(log)
        with pytest.raises(TimeoutError, match="op 9 dispatch"):
            p._gated((_Prog(log, "front", status=status), (1,)),
                     _Prog(log, "header", flag_seen=second), (3,), 9, "dispatch", 64)
        assert log[-1] == ("late", 9, "dispatch")


def test_a_gate_failure_raises_without_launching_the_waiting_phase():
    log = []
    p, _ = _phases(log, fail=RuntimeError("rank 0 never issued op 9"))
    with pytest.raises(RuntimeError, match="never issued"):
        p._gated((_Prog(log, "front", status=nl.GATE_LATE), (1,)), _Prog(log, "header"), (3,),
                 9, "dispatch", 64)
    assert [e[0] for e in log] == ["gated", "await"]


def test_no_gate_passes_a_null_address():
    log = []
    p, tr = _phases(log)
    tr._gate = None
    p._gated((_Prog(log, "store", status=nl.RAN), (1,)), _Prog(log, "reduce"), (2,), 3, "combine")
    assert log[0][3] == 0
