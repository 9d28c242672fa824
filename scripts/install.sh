#!/usr/bin/env bash
# Installs efa-ep and everything its CPU path needs on a fresh Debian/Ubuntu machine with
# Python 3.11+ (idempotent; run as root or with sudo for apt). GPU machines: install torch with
# CUDA yourself first; this keeps whatever torch is already there. Each step says what it does
# (a fresh machine spends a few minutes here, most of it building megatron-core).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "[install] $*"; }
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if command -v apt-get >/dev/null && ! [ -f /usr/include/rdma/fabric.h ]; then
  export DEBIAN_FRONTEND=noninteractive
  step "apt: libfabric-dev libfabric-bin gcc g++ (native proxy, megatron-core build)"
  $SUDO apt-get update -qq
  # libfabric (tcp/shm providers) + headers for the native proxy; g++ builds megatron-core's sdist.
  $SUDO apt-get install -y -qq libfabric-dev libfabric-bin gcc g++ >/dev/null
else
  step "apt: libfabric headers present (or no apt-get), skipped"
fi
PY=${PYTHON:-python3}
step "pip: pip, setuptools>=80, wheel, pybind11"
$PY -m pip install -q --upgrade pip 'setuptools>=80' wheel pybind11
# torch==2.13.0 resolves to a CPU wheel on the CI/dev machines; keep an existing torch.
if $PY -c "import torch" 2>/dev/null; then
  step "torch $($PY -c 'import torch; print(torch.__version__)') already installed, kept"
else
  step "pip: torch==2.13.0 (the CPU wheel here; about 200 MB)"
  $PY -m pip install -q torch==2.13.0
fi
# megatron-core >= 0.17 declares Requires-Python >= 3.12 but runs on 3.11, and needs triton.
# Its dependencies go in first, without --ignore-requires-python: that flag applies to every
# package pip resolves, and would pick a numpy that only builds on Python >= 3.12.
step "pip: triton numpy packaging"
$PY -m pip install -q triton numpy packaging
if $PY -c "import megatron.core" 2>/dev/null; then
  step "megatron-core already installed, kept"
else
  step "pip: megatron-core==0.19.2 (builds from source with g++, about a minute)"
  $PY -m pip install -q --ignore-requires-python megatron-core==0.19.2
fi
step "pip: efa-ep in editable mode with the test and recipes extras"
$PY -m pip install -q -e '.[test,recipes]'
step "done: $($PY -c 'import efa_ep.kernels as k; print("transports usable here:", ", ".join(k.available_transports()))')"
