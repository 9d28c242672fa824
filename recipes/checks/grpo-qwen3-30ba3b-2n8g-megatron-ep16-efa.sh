#!/bin/bash
# Check for recipes/llm/grpo-qwen3-30ba3b-2n8g-megatron-ep16-efa.yaml (NeMo-RL test-suite style): run 30 GRPO steps, assert thresholds.
# Thresholds are provisional (NeMo-RL's own recipe gates scaled to this size), not yet measured on p5en.
source "$(dirname "${BASH_SOURCE[0]}")/common.env"
MAX_STEPS=30
run_recipe "$@"
check_metrics \
  'median(data["train/token_mult_prob_error"]) < 1.1' \
  'data["train/token_mult_prob_error"]["30"] < 1.1' \
  'max(data["train/probs_ratio_clamped_max"]) < 1.21' \
  'min(data["train/probs_ratio_clamped_min"]) > 0.79' \
  'data["train/reward"]["30"] > 0.43' \
  'mean(data["timing/train/total_step_time"], -11, -1) < 600'
