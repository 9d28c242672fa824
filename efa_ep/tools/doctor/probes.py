"""What ``efa-ep-doctor`` reads from this machine, one function per fact, each returning plain
data (so a test can replace any of them) and none changing anything outside this process.

Reads only: package metadata, ``torch.cuda``, ``nvidia-smi topo -m`` (when present),
``/proc`` (MPS daemons, the libraries mapped into this process), ``/sys/class/infiniband`` (EFA
devices), the CPU affinity mask. The one thing it builds is the proxy's native library, with the
project's own build (:mod:`efa_ep.kernels.proxy.native`), and only into a temporary folder that
:func:`cleanup` removes, when the user's cache does not hold it yet: loading it is how the
project loads libfabric, so the providers the doctor reports are the ones the proxy would get.
"""
from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

from ..provenance import _dist_version, libfabric_version, loaded_library, mps_running  # noqa: F401

EFA_INSTALLER_PREFIX = "/opt/amazon/efa"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TEMP_DIRS: List[str] = []
_UNSET = object()
_PREV_CACHE_DIR: List[Any] = []  # EFA_EP_CACHE_DIR before a throwaway build replaced it


def dist_version(name: str) -> Optional[str]:
    """Installed version of distribution ``name`` (``torch``, ``megatron-core``), or None."""
    return _dist_version(name)


def python_version() -> str:
    import platform

    return platform.python_version()


def torch_cuda_build() -> Optional[str]:
    """The CUDA version torch was built with (None: a CPU build)."""
    import torch

    return torch.version.cuda


def gpus() -> Dict[str, Any]:
    """``{"count": visible CUDA devices, "name": device 0's name or None}``."""
    import torch

    if not torch.cuda.is_available():
        return {"count": 0, "name": None}
    return {"count": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0)}


def nvidia_smi_topo() -> Optional[str]:
    """``nvidia-smi topo -m``'s output, or None when nvidia-smi is absent or fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        p = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def parse_topo(text: str) -> Dict[str, str]:
    """``nvidia-smi topo -m`` -> ``{"0-1": "NV18", "0-2": "SYS", ...}`` for every GPU pair
    (i < j): the link type between GPU i and GPU j (``NV<n>`` NVLink with n links; ``PIX``,
    ``PXB``, ``PHB``, ``NODE``, ``SYS`` over PCIe / the host)."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln.split() for ln in lines if ln.split() and ln.split()[0].startswith("GPU")
                   and ln[:1].isspace()), None)
    if header is None:  # header line not indented (older formats): first line naming GPU0
        header = next((ln.split() for ln in lines if "GPU0" in ln.split()[:2]), [])
    cols = [c for c in header if re.fullmatch(r"GPU\d+", c)]
    out: Dict[str, str] = {}
    for ln in lines:
        parts = ln.split()
        if not parts or not re.fullmatch(r"GPU\d+", parts[0]) or len(parts) < len(cols) + 1:
            continue
        i = int(parts[0][3:])
        for c, v in zip(cols, parts[1:1 + len(cols)]):
            j = int(c[3:])
            if i < j:
                out[f"{i}-{j}"] = v
    return out


def peer_access(count: int) -> Dict[str, str]:
    """``{"0-1": "peer" | "none"}`` from ``torch.cuda.can_device_access_peer`` (no link type)."""
    import torch

    return {f"{i}-{j}": ("peer" if torch.cuda.can_device_access_peer(i, j) else "none")
            for i in range(count) for j in range(i + 1, count)}


def nvlink_topology(count: int) -> Optional[Dict[str, Any]]:
    """``{"source": ..., "pairs": {...}}`` from nvidia-smi, else from torch's peer access;
    None with fewer than two GPUs."""
    if count < 2:
        return None
    text = nvidia_smi_topo()
    if text:
        pairs = parse_topo(text)
        if pairs:
            return {"source": "nvidia-smi topo -m", "pairs": pairs}
    return {"source": "torch.cuda.can_device_access_peer", "pairs": peer_access(count)}


def symmetric_memory() -> Optional[str]:
    """None when ``torch.distributed._symmetric_memory`` imports, else why not."""
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def expected_library_path() -> Optional[str]:
    """Where :func:`efa_ep.kernels.proxy.native.build` puts (or finds) the library for these
    sources and compile command, without building it: the same hash of sources, header and
    command. None without a C compiler."""
    from efa_ep.kernels.proxy import native

    cc = native.compiler()
    return None if cc is None else native.library_path(cc)


def native_library(build_if_missing: bool = True) -> Dict[str, Any]:
    """The proxy's native library: ``path``, ``built`` (already there before the doctor ran),
    ``prebuilt`` (``EFA_EP_PROXY_SO``), ``expected_path`` (where the project's build puts it),
    ``abi``/``expected_abi``, ``problem`` (why it cannot be built or loaded), ``temporary`` (the
    folder a throwaway build went to) and ``load_s`` (seconds to load, a build included).

    Loads it (building into a temporary folder when missing and ``build_if_missing``): loading
    it loads libfabric the way the proxy does. libfabric's providers install a SIGINT handler
    on load; Python's is put back."""
    from efa_ep.kernels.proxy import native

    out: Dict[str, Any] = {"path": None, "expected_path": None, "built": False, "prebuilt": False, "abi": None,
                           "expected_abi": native.ABI_VERSION, "problem": None, "temporary": None,
                           "load_s": None}
    from efa_ep.dispatcher.settings import raw

    pre = raw("EFA_EP_PROXY_SO")
    if pre:
        out.update(path=pre, prebuilt=True, built=os.path.isfile(pre))
    else:
        out["problem"] = native.build_problem()
        if out["problem"]:
            return out
        out["path"] = out["expected_path"] = expected_library_path()
        out["built"] = bool(out["path"]) and os.path.isfile(out["path"])
        if not out["built"]:
            if not build_if_missing:
                return out
            tmp = tempfile.mkdtemp(prefix="efa-ep-doctor-")
            _TEMP_DIRS.append(tmp)
            # native.py (this process) and the self-test's ranks (children) read the build
            # folder from the environment only, so it is replaced here (the earlier value kept,
            # not read as a setting) and put back by cleanup().
            _PREV_CACHE_DIR.append(os.environ.pop("EFA_EP_CACHE_DIR", _UNSET))
            os.environ["EFA_EP_CACHE_DIR"] = tmp
            out["temporary"] = tmp
    t0 = time.perf_counter()
    try:
        lib = _keeping_sigint(native.load)
        out["abi"] = int(lib.efa_abi_version())
        out["path"] = getattr(lib, "_name", out["path"])
    except RuntimeError as e:
        out["problem"] = str(e).splitlines()[0]
        m = re.search(r"ABI version (\d+) != (\d+)", str(e))
        if m:
            out["abi"] = int(m.group(1))
    out["load_s"] = round(time.perf_counter() - t0, 3)
    return out


def _keeping_sigint(fn):
    try:
        return fn()
    finally:
        if threading.current_thread() is threading.main_thread():
            handler = signal.getsignal(signal.SIGINT)
            if handler is not None:
                signal.signal(signal.SIGINT, handler)


def libfabric() -> Dict[str, Any]:
    """The libfabric this process loaded (through the native library), else the system one:
    ``path``, ``version`` (``fi_version()``, major.minor), ``loaded``, ``source`` (``efa
    installer`` under /opt/amazon/efa, ``distribution`` under /usr or /lib, else ``custom``)
    and ``fi_info`` (``fi_info --version`` of the fi_info on PATH, which may be another copy)."""
    info = dict(libfabric_version())
    path = info.get("path")
    real = os.path.realpath(path) if path and os.path.isabs(path) else path
    if not path:
        info["source"] = None
    elif real.startswith(EFA_INSTALLER_PREFIX) or path.startswith(EFA_INSTALLER_PREFIX):
        info["source"] = "efa installer"
    elif real.startswith(("/usr/", "/lib")):
        info["source"] = "distribution"
    else:
        info["source"] = "custom"
    info["fi_info"] = None
    fi = shutil.which("fi_info")
    if fi:
        try:
            p = subprocess.run([fi, "--version"], capture_output=True, text=True, timeout=10)
            m = re.search(r"libfabric:\s*(\S+)", p.stdout)
            info["fi_info"] = m.group(1) if m else None
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def provider(name: str, hmem: bool = False) -> Optional[str]:
    """None when libfabric provider ``name`` offers what the proxy needs (RDM, RMA, remote CQ
    data; with ``hmem`` also FI_HMEM registration), else why not (the probe the proxy itself
    runs, :func:`efa_ep.kernels.proxy.native.probe`)."""
    from efa_ep.kernels.proxy import native

    return _keeping_sigint(lambda: native.probe(name, hmem=hmem))


def efa_devices() -> List[str]:
    """Names of the RDMA devices driven by the ``efa`` kernel driver (``/sys/class/infiniband``)."""
    base = "/sys/class/infiniband"
    out = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    for name in names:
        driver = os.path.realpath(os.path.join(base, name, "device", "driver"))
        if os.path.basename(driver) == "efa":
            out.append(name)
    return out


def cpus() -> int:
    """CPUs this process may run on (its affinity mask, as the ranks inherit it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def proxy_channels() -> Dict[str, Any]:
    """The proxy's channels per rank as the dispatcher would resolve them here: ``value`` and
    ``source`` (``EFA_EP_PROXY_CHANNELS`` or the default, 4 on >= 8 CPUs, else 2), and
    ``cpu_base`` (``EFA_EP_PROXY_CPU_BASE``, None when unset)."""
    from efa_ep.dispatcher.settings import raw
    from efa_ep.kernels.proxy.options import default_num_channels

    # Lenient on purpose: a bad value is the settings line's failure, not this one's.
    text = raw("EFA_EP_PROXY_CHANNELS") or ""
    base = raw("EFA_EP_PROXY_CPU_BASE") or ""
    try:
        value, source = (int(text), "EFA_EP_PROXY_CHANNELS") if text else (
            default_num_channels(), "default: 4 on hosts with >= 8 CPUs, else 2")
    except ValueError:
        value, source = default_num_channels(), f"default (EFA_EP_PROXY_CHANNELS={text!r} is not a number)"
    try:
        cpu_base = int(base) if base else None
    except ValueError:
        cpu_base = None
    return {"value": value, "source": source, "cpu_base": cpu_base if cpu_base is None or cpu_base >= 0 else None}


def transports() -> Dict[str, Optional[str]]:
    """:func:`efa_ep.kernels.transport_status`: None per transport usable here, else why not."""
    from efa_ep.kernels import transport_status

    return _keeping_sigint(transport_status)


def settings() -> Dict[str, Any]:
    """The dispatcher's ``EFA_EP_*`` settings of this environment, validated as a launcher does
    (:func:`efa_ep.dispatcher.settings.check_environment`, without the availability check, which
    the transport lines cover): ``transport``, ``options``, ``fallback`` and ``error`` (the
    ConfigError's line and hint, or None)."""
    from efa_ep.dispatcher.settings import check_environment, fallback_dispatcher, raw

    try:
        s = check_environment(check_available=False)
        return {"transport": s.transport, "options": dict(s.transport_options),
                "fallback": fallback_dispatcher(), "error": None, "hint": None}
    except ValueError as e:
        return {"transport": raw("EFA_EP_TRANSPORT"), "options": {}, "fallback": None,
                "error": str(e), "hint": getattr(e, "hint", "")}


def cleanup() -> None:
    """Removes the temporary folders a throwaway build of the native library went to, and puts
    ``EFA_EP_CACHE_DIR`` back as it was."""
    while _TEMP_DIRS:
        shutil.rmtree(_TEMP_DIRS.pop(), ignore_errors=True)
    if _PREV_CACHE_DIR:
        prev = _PREV_CACHE_DIR[0]
        _PREV_CACHE_DIR.clear()
        if prev is _UNSET:
            os.environ.pop("EFA_EP_CACHE_DIR", None)
        else:
            os.environ["EFA_EP_CACHE_DIR"] = prev
