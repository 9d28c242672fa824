"""Provenance of a measurement: what code, libraries and hardware produced a number.

Every record the loss-match command and the benchmark write carries :func:`collect`'s dict.
Versions of shared libraries are read from the objects *loaded in this process* (the path in
``/proc/self/maps`` and the library's own version call), never from a build-time constant: a
review of DeepEP-on-EFA benchmarks found torch's ``torch.cuda.nccl.version()`` reporting 2.28.9
while 2.31.2 was loaded.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
from typing import Dict, Optional

# Environment variables of other software that move results (recorded when set); every
# declared EFA_EP_* variable is recorded too (efa_ep.dispatcher.settings.variables_set).
ENV_KNOBS = (
    "NCCL_DEBUG", "NCCL_ALGO", "NCCL_PROTO", "NCCL_NET", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE",
    "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE",
    "NCCL_BUFFSIZE", "NCCL_IB_DISABLE", "NCCL_P2P_LEVEL", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "FI_PROVIDER", "FI_TCP_IFACE", "FI_EFA_USE_HW_CNTR", "FI_EFA_USE_DEVICE_RDMA", "FI_LOG_LEVEL",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MPS_PIPE_DIRECTORY",
    "CUBLAS_WORKSPACE_CONFIG", "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "OMP_NUM_THREADS",
    "MKL_NUM_THREADS", "EP_BUFFER_DEBUG", "NVSHMEM_DEBUG", "TORCH_DISTRIBUTED_DEBUG",
)


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit(path: Optional[str] = None) -> Dict[str, Optional[str]]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout holding this file."""
    path = path or repo_root()
    try:
        sha = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or None
        if sha is None:
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10).stdout
        return {"commit": sha, "dirty": bool(status.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def loaded_library(fragment: str) -> Optional[str]:
    """Path of the first shared object mapped into this process whose file name holds
    ``fragment`` (e.g. ``libnccl``), from ``/proc/self/maps``; None if none is loaded."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and fragment in os.path.basename(parts[-1]):
                    return parts[-1]
    except OSError:
        pass
    return None


def nccl_loaded_version() -> Dict[str, Optional[str]]:
    """The NCCL library actually loaded (path and ``ncclGetVersion``), and torch's build
    constant for comparison. ``loaded`` is None when no libnccl is mapped in this process."""
    out: Dict[str, Optional[str]] = {"loaded_path": None, "loaded": None, "torch_build": None}
    try:
        import torch

        if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
            out["torch_build"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    path = loaded_library("libnccl")
    if path:
        out["loaded_path"] = path
        try:
            lib = ctypes.CDLL(path)
            v = ctypes.c_int()
            if lib.ncclGetVersion(ctypes.byref(v)) == 0:
                code = v.value  # NCCL >= 2.9: major*10000 + minor*100 + patch
                out["loaded"] = f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
        except (OSError, AttributeError):
            pass
    return out


def libfabric_version() -> Dict[str, Optional[str]]:
    """libfabric's ``fi_version()`` from the loaded object if mapped, else the system one."""
    path = loaded_library("libfabric") or ctypes.util.find_library("fabric")
    out: Dict[str, Optional[str]] = {"path": path, "version": None,
                                     "loaded": bool(loaded_library("libfabric"))}
    if path:
        try:
            from ..kernels.proxy.native import keep_signal_handlers

            keep_signal_handlers()
            lib = ctypes.CDLL(path)
            lib.fi_version.restype = ctypes.c_uint32
            v = lib.fi_version()
            out["version"] = f"{v >> 16}.{v & 0xFFFF}"
        except (OSError, AttributeError):
            pass
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mps_running() -> bool:
    """True when an NVIDIA MPS control daemon or server process is running on this host."""
    try:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip().startswith("nvidia-cuda-mps"):
                        return True
            except OSError:
                continue
    except OSError:
        pass
    return False


def gpu_info() -> Dict[str, object]:
    try:
        import torch

        if not torch.cuda.is_available():
            return {"available": False}
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"available": True, "name": props.name, "sm_count": props.multi_processor_count,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "count": torch.cuda.device_count(), "cuda": torch.version.cuda}
    except Exception as e:  # provenance must never fail the run
        return {"available": None, "error": f"{type(e).__name__}: {e}"}


def process_group_info() -> Dict[str, object]:
    """Backend and size of the default process group, when one is initialized in this process."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return {"backend": str(dist.get_backend()), "world_size": dist.get_world_size()}
    except Exception as e:  # provenance must never fail the run
        return {"error": f"{type(e).__name__}: {e}"}
    return {"backend": None, "world_size": None}


def collect(extra_env: tuple = ()) -> Dict[str, object]:
    """Everything that identifies the run. Cheap; call it in the process that measured."""
    import torch

    from efa_ep.dispatcher.settings import variables_set

    try:
        from efa_ep.kernels import transport_status

        transports = transport_status()
    except Exception as e:
        transports = {"error": f"{type(e).__name__}: {e}"}
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "git": git_commit(),
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "triton": _dist_version("triton"), "megatron_core": _dist_version("megatron-core"),
            "efa_ep": _dist_version("efa-ep"), "hydra_core": _dist_version("hydra-core"),
            "nccl": nccl_loaded_version(), "libfabric": libfabric_version(),
        },
        "cpu": {"model": cpu_model(), "logical_cores": os.cpu_count(),
                "torch_threads": torch.get_num_threads()},
        "gpu": gpu_info(),
        "mps": mps_running(),
        "process_group": process_group_info(),
        "transports": transports,
        "env": {**variables_set(),
                **{k: os.environ[k] for k in ENV_KNOBS + tuple(extra_env) if k in os.environ}},
    }
