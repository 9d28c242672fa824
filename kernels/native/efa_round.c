/* efa_round.c: one round of the proxy transport's wire protocol (header exchange, then data) in
 * native code. A client of the public ABI in efa_proxy.h (efa_wait_idle, efa_engine_expect,
 * efa_post_messages, efa_wait_counters); the protocol, the struct and the header format are
 * described there and in kernels/proxy/wire.py. A host window is read and written in place; a
 * device window through a host stage and the CUDA driver's copies (window_kind), the same steps
 * and checks. Every problem is worded here, the same on every rank (efa_wire_check_headers).
 *
 * Build: part of libefa_proxy.so (cc ... efa_proxy.c efa_bench.c efa_round.c efa_host.c ...).
 */
#define _GNU_SOURCE
#include "efa_proxy.h"
#include "efa_util.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

enum { H_STATUS, H_OP, H_ROWS, H_ROW_BYTES, H_CHUNKS, H_TAG, H_FORMAT };
#define FOOTER_BYTES 16

/* ---- A window reached through copies (window_kind != EFA_WINDOW_DIRECT) -------------------- */
/* The CUDA driver's copies, loaded at the first device window's round (the library builds and
 * runs without CUDA). CUresult is an int, CUdeviceptr an unsigned long long, CUstream a pointer. */
typedef int (*cu_h2d_t)(unsigned long long dst, const void *src, size_t n, void *stream);
typedef int (*cu_d2h_t)(void *dst, unsigned long long src, size_t n, void *stream);
typedef int (*cu_query_t)(void *stream);
typedef int (*cu_errstr_t)(int code, const char **text);
static struct {
    cu_h2d_t h2d;
    cu_d2h_t d2h;
    cu_query_t query;
    cu_errstr_t errstr;
    char why[256];
} cuda_copy;
static pthread_once_t cuda_copy_once = PTHREAD_ONCE_INIT;

static void cuda_copy_load(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(cuda_copy.why, sizeof cuda_copy.why,
                 "libcuda.so.1 cannot be loaded (%s): no NVIDIA driver here", dlerror());
        return;
    }
    cuda_copy.h2d = (cu_h2d_t)dlsym(h, "cuMemcpyHtoDAsync_v2");
    cuda_copy.d2h = (cu_d2h_t)dlsym(h, "cuMemcpyDtoHAsync_v2");
    cuda_copy.query = (cu_query_t)dlsym(h, "cuStreamQuery");
    cuda_copy.errstr = (cu_errstr_t)dlsym(h, "cuGetErrorString");
    if (!cuda_copy.h2d || !cuda_copy.d2h || !cuda_copy.query) {
        cuda_copy.h2d = NULL;
        snprintf(cuda_copy.why, sizeof cuda_copy.why, "the NVIDIA driver lacks "
                 "cuMemcpyHtoDAsync_v2, cuMemcpyDtoHAsync_v2 or cuStreamQuery");
    }
}

static int cuda_failed(const efa_wire *w, int code, const char *what, char *err, size_t errlen) {
    const char *text = NULL;
    if (cuda_copy.errstr) cuda_copy.errstr(code, &text);
    set_err(err, errlen, "rank %lld: the device window's %s failed: CUDA error %d (%s)",
            (long long)w->rank, what, code, text ? text : "unknown");
    return -EFAULT; /* the transport's own error (a peer's failure is -EIO, a deadline -ETIMEDOUT) */
}

static int copies_ready(const efa_wire *w, char *err, size_t errlen) {
    if (w->window_kind == EFA_WINDOW_DIRECT) return 0;
    if (w->window_kind != EFA_WINDOW_CUDA && w->window_kind != EFA_WINDOW_COPIED) {
        set_err(err, errlen, "rank %lld: window kind %lld is none of 0 (in place), 1 (CUDA "
                "copies), 2 (memcpy copies)", (long long)w->rank, (long long)w->window_kind);
        return -EINVAL;
    }
    if (!w->stage) {
        set_err(err, errlen, "rank %lld: a window reached through copies (kind %lld) needs a "
                "stage", (long long)w->rank, (long long)w->window_kind);
        return -EINVAL;
    }
    if (w->window_kind == EFA_WINDOW_CUDA) {
        pthread_once(&cuda_copy_once, cuda_copy_load);
        if (!cuda_copy.h2d) {
            set_err(err, errlen, "rank %lld: a device window's round needs the CUDA driver: %s",
                    (long long)w->rank, cuda_copy.why);
            return -ENOSYS;
        }
    }
    return 0;
}

/* Queue a copy of n bytes from host src to the window at off (ordered on the stream). */
static int to_window(const efa_wire *w, int64_t off, const void *src, int64_t n, char *err,
                     size_t errlen) {
    if (n <= 0) return 0;
    if (w->window_kind == EFA_WINDOW_COPIED) {
        memcpy(w->window + off, src, (size_t)n);
        return 0;
    }
    int rc = cuda_copy.h2d((unsigned long long)(uintptr_t)(w->window + off), src, (size_t)n,
                           (void *)(uintptr_t)w->stream);
    return rc ? cuda_failed(w, rc, "copy to the window", err, errlen) : 0;
}

/* Queue a copy of n bytes from the window at off to host dst (valid after window_sync). */
static int from_window(const efa_wire *w, void *dst, int64_t off, int64_t n, char *err,
                       size_t errlen) {
    if (n <= 0) return 0;
    if (w->window_kind == EFA_WINDOW_COPIED) {
        memcpy(dst, w->window + off, (size_t)n);
        return 0;
    }
    int rc = cuda_copy.d2h(dst, (unsigned long long)(uintptr_t)(w->window + off), (size_t)n,
                           (void *)(uintptr_t)w->stream);
    return rc ? cuda_failed(w, rc, "copy from the window", err, errlen) : 0;
}

/* Waits for the stream: the queued copies and every kernel the caller queued before them (its
 * packing into the send area, its reads of the receive side), at most timeout_ms (polled: a
 * kernel that never ends is named, not waited for forever). Time counted as a wait. */
#define CU_NOT_READY 600 /* CUDA_ERROR_NOT_READY */
static const char *op_name(int64_t op);
static int window_sync(efa_wire *w, const char *what, char *err, size_t errlen) {
    if (w->window_kind != EFA_WINDOW_CUDA) return 0;
    uint64_t t0 = now_ns(), limit = (uint64_t)w->timeout_ms * 1000000ull;
    int rc;
    while ((rc = cuda_copy.query((void *)(uintptr_t)w->stream)) == CU_NOT_READY) {
        uint64_t spent = now_ns() - t0;
        if (spent > limit) {
            w->wait_ns += (int64_t)spent;
            set_err(err, errlen, "rank %lld: the device window's stream did not finish its "
                    "queued work (the copies of the %s and the kernels before them) within %lld "
                    "ms [%s, round %lld]", (long long)w->rank, what, (long long)w->timeout_ms,
                    op_name(w->op), (long long)w->seq);
            return -ETIMEDOUT;
        }
        if (spent > 50000) { /* past 50 us: short sleeps, the CPU to the engine's threads */
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
    w->wait_ns += (int64_t)(now_ns() - t0);
    return rc ? cuda_failed(w, rc, "stream synchronization", err, errlen) : 0;
}

/* The stage's parts (efa_wire_stage_bytes' layout). */
static uint8_t *stage_hdr_send(const efa_wire *w) { return w->stage; }
static uint8_t *stage_hdr_recv(const efa_wire *w) { return w->stage + w->world * w->hdr_bytes; }
static uint8_t *stage_foot_send(const efa_wire *w) {
    return stage_hdr_recv(w) + w->world * w->hdr_len;
}
static uint8_t *stage_foot_recv(const efa_wire *w) {
    return stage_foot_send(w) + w->world * FOOTER_BYTES;
}

int64_t efa_wire_stage_bytes(int64_t world, int64_t hdr_bytes, int64_t hdr_len) {
    return world * (hdr_bytes + hdr_len + 2 * FOOTER_BYTES);
}

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Descriptors of a data message of `rows` rows: each plane cut into chunks, plus the footer. */
static int64_t data_chunks(const efa_wire *w, int64_t rows) {
    if (rows <= 0) return 0;
    int64_t c = 1;
    for (int64_t p = 0; p < w->nplanes; p++) c += cdiv(rows * w->widths[p], w->chunk_bytes);
    return c;
}

static int64_t hdr_recv_off(const efa_wire *w, int64_t src, int64_t seq) {
    return w->off_recv + src * w->region_bytes + (seq % 2) * w->hdr_bytes;
}

static int64_t data_recv_off(const efa_wire *w, int64_t src) {
    return w->off_recv + src * w->region_bytes + 2 * w->hdr_bytes;
}

static const char *op_name(int64_t op) {
    return op == 1 ? "dispatch" : op == 2 ? "combine" : op == 3 ? "dispatch_cached" : "operation";
}

/* A failed wait's text (it names the peer and the message id) gets the operation and round. */
static int wait_failed(const efa_wire *w, int rc, const char *what, char *err, size_t errlen) {
    if (rc < 0 && err && errlen) {
        size_t n = strlen(err);
        if (n < errlen)
            snprintf(err + n, errlen - n, " [%s %s, round %lld]", op_name(w->op), what,
                     (long long)w->seq);
    }
    return rc;
}

static int timed_wait(efa_wire *w, uint32_t msg, int n, const char *what, char *err, size_t errlen) {
    uint64_t t0 = now_ns();
    int rc = efa_wait_counters(w->engine, msg, n, w->wait_srcs, w->wait_expected, 1,
                               (int)w->timeout_ms, err, errlen);
    w->wait_ns += (int64_t)(now_ns() - t0);
    return wait_failed(w, rc, what, err, errlen);
}

static int64_t message_writes(const efa_wire *w, const int64_t *sizes, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += cdiv(sizes[i], w->chunk_bytes);
    return c;
}

int efa_wire_begin(efa_wire *w, int post_headers, char *err, size_t errlen) {
    const int64_t W = w->world, me = w->rank, F = w->hdr_fields;
    if (w->nplanes < 0 || w->nplanes > EFA_MAX_PLANES || w->max_msgs < W * (EFA_MAX_PLANES + 1)) {
        set_err(err, errlen, "rank %lld: round with %lld planes (at most %d) or message scratch "
                  "of %lld too small", (long long)me, (long long)w->nplanes, EFA_MAX_PLANES,
                  (long long)w->max_msgs);
        return -EINVAL;
    }
    w->r_writes = w->r_wire_bytes = w->r_messages = w->r_rows = 0;
    w->nmsgs = 0;
    w->bad_peer = -1;
    int rc = copies_ready(w, err, errlen);
    if (rc) return rc;
    /* our previous writes must have left the send side before it is rewritten */
    uint64_t t0 = now_ns();
    rc = efa_wait_idle(w->engine, (int)w->timeout_ms, err, errlen);
    w->wait_ns += (int64_t)(now_ns() - t0);
    if (rc) return wait_failed(w, rc, "send side", err, errlen);
    /* from here on, a peer's message of another round is an error */
    efa_engine_expect(w->engine, (uint32_t)w->seq);

    const int ok = w->status == 0;
    /* 1. headers: also the "my window is free" handshake and the status carrier (built in the
     * stage when the window is reached through copies; efa_wire_post_headers copies them up) */
    uint8_t *hdrs = w->window_kind ? stage_hdr_send(w) : w->window + w->off_hdr_send;
    for (int64_t d = 0; d < W; d++) {
        if (d == me) continue;
        int64_t *h = (int64_t *)(hdrs + d * w->hdr_bytes);
        memset(h, 0, (size_t)w->hdr_len);
        h[H_STATUS] = w->status;
        h[H_OP] = w->op;
        h[H_ROW_BYTES] = w->row_bytes;
        h[H_TAG] = w->tag;
        h[H_FORMAT] = w->fmt;
        if (ok) {
            h[H_ROWS] = w->rows_to[d];
            h[H_CHUNKS] = data_chunks(w, w->rows_to[d]);
            if (w->extras)
                memcpy(h + EFA_HDR_FIXED, w->extras + d * w->num_extra, (size_t)w->num_extra * 8);
        }
        (void)F;
    }

    /* 2. the send area: plane p of every destination in rank order, then the footers */
    int64_t *plan = w->plan;
    for (int64_t i = 0; i < (EFA_MAX_PLANES + 1) * W; i++) plan[i] = -1;
    int64_t cur = w->off_data_send;
    for (int64_t p = 0; p < w->nplanes && ok; p++) {
        for (int64_t d = 0; d < W; d++) {
            int64_t n = w->rows_to[d];
            if (d == me || n <= 0) continue;
            if (n > w->max_rows) {
                set_err(err, errlen, "rank %lld: %lld rows to rank %lld exceed the capacity %lld",
                          (long long)me, (long long)n, (long long)d, (long long)w->max_rows);
                return -EINVAL;
            }
            cur = align16(cur);
            plan[p * W + d] = cur;
            cur += n * w->widths[p];
        }
    }
    cur = align16(cur);
    for (int64_t d = 0, nf = 0; d < W && ok; d++) {
        if (d == me || w->rows_to[d] <= 0) continue;
        if (w->window_kind) { /* staged footers go up with the headers, in destination order */
            int64_t *f = (int64_t *)(stage_foot_send(w) + FOOTER_BYTES * nf++);
            f[0] = w->rows_to[d];
            f[1] = w->tag;
        }
        plan[EFA_MAX_PLANES * W + d] = cur;
        cur += FOOTER_BYTES;
    }
    if (cur > w->off_data_send + w->send_bytes) {
        set_err(err, errlen, "rank %lld: a round of %lld bytes exceeds the send area of %lld bytes",
                  (long long)me, (long long)(cur - w->off_data_send), (long long)w->send_bytes);
        return -EINVAL;
    }

    /* 3. the data messages: per destination its planes, then its footer (as the receiver reads
     * them: planes 16-byte aligned from its region of the destination's window) */
    int64_t *dests = w->msgs, *loffs = w->msgs + w->max_msgs, *roffs = w->msgs + 2 * w->max_msgs,
            *sizes = w->msgs + 3 * w->max_msgs;
    int64_t m = 0, rbase = data_recv_off(w, me);
    for (int64_t d = 0; d < W && ok; d++) {
        int64_t n = w->rows_to[d];
        if (d == me || n <= 0) continue;
        int64_t roff = rbase;
        for (int64_t p = 0; p < w->nplanes; p++) {
            int64_t nb = n * w->widths[p];
            if (nb > 0) {
                dests[m] = d;
                loffs[m] = plan[p * W + d];
                roffs[m] = roff;
                sizes[m] = nb;
                m++;
            }
            roff += align16(nb);
        }
        dests[m] = d;
        loffs[m] = plan[EFA_MAX_PLANES * W + d];
        roffs[m] = roff;
        sizes[m] = FOOTER_BYTES;
        m++;
        w->r_messages++;
        w->r_rows += n;
    }
    w->nmsgs = m;

    /* header messages (the round's parity picks the peer's header slot) */
    int64_t *hd = w->hmsgs, *hl = w->hmsgs + W, *hr = w->hmsgs + 2 * W, *hs = w->hmsgs + 3 * W;
    int64_t nh = 0;
    for (int64_t d = 0; d < W; d++) {
        if (d == me) continue;
        hd[nh] = d;
        hl[nh] = w->off_hdr_send + d * w->hdr_bytes;
        hr[nh] = hdr_recv_off(w, me, w->seq);
        hs[nh] = w->hdr_len;
        nh++;
    }
    return post_headers ? efa_wire_post_headers(w, err, errlen) : 0;
}

int efa_wire_post_headers(efa_wire *w, char *err, size_t errlen) {
    const int64_t W = w->world;
    if (W < 2) return 0;
    if (w->window_kind) {
        /* the staged headers and footers up; the stream's sync also orders the caller's earlier
         * reads of the receive side before the headers let peers overwrite it */
        int rc = to_window(w, w->off_hdr_send, stage_hdr_send(w), W * w->hdr_bytes, err, errlen);
        int64_t first = -1, nf = 0;
        for (int64_t d = 0; d < W; d++) {
            int64_t off = w->plan[EFA_MAX_PLANES * W + d];
            if (off < 0) continue;
            if (first < 0) first = off;
            nf++;
        }
        if (!rc && nf) rc = to_window(w, first, stage_foot_send(w), nf * FOOTER_BYTES, err, errlen);
        if (!rc) rc = window_sync(w, "headers and footers", err, errlen);
        if (rc) return rc;
    }
    int64_t *hd = w->hmsgs, *hl = w->hmsgs + W, *hr = w->hmsgs + 2 * W, *hs = w->hmsgs + 3 * W;
    uint32_t msg = (uint32_t)(2 * w->seq) & EFA_IMM_MSG_MASK;
    int rc = efa_post_messages(w->engine, msg, 0, (int)(W - 1), hd, hl, hr, hs,
                               (uint32_t)w->chunk_bytes,
                               w->next_channel, (int)w->timeout_ms, err, errlen);
    if (rc) return rc;
    w->r_writes += message_writes(w, hs, W - 1);
    w->r_wire_bytes += (W - 1) * w->hdr_len;
    return 0;
}

int efa_wire_exchange(efa_wire *w, int post_data, char *err, size_t errlen) {
    const int64_t W = w->world, me = w->rank, F = w->hdr_fields;
    uint32_t msg = (uint32_t)(2 * w->seq) & EFA_IMM_MSG_MASK;
    int n = 0;
    for (int64_t r = 0; r < W; r++) {
        if (r == me) continue;
        w->wait_srcs[n] = (int32_t)r;
        w->wait_expected[n] = (uint64_t)w->hdr_chunks;
        n++;
    }
    if (n) {
        int rc = timed_wait(w, msg, n, "headers", err, errlen);
        if (rc) return rc;
    }
    /* through copies: every peer's header with its text into the stage; the sync also waits
     * for the caller's packing kernels, queued on the stream before it */
    if (w->window_kind) {
        for (int64_t r = 0; r < W; r++) {
            if (r == me) continue;
            int rc = from_window(w, stage_hdr_recv(w) + r * w->hdr_len, hdr_recv_off(w, r, w->seq),
                                 w->hdr_len, err, errlen);
            if (rc) return rc;
        }
        int rc = window_sync(w, "peers' headers", err, errlen);
        if (rc) return rc;
    }
    /* a copy of every peer's header: what the caller reads (the error texts stay in the window,
     * or the stage) */
    for (int64_t r = 0; r < W; r++) {
        int64_t *g = w->got + r * F;
        if (r == me) {
            memset(g, 0, (size_t)F * 8);
            continue;
        }
        memcpy(g, w->window_kind ? stage_hdr_recv(w) + r * w->hdr_len
                                 : w->window + hdr_recv_off(w, r, w->seq), (size_t)F * 8);
    }
    int rc = efa_wire_check_headers(w, err, errlen);
    if (rc) return rc; /* nothing posted */
    /* footers: [rows, round tag], checked by the receiver against the header (staged ones went
     * up with the headers) */
    for (int64_t d = 0; d < W && !w->window_kind; d++) {
        int64_t off = w->plan[EFA_MAX_PLANES * W + d];
        if (d == me || off < 0) continue;
        int64_t *f = (int64_t *)(w->window + off);
        f[0] = w->rows_to[d];
        f[1] = w->tag;
    }
    return post_data ? efa_wire_post_data(w, err, errlen) : 0;
}

int efa_wire_post_data(efa_wire *w, char *err, size_t errlen) {
    if (!w->nmsgs) return 0;
    int64_t *dests = w->msgs, *loffs = w->msgs + w->max_msgs, *roffs = w->msgs + 2 * w->max_msgs,
            *sizes = w->msgs + 3 * w->max_msgs;
    uint32_t msg = (uint32_t)(2 * w->seq + 1) & EFA_IMM_MSG_MASK;
    int rc = efa_post_messages(w->engine, msg, 0, (int)w->nmsgs, dests, loffs, roffs, sizes,
                               (uint32_t)w->chunk_bytes, w->next_channel, (int)w->timeout_ms, err,
                               errlen);
    if (rc) return rc;
    w->r_writes += message_writes(w, sizes, w->nmsgs);
    for (int64_t i = 0; i < w->nmsgs; i++) w->r_wire_bytes += sizes[i];
    return 0;
}

int efa_wire_finish(efa_wire *w, char *err, size_t errlen) {
    const int64_t W = w->world, me = w->rank;
    uint32_t msg = (uint32_t)(2 * w->seq + 1) & EFA_IMM_MSG_MASK;
    int n = 0;
    for (int64_t r = 0; r < W; r++) {
        if (r == me || w->rows_from[r] <= 0) continue;
        w->wait_srcs[n] = (int32_t)r;
        w->wait_expected[n] = (uint64_t)data_chunks(w, w->rows_from[r]);
        n++;
    }
    if (n) {
        int rc = timed_wait(w, msg, n, "data", err, errlen);
        if (rc) return rc;
    }
    for (int i = 0; i < n && w->window_kind; i++) { /* through copies: the footers to the stage */
        int64_t r = w->wait_srcs[i], rows = w->rows_from[r], off = data_recv_off(w, r);
        for (int64_t p = 0; p < w->nplanes; p++) off += align16(rows * w->widths[p]);
        int rc = from_window(w, stage_foot_recv(w) + r * FOOTER_BYTES, off, FOOTER_BYTES, err,
                             errlen);
        if (rc) return rc;
    }
    if (n && w->window_kind) {
        int rc = window_sync(w, "peers' footers", err, errlen);
        if (rc) return rc;
    }
    for (int i = 0; i < n; i++) {
        int64_t r = w->wait_srcs[i], rows = w->rows_from[r], off = data_recv_off(w, r);
        for (int64_t p = 0; p < w->nplanes; p++) off += align16(rows * w->widths[p]);
        const int64_t *f = (const int64_t *)(w->window_kind ? stage_foot_recv(w) + r * FOOTER_BYTES
                                                            : w->window + off);
        if (f[0] != rows || f[1] != w->tag) {
            w->bad_peer = r;
            set_err(err, errlen, "rank %lld: protocol violation: rank %lld's %s data says %lld "
                      "rows (round tag %#llx), its header %lld rows (tag %#llx)", (long long)me,
                      (long long)r, op_name(w->op), (long long)f[0], (unsigned long long)f[1],
                      (long long)rows, (unsigned long long)w->tag);
            return -EPROTO;
        }
    }
    return 0;
}

/* The checks of the peers' headers in w->got (efa_proxy.h), in the order every rank applies
 * them, so that every rank raises the same error from the same headers. */
int efa_wire_check_headers(efa_wire *w, char *err, size_t errlen) {
    const int64_t W = w->world, me = w->rank, F = w->hdr_fields;
    const char *what = op_name(w->op);
    int bad_input = w->status != 0;
    for (int64_t r = 0; r < W; r++) {
        w->rows_from[r] = 0;
        if (r == me) continue;
        const int64_t st = w->got[r * F + H_STATUS];
        if (st == EFA_STATUS_BAD_INPUT) {
            bad_input = 1;
        } else if (st != 0) {
            set_err(err, errlen, "rank %lld: protocol violation: rank %lld's %s header has status "
                      "%lld", (long long)me, (long long)r, what, (long long)st);
            return -EPROTO;
        }
    }
    if (bad_input) return EFA_RC_GROUP_INPUT; /* the texts are in the window: the caller joins them */
    for (int64_t r = 0; r < W; r++) {
        const int64_t *g = w->got + r * F;
        if (r != me && g[H_TAG] != w->tag) {
            set_err(err, errlen, "rank %lld: protocol violation: rank %lld's %s header carries "
                      "round tag %#llx, expected %#llx (a stale or replayed header)", (long long)me,
                      (long long)r, what, (unsigned long long)g[H_TAG], (unsigned long long)w->tag);
            return -EPROTO;
        }
    }
    int same = 1;
    for (int64_t r = 0; r < W; r++) {
        const int64_t *g = w->got + r * F;
        if (r != me && (g[H_OP] != w->op || g[H_ROW_BYTES] != w->row_bytes || g[H_FORMAT] != w->fmt))
            same = 0;
    }
    if (!same) {
        size_t n = 0;
        set_err(err, errlen, "proxy: ranks are in different operations or row formats: ");
        for (int64_t r = 0; r < W && err && (n = strlen(err)) < errlen; r++) {
            const int64_t *g = w->got + r * F;
            int64_t op = r == me ? w->op : g[H_OP], rb = r == me ? w->row_bytes : g[H_ROW_BYTES],
                    fm = r == me ? w->fmt : g[H_FORMAT];
            if (op >= 1 && op <= 3)
                snprintf(err + n, errlen - n, "%srank %lld: %s %lld bytes/row format %lld", r ? ", " : "",
                         (long long)r, op_name(op), (long long)rb, (long long)fm);
            else
                snprintf(err + n, errlen - n, "%srank %lld: %lld %lld bytes/row format %lld", r ? ", " : "",
                         (long long)r, (long long)op, (long long)rb, (long long)fm);
        }
        if (err && (n = strlen(err)) < errlen)
            snprintf(err + n, errlen - n, "; every rank must call the same operations in order with "
                     "rows of one dtype and width");
        return EFA_RC_GROUP_MISMATCH;
    }
    for (int64_t r = 0; r < W; r++) {
        const int64_t *g = w->got + r * F;
        if (r == me) continue;
        const int64_t rows = g[H_ROWS], ch = g[H_CHUNKS];
        if (rows < 0 || rows > w->max_rows) {
            set_err(err, errlen, "rank %lld: protocol violation: rank %lld declares %lld %s rows; "
                      "capacity is 0..%lld (max_tokens_per_rank)", (long long)me, (long long)r,
                      (long long)rows, what, (long long)w->max_rows);
            return -EPROTO;
        }
        if (ch != data_chunks(w, rows)) {
            set_err(err, errlen, "rank %lld: protocol violation: rank %lld declares %lld %s rows in "
                      "%lld chunks; %lld rows of %lld bytes are %lld chunks", (long long)me,
                      (long long)r, (long long)rows, what, (long long)ch, (long long)rows,
                      (long long)w->row_bytes, (long long)data_chunks(w, rows));
            return -EPROTO;
        }
    }
    if (w->n_recv) {
        char a[160] = "", b[160] = "", c[160] = "";
        size_t pa = 0, pb = 0, pc = 0;
        int bad = 0;
        for (int64_t r = 0; r < W; r++) {
            const int64_t rows = w->got[r * F + H_ROWS];
            if (r == me || rows == w->n_recv[r]) continue;
            if (pa < sizeof a - 48) {
                const char *sep = bad ? ", " : "";
                pa += (size_t)snprintf(a + pa, sizeof a - pa, "%s%lld", sep, (long long)r);
                pb += (size_t)snprintf(b + pb, sizeof b - pb, "%s%lld", sep, (long long)rows);
                pc += (size_t)snprintf(c + pc, sizeof c - pc, "%s%lld", sep, (long long)w->n_recv[r]);
            }
            bad = 1;
        }
        if (bad) {
            set_err(err, errlen, "rank %lld: %s: ranks [%s] send [%s] rows, the handle expects "
                      "[%s]; handles from different dispatches?", (long long)me, what, a, b, c);
            return EFA_RC_HANDLE_MISMATCH;
        }
    }
    for (int64_t r = 0; r < W; r++) w->rows_from[r] = r == me ? 0 : w->got[r * F + H_ROWS];
    return 0;
}
