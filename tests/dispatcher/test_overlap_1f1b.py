"""1F1B EP-communication overlap (``overlap_moe_expert_parallel_comm``) with the efa dispatcher,
through Megatron's real combined-1F1B schedule, on CPU (gloo, EP 2 as two processes, bf16).

Megatron's ``forward_backward_no_pipelining`` runs 4 micro-batches of a 3-layer GPTModel (MoE in
every layer, top-2 of 4 experts) through ``combined_1f1b_schedule_for_no_pipelining``: each
layer split into pre_dispatch / dispatch / mlp / combine nodes detached from each other,
micro-batch m + 1's forward nodes run between micro-batch m's backward nodes (the middle layer
with itself), and the schedule frees the inputs of the dispatch and mlp nodes after their
forward (real ``resize_(0)`` here too). The schedule's CUDA-only calls (comm stream, events,
``record_stream``, one ``device="cuda"`` counter) get CPU stand-ins
(:func:`efa_ep.testing.overlap_1f1b.cpu_schedule`); everything else is Megatron's. What the
streams and events add on a GPU is covered by ``test_overlap_1f1b_gpu.py``.

Asserted, on every rank: the per-micro-batch losses and every parameter's gradient of efa with
the overlap are bitwise those of efa without it and of Megatron's ``alltoall`` with and without
it (top-2: same rows, same order, same float32 combine), in dropless and drop-and-pad mode, with
``delay_wgrad_compute`` (a no-op for the local spec's linears, whose ``backward_dw`` does
nothing: their weight gradients are computed in the backward itself), and with the config
keeping ``alltoall`` under ``EFA_EP_REPLACE_DISPATCHER=alltoall``.
"""
import pytest

from efa_ep.distributed import run_ranks
from efa_ep.testing.overlap_1f1b import compare_arms, schedule_worker

NUM_MICROBATCHES = 4
PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)


def _arm(name, dispatcher, overlap, **kw):
    return dict(name=name, dispatcher=dispatcher, overlap=overlap, **kw)


def _check(results, overlap_names, efa_names):
    for rank, arms in enumerate(results):
        ref = arms[0]
        for arm in arms:
            assert arm["forward_steps"] == NUM_MICROBATCHES, arm["name"]
            if arm["name"] in overlap_names:
                # Every micro-batch went through the combined-1F1B schedule, 3 of its 5 phases
                # pair a forward and a backward in each of the 3 layers, and the middle layer
                # ran with itself in each of those 3.
                assert arm["schedule_plans"] == NUM_MICROBATCHES, arm["name"]
                assert (arm["pairs"], arm["same_layer_pairs"]) == (9, 3), arm
            else:
                assert arm["schedule_plans"] == 0 and arm["pairs"] == 0, arm["name"]
            want = "EfaTokenDispatcher" if arm["name"] in efa_names else "MoEAlltoAllTokenDispatcher"
            assert arm["dispatchers"] == [want], (arm["name"], arm["dispatchers"])
            if arm is not ref:
                err = compare_arms(ref, arm, rank)
                assert err is None, err


def test_1f1b_overlap_dropless_bitwise():
    arms = [_arm("alltoall", "alltoall", False),
            _arm("alltoall+1f1b", "alltoall", True),
            _arm("efa", "efa", False),
            _arm("efa+1f1b", "efa", True),
            _arm("efa+1f1b+delay_wgrad", "efa", True, config=dict(delay_wgrad_compute=True)),
            # A stack that validates the type string keeps "alltoall" and still gets efa.
            _arm("efa(as alltoall)+1f1b", "alltoall", True,
                 env={"EFA_EP_REPLACE_DISPATCHER": "alltoall"})]
    results = run_ranks(schedule_worker, 2, (arms, NUM_MICROBATCHES), timeout_s=400)
    _check(results, {"alltoall+1f1b", "efa+1f1b", "efa+1f1b+delay_wgrad", "efa(as alltoall)+1f1b"},
           {"efa", "efa+1f1b", "efa+1f1b+delay_wgrad", "efa(as alltoall)+1f1b"})
    for arms_of_rank in results:
        assert all(a["transports"] == ["torch"] for a in arms_of_rank if "efa" in a["name"])


def test_1f1b_overlap_drop_and_pad_bitwise():
    arms = [_arm("alltoall pad", "alltoall", False, config=PAD),
            _arm("alltoall pad+1f1b", "alltoall", True, config=PAD),
            _arm("efa pad+1f1b", "efa", True, config=PAD)]
    results = run_ranks(schedule_worker, 2, (arms, NUM_MICROBATCHES), timeout_s=400)
    _check(results, {"alltoall pad+1f1b", "efa pad+1f1b"}, {"efa pad+1f1b"})


def test_overlap_is_accepted_and_fp32_refused_by_megatron():
    """The efa dispatcher no longer refuses the overlap; Megatron's own checks (applied to
    ``efa`` as to ``alltoall``) still demand bf16/fp16 and EP > 1."""
    import efa_ep  # noqa: F401
    from efa_ep.dispatcher.token_dispatcher import check_supported
    from efa_ep.tiny_moe import TinyMoEConfig, transformer_config

    cfg = TinyMoEConfig(num_layers=1, hidden_size=32, num_moe_experts=4, dtype="bf16")
    config = transformer_config(cfg, "efa", 2, overlap_moe_expert_parallel_comm=True)
    check_supported(config)  # no error
    assert config.moe_token_dispatcher_type == "efa"
    with pytest.raises(AssertionError, match="bf16 or fp16"):
        transformer_config(TinyMoEConfig(num_layers=1, hidden_size=32, num_moe_experts=4),
                           "efa", 2, overlap_moe_expert_parallel_comm=True)
    with pytest.raises(AssertionError, match="expert model parallelism"):
        transformer_config(cfg, "efa", 1, overlap_moe_expert_parallel_comm=True)


def test_the_schedule_gets_received_rows_of_their_own():
    """The schedule frees its mlp node's input (the received rows) after the node's forward. A
    transport's rows may share their storage with its handle's data (gda's one allocation) or
    be its window (gda's rows_in_window): with the overlap, token_dispatch hands on copies, so
    freeing them leaves the transport's memory alone; without it, the rows as received."""
    import types

    import torch

    from efa_ep.dispatcher.token_dispatcher import EfaTokenDispatcher

    storage = torch.arange(40, dtype=torch.float32)  # rows and the handle's layout, one storage
    recv_x, layout = storage[:24].view(6, 4), storage[24:]
    recv_w = storage[:12].view(6, 2)
    for overlap in (True, False):
        fake = types.SimpleNamespace(
            shared_experts=None, drop_and_pad=False, overlap_1f1b=overlap,
            _dispatch_growing=lambda x, p: ("transport", (recv_x, recv_w, None, "handle")))
        x, w = EfaTokenDispatcher.token_dispatch(fake, torch.zeros(3, 4), torch.zeros(3, 2))
        assert torch.equal(x, recv_x) and torch.equal(w, recv_w)
        shared = x.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
        assert shared != overlap, overlap
        if overlap:
            x.untyped_storage().resize_(0)  # what the schedule does
            assert torch.equal(layout, torch.arange(24, 40, dtype=torch.float32))
