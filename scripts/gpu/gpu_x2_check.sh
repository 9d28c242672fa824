#!/usr/bin/env bash
# One call on two H200s of one host (nvidia-h200-x2): one rank per GPU, NCCL process group, no
# MPS. The gda modes next to NCCL all_to_all_single of the same bytes, and the Megatron layer over
# efa:gda against Megatron's alltoall on NCCL (the bench's layer view), in the same rank processes.
#   X2_STARTS  starts of the bench (default 3); X2_BENCH_ARGS more bench overrides
#   X2_STEPS   which steps, default "bench"; also: tests (the gda GPU tests on two GPUs), proxy
#              (the proxy's decode and prefill D+C of CUDA rows against its wire floor, rank r's
#              rows on GPU r: each rank's staging on a PCIe link of its own; then its step clock)
# Carry: .whl, .native_build/libefa_proxy.so, .triton_cache.tgz.
# Returns $OUT/x2.tgz (every log and record) and $OUT/triton_cache.tgz.
set -u
OUT=${OUT:-/tmp/gpu_x2_out}; mkdir -p "$OUT"
[ -f .triton_cache.tgz ] && tar -xzf .triton_cache.tgz
source scripts/gpu/gpu_common.sh
gpu_setup || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
want() { case " ${X2_STEPS:-bench} " in *" $1 "*) return 0;; esac; return 1; }
want tests && TAILN=20 step tests 240 python3 -m pytest -q -x -p no:cacheprovider \
  tests/kernels/test_gda_gpu.py -k "not stress"
want bench && TAILN=60 step bench "${X2_BENCH_S:-420}" efa-ep-bench --config-name gpu_nccl \
  starts="${X2_STARTS:-3}" "routes=[uniform]" "use_shapes=[deepseek_v3]" \
  out_dir="$OUT/bench_gpu_nccl" ${X2_BENCH_ARGS:-}
if want proxy; then
  export FI_TCP_IFACE=lo EFA_EP_PROXY_SO=$PWD/.native_build/libefa_proxy.so
  TAILN=1 step proxy_cpp 200 python3 -c "from efa_ep.kernels.proxy import cpp_op; print(cpp_op.load())"
  TAILN=4 step proxy_bench 240 python3 scripts/bench_proxy.py --providers shm \
    --skip roundtrip,rate,wire --untimed-torch --iters 20 --starts 3 --device cuda --fresh-routes \
    --profiles decode,prefill --out "$OUT/proxy_bench"
  TAILN=26 step proxy_clock 100 python3 scripts/probes/proxy_host_profile.py --iters 200 \
    --channels 4 --staging layout
fi
out_pack x2
triton_cache_save
