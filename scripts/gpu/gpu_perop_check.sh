#!/usr/bin/env bash
# One call on a lent H200: the per-op cost of gda. Ranks are processes on the GPU under MPS
# (started here, stopped at the end).
#   PEROP_STEPS  which steps, default "tests bench"; also: before (the same bench from the
#                checkout in .before/, a before/after comparison), nofast (fast_launch=0),
#                fast3 (fast_launch=3: the dispatch's Python path, the A/B of the default 4),
#                fast2 (fast_launch=2: each op phase its own native call, the gate in Python),
#                fast1 (fast_launch=1: one launch per kernel),
#                layer (Megatron layer at a training shape; layer_before, layer_nofast likewise;
#                layers: PEROP_STARTS fresh starts of it),
#                profile (cProfile of eager decode D+C), stress (randomized rounds),
#                contract (the conformance suite's gda cases; PEROP_CONTRACT_S),
#                window (the bench with rows_in_window=1), auto (with rows_in_window=auto, the
#                Megatron dispatcher's default), ab_window (it against the default in
#                the same processes at 128, 512, 1024 and 4096 tokens per rank), layer_window
#                (the layer with it), timeline (the GPU's idle gaps of an eager EP 2 prefill)
#   PEROP_STARTS starts per bench (default 3); PEROP_TESTS_K the tests step's -k expression;
#   PEROP_BENCH_ARGS more arguments of every bench (e.g. --pin: one physical core per rank)
# Carry: .whl (megatron-core wheel for the GPU's Python), .before when a before step runs.
# Returns $OUT/perop.tgz (every log and record) and $OUT/triton_cache.tgz.
set -u
OUT=${OUT:-/tmp/gpu_perop_out}; mkdir -p "$OUT"
source scripts/gpu/gpu_common.sh
gpu_setup || exit 1
mps_start
want() { case " ${PEROP_STEPS:-tests bench} " in *" $1 "*) return 0;; esac; return 1; }
N=${PEROP_STARTS:-3}
BENCH="--skip-tests --worlds 2,4 --routes random --modes regular,fixed,graph ${PEROP_BENCH_ARGS:-}"
want tests && TAILN=20 step tests ${PEROP_TESTS_S:-240} python3 -m pytest -q -x -p no:cacheprovider \
  --durations=12 \
  tests/kernels/test_gda_gpu.py tests/dispatcher/test_moe_layer_gpu.py \
  tests/dispatcher/test_capacity_overlap.py::test_gda_capacity_pad_equals_torch_without_host_sync \
  -k "${PEROP_TESTS_K:-not stress}"
want bench && TAILN=30 step bench "${PEROP_BENCH_S:-300}" python3 scripts/gpu/gda_gpu_check.py $BENCH --starts "$N" --tag _after
want fast3 && TAILN=12 step fast3 "${PEROP_BENCH_S:-300}" python3 scripts/gpu/gda_gpu_check.py \
  $BENCH --starts "$N" --options fast_launch=3 --tag _fast3
want fast2 && TAILN=12 step fast2 "${PEROP_BENCH_S:-300}" python3 scripts/gpu/gda_gpu_check.py \
  $BENCH --starts "$N" --options fast_launch=2 --tag _fast2
want fast1 && TAILN=12 step fast1 200 python3 scripts/gpu/gda_gpu_check.py $BENCH --starts 1 \
  --options fast_launch=1 --tag _fast1
want nofast && TAILN=12 step nofast 200 python3 scripts/gpu/gda_gpu_check.py $BENCH --starts 1 \
  --options fast_launch=0 --tag _nofast
if want before; then
  for s in $(seq 1 "$N"); do
    (cd .before && package_setup && TAILN=12 step before_$s 200 python3 scripts/gpu/gda_gpu_check.py $BENCH)
    mv "$OUT/gda_gpu_check.json" "$OUT/gda_gpu_check_before_$s.json" 2>/dev/null
  done
  package_setup || exit 1
fi
want layer && TAILN=6 step layer 240 python3 scripts/gpu/gda_layer_host.py --world 4 --tag _after
if want layers; then  # the layer, PEROP_STARTS fresh starts
  for s in $(seq 1 "$N"); do
    TAILN=3 step layer_$s "${PEROP_LAYER_S:-120}" python3 scripts/gpu/gda_layer_host.py --world 4 \
      --steps 8 --tag "_start$s"
  done
fi
want layer_nofast && TAILN=6 step layer_nofast 240 python3 scripts/gpu/gda_layer_host.py --world 4 \
  --options fast_launch=0 --tag _nofast
if want layer_before; then  # the same script over the checkout in .before, installed in place
  (cd .before && package_setup) && TAILN=6 step layer_before 240 python3 scripts/gpu/gda_layer_host.py \
    --world 4 --tag _before
  package_setup || exit 1
fi
want profile && TAILN=40 step profile 120 python3 scripts/probes/gda_host_profile.py --world 2 --mode regular --iters 300
want stress && TAILN=8 step stress 300 python3 scripts/gpu/gda_stress.py --worlds 2,4 --rounds ${PEROP_ROUNDS:-300} \
  --out "$OUT/gda_stress.jsonl"
want window && TAILN=12 step window "${PEROP_BENCH_S:-300}" python3 scripts/gpu/gda_gpu_check.py \
  --skip-tests --worlds 2,4 --routes random --modes regular,graph ${PEROP_BENCH_ARGS:-} \
  --starts "$N" --options rows_in_window=1 --tag _window
want auto && TAILN=12 step auto "${PEROP_BENCH_S:-300}" python3 scripts/gpu/gda_gpu_check.py \
  --skip-tests --worlds 2,4 --routes random --modes regular,graph ${PEROP_BENCH_ARGS:-} \
  --starts "$N" --options rows_in_window=auto --tag _auto
want ab_window && TAILN=16 step ab_window 300 python3 scripts/probes/gda_ab.py --b rows_in_window=1 \
  --worlds 2,4 --profiles decode,512,1024,prefill --iters 100 --starts 1 --out "$OUT/gda_ab_window.json"
want layer_window && TAILN=6 step layer_window 240 python3 scripts/gpu/gda_layer_host.py --world 4 \
  --options rows_in_window=1 --tag _window
want timeline && TAILN=20 step timeline 120 python3 scripts/probes/gda_timeline.py --world 2 \
  --tokens 4096 --out "$OUT/gda_timeline.json"
want contract && TAILN=30 step contract ${PEROP_CONTRACT_S:-300} python3 -m pytest -q -p no:cacheprovider -rf \
  tests/contract -k gda
mps_stop
out_pack perop   # every log and record in one file (the device returns 8 files at most)
triton_cache_save
