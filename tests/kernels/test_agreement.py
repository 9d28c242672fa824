"""The group status exchange (``agree_on_input``, and its split form ``start_agreement`` /
``finish_agreement`` that hier's dispatch runs under its stages): every rank raises the same
error, with the offending ranks' own words, or none does; other groups' collectives may run
while it is in flight. CPU, gloo, 3 ranks."""
import torch
import torch.distributed as dist

from efa_ep.distributed import run_ranks
from efa_ep.kernels.base import (DispatchInputError, agree_on_input, finish_agreement,
                                 start_agreement)


def _split(rank, world, bad_ranks):
    error = f"rank {rank}: my input is wrong" if rank in bad_ranks else None
    pair = dist.new_group([0, 1])  # every rank creates it; only 0 and 1 use it meanwhile
    pending = start_agreement(None, error)
    if rank in (0, 1):  # another group's collective while the exchange is in flight
        t = torch.tensor([rank + 1])
        dist.all_reduce(t, group=pair)
        assert int(t) == 3
    try:
        finish_agreement(pending, "test dispatch")
    except DispatchInputError as e:
        split = str(e)
    else:
        split = None
    try:
        agree_on_input(None, rank, "test dispatch", error)
    except DispatchInputError as e:
        whole = str(e)
    else:
        whole = None
    return split, whole


def test_every_rank_raises_the_same_words_or_none():
    res = run_ranks(_split, 3, args=([2],))
    assert all(r == res[0] for r in res), res
    split, whole = res[0]
    assert split == whole and "invalid input on rank(s) [2]" in split
    assert "rank 2: my input is wrong" in split and "test dispatch" in split
    assert run_ranks(_split, 3, args=([],)) == [(None, None)] * 3
    res = run_ranks(_split, 3, args=([0, 2],))
    assert all(r == res[0] for r in res) and "[0, 2]" in res[0][0]


def _refusing(rank, world, case):
    """hier's ops along a handle (``RefusingStages``) over a stand-in hier whose two stages
    record their calls; ``case`` says what goes wrong on rank 1."""
    from efa_ep.kernels.base import PeerFailure
    from efa_ep.kernels.hier.refusing import RefusingStages

    calls = []
    fake = type("Hier", (), {"group": None, "_ctl": None, "_begin": lambda self, op: None,
                             "_stage": lambda self, fn, *a: fn(*a)})()

    def stage(name, fails):
        def fn(rows, handle):
            calls.append((name, handle))
            if handle is None:  # a stage refuses a call without handle on its group's ranks
                raise DispatchInputError(f"{name}: rank {rank} passed no handle")
            if fails:
                raise fails
            return rows + 1
        return fn

    bad = rank == 1
    error = f"rank {rank}: combine input y is wrong" if bad and case == "own" else None
    first = stage("local", DispatchInputError("local: refused") if bad and case == "stage"
                  else PeerFailure("local: peer gone") if bad and case == "peer" else None)
    second = stage("network", None)
    if case == "outside":  # a stage called outside run() refuses on rank 1, which had bad input
        error = "rank 1: my input is wrong" if bad else None

        def body():
            if bad:
                raise DispatchInputError("a stage said no")
            return 3
    else:
        def body():
            return stages.run(second, stages.run(first, 1, "h1"), "h2")
    stages = RefusingStages(fake, "combine", error)
    try:
        out = stages.complete(body)
    except (DispatchInputError, PeerFailure) as e:
        out = f"{type(e).__name__}: {e}"
    return out, calls


def test_refusing_stages_call_every_stage_and_raise_together():
    """Every rank calls both stages once; after its own input's refusal or a stage's, later
    stages get no handle (they refuse); the group's error wins on every rank; a stage's other
    failure is the one raised (not the exchange's)."""
    ok = run_ranks(_refusing, 2, args=("none",))
    assert ok == [(3, [("local", "h1"), ("network", "h2")])] * 2
    own = run_ranks(_refusing, 2, args=("own",))
    for out, calls in own:
        assert "invalid input on rank(s) [1]" in out and "combine input y is wrong" in out, out
    assert own[1][1] == [("local", None), ("network", None)]  # the bad rank refuses both
    assert own[0][1] == [("local", "h1"), ("network", "h2")]  # (stand-in stages: no spread)
    stage = run_ranks(_refusing, 2, args=("stage",))
    assert stage[1] == ("DispatchInputError: local: refused", [("local", "h1"),
                                                              ("network", None)])
    assert stage[0] == (3, [("local", "h1"), ("network", "h2")])
    peer = run_ranks(_refusing, 2, args=("peer",))
    assert peer[1] == ("PeerFailure: local: peer gone", [("local", "h1")])
    outside = run_ranks(_refusing, 2, args=("outside",))  # the group's error, on both ranks
    assert all("invalid input on rank(s) [1]" in out for out, _ in outside), outside


def _payload(rank, world):
    pending = start_agreement(None, None, payload=[[100 * rank + r, -r] for r in range(world)])
    return finish_agreement(pending, "test dispatch").tolist()


def test_the_payload_rides_to_each_rank():
    """Row r of a rank's payload reaches rank r with the status word, in source rank order."""
    res = run_ranks(_payload, 3)
    for r, got in enumerate(res):
        assert got == [[100 * s + r, -r] for s in range(3)], (r, got)
