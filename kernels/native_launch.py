"""Kernel programs launched in one native call (``kernels/native/efa_launch.c``, its CUDA graphs
in ``efa_launch_graph.c``).

A transport op launches a few compiled Triton kernels in a fixed order (layout, store, wait,
reduce, ...). Launching each through Python costs 6-40 us of host time per kernel on a GPU
host; the GPU work of a decode-size op is a few microseconds. A :class:`Program` binds the
kernels of one op phase once per shape: the compiled kernels' function handles, grids, block
sizes and every parameter value, in a C array. Per call Python rewrites only the *variables*
(the addresses of the call's tensors, the op number, a row count, a grid size) and makes one
native call, which launches every kernel with ``cuLaunchKernel`` (and, for a phase whose last
kernel writes counts into page-locked host memory, waits for that kernel's completion word
there: no copy, no stream synchronization).

Binding a step checks the compiled kernel's parameter list against the driver's own
(``cuFuncGetParamInfo``): count and size of every parameter. A kernel whose parameters do not
match what is expected (another Triton calling convention) raises :class:`NativeLaunchError`
when the program is built, never a wrong launch.

Variables: a tensor argument whose address lies inside one of the program's *variable tensors*
is rewritten per call as that tensor's new address plus the same byte offset (so views of one
allocation made per call follow it; the library writes them, from the call's variables packed
into the program's variable array: one ``struct.pack_into`` and one native call per run); an integer argument whose parameter name is one of the
program's *variable integers* takes the call's value; a step listed in ``grid_steps`` takes the
call's grid size. Everything else is constant: it must stay valid for the program's lifetime
(the transport's own tables and windows). The caller keys programs by everything that changes
a kernel's specialization (shapes, dtypes, strides, which tensors are 16-byte aligned).

Synchronization: kernels go on the stream passed to :meth:`Program.run` (the current stream),
in order, as the Python launches would (by default as one CUDA graph per program, where the
driver allows: one host submission instead of one per kernel, see :class:`Program`'s
``graph``); :meth:`Program.run_wait` also waits for the host completion word its last kernel
writes.
:meth:`Program.run_gated` runs two programs in one call with the launch gate of ranks sharing a
GPU between them (publish, brief wait for the peers; the caller's own wait takes over when a
peer is late).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import threading
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["NativeLaunchError", "Program", "KernelStep", "MemsetStep", "availability", "bind", "load",
           "gate_publish_wait", "wait_flag", "rows_received", "RAN", "GATE_LATE", "FLAG_LATE",
           "NOT_GATHERED"]

_NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
#: the library's files: the driver, programs, gate and gda dispatch; a program as one CUDA graph;
#: what both share (hashed with them, so an edit of any rebuilds)
SOURCES = tuple(os.path.join(_NATIVE_DIR, f) for f in ("efa_launch.c", "efa_launch_graph.c"))
HEADERS = tuple(os.path.join(_NATIVE_DIR, f) for f in ("efa_launch.h", "efa_util.h"))
ABI_VERSION = 9
MAX_PARAMS = 40     # EFA_LAUNCH_MAX_PARAMS
_HEAD = 8           # int64 fields before params[] in efa_launch_t
_F_FUNCTION, _F_GRID_X, _F_GRID_Y, _F_GRID_Z, _F_BLOCK, _F_SHARED, _F_NPARAMS = range(7)
_ERRLEN = 512
#: :meth:`Program.run_gated` statuses: both programs ran; the gate was not passed in time (the
#: second did not run); both ran but the completion word was not seen in time
RAN, GATE_LATE, FLAG_LATE = 0, 1, 2
#: :meth:`Program.run_dispatch`: both programs ran, the counts were not gathered (see there)
NOT_GATHERED = 3

# Triton signature type -> bytes of the kernel parameter
_TYPE_BYTES = {"i1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "fp16": 2, "bf16": 2,
               "i32": 4, "u32": 4, "fp32": 4, "i64": 8, "u64": 8, "fp64": 8}


class NativeLaunchError(RuntimeError):
    """The native launch library cannot run here, cannot bind a kernel, or a launch failed."""


class _Record(ctypes.Structure):
    _fields_ = [("head", ctypes.c_int64 * _HEAD), ("params", ctypes.c_void_p * MAX_PARAMS),
                ("values", ctypes.c_int64 * MAX_PARAMS)]


class _ProgramDesc(ctypes.Structure):
    """``efa_program_t``: a program's records and where the call's variables go."""
    _fields_ = [("recs", ctypes.c_void_p), ("num_recs", ctypes.c_int64),
                ("uses", ctypes.c_void_p), ("num_uses", ctypes.c_int64),
                ("vars", ctypes.c_void_p), ("graph_mode", ctypes.c_int64),
                ("graph", ctypes.c_void_p)]


_RECORD_WORDS = ctypes.sizeof(_Record) // 8
_VALUES = _HEAD + MAX_PARAMS  # index of values[0] inside a record, in int64 words

_lock = threading.Lock()
_lib = None
_lib_error: Optional[str] = None


def _build() -> str:
    from .proxy.native_build import cache_dir, compile_library, compiler  # one build recipe
    cc = compiler()
    if cc is None:
        raise NativeLaunchError("no C compiler found (cc/gcc/clang; apt-get install gcc)")
    cmd = [cc, "-O2", "-std=c11", "-Wall", "-shared", "-fPIC", *SOURCES, "-ldl"]
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):  # a changed header rebuilds too
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(" ".join(cmd).encode())
    d = cache_dir()
    os.makedirs(d, exist_ok=True)
    out = os.path.join(d, f"libefa_launch-{h.hexdigest()[:16]}.so")
    if os.path.isfile(out):
        return out
    try:
        return compile_library(lambda o: cmd + ["-o", o], out, list(SOURCES))
    except RuntimeError as e:
        raise NativeLaunchError(str(e)) from e


_i64, _i32, _vp, _cp, _sz = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, \
    ctypes.c_size_t
_SIGS = {
    "efa_launch_abi_version": ([], _i32),
    "efa_launch_record_bytes": ([], _i32),
    "efa_launch_max_params": ([], _i32),
    "efa_launch_program_bytes": ([], _i32),
    "efa_launch_graph_free": ([_vp], None),
    "efa_launch_init": ([_cp, _sz], _i32),
    "efa_launch_param_sizes": ([_i64, _vp, _i32, _cp, _sz], _i32),
    "efa_launch_bind": ([_vp], _i32),
    "efa_launch_run": ([_vp, _i64, _vp, _sz], _i32),
    "efa_launch_run_wait": ([_vp, _i64, _vp, _i64, _i64, _vp, _vp, _sz], _i32),
    "efa_gate_publish_wait": ([_vp, _i32, _i32, _i64, _i64, _vp], _i32),
    "efa_launch_wait_flag": ([_vp, _i64, _i64, _vp], _i32),
    "efa_launch_run_gated": ([_vp, _vp, _i64, _vp, _i32, _i32, _i64, _i64, _vp, _i64, _i64, _vp,
                              _vp, _vp, _sz], _i32),
    "efa_launch_event_record": ([_i64, _i64, _vp, _sz], _i32),
    "efa_launch_event_wait": ([_i64, _vp, _sz], _i32),
    "efa_gda_rows_received": ([_vp, _vp], _i64),
    "efa_launch_dispatch": ([_vp, _vp, _vp, _i64, _vp, _i32, _i32, _i64, _i64, _vp, _i64, _i64,
                             _vp, _vp, _vp, _vp, _vp, _sz], _i32),
}


def load():
    """Builds (once per source) and loads the library; checks its record layout. Raises
    :class:`NativeLaunchError`. Loading needs no GPU; launching does (see :func:`availability`)."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise NativeLaunchError(_lib_error)
        try:
            lib = ctypes.CDLL(_build())
            for name, (args, res) in _SIGS.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
            if lib.efa_launch_abi_version() != ABI_VERSION or \
                    lib.efa_launch_record_bytes() != ctypes.sizeof(_Record) or \
                    lib.efa_launch_program_bytes() != ctypes.sizeof(_ProgramDesc) or \
                    lib.efa_launch_max_params() != MAX_PARAMS:
                raise NativeLaunchError("libefa_launch: ABI or record layout differs from "
                                        "kernels/native_launch.py (stale build?)")
        except (OSError, AttributeError, NativeLaunchError) as e:
            _lib_error = f"native launch library: {e}"
            raise NativeLaunchError(_lib_error) from e
        _lib = lib
        return lib


def availability() -> Optional[str]:
    """None when programs can be launched here (library built, NVIDIA driver with
    ``cuFuncGetParamInfo``), else why not."""
    try:
        lib = load()
    except NativeLaunchError as e:
        return str(e)
    err = ctypes.create_string_buffer(_ERRLEN)
    if lib.efa_launch_init(err, _ERRLEN):
        return err.value.decode(errors="replace")
    return None


class KernelStep:
    """One kernel of a program: a FastKernel and the launch it would make,
    ``fk.launch(grid, args, num_warps)`` (every parameter positionally, constexprs included)."""
    __slots__ = ("fk", "grid", "args", "num_warps")

    def __init__(self, fk, grid: Sequence[int], args: Sequence, num_warps: int):
        self.fk, self.grid, self.args, self.num_warps = fk, tuple(grid), tuple(args), num_warps


class MemsetStep:
    """Zero ``nbytes`` bytes at ``tensor``'s address (stream-ordered, like ``tensor.zero_()``)."""
    __slots__ = ("tensor", "nbytes")

    def __init__(self, tensor: torch.Tensor, nbytes: int):
        self.tensor, self.nbytes = tensor, int(nbytes)


def _param_layout(kernel, fk, args) -> Tuple[list, list]:
    """(names, values) of the compiled kernel's parameters in launch order, from its signature:
    the non-constexpr entries (Triton turns some arguments into constants when it specializes)."""
    sig = getattr(getattr(kernel, "src", None), "signature", None)
    if not isinstance(sig, dict):
        raise NativeLaunchError(f"{fk.fn.__name__}: compiled kernel exposes no signature")
    names = fk.runtime_names()
    by_name = dict(zip(names, args))
    out_names, out_types = [], []
    for name, ty in sig.items():
        if ty == "constexpr":
            continue
        if name not in by_name:
            raise NativeLaunchError(f"{fk.fn.__name__}: parameter {name!r} ({ty}) is not a "
                                    f"runtime argument")
        out_names.append(name)
        out_types.append(ty)
    return out_names, out_types


class Program:
    """The kernels of one op phase, bound for one native call per run.

    Args:
        steps: :class:`KernelStep` / :class:`MemsetStep` in launch order, built with the tensors
            of one real call (the kernels are compiled for them if needed).
        tensors: the variable tensors of that call, in the order :meth:`run` takes addresses.
        ints: names of integer parameters whose value :meth:`run` supplies (after the tensors).
        grid_steps: indices of steps whose grid size :meth:`run` supplies (after the ints).
        graph: run the kernels as one CUDA graph (made by the first run; each run sets every
            node's parameters from the call's values, then one ``cuGraphLaunch``: same kernels,
            arguments and stream order, less host time) where the driver allows, a memset step
            as a memset node; a run on a stream being captured launches kernel by kernel.
    """

    def __init__(self, steps: Sequence, tensors: Sequence[torch.Tensor] = (),
                 ints: Sequence[str] = (), grid_steps: Sequence[int] = (), graph: bool = True):
        lib = load()
        err = ctypes.create_string_buffer(_ERRLEN)
        if lib.efa_launch_init(err, _ERRLEN):
            raise NativeLaunchError(err.value.decode(errors="replace"))
        self._lib = lib
        self.num_steps = n = len(steps)
        self._recs = (_Record * max(1, n))()
        self._words = memoryview(self._recs).cast("B").cast("q")
        bases = [(t.data_ptr(), max(1, t.numel() * t.element_size())) for t in tensors]
        for j, (b, size) in enumerate(bases):
            for b2, size2 in bases[:j]:
                if b < b2 + size2 and b2 < b + size:
                    raise NativeLaunchError(
                        f"variable tensors {j} and another share addresses ({b:#x}, {b2:#x}): "
                        f"an argument inside them could not be told apart (bind from a call "
                        f"whose variable tensors are distinct, non-empty allocations)")
        int_index = {name: len(bases) + j for j, name in enumerate(ints)}
        uses = []  # (word index, variable index, byte offset)

        def var_of(ptr: int) -> Optional[Tuple[int, int]]:
            for j, (b, size) in enumerate(bases):
                if b <= ptr < b + size:
                    return j, ptr - b
            return None

        sizes = (ctypes.c_int64 * MAX_PARAMS)()
        for i, step in enumerate(steps):
            rec = self._recs[i]
            w0 = i * _RECORD_WORDS
            if isinstance(step, MemsetStep):
                rec.head[_F_FUNCTION] = 0
                ptr = step.tensor.data_ptr()
                v = var_of(ptr)
                if v is None:
                    rec.values[0] = ptr
                else:
                    uses.append((w0 + _VALUES, v[0], v[1]))
                rec.values[1] = step.nbytes
                continue
            fk = step.fk
            kernel = fk.compiled(step.grid, step.args, step.num_warps)
            run = kernel.run  # (initializes the function handle)
            if getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0) \
                    or getattr(run, "launch_cooperative_grid", False) or \
                    getattr(run, "launch_pdl", False):
                raise NativeLaunchError(f"{fk.fn.__name__}: needs scratch memory or launch "
                                        f"attributes the native launcher does not set")
            md = kernel.metadata
            if getattr(md, "num_ctas", 1) != 1:
                raise NativeLaunchError(f"{fk.fn.__name__}: clusters are not supported")
            names, types = _param_layout(kernel, fk, step.args)
            count = lib.efa_launch_param_sizes(int(kernel.function), sizes, MAX_PARAMS, err,
                                               _ERRLEN)
            if count < 0:
                raise NativeLaunchError(f"{fk.fn.__name__}: {err.value.decode(errors='replace')}")
            extra = count - len(names)  # Triton's trailing scratch pointers
            expect = [8 if ty.startswith("*") else _TYPE_BYTES.get(ty, -1) for ty in types]
            if extra < 0 or extra > 2 or list(sizes[:len(names)]) != expect or \
                    any(sizes[len(names) + j] != 8 for j in range(extra)):
                raise NativeLaunchError(
                    f"{fk.fn.__name__}: the compiled kernel's parameters ({count}, sizes "
                    f"{list(sizes[:count])}) do not match its signature ({names}, {types})")
            arg_of = dict(zip(fk.runtime_names(), step.args))
            for p, (name, ty) in enumerate(zip(names, types)):
                a = arg_of[name]
                word = w0 + _VALUES + p
                if name in int_index:
                    uses.append((word, int_index[name], 0))
                    rec.values[p] = int(a)
                elif hasattr(a, "data_ptr"):  # a tensor, or a page-locked host address
                    ptr = a.data_ptr()
                    v = var_of(ptr)
                    if v is None:
                        rec.values[p] = ptr
                    else:
                        uses.append((word, v[0], v[1]))
                elif isinstance(a, (bool, int)):
                    rec.values[p] = int(a)
                else:
                    raise NativeLaunchError(f"{fk.fn.__name__}: argument {name} of type "
                                            f"{type(a).__name__} ({ty}) cannot be bound")
            for p in range(count):
                rec.params[p] = ctypes.addressof(rec.values) + 8 * p
            for p in range(len(names), count):
                rec.values[p] = 0  # no scratch memory (checked above)
            grid = tuple(step.grid) + (1, 1)
            rec.head[_F_FUNCTION] = int(kernel.function)
            rec.head[_F_GRID_X], rec.head[_F_GRID_Y], rec.head[_F_GRID_Z] = grid[:3]
            rec.head[_F_BLOCK] = 32 * int(md.num_warps)
            rec.head[_F_SHARED] = int(md.shared)
            rec.head[_F_NPARAMS] = count
        check_variable_names(steps, ints)
        for j, i in enumerate(grid_steps):
            uses.append((i * _RECORD_WORDS + _F_GRID_X, len(bases) + len(ints) + j, 0))
        self.num_vars = len(bases) + len(ints) + len(grid_steps)
        flat = [v for u in uses for v in u]
        self._uses = (ctypes.c_int64 * max(1, len(flat)))(*flat)
        self._vars = (ctypes.c_int64 * max(1, self.num_vars))()
        # one pack per run: raises struct.error unless the call gives exactly num_vars values
        self._pack = struct.Struct(f"{self.num_vars}q").pack_into
        self._desc = _ProgramDesc(ctypes.addressof(self._recs), n, ctypes.addressof(self._uses),
                                  len(uses), ctypes.addressof(self._vars), int(bool(graph)), None)
        self._err = err
        # plain integers for the hot path: ctypes converts them without a from_param call
        self._addr = ctypes.addressof(self._desc)
        self._err_addr = ctypes.addressof(err)
        self._sync_ns = ctypes.c_int64(0)
        self._sync_ns_addr = ctypes.addressof(self._sync_ns)
        self._gate_ns = ctypes.c_int64(0)
        self._gate_ns_addr = ctypes.addressof(self._gate_ns)

    @property
    def graphed(self) -> bool:
        """Whether the last run went to the GPU as one CUDA graph (see ``graph``)."""
        return bool(self._desc.graph) and self._desc.graph_mode > 0

    def __del__(self):
        desc = getattr(self, "_desc", None)
        if desc is not None and desc.graph:
            try:
                self._lib.efa_launch_graph_free(self._addr)
            except Exception:  # noqa: BLE001 (interpreter shutdown: the driver may be gone)
                pass

    def set_vars(self, values: Sequence[int]) -> None:
        """Sets the variables of the next launch (as :meth:`run` takes them) without launching:
        for a native caller that launches the program itself (its address ``_addr``)."""
        self._pack(self._vars, 0, *values)

    def run(self, values: Sequence[int], stream: int) -> None:
        """Launches the program on ``stream`` with ``values``: the variable tensors' addresses,
        then the integers, then the grid sizes (a grid of 0 skips that kernel)."""
        self._pack(self._vars, 0, *values)
        rc = self._lib.efa_launch_run(self._addr, stream, self._err_addr, _ERRLEN)
        if rc:
            raise NativeLaunchError(self._err.value.decode(errors="replace"))

    def run_wait(self, values: Sequence[int], stream: int, flag: int, value: int,
                 wait_ns: int) -> Optional[float]:
        """:meth:`run`, then waits until the int64 at page-locked host address ``flag`` holds
        ``value`` (the program's last kernel writes it after what the host reads next, release
        at system scope). Returns the seconds waited, or None when ``wait_ns`` passed first."""
        self._pack(self._vars, 0, *values)
        rc = self._lib.efa_launch_run_wait(self._addr, stream, flag, value, wait_ns,
                                           self._sync_ns_addr, self._err_addr, _ERRLEN)
        if rc < 0:
            raise NativeLaunchError(self._err.value.decode(errors="replace"))
        return None if rc else self._sync_ns.value * 1e-9

    def run_gated(self, values: Sequence[int], second: "Program", values2: Sequence[int],
                  stream: int, gate: int, world: int, rank: int, record: int, spin_ns: int,
                  flag: int = 0, value: int = 0, wait_ns: int = 0) -> Tuple[int, float, float]:
        """This program with ``values``, then ``second`` with ``values2``, in one native call.
        Between them, with ``gate`` (the address of the launch gate's ``[world]`` int64
        "issued" slots; 0: none) this rank publishes ``record`` (``op * 8 + kind``) and waits
        up to ``spin_ns`` for every rank to have published the same record or a later op's.
        With ``flag``, ``second`` ends with a wait as :meth:`run_wait`.

        Returns:
            (status, seconds waiting for the device, seconds waiting for the peers). Status
            :data:`RAN`: both ran (and the flag was seen); :data:`GATE_LATE`: a peer had not
            published in time, or published this op with another kind: this program ran and
            ``record`` is published, ``second`` did not run (wait for the peers, then run it);
            :data:`FLAG_LATE`: both ran, the flag was not seen within ``wait_ns``.
        """
        self._pack(self._vars, 0, *values)
        second._pack(second._vars, 0, *values2)
        rc = self._lib.efa_launch_run_gated(
            self._addr, second._addr, stream, gate or None, world, rank, record, spin_ns,
            flag or None, value, wait_ns, self._sync_ns_addr, self._gate_ns_addr, self._err_addr,
            _ERRLEN)
        if rc < 0:
            raise NativeLaunchError(self._err.value.decode(errors="replace"))
        return rc, self._sync_ns.value * 1e-9, self._gate_ns.value * 1e-9

    def run_dispatch(self, values: Sequence[int], second: "Program", values2: Sequence[int],
                     third: "Program", values3: Sequence[int], stream: int, gate: int,
                     world: int, rank: int, record: int, spin_ns: int, flag: int, value: int,
                     wait_ns: int, shape: int, rows_out: int) -> Tuple[int, float, float]:
        """A gda regular dispatch in one native call: :meth:`run_gated` (``second`` ends with the
        wait for the header's completion word at ``flag``), then the counts before ``flag``
        checked and, when clean with ``0 < rows <= cap``, ``third`` (the gather) with
        ``values3`` whose row count and grid the library sets. ``shape``: address of the
        ``[11]`` int64 ``[world, hdr_len, L, t_max, top-k, cap, max_grid, row-count variable,
        grid variable, counts before flag, early]``; with ``early`` (and cap > 0) ``third`` is
        the early gather, launched with ``values3`` as given before the wait for ``flag`` (it
        copies only the clean rows the header left on the device, see
        ``launches.gather_rows``); ``rows_out``: address of an int64 that receives the rows
        (-1: counts not clean).

        Returns:
            (status, seconds waiting for the device, seconds waiting for the peers): the
            statuses of :meth:`run_gated`, or :data:`NOT_GATHERED` (both phases ran, the
            gather did not: the caller checks the counts and gathers).
        """
        self._pack(self._vars, 0, *values)
        second._pack(second._vars, 0, *values2)
        third._pack(third._vars, 0, *values3)
        rc = self._lib.efa_launch_dispatch(
            self._addr, second._addr, third._addr, stream, gate or None, world, rank, record,
            spin_ns, flag, value, wait_ns, shape, rows_out, self._sync_ns_addr,
            self._gate_ns_addr, self._err_addr, _ERRLEN)
        if rc < 0:
            raise NativeLaunchError(self._err.value.decode(errors="replace"))
        return rc, self._sync_ns.value * 1e-9, self._gate_ns.value * 1e-9


def rows_received(info: int, shape: int) -> int:
    """The C check of a gda dispatch's counts alone (see :meth:`Program.run_dispatch`): the
    rows received, or -1 when the counts at address ``info`` are not clean for ``shape``."""
    return load().efa_gda_rows_received(info, shape)


def check_variable_names(steps, ints: Sequence[str]) -> None:
    """Raises :class:`NativeLaunchError` unless every name in ``ints`` is a parameter of a
    kernel among ``steps`` (a misspelt name would leave the kernel's value fixed at the bound
    call's)."""
    unknown = set(ints) - {n for s in steps if not isinstance(s, MemsetStep)
                           for n in s.fk.runtime_names()}
    if unknown:
        raise NativeLaunchError(f"no kernel of this program has a parameter named "
                                f"{sorted(unknown)}")


def bind(launch, tensors: Sequence[torch.Tensor], ints: Sequence[str] = (),
         grid_steps: Sequence[int] = (), graph: bool = True) -> Optional[Program]:
    """The :class:`Program` of the launches ``launch(plan)`` appends to ``plan`` (a list),
    bound from this call's variable ``tensors``; None when a variable tensor is empty (its
    address says nothing, often 0 and shared with other empty tensors: a program bound from it
    would rewrite the wrong arguments later), so the caller launches this call from Python.
    Raises :class:`NativeLaunchError` when a kernel cannot be bound."""
    if any(t.numel() == 0 for t in tensors):
        return None
    steps = []
    launch(steps)
    return Program(steps, tensors, ints, grid_steps, graph)


def gate_publish_wait(gate: int, world: int, rank: int, record: int, spin_ns: int):
    """The launch gate's native fast path alone (see :meth:`Program.run_gated`): publishes
    ``record`` at slot ``rank`` of the ``[world]`` int64 slots at address ``gate`` and waits up
    to ``spin_ns`` for every slot to hold it or a later op's record. Returns (every rank agreed,
    seconds waited)."""
    lib = load()
    waited = ctypes.c_int64(0)
    ok = lib.efa_gate_publish_wait(gate, world, rank, record, spin_ns, ctypes.addressof(waited))
    return bool(ok), waited.value * 1e-9


def wait_flag(flag: int, value: int, wait_ns: int):
    """The completion-word wait alone (see :meth:`Program.run_wait`): spins until the int64 at
    host address ``flag`` holds ``value`` or ``wait_ns`` passed. Returns (seen, seconds
    waited)."""
    lib = load()
    waited = ctypes.c_int64(0)
    seen = lib.efa_launch_wait_flag(flag, value, wait_ns, ctypes.addressof(waited))
    return bool(seen), waited.value * 1e-9
