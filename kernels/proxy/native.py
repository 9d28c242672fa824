"""The one ctypes boundary of the proxy: builds and loads the native engine (``kernels/native/``:
``efa_proxy.c`` the engine (creation, API, waits), ``efa_endpoint.c`` a channel's libfabric
endpoint, ``efa_channel.c`` a channel thread's data path (the three share the internal
``efa_engine.h``), ``efa_round.c`` one round of the wire protocol, ``efa_host.c`` the host-side
data path helpers (routing layout, received-metadata checks, combine's reduction),
``efa_op.c`` whole operations on host memory in two calls, ``efa_devop.c`` a packed operation
of CUDA rows in one call (its kernels through the launch library), ``efa_bench.c`` the benchmark
entry points, ``efa_proxy.h`` the ABI).

Build (``native_build.py``): on first use,
``cc -O2 -std=c11 -shared -fPIC <SOURCES> -lfabric -lpthread`` into ``$EFA_EP_CACHE_DIR`` (default ``~/.cache/efa_ep``), the file named by a hash of the sources,
the header and the compile command, so a changed source rebuilds and one build serves every Python
version (C ABI, no Python symbols). ``EFA_EP_PROXY_SO=/path/libefa_proxy.so`` loads a prebuilt
library instead (hosts with the libfabric runtime but no headers, e.g. the GPU machine). These
variables are read through their declarations (:mod:`efa_ep.kernels.core.variables`).

Every symbol gets ``argtypes``/``restype`` here and a typed wrapper that raises
:class:`NativeError` carrying the C side's message (verb, peer, message id). No other module
touches ctypes.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import Optional, Sequence, Tuple

from .native_build import build_problem, compiler, library_path  # noqa: F401 (for callers)
from .native_build import build

ABI_VERSION = 11
ADDR_MAX = 256          # EFA_ADDR_MAX
CTRL_STRIDE = 16        # EFA_CTRL_STRIDE (uint64 per channel in ring_ctrl)
CTRL_TAIL, CTRL_HEAD = 0, 8
MSG_BITS = 20           # descriptor field and source-rank shift in the immediate
IMM_MSG_MASK = 0xFF     # message ids (then 8 bits of chunk mark, 4 of generation)
IMM_GEN_MASK = 0xF
# chunk marks (efa_proxy.h "Chunk marks"): uint32 per source, chunks 0..MARK_CHUNKS - 1 of a
# marked message, then the consumer's whole-data mark at MARK_WHOLE
MARKS, MARK_CHUNKS, MARK_WHOLE = 256, 254, 255
MAX_RANKS = 4096
NUM_STATS = 8
STAT_NAMES = ("popped", "posted", "tx_done", "arrived", "eagain", "noop", "max_inflight", "sleeps")
INJECT_TARGET, INJECT_SENDER = 1, 2
# test-only faults on one data write (EFA_TAMPER_* in efa_proxy.h)
TAMPER_KINDS = {"offset": 1, "msg": 2, "replay": 3, "gen": 4, "mark": 5}
_ERRLEN = 1024

_lock = threading.Lock()
_lib = None
_lib_error: Optional[str] = None


class NativeError(RuntimeError):
    """A native proxy call failed; ``code`` is the negative errno, the message comes from C."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code

    @property
    def timed_out(self) -> bool:
        return self.code == -errno.ETIMEDOUT


_u64, _i32, _u32, _vp, _cp = ctypes.c_uint64, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_char_p
_i64 = ctypes.c_int64
_pu64 = ctypes.POINTER(ctypes.c_uint64)
_SIGS = {
    "efa_abi_version": ([], _i32),
    "efa_probe": ([_cp, _cp, ctypes.c_size_t], _i32),
    "efa_probe_hmem": ([_cp, _cp, ctypes.c_size_t], _i32),
    "efa_engine_create": ([_cp, _i32, _i32, _i32, _vp, _u64, _i32, _vp, _u32, _vp, _vp, _u32, _i32, _i32,
                           _i32, _u64, _i32, _i32, _pu64, _cp, ctypes.c_size_t], _i32),
    "efa_engine_create_ex": ([_cp, _i32, _i32, _i32, _vp, _u64, _i32, _vp, _u32, _vp, _vp, _u32, _i32, _i32,
                              _i32, _u64, _i32, _i32, _u64, _u64, _u64, _cp, _u32, _pu64, _cp,
                              ctypes.c_size_t], _i32),
    "efa_engine_region_info": ([_u64, _i32, _i32, _pu64, _pu64, _cp, ctypes.c_size_t], _i32),
    "efa_engine_expect": ([_u64, _u32], _i32),
    "efa_engine_tamper": ([_u64, _i32], _i32),
    "efa_engine_set_marks": ([_u64, _vp], _i32),
    "efa_engine_mark_whole": ([_u64, _u64], _i32),
    "efa_engine_set_idle": ([_u64, _i32], _i32),
    "efa_engine_local_info": ([_u64, _i32, _vp, _pu64, _pu64, _pu64, _cp, ctypes.c_size_t], _i32),
    "efa_engine_set_peers": ([_u64, _i32, _vp, _vp, _vp, _vp, _i32, _cp, ctypes.c_size_t], _i32),
    "efa_ring_wait_space": ([_u64, _i32, _u32, _i32, _cp, ctypes.c_size_t], _i32),
    "efa_ring_publish": ([_u64, _i32, _u64], _i32),
    "efa_ring_push": ([_u64, _i32, _vp, _u32, _i32, _cp, ctypes.c_size_t], _i32),
    "efa_post_messages": ([_u64, _u32, _u32, _i32, _vp, _vp, _vp, _vp, _u32, _vp, _i32, _cp,
                           ctypes.c_size_t], _i32),
    "efa_wait_counters": ([_u64, _u32, _i32, _vp, _vp, _i32, _i32, _cp, ctypes.c_size_t], _i32),
    "efa_wait_idle": ([_u64, _i32, _cp, ctypes.c_size_t], _i32),
    "efa_engine_stats": ([_u64, _vp, _i32], _i32),
    "efa_engine_query": ([_u64, _vp, _vp, _vp, _vp], _i32),
    "efa_bench_roundtrip": ([_u64, _i32, _u32, _u32, _i32, _vp, _i32, _cp, ctypes.c_size_t], _i32),
    "efa_bench_rate": ([_u64, _i32, _u32, _u32, _u32, _pu64, _i32, _cp, ctypes.c_size_t], _i32),
    "efa_wire_begin": ([_vp, _i32, _cp, ctypes.c_size_t], _i32),
    "efa_wire_post_headers": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_wire_exchange": ([_vp, _i32, _cp, ctypes.c_size_t], _i32),
    "efa_wire_post_data": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_wire_finish": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_wire_check_headers": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_wire_stage_bytes": ([_i64, _i64, _i64], _i64),
    "efa_op_dispatch_post": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_dispatch_complete": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_cached_post": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_cached_complete": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_combine_post": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_combine_complete": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_dispatch_packed_begin": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_dispatch_packed_post": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_dispatch_packed_complete": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_cached_packed_begin": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_cached_packed_post": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_cached_packed_complete": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_combine_packed_begin": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_combine_packed_post": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_op_combine_packed_complete": ([_vp, _cp, ctypes.c_size_t], _i32),
    "efa_devop_dispatch": ([_vp, _vp, _cp, ctypes.c_size_t], _i32),
    "efa_devop_rows": ([_vp, _vp, _cp, ctypes.c_size_t], _i32),
    "efa_devop_dispatch_finish": ([_vp, _vp, _cp, ctypes.c_size_t], _i32),
    "efa_devop_step_clock": ([ctypes.c_int, _vp], _i32),
    "efa_describe_meta": ([_vp, _i64, _vp, _i64, _i64, _i64, _vp, _cp, ctypes.c_size_t], _i32),
    "efa_route_layout": ([_vp, _vp, _i64, _i64, _i64, _i64, _vp, _vp, _i64, _vp, _vp, _vp, _vp], _i64),
    "efa_unpack_meta": ([_i64, _i64, _i64, _vp, _vp, _vp, _vp, _i64, _vp, _vp, _vp, _vp, _vp], _i64),
    "efa_reduce_rows": ([_i64, _i64, _i64, _i64, _i64, _vp, _vp, _vp, _vp, _vp], _i32),
    "efa_engine_stop": ([_u64], _i32),
    "efa_engine_destroy": ([_u64], _i32),
}


def keep_signal_handlers() -> None:
    """Call before this process first loads libfabric. Debian's and Ubuntu's libfabric links
    the PSM providers, whose ``libinfinipath`` installs, when loaded, handlers for SIGTERM,
    SIGSEGV, SIGBUS, SIGILL and SIGABRT that print a backtrace from inside the handler: a
    SIGTERM (torchrun, Slurm) then ends the process with status 1 instead of by the signal, or
    hangs it when another thread holds a lock the backtrace takes (seen in a rank process after
    a SIGTERM), and a crash bypasses Python's ``faulthandler``. Its own variable
    ``IPATH_NO_BACKTRACE`` turns them off; set here unless the user set it (the rank processes
    started later inherit it)."""
    os.environ.setdefault("IPATH_NO_BACKTRACE", "1")


def load():
    """Builds (if needed) and loads the library once per process. Raises RuntimeError."""
    global _lib, _lib_error
    with _lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise RuntimeError(_lib_error)
        keep_signal_handlers()
        try:
            path = build()
            lib = ctypes.CDLL(path)  # CDLL releases the GIL during calls: waits do not block Python
            for name, (args, res) in _SIGS.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
            if lib.efa_abi_version() != ABI_VERSION:
                raise RuntimeError(f"{path}: ABI version {lib.efa_abi_version()} != {ABI_VERSION}")
        except (OSError, RuntimeError, AttributeError) as e:
            _lib_error = f"cannot load the native proxy: {e}"
            raise RuntimeError(_lib_error) from e
        _lib = lib
        return lib


def _check(rc: int, err) -> int:
    if rc < 0:
        raise NativeError(rc, err.value.decode(errors="replace") or f"native error {rc}")
    return rc


def _err():
    return ctypes.create_string_buffer(_ERRLEN)


def probe(provider: str, hmem: bool = False) -> Optional[str]:
    """None if ``provider`` offers RDM + FI_RMA + FI_REMOTE_CQ_DATA here (and, with ``hmem``,
    FI_HMEM device-memory registration), else the reason."""
    try:
        lib = load()
    except RuntimeError as e:
        return str(e)
    err = _err()
    fn = lib.efa_probe_hmem if hmem else lib.efa_probe
    rc = fn(provider.encode(), err, _ERRLEN)
    return None if rc == 0 else err.value.decode(errors="replace")


class Engine:
    """Typed wrapper over one native engine. Memory arguments are raw addresses of caller-owned
    buffers (the Python transport keeps the tensors alive for the engine's lifetime)."""

    def __init__(self, provider: str, rank: int, world: int, num_channels: int, window_ptr: int,
                 window_bytes: int, rings_ptr: int, ring_slots: int, ctrl_ptr: int,
                 counters_ptr: int, num_slots: int, max_inflight: int, spin_us: int, inject: int,
                 seed: int, cpu_base: int, timeout_ms: int, hmem_cuda_device: int = -1,
                 recv_off: int = 0, recv_stride: int = 0, key_seed: Optional[int] = None,
                 node: str = "", gen: int = 0):
        """``recv_stride > 0``: hardened layout (efa_engine_create_ex): source r writes only into
        ``[recv_off + r * recv_stride, + recv_stride)``, keys from ``key_seed`` (random when
        None), endpoint bound to ``node`` (tcp), ``gen`` in every immediate. ``recv_stride=0``:
        one region, the whole window (standalone benchmark engines)."""
        self._lib = load()
        # error text of the per-operation calls (one operation at a time per engine)
        self._errbuf = _err()
        self.num_channels = num_channels
        self.world = world
        h = ctypes.c_uint64(0)
        err = _err()
        if key_seed is None:
            key_seed = int.from_bytes(os.urandom(8), "little")
        _check(self._lib.efa_engine_create_ex(
            provider.encode(), rank, world, num_channels, window_ptr, window_bytes, hmem_cuda_device, rings_ptr,
            ring_slots, ctrl_ptr, counters_ptr, num_slots, max_inflight, spin_us, inject, seed,
            cpu_base, timeout_ms, recv_off, recv_stride, key_seed, node.encode(), gen,
            ctypes.byref(h), err, _ERRLEN), err)
        self.handle = h.value

    def region_info(self, ch: int, src: int) -> Tuple[int, int]:
        """(key, base) of source ``src``'s receive region in this window on channel ch: what
        only ``src`` needs to write to us."""
        key, base = ctypes.c_uint64(), ctypes.c_uint64()
        err = _err()
        _check(self._lib.efa_engine_region_info(self.handle, ch, src, ctypes.byref(key),
                                                ctypes.byref(base), err, _ERRLEN), err)
        return key.value, base.value

    def expect(self, seq: int) -> None:
        """The consumer entered round ``seq``: other message ids now fail the engine."""
        self._lib.efa_engine_expect(self.handle, seq & 0xFFFFFFFF)

    def set_idle(self, linger_us: int) -> None:
        """The channel threads' idle policy (efa_engine_set_idle): ``linger_us > 0`` keeps them
        busy only while there is work or a thread waits in the engine; 0 spins ``spin_us``."""
        self._lib.efa_engine_set_idle(self.handle, linger_us)

    def set_marks(self, marks_ptr: int) -> None:
        """Keep chunk marks in ``[world * MARKS]`` uint32 at ``marks_ptr`` (zeroed caller memory,
        alive as long as the engine; see :func:`mark_tag`)."""
        self._lib.efa_engine_set_marks(self.handle, marks_ptr)

    def mark_whole(self, seq: int) -> None:
        """Stores round ``seq``'s tag at every source's whole-data mark."""
        self._lib.efa_engine_mark_whole(self.handle, seq)

    def tamper(self, kind: str) -> None:
        """Test-only: alters the next data write (TAMPER_KINDS)."""
        self._lib.efa_engine_tamper(self.handle, TAMPER_KINDS[kind] if kind else 0)

    def local_info(self, ch: int) -> Tuple[bytes, int, int]:
        """(endpoint name padded to ADDR_MAX bytes, name length, key, base) of channel ch."""
        name = ctypes.create_string_buffer(ADDR_MAX)
        n, key, base = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        err = _err()
        _check(self._lib.efa_engine_local_info(self.handle, ch, name, ctypes.byref(n),
                                               ctypes.byref(key), ctypes.byref(base), err, _ERRLEN), err)
        return name.raw, n.value, key.value, base.value

    def set_peers(self, ch: int, names: bytes, name_lens: Sequence[int], keys: Sequence[int],
                  bases: Sequence[int], timeout_ms: int) -> None:
        w = self.world
        names_buf = ctypes.create_string_buffer(names, len(names))
        lens = (ctypes.c_uint64 * w)(*name_lens)
        k = (ctypes.c_uint64 * w)(*keys)
        b = (ctypes.c_uint64 * w)(*bases)
        err = _err()
        _check(self._lib.efa_engine_set_peers(self.handle, ch, names_buf, lens, k, b, timeout_ms,
                                              err, _ERRLEN), err)

    def ring_wait_space(self, ch: int, n: int, timeout_ms: int) -> None:
        err = self._errbuf
        _check(self._lib.efa_ring_wait_space(self.handle, ch, n, timeout_ms, err, _ERRLEN), err)

    def ring_publish(self, ch: int, new_tail: int) -> None:
        self._lib.efa_ring_publish(self.handle, ch, new_tail)

    def ring_push(self, ch: int, descs_ptr: int, n: int, timeout_ms: int) -> None:
        err = _err()
        _check(self._lib.efa_ring_push(self.handle, ch, descs_ptr, n, timeout_ms, err, _ERRLEN), err)

    def post_messages(self, msg: int, n: int, dests_ptr: int, local_offs_ptr: int,
                      remote_offs_ptr: int, sizes_ptr: int, chunk_bytes: int, next_channel_ptr: int,
                      timeout_ms: int, mark0: int = 0) -> None:
        """Cuts n messages into chunks and posts them (efa_post_messages). The four arrays are n
        int64 each, next_channel_ptr one uint32 (addresses of contiguous CPU buffers);
        ``mark0`` > 0: chunk k of each message carries chunk mark ``mark0 + k``."""
        err = self._errbuf
        _check(self._lib.efa_post_messages(self.handle, msg, mark0, n, dests_ptr, local_offs_ptr,
                                           remote_offs_ptr, sizes_ptr, chunk_bytes, next_channel_ptr,
                                           timeout_ms, err, _ERRLEN), err)

    def wait_counters(self, msg: int, srcs_ptr: int, expected_ptr: int, n: int, reset: bool,
                      timeout_ms: int) -> None:
        """srcs_ptr: n int32; expected_ptr: n uint64 (addresses of contiguous CPU tensors)."""
        err = self._errbuf
        _check(self._lib.efa_wait_counters(self.handle, msg, n, srcs_ptr, expected_ptr, int(reset),
                                           timeout_ms, err, _ERRLEN), err)

    def wait_idle(self, timeout_ms: int) -> None:
        err = self._errbuf
        _check(self._lib.efa_wait_idle(self.handle, timeout_ms, err, _ERRLEN), err)

    def stats(self) -> list:
        """Per channel dict of counters (see STAT_NAMES)."""
        n = self.num_channels * NUM_STATS
        buf = (ctypes.c_uint64 * n)()
        self._lib.efa_engine_stats(self.handle, buf, n)
        return [dict(zip(STAT_NAMES, buf[c * NUM_STATS:(c + 1) * NUM_STATS]))
                for c in range(self.num_channels)]

    def bench_roundtrip(self, ch: int, nbytes: int, msg0: int, iters: int, timeout_ms: int) -> list:
        """Per-op ns of push -> proxy -> counter visible, the producer being native code."""
        out = (ctypes.c_uint64 * iters)()
        err = _err()
        _check(self._lib.efa_bench_roundtrip(self.handle, ch, nbytes, msg0, iters, out, timeout_ms,
                                             err, _ERRLEN), err)
        return list(out)

    def bench_rate(self, nch: int, n: int, nbytes: int, msg: int, timeout_ms: int) -> int:
        """ns to push and complete n descriptors on each of nch channels."""
        out = ctypes.c_uint64()
        err = _err()
        _check(self._lib.efa_bench_rate(self.handle, nch, n, nbytes, msg, ctypes.byref(out),
                                        timeout_ms, err, _ERRLEN), err)
        return out.value

    def stop(self) -> None:
        if self.handle:
            self._lib.efa_engine_stop(self.handle)

    def destroy(self) -> None:
        if self.handle:
            self._lib.efa_engine_destroy(self.handle)
            self.handle = 0


# ---------------------------------------------------------------------------------------------
# One round of the wire protocol in native code (efa_round.c; ``efa_wire`` in efa_proxy.h)
HDR_FIXED = 7
MAX_PLANES = 4
DT_F32, DT_BF16 = 1, 2


class WireStruct(ctypes.Structure):
    """``struct efa_wire`` (efa_proxy.h): every field 8 bytes, in the header's order."""

    _fields_ = [(name, kind) for name, kind in (
        ("engine", _u64), ("window", _vp), ("rank", _i64), ("world", _i64), ("hdr_fields", _i64),
        ("num_extra", _i64), ("hdr_len", _i64), ("hdr_bytes", _i64), ("hdr_chunks", _i64),
        ("off_hdr_send", _i64), ("off_data_send", _i64), ("send_bytes", _i64), ("off_recv", _i64),
        ("region_bytes", _i64), ("chunk_bytes", _i64), ("max_rows", _i64), ("timeout_ms", _i64),
        ("next_channel", _vp), ("msgs", _vp), ("max_msgs", _i64), ("hmsgs", _vp),
        ("wait_srcs", _vp), ("wait_expected", _vp),
        ("seq", _i64), ("op", _i64), ("status", _i64), ("nplanes", _i64), ("tag", _i64),
        ("fmt", _i64), ("row_bytes", _i64), ("widths", _i64 * MAX_PLANES),
        ("rows_to", _vp), ("extras", _vp), ("n_recv", _vp),
        ("plan", _vp), ("got", _vp), ("rows_from", _vp), ("nmsgs", _i64), ("bad_peer", _i64),
        ("r_writes", _i64), ("r_wire_bytes", _i64), ("r_messages", _i64), ("r_rows", _i64),
        ("wait_ns", _i64), ("window_kind", _i64), ("stage", _vp), ("stream", _u64))]


# How a round reaches its window (efa_proxy.h EFA_WINDOW_*): in place (a host window), through
# the CUDA driver's copies (a device window), through memcpy (a host window reached as a device
# window is: the tests' stand-in for the device window's steps)
WINDOW_DIRECT, WINDOW_CUDA, WINDOW_COPIED = 0, 1, 2


def wire_stage_bytes(world: int, hdr_bytes: int, hdr_len: int) -> int:
    """Bytes of the host stage of a window reached through copies (efa_wire_stage_bytes)."""
    return int(load().efa_wire_stage_bytes(world, hdr_bytes, hdr_len))


# efa_wire_check_headers' codes (efa_proxy.h): what a round's headers say beyond "clean"
RC_GROUP_INPUT, RC_GROUP_MISMATCH, RC_HANDLE_MISMATCH, RC_LOCAL_INPUT = 1, 2, 3, 4


class NativeWire:
    """Typed calls of efa_wire_* on one struct (the caller keeps every array it points to alive).
    Each returns the C return code (0, or an ``RC_*`` code: see efa_proxy.h; :meth:`text` is its
    message) and raises :class:`NativeError` on failures."""

    def __init__(self, st: WireStruct):
        self._lib = load()
        self.st = st
        self._ref = ctypes.byref(st)
        self.address = ctypes.addressof(st)
        self._err = _err()

    def _call(self, fn, *args) -> int:
        rc = fn(self._ref, *args, self._err, _ERRLEN)
        if rc < 0:
            raise NativeError(rc, self._err.value.decode(errors="replace") or f"native error {rc}")
        return rc

    def text(self) -> str:
        """The message of the last call's non-zero return code."""
        return self._err.value.decode(errors="replace")

    def check_headers(self) -> int:
        return self._call(self._lib.efa_wire_check_headers)

    def describe_meta(self, src: int, meta_ptr: int, n: int, k: int, num_local: int,
                      hdr_counts_ptr: int) -> str:
        """The text of the problem efa_unpack_meta found in source ``src``'s routing rows."""
        self._lib.efa_describe_meta(self._ref, src, meta_ptr, n, k, num_local, hdr_counts_ptr,
                                    self._err, _ERRLEN)
        return self.text()

    def begin(self, post_headers: bool) -> int:
        return self._call(self._lib.efa_wire_begin, int(post_headers))

    def post_headers(self) -> int:
        return self._call(self._lib.efa_wire_post_headers)

    def exchange(self, post_data: bool) -> int:
        return self._call(self._lib.efa_wire_exchange, int(post_data))

    def post_data(self) -> int:
        return self._call(self._lib.efa_wire_post_data)

    def finish(self) -> int:
        return self._call(self._lib.efa_wire_finish)


class OpStruct(ctypes.Structure):
    """``struct efa_op`` (efa_proxy.h): every field 8 bytes, in the header's order."""

    _fields_ = [(name, kind) for name, kind in (
        ("wire", _vp), ("gen", _i64), ("num_experts", _i64), ("num_local", _i64),
        ("meta", _vp), ("meta_rows", _i64), ("slot", _vp), ("slot_cap", _i64), ("scratch", _vp),
        ("aux", _vp), ("counts", _vp), ("num_send", _vp), ("num_recv", _vp),
        ("seq", _i64), ("tokens", _i64), ("row_bytes", _i64), ("fmt", _i64), ("topk", _i64),
        ("cap", _i64), ("dtype", _i64), ("x", _vp), ("topk_idx", _vp), ("weights", _vp),
        ("send_idx", _vp), ("recv_x", _vp), ("recv_idx", _vp), ("recv_w", _vp),
        ("tokens_per_expert", _vp), ("out", _vp), ("rows", _i64), ("flags", _i64),
        ("bad_peer", _i64), ("kind", _i64), ("dev_counts", _vp), ("progress", _vp),
        ("progress_words", _i64), ("chunk_rows", _i64))]


class NativeOp:
    """Typed calls of efa_op_* on one struct: ``post``/``complete`` of ``dispatch``, ``cached``
    and ``combine``, ``begin``/``post``/``complete`` of the packed kinds, return the C return
    code (0 or an ``RC_*`` code, :meth:`text` its message) and raise :class:`NativeError` (the
    message from C) on failures."""

    def __init__(self, st: OpStruct):
        lib = self._lib = load()
        self.st = st
        self._ref = ctypes.byref(st)
        self._err = _err()
        self._fns = {(kind, step): getattr(lib, f"efa_op_{kind}_{step}")
                     for kind in ("dispatch", "cached", "combine", "dispatch_packed",
                                  "cached_packed", "combine_packed")
                     for step in ("post", "complete")}
        for kind in ("dispatch_packed", "cached_packed", "combine_packed"):  # headers first
            self._fns[kind, "begin"] = getattr(lib, f"efa_op_{kind}_begin")

    def call(self, kind: str, step: str) -> int:
        rc = self._fns[kind, step](self._ref, self._err, _ERRLEN)
        if rc < 0:
            raise NativeError(rc, self._err.value.decode(errors="replace") or f"native error {rc}")
        return rc

    def text(self) -> str:
        return self._err.value.decode(errors="replace")


# A packed operation in one call (efa_devop.c; ``efa_devop`` in efa_proxy.h)
DEVOP_DISPATCH, DEVOP_COMBINE, DEVOP_CACHED = 1, 2, 3


def mark_tag(seq: int) -> int:
    """The chunk marks' tag of round ``seq`` (efa_mark_tag): never 0, and different for the
    2**30 rounds before it."""
    return (seq & 0x3FFFFFFF) + 1
(STEP_QUIESCE, STEP_LAUNCH, STEP_WAIT_READS, STEP_BEGIN, STEP_POST, STEP_COMPLETE, STEP_READS,
 STEP_DONE) = range(1, 9)


class DevopStruct(ctypes.Structure):
    """``struct efa_devop`` (efa_proxy.h): every field 8 bytes, in the header's order."""

    _fields_ = [(name, _i64) for name in (
        "run", "event_record", "event_wait", "stream", "pack", "reads", "wait_event",
        "reads_event", "kind", "early", "recv_off", "send_off", "routing_cap", "own_start",
        "step")]


def route_layout(idx_ptr: int, w_ptr: int, T: int, K: int, E: int, W: int, send_idx_ptr: int,
                 meta_ptr: int, cap: int, num_send_ptr: int, counts_ptr: int, scratch_ptr: int,
                 flags_ptr: int) -> int:
    """efa_route_layout (efa_proxy.h): rows S, or -1 (value flags set), or -ENOSPC."""
    return load().efa_route_layout(idx_ptr, w_ptr, T, K, E, W, send_idx_ptr, meta_ptr, cap,
                                   num_send_ptr, counts_ptr, scratch_ptr, flags_ptr)


def unpack_meta(W: int, K: int, L: int, src_ptrs: int, n_ptr: int, check_ptr: int, hdr_ptr: int,
                hdr_stride: int, out_idx_ptr: int, out_w_ptr: int, tpe_ptr: int, scratch_ptr: int,
                kind_ptr: int) -> int:
    """efa_unpack_meta: the first bad source, or -1."""
    return load().efa_unpack_meta(W, K, L, src_ptrs, n_ptr, check_ptr, hdr_ptr, hdr_stride,
                                  out_idx_ptr, out_w_ptr, tpe_ptr, scratch_ptr, kind_ptr)


def reduce_rows(W: int, T: int, D: int, in_dtype: int, out_dtype: int, rows_ptr: int, n_ptr: int,
                idx_ptr: int, slot_ptr: int, out_ptr: int) -> int:
    """efa_reduce_rows: 0, 1 (a NaN sum: recompute with torch) or -EINVAL."""
    return load().efa_reduce_rows(W, T, D, in_dtype, out_dtype, rows_ptr, n_ptr, idx_ptr, slot_ptr,
                                  out_ptr)
