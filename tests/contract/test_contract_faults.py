"""The contract's failure kinds (``kernels/base.py``, README 'Threat model') on every transport:
the same exception class for the same fault, whatever the transport.

One launch per transport (EP 2; hier as 2 emulated nodes of one rank, ``proxy`` network over
loopback tcp), every fault on a fresh transport over a group whose timeout is the deadline
(:data:`contract_workers.DEADLINE_S`; ``proxy`` and hier's network stage get it as
``timeout_s``):

- ranks running different operations (rank 0 combines, rank 1 replays the dispatch):
  :class:`ProtocolError` on every rank, then :class:`TransportBroken`;
- a tampered header (rank 1 announces more rows than it sends) and a tampered write after a
  valid header, through each transport's test hook (``torch``: ``_all_to_all``; ``proxy`` and
  hier's network: ``EFA_EP_PROXY_TAMPER``, kinds ``rows`` and ``gen``; gda has none):
  :class:`ProtocolError` on the rank that receives it, then :class:`TransportBroken`;
- a missing peer, after a good round: rank 1 skips the next call (alive, waiting for an event
  the survivors set when done) or exits without closing anything: :class:`PeerFailure` on the
  survivor within the deadline, then :class:`TransportBroken` from every operation, carrying the
  original error.
"""
from __future__ import annotations

import pytest

import contract_workers as cw
from contract_runs import case_params, launch, transport_params


def _faults(transport, case):
    every = launch("faults", transport)
    return {r: every[r].get(case) for r in every}


def _assert_broken(res, rank, original):
    assert res["later"], f"rank {rank}: no later calls recorded"
    for op, later in res["later"].items():
        assert later["kinds"][:1] == ["TransportBroken"], (
            f"rank {rank}: {op} after the failure gave {later['type']} {later['kinds']}: "
            f"{later['message']}")
        assert original in later["message"], (
            f"rank {rank}: {op}'s TransportBroken does not carry the original error: "
            f"{later['message']}")


@pytest.mark.parametrize("transport", transport_params())
def test_ranks_in_different_operations_raise_protocol_error_on_every_rank(transport):
    per_rank = _faults(transport, "desync")
    for r, res in per_rank.items():
        assert "ProtocolError" in res["first"]["kinds"], (
            f"rank {r}: {res['first']['type']} {res['first']['kinds']}: {res['first']['message']}")
    assert len({res["first"]["message"] for res in per_rank.values()}) == 1, per_rank


@pytest.mark.parametrize("transport", transport_params())
def test_broken_after_ranks_in_different_operations(transport):
    for r, res in _faults(transport, "desync").items():
        _assert_broken(res, r, res["first"]["message"])


NO_HOOK = {"gda": "gda has no tamper hook", "gda-window": "gda has no tamper hook"}


@pytest.mark.parametrize("case,transport", case_params(["tamper_header", "tamper_write"]))
def test_tampered_data_is_a_protocol_error_then_broken(case, transport):
    if transport in NO_HOOK:
        pytest.skip(NO_HOOK[transport])
    per_rank = _faults(transport, case)
    victim = per_rank[0]["first"]
    assert "ProtocolError" in victim["kinds"], (
        f"rank 0 (receives the tampered data) raised {victim['type']} {victim['kinds']}: "
        f"{victim['message']}")
    _assert_broken(per_rank[0], 0, victim["message"])
    # the tamperer is not left waiting past the deadline, whatever it sees
    for r, res in per_rank.items():
        assert res["first"]["seconds"] < cw.DEADLINE_S + cw.SLACK_S, (r, res["first"])
        assert res["first"]["type"] is None or "TransportError" in res["first"]["kinds"], (
            r, res["first"])


MODES = ["skip", "exit"]


def _survivors(transport, mode):
    per_rank = _faults(transport, mode)
    return {r: res for r, res in per_rank.items() if r != 1}


@pytest.mark.parametrize("mode,transport", case_params(MODES))
def test_missing_peer_is_a_peer_failure_within_the_deadline(mode, transport):
    for r, res in _survivors(transport, mode).items():
        first = res["first"]
        assert "PeerFailure" in first["kinds"], (
            f"rank {r}: {first['type']} {first['kinds']}: {first['message']}")
        assert first["seconds"] < cw.DEADLINE_S + cw.SLACK_S, (
            f"rank {r}: took {first['seconds']:.2f}s, deadline {cw.DEADLINE_S}s")


@pytest.mark.parametrize("mode,transport", case_params(MODES))
def test_broken_after_missing_peer(mode, transport):
    for r, res in _survivors(transport, mode).items():
        _assert_broken(res, r, res["first"]["message"])


@pytest.mark.parametrize("transport", transport_params())
def test_exited_peer_is_named(transport):
    for r, res in _survivors(transport, "exit").items():
        msg = res["first"]["message"]
        assert "rank 1 " in msg or "rank(s) [1]" in msg, f"rank {r}: {msg}"


@pytest.mark.slow
@pytest.mark.parametrize("transport", transport_params({}, skip=NO_HOOK))
def test_rank_leaving_mid_operation_fails_every_peer_within_the_deadline(transport):
    """EP 4 (hier: 2 nodes x 2): the rank that receives a tampered header raises and stays
    alive; every rank must have raised a contract error within the deadline."""
    per_rank = launch("midop", transport)
    assert any("ProtocolError" in r["first"]["kinds"] for r in per_rank), per_rank
    for r, res in enumerate(per_rank):
        first = res["first"]
        assert first["type"] is None or "TransportError" in first["kinds"], (r, first)
        assert first["seconds"] < cw.DEADLINE_S + cw.SLACK_S, (
            f"rank {r} took {first['seconds']:.2f}s (deadline {cw.DEADLINE_S}s): "
            f"{first['type']}: {first['message'][:300]}")
