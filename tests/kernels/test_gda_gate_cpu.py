"""The gda launch gate's board between real processes (gloo group, shared memory; no GPU): the
issued slots, and the bad-input words every rank reads so that all raise the same error.

What is pinned: a rank that refuses op ``e`` is seen by a peer past the gate of ``e`` (the flag
is written before the publish), its words arrive intact and a length a peer wrote beyond the
slot is bounded; ranks that issued different kinds of one op all raise the same
:class:`ProtocolError`; op ``e + 1`` of the other parity does not disturb op ``e``'s words; a text
that never comes gives None within the wait, and at once when that rank has failed."""
import time

import pytest
import torch.distributed as dist

from efa_ep.distributed import run_ranks
from efa_ep.kernels.base import ProtocolError
from efa_ep.kernels.gda.gate import TEXT_SLOT_BYTES, LaunchGate, wait_record

WORDS = "rank 1: combine input y must be [12, 16] torch.float32, got [13, 16] \u00e9"


def _board_worker(rank, world):
    gate = LaunchGate(dist.group.WORLD, rank, world)
    out = {}
    if rank == 1:
        gate.mark_bad(3, WORDS)
        gate.post_text(4, "x" * (2 * TEXT_SLOT_BYTES))  # other parity; cut to the slot
    gate.publish(wait_record(3, "combine"))
    gate.wait(wait_record(3, "combine"), 30.0, "combine")
    out["bad3"] = gate.bad_at(3)
    out["bad5"] = gate.bad_at(5)
    out["text3"] = gate.text_of(1, 3, 0.0)
    gate.publish(wait_record(4, "combine"))
    gate.wait(wait_record(4, "combine"), 30.0, "combine")
    out["bad4"] = gate.bad_at(4)
    out["len4"] = len(gate.text_of(1, 4, 0.0) or "")
    t0 = time.monotonic()
    out["never"] = gate.text_of(0, 7, 0.2)  # nobody posts op 7
    out["never_s"] = time.monotonic() - t0
    dist.barrier()
    if rank == 0:
        gate.fail(9 * 8 + 1)
    dist.barrier()
    t0 = time.monotonic()
    out["failed_text"] = gate.text_of(0, 9, 30.0)  # rank 0 failed: no 30 s wait
    out["failed_s"] = time.monotonic() - t0
    dist.barrier()
    gate.close()
    return out


def _corrupt_length_worker(rank, world):
    gate = LaunchGate(dist.group.WORLD, rank, world)
    if rank == 1:
        gate.post_text(2, "short words")
        off = gate._text_off + (2 * 1 + 0) * TEXT_SLOT_BYTES
        stamp = memoryview(gate._mm)[off:off + 16].cast("q")
        stamp[1] = 1 << 40  # a peer's length is untrusted
        stamp.release()
    dist.barrier()
    text = gate.text_of(1, 2, 5.0)
    dist.barrier()
    gate.close()
    return text


def _desync_worker(rank, world):
    gate = LaunchGate(dist.group.WORLD, rank, world)
    kind = "combine" if rank == 0 else "cached dispatch"
    gate.publish(wait_record(2, kind))
    try:
        gate.wait(wait_record(2, kind), 30.0, kind)
        out = "passed"
    except ProtocolError as e:
        out = str(e)
    dist.barrier()
    gate.close()
    return out


def test_ranks_in_different_operations_get_the_same_protocol_error():
    outs = run_ranks(_desync_worker, 3, timeout_s=120, pg_timeout_s=30)
    assert len(set(outs)) == 1, outs
    assert "combine on rank(s) [0]" in outs[0] and "cached dispatch on rank(s) [1, 2]" in outs[0]


def test_bad_input_words_reach_every_rank_intact():
    outs = run_ranks(_board_worker, 2, timeout_s=120, pg_timeout_s=30)
    for r, o in enumerate(outs):
        assert o["bad3"] and not o["bad5"] and not o["bad4"], (r, o)
        assert o["text3"] == WORDS, (r, o["text3"])
        assert o["len4"] == TEXT_SLOT_BYTES - 16, (r, o["len4"])
        assert o["never"] is None and o["never_s"] < 10, (r, o)
    assert outs[1]["failed_text"] is None and outs[1]["failed_s"] < 10, outs[1]


def test_a_peer_length_beyond_the_slot_is_bounded():
    outs = run_ranks(_corrupt_length_worker, 2, timeout_s=120, pg_timeout_s=30)
    for text in outs:
        assert text is not None and text.startswith("short words"), text
        assert len(text.encode("utf-8", "replace")) <= TEXT_SLOT_BYTES - 16


#: tokens each of 3 ranks passes to regular dispatches 1..6 (None: a refused input, no ids)
SIZES = [(5, 5, 5), (30, 1, 1), (1, 1, 1), (None, 1, 25), (1, 1, 1), (2, 2, 2)]
#: rows_in_window=auto compact from 40 rows (rows = T * min(W, K), K = 2):
#: dispatch c is compact when dispatch c - 1 sent 40 rows or more on some rank
COMPACT = [False, False, True, False, True, False]


def _sizes_worker(rank, world):
    import random
    import types

    import torch

    from efa_ep.kernels.gda.compact import compact_now

    gate = LaunchGate(dist.group.WORLD, rank, world)
    tr = types.SimpleNamespace(_gate=gate, world_size=world, _compact_rows=40)
    rng = random.Random(rank)
    out = []
    for c, sizes in enumerate(SIZES, start=1):
        time.sleep(rng.random() * 0.02)  # ranks out of step: a peer may post the next size first
        t = sizes[rank]
        idx = None if t is None else torch.zeros(t, 2, dtype=torch.int64)
        out.append(compact_now(tr, idx))
        # the op itself: published, then the gate (every rank issued it)
        gate.publish(wait_record(c, "dispatch"))
        gate.wait(wait_record(c, "dispatch"), 30.0, "dispatch")
    out.append(gate.next_dispatch(3))  # dispatch 7: 6's largest, 2 tokens x min(3, 2)
    gate.publish(wait_record(7, "dispatch"))
    gate.wait(wait_record(7, "dispatch"), 30.0, "dispatch")
    if rank == 1:  # a slot holding another dispatch's size (a rank that made other calls)
        gate._slots[gate._size_base[1] + 2] = 99
    dist.barrier()
    out.append(gate.next_dispatch(3))  # dispatch 8: no answer on any rank
    dist.barrier()
    gate.close()
    return out


def test_rows_in_window_auto_picks_the_same_way_on_every_rank():
    """``rows_in_window=auto``: each regular dispatch stores compact when the previous one was
    large on some rank, and every rank reaches the same answer from the sizes the ranks posted
    on the board, with ranks out of step (a peer already posting the next size), a rank whose
    input is refused, and a rank large alone; a slot stamped with another dispatch gives no
    size."""
    outs = run_ranks(_sizes_worker, 3, timeout_s=120, pg_timeout_s=30)
    for r, o in enumerate(outs):
        assert o[:len(SIZES)] == COMPACT, (r, o)
        assert o[len(SIZES):] == [4, -1], (r, o)
