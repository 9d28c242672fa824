"""The package's torch C++ extensions (``kernels/native/*.cpp``), each built once per source.

A transport's planned ops call one C++ function per op instead of a dozen Python steps
(``kernels/gda/cpp_op.py``, ``kernels/proxy/cpp_op.py``). Each source is built with torch's
extension builder the first time it is loaded in an install (it needs a C++ compiler and
``ninja``: ``pip install ninja``) into the package's cache folder, named by the hash of its
content and of the native headers it may include, so a changed source or header builds again.
Where it cannot be built, :func:`load` raises a RuntimeError saying why, the same text on every
later call (the callers run their Python path instead).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
from typing import Dict

NATIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")

_lock = threading.Lock()
_mods: Dict[str, object] = {}
_why: Dict[str, str] = {}


def _digest(path: str) -> str:
    """The build's name: the hash of the source and of every header next to it (a source
    includes the native library's headers, whose structs it reads: a changed header must build
    again too)."""
    h = hashlib.sha256()
    headers = sorted(f for f in os.listdir(NATIVE) if f.endswith(".h"))
    for p in [path] + [os.path.join(NATIVE, f) for f in headers]:
        with open(p, "rb") as f:
            h.update(os.path.basename(p).encode() + b"\0" + f.read())
    return h.hexdigest()[:12]


def load(source: str, what: str, constants: Dict[str, int]):
    """The built module of ``kernels/native/<source>`` (``what``: how messages name it).
    ``constants``: module attributes that must equal the caller's (its plans' field counts, its
    status codes), checked once after the build; a source and its Python caller that disagree
    raise. Raises RuntimeError naming what is missing."""
    with _lock:
        mod = _mods.get(source)
        if mod is not None:
            return mod
        if source in _why:
            raise RuntimeError(_why[source])
        path = os.path.join(NATIVE, source)
        try:
            import torch.utils.cpp_extension as cpp

            from .proxy.native_build import cache_dir

            cpp.verify_ninja_availability()
            digest = _digest(path)
            name = f"{os.path.splitext(source)[0]}_{digest}"
            build = os.path.join(cache_dir(), name)
            os.makedirs(build, exist_ok=True)
            if not any(f.endswith(".so") for f in os.listdir(build)):  # say why the wait
                print(f"efa-ep: building {what} once for this install (about 30 s) into {build}",
                      file=sys.stderr, flush=True)
            mod = cpp.load(name=name, sources=[path], build_directory=build,
                           extra_include_paths=[NATIVE], extra_cflags=["-O2"], verbose=False)
            theirs = {k: getattr(mod, k, None) for k in constants}
            if theirs != dict(constants):
                raise RuntimeError(f"{path} has {theirs}, its Python caller {dict(constants)}")
        except Exception as e:  # noqa: BLE001 (any build failure means: not available)
            text = str(e).strip()
            _why[source] = (f"{what} could not be built ({type(e).__name__}: "
                            f"{text.splitlines()[-1] if text else e}); it needs a C++ compiler "
                            f"and ninja (pip install ninja)")
            raise RuntimeError(_why[source]) from e
        _mods[source] = mod
        return mod
