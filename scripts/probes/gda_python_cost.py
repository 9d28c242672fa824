#!/usr/bin/env python3
"""The Python host cost of gda's eager ops, on a machine without a GPU.

A :class:`~efa_ep.kernels.gda.GdaTransport` is assembled around CPU tensors (no windows, no
peers) and its native library is replaced by a stand-in built here from C (same entry points:
binds each program's variables, launches nothing, writes plausible counts where a header kernel
would). Every dispatch, combine, cached dispatch and weight combine then runs the transport's
real Python path, bound plans and native-call argument packing included, and the wall time per
call is what that Python costs. Use it to compare two versions of the hot path on the CPU
machine; device costs (launches, waits) are not in it: measure those on a GPU with
``scripts/gpu/gda_gpu_check.py``. The machine's speed drifts: compare versions in one run of
this script each, alternated, and read the best of several medians.

    python3 scripts/probes/gda_python_cost.py [--calls 2000] [--repeats 6] [--profile]

Shape: DeepSeek-V3 decode (H 7168 bf16, top-8 of 256, 128 tokens/rank), EP 2.
"""
import argparse
import ctypes
import mmap
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

STUB = r"""
#include <stdint.h>
#include <string.h>
#include <stddef.h>
typedef struct { int64_t *recs; int64_t n; const int64_t *uses; int64_t nu; const int64_t *vars; } prog_t;
static void bind(const prog_t *p) {
  for (int64_t i = 0; i < p->nu; i++) { const int64_t *u = &p->uses[3 * i]; p->recs[u[0]] = p->vars[u[1]] + u[2]; } }
static int64_t info[65536], ninfo;
void stub_set_info(const int64_t *p, int64_t n) { memcpy(info, p, 8 * n); ninfo = n; }
static void header(int64_t *flag, int64_t value) { memcpy(flag - ninfo, info, 8 * ninfo); *flag = value; }
int efa_launch_bind(const prog_t *p) { bind(p); return 0; }
int efa_launch_run(const prog_t *p, int64_t s, void *e, size_t l) { bind(p); return 0; }
int efa_launch_run_wait(const prog_t *p, int64_t s, int64_t *flag, int64_t value, int64_t wait,
                        int64_t *waited, void *e, size_t l) { bind(p); header(flag, value); *waited = 0; return 0; }
int efa_launch_run_gated(const prog_t *a, const prog_t *b, int64_t s, int64_t *gate, int w, int r,
                         int64_t rec, int64_t spin, int64_t *flag, int64_t value, int64_t wait,
                         int64_t *sync, int64_t *gns, void *e, size_t l) {
  bind(a); bind(b); if (flag) header(flag, value); *sync = 0; *gns = 0; if (gate) gate[r] = rec; return 0; }
"""

W, E, H, T_MAX, K, T = 2, 256, 7168, 4096, 8, 128


def _stub_library(tmp):
    src, lib = os.path.join(tmp, "stub.c"), os.path.join(tmp, "libgda_stub.so")
    with open(src, "w") as f:
        f.write(STUB)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    return ctypes.CDLL(lib)


def _transport(lib):
    from efa_ep.kernels import native_launch as nl
    from efa_ep.kernels.base import TransportConfig, align_up
    from efa_ep.kernels.gda import launches, phases, transport
    from efa_ep.kernels.gda.gate import LaunchGate
    from efa_ep.kernels.gda.window import WindowLayout

    for name, (args, res) in nl._SIGS.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
    torch.cuda.is_current_stream_capturing = lambda: False
    phases._stream = lambda dev: 0
    cfg = TransportConfig(name="gda", world_size=W, num_experts=E, hidden=H,
                          max_tokens_per_rank=T_MAX, dtype=torch.bfloat16)
    L = E // W
    tr = object.__new__(transport.GdaTransport)
    tr.cfg, tr.group, tr.rank, tr.world_size, tr.uid = cfg, None, 0, W, 1
    tr._kern, tr.max_topk, tr.timeout_s, tr.check_every_call = launches, 16, 60.0, False
    tr.check_backward, tr.fast_launch, tr.blocked_s = True, 3, 0.0
    tr.device, tr.ranks_per_device, tr.launch_gate = torch.device("cpu"), W, True
    gate = object.__new__(LaunchGate)  # a board in private memory; the peer is always ahead
    gate._text_off = 8 * (2 * W + 2)
    gate._mm = mmap.mmap(-1, gate._text_off + 2 * W * 1024)
    arr = np.frombuffer(gate._mm, dtype=np.int64, count=2 * W + 2)
    gate.issued, gate.failed = arr[:W], arr[W:2 * W]
    gate._address, gate._slots = gate.issued.ctypes.data, memoryview(gate._mm).cast("q")
    gate.rank, gate.world = 0, W
    gate.issued[1] = 2**60
    tr._gate = gate
    tr.num_programs, tr._elem = 132, 2
    tr.layout = WindowLayout(world=W, t_max=T_MAX, row_bytes=align_up(H * 2, 16), k_cap=16,
                             num_local=L)
    tr._offs = (tr.layout.offsets(0), tr.layout.offsets(1))
    tr._buf = torch.zeros(tr._offs[1]["hdr_off"] + 8 * W * tr.layout.hdr_len, dtype=torch.uint8)
    tr._buf_ptrs = torch.zeros(W, dtype=torch.int64)
    tr._sig_ptrs = torch.zeros(W, dtype=torch.int64)
    tr._win_ptr, tr._my_sig = tr._buf_ptrs[0:1], torch.zeros(W, dtype=torch.int32)
    tr._err, tr._hw = torch.zeros(3, dtype=torch.int64), torch.zeros(2, W, dtype=torch.int64)
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
    n_info = 1 + W * (2 + L) + W + L
    ph._pinned = torch.full((n_info + 1,), -1, dtype=torch.int64)
    addr = ph._pinned.data_ptr()
    ph._host = (addr, memoryview((ctypes.c_int64 * n_info).from_address(addr)).cast("B").cast("q"))

    def program(self, key, launch, tensors, ints=phases._EPOCH, grid_steps=()):
        prog = self._progs.get(key)
        if prog is None:  # a program of the real class's layout: 2 records, 2 uses per variable
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
            prog._err = ctypes.create_string_buffer(nl._ERRLEN)
            prog._err_addr = ctypes.addressof(prog._err)
            prog._sync_ns, prog._gate_ns = ctypes.c_int64(0), ctypes.c_int64(0)
            prog._sync_ns_addr = ctypes.addressof(prog._sync_ns)
            prog._gate_ns_addr = ctypes.addressof(prog._gate_ns)
            self._progs[key] = prog
        return prog

    phases.GdaPhases._program = program
    tr._phases = ph
    # counts as every header would carry them: T rows from each source, 4 per local expert
    hl = 2 + L
    info = [0] * n_info
    for s in range(W):
        info[2 + s * hl] = T
        for e in range(L):
            info[3 + s * hl + e] = 4
    end = 1 + W * hl
    for s in range(W):
        info[end + s] = T
    for e in range(L):
        info[end + W + e] = 8
    lib.stub_set_info((ctypes.c_int64 * n_info)(*info), n_info)
    return tr


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls of each op per repeat")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--profile", action="store_true", help="then a cProfile of D+C")
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tr = _transport(_stub_library(tmp))
        x = torch.randn(T, H).to(torch.bfloat16)
        idx = torch.randint(0, E, (T, K))
        w = torch.rand(T, K)
        for _ in range(200):  # binds every program and plan
            r = tr.dispatch(x, idx, w)
            tr.combine(r[0], r[-1])
            tr.dispatch_cached(x, r[-1])
            tr.combine_topk_weights(r[2], r[-1])
        best = None
        for _ in range(a.repeats):
            times = ([], [], [], [])
            for _ in range(a.calls):
                t0 = time.perf_counter()
                r = tr.dispatch(x, idx, w)
                t1 = time.perf_counter()
                tr.combine(r[0], r[-1])
                t2 = time.perf_counter()
                tr.dispatch_cached(x, r[-1])
                t3 = time.perf_counter()
                tr.combine_topk_weights(r[2], r[-1])
                t4 = time.perf_counter()
                for acc, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    acc.append(dt)
            med = [statistics.median(acc) * 1e6 for acc in times]
            best = med if best is None else [min(b, m) for b, m in zip(best, med)]
        print("Python host cost per call, best of %d medians of %d calls (us): dispatch %.1f, "
              "combine %.1f, cached dispatch %.1f, weight combine %.1f"
              % ((a.repeats, a.calls) + tuple(best)))
        if a.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                r = tr.dispatch(x, idx, w)
                tr.combine(r[0], r[-1])
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
