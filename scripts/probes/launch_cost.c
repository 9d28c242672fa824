/* launch_cost.c: host time of kernel launches against CUDA graph launches (see launch_cost.py).
 *
 * measure(kind, fn, n_kernels, params, calls, out_ns): per call, n_kernels launches of fn with
 * cuLaunchKernel (kind 0), or one cuGraphLaunch of a graph of n_kernels nodes of fn whose nodes'
 * parameters are set first (kind 1: cuGraphExecKernelNodeSetParams per node, as a call whose
 * tensors change would) or not (kind 2). out_ns[i]: host nanoseconds of call i. The stream is
 * synchronized every 16 calls, outside the timed part, so the queue never fills.
 * Build: cc -O2 -shared -fPIC launch_cost.c -ldl -o liblaunch_cost.so */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef struct {
    void *func;
    unsigned gx, gy, gz, bx, by, bz, smem;
    void **params;
    void **extra;
    void *kern;
    void *ctx;
} kparams_t;

typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void *, void **, void **);
static launch_t cu_launch;
static int (*cu_graph_create)(void **, unsigned);
static int (*cu_add_kernel)(void **, void *, void **, size_t, const kparams_t *);
static int (*cu_instantiate)(void **, void *, unsigned long long);
static int (*cu_set_params)(void *, void *, const kparams_t *);
static int (*cu_graph_launch)(void *, void *);
static int (*cu_stream_sync)(void *);
static int (*cu_param_info)(void *, size_t, size_t *, size_t *);

static int64_t now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

int init(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) return -1;
    cu_launch = (launch_t)dlsym(h, "cuLaunchKernel");
    cu_graph_create = dlsym(h, "cuGraphCreate");
    cu_add_kernel = dlsym(h, "cuGraphAddKernelNode_v2");
    cu_instantiate = dlsym(h, "cuGraphInstantiateWithFlags");
    cu_set_params = dlsym(h, "cuGraphExecKernelNodeSetParams_v2");
    cu_graph_launch = dlsym(h, "cuGraphLaunch");
    cu_stream_sync = dlsym(h, "cuStreamSynchronize");
    cu_param_info = dlsym(h, "cuFuncGetParamInfo");
    return cu_launch && cu_graph_create && cu_add_kernel && cu_instantiate && cu_set_params &&
                   cu_graph_launch && cu_stream_sync && cu_param_info ? 0 : -2;
}

/* The parameter count of a compiled kernel (cuFuncGetParamInfo). */
int num_params(int64_t fn) {
    for (int i = 0;; i++) {
        size_t off, size;
        if (cu_param_info((void *)(uintptr_t)fn, (size_t)i, &off, &size)) return i;
    }
}

int measure(int kind, int64_t fn, int n, int64_t *values, int nparams, unsigned grid,
            unsigned block, int64_t stream, int calls, int64_t *out_ns) {
    void *params[64];
    for (int i = 0; i < nparams; i++) params[i] = &values[i];
    kparams_t kp = {(void *)(uintptr_t)fn, grid, 1, 1, block, 1, 1, 0, params, NULL, NULL, NULL};
    void *s = (void *)(uintptr_t)stream, *graph = NULL, *exec = NULL, *nodes[8];
    if (kind) {
        int rc = cu_graph_create(&graph, 0);
        for (int i = 0; i < n && !rc; i++)
            rc = cu_add_kernel(&nodes[i], graph, i ? &nodes[i - 1] : NULL, i ? 1 : 0, &kp);
        if (!rc) rc = cu_instantiate(&exec, graph, 0);
        if (rc) return rc;
    }
    for (int c = 0; c < calls; c++) {
        if (c % 16 == 0) cu_stream_sync(s);
        values[1] = c;  /* a changing integer argument */
        int64_t t0 = now();
        int rc = 0;
        if (kind == 0) {
            for (int i = 0; i < n && !rc; i++)
                rc = cu_launch(kp.func, grid, 1, 1, block, 1, 1, 0, s, params, NULL);
        } else {
            if (kind == 1)
                for (int i = 0; i < n && !rc; i++) rc = cu_set_params(exec, nodes[i], &kp);
            if (!rc) rc = cu_graph_launch(exec, s);
        }
        out_ns[c] = now() - t0;
        if (rc) return rc;
    }
    cu_stream_sync(s);
    return 0;
}
