"""Named inputs of the planner: model shapes, fabrics, and the measured DeepEP-on-EFA figures.

Every value is a :class:`~efa_ep.tools.plan.model.Fig` with a provenance tag (``measured``,
``derived``, ``assumed``) and a source. Model shapes come from the models' published configs;
fabric figures from AWS/NVIDIA spec sheets (``assumed``: a spec is a promise, not a
measurement); EFA behaviour of a CPU proxy from a measured study of DeepEP on AWS EFA (two p5en.48xlarge,
Qwen3-30B-A3B EP16; ``measured``, with the study's experiment id).

The Hydra presets under ``conf/plan/model/`` and ``conf/plan/fabric/`` carry the same numbers as
plain keys (so they can be overridden on the command line); :data:`MODELS` and :data:`FABRICS`
hold the sources the report prints next to them.
"""
from __future__ import annotations

from typing import Dict

from .model import Fig

DEEPEP_EFA_STUDY = "study 'DeepEP on AWS EFA' (2x p5en.48xlarge, Qwen3-30B-A3B EP16)"

# Sources of the model presets (their numbers live in conf/plan/model/<name>.yaml).
MODELS: Dict[str, str] = {
    "qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B config.json (hidden 2048, 48 layers all MoE, 128 experts "
                     "top-8, moe_intermediate 768); recipes/llm/grpo-qwen3-30ba3b-*.yaml (seq 4096, "
                     "micro-batch 1, TP 2)",
    "moonlight_16b_a3b": "moonshotai/Moonlight-16B-A3B config.json (hidden 2048, 27 layers, first "
                         "dense, 64 experts top-6, moe_intermediate 1408); recipes/llm/grpo-moonlight-"
                         "16ba3b-4n8g-*.yaml (seq 8192, micro-batch 1)",
    "deepseek_v3": "deepseek-ai/DeepSeek-V3 config.json (hidden 7168, 61 layers, first 3 dense, "
                   "256 experts top-8, moe_intermediate 2048)",
    "kimi_k2": "moonshotai/Kimi-K2-Instruct config.json (hidden 7168, 61 layers, first dense, 384 "
               "experts top-8, moe_intermediate 2048)",
}

# Sources of the fabric presets (numbers in conf/plan/fabric/<name>.yaml).
FABRICS: Dict[str, str] = {
    "p5": "AWS p5.48xlarge spec: 8x H100 SXM (NVLink 4, 900 GB/s bidirectional per GPU, 80 GB), "
          "32x 100 Gb/s EFA; H100 bf16 dense 989 TFLOPS (NVIDIA datasheet)",
    "p5en": "AWS p5en.48xlarge spec: 8x H200 (NVLink 4, 900 GB/s bidirectional per GPU, 141 GB), "
            "16x 200 Gb/s EFAv3; H200 bf16 dense 989 TFLOPS (NVIDIA datasheet)",
    "p6-b200": "AWS p6-b200.48xlarge spec: 8x B200 (NVLink 5, 1.8 TB/s bidirectional per GPU, "
               "179 GB), 8x 400 Gb/s EFAv4; B200 bf16 dense 2.25 PFLOPS (NVIDIA datasheet)",
    "p6-b300": "AWS p6-b300.48xlarge spec: 8x B300 (NVLink 5, 1.8 TB/s bidirectional per GPU, "
               "268 GB), 16x 400 Gb/s EFA; B300 bf16 dense 2.25 PFLOPS (NVIDIA datasheet, assumed "
               "equal to B200 for bf16)",
}


def deepep_efa_figures() -> Dict[str, Fig]:
    """The DeepEP-on-EFA study's measured figures the planner uses or is tested against (units
    in names).

    Only ``proxy_channel_gbps_efa`` enters the model (the one EFA-specific rate this project
    could not measure: no EFA here); the rest are the comparison points of the study's cases.
    """
    src = DEEPEP_EFA_STUDY
    return {
        "proxy_channel_gbps_efa": Fig(8.0, "GB/s", "measured",
                                      f"{src}: one proxy channel (EP_NUM_COMMS=1) prefill dispatch "
                                      "scale-out 'K=1 ~ 8 GB/s', EXP-AB-MULTICOMM-2026-06-23"),
        "k1_prefill_dispatch_gbps": Fig((1.0, 7.0), "GB/s", "measured",
                                        f"{src}: raw floor (single comm), EXP-G40 / EXP-AB-MULTICOMM-2026-06-23"),
        "k8_prefill_dispatch_gbps": Fig((33.0, 35.0), "GB/s", "measured",
                                        f"{src}: EP_NUM_COMMS=8 prefill dispatch SO, EXP-AB-MULTICOMM-2026-06-23"),
        "k8_decode_dispatch_gbps": Fig((10.0, 12.0), "GB/s", "measured",
                                       f"{src}: EP_NUM_COMMS=8 decode dispatch SO, EXP-LOOP2-BASELINE-2026-06-23"),
        "k_scaling": Fig({1: 8.0, 2: 12.5, 4: 21.0, 8: 33.0}, "GB/s", "measured",
                         f"{src}: prefill dispatch SO vs EP_NUM_COMMS, EXP-AB-MULTICOMM-2026-06-23"),
        "node_injection_gbps": Fig(113.0, "GB/s", "measured", f"{src}: node injection, EXP-G40"),
        "nic_utilisation": Fig(0.022, "fraction", "measured",
                               f"{src}: EFA NIC utilisation during dispatch ('issue-bound')"),
    }
