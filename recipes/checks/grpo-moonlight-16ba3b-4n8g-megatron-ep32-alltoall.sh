#!/bin/bash
# Check for recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron-ep32-alltoall.yaml (NeMo-RL test-suite style): run 30 GRPO steps, assert thresholds.
# Thresholds are provisional (NeMo-RL's own recipe gates scaled to this size), not yet measured on p5en.
source "$(dirname "${BASH_SOURCE[0]}")/common.env"
MAX_STEPS=30
run_recipe "$@"
check_metrics \
  'median(data["train/token_mult_prob_error"]) < 1.1' \
  'data["train/token_mult_prob_error"]["30"] < 1.1' \
  'mean(data["train/reward"]) > 0.45' \
  'mean(data["timing/train/total_step_time"], -11, -1) < 140'
