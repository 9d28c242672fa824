#!/usr/bin/env bash
# Prepares, on a machine with the package registries (no GPU needed), what the one-call GPU
# scripts take to an offline GPU machine with Python 3.12 and torch but no megatron-core:
#   .whl/          megatron-core, hydra-core, omegaconf and antlr4 wheels for CPython 3.12
#                  (gpu_common.sh's gpu_setup installs them into /tmp/site there)
#   .native_build/ libefa_proxy.so built here against the system libfabric (the GPU image has
#                  the libfabric runtime but no headers; the scripts set EFA_EP_PROXY_SO to it)
#   .libfabric_src (only with LIBFABRIC_GIT=<a libfabric git checkout or mirror>): v1.22.0 with a
#                  generated configure, for build_libfabric_cuda.sh (needs autoconf, automake,
#                  libtool here)
# All three are git-ignored: name them in the GPU call's carry list.
#   bash scripts/gpu/prepare_carry.sh
set -eu
cd "$(dirname "$0")/../.."
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64"
PLAT="$PLAT --platform manylinux2014_x86_64"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLAT -d .whl megatron-core==0.19.2 hydra-core==1.3.2 omegaconf==2.3.0
# antlr4-python3-runtime 4.9.3 (omegaconf's parser runtime) is published as a source archive only
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl
so=$(python3 -c "from efa_ep.kernels.proxy import native_build as b; print(b.build())")
mkdir -p .native_build && cp "$so" .native_build/libefa_proxy.so && ls -l .native_build
if [ -n "${LIBFABRIC_GIT:-}" ]; then
  rm -rf .libfabric_src && mkdir .libfabric_src
  git -C "$LIBFABRIC_GIT" archive v1.22.0 | tar -x -C .libfabric_src
  (cd .libfabric_src && ./autogen.sh >/dev/null && rm -rf fabtests autom4te.cache)
  du -sh .libfabric_src
fi
