/* efa_bench.c: benchmark entry points of the native proxy, written against the public ABI of
 * efa_proxy.h only (the engine itself is in efa_proxy.c). The caller thread is the producer, so
 * no Python runs between operations; see efa_proxy.h for what each entry point measures.
 *
 * Build: part of libefa_proxy.so (cc ... efa_proxy.c efa_bench.c ...).
 */
#define _GNU_SOURCE
#include "efa_proxy.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static uint64_t bench_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void bench_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static uint64_t make_w0(int dest, uint32_t msg, uint32_t len) {
    return ((uint64_t)dest << 52) | ((uint64_t)(msg & ((1u << EFA_MSG_BITS) - 1)) << 32) | len;
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
        bench_err(err, errlen, "len %u > half the window (%llu)", len, (unsigned long long)half);
        return -EINVAL;
    }
    for (int i = 0; i < iters; i++) {
        uint32_t msg = msg0 + (uint32_t)i;
        uint64_t d[2] = {make_w0(rank, msg, len), ((uint64_t)0 << 32) | (half >> 4)};
        int32_t src = rank;
        uint64_t one = 1;
        uint64_t t0 = bench_now_ns();
        rc = efa_ring_push(handle, ch, d, 1, timeout_ms, err, errlen);
        if (!rc) rc = efa_wait_counters(handle, msg, 1, &src, &one, 1, timeout_ms, err, errlen);
        if (rc) return rc;
        out_ns[i] = bench_now_ns() - t0;
    }
    return 0;
}

int efa_bench_rate(uint64_t handle, int nch, uint32_t n, uint32_t len, uint32_t msg,
                   uint64_t *out_ns, int timeout_ms, char *err, size_t errlen) {
    int rank = 0, num_channels = 0;
    uint32_t ring_slots = 0;
    uint64_t window_bytes = 0;
    int rc = efa_engine_query(handle, &rank, &num_channels, &ring_slots, &window_bytes);
    if (rc) return rc;
    if (nch < 1 || nch > num_channels) {
        bench_err(err, errlen, "nch=%d must be in 1..%d", nch, num_channels);
        return -EINVAL;
    }
    uint64_t half = (window_bytes / 2) & ~15ull;
    uint64_t stride = ((uint64_t)len + 15) & ~15ull;
    uint32_t per_ring = n < ring_slots ? n : ring_slots;
    uint64_t *d = malloc(sizeof(uint64_t) * 2 * per_ring);
    if (!d) return -ENOMEM;
    uint64_t t0 = bench_now_ns();
    /* fill rings round robin in batches so every channel thread works at the same time */
    uint32_t done = 0;
    rc = 0;
    while (done < n && !rc) {
        uint32_t b = n - done < per_ring / 2 + 1 ? n - done : per_ring / 2 + 1;
        if (b > per_ring) b = per_ring;
        for (int c = 0; c < nch && !rc; c++) {
            for (uint32_t i = 0; i < b; i++) {
                uint64_t off = (stride * (uint64_t)((done + i) % 64)) % (half ? half : 16);
                d[2 * i] = make_w0(rank, msg, len);
                d[2 * i + 1] = ((off >> 4) << 32) | ((half + off) >> 4);
            }
            rc = efa_ring_push(handle, c, d, b, timeout_ms, err, errlen);
        }
        done += b;
    }
    free(d);
    if (rc) return rc;
    int32_t src = rank;
    uint64_t expect = (uint64_t)n * (uint64_t)nch;
    rc = efa_wait_counters(handle, msg, 1, &src, &expect, 1, timeout_ms, err, errlen);
    *out_ns = bench_now_ns() - t0;
    return rc;
}
