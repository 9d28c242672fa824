/* efa_launch.h: what the two files of the launch library share (efa_launch.c: the driver,
 * programs launched kernel by kernel, the gate and the gda dispatch; efa_launch_graph.c: a
 * program as one CUDA graph). Internal: Python sees only the exported functions. */
#ifndef EFA_LAUNCH_H
#define EFA_LAUNCH_H
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "efa_util.h" /* now_ns, set_err */

#define EFA_LAUNCH_ABI 9
#define EFA_LAUNCH_MAX_PARAMS 40

/* One kernel launch (function != 0) or memset (function == 0: values[0] = device address,
 * values[1] = bytes, set to zero). params[i] points at values[i]; a 4-byte parameter reads the
 * low half of its slot (little-endian). */
typedef struct {
    int64_t function;
    int64_t grid_x, grid_y, grid_z;
    int64_t block_x;
    int64_t shared_bytes;
    int64_t num_params;
    int64_t reserved;
    void *params[EFA_LAUNCH_MAX_PARAMS];
    int64_t values[EFA_LAUNCH_MAX_PARAMS];
} efa_launch_t;

typedef int CUresult;
typedef int (*cu_init_t)(unsigned);
typedef int (*cu_launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, void *, void **, void **);
typedef int (*cu_param_info_t)(void *, size_t, size_t *, size_t *);
typedef int (*cu_memset_t)(uint64_t, unsigned char, size_t, void *);
typedef int (*cu_copy_t)(uint64_t, uint64_t, size_t, void *);
typedef int (*cu_errstr_t)(int, const char **);
typedef int (*cu_event_record_t)(void *, void *);
typedef int (*cu_event_sync_t)(void *);

/* CUDA_KERNEL_NODE_PARAMS_v2 (kern and ctx unused: func is set) */
typedef struct {
    void *func;
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
    void **params;
    void **extra;
    void *kern;
    void *ctx;
} node_params_t;
typedef int (*cu_graph_create_t)(void **, unsigned);
typedef int (*cu_graph_add_kernel_t)(void **, void *, void *const *, size_t,
                                     const node_params_t *);
typedef int (*cu_graph_instantiate_t)(void **, void *, unsigned long long);
typedef int (*cu_graph_set_params_t)(void *, void *, const node_params_t *);
typedef int (*cu_graph_enable_t)(void *, void *, unsigned);
typedef int (*cu_graph_launch_t)(void *, void *);
typedef int (*cu_destroy_t)(void *);
typedef int (*cu_capturing_t)(void *, int *);
/* CUDA_MEMSET_NODE_PARAMS: a 1-D memset of width elements of element_bytes (1, 2 or 4) */
typedef struct {
    uint64_t dst;
    size_t pitch;
    unsigned value, element_bytes;
    size_t width, height;
} memset_params_t;
typedef int (*cu_graph_add_memset_t)(void **, void *, void *const *, size_t,
                                     const memset_params_t *, void *);
typedef int (*cu_graph_set_memset_t)(void *, void *, const memset_params_t *, void *);
typedef int (*cu_ctx_current_t)(void **);

typedef struct {
    int state; /* 0 not tried, 1 ready, -1 failed */
    char why[256];
    cu_launch_t launch;
    cu_param_info_t param_info;
    cu_memset_t memset;
    cu_copy_t copy; /* cuMemcpyDtoDAsync_v2 (efa_launch_copy) */
    cu_errstr_t errstr;
    cu_event_record_t event_record;
    cu_event_sync_t event_sync;
    int graphs; /* 1 when every graph entry point below was found */
    cu_graph_create_t graph_create;
    cu_graph_add_kernel_t graph_add_kernel;
    cu_graph_instantiate_t graph_instantiate;
    cu_graph_set_params_t graph_set_params;
    cu_graph_enable_t graph_enable;
    cu_graph_launch_t graph_launch;
    cu_destroy_t graph_destroy, graph_exec_destroy;
    cu_capturing_t capturing;
    /* memset nodes: a program with a memset step runs as a graph only when all three exist */
    cu_graph_add_memset_t graph_add_memset;
    cu_graph_set_memset_t graph_set_memset;
    cu_ctx_current_t ctx_current;
} efa_driver_t;

/* The driver's entry points (efa_launch_init loads them; defined in efa_launch.c). */
extern efa_driver_t cu __attribute__((visibility("hidden")));


static inline const char *cu_name(int rc) {
    const char *s = NULL;
    if (cu.errstr && cu.errstr(rc, &s) == 0 && s) return s;
    return "unknown CUDA error";
}

/* A bound program: n records, and where the call's variables go. uses holds num_uses triples
 * (word, variable, byte offset): before a run, word `word` of the records (viewed as one flat
 * int64 array) becomes vars[variable] + offset. vars is written by the caller per call.
 * graph_mode: 1 = run as one CUDA graph where possible (graph: its state, made on the first
 * run; efa_launch_graph_free frees it), 0 = kernel by kernel; the library sets it to a
 * negative value when the graph could not be made (then kernel by kernel for good). */
typedef struct {
    efa_launch_t *recs;
    int64_t num_recs;
    const int64_t *uses;
    int64_t num_uses;
    const int64_t *vars;
    int64_t graph_mode;
    void *graph;
} efa_program_t;

/* Runs bound p as its CUDA graph (efa_launch_graph.c): 0, -EIO (err says why), or 1 when p
 * does not run as a graph (then the caller launches its records one by one). */
int efa_launch_graph_run(efa_program_t *p, void *stream, char *err, size_t errlen)
    __attribute__((visibility("hidden")));
void efa_launch_graph_free(efa_program_t *p);

#endif
