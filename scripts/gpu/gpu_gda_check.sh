#!/usr/bin/env bash
# One call on a lent GPU host: the gda correctness checks. Ranks are
# processes on the GPU(s) under MPS (started here, stopped at the end).
#   GDA_STEPS   which steps, default "probe tests stress layers" (also: bench)
#   GDA_TEST_K  pytest -k expression of the tests step (default: all)
#   GDA_MODES   modes of the bench step (default fixed,graph; see scripts/gpu/gda_gpu_check.py)
#   GDA_ROUNDS  randomized rounds per world size (default 1000)
#   GDA_WORLDS  world sizes of the stress rounds and layer runs (default 2,4,8)
#   GDA_LAUNCHES x GDA_ITERS  layer runs per (world, dtype) (default 4 x 5 = 20)
# Carry: .whl (megatron-core wheel for the GPU's Python). Outputs: $OUT/*.log, $OUT/gda_stress.jsonl
set -u
OUT=${OUT:-/tmp/gpu_gda_out}; mkdir -p "$OUT"
source scripts/gpu/gpu_common.sh
gpu_setup || exit 1
mps_start
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
want() { case " ${GDA_STEPS:-probe tests stress layers} " in *" $1 "*) return 0;; esac; return 1; }
W=${GDA_WORLDS:-2,4,8}
want probe && for p in 1 132 528; do step probe_$p 60 python3 scripts/probes/gda_stall_probe.py --spin-s 2 --spin-programs $p; done
want probe && cat "$OUT"/probe_*.log
want tests && TAILN=12 step tests 300 python3 -m pytest -q -x -p no:cacheprovider \
  tests/kernels/test_gda_gpu.py tests/dispatcher/test_moe_layer_gpu.py ${GDA_TEST_K:+-k "$GDA_TEST_K"}
want bench && TAILN=14 step bench 400 python3 scripts/gpu/gda_gpu_check.py --skip-tests --worlds "$W" \
  --routes random --modes "${GDA_MODES:-fixed,graph}"
want stress && TAILN=8 step stress 900 python3 scripts/gpu/gda_stress.py --worlds "$W" \
  --rounds "${GDA_ROUNDS:-1000}" --out "$OUT/gda_stress.jsonl"
want layers && TAILN=8 step layers 900 python3 scripts/gpu/gda_stress.py --worlds "$W" --rounds 0 \
  --layer-launches "${GDA_LAUNCHES:-4}" --layer-iters "${GDA_ITERS:-5}" --out "$OUT/gda_stress.jsonl"
mps_stop
