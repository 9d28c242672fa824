/* efa_launch_graph.c: a bound program (efa_launch.h) as one CUDA graph: one node per record,
 * each after the one before (a kernel node, or a memset node for a memset record), made on the
 * program's first run; every run sets each node's parameters from the records the call's
 * variables were written into (a memset's address, a kernel's arguments and grid; a kernel of
 * grid 0 is disabled for that run), then one cuGraphLaunch on the caller's stream. A driver
 * without memset nodes, a misaligned memset, a graph the driver will not make, parameters it
 * refuses and a stream being captured leave the program to the caller's launches.
 *
 * Build: with efa_launch.c (kernels/native_launch.py).
 */
#define _GNU_SOURCE
#include "efa_launch.h"

/* A program's CUDA graph: one node per record (kernel or memset), each after the one before. */
typedef struct {
    void *graph, *exec;
    void *ctx;              /* the memset nodes' context (the current one when made) */
    int64_t n;
    void **nodes;           /* [n] */
    unsigned char *enabled; /* [n] node on (grid > 0) as the exec has it now */
} graph_t;

static void node_params(const efa_launch_t *r, node_params_t *np) {
    memset(np, 0, sizeof *np);
    np->func = (void *)(uintptr_t)r->function;
    np->grid_x = r->grid_x > 0 ? (unsigned)r->grid_x : 1;
    np->grid_y = (unsigned)r->grid_y;
    np->grid_z = (unsigned)r->grid_z;
    np->block_x = (unsigned)r->block_x;
    np->block_y = np->block_z = 1;
    np->shared_bytes = (unsigned)r->shared_bytes;
    np->params = (void **)r->params;
}

/* A memset record's node parameters: values[1] bytes of zeros at values[0], in 4-byte
 * elements when the size is a multiple of 4 (the layout's counters are int64; a node keeps its
 * element size). 0, or -EINVAL when the address does not suit that element size. */
static int memset_params(const efa_launch_t *r, memset_params_t *mp) {
    memset(mp, 0, sizeof *mp);
    mp->dst = (uint64_t)r->values[0];
    mp->element_bytes = (r->values[1] % 4) == 0 ? 4 : 1;
    mp->width = (size_t)r->values[1] / mp->element_bytes;
    mp->height = 1;
    return mp->dst % mp->element_bytes ? -EINVAL : 0;
}

/* Frees p's graph, if any (a no-op otherwise). */
void efa_launch_graph_free(efa_program_t *p) {
    graph_t *g = (graph_t *)p->graph;
    if (!g) return;
    p->graph = NULL;
    if (g->exec) cu.graph_exec_destroy(g->exec);
    if (g->graph) cu.graph_destroy(g->graph);
    free(g);
}

/* Makes p's graph from its bound records; 0, or the driver's error (p->graph stays NULL). */
static int graph_make(efa_program_t *p) {
    const int64_t n = p->num_recs;
    graph_t *g = (graph_t *)calloc(1, sizeof *g + n * (sizeof(void *) + 1));
    if (!g) return -ENOMEM;
    g->n = n;
    g->nodes = (void **)(g + 1);
    g->enabled = (unsigned char *)(g->nodes + n);
    int rc = cu.graph_create(&g->graph, 0);
    for (int64_t i = 0; i < n && !rc; i++) {
        void *const *dep = i ? &g->nodes[i - 1] : NULL;
        if (p->recs[i].function == 0) {
            memset_params_t mp;
            rc = memset_params(&p->recs[i], &mp);
            if (!rc) rc = cu.ctx_current(&g->ctx);
            if (!rc) rc = cu.graph_add_memset(&g->nodes[i], g->graph, dep, i ? 1 : 0, &mp, g->ctx);
        } else {
            node_params_t np;
            node_params(&p->recs[i], &np);
            rc = cu.graph_add_kernel(&g->nodes[i], g->graph, dep, i ? 1 : 0, &np);
        }
        g->enabled[i] = 1;
    }
    if (!rc) rc = cu.graph_instantiate(&g->exec, g->graph, 0);
    p->graph = g;
    if (rc) efa_launch_graph_free(p);
    return rc;
}

/* Runs bound p as its graph: 0, -EIO (err says why), or 1 when p does not run as a graph
 * (mode off, a memset step without the driver's memset nodes, an empty memset, the graph could
 * not be made or its node parameters were refused, the stream is being captured). */
int efa_launch_graph_run(efa_program_t *p, void *stream, char *err, size_t errlen) {
    if (p->graph_mode <= 0 || !cu.graphs) return 1;
    int capture = 0;
    if (cu.capturing(stream, &capture) || capture) return 1;
    graph_t *g = (graph_t *)p->graph;
    const int memset_nodes = cu.graph_add_memset && cu.graph_set_memset && cu.ctx_current;
    if (!g) {
        for (int64_t i = 0; i < p->num_recs; i++)
            if (p->recs[i].function == 0 && (!memset_nodes || p->recs[i].values[1] <= 0)) {
                p->graph_mode = -1;
                return 1;
            }
        int rc = graph_make(p);
        if (rc) {
            p->graph_mode = -2;
            return 1;
        }
        g = (graph_t *)p->graph;
    }
    for (int64_t i = 0; i < g->n; i++) {
        const efa_launch_t *r = &p->recs[i];
        const unsigned char on = r->grid_x > 0;
        int rc = 0;
        const char *what = "cuGraphNodeSetEnabled";
        if (r->function == 0) { /* a memset: its address changes per run, its size does not */
            memset_params_t mp;
            if (r->values[1] <= 0 || memset_params(r, &mp) ||
                cu.graph_set_memset(g->exec, g->nodes[i], &mp, g->ctx)) {
                p->graph_mode = -3; /* the driver refused: kernel by kernel from now on */
                efa_launch_graph_free(p);
                return 1;
            }
            continue;
        }
        if (on != g->enabled[i]) {
            rc = cu.graph_enable(g->exec, g->nodes[i], on);
            g->enabled[i] = on;
        }
        if (!rc && on) {
            node_params_t np;
            node_params(r, &np);
            what = "cuGraphExecKernelNodeSetParams";
            rc = cu.graph_set_params(g->exec, g->nodes[i], &np);
        }
        if (rc) {
            set_err(err, errlen, "%s (step %lld of %lld) failed: %s", what, (long long)i,
                    (long long)g->n, cu_name(rc));
            return -EIO;
        }
    }
    int rc = cu.graph_launch(g->exec, stream);
    if (rc) {
        set_err(err, errlen, "cuGraphLaunch (%lld steps) failed: %s", (long long)g->n,
                cu_name(rc));
        return -EIO;
    }
    return 0;
}
