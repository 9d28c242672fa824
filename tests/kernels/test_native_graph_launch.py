"""A program run as one CUDA graph launch (``kernels/native/efa_launch.c``), on the CPU machine.

The real launch library is loaded in a child process whose ``libcuda.so.1`` is a stand-in
driver built here: it logs every driver call the library makes (launches, graph creation, node
arguments with the value of the first parameter at that moment, node enabling, graph launches)
and can pretend that the stream is being captured or that a graph cannot be instantiated. The
tests pin what the GPU runs cannot show call by call: the graph is made once, every run sets
each node's arguments after the call's variables were written, a step of grid 0 is disabled
rather than launched, a memset step is a memset node whose address each run sets (with a
driver that has them), and a memset step without them, a capturing stream or a graph the
driver refuses launch kernel by kernel with the same records."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from efa_ep.kernels import native_launch as nl

_DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
typedef struct { void *func; unsigned gx, gy, gz, bx, by, bz, smem; void **params; void **extra;
                 void *kern; void *ctx; } np_t;
static char log_[65536]; static size_t len_;
static int capturing, refuse_instantiate, nodes_made;
static void add(const char *s) { size_t n = strlen(s); memcpy(log_ + len_, s, n); len_ += n; }
const char *fake_log(void) { log_[len_] = 0; return log_; }
void fake_reset(int capture, int refuse) {
  len_ = 0; capturing = capture; refuse_instantiate = refuse;
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void *s, void **p, void **e) {
  char b[128]; snprintf(b, sizeof b, "launch %u %lld;", gx, (long long)*(int64_t *)p[0]); add(b);
  return 0;
}
int cuFuncGetParamInfo(void *f, size_t i, size_t *o, size_t *s) { return 1; }
int cuMemsetD8Async(uint64_t d, unsigned char v, size_t n, void *s) { add("memset;"); return 0; }
int cuGetErrorString(int rc, const char **s) { *s = "fake error"; return 0; }
int cuEventRecord(void *e, void *s) { return 0; }
int cuEventSynchronize(void *e) { return 0; }
int cuGraphCreate(void **g, unsigned fl) { *g = (void *)0x100; add("create;"); return 0; }
int cuGraphAddKernelNode_v2(void **n, void *g, void *const *deps, size_t nd, const np_t *p) {
  *n = (void *)(uintptr_t)(0x200 + nodes_made++);
  char b[64]; snprintf(b, sizeof b, "node %zu;", nd); add(b);
  return 0;
}
int cuGraphInstantiateWithFlags(void **x, void *g, unsigned long long fl) {
  if (refuse_instantiate) { add("refused;"); return 700; }
  *x = (void *)0x300; add("instantiate;"); return 0;
}
int cuGraphExecKernelNodeSetParams_v2(void *x, void *n, const np_t *p) {
  char b[128];
  snprintf(b, sizeof b, "set %u %lld;", p->gx, (long long)*(int64_t *)p->params[0]); add(b);
  return 0;
}
int cuGraphNodeSetEnabled(void *x, void *n, unsigned on) { add(on ? "on;" : "off;"); return 0; }
int cuGraphLaunch(void *x, void *s) { add("graph;"); return 0; }
int cuGraphDestroy(void *g) { add("destroy;"); return 0; }
int cuGraphExecDestroy(void *x) { add("destroy_exec;"); return 0; }
int cuStreamIsCapturing(void *s, int *st) { *st = capturing; return 0; }
#ifdef MEMSET_NODES
typedef struct { uint64_t dst; size_t pitch; unsigned value, elem; size_t width, height; } ms_t;
static int refuse_memset;
void fake_refuse_memset(int r) { refuse_memset = r; }
int cuCtxGetCurrent(void **c) { *c = (void *)0x400; return 0; }
int cuGraphAddMemsetNode(void **n, void *g, void *const *deps, size_t nd, const ms_t *p,
                         void *ctx) {
  *n = (void *)(uintptr_t)(0x200 + nodes_made++);
  char b[96]; snprintf(b, sizeof b, "memset_node %zu %u x %zu;", nd, p->elem, p->width); add(b);
  return 0;
}
int cuGraphExecMemsetNodeSetParams(void *x, void *n, const ms_t *p, void *ctx) {
  char b[96]; snprintf(b, sizeof b, "memset_set %llu;", (unsigned long long)p->dst); add(b);
  return refuse_memset ? 1 : 0;
}
#endif
"""

# The child: programs of two kernel steps (or a memset then a kernel) whose first parameter is
# the call's variable 0 plus 8 * step, run under each condition; prints the driver's log per run.
_CHILD = textwrap.dedent("""
    import ctypes, json, sys
    from efa_ep.kernels import native_launch as nl

    lib = nl.load()
    err = ctypes.create_string_buffer(512)
    assert lib.efa_launch_init(err, 512) == 0, err.value
    drv = ctypes.CDLL("libcuda.so.1")
    drv.fake_log.restype = ctypes.c_char_p
    keep, out = [], {}

    def program(memset=False, mode=1, nbytes=0):
        recs = (nl._Record * 2)()
        for i, r in enumerate(recs):
            r.head[0] = 0 if (memset and i == 0) else 0x1000 + i
            r.head[1], r.head[2], r.head[3], r.head[4], r.head[6] = 4, 1, 1, 128, 1
            r.params[0] = ctypes.addressof(r.values)
        recs[0].values[1] = nbytes  # a memset step's size
        words = ctypes.sizeof(nl._Record) // 8
        uses = (ctypes.c_int64 * 9)(nl._VALUES, 0, 0, words + nl._VALUES, 0, 8,
                                    words + 1, 1, 0)  # step 1's grid: variable 1
        vars_ = (ctypes.c_int64 * 2)()
        desc = nl._ProgramDesc(ctypes.addressof(recs), 2, ctypes.addressof(uses), 3,
                               ctypes.addressof(vars_), mode, None)
        keep.extend((recs, uses, vars_, desc))
        return desc, vars_

    def run(name, desc, vars_, value, grid, capture=0, refuse=0):
        drv.fake_reset(capture, refuse)
        vars_[0], vars_[1] = value, grid
        rc = lib.efa_launch_run(ctypes.addressof(desc), 0, err, 512)
        out[name] = [rc, drv.fake_log().decode(), desc.graph_mode, bool(desc.graph)]

    d, v = program()
    run("first", d, v, 10, 4)
    run("second", d, v, 20, 4)
    run("grid0", d, v, 30, 0)
    run("grid_back", d, v, 40, 4)
    run("capturing", d, v, 50, 4, capture=1)
    drv.fake_reset(0, 0)
    lib.efa_launch_graph_free(ctypes.addressof(d))
    out["free"] = [drv.fake_log().decode(), bool(d.graph)]
    d, v = program(mode=0)
    run("mode0", d, v, 60, 4)
    d, v = program(memset=True, nbytes=64)
    run("memset", d, v, 72, 4)
    if hasattr(drv, "fake_refuse_memset"):  # the driver has memset nodes
        run("memset_again", d, v, 96, 4)
        d2, v2 = program(memset=True, nbytes=64)
        run("memset_odd", d2, v2, 73, 4)
        drv.fake_refuse_memset(1)
        run("memset_refused", d, v, 120, 4)
        run("memset_refused_again", d, v, 136, 4)
    d, v = program()
    run("refused", d, v, 80, 4, refuse=1)
    run("refused_again", d, v, 90, 4)
    print(json.dumps(out))
""")


def _run_child(tmp_path_factory, memset_nodes):
    try:
        nl.load()
    except nl.NativeLaunchError as e:
        pytest.skip(f"no C compiler here: {e}")
    if nl.availability() is None:
        pytest.skip("an NVIDIA driver is present: the stand-in would not be the one loaded")
    d = tmp_path_factory.mktemp("fake_driver")
    src = d / "driver.c"
    src.write_text(_DRIVER)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", *(["-DMEMSET_NODES"] if memset_nodes else []),
                    str(src), "-o", str(d / "libcuda.so.1")], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{d}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def driver_log(tmp_path_factory):
    """The log of a driver without memset nodes (their entry points absent)."""
    return _run_child(tmp_path_factory, memset_nodes=False)


@pytest.fixture(scope="module")
def memset_driver_log(tmp_path_factory):
    """The log of a driver with memset nodes."""
    return _run_child(tmp_path_factory, memset_nodes=True)


def test_graph_is_made_once_and_each_run_sets_every_node_from_the_call(driver_log):
    rc, log, mode, has = driver_log["first"]
    assert rc == 0 and mode == 1 and has
    # two chained nodes, instantiated, then this call's arguments (variable 0 + 8 per step)
    assert log == "create;node 0;node 1;instantiate;set 4 10;set 4 18;graph;", log
    rc, log, _, _ = driver_log["second"]
    assert (rc, log) == (0, "set 4 20;set 4 28;graph;")


def test_a_step_of_grid_zero_is_disabled_and_enabled_again(driver_log):
    assert driver_log["grid0"][:2] == [0, "set 4 30;off;graph;"]
    assert driver_log["grid_back"][:2] == [0, "set 4 40;on;set 4 48;graph;"]


def test_a_capturing_stream_gets_kernel_launches_and_the_graph_is_freed(driver_log):
    rc, log, mode, has = driver_log["capturing"]
    assert (rc, log, mode, has) == (0, "launch 4 50;launch 4 58;", 1, True)
    assert driver_log["free"] == ["destroy_exec;destroy;", False]


def test_launch_by_launch_when_off_with_a_memset_or_refused_by_the_driver(driver_log):
    assert driver_log["mode0"][:3] == [0, "launch 4 60;launch 4 68;", 0]
    rc, log, mode, has = driver_log["memset"]  # a driver without memset nodes
    assert (rc, log, mode, has) == (0, "memset;launch 4 80;", -1, False)
    rc, log, mode, has = driver_log["refused"]
    assert rc == 0 and log.endswith("refused;destroy;launch 4 80;launch 4 88;") and mode == -2
    assert not has  # what was made is freed
    assert driver_log["refused_again"][:3] == [0, "launch 4 90;launch 4 98;", -2]


def test_a_memset_step_is_a_memset_node_set_from_each_call(memset_driver_log):
    """A program with a memset step (a large batch's routing layout) runs as one graph: the
    memset is a node of its own before the kernel (64 bytes as 16 four-byte elements), its
    address set from the call's variables on every run like a kernel's arguments."""
    rc, log, mode, has = memset_driver_log["memset"]
    assert (rc, mode, has) == (0, 1, True)
    assert log == ("create;memset_node 0 4 x 16;node 1;instantiate;memset_set 72;set 4 80;"
                   "graph;"), log
    assert memset_driver_log["memset_again"][:2] == [0, "memset_set 96;set 4 104;graph;"]


def test_a_memset_node_refused_or_misaligned_falls_back_to_launches(memset_driver_log):
    """The driver refusing a memset node's arguments frees the graph and runs the program
    launch by launch from then on; an address that does not suit the node's four-byte
    elements never makes the graph."""
    rc, log, mode, has = memset_driver_log["memset_refused"]
    assert (rc, log, mode, has) == (
        0, "memset_set 120;destroy_exec;destroy;memset;launch 4 128;", -3, False)
    assert memset_driver_log["memset_refused_again"][:3] == [0, "memset;launch 4 144;", -3]
    rc, log, mode, has = memset_driver_log["memset_odd"]
    assert rc == 0 and log.endswith("memset;launch 4 81;") and mode == -2 and not has, log
