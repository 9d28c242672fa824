/* efa_host.c: host-side data path helpers of the proxy transport (plain C over caller memory, no
 * engine, no libfabric): the routing layout of a dispatch, the unpacking and validation of the
 * routing rows it receives, and combine's fused reduction. Each replaces a chain of small torch
 * ops (kernels/base.py compute_send_layout, the transport's metadata checks, reduce_rows_by_rank
 * followed by a dtype cast) and matches it bit for bit; see efa_proxy.h for the contracts.
 *
 * Build: part of libefa_proxy.so (cc ... efa_host.c ...).
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3")
#endif
#include "efa_proxy.h"

#include <errno.h>
#include <math.h>
#include <string.h>

static inline int64_t float_bits(float f) {
    int32_t b;
    memcpy(&b, &f, 4);
    return (int64_t)b; /* sign-extended, as kernels/base.py float_bits_to_int64 */
}

static inline float bits_float(int64_t v) {
    int32_t b = (int32_t)(uint32_t)(uint64_t)v; /* the low 32 bits, as int64_to_float_bits */
    float f;
    memcpy(&f, &b, 4);
    return f;
}

int64_t efa_route_layout(const int64_t *topk_idx, const float *weights, int64_t T, int64_t K,
                         int64_t E, int64_t W, int64_t *send_idx, int64_t *meta, int64_t cap,
                         int64_t *num_send, int64_t *counts, int64_t *scratch, int64_t *flags) {
    int64_t f = 0;
    for (int64_t i = 0; i < T * K; i++) {
        int64_t e = topk_idx[i];
        if (e < -1 || e >= E) f |= 1;
        if (!isfinite(weights[i])) f |= 2;
    }
    *flags = f;
    if (f) return -1;
    const int64_t L = E / W;
    int64_t *stamp = scratch, *cursor = scratch + W;
    for (int64_t r = 0; r < W; r++) {
        num_send[r] = 0;
        stamp[r] = -1;
    }
    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    /* pass 1: rows per rank (a token once per rank), (token, expert) pairs per expert */
    for (int64_t t = 0; t < T; t++) {
        for (int64_t k = 0; k < K; k++) {
            int64_t e = topk_idx[t * K + k];
            if (e < 0) continue;
            int64_t r = e / L;
            counts[e]++;
            if (stamp[r] != t) {
                stamp[r] = t;
                num_send[r]++;
            }
        }
    }
    int64_t S = 0;
    for (int64_t r = 0; r < W; r++) {
        cursor[r] = S;
        S += num_send[r];
        stamp[r] = -1;
    }
    if (S > cap) return -ENOSPC;
    /* pass 2: tokens ascending, so each rank's block is in token order */
    for (int64_t t = 0; t < T; t++) {
        const int64_t *ids = topk_idx + t * K;
        for (int64_t k = 0; k < K; k++) {
            int64_t e = ids[k];
            if (e < 0) continue;
            int64_t r = e / L;
            if (stamp[r] == t) continue;
            stamp[r] = t;
            int64_t pos = cursor[r]++;
            send_idx[pos] = t;
            int64_t *m = meta + pos * 2 * K;
            for (int64_t kk = 0; kk < K; kk++) {
                int64_t ee = ids[kk];
                if (ee >= 0 && ee / L == r) {
                    m[kk] = ee - r * L;
                    m[K + kk] = float_bits(weights[t * K + kk]);
                } else {
                    m[kk] = -1;
                    m[K + kk] = 0;
                }
            }
        }
    }
    return S;
}

int64_t efa_unpack_meta(int64_t W, int64_t K, int64_t L, const int64_t *src_meta, const int64_t *n,
                        const int64_t *check, const int64_t *hdr_counts, int64_t hdr_stride,
                        int64_t *out_idx, float *out_w, int64_t *tokens_per_expert,
                        int64_t *scratch, int64_t *kind) {
    int64_t row = 0;
    *kind = 0;
    for (int64_t e = 0; e < L; e++) tokens_per_expert[e] = 0;
    for (int64_t r = 0; r < W; r++) {
        const int64_t *m = (const int64_t *)(uintptr_t)src_meta[r];
        const int64_t nr = n[r];
        if (check[r]) {
            int64_t bad = 0;
            for (int64_t e = 0; e < L; e++) scratch[e] = 0;
            for (int64_t i = 0; i < nr && !bad; i++) {
                const int64_t *ids = m + i * 2 * K, *wb = ids + K;
                int any = 0;
                for (int64_t k = 0; k < K; k++) {
                    int64_t id = ids[k];
                    if (id < -1 || id >= L) {
                        bad = 1;
                        break;
                    }
                    if (id >= 0) {
                        any = 1;
                        scratch[id]++;
                    } else if (wb[k] != 0) {
                        bad = 3;
                    }
                    if (!isfinite(bits_float(wb[k]))) bad = bad ? bad : 4;
                }
                if (!bad && !any) bad = 2;
            }
            if (!bad) {
                const int64_t *want = hdr_counts + r * hdr_stride;
                for (int64_t e = 0; e < L; e++)
                    if (scratch[e] != want[e]) bad = 5;
            }
            if (bad) {
                *kind = bad;
                return r;
            }
        }
        for (int64_t i = 0; i < nr; i++, row++) {
            const int64_t *ids = m + i * 2 * K, *wb = ids + K;
            for (int64_t k = 0; k < K; k++) {
                int64_t id = ids[k];
                out_idx[row * K + k] = id;
                out_w[row * K + k] = bits_float(wb[k]);
                if (id >= 0) tokens_per_expert[id]++;
            }
        }
    }
    return -1;
}

/* float -> bfloat16, round to nearest even (c10's round_to_nearest_even for non-NaN values) */
static inline uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#define RB 256 /* columns per block: the accumulator stays in registers / L1 */

/* The reduction's loops vectorize; an AVX2 clone (chosen at load time where the CPU has it)
 * runs about 2x faster than the baseline SSE2 code. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define EFA_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef EFA_CLONES
#define EFA_CLONES
#endif

EFA_CLONES int efa_reduce_rows(int64_t W, int64_t T, int64_t D, int64_t in_dtype, int64_t out_dtype,
                    const int64_t *rows, const int64_t *n, const int64_t *idx, int32_t *slot,
                    void *out) {
    if ((in_dtype != EFA_DT_F32 && in_dtype != EFA_DT_BF16) ||
        (out_dtype != EFA_DT_F32 && out_dtype != EFA_DT_BF16))
        return -EINVAL;
    for (int64_t i = 0; i < W * T; i++) slot[i] = -1;
    for (int64_t r = 0; r < W; r++) {
        const int64_t *ix = (const int64_t *)(uintptr_t)idx[r];
        for (int64_t j = 0; j < n[r]; j++) {
            int64_t t = ix[j];
            if (t < 0 || t >= T || slot[r * T + t] >= 0) return -EINVAL;
            slot[r * T + t] = (int32_t)j;
        }
    }
    const size_t esz = in_dtype == EFA_DT_F32 ? 4 : 2;
    int nan = 0;
    float acc[RB];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t c0 = 0; c0 < D; c0 += RB) {
            const int64_t m = D - c0 < RB ? D - c0 : RB;
            for (int64_t c = 0; c < m; c++) acc[c] = 0.0f;
            for (int64_t r = 0; r < W; r++) {
                int32_t j = slot[r * T + t];
                if (j < 0) continue;
                const char *src = (const char *)(uintptr_t)rows[r] + ((size_t)j * (size_t)D + (size_t)c0) * esz;
                if (in_dtype == EFA_DT_BF16) {
                    const uint16_t *s = (const uint16_t *)src;
                    for (int64_t c = 0; c < m; c++) {
                        uint32_t u = (uint32_t)s[c] << 16;
                        float v;
                        memcpy(&v, &u, 4);
                        acc[c] += v;
                    }
                } else {
                    const float *s = (const float *)src;
                    for (int64_t c = 0; c < m; c++) acc[c] += s[c];
                }
            }
            int bad = 0;
            for (int64_t c = 0; c < m; c++) bad |= acc[c] != acc[c];
            nan |= bad;
            if (out_dtype == EFA_DT_BF16) {
                uint16_t *o = (uint16_t *)out + (size_t)t * (size_t)D + (size_t)c0;
                for (int64_t c = 0; c < m; c++) o[c] = f32_bf16(acc[c]);
            } else {
                float *o = (float *)out + (size_t)t * (size_t)D + (size_t)c0;
                memcpy(o, acc, (size_t)m * 4);
            }
        }
    }
    return nan ? 1 : 0;
}
