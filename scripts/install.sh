#!/usr/bin/env bash
# Installs efa-ep and everything its CPU path needs on a fresh Debian/Ubuntu machine with
# Python 3.11+ (idempotent; run as root or with sudo for apt). GPU machines: install torch with
# CUDA yourself first; this keeps whatever torch is already there. Each step says what it does
# (a fresh machine spends a few minutes here, most of it building megatron-core). A good run
# prints its "[install] ..." lines only: each apt/pip command's own output (pip's root-user and
# index warnings, setuptools' editable-install banner) is held back and printed, with the
# command, only when that command fails; the script then exits with its status.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "[install] $*"; }
# quiet CMD...: runs CMD with stdout and stderr captured; on failure prints them and exits.
quiet() {
  local log rc=0
  log=$(mktemp "${TMPDIR:-/tmp}/efa-ep-install.XXXXXX")
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "[install] FAILED (exit $rc): $*" >&2
    cat "$log" >&2
    rm -f "$log"
    exit "$rc"
  fi
  rm -f "$log"
}
# pip reads these as --disable-pip-version-check and --root-user-action=ignore (a pip too old
# for the latter ignores it); -q on every call below.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if command -v apt-get >/dev/null && ! [ -f /usr/include/rdma/fabric.h ]; then
  export DEBIAN_FRONTEND=noninteractive
  step "apt: libfabric-dev libfabric-bin gcc g++ (native proxy, megatron-core build)"
  quiet $SUDO apt-get update -qq
  # libfabric (tcp/shm providers) + headers for the native proxy; g++ builds megatron-core's sdist.
  quiet $SUDO apt-get install -y -qq libfabric-dev libfabric-bin gcc g++
else
  step "apt: libfabric headers present (or no apt-get), skipped"
fi
PY=${PYTHON:-python3}
step "pip: pip, setuptools>=80, wheel, pybind11"
quiet $PY -m pip install -q --upgrade pip 'setuptools>=80' wheel pybind11
# torch==2.13.0 resolves to a CPU wheel on the CI/dev machines; keep an existing torch.
if $PY -c "import torch" 2>/dev/null; then
  step "torch $($PY -c 'import torch; print(torch.__version__)') already installed, kept"
else
  step "pip: torch==2.13.0 (the CPU wheel here; about 200 MB)"
  quiet $PY -m pip install -q torch==2.13.0
fi
# megatron-core >= 0.17 declares Requires-Python >= 3.12 but runs on 3.11, and needs triton.
# Its dependencies go in first, without --ignore-requires-python: that flag applies to every
# package pip resolves, and would pick a numpy that only builds on Python >= 3.12.
step "pip: triton numpy packaging"
quiet $PY -m pip install -q triton numpy packaging
if $PY -c "import megatron.core" 2>/dev/null; then
  step "megatron-core already installed, kept"
else
  step "pip: megatron-core==0.19.2 (builds from source with g++, about a minute)"
  quiet $PY -m pip install -q --ignore-requires-python megatron-core==0.19.2
fi
step "pip: efa-ep in editable mode with the test and recipes extras"
quiet $PY -m pip install -q -e '.[test,recipes]'
# an assignment, so that set -e stops the script (with Python's traceback) if the import fails
usable=$($PY -c 'import efa_ep.kernels as k; print("transports usable here:", ", ".join(k.available_transports()))')
step "done: $usable"
