#!/usr/bin/env bash
# build_libfabric_cuda.sh -- build a CUDA-enabled (FI_HMEM) libfabric from the
# offline source kit in .libfabric_src/ (libfabric v1.22.0, `configure` already
# generated, so no autoconf/automake/libtool is needed).
#
# Purpose: on the lent GPU machine (no internet, CUDA 13 toolkit), build a
# libfabric with CUDA support so the efa-ep proxy's FI_HMEM path can be tested.
# The Debian libfabric 1.17 on the CPU dev machines is built WITHOUT CUDA, so
# it never advertises FI_HMEM for CUDA memory.
#
# Usage:   bash scripts/build_libfabric_cuda.sh [PREFIX]     (default /tmp/libfabric-cuda)
# Env:
#   LIBFABRIC_CUDA=no      configure --without-cuda (CPU-only smoke test of the kit)
#   LIBFABRIC_CUDA=/path   use this CUDA toolkit directory instead of auto-detect
#   LF_BUILD_DIR=dir       out-of-tree build dir (default /tmp/lfbuild; wiped first)
#   LF_JOBS=N              make parallelism (default $(nproc))
#   FI_TCP_IFACE=if        interface for the fi_info checks (default lo)
#
# CUDA is located as: $LIBFABRIC_CUDA, /usr/local/cuda, then $(dirname $(which nvcc))/..
# libfabric is configured with --enable-cuda-dlopen: at run time it dlopen()s
# the UNVERSIONED names "libcudart.so" and "libcuda.so" (then libnvidia-ml.so[.1]).
# The script therefore creates $PREFIX/lib/cuda-dlopen-shim/ with symlinks to the
# real libraries, and writes $PREFIX/env.sh that puts it on LD_LIBRARY_PATH.
#
# Providers built: tcp, rxm, shm, sockets (everything else disabled).
# Note: in libfabric (1.22 and 2.x) tcp does NOT advertise FI_HMEM, and
# tcp;ofi_rxm drops FI_HMEM when the core provider lacks it; shm does advertise
# FI_HMEM (and FI_MR_HMEM) -- it does so even without CUDA (system memory), so
# use the "CUDA hmem init" log lines below to see whether CUDA really came up.
# Known quirk of v1.22.0: --disable-sm2 is ignored (sm2's configure.m4 tests
# enable_shm), so sm2 is always built in; exclude it at run time with
# FI_PROVIDER=^sm2 if it gets in the way.

set -u
set -o pipefail

die() { echo "ERROR: build_libfabric_cuda.sh: $*" >&2; exit 1; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/.libfabric_src"
PREFIX="${1:-/tmp/libfabric-cuda}"
BUILD="${LF_BUILD_DIR:-/tmp/lfbuild}"
JOBS="${LF_JOBS:-$(nproc 2>/dev/null || echo 4)}"
CUDA_MODE="${LIBFABRIC_CUDA:-auto}"

[ -x "$SRC/configure" ] || die "$SRC/configure missing. Make the kit on a machine with internet and autotools:
  git clone --depth 1 --branch v1.22.0 https://github.com/ofiwg/libfabric .libfabric_src
  (cd .libfabric_src && ./autogen.sh && rm -rf .git fabtests autom4te.cache)
then carry .libfabric_src (it is git-ignored) to the GPU machine"
command -v gcc >/dev/null || die "gcc not found"
command -v make >/dev/null || die "make not found"
case "$PREFIX" in /*) ;; *) PREFIX="$(pwd)/$PREFIX" ;; esac

# ---------------------------------------------------------------- CUDA lookup
CUDA_DIR=""
EXTRA_CPPFLAGS=""
if [ "$CUDA_MODE" = "no" ]; then
    CUDA_FLAGS=(--without-cuda)
    echo "== LIBFABRIC_CUDA=no: building WITHOUT CUDA (kit smoke test)"
else
    cands=()
    if [ "$CUDA_MODE" != "auto" ] && [ "$CUDA_MODE" != "yes" ]; then
        cands+=("$CUDA_MODE")          # explicit path: use only that
    else
        cands+=(/usr/local/cuda)
        if command -v nvcc >/dev/null 2>&1; then
            cands+=("$(cd "$(dirname "$(readlink -f "$(command -v nvcc)")")/.." && pwd)")
        fi
    fi
    for d in "${cands[@]}"; do
        if [ -f "$d/include/cuda_runtime.h" ] && [ -f "$d/include/cuda.h" ]; then
            CUDA_DIR="$(readlink -f "$d")"; break
        fi
    done
    [ -n "$CUDA_DIR" ] || die "no CUDA toolkit with include/cuda_runtime.h and include/cuda.h found (tried: ${cands[*]}). Set LIBFABRIC_CUDA=/path/to/cuda, or LIBFABRIC_CUDA=no."
    echo "== CUDA toolkit: $CUDA_DIR"
    [ -x "$CUDA_DIR/bin/nvcc" ] && "$CUDA_DIR/bin/nvcc" --version | tail -2
    # src/hmem_cuda.c also includes <nvml.h>, which configure does not check.
    if [ ! -f "$CUDA_DIR/include/nvml.h" ]; then
        nv="$(find "$CUDA_DIR" /usr/include /usr/local/include -maxdepth 4 -name nvml.h 2>/dev/null | head -1)"
        if [ -n "$nv" ]; then
            EXTRA_CPPFLAGS="-I$(dirname "$nv")"
            echo "== nvml.h not in $CUDA_DIR/include; using $nv"
        else
            # With --enable-cuda-dlopen only the type nvmlReturn_t, NVML_SUCCESS
            # and the three _v2/shutdown prototypes are needed.
            shim="$BUILD.nvml-shim"; mkdir -p "$shim"
            cat > "$shim/nvml.h" <<'EOF'
/* minimal nvml.h stand-in written by build_libfabric_cuda.sh (libfabric
 * dlopen()s libnvidia-ml at run time; only these declarations are used) */
#ifndef LF_NVML_SHIM_H
#define LF_NVML_SHIM_H
typedef enum nvmlReturn_enum { NVML_SUCCESS = 0 } nvmlReturn_t;
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount);
nvmlReturn_t nvmlShutdown(void);
#endif
EOF
            EXTRA_CPPFLAGS="-I$shim"
            echo "== WARNING: nvml.h not found anywhere; using minimal shim $shim/nvml.h"
        fi
    fi
    CUDA_FLAGS=(--with-cuda="$CUDA_DIR" --enable-cuda-dlopen)
fi

# ------------------------------------------------------------ configure flags
CONF_FLAGS=(
    --prefix="$PREFIX"
    --disable-static
    --enable-only
    --enable-tcp=yes --enable-rxm=yes --enable-shm=yes --enable-sockets=yes
    --disable-efa --disable-verbs --disable-psm2 --disable-psm3 --disable-opx
    --disable-usnic --disable-udp --disable-mrail --disable-rxd --disable-sm2
    --disable-ucx --disable-cxi
    --disable-perf --disable-trace --disable-profile
    --disable-hook_debug --disable-hook_hmem --disable-dmabuf_peer_mem
    --disable-xpmem
    --without-uring --without-ze --without-rocr --without-neuron
    --without-synapseai --without-gdrcopy --without-dsa
    "${CUDA_FLAGS[@]}"
)

# Copying the kit may reorder mtimes; if configure.ac/Makefile.am looked newer
# than configure/Makefile.in, make would try to rerun autoconf/automake (which
# the GPU machine may lack). Pin the generated files as newest.
if [ -w "$SRC/configure" ]; then
    find "$SRC" -type f -exec touch -h -d '2020-01-01 00:00:00' {} +
    touch -d '2020-01-01 00:00:01' "$SRC/aclocal.m4"
    touch -d '2020-01-01 00:00:02' "$SRC/configure" "$SRC/config.h.in"
    touch -d '2020-01-01 00:00:03' "$SRC/Makefile.in"
fi

rm -rf "$BUILD" || die "cannot remove $BUILD"
mkdir -p "$BUILD" || die "cannot create $BUILD"
[ -n "$EXTRA_CPPFLAGS" ] && export CPPFLAGS="${CPPFLAGS:-} $EXTRA_CPPFLAGS"

echo "== configure: $SRC/configure ${CONF_FLAGS[*]}"
t0=$(date +%s)
( cd "$BUILD" && "$SRC/configure" "${CONF_FLAGS[@]}" ) > "$BUILD/configure.out" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
    tail -40 "$BUILD/configure.out"
    echo "--- last lines of config.log:"; tail -40 "$BUILD/config.log" 2>/dev/null
    die "configure FAILED (rc=$rc); full log: $BUILD/configure.out, $BUILD/config.log"
fi
grep -E '^\*\*\*|Building|providers|CUDA' "$BUILD/configure.out" | tail -30
if [ -n "$CUDA_DIR" ]; then
    grep -E '^#define (HAVE_CUDA|ENABLE_CUDA_DLOPEN|HAVE_CUDA_DMABUF) ' "$BUILD/config.h"
    grep -q '^#define HAVE_CUDA 1' "$BUILD/config.h" || die "configure did not enable CUDA (HAVE_CUDA != 1)"
fi
t1=$(date +%s)

echo "== make -j$JOBS (log: $BUILD/make.out)"
( cd "$BUILD" && make -j"$JOBS" ) > "$BUILD/make.out" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
    grep -nE 'error|Error' "$BUILD/make.out" | head -30
    tail -30 "$BUILD/make.out"
    die "make FAILED (rc=$rc); full log: $BUILD/make.out"
fi
t2=$(date +%s)
if grep -qE '(^|[ /])(aclocal|automake|autoconf|autoheader)( |$)' "$BUILD/make.out"; then
    echo "== note: make re-ran autotools (source mtimes were off); it worked here"
fi

echo "== make install -> $PREFIX"
( cd "$BUILD" && make install ) > "$BUILD/install.out" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
    tail -30 "$BUILD/install.out"
    die "make install FAILED (rc=$rc); full log: $BUILD/install.out"
fi
t3=$(date +%s)
[ -x "$PREFIX/bin/fi_info" ] || die "install incomplete: $PREFIX/bin/fi_info missing"
[ -e "$PREFIX/lib/libfabric.so.1" ] || die "install incomplete: $PREFIX/lib/libfabric.so.1 missing"
echo "== times: configure $((t1-t0))s, make $((t2-t1))s, install $((t3-t2))s, total $((t3-t0))s"

# ------------------------------------------- dlopen shim for the CUDA libraries
SHIM_DIR=""
if [ -n "$CUDA_DIR" ]; then
    SHIM_DIR="$PREFIX/lib/cuda-dlopen-shim"
    mkdir -p "$SHIM_DIR"
    cat > "$BUILD/dlcheck.c" <<'EOF'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>
/* dlopen each name the way libfabric does; print where it resolved.
 * A CUDA toolkit "stubs" libcuda.so counts as a failure. */
int main(int argc, char **argv) {
    int bad = 0;
    for (int i = 1; i < argc; i++) {
        void *h = dlopen(argv[i], RTLD_NOW);
        struct link_map *m = NULL;
        if (h) dlinfo(h, RTLD_DI_LINKMAP, &m);
        const char *path = (m && m->l_name) ? m->l_name : "?";
        printf("  dlopen(%s): %s %s\n", argv[i], h ? "ok" : dlerror(), h ? path : "");
        if (!h || strstr(path, "/stubs/")) bad = 1;
    }
    return bad;
}
EOF
    gcc -o "$BUILD/dlcheck" "$BUILD/dlcheck.c" -ldl || die "cannot compile dlopen checker"
    find_lib() {  # $1 = soname-ish glob; prints the first real match, never a stubs/ dir
        local n="$1" p
        p="$(ldconfig -p 2>/dev/null | awk -v n="$n" '$1 ~ "^"n {print $NF}' | grep -v /stubs/ | head -1)"
        [ -z "$p" ] && p="$(ls -1 "$CUDA_DIR"/lib64/$n* "$CUDA_DIR"/targets/*/lib/$n* \
              /usr/lib/x86_64-linux-gnu/$n* /usr/lib64/$n* /usr/local/nvidia/lib64/$n* \
              /usr/lib/wsl/lib/$n* 2>/dev/null | grep -v /stubs/ | head -1)"
        [ -n "$p" ] && readlink -f "$p"
    }
    for pair in "libcudart.so:libcudart.so." "libcuda.so:libcuda.so.1" "libnvidia-ml.so:libnvidia-ml.so.1"; do
        name="${pair%%:*}"; pat="${pair#*:}"
        if "$BUILD/dlcheck" "$name" >/dev/null 2>&1; then
            echo "== $name loads as is (no shim needed)"
            continue
        fi
        real="$(find_lib "$pat")"
        if [ -n "$real" ]; then
            ln -sf "$real" "$SHIM_DIR/$name"
            echo "== shim: $SHIM_DIR/$name -> $real"
        else
            if [ "$name" = libnvidia-ml.so ]; then
                echo "== note: no $pat found; libfabric then skips its NVML device check (not fatal)"
            else
                echo "== WARNING: no $pat found for $name; libfabric's CUDA hmem will be disabled at run time"
            fi
        fi
    done
fi

LDP="$PREFIX/lib${SHIM_DIR:+:$SHIM_DIR}"
cat > "$PREFIX/env.sh" <<EOF
# source me: use the libfabric built by scripts/build_libfabric_cuda.sh
export PATH="$PREFIX/bin:\$PATH"
export LD_LIBRARY_PATH="$LDP\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
echo "== wrote $PREFIX/env.sh (source it, or LD_LIBRARY_PATH=$LDP)"
echo "== SONAME: $(objdump -p "$PREFIX/lib/libfabric.so.1" 2>/dev/null | awk '/SONAME/{print $2}')"

# ------------------------------------------------------------------- checks
export LD_LIBRARY_PATH="$LDP${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FI_TCP_IFACE="${FI_TCP_IFACE:-lo}"
if [ -n "$SHIM_DIR" ]; then
    echo "== dlopen check (with LD_LIBRARY_PATH=$LDP):"
    "$BUILD/dlcheck" libcudart.so libcuda.so libnvidia-ml.so.1; echo "   rc=$?"
fi
echo "== fi_info --version"; "$PREFIX/bin/fi_info" --version
if [ -n "$CUDA_DIR" ]; then
    echo "== CUDA hmem init (FI_LOG_LEVEL=info; 'Failed to initialize hmem iface FI_HMEM_CUDA' = no CUDA at run time):"
    FI_LOG_LEVEL=info "$PREFIX/bin/fi_info" -p shm -c FI_HMEM 2>&1 | grep -i -E 'cuda' | grep -v -i 'monitor' | head -8
fi
echo "== fi_info -l"; "$PREFIX/bin/fi_info" -l
for p in tcp shm; do
    echo "== FI_TCP_IFACE=$FI_TCP_IFACE fi_info -c FI_HMEM -p $p"
    "$PREFIX/bin/fi_info" -c FI_HMEM -p "$p"
    echo "   rc=$?"
done
echo "== fi_info -p tcp -t FI_EP_RDM (summary)"
"$PREFIX/bin/fi_info" -p tcp -t FI_EP_RDM | grep -E 'provider|fabric|domain|type' | head -12
echo "   rc=$?"
echo "== build OK: $PREFIX (cuda: ${CUDA_DIR:-none})"
exit 0
