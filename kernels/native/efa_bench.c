/* efa_bench.c: benchmark entry points of the native proxy, written against the public ABI of
 * efa_proxy.h only (the engine itself is in efa_proxy.c). The caller thread is the producer, so
 * no Python runs between operations; see efa_proxy.h for what each entry point measures.
 *
 * Build: part of libefa_proxy.so (cc ... efa_proxy.c efa_bench.c ...).
 */
#define _GNU_SOURCE
#include "efa_proxy.h"
#include "efa_util.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


static uint64_t make_w0(int dest, uint32_t msg, uint32_t len) {
    return ((uint64_t)dest << 52) | ((uint64_t)(msg & EFA_IMM_MSG_MASK) << 32) | len;
}

int efa_bench_roundtrip(uint64_t handle, int ch, uint32_t len, uint32_t msg0, int iters,
                        uint64_t *out_ns, int timeout_ms, char *err, size_t errlen) {
    int rank = 0;
    uint64_t window_bytes = 0;
    int rc = efa_engine_query(handle, &rank, NULL, NULL, &window_bytes);
    if (rc) return rc;
    /* source and target both at window offset 0 / window_bytes/2: a write to ourselves */
    uint64_t half = (window_bytes / 2) & ~15ull;
    if (len > half) {
        set_err(err, errlen, "len %u > half the window (%llu)", len, (unsigned long long)half);
        return -EINVAL;
    }
    for (int i = 0; i < iters; i++) {
        uint32_t msg = msg0 + (uint32_t)i;
        uint64_t d[2] = {make_w0(rank, msg, len), ((uint64_t)0 << 32) | (half >> 4)};
        int32_t src = rank;
        uint64_t one = 1;
        uint64_t t0 = now_ns();
        rc = efa_ring_push(handle, ch, d, 1, timeout_ms, err, errlen);
        if (!rc) rc = efa_wait_counters(handle, msg, 1, &src, &one, 1, timeout_ms, err, errlen);
        if (rc) return rc;
        out_ns[i] = now_ns() - t0;
    }
    return 0;
}

/* One producer thread per channel (so the bench measures the channels, not one producer thread
 * filling every ring): thread c pushes n descriptors into ring c in batches, with back-pressure. */
typedef struct {
    uint64_t handle;
    int ch;
    uint32_t n, len, msg, ring_slots;
    uint64_t half;
    int timeout_ms;
    int rc;
    char err[256];
} rate_producer;

static void *rate_produce(void *arg) {
    rate_producer *p = (rate_producer *)arg;
    int rank = 0;
    efa_engine_query(p->handle, &rank, NULL, NULL, NULL);
    uint64_t stride = ((uint64_t)p->len + 15) & ~15ull;
    uint32_t per_push = p->ring_slots / 2 + 1;
    if (per_push > p->ring_slots) per_push = p->ring_slots;
    uint64_t *d = malloc(sizeof(uint64_t) * 2 * per_push);
    if (!d) {
        p->rc = -ENOMEM;
        return NULL;
    }
    uint32_t done = 0;
    while (done < p->n && !p->rc) {
        uint32_t b = p->n - done < per_push ? p->n - done : per_push;
        for (uint32_t i = 0; i < b; i++) {
            /* each channel writes its own 64 targets: channels never touch the same bytes */
            uint64_t off = (stride * (uint64_t)(((done + i) % 64) + 64 * (uint64_t)p->ch)) % (p->half ? p->half : 16);
            d[2 * i] = make_w0(rank, p->msg, p->len);
            d[2 * i + 1] = ((off >> 4) << 32) | ((p->half + off) >> 4);
        }
        p->rc = efa_ring_push(p->handle, p->ch, d, b, p->timeout_ms, p->err, sizeof p->err);
        done += b;
    }
    free(d);
    return NULL;
}

int efa_bench_rate(uint64_t handle, int nch, uint32_t n, uint32_t len, uint32_t msg,
                   uint64_t *out_ns, int timeout_ms, char *err, size_t errlen) {
    int rank = 0, num_channels = 0;
    uint32_t ring_slots = 0;
    uint64_t window_bytes = 0;
    int rc = efa_engine_query(handle, &rank, &num_channels, &ring_slots, &window_bytes);
    if (rc) return rc;
    if (nch < 1 || nch > num_channels) {
        set_err(err, errlen, "nch=%d must be in 1..%d", nch, num_channels);
        return -EINVAL;
    }
    rate_producer p[64];
    pthread_t th[64];
    int started = 0;
    uint64_t t0 = now_ns();
    for (int c = 0; c < nch; c++) {
        memset(&p[c], 0, sizeof p[c]);
        p[c].handle = handle;
        p[c].ch = c;
        p[c].n = n;
        p[c].len = len;
        p[c].msg = msg;
        p[c].ring_slots = ring_slots;
        p[c].half = (window_bytes / 2) & ~15ull;
        p[c].timeout_ms = timeout_ms;
        if (pthread_create(&th[c], NULL, rate_produce, &p[c])) {
            set_err(err, errlen, "pthread_create for producer %d failed", c);
            rc = -EAGAIN;
            break;
        }
        started++;
    }
    for (int c = 0; c < started; c++) pthread_join(th[c], NULL);
    for (int c = 0; c < started && !rc; c++)
        if (p[c].rc) {
            set_err(err, errlen, "producer of channel %d: %s", c, p[c].err);
            rc = p[c].rc;
        }
    if (rc) return rc;
    /* every channel counts its own arrivals (per-channel counters); the wait sums them */
    int32_t src = rank;
    uint64_t expect = (uint64_t)n * (uint64_t)nch;
    rc = efa_wait_counters(handle, msg, 1, &src, &expect, 1, timeout_ms, err, errlen);
    *out_ns = now_ns() - t0;
    return rc;
}
