#!/usr/bin/env bash
# One call on the lent GPU host: the 1F1B EP-overlap GPU test
# (tests/dispatcher/test_overlap_1f1b_gpu.py: Megatron's combined-1F1B schedule with the efa
# dispatcher over torch and gda vs alltoall, bitwise). EP 2 = two processes on one GPU under
# MPS (started here, stopped at the end).
# Then scripts/bench_1f1b.py (BENCH_1F1B=0 skips it).
# Carry: .whl (the megatron-core wheel for the GPU's Python). Output: $OUT/1f1b.log,
# $OUT/bench_1f1b/.
set -u
OUT=${OUT:-/tmp/gpu_1f1b_out}; mkdir -p "$OUT"
source scripts/gpu/gpu_common.sh
gpu_setup || exit 1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS on"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${T1F1B_TIMEOUT:-540}" python3 -m pytest -x -q -rs -p no:cacheprovider \
  tests/dispatcher/test_overlap_1f1b_gpu.py 2>&1 | tee "$OUT/1f1b.log" | grep -v -e "UserWarning" -e "warnings.warn" | tail -n 60
rc=${PIPESTATUS[0]}
# the training step with and without the overlap, alltoall vs efa over gda, side by side
if [ "${BENCH_1F1B:-1}" = 1 ]; then
  timeout "${BENCH_1F1B_TIMEOUT:-420}" python3 scripts/bench_1f1b.py --out "$OUT/bench_1f1b" \
    --starts "${BENCH_1F1B_STARTS:-6}" --steps "${BENCH_1F1B_STEPS:-5}" 2>&1 | grep "bench_1f1b\]"
fi
echo quit | nvidia-cuda-mps-control
echo "== 1f1b rc=$rc"
exit "$rc"
