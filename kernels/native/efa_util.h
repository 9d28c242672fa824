/* efa_util.h: the small helpers every source of libefa_proxy and of the launch library shares
 * (the monotonic clock, the error-text setter, 16-byte alignment). Internal; not part of either
 * ABI (efa_proxy.h, efa_launch.h). */
#ifndef EFA_UTIL_H
#define EFA_UTIL_H
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Writes the formatted message into err[errlen] (a caller may pass no buffer). */
static inline void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static inline int64_t align16(int64_t n) { return (n + 15) & ~(int64_t)15; }

#endif
