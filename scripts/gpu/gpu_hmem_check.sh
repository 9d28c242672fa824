#!/usr/bin/env bash
# One call on the lent H200: the proxy's FI_HMEM path (device window registered with
# FI_HMEM_CUDA, no host staging) against torch, and its dispatch+combine next to the
# host-staged path on the same machine.
#
# Debian's libfabric (the image's runtime) is built without CUDA, so this builds libfabric
# v1.22 with CUDA from the carried kit first (scripts/build_libfabric_cuda.sh), then the
# native proxy against it. Provider: shm (tcp never offers FI_HMEM).
# Carry: .libfabric_src and .native_build (the Debian-linked .so, for the refusal check).
set -u
OUT=${OUT:-/tmp/hmem_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FI_TCP_IFACE=lo
source scripts/gpu/gpu_common.sh
package_setup || exit 1
TAILN=${TAILN:-6}
# 1. with Debian's libfabric: hmem='cuda' must be refused with a message naming the verb
step refusal 60 env EFA_EP_PROXY_SO=$PWD/.native_build/libefa_proxy.so python3 -c "
from efa_ep.distributed import run_ranks
from efa_ep.testing.transports import hmem_creation_error_worker
for prov in ('shm', 'tcp'):
    print(prov, '->', run_ranks(hmem_creation_error_worker, 1, (prov,), timeout_s=50)[0])"
# 2. CUDA-enabled libfabric + the proxy built against it
step build_libfabric 240 bash scripts/build_libfabric_cuda.sh /tmp/lfcuda || true
[ -f /tmp/lfcuda/env.sh ] || { echo "libfabric build failed"; tail -40 "$OUT/build_libfabric.log"; exit 1; }
source /tmp/lfcuda/env.sh
export EFA_EP_FI_INCLUDE=/tmp/lfcuda/include EFA_EP_FI_LIB=/tmp/lfcuda/lib EFA_EP_CACHE_DIR=/tmp/efa_cache
unset EFA_EP_PROXY_SO
step build_proxy 60 python3 -c "
from efa_ep.kernels.proxy import native as n
print(n.build()); print('shm hmem probe:', n.probe('shm', True)); print('tcp hmem probe:', n.probe('tcp', True))"
mps_start
# 3. correctness: host-staged and FI_HMEM GPU tests, bit-identical to torch
step gpu_tests 180 env EFA_EP_TEST_HMEM_PROVIDER=shm python3 -m pytest -q -rs tests/kernels/test_proxy.py -k gpu
# 4. dispatch+combine, same machine: FI_HMEM window vs host-staged window
step bench_hmem 150 python3 scripts/bench_proxy.py --out $OUT/hmem --providers shm --skip roundtrip,rate \
  --device cuda --hmem cuda --iters 20
step bench_staged 150 python3 scripts/bench_proxy.py --out $OUT/staged --providers shm --skip roundtrip,rate \
  --device cuda --hmem off --iters 20
mps_stop
for d in hmem staged; do python3 -c "
import json,sys
for r in json.load(open('$OUT/$d/bench_proxy.json'))['records']:
    print('$d', r['provider'], r['profile'], r['bit_identical_to_torch'], 'proxy', r['proxy_ms'], 'torch', r['torch_ms'])" 2>&1 | cut -c1-300; done
