#!/usr/bin/env bash
# Installs efa-ep and everything its CPU path needs on a fresh Debian/Ubuntu machine with
# Python 3.11+ (idempotent; run as root or with sudo for apt). GPU machines: install torch with
# CUDA yourself first; this keeps whatever torch is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if command -v apt-get >/dev/null && ! [ -f /usr/include/rdma/fabric.h ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # libfabric (tcp/shm providers) + headers for the native proxy; g++ builds megatron-core's sdist.
  $SUDO apt-get install -y -qq libfabric-dev libfabric-bin gcc g++ >/dev/null
fi
PY=${PYTHON:-python3}
$PY -m pip install -q --upgrade pip 'setuptools>=80' wheel pybind11
# torch==2.13.0 resolves to a CPU wheel on the CI/dev machines; keep an existing torch.
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0
# megatron-core >= 0.17 declares Requires-Python >= 3.12 but runs on 3.11, and needs triton.
# Its dependencies go in first, without --ignore-requires-python: that flag applies to every
# package pip resolves, and would pick a numpy that only builds on Python >= 3.12.
$PY -m pip install -q triton numpy packaging
$PY -c "import megatron.core" 2>/dev/null || \
  $PY -m pip install -q --ignore-requires-python megatron-core==0.19.2
$PY -m pip install -q -e '.[test,recipes]'
