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
