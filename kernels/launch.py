"""Triton kernel launches without Triton's per-call Python.

``kernel[grid](*args)`` runs about 1-2 us of Python per argument before the launch (binding,
specialization of every argument, cache keys, hooks): 13 us for a bare kernel and ~55 us for a
kernel of ~30 arguments on an H200 host, which is more than the GPU work of a decode-size
dispatch. :class:`FastKernel` keeps Triton's compiler, cache and launcher, and skips only that
per-call work once a kernel is compiled:

* The first launch of a *specialization key* goes through ``kernel[grid](...)`` (Triton
  compiles or loads the kernel and launches it) and keeps the ``CompiledKernel`` it returns.
* Later launches with the same key call that kernel's native launcher directly
  (``CompiledKernel.run``: grid, stream, function handle, packed metadata, the arguments), with
  tensors passed as their device addresses (the launcher then skips its own per-pointer
  ``data_ptr`` call and driver query).

The key is finer than Triton's own specialization, so it never reuses a kernel compiled for
other argument properties: constexpr values, ``num_warps``, each tensor's dtype and whether its
address is 16-byte aligned, each specialized integer's value, and for ``do_not_specialize``
integers whether they fit in int32 (Triton picks the integer type by value). A miss costs one
slow launch (Triton's own cache then answers without compiling).

Used when the native launcher's calling convention is the one this module was written against
(Triton 3.2-3.6: ``run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *args)``), on a CUDA device, without ``TRITON_INTERPRET`` and without
launch hooks (profilers); otherwise every launch takes Triton's own path.
Synchronization: none; kernels go on the current CUDA stream of the current device, as with
``kernel[grid]``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Sequence, Tuple

import torch

__all__ = ["FastKernel", "fast_launch_supported"]

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_MAX_ENTRIES = 512  # a key space this large means some argument varies freely: stop caching


def _triton_version() -> Tuple[int, int]:
    import triton
    parts = triton.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return 0, 0


def fast_launch_supported() -> bool:
    """True when :class:`FastKernel` may call compiled kernels' launchers directly here."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if not torch.cuda.is_available():
        return False
    return (3, 2) <= _triton_version() <= (3, 6)


def _runtime_knobs():
    try:
        from triton import knobs
        return knobs.runtime
    except Exception:  # layouts without a knobs module keep no launch hooks there
        return None


_RUNTIME = None


def _hooks_set() -> bool:
    """Launch hooks (profilers such as proton) need Triton's own path: it builds their metadata.
    A hook is a callable or a chain of callables (``.calls``); an empty chain is no hook."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = _runtime_knobs() or False
    if _RUNTIME is False:
        return False
    for hook in (_RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _current_stream() -> int:
    """The current CUDA stream of the current device, as the raw handle Triton launches on."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def _direct_launcher(kernel):
    """``(launch, function, cooperative, pdl, packed_metadata)`` to call the kernel's native
    launch function without the Python frame around it, or None where that frame does work
    (scratch memory to allocate, tensor descriptors to expand) or the layout is unknown."""
    run = kernel.run
    launch = getattr(run, "launch", None)
    if launch is None or getattr(run, "global_scratch_size", 1) or \
            getattr(run, "profile_scratch_size", 1) or type(launch).__name__ == "function":
        return None  # (a Python function here is Triton's tensor-descriptor wrapper)
    return (launch, kernel.function, getattr(run, "launch_cooperative_grid", None),
            getattr(run, "launch_pdl", None), kernel.packed_metadata)


class FastKernel:
    """One ``@triton.jit`` kernel launched with its compiled launcher once compiled.

    Args:
        fn: the ``triton.jit`` function. Its constexpr parameters must come after all the
            others (every kernel of this package is written so).
        enabled: False = always ``fn[grid](...)`` (Triton's own path).

    Call ``launch(grid, args, num_warps[, fast])`` with **every** parameter of ``fn``
    positionally, in signature order, constexprs included (the same values
    ``fn[grid](*args, num_warps=...)`` would take). Tensors must be on the current CUDA device.
    """

    __slots__ = ("fn", "enabled", "_num_runtime", "_dns", "_entries")

    def __init__(self, fn, enabled: bool = True):
        self.fn = fn
        params = getattr(fn, "params", None)  # None under TRITON_INTERPRET (interpreted fn)
        self.enabled = bool(enabled) and params is not None and fast_launch_supported()
        params = list(params or ())
        const = [bool(p.is_constexpr) for p in params]
        self._num_runtime = const.index(True) if True in const else len(const)
        if any(not c for c in const[self._num_runtime:]):
            raise ValueError(f"{getattr(fn, '__name__', fn)}: FastKernel needs the constexpr "
                             f"parameters after all the others")
        self._dns = tuple(bool(p.do_not_specialize) for p in params[:self._num_runtime])
        self._entries: Dict[tuple, Any] = {}

    def _key(self, args: Sequence[Any], num_warps: int):
        """(cache key, the arguments with tensors replaced by their addresses)."""
        n = self._num_runtime
        call = list(args)
        key = [num_warps]
        dns = self._dns
        for i in range(n):
            a = call[i]
            if type(a) is int:
                key.append((_I32_MIN <= a <= _I32_MAX) if dns[i] else a)
            else:  # a tensor: its address goes to the launcher as an integer
                p = a.data_ptr()
                call[i] = p
                key.append((a.dtype, not (p & 15)))
        key.extend(args[n:])
        return tuple(key), call

    def compiled(self, grid: Sequence[int], args: Sequence[Any], num_warps: int):
        """The ``CompiledKernel`` that ``launch(grid, args, num_warps)`` would run, compiled (or
        loaded from Triton's cache) without launching it. For launching it by other means
        (:mod:`efa_ep.kernels.native_launch`)."""
        key, _ = self._key(args, num_warps)
        entry = self._entries.get(key)
        if entry is not None:
            return entry[0]
        kernel = self.fn.warmup(*args, grid=grid, num_warps=num_warps)
        if len(self._entries) < _MAX_ENTRIES:
            self._entries[key] = (kernel, _direct_launcher(kernel))
        return kernel

    def runtime_names(self) -> Tuple[str, ...]:
        """Names of the parameters before the constexprs, in signature order."""
        return tuple(p.name for p in self.fn.params[:self._num_runtime])

    def launch(self, grid: Sequence[int], args: Sequence[Any], num_warps: int,
               fast: bool = True) -> None:
        """Launches ``fn[grid](*args, num_warps=num_warps)``; ``fast=False`` forces Triton's own
        launch path for this call (an A/B switch for benchmarks and an escape hatch)."""
        if not (fast and self.enabled):
            self.fn[grid](*args, num_warps=num_warps)
            return
        key, call = self._key(args, num_warps)
        entry = self._entries.get(key)
        if entry is None or _hooks_set():
            kernel = self.fn[grid](*args, num_warps=num_warps)
            if len(self._entries) < _MAX_ENTRIES and not hasattr(kernel, "result"):
                self._entries[key] = (kernel, _direct_launcher(kernel))
            return
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _current_stream()
        kernel, direct = entry
        if direct is not None:
            launch, function, coop, pdl, meta = direct
            launch(g0, g1, g2, stream, function, coop, pdl, None, None, meta, None, None, None,
                   *call)
        else:
            kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None,
                       None, *call)
