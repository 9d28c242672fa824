"""A ``gda`` transport on a machine without a GPU, for its host code: the Python path of every
op, its bound plans and the arguments it hands the native library, with none of the device work.

:func:`host_only_transport` assembles a :class:`~efa_ep.kernels.gda.GdaTransport` around CPU
tensors (no windows, no peers: the launch gate's board is private and every peer is always
ahead) and gives it :func:`stand_in_library` for the native library, built here from C with the
same entry points: it writes each program's variables into its records as the real library does,
launches nothing, writes the given counts where the header kernel would write them, then the
op's completion word, and remembers that word's address and value (:func:`last_completion`);
of a compact dispatch whose header program copies the received ids it makes that copy.

Used by ``scripts/probes/gda_python_cost.py`` (what the Python costs) and
``tests/kernels/test_gda_plans_cpu.py`` (a bound plan passes what the phase methods pass). It
replaces ``GdaPhases._program`` and the stream and capture checks of ``efa_ep.kernels.gda``
through ``patch`` (``setattr`` by default: for the whole process; a test passes pytest's
``monkeypatch.setattr``).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
import subprocess
from typing import Sequence, Tuple

import torch

_STAND_IN = r"""
#include <stdint.h>
#include <string.h>
#include <stddef.h>
typedef struct {
  int64_t *recs; int64_t n; const int64_t *uses; int64_t nu; const int64_t *vars;
  int64_t graph_mode; void *graph;  /* (a graph is never made here) */
} prog_t;
static void bind(const prog_t *p) {
  for (int64_t i = 0; i < p->nu; i++) {
    const int64_t *u = &p->uses[3 * i];
    p->recs[u[0]] = p->vars[u[1]] + u[2];
  }
}
static int64_t info[65536], ninfo, last_flag, last_value, gate_late;
/* the next n gated calls find a peer late: the first program runs and is published, the
 * second does not (efa_launch_run_gated's status 1) */
void stand_in_gate_late(int64_t n) { gate_late = n; }
void stand_in_set_info(const int64_t *p, int64_t n) { memcpy(info, p, 8 * n); ninfo = n; }
void stand_in_last(int64_t *out) { out[0] = last_flag; out[1] = last_value; }
static void header(int64_t *flag, int64_t value) {
  memcpy(flag - ninfo, info, 8 * ninfo);
  *flag = value;
  last_flag = (int64_t)(uintptr_t)flag;
  last_value = value;
}
int efa_launch_bind(const prog_t *p) { bind(p); return 0; }
static int64_t copies;
int64_t stand_in_copies(void) { return copies; }
int efa_launch_copy(int64_t dst, int64_t src, int64_t n, int64_t s, void *e, size_t l) {
  memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n); copies++; return 0;
}
/* programs with the early ids copy (copy_ids_early, after a compact header read): the id
 * region of each window parity and the top-k, as the recorded launch had them */
static struct { const prog_t *p; int64_t src[2], k; } ids_progs[8];
void stand_in_ids_program(const prog_t *p, int64_t src0, int64_t src1, int64_t k) {
  for (int i = 0; i < 8; i++)
    if (!ids_progs[i].p || ids_progs[i].p == p) {
      ids_progs[i].p = p; ids_progs[i].src[0] = src0; ids_progs[i].src[1] = src1;
      ids_progs[i].k = k; return;
    }
}
/* the copy as the kernel makes it: vars (header's two, room, op number, room's rows); the
 * rows the count read found when in [1, room's rows] (the kernel's own count: the same when
 * clean) */
static void ids_copy(const prog_t *p, int64_t rows) {
  for (int i = 0; i < 8 && ids_progs[i].p; i++)
    if (ids_progs[i].p == p && p->nu == 2 * 5) {  /* (its 5 variables, each used twice) */
      const int64_t *v = p->vars;
      if (rows > 0 && rows <= v[4])
        memcpy((void *)(uintptr_t)v[2], (const void *)(uintptr_t)ids_progs[i].src[v[3] & 1],
               (size_t)(8 * rows * ids_progs[i].k));
      return;
    }
}
int efa_launch_run(const prog_t *p, int64_t s, void *e, size_t l) { bind(p); return 0; }
int efa_launch_run_wait(const prog_t *p, int64_t s, int64_t *flag, int64_t value, int64_t wait,
                        int64_t *waited, void *e, size_t l) {
  bind(p); header(flag, value); *waited = 0; return 0;
}
int efa_launch_run_gated(const prog_t *a, const prog_t *b, int64_t s, int64_t *gate, int w, int r,
                         int64_t rec, int64_t spin, int64_t *flag, int64_t value, int64_t wait,
                         int64_t *sync, int64_t *gns, void *e, size_t l) {
  bind(a);
  *sync = 0; *gns = 0;
  if (gate) gate[r] = rec;
  if (gate_late > 0) { gate_late--; return 1; }
  bind(b);
  if (flag) header(flag, value);
  return 0;
}
/* the launch gate's fast path: published; every peer is always ahead here */
int efa_gate_publish_wait(int64_t *gate, int w, int r, int64_t rec, int64_t spin,
                          int64_t *waited) {
  if (gate) gate[r] = rec;
  if (waited) *waited = 0;
  return 1;
}
/* the real library's count check (efa_gda_rows_received), set from Python */
static int64_t (*rows_received)(const int64_t *, const int64_t *);
void stand_in_set_check(void *fn) { rows_received = fn; }
int efa_launch_dispatch(const prog_t *a, const prog_t *b, const prog_t *c, int64_t s,
                        int64_t *gate, int w, int r, int64_t rec, int64_t spin, int64_t *flag,
                        int64_t value, int64_t wait, const int64_t *shape, int64_t *rows_out,
                        int64_t *sync, int64_t *gns, void *e, size_t l) {
  /* early (and cap > 0): the early gather is launched as bound, before the count read */
  const int early = shape[10] != 0 && shape[5] > 0;
  int rc = efa_launch_run_gated(a, b, s, gate, w, r, rec, spin, flag, value, wait, sync, gns, e, l);
  if (rc) return rc;
  if (early && c) bind(c);  /* (NULL: b holds the early gather) */
  int64_t rows = rows_received(flag - shape[9], shape);
  *rows_out = rows;
  ids_copy(b, rows);
  if (rows <= 0 || rows > shape[5]) return 3;
  if (early) return 0;
  int64_t *vars = (int64_t *)c->vars;
  vars[shape[7]] = rows;
  vars[shape[8]] = rows < shape[6] ? rows : shape[6];
  bind(c);
  return 0;
}
"""


def stand_in_library(directory: str):
    """Builds (``cc``) and loads the stand-in native library in ``directory``; its dispatch
    checks the counts with the real library's check (which loads without a GPU)."""
    from efa_ep.kernels import native_launch as nl

    src, lib = os.path.join(directory, "gda_stand_in.c"), os.path.join(directory, "libgda_stand_in.so")
    with open(src, "w") as f:
        f.write(_STAND_IN)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    stand_in = ctypes.CDLL(lib)
    stand_in.stand_in_set_check.argtypes = [ctypes.c_void_p]
    stand_in.stand_in_set_check(ctypes.cast(nl.load().efa_gda_rows_received, ctypes.c_void_p))
    return stand_in


def last_completion(lib) -> Tuple[int, int]:
    """(address, value) of the last completion word the stand-in library wrote."""
    out = (ctypes.c_int64 * 2)()
    lib.stand_in_last(out)
    return out[0], out[1]


def header_info(world: int, num_local: int, rows_from: Sequence[int], rows_to: Sequence[int],
                per_expert: Sequence[int]) -> list:
    """The int64 counts a dispatch's header kernel hands the host (``launches.recv_header``):
    error bits 0, every source's header (status 0, its rows, its rows split evenly over the
    local experts), the rows this rank sent each destination, the rows per local expert."""
    hl = 2 + num_local
    info = [0] * (1 + world * hl + world + num_local)
    for s in range(world):
        info[2 + s * hl] = rows_from[s]
        for e in range(num_local):
            info[3 + s * hl + e] = rows_from[s] // num_local
    end = 1 + world * hl
    info[end:end + world] = list(rows_to)
    info[end + world:] = list(per_expert)
    return info


def host_only_transport(lib, *, world: int = 2, num_experts: int = 256, hidden: int = 7168,
                        t_max: int = 4096, info: Sequence[int] = (), patch=setattr,
                        cpp: bool = False):
    """A :class:`~efa_ep.kernels.gda.GdaTransport` of rank 0 of ``world`` on CPU tensors whose
    native calls go to ``lib`` (:func:`stand_in_library`); every dispatch's header reads
    ``info`` (:func:`header_info`). bf16 rows, the launch gate on, ``fast_launch=3``, or with
    ``cpp`` 4 (the C++ dispatch, :mod:`efa_ep.kernels.gda.cpp_op`, must build here)."""
    from efa_ep.kernels import native_launch as nl
    from efa_ep.kernels.base import TransportConfig, align_up
    from efa_ep.kernels.gda import compact, cpp_op, launches, phases, transport
    from efa_ep.kernels.gda.gate import LaunchGate
    from efa_ep.kernels.gda.window import WindowLayout

    for name, (args, res) in nl._SIGS.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
    patch(torch.cuda, "is_current_stream_capturing", lambda: False)
    patch(phases, "_stream", lambda dev: 0)
    patch(cpp_op, "_stream", lambda dev: 0)
    patch(compact, "_stream", lambda dev: 0)
    W, L = world, num_experts // world
    cfg = TransportConfig(name="gda", world_size=W, num_experts=num_experts, hidden=hidden,
                          max_tokens_per_rank=t_max, dtype=torch.bfloat16)
    tr = object.__new__(transport.GdaTransport)
    tr.cfg, tr.group, tr.rank, tr.world_size, tr.uid = cfg, None, 0, W, 1
    tr._kern, tr.max_topk, tr.timeout_s, tr.check_every_call = launches, 16, 60.0, False
    tr.check_backward, tr.fast_launch, tr.blocked_s = True, 3, 0.0
    tr._check_queued = False
    tr.device, tr.ranks_per_device, tr.launch_gate = torch.device("cpu"), W, True
    gate = object.__new__(LaunchGate)  # a board in private memory; the peers are always ahead
    gate._attach(mmap.mmap(-1, LaunchGate.board_bytes(W)), 0, W)
    gate.issued[1:] = 2**60
    tr._gate = gate
    tr.num_programs, tr._elem = 132, 2
    tr.layout = WindowLayout(world=W, t_max=t_max, row_bytes=align_up(hidden * 2, 16), k_cap=16,
                             num_local=L)
    tr._offs = (tr.layout.offsets(0), tr.layout.offsets(1))
    tr._buf = torch.zeros(tr._offs[1]["hdr_off"] + 8 * W * tr.layout.hdr_len, dtype=torch.uint8)
    tr._buf_ptrs = torch.zeros(W, dtype=torch.int64)
    tr._sig_ptrs = torch.zeros(W, dtype=torch.int64)
    tr._win_ptr, tr._my_sig = tr._buf_ptrs[0:1], torch.zeros(W, dtype=torch.int32)
    tr._err, tr._hw = torch.zeros(4, dtype=torch.int64), torch.zeros(2, W, dtype=torch.int64)
    tr._idx_k, tr._idx_full, tr._idx_epoch = [0, 0], [False, False], [0, 0]
    tr._done, tr._epoch = torch.zeros(2, dtype=torch.int32), 0
    tr._op_base, tr._dev_base = torch.zeros(1, dtype=torch.int32), 0
    tr._capturing, tr._broken = False, None
    tr._wait_kw = dict(timeout_ns=60 * 10**9, max_spins=2**31 - 1, use_globaltimer=True)
    tr._hdr = tuple(tr._buf[o["hdr_off"]:o["hdr_off"] + 8 * W * tr.layout.hdr_len]
                    .view(torch.int64).view(W, -1) for o in tr._offs)
    ph = object.__new__(phases.GdaPhases)
    ph.tr, ph.fast, ph.gated, ph.native_off, ph._progs, ph._plans = tr, True, True, None, {}, {}
    ph._dev, ph._header_words, ph._flag_wait_ns = 0, None, 10**9
    ph._ahead, ph.cpp, ph.cpp_off = None, (cpp_op.load() if cpp else None), None
    ph._cpp_device = -2  # the C++ input check takes CPU tensors
    ph.layout_in_store = tr.layout_in_store = 1
    tr.wait_in_reduce, tr.wait_programs, tr.gather_early = 0, 66, 2
    tr.rows_in_window, tr._fixed_regions = False, {}
    tr._rows_mode, tr.compact_dispatches, tr._choice = "0", 0, 0
    ph.wait_in_kernel, ph.read_programs, ph._read_step = False, tr.num_programs, 1
    tr.fast_launch = 4 if cpp else 3
    n_info = 1 + W * (2 + L) + W + L
    ph._pinned = torch.full((n_info + 1,), -1, dtype=torch.int64)
    addr = ph._pinned.data_ptr()
    ph._host = (addr, memoryview((ctypes.c_int64 * n_info).from_address(addr)).cast("B").cast("q"))

    def program(self, key, launch, tensors, ints=phases._EPOCH, grid_steps=()):
        prog = self._progs.get(key)
        if prog is None:  # the real class's layout: 2 records, every variable used twice
            # the launches recorded, not run: every integer variable names a kernel parameter
            # (as the real class requires)
            steps = []
            launch(steps)
            nl.check_variable_names(steps, ints)
            copy = [st for st in steps if isinstance(st, nl.KernelStep)
                    and st.fk is launches._K_COPY_IDS_EARLY]
            n_vars = len(tensors) + len(ints) + len(grid_steps)
            prog = object.__new__(nl.Program)
            prog._lib, prog.num_steps, prog.num_vars = lib, 2, n_vars
            prog._recs = (nl._Record * 2)()
            prog._words = memoryview(prog._recs).cast("B").cast("q")
            flat = [v for i in range(2 * n_vars) for v in (nl._VALUES + i, i % n_vars, 0)]
            prog._uses = (ctypes.c_int64 * len(flat))(*flat)
            prog._vars = (ctypes.c_int64 * n_vars)()
            prog._pack = struct.Struct(f"{n_vars}q").pack_into
            prog._desc = nl._ProgramDesc(ctypes.addressof(prog._recs), 2,
                                         ctypes.addressof(prog._uses), 2 * n_vars,
                                         ctypes.addressof(prog._vars))
            prog._addr = ctypes.addressof(prog._desc)
            if copy:  # the stand-in copies as the kernel would (args: see copy_ids_early)
                base, k = self.tr._buf.data_ptr(), copy[0].args[5]
                lib.stand_in_ids_program(ctypes.c_void_p(prog._addr),
                                         *(ctypes.c_int64(base + o["idx_off"])
                                           for o in self.tr._offs), ctypes.c_int64(k))
            prog._err = ctypes.create_string_buffer(nl._ERRLEN)
            prog._err_addr = ctypes.addressof(prog._err)
            prog._sync_ns, prog._gate_ns = ctypes.c_int64(0), ctypes.c_int64(0)
            prog._sync_ns_addr = ctypes.addressof(prog._sync_ns)
            prog._gate_ns_addr = ctypes.addressof(prog._gate_ns)
            self._progs[key] = prog
        return prog

    patch(phases.GdaPhases, "_program", program)
    tr._phases = ph
    if len(info) != n_info:
        raise ValueError(f"info must hold {n_info} counts (header_info), got {len(info)}")
    lib.stand_in_set_info((ctypes.c_int64 * n_info)(*info), n_info)
    return tr


def with_host_window(tr):
    """``tr`` (a :func:`host_only_transport`) with ``rows_in_window`` on and a window in host
    memory holding its boards and headers: its regular dispatches store compact and return the
    rows as views of that window (the stand-in library's header reads the counts given)."""
    tr.rows_in_window = True
    tr._buf = torch.zeros(tr.layout.total_bytes, dtype=torch.uint8)
    n_board, w = tr.layout.board_words, tr.world_size
    tr._board = tuple(tr._buf[o["board_off"]:o["board_off"] + 8 * n_board].view(torch.int64)
                      for o in tr._offs)
    tr._hdr = tuple(tr._buf[o["hdr_off"]:o["hdr_off"] + 8 * w * tr.layout.hdr_len]
                    .view(torch.int64).view(w, -1) for o in tr._offs)
    return tr
