"""1F1B EP-communication overlap (``overlap_moe_expert_parallel_comm``) with the efa dispatcher on
a GPU: Megatron's ``forward_backward_no_pipelining`` with the overlap on runs its combined-1F1B
schedule as in training (dispatch and combine nodes on its communication stream, CUDA events
between nodes, inputs freed after a node's forward), 4 micro-batches of a 3-layer bf16 GPTModel
(local layer spec: no Transformer Engine; MoE in every layer, top-2 of 8 experts), EP 2 as two
processes on one GPU over a gloo group (MPS on, started by ``scripts/gpu/gpu_1f1b_check.sh``).

Asserted, on every rank: per-micro-batch losses and every parameter's gradient bitwise equal
across all arms of a test: Megatron's ``alltoall`` without the overlap (the reference) and with
it, efa over ``torch`` and over ``gda`` without and with it (``gda`` also with its option
``rows_in_window``), and efa over ``gda`` with ``delay_wgrad_compute`` (allowed without
Transformer Engine; the local spec's linears compute their weight gradients in the backward,
so it changes no arithmetic), in dropless and
drop-and-pad mode. Bitwise because top-2 gives the same rows, the same order and the same float32
combine in every arm, and no kernel here depends on the stream it runs on. Skipped without CUDA.
"""
import pytest
import torch

from efa_ep.distributed import run_ranks
from efa_ep.testing.overlap_1f1b import compare_arms, schedule_worker

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_MICROBATCHES = 4
MODEL = dict(hidden_size=128, ffn_hidden_size=256, moe_ffn_hidden_size=256, num_moe_experts=8,
             seq_length=64)
PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "EFA_EP_MAX_TOKENS_PER_RANK": "1024",
       # one cuBLAS workspace per stream: results independent of which stream a GEMM runs on
       "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


WINDOW = {"EFA_EP_TRANSPORT_OPTIONS": "rows_in_window=1"}


def _arm(name, dispatcher, overlap, transport=None, **kw):
    return dict(name=name, dispatcher=dispatcher, overlap=overlap, transport=transport, **kw)


def _run_and_compare(arms, overlap_names):
    results = run_ranks(schedule_worker, 2, (arms, NUM_MICROBATCHES, MODEL), timeout_s=500,
                        env=ENV)
    errors = []
    for rank, per_arm in enumerate(results):
        by_name = {a["name"]: a for a in per_arm}
        for arm in per_arm:
            spec = next(a for a in arms if a["name"] == arm["name"])
            if spec["dispatcher"] == "efa":
                assert arm["dispatchers"] == ["EfaTokenDispatcher"], arm["name"]
                assert arm["transports"] == [spec["transport"]], (arm["name"], arm["transports"])
            else:
                assert arm["dispatchers"] == ["MoEAlltoAllTokenDispatcher"], arm["name"]
            overlapped = arm["name"] in overlap_names
            assert arm["schedule_plans"] == (NUM_MICROBATCHES if overlapped else 0), arm["name"]
            assert (arm["pairs"], arm["same_layer_pairs"]) == ((9, 3) if overlapped else (0, 0))
        ref = per_arm[0]
        # Every arm against the reference, and each overlapped arm against its own arm without
        # the overlap (so a failure says whether the overlap or the dispatcher differs).
        for arm in per_arm[1:]:
            errors.append(compare_arms(ref, arm, rank))
            base = by_name.get(arm["name"].replace("+1f1b+delay_wgrad", "").replace("+1f1b", ""))
            if base is not None and base is not arm and base is not ref:
                errors.append(compare_arms(base, arm, rank))
    errors = [e for e in errors if e]
    assert not errors, "\n".join(errors)
    return results


def test_gpu_1f1b_overlap_dropless_bitwise():
    arms = [_arm("alltoall", "alltoall", False),
            _arm("alltoall+1f1b", "alltoall", True),
            _arm("efa:torch", "efa", False, "torch"),
            _arm("efa:torch+1f1b", "efa", True, "torch"),
            _arm("efa:gda", "efa", False, "gda"),
            _arm("efa:gda+1f1b", "efa", True, "gda"),
            _arm("efa:gda+1f1b+delay_wgrad", "efa", True, "gda",
                 config=dict(delay_wgrad_compute=True)),
            # gda's received rows read in its window (copied at once under the overlap)
            _arm("efa:gda window", "efa", False, "gda", env=WINDOW),
            _arm("efa:gda window+1f1b", "efa", True, "gda", env=WINDOW)]
    results = _run_and_compare(arms, {a["name"] for a in arms if a["overlap"]})
    assert all(l > 0 for per_arm in results for a in per_arm for l in a["losses"])


def test_gpu_1f1b_overlap_drop_and_pad_bitwise():
    arms = [_arm("alltoall pad", "alltoall", False, config=PAD),
            _arm("alltoall pad+1f1b", "alltoall", True, config=PAD),
            _arm("efa:torch pad+1f1b", "efa", True, "torch", config=PAD),
            _arm("efa:gda pad+1f1b", "efa", True, "gda", config=PAD)]
    _run_and_compare(arms, {a["name"] for a in arms if a["overlap"]})
