# Sourced by the one-call GPU scripts (gpu_suite.sh, gpu_hmem_check.sh); needs $OUT set.
# step NAME SECONDS CMD...: runs CMD under a timeout into $OUT/NAME.log and prints its rc, wall
# time and last $TAILN lines, so one overrun cannot take the other steps down. A command that
# ignores or hangs on the timeout's SIGTERM (a library's signal handler can) is killed 15 s later.
step() {
  local name=$1 secs=$2; shift 2; local t0=$SECONDS
  timeout -k 15 "$secs" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"; tail -n "${TAILN:-4}" "$OUT/$name.log" | cut -c1-400
}
# Several ranks on one GPU need MPS (without it they time-slice); stop it when done.
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS on"
}
mps_stop() { echo quit | nvidia-cuda-mps-control; }
# (scripts/gpu/prepare_carry.sh makes .whl and .native_build on a machine with the registries.)
# The carried wheels (.whl: megatron-core and friends for the GPU's Python; ninja) into /tmp/site, this
# checkout installed in place (the package maps dispatcher/, kernels/, recipes/ and conf/ under
# efa_ep, so a bare PYTHONPATH does not find them), and the environment every GPU script runs with.
gpu_setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
  package_setup || return 1
  # (/tmp/site/bin: the carried wheels' programs, e.g. ninja for gda's C++ dispatch, fast_launch=4)
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 \
    TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
  # A fresh machine compiles every Triton kernel again (minutes): a carried .triton_cache (the
  # previous call's $OUT/triton_cache.tgz unpacked) starts it warm; triton_cache_save packs it.
  export TRITON_CACHE_DIR=$PWD/.triton_cache
  # (carried packed: .triton_cache.tgz, unpacked here once)
  [ -f .triton_cache.tgz ] && [ ! -d .triton_cache ] && tar -xzf .triton_cache.tgz
  return 0
}
triton_cache_save() { tar -C "$PWD" -czf "$OUT/triton_cache.tgz" .triton_cache 2>/dev/null; }
# The device returns at most 8 files from $OUT: out_pack NAME packs every other file there
# (logs, JSON, PNG, subfolders) into $OUT/NAME.tgz, so none is left behind.
out_pack() {
  (cd "$OUT" && ls -A | grep -v -e '\.tgz$' >/tmp/out_pack.list &&
   [ -s /tmp/out_pack.list ] && tar -czf "$1.tgz" -T /tmp/out_pack.list &&
   xargs -d '\n' rm -rf </tmp/out_pack.list)
}
package_setup() {
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
    >/tmp/package_setup.log 2>&1 || { tail -n 5 /tmp/package_setup.log; return 1; }
  python3 -c "import efa_ep.dispatcher, efa_ep.kernels" || return 1
}
