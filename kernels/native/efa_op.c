/* efa_op.c: a whole proxy operation on host memory in two native calls, post and complete
 * (efa_proxy.h, "Operations"). post: the routing layout and its value checks (dispatch), the
 * round's headers, the rows packed into the send area, the peers' headers waited for and
 * checked, the data posted. complete: this rank's own rows, the peers' data waited for, footers
 * checked, rows copied out, routing rows checked and unpacked (dispatch) or the reduction
 * (combine). Between the two the caller only allocates the outputs, whose sizes the headers
 * gave. Every problem found here is named here (err); the caller maps the return code to its
 * error kind. A client of efa_round.c (the round's steps) and efa_host.c (layout, checks,
 * reduction).
 *
 * Build: part of libefa_proxy.so (kernels/proxy/native.py SOURCES).
 */
#define _GNU_SOURCE
#include "efa_proxy.h"
#include "efa_util.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

enum { OP_DISPATCH = 1, OP_COMBINE = 2, OP_CACHED = 3 };


static int64_t data_recv_off(const efa_wire *w, int64_t src) {
    return w->off_recv + src * w->region_bytes + 2 * w->hdr_bytes;
}

/* Prefix sums of counts[W] into starts[W + 1]. */
static void prefix(const int64_t *counts, int64_t W, int64_t *starts) {
    starts[0] = 0;
    for (int64_t r = 0; r < W; r++) starts[r + 1] = starts[r] + counts[r];
}

/* The round's fixed inputs for op, rows_to[] given; widths[0..np). */
static void round_setup(efa_op *o, int64_t op, int64_t np, const int64_t *widths, int64_t fmt,
                        int64_t *extras, int64_t *n_recv) {
    efa_wire *w = o->wire;
    w->seq = o->seq;
    w->tag = (int64_t)(((uint64_t)o->gen << 32) | ((uint64_t)o->seq & 0xFFFFFFFFull));
    w->op = op;
    w->status = 0;
    w->nplanes = np;
    w->row_bytes = 0;
    for (int64_t p = 0; p < np; p++) {
        w->widths[p] = widths[p];
        w->row_bytes += widths[p];
    }
    w->fmt = fmt;
    w->extras = extras;
    w->n_recv = n_recv;
    w->rows_to[w->rank] = 0;
}

/* The operations read and write the window in place: a host window's (EFA_WINDOW_DIRECT). */
static int begin_round(efa_wire *w, char *err, size_t errlen) {
    if (w->window_kind != EFA_WINDOW_DIRECT) {
        set_err(err, errlen, "rank %lld: the native operations need a host window (window kind "
                "%lld); a device window runs its rounds in steps", (long long)w->rank,
                (long long)w->window_kind);
        return -EINVAL;
    }
    return efa_wire_begin(w, 1, err, errlen);
}

/* num_recv[r] = rows_from[r] (the checked headers), this rank's own = own. */
static void take_rows_from(efa_op *o, int64_t own) {
    efa_wire *w = o->wire;
    for (int64_t r = 0; r < w->world; r++) o->num_recv[r] = r == w->rank ? own : w->rows_from[r];
}

/* Rows idx[a..b) of src (row_bytes each) -> dst, in order. */
static void gather_rows(uint8_t *dst, const uint8_t *src, const int64_t *idx, int64_t a, int64_t b,
                        int64_t rb) {
    for (int64_t j = a; j < b; j++, dst += rb) memcpy(dst, src + idx[j] * rb, (size_t)rb);
}

/* Starts a dispatch round of S rows (num_send[W] to each rank): two planes (the rows, then
 * their 16K-byte routing rows), the per-expert counts in the headers, the headers posted. */
static int begin_dispatch_round(efa_op *o, int64_t S, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    o->rows = S;
    for (int64_t d = 0; d < w->world; d++) w->rows_to[d] = o->num_send[d];
    const int64_t widths[2] = {o->row_bytes, 16 * o->topk};
    round_setup(o, OP_DISPATCH, 2, widths, o->topk, o->counts, NULL);
    return begin_round(w, err, errlen);
}

/* ---------------------------------------------------------------------------------------- */
int efa_op_dispatch_post(efa_op *o, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, K = o->topk, T = o->tokens, rb = o->row_bytes;
    if (K < 1 || T < 0 || T > w->max_rows || o->cap < T * (K < W ? K : W) ||
        o->meta_rows < o->cap || o->num_experts != o->num_local * W) {
        set_err(err, errlen, "rank %lld: dispatch of %lld tokens, top-%lld: scratch of %lld rows "
               "(capacity %lld) too small or bad geometry", (long long)me, (long long)T,
               (long long)K, (long long)o->meta_rows, (long long)o->cap);
        return -EINVAL;
    }
    int64_t S = efa_route_layout(o->topk_idx, o->weights, T, K, o->num_experts, W, o->send_idx,
                                 o->meta, o->cap, o->num_send, o->counts, o->scratch, &o->flags);
    if (S < 0) {
        if (S == -1) return EFA_RC_LOCAL_INPUT; /* the caller names the bad values, then the error round */
        set_err(err, errlen, "rank %lld: the routing layout needs more than %lld rows",
               (long long)me, (long long)o->cap);
        return (int)S;
    }
    int rc = begin_dispatch_round(o, S, err, errlen);
    if (rc) return rc;
    /* pack while the headers fly: token rows (plane 0) and routing rows (plane 1) */
    int64_t *st = o->scratch; /* W + 1 starts (the layout is done with its scratch) */
    prefix(o->num_send, W, st);
    for (int64_t d = 0; d < W; d++) {
        if (d == me || !o->num_send[d]) continue;
        gather_rows(w->window + w->plan[d], o->x, o->send_idx, st[d], st[d + 1], rb);
        memcpy(w->window + w->plan[W + d], o->meta + st[d] * 2 * K, (size_t)(o->num_send[d] * 16 * K));
    }
    rc = efa_wire_exchange(w, 1, err, errlen);
    if (rc) return rc;
    take_rows_from(o, o->num_send[me]);
    return 0;
}

/* Names the first problem efa_unpack_meta found in source src's routing rows (m: n rows of 2K
 * int64), the way every check is worded (kinds as efa_unpack_meta's). */
static void describe_meta(const efa_wire *w, int64_t src, const int64_t *m, int64_t n, int64_t K,
                          int64_t L, const int64_t *want, char *err, size_t errlen) {
    const long long me = (long long)w->rank, s = (long long)src;
    int64_t lo = 0, hi = 0, none = 0, wt = 0, inf = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *ids = m + i * 2 * K, *wb = ids + K;
        int any = 0;
        for (int64_t k = 0; k < K; k++) {
            if ((i == 0 && k == 0) || ids[k] < lo) lo = ids[k];
            if ((i == 0 && k == 0) || ids[k] > hi) hi = ids[k];
            any |= ids[k] >= 0;
            wt |= ids[k] < 0 && wb[k] != 0;
            int32_t b = (int32_t)(uint32_t)(uint64_t)wb[k];
            float f;
            memcpy(&f, &b, 4);
            inf |= !isfinite(f);
        }
        none |= !any;
    }
    if (n && (lo < -1 || hi >= L)) {
        set_err(err, errlen, "rank %lld: protocol violation: rank %lld sent local expert id %lld; "
               "expected -1 or 0 <= id < %lld (local experts)", me, s,
               (long long)(hi >= L ? hi : lo), (long long)L);
    } else if (n && none) {
        set_err(err, errlen, "rank %lld: protocol violation: rank %lld sent a row that names none "
               "of this rank's experts", me, s);
    } else if (n && wt) {
        set_err(err, errlen, "rank %lld: protocol violation: rank %lld sent a non-zero weight in a "
               "slot without an expert here", me, s);
    } else if (n && inf) {
        set_err(err, errlen, "rank %lld: protocol violation: rank %lld sent NaN/Inf routing "
               "weights", me, s);
    } else {
        /* the counts: ids are in range here, so each lands in [0, L) */
        char a[192], b[192];
        size_t pa = 0, pb = 0;
        for (int64_t e = 0; e < L && pa < sizeof a - 24 && pb < sizeof b - 24; e++) {
            int64_t c = 0;
            for (int64_t i = 0; i < n; i++)
                for (int64_t k = 0; k < K; k++) c += m[i * 2 * K + k] == e;
            pa += (size_t)snprintf(a + pa, sizeof a - pa, "%s%lld", e ? ", " : "", (long long)want[e]);
            pb += (size_t)snprintf(b + pb, sizeof b - pb, "%s%lld", e ? ", " : "", (long long)c);
        }
        set_err(err, errlen, "rank %lld: protocol violation: rank %lld's per-expert counts [%s%s] "
               "disagree with the expert ids of the %lld rows it sent ([%s%s])", me, s, a,
               pa >= sizeof a - 24 ? ", ..." : "", (long long)n, b, pb >= sizeof b - 24 ? ", ..." : "");
    }
}

int efa_describe_meta(efa_wire *w, int64_t src, const int64_t *m, int64_t n, int64_t K, int64_t L,
                      const int64_t *hdr_counts, char *err, size_t errlen) {
    describe_meta(w, src, m, n, K, L, hdr_counts, err, errlen);
    return -EPROTO;
}

/* The end of a dispatch: the peers' data waited for and its footers checked, their rows copied
 * into recv_x (copy_rows; else they stay in the window, read from there by the device), the
 * routing rows checked and unpacked. */
static int dispatch_finish(efa_op *o, int copy_rows, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, K = o->topk, rb = o->row_bytes, L = o->num_local;
    int64_t *rst = o->scratch, *sst = o->scratch + W + 1;
    prefix(o->num_recv, W, rst);
    prefix(o->num_send, W, sst);
    /* this rank's own rows while the peers' data flies */
    if (copy_rows)
        gather_rows(o->recv_x + rst[me] * rb, o->x, o->send_idx, sst[me], sst[me + 1], rb);
    int rc = efa_wire_finish(w, err, errlen);
    if (rc) return rc;
    int64_t *srcs = o->aux, *n = o->aux + W, *chk = o->aux + 2 * W;
    for (int64_t r = 0; r < W; r++) {
        n[r] = o->num_recv[r];
        chk[r] = r != me;
        if (r == me) {
            srcs[r] = (int64_t)(uintptr_t)(o->meta + sst[me] * 2 * K);
            continue;
        }
        const uint8_t *base = w->window + data_recv_off(w, r);
        if (n[r] && copy_rows) memcpy(o->recv_x + rst[r] * rb, base, (size_t)(n[r] * rb));
        srcs[r] = (int64_t)(uintptr_t)(base + align16(n[r] * rb));
    }
    int64_t kind = 0;
    int64_t bad = efa_unpack_meta(W, K, L, srcs, n, chk, w->got + EFA_HDR_FIXED, w->hdr_fields,
                                  o->recv_idx, o->recv_w, o->tokens_per_expert,
                                  o->scratch + 2 * W + 2, &kind);
    if (bad >= 0) {
        o->bad_peer = bad;
        o->kind = kind;
        describe_meta(w, bad, (const int64_t *)(uintptr_t)srcs[bad], n[bad], K, L,
                      w->got + bad * w->hdr_fields + EFA_HDR_FIXED, err, errlen);
        return -EPROTO;
    }
    return 0;
}

int efa_op_dispatch_complete(efa_op *o, char *err, size_t errlen) {
    return dispatch_finish(o, 1, err, errlen);
}

/* Rows packed by the device before the round: plane 0 of the send area must be one run of
 * every peer's rows in rank order from its start (the device wrote them there), which holds
 * when a row is a multiple of 16 bytes. */
static int check_packed_plane(efa_op *o, const char *what, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, rb = o->row_bytes;
    if (rb % 16) {
        set_err(err, errlen, "rank %lld: %s of rows packed before the round: rows of %lld bytes "
               "are not a multiple of 16", (long long)me, what, (long long)rb);
        return -EINVAL;
    }
    int64_t at = w->off_data_send;
    for (int64_t d = 0; d < W; d++) {
        if (d == me || w->rows_to[d] <= 0) continue;
        if (w->plan[d] != at) {
            set_err(err, errlen, "rank %lld: %s: the send area's rows to rank %lld start at %lld, "
                   "the device packed them at %lld", (long long)me, what, (long long)d,
                   (long long)w->plan[d], (long long)at);
            return -EINVAL;
        }
        at += w->rows_to[d] * rb;
    }
    return 0;
}

/* Waits until the device's count block says it is complete (its ready word, written last with
 * release order), spinning, then yielding; bounded by the wire's deadline. */
static int wait_dev_counts(efa_op *o, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const volatile int64_t *ready = o->dev_counts + 1 + w->world + o->num_experts;
    if (__atomic_load_n(ready, __ATOMIC_ACQUIRE) == 1) return 0;
    const uint64_t t0 = now_ns(), limit = (uint64_t)w->timeout_ms * 1000000ull;
    for (uint64_t spins = 1;; spins++) {
        if (__atomic_load_n(ready, __ATOMIC_ACQUIRE) == 1) break;
        if ((spins & 255) == 0) {
            uint64_t dt = now_ns() - t0;
            if (dt > limit) {
                set_err(err, errlen, "rank %lld: dispatch (round %lld): the device did not write "
                       "the routing counts within %.3g s (a kernel on this stream never "
                       "completed: the GPU hangs or another kernel holds it)", (long long)w->rank,
                       (long long)o->seq, (double)w->timeout_ms / 1e3);
                return -ETIMEDOUT;
            }
            if (dt > 200000) sched_yield(); /* a long pack (prefill): leave the core to others */
        }
    }
    w->wait_ns += (int64_t)(now_ns() - t0);
    return 0;
}

int efa_op_dispatch_packed_begin(efa_op *o, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, K = o->topk, E = o->num_experts;
    int rc = wait_dev_counts(o, err, errlen);
    if (rc) return rc;
    const volatile int64_t *c = o->dev_counts;
    if (c[0]) {
        o->flags = c[0];
        return EFA_RC_LOCAL_INPUT; /* the caller names the bad values, then the error round */
    }
    int64_t S = 0;
    for (int64_t d = 0; d < W; d++) {
        o->num_send[d] = c[1 + d];
        if (o->num_send[d] < 0 || o->num_send[d] > w->max_rows) {
            set_err(err, errlen, "rank %lld: dispatch of packed rows: %lld rows to rank %lld "
                   "outside [0, %lld]", (long long)me, (long long)o->num_send[d], (long long)d,
                   (long long)w->max_rows);
            return -EINVAL;
        }
        S += o->num_send[d];
    }
    for (int64_t e = 0; e < E; e++) o->counts[e] = c[1 + W + e];
    if (K < 1 || S > o->meta_rows) {
        set_err(err, errlen, "rank %lld: dispatch of packed rows: %lld routing rows, top-%lld, "
               "exceed the routing buffer of %lld rows", (long long)me, (long long)S,
               (long long)K, (long long)o->meta_rows);
        return -EINVAL;
    }
    return begin_dispatch_round(o, S, err, errlen);
}

static inline int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Posts bytes [from, to) of this round's data message m (efa_wire_begin's list). Cut at
 * multiples of the wire's chunk size, a message's slices make the chunks the receiver counts;
 * marked (a plane 0: the receiver's kernel may read its chunks as they arrive), the chunk at
 * byte c * chunk_bytes carries mark c + 1. */
static int post_slice(efa_wire *w, int64_t m, int64_t from, int64_t to, int marked, char *err,
                      size_t errlen) {
    int64_t d = w->msgs[m], lo = w->msgs[w->max_msgs + m] + from,
            ro = w->msgs[2 * w->max_msgs + m] + from, size = to - from;
    uint32_t msg = (uint32_t)(2 * w->seq + 1) & EFA_IMM_MSG_MASK;
    int64_t c = from / w->chunk_bytes;
    uint32_t mark0 = marked && c < EFA_MARK_CHUNKS ? (uint32_t)c + 1 : 0;
    int rc = efa_post_messages(w->engine, msg, mark0, 1, &d, &lo, &ro, &size,
                               (uint32_t)w->chunk_bytes, w->next_channel, (int)w->timeout_ms, err,
                               errlen);
    if (rc) return rc;
    w->r_writes += cdiv64(size, w->chunk_bytes);
    w->r_wire_bytes += size;
    return 0;
}

/* Plane 0 of every destination posted as the device stores it: the rows below min(progress) *
 * chunk_rows of the send order (rows_to[d] to rank d, rank-major, starts st[W + 1]) are in host
 * memory. Returns once every chunk is stored (a dispatch's routing rows too), or -ETIMEDOUT at
 * the wire's deadline. what: the operation, for the message. */
static int post_rows_as_stored(efa_op *o, const int64_t *rows_to, const int64_t *st,
                               const char *what, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, rb = o->row_bytes, cb = w->chunk_bytes;
    const int64_t S = st[W], R = o->chunk_rows, chunks = S > 0 ? cdiv64(S, R) : 0;
    if (R < 1 || o->progress_words < 1 || cb < 1) {
        set_err(err, errlen, "rank %lld: %s of packed rows: chunks of %lld rows, %lld progress "
               "words", (long long)me, what, (long long)R, (long long)o->progress_words);
        return -EINVAL;
    }
    int64_t *msg0 = o->aux, *posted = o->aux + W; /* plane 0's message per destination, bytes out */
    for (int64_t d = 0; d < W; d++) {
        msg0[d] = -1;
        posted[d] = 0;
    }
    for (int64_t m = 0; m < w->nmsgs; m++) {
        int64_t d = w->msgs[m];
        if (w->msgs[w->max_msgs + m] == w->plan[d]) msg0[d] = m; /* plane 0 of d starts there */
    }
    const uint64_t t0 = now_ns(), limit = (uint64_t)w->timeout_ms * 1000000ull;
    int64_t stored = 0; /* chunks every program has stored */
    for (uint64_t spins = 0;;) {
        int64_t c = chunks;
        for (int64_t p = 0; p < o->progress_words; p++) {
            int64_t v = __atomic_load_n(o->progress + p, __ATOMIC_ACQUIRE);
            if (v < c) c = v < 0 ? 0 : v;
        }
        if (c > stored || (stored == 0 && chunks == 0)) {
            stored = c;
            const int64_t rows = stored * R < S ? stored * R : S;
            for (int64_t d = 0; d < W; d++) {
                if (d == me || msg0[d] < 0) continue;
                int64_t n = rows_to[d], ready = rows - st[d];
                ready = ready < 0 ? 0 : ready > n ? n : ready;
                int64_t upto = ready == n ? n * rb : (ready * rb / cb) * cb;
                if (upto > posted[d]) {
                    int rc = post_slice(w, msg0[d], posted[d], upto, 1, err, errlen);
                    if (rc) return rc;
                    posted[d] = upto;
                }
            }
            if (stored >= chunks) break;
            continue;
        }
        if ((++spins & 255) == 0) {
            uint64_t dt = now_ns() - t0;
            if (dt > limit) {
                set_err(err, errlen, "rank %lld: %s (round %lld): the device stored %lld of "
                       "%lld chunks of rows within %.3g s (a kernel on this stream never "
                       "completed: the GPU hangs or another kernel holds it)", (long long)me,
                       what, (long long)o->seq, (long long)stored, (long long)chunks,
                       (double)w->timeout_ms / 1e3);
                return -ETIMEDOUT;
            }
            if (dt > 200000) sched_yield();
        }
    }
    w->wait_ns += (int64_t)(now_ns() - t0);
    return 0;
}

/* Every data message of this round but the planes 0 (posted as stored): routing rows, footers. */
static int post_rest(efa_wire *w, char *err, size_t errlen) {
    for (int64_t m = 0; m < w->nmsgs; m++) {
        if (w->msgs[w->max_msgs + m] == w->plan[w->msgs[m]]) continue; /* plane 0 */
        int rc = post_slice(w, m, 0, w->msgs[3 * w->max_msgs + m], 0, err, errlen);
        if (rc) return rc;
    }
    return 0;
}

int efa_op_dispatch_packed_post(efa_op *o, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, K = o->topk;
    int rc = check_packed_plane(o, "dispatch", err, errlen);
    if (rc) return rc;
    rc = efa_wire_exchange(w, 0, err, errlen); /* headers checked, footers written */
    if (rc) return rc;
    int64_t *st = o->scratch;
    prefix(o->num_send, W, st);
    rc = post_rows_as_stored(o, o->num_send, st, "dispatch", err, errlen);
    if (rc) return rc;
    /* every row stored: the routing rows, then the rest of each message (its footer) */
    for (int64_t d = 0; d < W; d++)
        if (d != me && o->num_send[d])
            memcpy(w->window + w->plan[W + d], o->meta + st[d] * 2 * K,
                   (size_t)(o->num_send[d] * 16 * K));
    rc = post_rest(w, err, errlen);
    if (rc) return rc;
    take_rows_from(o, o->num_send[me]);
    return 0;
}

int efa_op_dispatch_packed_complete(efa_op *o, char *err, size_t errlen) {
    return dispatch_finish(o, 0, err, errlen);
}

/* ---------------------------------------------------------------------------------------- */
/* Starts a round of one plane of row_bytes-wide rows: rows_to[d] rows to each rank, n_recv[r]
 * expected from each (the handle's counts), the headers posted. */
static int begin_rows_round(efa_op *o, int64_t op, const int64_t *rows_to, int64_t *n_recv,
                            char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t rb = o->row_bytes;
    for (int64_t d = 0; d < w->world; d++) w->rows_to[d] = rows_to[d];
    round_setup(o, op, 1, &rb, o->fmt, NULL, n_recv);
    return begin_round(w, err, errlen);
}

int efa_op_cached_post(efa_op *o, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, rb = o->row_bytes;
    /* the handle's rows index x: each must be one of x's tokens (checked before anything moves) */
    int64_t S = 0;
    for (int64_t d = 0; d < W; d++) S += o->num_send[d];
    for (int64_t j = 0; j < S; j++) {
        if (o->send_idx[j] < 0 || o->send_idx[j] >= o->tokens) {
            set_err(err, errlen, "rank %lld: dispatch_cached: the handle's token index %lld is "
                   "outside [0, %lld)", (long long)me, (long long)o->send_idx[j], (long long)o->tokens);
            return -EINVAL;
        }
    }
    int rc = begin_rows_round(o, OP_CACHED, o->num_send, o->num_recv, err, errlen);
    if (rc) return rc;
    int64_t *st = o->scratch;
    prefix(o->num_send, W, st);
    for (int64_t d = 0; d < W; d++)
        if (d != me && o->num_send[d])
            gather_rows(w->window + w->plan[d], o->x, o->send_idx, st[d], st[d + 1], rb);
    return efa_wire_exchange(w, 1, err, errlen);
}

int efa_op_cached_complete(efa_op *o, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, rb = o->row_bytes;
    int64_t *rst = o->scratch, *sst = o->scratch + W + 1;
    prefix(o->num_recv, W, rst);
    prefix(o->num_send, W, sst);
    gather_rows(o->recv_x + rst[me] * rb, o->x, o->send_idx, sst[me], sst[me + 1], rb);
    int rc = efa_wire_finish(w, err, errlen);
    if (rc) return rc;
    for (int64_t r = 0; r < W; r++)
        if (r != me && o->num_recv[r])
            memcpy(o->recv_x + rst[r] * rb, w->window + data_recv_off(w, r), (size_t)(o->num_recv[r] * rb));
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* combine: y's rows are grouped by destination (num_recv[d] rows to rank d, rank order); they go
 * back to the ranks they came from, each rank expecting num_send[r] rows from r. */
int efa_op_combine_post(efa_op *o, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, rb = o->row_bytes;
    int rc = begin_rows_round(o, OP_COMBINE, o->num_recv, o->num_send, err, errlen);
    if (rc) return rc;
    int64_t *st = o->scratch;
    prefix(o->num_recv, W, st);
    for (int64_t d = 0; d < W; d++)
        if (d != me && o->num_recv[d])
            memcpy(w->window + w->plan[d], o->x + st[d] * rb, (size_t)(o->num_recv[d] * rb));
    return efa_wire_exchange(w, 1, err, errlen);
}

/* cached_packed: the handle's rows, gathered by the device into the send area (num_send[d]
 * rows to rank d), num_recv[r] expected from rank r; the caller copies them out of the window. */
int efa_op_cached_packed_begin(efa_op *o, char *err, size_t errlen) {
    return begin_rows_round(o, OP_CACHED, o->num_send, o->num_recv, err, errlen);
}

/* The post of a packed round of one plane of rows (rows_to[d] to rank d, rank order): headers
 * checked, the rows posted as the device stores them, then the footers. */
static int post_packed_rows(efa_op *o, const int64_t *rows_to, const char *what, char *err,
                            size_t errlen) {
    efa_wire *w = o->wire;
    int rc = check_packed_plane(o, what, err, errlen);
    if (rc) return rc;
    rc = efa_wire_exchange(w, 0, err, errlen); /* headers checked, footers written */
    if (rc) return rc;
    int64_t *st = o->scratch;
    prefix(rows_to, w->world, st);
    rc = post_rows_as_stored(o, rows_to, st, what, err, errlen);
    if (rc) return rc;
    return post_rest(w, err, errlen);
}

int efa_op_cached_packed_post(efa_op *o, char *err, size_t errlen) {
    return post_packed_rows(o, o->num_send, "dispatch_cached", err, errlen);
}

int efa_op_cached_packed_complete(efa_op *o, char *err, size_t errlen) {
    return efa_wire_finish(o->wire, err, errlen);
}

int efa_op_combine_packed_begin(efa_op *o, char *err, size_t errlen) {
    return begin_rows_round(o, OP_COMBINE, o->num_recv, o->num_send, err, errlen);
}

int efa_op_combine_packed_post(efa_op *o, char *err, size_t errlen) {
    return post_packed_rows(o, o->num_recv, "combine", err, errlen); /* y's rows go back */
}

int efa_op_combine_packed_complete(efa_op *o, char *err, size_t errlen) {
    return efa_wire_finish(o->wire, err, errlen);
}

int efa_op_combine_complete(efa_op *o, char *err, size_t errlen) {
    efa_wire *w = o->wire;
    const int64_t W = w->world, me = w->rank, rb = o->row_bytes, T = o->tokens;
    int64_t *rst = o->scratch, *sst = o->scratch + W + 1;
    prefix(o->num_recv, W, rst);
    prefix(o->num_send, W, sst);
    int rc = efa_wire_finish(w, err, errlen);
    if (rc) return rc;
    if (o->slot_cap < W * T) {
        set_err(err, errlen, "rank %lld: combine scratch of %lld slots < %lld", (long long)me,
               (long long)o->slot_cap, (long long)(W * T));
        return -EINVAL;
    }
    int64_t *rows = o->aux, *n = o->aux + W, *ix = o->aux + 2 * W;
    for (int64_t r = 0; r < W; r++) {
        rows[r] = (int64_t)(uintptr_t)(r == me ? o->x + rst[me] * rb : w->window + data_recv_off(w, r));
        n[r] = o->num_send[r];
        ix[r] = (int64_t)(uintptr_t)(o->send_idx + sst[r]);
    }
    const int64_t esz = o->dtype == EFA_DT_F32 ? 4 : 2;
    rc = efa_reduce_rows(W, T, rb / esz, o->dtype, o->dtype, rows, n, ix, o->slot, o->out);
    if (rc < 0)
        set_err(err, errlen, "rank %lld: combine: the handle's token indices are outside [0, %lld) "
               "or repeat within a rank's rows", (long long)me, (long long)T);
    return rc;
}
