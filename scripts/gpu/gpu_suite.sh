#!/usr/bin/env bash
# One call on the lent H200: every GPU check and measurement this
# project records, in priority order, each bounded by a timeout so one overrun cannot take the
# others down. Ranks are processes on one GPU under MPS (started here, stopped at the end).
#
# Carry: .whl (megatron-core, hydra-core, omegaconf, antlr4 wheels for Python 3.12) and
# .native_build (libefa_proxy.so built on the CPU machine: the GPU image has the libfabric
# runtime but no headers). Outputs: $OUT/*.log and $OUT/suite.tgz.
set -u
OUT=${OUT:-/tmp/gpu_suite_out}; mkdir -p "$OUT"
source scripts/gpu/gpu_common.sh
gpu_setup || exit 1
export FI_TCP_IFACE=lo \
       TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 EFA_EP_PROXY_SO=$PWD/.native_build/libefa_proxy.so
mps_start
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import efa_ep.kernels as k; print('transports:', k.transport_status())"
# SUITE_STEPS picks steps (default: all, in this order); SUITE_SCALE multiplies every timeout.
want() { case " ${SUITE_STEPS:-proxy_gpu proxy_bench loss_match_bf16 moe_layer_gpu bench} " in *" $1 "*) return 0;; esac; return 1; }
scale=${SUITE_SCALE:-1}
want proxy_gpu && step proxy_gpu $((80 * scale)) python3 -m pytest -q -x tests/kernels/test_proxy.py -k gpu
want proxy_bench && step proxy_bench $((150 * scale)) python3 scripts/bench_proxy.py --out $OUT/proxy \
  --providers shm,tcp --gpu-roundtrip --device cuda --iters 20
want loss_match_bf16 && step loss_match_bf16 $((330 * scale)) python3 scripts/loss_match.py --config-name gpu_bf16 out_dir=$OUT/lm
want moe_layer_gpu && step moe_layer_gpu $((100 * scale)) python3 -m pytest -q -x tests/dispatcher/test_moe_layer_gpu.py
want bench && step bench $((180 * scale)) python3 scripts/bench.py --config-name gpu "arms.transports=[torch,gda,proxy]" \
  "arms.proxy_channels=[2]" starts=6 iters=10 \
  warmup=3 layer.enabled=false start_timeout_s=120 out_dir=$OUT/bench
mps_stop
tar czf "$OUT/suite.tgz" -C "$OUT" $(cd "$OUT" && ls -d lm bench proxy 2>/dev/null)
grep -h "loss-match:" "$OUT/loss_match_bf16.log" 2>/dev/null | tail -1
grep -h "gpu_roundtrip\|\"rate\"" "$OUT/proxy_bench.log" 2>/dev/null | cut -c1-600 | head -6
cat "$OUT/bench/bench_table.md" 2>/dev/null | head -40
