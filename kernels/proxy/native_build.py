"""How the proxy's native library is built: the C sources (``kernels/native/``), the compile
command, and the cache file named by a hash of the sources, the headers and the command (a
changed source or header rebuilds; one build serves every Python version). Also the build recipe
the launch library's build reuses (:func:`compile_library`). ``native.py`` loads what this builds.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import Callable, Optional, Sequence

from ..core.variables import raw

# The C sources live in efa_ep.kernels.native (kernels/native/), next to this package.
_NATIVE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "native")
SOURCES = tuple(os.path.join(_NATIVE_DIR, f) for f in (
    "efa_proxy.c", "efa_endpoint.c", "efa_channel.c", "efa_bench.c", "efa_round.c", "efa_host.c",
    "efa_op.c", "efa_devop.c"))
HEADER = os.path.join(_NATIVE_DIR, "efa_proxy.h")
HEADERS = (HEADER, os.path.join(_NATIVE_DIR, "efa_engine.h"),
           os.path.join(_NATIVE_DIR, "efa_util.h"))  # a changed header rebuilds too


def cache_dir() -> str:
    return raw("EFA_EP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "efa_ep")


def compiler() -> Optional[str]:
    """The system C compiler (``$CC``, then cc, gcc, clang), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def libfabric_header() -> Optional[str]:
    """Path of ``rdma/fabric.h`` in the compiler's default include dirs (or $EFA_EP_FI_INCLUDE /
    the EFA installer's /opt/amazon/efa/include), or None."""
    for d in (raw("EFA_EP_FI_INCLUDE"), "/opt/amazon/efa/include", "/usr/local/include",
              "/usr/include"):
        if d and os.path.isfile(os.path.join(d, "rdma", "fabric.h")):
            return os.path.join(d, "rdma", "fabric.h")
    return None


def _compile_cmd(cc: str, out: str) -> list:
    """$EFA_EP_FI_INCLUDE / $EFA_EP_FI_LIB select a libfabric install (default: the EFA
    installer's /opt/amazon/efa if present, else the system's)."""
    cmd = [cc, "-O2", "-std=c11", "-Wall", "-shared", "-fPIC", *SOURCES, "-o", out]
    inc = raw("EFA_EP_FI_INCLUDE") or (
        "/opt/amazon/efa/include" if os.path.isdir("/opt/amazon/efa/include") else None)
    if inc:
        cmd += ["-I", inc]
    lib = raw("EFA_EP_FI_LIB") or (
        "/opt/amazon/efa/lib" if os.path.isdir("/opt/amazon/efa/lib") else None)
    if lib:  # a libfabric outside the default search path: link it and find it at run time
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return cmd + ["-lfabric", "-lpthread"]


def build_problem() -> Optional[str]:
    """None if the library can be built (or a prebuilt one is configured), else why not."""
    pre = raw("EFA_EP_PROXY_SO")
    if pre:
        return None if os.path.isfile(pre) else f"EFA_EP_PROXY_SO={pre} does not exist"
    if compiler() is None:
        return "no C compiler found (cc/gcc/clang; apt-get install gcc)"
    if libfabric_header() is None:
        return ("libfabric headers (rdma/fabric.h) not found: apt-get install libfabric-dev "
                "(Debian/Ubuntu), or the AWS EFA installer (/opt/amazon/efa)")
    return None


def library_path(cc: str) -> str:
    """Where :func:`build` puts the library compiled by ``cc``: named by a hash of the sources,
    the headers and the compile command (nothing is built here)."""
    h = hashlib.sha256()
    for p in (*SOURCES, *HEADERS):
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(" ".join(_compile_cmd(cc, "OUT")).encode())
    return os.path.join(cache_dir(), f"libefa_proxy-{h.hexdigest()[:16]}.so")


def build(force: bool = False) -> str:
    """Compiles the library if needed; returns its path. Raises RuntimeError with the compiler's
    output on failure."""
    pre = raw("EFA_EP_PROXY_SO")
    if pre:
        return pre
    problem = build_problem()
    if problem:
        raise RuntimeError(problem)
    cc = compiler()
    out = library_path(cc)
    d = os.path.dirname(out)
    os.makedirs(d, exist_ok=True)
    if os.path.isfile(out) and not force:
        return out
    return compile_library(lambda o: _compile_cmd(cc, o), out, SOURCES)


def compile_library(make_cmd: Callable[[str], list], out: str, sources: Sequence[str]) -> str:
    """Runs the compile command ``make_cmd(path)`` to a private temporary name next to ``out``,
    then renames it to ``out`` (concurrent ranks never load a half-written file); returns
    ``out``. Raises RuntimeError with the compiler's output on failure."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    proc = subprocess.run(make_cmd(tmp), capture_output=True, text=True)
    if proc.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {' '.join(sources)} failed ({' '.join(make_cmd(out))}):\n"
                           f"{proc.stdout}{proc.stderr}")
    os.replace(tmp, out)
    return out
