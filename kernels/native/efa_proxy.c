/* efa_proxy.c: K channel threads, command rings, libfabric RDM wire, arrival counters.
 * See efa_proxy.h for the memory the caller owns, the descriptor format and the protocol.
 *
 * Build: part of libefa_proxy.so (kernels/proxy/native.py SOURCES); a channel's endpoint is in
 * efa_endpoint.c, its thread's data path in efa_channel.c, the structures they share in
 * efa_engine.h (internal); the
 * benchmark entry points live in efa_bench.c, a client of the public ABI.
 *
 * Per channel thread, in this order (step(), efa_channel.c):
 *   1. commands : acquire the ring's tail, copy descriptors out, release the head (slots reusable);
 *   2. post     : fi_writedata each descriptor (bounded in flight; -FI_EAGAIN -> progress, retry);
 *   3. poll CQ  : local write completions free their context; remote completions (FI_REMOTE_CQ_DATA)
 *                 become arrivals (source, message) taken from the 32-bit immediate data;
 *   4. publish  : add arrivals to the counters (release), shuffled/delayed under fault injection.
 * Data-path failures become an engine error naming the verb, the peer and the message; every
 * waiter checks it, so nobody waits on a dead engine.
 */
#define _GNU_SOURCE
#include "efa_engine.h"

/* ---------------------------------------------------------------------------------------- */
int efa_abi_version(void) { return EFA_PROXY_ABI_VERSION; }

/* ---------------------------------------------------------------------------------------- */
static int wait_phase(engine *e, channel *c, int want, int timeout_ms, char *err, size_t errlen,
                      const char *what) {
    uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        int ph = atomic_load_explicit(&c->phase, memory_order_acquire);
        if (ph == want) return 0;
        if (ph == PH_FAILED || atomic_load(&e->failed)) {
            pthread_mutex_lock(&e->fail_mu);
            set_err(err, errlen, "%s", e->fail_msg);
            int code = atomic_load(&e->failed) ? e->fail_code : -EIO;
            pthread_mutex_unlock(&e->fail_mu);
            return code;
        }
        if (now_ns() > deadline) {
            set_err(err, errlen, "rank %d channel %d: timed out after %d ms waiting for the channel "
                                 "thread to %s", e->rank, c->idx, timeout_ms, what);
            return -ETIMEDOUT;
        }
        sleep_us(50);
    }
}

int efa_engine_create(const char *provider, int rank, int world, int num_channels, void *window,
                      uint64_t window_bytes, int hmem_cuda_device, uint64_t *rings,
                      uint32_t ring_slots, uint64_t *ring_ctrl, uint64_t *counters,
                      uint32_t num_slots, int max_inflight, int spin_us, int inject, uint64_t seed,
                      int cpu_base, int timeout_ms, uint64_t *out_handle, char *err, size_t errlen) {
    /* one region (the whole window), keys from the seed, provider's address, generation 0 */
    return efa_engine_create_ex(provider, rank, world, num_channels, window, window_bytes,
                                hmem_cuda_device, rings, ring_slots, ring_ctrl, counters, num_slots,
                                max_inflight, spin_us, inject, seed, cpu_base, timeout_ms, 0, 0,
                                splitmix64(seed), NULL, 0, out_handle, err, errlen);
}

int efa_engine_create_ex(const char *provider, int rank, int world, int num_channels, void *window,
                         uint64_t window_bytes, int hmem_cuda_device, uint64_t *rings,
                         uint32_t ring_slots, uint64_t *ring_ctrl, uint64_t *counters,
                         uint32_t num_slots, int max_inflight, int spin_us, int inject, uint64_t seed,
                         int cpu_base, int timeout_ms, uint64_t recv_off, uint64_t recv_stride,
                         uint64_t key_seed, const char *node, uint32_t gen, uint64_t *out_handle,
                         char *err, size_t errlen) {
    *out_handle = 0;
    if (world < 1 || world > EFA_MAX_RANKS || rank < 0 || rank >= world) {
        set_err(err, errlen, "rank=%d world=%d: need 0 <= rank < world <= %d", rank, world, EFA_MAX_RANKS);
        return -EINVAL;
    }
    if (num_channels < 1 || num_channels > 64 || ring_slots < 1 || num_slots < 1 || max_inflight < 1) {
        set_err(err, errlen, "num_channels=%d (1..64), ring_slots=%u, num_slots=%u, max_inflight=%d "
                             "must be positive", num_channels, ring_slots, num_slots, max_inflight);
        return -EINVAL;
    }
    if (((uintptr_t)window & 15) || window_bytes > (1ull << 36) || !rings || !ring_ctrl || !counters) {
        set_err(err, errlen, "window %p must be 16-byte aligned and <= 64 GiB (%llu bytes); rings, "
                             "ring_ctrl and counters must be given", window,
                (unsigned long long)window_bytes);
        return -EINVAL;
    }
    if (recv_stride && ((recv_off | recv_stride) & 15 || recv_off + (uint64_t)world * recv_stride > window_bytes)) {
        set_err(err, errlen, "receive regions [%llu + r * %llu) for %d ranks must be 16-byte aligned "
                             "and inside the window of %llu bytes", (unsigned long long)recv_off,
                (unsigned long long)recv_stride, world, (unsigned long long)window_bytes);
        return -EINVAL;
    }
    engine *e = calloc(1, sizeof(engine));
    if (!e) {
        set_err(err, errlen, "out of memory");
        return -ENOMEM;
    }
    snprintf(e->provider, sizeof e->provider, "%s", provider);
    e->rank = rank;
    e->world = world;
    e->num_channels = num_channels;
    e->window = (uint8_t *)window;
    e->window_bytes = window_bytes;
    e->ring_slots = ring_slots;
    e->num_slots = num_slots;
    e->counters = (_Atomic uint64_t *)counters;
    e->max_inflight = max_inflight;
    e->spin_us = spin_us < 0 ? 0 : spin_us;
    e->inject = inject;
    e->cpu_base = cpu_base;
    e->hmem_cuda_device = hmem_cuda_device < 0 ? -1 : hmem_cuda_device;
    e->recv_off = recv_stride ? recv_off : 0;
    e->recv_stride = recv_stride;
    e->num_regions = recv_stride ? world : 1;
    e->key_seed = key_seed;
    snprintf(e->node, sizeof e->node, "%s", node ? node : "");
    e->gen = gen & EFA_IMM_GEN_MASK;
    pthread_mutex_init(&e->fail_mu, NULL);
    e->ch = calloc((size_t)num_channels, sizeof(channel));
    if (!e->ch) {
        free(e);
        set_err(err, errlen, "out of memory");
        return -ENOMEM;
    }
    for (int i = 0; i < num_channels; i++) {
        channel *c = &e->ch[i];
        c->eng = e;
        c->idx = i;
        c->ring = (desc_t *)(rings + (size_t)i * ring_slots * 2);
        c->tail = (_Atomic uint64_t *)(ring_ctrl + (size_t)i * EFA_CTRL_STRIDE + EFA_CTRL_TAIL);
        c->head = (_Atomic uint64_t *)(ring_ctrl + (size_t)i * EFA_CTRL_STRIDE + EFA_CTRL_HEAD);
        c->local_head = atomic_load(c->head);
        c->rng = seed * 0x9E3779B97F4A7C15ull + (uint64_t)(rank * 131 + i + 1);
        c->peer_addr = calloc((size_t)world, sizeof(fi_addr_t));
        c->peer_key = calloc((size_t)world, sizeof(uint64_t));
        c->peer_base = calloc((size_t)world, sizeof(uint64_t));
        c->connected = calloc((size_t)world, 1);
    }
    *out_handle = (uint64_t)(uintptr_t)e;
    for (int i = 0; i < num_channels; i++) {
        if (pthread_create(&e->ch[i].thread, NULL, efa_channel_main, &e->ch[i])) {
            set_err(err, errlen, "pthread_create for channel %d failed", i);
            efa_engine_destroy(*out_handle);
            *out_handle = 0;
            return -EAGAIN;
        }
        e->ch[i].thread_started = 1;
    }
    for (int i = 0; i < num_channels; i++) {
        int rc = wait_phase(e, &e->ch[i], PH_READY, timeout_ms, err, errlen, "open its endpoint");
        if (rc) {
            efa_engine_destroy(*out_handle);
            *out_handle = 0;
            return rc;
        }
    }
    return 0;
}

int efa_engine_local_info(uint64_t handle, int ch, uint8_t *name, uint64_t *name_len, uint64_t *key,
                          uint64_t *base, char *err, size_t errlen) {
    engine *e = from_handle(handle);
    if (ch < 0 || ch >= e->num_channels) {
        set_err(err, errlen, "channel %d out of range (num_channels=%d)", ch, e->num_channels);
        return -EINVAL;
    }
    channel *c = &e->ch[ch];
    memset(name, 0, EFA_ADDR_MAX);
    memcpy(name, c->name, c->name_len);
    *name_len = c->name_len;
    int r = e->recv_stride ? e->rank : 0;
    *key = c->region_key[r];
    *base = c->region_base[r];
    return 0;
}

int efa_engine_region_info(uint64_t handle, int ch, int src, uint64_t *key, uint64_t *base,
                           char *err, size_t errlen) {
    engine *e = from_handle(handle);
    if (ch < 0 || ch >= e->num_channels || src < 0 || src >= e->world) {
        set_err(err, errlen, "channel %d / source %d out of range (num_channels=%d, world=%d)", ch,
                src, e->num_channels, e->world);
        return -EINVAL;
    }
    channel *c = &e->ch[ch];
    int r = e->recv_stride ? src : 0;
    *key = c->region_key[r];
    *base = c->region_base[r];
    return 0;
}

int efa_engine_expect(uint64_t handle, uint32_t seq) {
    engine *e = from_handle(handle);
    atomic_store_explicit(&e->expect_seq, seq, memory_order_release);
    atomic_store_explicit(&e->check_msgs, 1, memory_order_release);
    return 0;
}

int efa_engine_set_idle(uint64_t handle, int linger_us) {
    engine *e = from_handle(handle);
    e->linger_ns = linger_us > 0 ? (uint64_t)linger_us * 1000ull : 0;
    atomic_fetch_add_explicit(&e->wake_seq, 1, memory_order_release);
    syscall(SYS_futex, &e->wake_seq, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    return 0;
}

int efa_engine_set_marks(uint64_t handle, uint32_t *marks) {
    engine *e = from_handle(handle);
    e->marks = (_Atomic uint32_t *)marks;
    return 0;
}

int efa_engine_mark_whole(uint64_t handle, uint64_t seq) {
    engine *e = from_handle(handle);
    if (!e->marks) return 0;
    const uint32_t tag = efa_mark_tag(seq);
    for (int r = 0; r < e->world; r++)
        atomic_store_explicit(&e->marks[(size_t)r * EFA_MARKS + EFA_MARK_WHOLE], tag,
                              memory_order_release);
    return 0;
}

int efa_engine_tamper(uint64_t handle, int kind) {
    engine *e = from_handle(handle);
    atomic_store_explicit(&e->tamper_done, 0, memory_order_relaxed);
    atomic_store_explicit(&e->tamper, kind, memory_order_release);
    return 0;
}

int efa_engine_set_peers(uint64_t handle, int ch, const uint8_t *names, const uint64_t *name_lens,
                         const uint64_t *keys, const uint64_t *bases, int timeout_ms, char *err,
                         size_t errlen) {
    engine *e = from_handle(handle);
    if (ch < 0 || ch >= e->num_channels) {
        set_err(err, errlen, "channel %d out of range (num_channels=%d)", ch, e->num_channels);
        return -EINVAL;
    }
    channel *c = &e->ch[ch];
    for (int r = 0; r < e->world; r++) {
        c->peer_key[r] = keys[r];
        c->peer_base[r] = bases[r];
    }
    c->req_names = names;
    c->req_name_lens = name_lens;
    /* hand over: the thread inserts into its AV, then reports RUNNING */
    atomic_store_explicit(&c->phase, PH_PEERS_REQ, memory_order_release);
    int rc = wait_phase(e, c, PH_RUNNING, timeout_ms, err, errlen, "insert the peers' addresses");
    c->req_names = NULL;
    c->req_name_lens = NULL;
    return rc;
}

int efa_ring_wait_space(uint64_t handle, int ch, uint32_t n, int timeout_ms, char *err, size_t errlen) {
    engine *e = from_handle(handle);
    channel *c = &e->ch[ch];
    if (n > e->ring_slots) {
        set_err(err, errlen, "asked for %u free slots in a ring of %u", n, e->ring_slots);
        return -EINVAL;
    }
    uint64_t start = now_ns(), deadline = start + (uint64_t)timeout_ms * 1000000ull;
    /* the producer is the only writer of tail, so a relaxed load of our own index is exact */
    uint64_t tail = atomic_load_explicit(c->tail, memory_order_relaxed);
    for (;;) {
        uint64_t head = atomic_load_explicit(c->head, memory_order_acquire);
        if (e->ring_slots - (tail - head) >= n) return 0;
        int rc = engine_broken(e, err, errlen);
        if (rc) return rc;
        if (now_ns() > deadline) {
            set_err(err, errlen, "rank %d channel %d: ring full for %d ms (head %llu, tail %llu, %u "
                                 "slots): the channel thread is not consuming",
                    e->rank, ch, timeout_ms, (unsigned long long)head, (unsigned long long)tail,
                    e->ring_slots);
            return -ETIMEDOUT;
        }
        waiter_idle(e, start);
    }
}

int efa_ring_publish(uint64_t handle, int ch, uint64_t new_tail) {
    engine *e = from_handle(handle);
    /* release: every descriptor word written before this call is visible to the thread's acquire */
    atomic_store_explicit(e->ch[ch].tail, new_tail, memory_order_release);
    kick(e);
    return 0;
}

int efa_ring_push(uint64_t handle, int ch, const uint64_t *descs, uint32_t n, int timeout_ms,
                  char *err, size_t errlen) {
    engine *e = from_handle(handle);
    channel *c = &e->ch[ch];
    uint32_t done = 0;
    while (done < n) {
        uint32_t chunk = n - done < e->ring_slots ? n - done : e->ring_slots;
        int rc = efa_ring_wait_space(handle, ch, chunk, timeout_ms, err, errlen);
        if (rc) return rc;
        uint64_t tail = atomic_load_explicit(c->tail, memory_order_relaxed);
        for (uint32_t i = 0; i < chunk; i++) {
            desc_t *slot = &c->ring[(tail + i) % e->ring_slots];
            slot->w0 = descs[2 * (done + i)];
            slot->w1 = descs[2 * (done + i) + 1];
        }
        atomic_store_explicit(c->tail, tail + chunk, memory_order_release);
        kick(e);
        done += chunk;
    }
    return 0;
}

int efa_post_messages(uint64_t handle, uint32_t msg, uint32_t mark0, int n, const int64_t *dests,
                      const int64_t *local_offs, const int64_t *remote_offs, const int64_t *sizes,
                      uint32_t chunk_bytes, uint32_t *next_channel, int timeout_ms, char *err,
                      size_t errlen) {
    engine *e = from_handle(handle);
    int K = e->num_channels;
    if (chunk_bytes < 16 || chunk_bytes % 16) {
        set_err(err, errlen, "chunk_bytes=%u must be a positive multiple of 16", chunk_bytes);
        return -EINVAL;
    }
    for (int i = 0; i < n; i++) {
        if (dests[i] < 0 || dests[i] >= e->world || sizes[i] <= 0 || (local_offs[i] & 15) ||
            (remote_offs[i] & 15) || (uint64_t)local_offs[i] + (uint64_t)sizes[i] > e->window_bytes) {
            set_err(err, errlen, "rank %d: message %u, entry %d: dest %lld, local offset %lld, "
                                 "remote offset %lld, %lld bytes: expected a rank < %d, 16-byte "
                                 "aligned offsets and 0 < bytes within the %llu-byte window",
                    e->rank, msg, i, (long long)dests[i], (long long)local_offs[i],
                    (long long)remote_offs[i], (long long)sizes[i], e->world,
                    (unsigned long long)e->window_bytes);
            return -EINVAL;
        }
    }
    uint64_t tail[64];
    for (int c = 0; c < K; c++) tail[c] = atomic_load_explicit(e->ch[c].tail, memory_order_relaxed);
    uint32_t j = *next_channel % (uint32_t)K; /* channel of the next descriptor */
    uint64_t total = 0;
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        uint32_t mark = mark0;
        for (uint64_t off = 0; off < (uint64_t)sizes[i]; off += chunk_bytes) {
            channel *c = &e->ch[j];
            uint64_t head = atomic_load_explicit(c->head, memory_order_acquire);
            if (tail[j] - head >= e->ring_slots) {
                /* ring full: let every channel start on what we wrote, then wait for space */
                for (int k = 0; k < K; k++)
                    atomic_store_explicit(e->ch[k].tail, tail[k], memory_order_release);
                rc = efa_ring_wait_space(handle, (int)j, 1, timeout_ms, err, errlen);
                if (rc) break;
            }
            uint64_t rest = (uint64_t)sizes[i] - off;
            uint32_t len = rest < chunk_bytes ? (uint32_t)rest : chunk_bytes;
            desc_t *slot = &c->ring[tail[j] % e->ring_slots];
            uint32_t field = (msg & EFA_IMM_MSG_MASK) |
                             ((mark <= EFA_MARK_CHUNKS ? mark : 0) << EFA_IMM_MARK_SHIFT);
            slot->w0 = ((uint64_t)dests[i] << 52) | ((uint64_t)field << 32) | len;
            mark += mark ? 1 : 0;
            slot->w1 = ((((uint64_t)local_offs[i] + off) >> 4) << 32) |
                       (((uint64_t)remote_offs[i] + off) >> 4);
            tail[j]++;
            total++;
            j = (j + 1) % (uint32_t)K;
        }
    }
    /* release: the descriptor words above are visible before the channel threads see the tails */
    for (int k = 0; k < K; k++) atomic_store_explicit(e->ch[k].tail, tail[k], memory_order_release);
    *next_channel = j;
    kick(e);
    return rc;
}

static int wait_counters(engine *e, uint32_t msg, int n, const int32_t *srcs,
                         const uint64_t *expected, int reset, int timeout_ms, char *err,
                         size_t errlen);

int efa_wait_counters(uint64_t handle, uint32_t msg, int n, const int32_t *srcs,
                      const uint64_t *expected, int reset, int timeout_ms, char *err, size_t errlen) {
    engine *e = from_handle(handle);
    host_enter(e);
    int rc = wait_counters(e, msg, n, srcs, expected, reset, timeout_ms, err, errlen);
    host_leave(e);
    return rc;
}

static int wait_counters(engine *e, uint32_t msg, int n, const int32_t *srcs,
                         const uint64_t *expected, int reset, int timeout_ms, char *err,
                         size_t errlen) {
    uint64_t start = now_ns(), deadline = start + (uint64_t)timeout_ms * 1000000ull;
    uint64_t next_probe = start + 100000000ull; /* first probe after 100 ms of silence */
    int i = 0;
    for (int k = 0; k < n; k++) {
        if (srcs[k] < 0 || srcs[k] >= e->world) {
            set_err(err, errlen, "rank %d: wait for message %u from rank %d: no such rank (world %d)",
                    e->rank, msg, srcs[k], e->world);
            return -EINVAL;
        }
    }
    while (i < n) {
        uint64_t got = counter_sum(e, srcs[i], msg);
        if (got >= expected[i]) {
            if (got > expected[i]) {
                set_err(err, errlen, "rank %d: message %u from rank %d: %llu chunks arrived, "
                                     "expected %llu (peers disagree on the layout)",
                        e->rank, msg, srcs[i], (unsigned long long)got,
                        (unsigned long long)expected[i]);
                return -EPROTO;
            }
            i++;
            continue;
        }
        int rc = engine_broken(e, err, errlen);
        if (rc) return rc;
        uint64_t t = now_ns();
        if (t > next_probe) {
            /* ask a channel thread to probe the peer we wait for (a dead one fails the write) */
            channel *pc = &e->ch[(uint32_t)srcs[i] % (uint32_t)e->num_channels];
            atomic_store_explicit(&pc->probe_req, srcs[i] + 1, memory_order_release);
            next_probe = t + 250000000ull;
        }
        if (t > deadline) {
            set_err(err, errlen, "rank %d: timed out after %d ms waiting for message %u from rank %d: "
                                 "%llu of %llu chunks arrived (is rank %d alive and in the same "
                                 "operation?)",
                    e->rank, timeout_ms, msg, srcs[i], (unsigned long long)got,
                    (unsigned long long)expected[i], srcs[i]);
            return -ETIMEDOUT;
        }
        waiter_idle(e, start);
    }
    if (reset) {
        /* every chunk of this message has arrived, so no thread adds to these counters again
         * until the slot is reused num_slots messages later */
        for (int k = 0; k < n; k++)
            for (int ch = 0; ch < e->num_channels; ch++)
                atomic_store_explicit(&e->counters[counter_index(e, ch, srcs[k], msg)], 0,
                                      memory_order_relaxed);
    }
    return 0;
}

static int wait_idle(engine *e, int timeout_ms, char *err, size_t errlen);

int efa_wait_idle(uint64_t handle, int timeout_ms, char *err, size_t errlen) {
    engine *e = from_handle(handle);
    host_enter(e);
    int rc = wait_idle(e, timeout_ms, err, errlen);
    host_leave(e);
    return rc;
}

static int wait_idle(engine *e, int timeout_ms, char *err, size_t errlen) {
    uint64_t start = now_ns(), deadline = start + (uint64_t)timeout_ms * 1000000ull;
    for (int ch = 0; ch < e->num_channels; ch++) {
        channel *c = &e->ch[ch];
        for (;;) {
            uint64_t tail = atomic_load_explicit(c->tail, memory_order_relaxed);
            uint64_t head = atomic_load_explicit(c->head, memory_order_acquire);
            int queued = atomic_load_explicit(&c->queued, memory_order_acquire);
            int inflight = atomic_load_explicit(&c->inflight, memory_order_acquire);
            if (head == tail && !queued && !inflight) break;
            int rc = engine_broken(e, err, errlen);
            if (rc) return rc;
            if (now_ns() > deadline) {
                /* name the oldest outstanding write (read racily: diagnostics only) */
                int dest = -1;
                uint32_t msg = 0;
                uint64_t oldest = UINT64_MAX;
                for (int k = 0; k < e->max_inflight; k++)
                    if (c->ctx[k].in_use && c->ctx[k].post_ns < oldest) {
                        oldest = c->ctx[k].post_ns;
                        dest = c->ctx[k].dest;
                        msg = c->ctx[k].msg;
                    }
                set_err(err, errlen, "rank %d channel %d: timed out after %d ms waiting for writes to "
                                     "complete: %llu unread descriptors, %d queued, %d in flight "
                                     "(oldest: to rank %d, message %u)",
                        e->rank, ch, timeout_ms, (unsigned long long)(tail - head), queued, inflight,
                        dest, msg);
                return -ETIMEDOUT;
            }
            waiter_idle(e, start);
        }
    }
    return engine_broken(e, err, errlen);
}

int efa_engine_query(uint64_t handle, int *rank, int *num_channels, uint32_t *ring_slots,
                     uint64_t *window_bytes) {
    engine *e = from_handle(handle);
    if (!e) return -EINVAL;
    if (rank) *rank = e->rank;
    if (num_channels) *num_channels = e->num_channels;
    if (ring_slots) *ring_slots = e->ring_slots;
    if (window_bytes) *window_bytes = e->window_bytes;
    return 0;
}

int efa_engine_stats(uint64_t handle, uint64_t *out, int n) {
    engine *e = from_handle(handle);
    int k = 0;
    for (int ch = 0; ch < e->num_channels; ch++)
        for (int s = 0; s < NUM_STATS; s++) {
            if (k >= n) return k;
            out[k++] = atomic_load_explicit(&e->ch[ch].stats[s], memory_order_relaxed);
        }
    return k;
}

int efa_engine_stop(uint64_t handle) {
    engine *e = from_handle(handle);
    if (!e) return 0;
    atomic_store_explicit(&e->stop, 1, memory_order_release);
    atomic_fetch_add_explicit(&e->wake_seq, 1, memory_order_release);
    syscall(SYS_futex, &e->wake_seq, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    for (int i = 0; i < e->num_channels; i++) {
        channel *c = &e->ch[i];
        if (c->thread_started) {
            pthread_join(c->thread, NULL);
            c->thread_started = 0;
        }
        efa_channel_close(c);
    }
    return 0;
}

int efa_engine_destroy(uint64_t handle) {
    engine *e = from_handle(handle);
    if (!e) return 0;
    efa_engine_stop(handle);
    for (int i = 0; i < e->num_channels; i++) {
        channel *c = &e->ch[i];
        free(c->ctx);
        free(c->held);
        free(c->mr_recv);
        free(c->region_key);
        free(c->region_base);
        free(c->peer_addr);
        free(c->peer_key);
        free(c->peer_base);
        free(c->connected);
    }
    free(e->ch);
    pthread_mutex_destroy(&e->fail_mu);
    free(e);
    return 0;
}
