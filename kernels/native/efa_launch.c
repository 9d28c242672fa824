/* efa_launch.c: launches a short program of compiled GPU kernels in one call.
 *
 * A program is an array of efa_launch_t records prepared once per shape by Python
 * (kernels/native_launch.py): the CUfunction of a compiled Triton kernel, its grid and block,
 * and its parameter values; a record with function 0 is an asynchronous memset. Per call Python
 * writes only the call's variables (tensor addresses, op numbers, row counts) into the
 * program's variable array and calls efa_launch_run once, instead of one Python launch wrapper
 * per kernel; the library writes them into the records (efa_program_t.uses says where).
 *
 * The driver API comes from libcuda.so.1 at run time (dlopen): the library builds without a CUDA
 * toolkit, and loads on a machine without a GPU (efa_launch_init then says why it cannot run).
 * Every record is int64 fields only, so Python views a program as one flat int64 array.
 *
 * An op whose second phase waits on its peers' stores runs both phases in one call when ranks
 * share a GPU: efa_launch_run_gated launches the first, publishes it on the launch gate (the
 * ranks' shared "issued" slots) and waits briefly for every peer to publish the same op before
 * launching the second (see kernels/gda/gate.py for why a waiting kernel may only be launched
 * then). A peer that is late leaves the rest to the caller, whose wait has the deadline and
 * names the missing ranks.
 *
 * A gda regular dispatch runs whole in one call (efa_launch_dispatch): front, gate, header, the
 * wait for the counts in host memory, their checks, and the gather of the received rows into
 * outputs the caller allocated ahead at a capacity; counts that are not clean, or more rows than
 * the capacity, leave the gather to the caller, whose checks name the problem.
 *
 * A program goes to the GPU as one CUDA graph (efa_launch_graph.c: made on its first run, every
 * node's parameters set from the records per run, then one cuGraphLaunch) where the driver
 * allows: the host submits once per program instead of once per kernel (on an H200 host under
 * MPS, ~4.3 us per cuLaunchKernel against ~2.3 us per cuGraphLaunch plus ~0.6 us per node's
 * parameters). Same kernels, arguments and stream order. A memset step is a memset node of the
 * graph (its address set per run like a kernel's parameters). A program whose graph could not be
 * made, or whose node parameters the driver refuses, and a run on a stream being captured launch
 * kernel by kernel.
 *
 * Build: cc -O2 -std=c11 -shared -fPIC efa_launch.c efa_launch_graph.c -ldl -o libefa_launch.so
 */
#define _GNU_SOURCE
#include "efa_launch.h"

efa_driver_t cu;

int efa_launch_abi_version(void) { return EFA_LAUNCH_ABI; }

int efa_launch_record_bytes(void) { return (int)sizeof(efa_launch_t); }

int efa_launch_max_params(void) { return EFA_LAUNCH_MAX_PARAMS; }

/* Loads the driver entry points once. 0 = ready; -ENOSYS with the reason in err otherwise. */
int efa_launch_init(char *err, size_t errlen) {
    if (cu.state == 1) return 0;
    if (cu.state == -1) {
        set_err(err, errlen, "%s", cu.why);
        return -ENOSYS;
    }
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(cu.why, sizeof cu.why, "libcuda.so.1 cannot be loaded (%s): no NVIDIA driver here",
                 dlerror());
        cu.state = -1;
        set_err(err, errlen, "%s", cu.why);
        return -ENOSYS;
    }
    cu.launch = (cu_launch_t)dlsym(h, "cuLaunchKernel");
    cu.param_info = (cu_param_info_t)dlsym(h, "cuFuncGetParamInfo");
    cu.memset = (cu_memset_t)dlsym(h, "cuMemsetD8Async");
    cu.copy = (cu_copy_t)dlsym(h, "cuMemcpyDtoDAsync_v2");
    cu.errstr = (cu_errstr_t)dlsym(h, "cuGetErrorString");
    cu.event_record = (cu_event_record_t)dlsym(h, "cuEventRecord");
    cu.event_sync = (cu_event_sync_t)dlsym(h, "cuEventSynchronize");
    if (!cu.launch || !cu.param_info || !cu.memset || !cu.event_record || !cu.event_sync) {
        snprintf(cu.why, sizeof cu.why,
                 "the NVIDIA driver lacks %s (CUDA 12.4 or newer driver needed)",
                 !cu.param_info ? "cuFuncGetParamInfo" : "a launch entry point");
        cu.state = -1;
        set_err(err, errlen, "%s", cu.why);
        return -ENOSYS;
    }
    cu.graph_create = (cu_graph_create_t)dlsym(h, "cuGraphCreate");
    cu.graph_add_kernel = (cu_graph_add_kernel_t)dlsym(h, "cuGraphAddKernelNode_v2");
    cu.graph_instantiate = (cu_graph_instantiate_t)dlsym(h, "cuGraphInstantiateWithFlags");
    cu.graph_set_params = (cu_graph_set_params_t)dlsym(h, "cuGraphExecKernelNodeSetParams_v2");
    cu.graph_enable = (cu_graph_enable_t)dlsym(h, "cuGraphNodeSetEnabled");
    cu.graph_launch = (cu_graph_launch_t)dlsym(h, "cuGraphLaunch");
    cu.graph_destroy = (cu_destroy_t)dlsym(h, "cuGraphDestroy");
    cu.graph_exec_destroy = (cu_destroy_t)dlsym(h, "cuGraphExecDestroy");
    cu.capturing = (cu_capturing_t)dlsym(h, "cuStreamIsCapturing");
    cu.graph_add_memset = (cu_graph_add_memset_t)dlsym(h, "cuGraphAddMemsetNode");
    cu.graph_set_memset = (cu_graph_set_memset_t)dlsym(h, "cuGraphExecMemsetNodeSetParams");
    cu.ctx_current = (cu_ctx_current_t)dlsym(h, "cuCtxGetCurrent");
    cu.graphs = cu.graph_create && cu.graph_add_kernel && cu.graph_instantiate &&
                cu.graph_set_params && cu.graph_enable && cu.graph_launch && cu.graph_destroy &&
                cu.graph_exec_destroy && cu.capturing;
    cu.state = 1;
    return 0;
}

/* Sizes in bytes of the parameters of a compiled kernel, as the driver sees them. Returns the
 * parameter count (at most max), or a negative errno. */
int efa_launch_param_sizes(int64_t function, int64_t *sizes, int max, char *err, size_t errlen) {
    if (efa_launch_init(err, errlen)) return -ENOSYS;
    for (int i = 0;; i++) {
        size_t off = 0, size = 0;
        int rc = cu.param_info((void *)(uintptr_t)function, (size_t)i, &off, &size);
        if (rc != 0) return i; /* past the last parameter */
        if (i >= max) {
            set_err(err, errlen, "kernel has more than %d parameters", max);
            return -E2BIG;
        }
        sizes[i] = (int64_t)size;
    }
}

int efa_launch_program_bytes(void) { return (int)sizeof(efa_program_t); }

/* Writes the call's variables into the program's records. */
static void bind(const efa_program_t *p) {
    int64_t *words = (int64_t *)p->recs;
    for (int64_t i = 0; i < p->num_uses; i++) {
        const int64_t *u = &p->uses[3 * i];
        words[u[0]] = p->vars[u[1]] + u[2];
    }
}

/* bind() alone, no driver needed: lets a caller see the records a run would launch. */
int efa_launch_bind(const efa_program_t *p) {
    bind(p);
    return 0;
}

static int run(const efa_program_t *p, void *stream, char *err, size_t errlen) {
    bind(p);
    const int graphed = efa_launch_graph_run((efa_program_t *)p, stream, err, errlen);
    if (graphed <= 0) return graphed;
    const int n = (int)p->num_recs;
    for (int i = 0; i < n; i++) {
        efa_launch_t *r = &p->recs[i];
        int rc;
        if (r->function == 0) {
            rc = cu.memset((uint64_t)r->values[0], 0, (size_t)r->values[1], stream);
            if (rc) {
                set_err(err, errlen, "cuMemsetD8Async (step %d of %d, %lld bytes) failed: %s", i,
                        n, (long long)r->values[1], cu_name(rc));
                return -EIO;
            }
            continue;
        }
        if (r->grid_x <= 0) continue; /* nothing to do for this step this call */
        rc = cu.launch((void *)(uintptr_t)r->function, (unsigned)r->grid_x, (unsigned)r->grid_y,
                       (unsigned)r->grid_z, (unsigned)r->block_x, 1, 1, (unsigned)r->shared_bytes,
                       stream, r->params, NULL);
        if (rc) {
            set_err(err, errlen, "cuLaunchKernel (step %d of %d, grid %lld) failed: %s", i, n,
                    (long long)r->grid_x, cu_name(rc));
            return -EIO;
        }
    }
    return 0;
}

/* Binds prog's variables and launches its records on stream, in order. 0 or -EIO with the
 * failing step in err. */
int efa_launch_run(const efa_program_t *prog, int64_t stream, char *err, size_t errlen) {
    if (cu.state != 1 && efa_launch_init(err, errlen)) return -ENOSYS;
    return run(prog, (void *)(uintptr_t)stream, err, errlen);
}

/* Copies `bytes` of device memory from src to dst on stream (the copy engine; no tensor
 * machinery: a dispatch's C++ call copies its received ids this way). 0 or -EIO. */
int efa_launch_copy(int64_t dst, int64_t src, int64_t bytes, int64_t stream, char *err,
                    size_t errlen) {
    if (cu.state != 1 && efa_launch_init(err, errlen)) return -ENOSYS;
    if (!cu.copy) {
        set_err(err, errlen, "the NVIDIA driver lacks cuMemcpyDtoDAsync_v2");
        return -ENOSYS;
    }
    int rc = cu.copy((uint64_t)dst, (uint64_t)src, (size_t)bytes, (void *)(uintptr_t)stream);
    if (rc) {
        set_err(err, errlen, "cuMemcpyDtoDAsync (%lld bytes) failed: %s", (long long)bytes,
                cu_name(rc));
        return -EIO;
    }
    return 0;
}

/* Records event (a CUevent, e.g. torch.cuda.Event.cuda_event) on stream. 0 or -EIO. */
int efa_launch_event_record(int64_t event, int64_t stream, char *err, size_t errlen) {
    if (cu.state != 1 && efa_launch_init(err, errlen)) return -ENOSYS;
    int rc = cu.event_record((void *)(uintptr_t)event, (void *)(uintptr_t)stream);
    if (rc) {
        set_err(err, errlen, "cuEventRecord failed: %s", cu_name(rc));
        return -EIO;
    }
    return 0;
}

/* Blocks until the work event captured has finished (cuEventSynchronize). 0 or -EIO. */
int efa_launch_event_wait(int64_t event, char *err, size_t errlen) {
    if (cu.state != 1 && efa_launch_init(err, errlen)) return -ENOSYS;
    int rc = cu.event_sync((void *)(uintptr_t)event);
    if (rc) {
        set_err(err, errlen, "cuEventSynchronize failed: %s", cu_name(rc));
        return -EIO;
    }
    return 0;
}

/* Spins until *flag holds value or wait_ns passed: 1 when seen, 0 when the time ran out.
 * *waited_ns = time spun. flag is page-locked host memory a kernel writes last, with a release
 * store at system scope, after the data the caller reads next: read with acquire loads. */
int efa_launch_wait_flag(const int64_t *flag, int64_t value, int64_t wait_ns,
                         int64_t *waited_ns) {
    int64_t t0 = now_ns(), t = t0;
    int seen;
    for (long spins = 0;; spins++) {
        seen = __atomic_load_n(flag, __ATOMIC_ACQUIRE) == value;
        if (seen) break;
        if ((spins & 63) == 0) {
            t = now_ns();
            if (t - t0 >= wait_ns) break;
        }
    }
    if (waited_ns) *waited_ns = (seen ? (int64_t)now_ns() : t) - t0;
    return seen;
}

/* As efa_launch_run, then waits until the host word *flag holds value (the program's last
 * kernel writes it, see efa_launch_wait_flag): the host may read what that kernel wrote before it when this
 * returns 0. 2 when wait_ns passed first (err says so); a negative errno when a launch failed.
 * *waited_ns = nanoseconds spent waiting. No stream synchronization: only the flag. */
int efa_launch_run_wait(const efa_program_t *prog, int64_t stream, const int64_t *flag,
                        int64_t value, int64_t wait_ns, int64_t *waited_ns, char *err,
                        size_t errlen) {
    if (cu.state != 1 && efa_launch_init(err, errlen)) return -ENOSYS;
    if (waited_ns) *waited_ns = 0;
    int rc = run(prog, (void *)(uintptr_t)stream, err, errlen);
    if (rc) return rc;
    if (!efa_launch_wait_flag(flag, value, wait_ns, waited_ns)) {
        set_err(err, errlen, "the program's completion word was not written within %lld ns",
                (long long)wait_ns);
        return 2;
    }
    return 0;
}


/* The launch gate's fast path: stores record = op * 8 + kind into gate[rank] (this rank has
 * enqueued the op's stores), then waits up to spin_ns until every gate[r] holds the same record
 * or a later op's (>= (op + 1) * 8: that peer passed this gate, so it agreed). 1 when they do, 0
 * when the time ran out or a peer published the same op with another kind (nothing else
 * changes: the caller's own wait takes over, with its deadline and the ranks' disagreement).
 * *waited_ns = time spent waiting. gate is shared memory written by other processes: read with
 * acquire loads. */
int efa_gate_publish_wait(int64_t *gate, int world, int rank, int64_t record, int64_t spin_ns,
                          int64_t *waited_ns) {
    if (waited_ns) *waited_ns = 0;
    if (!gate || world < 1 || rank < 0 || rank >= world) return 0;
    __atomic_store_n(&gate[rank], record, __ATOMIC_RELEASE);
    const int64_t next_op = (record | 7) + 1;
    int64_t t0 = 0;
    for (long spins = 0;; spins++) {
        int ready = 1;
        for (int r = 0; r < world; r++) {
            int64_t v = __atomic_load_n(&gate[r], __ATOMIC_ACQUIRE);
            if (v != record && v < next_op) {
                ready = 0;
                break;
            }
        }
        if (ready) {
            if (waited_ns && t0) *waited_ns = now_ns() - t0;
            return 1;
        }
        int64_t t = now_ns();
        if (!t0) t0 = t;
        else if (t - t0 >= spin_ns) {
            if (waited_ns) *waited_ns = t - t0;
            return 0;
        }
    }
}

/* The two phases of an op in one call: launches first (its records), publishes record on the
 * launch gate (gate == NULL: no gate, ranks on their own GPUs) and waits up to spin_ns for the
 * peers (efa_gate_publish_wait), then launches second (its records) and, with flag != NULL,
 * waits for it as efa_launch_run_wait. Returns 0 when both phases ran (and the flag was seen);
 * 1 when the peers had not published in spin_ns (first launched and published, second not: the
 * caller waits with its deadline and launches it); 2 when the flag was not seen in wait_ns; a
 * negative errno with the failing step in err. *sync_ns: time waiting for the device;
 * *gate_ns: time waiting for the peers. */
int efa_launch_run_gated(const efa_program_t *first, const efa_program_t *second,
                         int64_t stream, int64_t *gate, int world, int rank, int64_t record,
                         int64_t spin_ns, const int64_t *flag, int64_t value, int64_t wait_ns,
                         int64_t *sync_ns, int64_t *gate_ns, char *err, size_t errlen) {
    if (cu.state != 1 && efa_launch_init(err, errlen)) return -ENOSYS;
    if (sync_ns) *sync_ns = 0;
    if (gate_ns) *gate_ns = 0;
    int rc = run(first, (void *)(uintptr_t)stream, err, errlen);
    if (rc) return rc;
    if (gate && !efa_gate_publish_wait(gate, world, rank, record, spin_ns, gate_ns)) return 1;
    if (flag) return efa_launch_run_wait(second, stream, flag, value, wait_ns, sync_ns, err, errlen);
    return run(second, (void *)(uintptr_t)stream, err, errlen);
}


/* The counts a gda dispatch's header kernel wrote into host memory (kernels/gda/launches.py,
 * recv_header: [error bits, per source (status, rows, rows per local expert), rows sent per
 * destination, rows received per local expert]), checked as the transport checks them.
 * shape = [world, hdr_len (2 + L), L, t_max, top-k]. Returns the rows received (>= 0) when they
 * are clean: no error bits, every source's status 0 and rows in [0, t_max] (the peers' counts
 * are untrusted), per-expert rows >= 0 summing to at most rows * top-k; else -1. */
int64_t efa_gda_rows_received(const int64_t *info, const int64_t *shape) {
    const int64_t w = shape[0], hdr_len = shape[1], num_local = shape[2], t_max = shape[3],
                  k = shape[4];
    if (info[0] != 0) return -1;
    int64_t rows = 0;
    for (int64_t s = 0; s < w; s++) {
        const int64_t status = info[1 + s * hdr_len], r = info[2 + s * hdr_len];
        if (status != 0 || r < 0 || r > t_max) return -1;
        rows += r;
    }
    const int64_t *per_expert = info + 1 + w * hdr_len + w;
    int64_t pairs = 0;
    for (int64_t e = 0; e < num_local; e++) {
        if (per_expert[e] < 0) return -1;
        pairs += per_expert[e];
    }
    return pairs > rows * k ? -1 : rows;
}

/* A gda regular dispatch in one call: efa_launch_run_gated(first, second, ...) with flag (the
 * header's completion word; the n_info counts precede it), then, when efa_gda_rows_received
 * finds them clean with 0 < rows <= cap, third (the gather) with its variables var_rows = rows
 * and var_grid = min(rows, max_grid). shape = [world, hdr_len, L, t_max, top-k, cap, max_grid,
 * var_rows, var_grid, n_info, early]. With early (and cap > 0) third is the early gather,
 * launched as the caller bound it (var_rows = cap, var_grid = min(cap, max_grid)) right after
 * second (third NULL: second holds it, after the header's kernel), before the wait for flag: it reads the row count the header kernel left on the device
 * and copies only when the counts were clean and fit, which this check then confirms (its
 * conditions include the kernel's). Returns 0 when the gather ran (*rows_out = rows); 3 when it
 * did not (counts not clean: *rows_out = -1; no rows or more than cap: *rows_out = rows), the
 * caller checks the counts and gathers; else what efa_launch_run_gated returns. */
int efa_launch_dispatch(const efa_program_t *first, const efa_program_t *second,
                        const efa_program_t *third, int64_t stream, int64_t *gate, int world,
                        int rank, int64_t record, int64_t spin_ns, const int64_t *flag,
                        int64_t value, int64_t wait_ns, const int64_t *shape, int64_t *rows_out,
                        int64_t *sync_ns, int64_t *gate_ns, char *err, size_t errlen) {
    *rows_out = -1;
    int rc;
    const int early = shape[10] != 0 && shape[5] > 0;
    if (early) {
        rc = efa_launch_run_gated(first, second, stream, gate, world, rank, record, spin_ns,
                                  NULL, 0, 0, sync_ns, gate_ns, err, errlen);
        if (rc) return rc;
        if (third) { /* (NULL: the early gather is a kernel of second, already launched) */
            rc = run(third, (void *)(uintptr_t)stream, err, errlen);
            if (rc) return rc;
        }
        if (!efa_launch_wait_flag(flag, value, wait_ns, sync_ns)) {
            set_err(err, errlen, "the program's completion word was not written within %lld ns",
                    (long long)wait_ns);
            return 2;
        }
    } else {
        rc = efa_launch_run_gated(first, second, stream, gate, world, rank, record, spin_ns,
                                  flag, value, wait_ns, sync_ns, gate_ns, err, errlen);
        if (rc) return rc;
    }
    const int64_t rows = efa_gda_rows_received(flag - shape[9], shape);
    *rows_out = rows;
    if (rows <= 0 || rows > shape[5]) return 3;
    if (early) return 0;
    int64_t *vars = (int64_t *)third->vars;
    vars[shape[7]] = rows;
    vars[shape[8]] = rows < shape[6] ? rows : shape[6];
    return run(third, (void *)(uintptr_t)stream, err, errlen);
}
