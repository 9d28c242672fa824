#!/usr/bin/env bash
# One call on the lent H200: the proxy's CUDA path (host window) checked
# bit-identical against torch, then measured: decode and prefill dispatch+combine with the device
# kernels, the same transport with its device work as torch ops, and torch (gloo), interleaved in
# the same ranks; plus the channel issue rates. Ranks are processes on the GPU under MPS.
#   PROXY_STEPS      which steps, default "tests bench"; also: cpp_ab (decode and prefill D+C
#                    with the planned ops' C++ calls, then the Python glue, then C++ again:
#                    EFA_EP_PROXY_CPP 1/0/1), clock (the native calls step by step at decode and
#                    512 tokens: proxy_host_profile.py with its step clock), reduce (the combine's
#                    reduction alone at prefill, every row in pinned memory: one rank and two at
#                    once, i.e. what PCIe allows: proxy_reduce_probe.py)
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
# the planned ops' C++ extension, built once here rather than inside a timed step
TAILN=1 step build_cpp 200 python3 -c "from efa_ep.kernels.proxy import cpp_op; print(cpp_op.load())"
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
AB="python3 scripts/bench_proxy.py --providers shm --skip roundtrip,rate,wire --untimed-torch \
  --iters 20 --starts 3 --device cuda --fresh-routes --profiles decode,prefill"
if want cpp_ab; then
  EFA_EP_PROXY_CPP=1 TAILN=3 step cpp_ab_cpp 120 $AB --out "$OUT/cpp_ab_cpp"
  EFA_EP_PROXY_CPP=0 TAILN=3 step cpp_ab_py 120 $AB --out "$OUT/cpp_ab_py"
  EFA_EP_PROXY_CPP=1 TAILN=3 step cpp_ab_cpp_again 120 $AB --out "$OUT/cpp_ab_cpp_again"
  grep -h "\[bench_proxy\]" "$OUT"/cpp_ab_*.log | cut -c1-400
fi
want clock && TAILN=26 step clock 100 python3 scripts/probes/proxy_host_profile.py --iters 200 \
  --channels 4 --staging layout
want clock && TAILN=26 step clock512 100 python3 scripts/probes/proxy_host_profile.py --iters 100 \
  --channels 4 --staging layout --tokens 512
want reduce && TAILN=10 step reduce 120 python3 scripts/probes/proxy_reduce_probe.py --tokens 4096 \
  --programs 66,132 --pair --json "$OUT/reduce_probe.json"
mps_stop
out_pack proxy   # every log and record in one file (the device returns 8 files at most)
