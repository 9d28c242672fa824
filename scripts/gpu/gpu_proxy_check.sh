#!/usr/bin/env bash
# One call on the lent H200: the proxy's CUDA path (host window) checked
# bit-identical against torch, then measured: decode and prefill dispatch+combine with the device
# kernels, the same transport with its device work as torch ops, and torch (gloo), interleaved in
# the same ranks; plus the channel issue rates. Ranks are processes on the GPU under MPS.
#   PROXY_STEPS      which steps, default "tests bench"
#   PROXY_PROVIDERS  providers of the bench (default shm)
#   PROXY_PROFILES   profiles of the bench (default decode,prefill)
#   PROXY_STARTS x PROXY_ITERS  fresh rank pairs x timed iterations (default 3 x 20)
# Carry: .whl (wheels for the GPU's Python) and .native_build (libefa_proxy.so built on the CPU
# machine: the GPU image has the libfabric runtime but no headers). Outputs: $OUT/*.log, $OUT/proxy/.
set -u
OUT=${OUT:-/tmp/gpu_proxy_out}; mkdir -p "$OUT"
source scripts/gpu/gpu_common.sh
gpu_setup || exit 1
export FI_TCP_IFACE=lo \
       EFA_EP_PROXY_SO=$PWD/.native_build/libefa_proxy.so
mps_start
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
want() { case " ${PROXY_STEPS:-tests bench} " in *" $1 "*) return 0;; esac; return 1; }
want tests && TAILN=12 step tests 240 python3 -m pytest -q -x -p no:cacheprovider \
  tests/kernels/test_proxy.py -k gpu
want bench && TAILN=12 step bench 420 python3 scripts/bench_proxy.py --out "$OUT/proxy" \
  --providers "${PROXY_PROVIDERS:-shm}" --skip roundtrip --profiles "${PROXY_PROFILES:-decode,prefill}" \
  --iters "${PROXY_ITERS:-20}" --starts "${PROXY_STARTS:-3}" --device cuda --torch-staging \
  --rate-n 20000 --rate-repeats 3
grep -h '"rate"' "$OUT/bench.log" 2>/dev/null | cut -c1-800 | head -4
mps_stop
out_pack proxy   # every log and record in one file (the device returns 8 files at most)
