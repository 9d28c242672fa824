/* efa_devop.c: a packed proxy operation (CUDA rows on a host window) in one native call, from
 * the send side's quiesce to the kernel that reads what arrived (efa_proxy.h, "A packed
 * operation ... in one call"): wait for our previous writes, launch the packing kernel, wait for
 * the previous op's reads of the window, the round's begin and post (efa_op.c), then the reading
 * kernel (it follows the chunk marks, so it reads while the rest arrives), the round's complete,
 * the whole marks and the reads' event.
 * Kernels and events go through the launch library's entry points, whose addresses the caller
 * passes (libefa_launch is loaded on its own, and may be absent where no GPU is).
 *
 * Build: part of libefa_proxy.so (kernels/proxy/native.py SOURCES).
 */
#define _GNU_SOURCE
#include "efa_proxy.h"
#include "efa_util.h"

#include <errno.h>
#include <string.h>

typedef int (*run_fn)(int64_t prog, int64_t stream, char *err, size_t errlen);

/* The step clock (efa_devop_step_clock): nanoseconds of the calling thread in each step of each
 * kind of call, summed over calls. Off unless a probe turns it on (one branch per step). */
enum { CLOCK_DISPATCH, CLOCK_FINISH, CLOCK_ROWS, CLOCK_KINDS };
static int g_clock_on;
static int64_t g_step_ns[CLOCK_KINDS][EFA_STEP_DONE + 1], g_calls[CLOCK_KINDS];
static uint64_t g_step_t0;
static int64_t g_step_now = -1, g_kind_now;

static void clock_step(int64_t step) {
    const uint64_t t = now_ns();
    if (g_step_now >= 0) g_step_ns[g_kind_now][g_step_now] += (int64_t)(t - g_step_t0);
    g_step_t0 = t;
    g_step_now = step;
}

/* Sets the call's step (what the caller reads after an error) and clocks it. */
static void at_step(efa_devop *d, int64_t step) {
    d->step = step;
    if (g_clock_on) clock_step(step);
}

static void clock_call(int kind) {
    if (!g_clock_on) return;
    g_kind_now = kind;
    g_calls[kind]++;
    clock_step(0);
}

static int clock_done(int rc) {
    if (g_clock_on) {
        clock_step(0);
        g_step_now = -1;
    }
    return rc;
}

int efa_devop_step_clock(int on, int64_t *out) {
    if (!out) return CLOCK_KINDS * (EFA_STEP_DONE + 2);
    int64_t *p = out;
    for (int k = 0; k < CLOCK_KINDS; k++) {
        *p++ = g_calls[k];
        for (int s = 0; s <= EFA_STEP_DONE; s++) *p++ = g_step_ns[k][s];
    }
    memset(g_step_ns, 0, sizeof g_step_ns);
    memset(g_calls, 0, sizeof g_calls);
    g_step_now = -1;
    g_clock_on = on;
    return CLOCK_KINDS * (EFA_STEP_DONE + 2);
}

typedef int (*record_fn)(int64_t event, int64_t stream, char *err, size_t errlen);
typedef int (*wait_fn)(int64_t event, char *err, size_t errlen);

static int launch(const efa_devop *d, int64_t prog, char *err, size_t errlen) {
    if (!d->run) {
        set_err(err, errlen, "packed operation without the launch library's entry point");
        return -EINVAL;
    }
    return ((run_fn)(uintptr_t)d->run)(prog, d->stream, err, errlen);
}

/* Our previous writes done, the device's progress words (and a dispatch's ready word) zeroed,
 * the packing kernel launched, the previous op's reads waited for; the round's counters reset. */
static int front(efa_op *o, efa_devop *d, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    at_step(d, EFA_STEP_QUIESCE);
    int rc = efa_wait_idle(w->engine, (int)w->timeout_ms, err, errlen);
    if (rc) return rc;
    memset((void *)(uintptr_t)o->progress, 0, (size_t)(8 * o->progress_words));
    if (d->kind == EFA_DEVOP_DISPATCH)
        ((int64_t *)(uintptr_t)o->dev_counts)[1 + w->world + o->num_experts] = 0; /* ready word */
    at_step(d, EFA_STEP_LAUNCH);
    rc = launch(d, d->pack, err, errlen);
    if (rc) return rc;
    at_step(d, EFA_STEP_WAIT_READS);
    if (d->wait_event) {
        rc = ((wait_fn)(uintptr_t)d->event_wait)(d->wait_event, err, errlen);
        if (rc) return rc;
    }
    w->r_writes = w->r_wire_bytes = w->r_messages = w->r_rows = 0;
    return 0;
}

static int launch_reads(efa_devop *d, char *err, size_t errlen) {
    at_step(d, EFA_STEP_READS);
    return d->reads ? launch(d, d->reads, err, errlen) : 0;
}

/* The reading kernel (0: none) and the round's complete: with d->early the kernel first (it
 * follows the chunk marks, so it reads while the data still arrives), then the complete, then
 * the whole marks, stored whatever the complete returned (the kernel must not wait for data that
 * will not come); else the complete, then the kernel. Then the reads' event. */
static int reads_and_complete(efa_op *o, efa_devop *d, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    int rc = d->early ? launch_reads(d, err, errlen) : 0;
    if (rc) return rc;
    at_step(d, EFA_STEP_COMPLETE);
    rc = d->kind == EFA_DEVOP_DISPATCH ? efa_op_dispatch_packed_complete(o, err, errlen)
         : d->kind == EFA_DEVOP_COMBINE ? efa_op_combine_packed_complete(o, err, errlen)
                                         : efa_op_cached_packed_complete(o, err, errlen);
    if (d->early && d->reads) efa_engine_mark_whole(w->engine, (uint64_t)w->seq);
    if (rc) return rc;
    if (!d->early && (rc = launch_reads(d, err, errlen))) return rc;
    at_step(d, EFA_STEP_READS);
    if (d->reads_event) {
        rc = ((record_fn)(uintptr_t)d->event_record)(d->reads_event, d->stream, err, errlen);
        if (rc) return rc;
    }
    at_step(d, EFA_STEP_DONE);
    return 0;
}

static int dispatch_call(efa_op *o, efa_devop *d, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank;
    if (d->kind != EFA_DEVOP_DISPATCH) {
        set_err(err, errlen, "rank %lld: efa_devop_dispatch of kind %lld", (long long)me,
                (long long)d->kind);
        return -EINVAL;
    }
    int rc = front(o, d, err, errlen);
    if (rc) return rc;
    at_step(d, EFA_STEP_BEGIN);
    rc = efa_op_dispatch_packed_begin(o, err, errlen);
    if (rc) return rc;
    at_step(d, EFA_STEP_POST);
    rc = efa_op_dispatch_packed_post(o, err, errlen);
    if (rc) return rc;
    int64_t n = 0; /* each source's count is bounded by the checked headers */
    for (int64_t r = 0; r < W; r++) n += o->num_recv[r];
    at_step(d, EFA_STEP_COMPLETE);
    if (n * o->topk > d->routing_cap) {
        set_err(err, errlen, "rank %lld: dispatch: %lld routing rows received, the buffer holds "
                "%lld", (long long)me, (long long)n, (long long)(d->routing_cap / o->topk));
        return -EINVAL;
    }
    d->recv_off[0] = 0;
    for (int64_t r = 0; r < W; r++) d->recv_off[r + 1] = d->recv_off[r] + o->num_recv[r];
    d->own_start = 0;
    for (int64_t r = 0; r < me; r++) d->own_start += o->num_send[r];
    return 0; /* step stays EFA_STEP_COMPLETE: efa_devop_dispatch_finish's */
}

int efa_devop_dispatch(efa_op *o, efa_devop *d, char *err, size_t errlen) {
    clock_call(CLOCK_DISPATCH);
    return clock_done(dispatch_call(o, d, err, errlen));
}

int efa_devop_dispatch_finish(efa_op *o, efa_devop *d, char *err, size_t errlen) {
    clock_call(CLOCK_FINISH);
    return clock_done(reads_and_complete(o, d, err, errlen));
}

static int rows_call(efa_op *o, efa_devop *d, char *err, size_t errlen) {
    const int combine = d->kind == EFA_DEVOP_COMBINE;
    if (!combine && d->kind != EFA_DEVOP_CACHED) {
        set_err(err, errlen, "rank %lld: efa_devop_rows of kind %lld", (long long)o->wire->rank,
                (long long)d->kind);
        return -EINVAL;
    }
    int rc = front(o, d, err, errlen);
    if (rc) return rc;
    at_step(d, EFA_STEP_BEGIN);
    rc = combine ? efa_op_combine_packed_begin(o, err, errlen)
                 : efa_op_cached_packed_begin(o, err, errlen);
    if (rc) return rc;
    at_step(d, EFA_STEP_POST);
    rc = combine ? efa_op_combine_packed_post(o, err, errlen)
                 : efa_op_cached_packed_post(o, err, errlen);
    if (rc) return rc;
    if (d->send_off) {
        d->send_off[0] = 0;
        for (int64_t r = 0; r < o->wire->world; r++)
            d->send_off[r + 1] = d->send_off[r] + o->num_send[r];
    }
    return reads_and_complete(o, d, err, errlen);
}

int efa_devop_rows(efa_op *o, efa_devop *d, char *err, size_t errlen) {
    clock_call(CLOCK_ROWS);
    return clock_done(rows_call(o, d, err, errlen));
}
