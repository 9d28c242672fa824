set -u; OUT=${OUT:-/tmp/o}; mkdir -p $OUT
source scripts/gpu/gpu_common.sh; gpu_setup || exit 1
export FI_TCP_IFACE=lo EFA_EP_PROXY_SO=$PWD/.native_build/libefa_proxy.so
nproc; which ninja
mps_start
G="python3 scripts/gpu/gda_gpu_check.py --skip-tests --worlds 2,4 --routes random --modes regular,graph --pin --starts 3"
TAILN=30 step fl4_a 140 $G --options fast_launch=4 --tag _fl4
TAILN=30 step base 100 $G --tag _base
TAILN=12 step tests_rep 170 python3 -m pytest -q -x tests/kernels/test_gda_gpu.py -k repeated
TAILN=30 step proxy_lines 110 python3 scripts/probes/proxy_host_profile.py --iters 200 --channels 4 --staging layout --lines
mps_stop; triton_cache_save; out_pack call1
