/* efa_engine.h: internal to the proxy engine, shared by efa_proxy.c (probe, engine creation,
 * the API, waits) and efa_channel.c (a channel's endpoint and its thread's data path): the engine
 * and channel structures and the small helpers both use (clock, error setters, idle policy,
 * arrival counters). Not part of the ABI (that is efa_proxy.h). */
#ifndef EFA_ENGINE_H
#define EFA_ENGINE_H
#include "efa_proxy.h"
#include "efa_util.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define LOCAL_QUEUE 64   /* descriptors popped from the ring but not yet posted */
#define CQ_BATCH 32      /* completions read per fi_cq_read */
#define PENDING_CAP 8192 /* arrivals held back under fault injection */
#define NUM_STATS 8

enum { ST_POPPED, ST_POSTED, ST_TX_DONE, ST_ARRIVED, ST_EAGAIN, ST_NOOP, ST_MAX_INFLIGHT, ST_SLEEPS };

/* Channel thread phases: the named handshake between the creating thread and the channel. */
enum {
    PH_STARTING = 0,  /* thread opening its endpoint */
    PH_READY = 1,     /* endpoint open, window registered, name/key readable */
    PH_PEERS_REQ = 2, /* creator published the peers' names: thread must fi_av_insert them */
    PH_RUNNING = 3,   /* peers inserted, stepping */
    PH_FAILED = -1,   /* init failed; engine error holds the verb */
};

typedef struct {
    struct fi_context2 fctx; /* first member: libfabric's FI_CONTEXT/FI_CONTEXT2 scratch */
    int32_t dest;
    uint32_t msg;
    uint32_t len;
    int32_t next_free;
    uint64_t post_ns;
    int in_use;
} op_ctx;

typedef struct {
    uint32_t imm;
    uint64_t due_ns;
} held_arrival;

typedef struct {
    uint64_t w0, w1;
} desc_t;

struct engine;

typedef struct {
    struct engine *eng;
    int idx;
    pthread_t thread;
    int thread_started;
    _Atomic int phase;

    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    struct fid_mr *mr;       /* whole window, local access only: source of our writes */
    struct fid_mr **mr_recv; /* num_regions receive regions, remote write only */
    void *mr_desc;
    uint8_t name[EFA_ADDR_MAX];
    size_t name_len;
    uint64_t *region_key, *region_base; /* per receive region: key and base peers add offsets to */

    /* peers (arrays of world); written by the creator before PH_PEERS_REQ */
    const uint8_t *req_names;
    const uint64_t *req_name_lens;
    fi_addr_t *peer_addr;
    uint64_t *peer_key;
    uint64_t *peer_base;

    /* ring ch: slots and control words in caller memory */
    desc_t *ring;
    _Atomic uint64_t *tail; /* producer -> thread */
    _Atomic uint64_t *head; /* thread -> producer */
    uint64_t local_head;

    desc_t queue[LOCAL_QUEUE];
    int q_first, q_count;
    _Atomic int probe_req; /* 1 + rank a waiter wants probed (see probe_peer), 0 = none */
    uint64_t eagain_since; /* first -FI_EAGAIN of the write now retried (0 = none) */
    uint8_t *connected;    /* per rank: a write to it has completed on this channel */
    int eagain_dest;
    _Atomic int queued;   /* popped, not yet posted (for wait_idle) */
    _Atomic int inflight; /* posted, not yet completed locally */

    op_ctx *ctx;
    int free_ctx;

    held_arrival *held;
    int num_held;
    uint64_t rng;

    _Atomic uint64_t stats[NUM_STATS];
} channel;

typedef struct engine {
    char provider[64];
    int rank, world, num_channels;
    uint8_t *window;
    uint64_t window_bytes;
    uint32_t ring_slots, num_slots;
    _Atomic uint64_t *counters;
    _Atomic uint32_t *marks; /* [world * EFA_MARKS] chunk marks (caller memory), NULL: none */
    int max_inflight, spin_us, inject, cpu_base;
    int hmem_cuda_device; /* >= 0: the window is CUDA memory on this device (FI_HMEM_CUDA) */
    /* Receive regions: source r writes only into [recv_off + r*recv_stride, + recv_stride), a
     * separate registration with its own key; recv_stride 0 = one region, the whole window
     * (standalone benchmark engines). */
    uint64_t recv_off, recv_stride;
    int num_regions;
    uint64_t key_seed;
    char node[128];       /* tcp: bind to this address (fi_getinfo FI_SOURCE), "" = provider's choice */
    uint32_t gen;         /* generation carried in every immediate (EFA_IMM_GEN_BITS) */
    _Atomic int check_msgs;     /* set by the first efa_engine_expect: stray message ids are errors */
    _Atomic uint32_t expect_seq; /* the consumer's current round */
    _Atomic int tamper;          /* test-only, see EFA_TAMPER_* */
    _Atomic int tamper_done;
    _Atomic int stop;
    _Atomic int failed;
    int fail_code;               /* under fail_mu: -EIO, or -EPROTO (a peer broke the protocol) */
    /* Idle policy (efa_engine_set_idle): linger_ns > 0 = host-driven. A channel thread then
     * stays busy only while it has work (queued, in flight, held) or a host thread is inside
     * one of the engine's waits (waiters > 0), lingers linger_ns after that, and then blocks on
     * the futex wake_seq (bounded) until a waiter or a producer bumps it. 0 = spin spin_us
     * after the last progress, then naps of 20 us on wake_seq (ended early by a host producer
     * or waiter; producers that never enter the engine, the GPU, are seen at the nap's end). */
    uint64_t linger_ns;
    _Atomic int waiters;
    _Atomic uint32_t wake_seq;
    _Atomic int sleepers;
    pthread_mutex_t fail_mu;
    char fail_msg[1024];
    channel *ch;
} engine;

/* ---------------------------------------------------------------------------------------- */
static inline void sleep_us(int us) {
    struct timespec ts = {0, (long)us * 1000L};
    nanosleep(&ts, NULL);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* The first data-path or init failure wins; later ones are dropped (they are usually echoes).
 * code is what every later wait returns: the caller maps a transfer failure (-EIO) and a peer's
 * write that breaks the protocol (-EPROTO) to different error kinds. */
static inline void engine_vfail(engine *e, int code, const char *fmt, va_list ap) {
    pthread_mutex_lock(&e->fail_mu);
    if (!atomic_load(&e->failed)) {
        vsnprintf(e->fail_msg, sizeof e->fail_msg, fmt, ap);
        e->fail_code = code;
        atomic_store_explicit(&e->failed, 1, memory_order_release);
    }
    pthread_mutex_unlock(&e->fail_mu);
}

static inline void engine_fail(engine *e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    engine_vfail(e, -EIO, fmt, ap);
    va_end(ap);
}

/* A received write whose immediate fails validation: the peer broke the protocol. */
static inline void engine_violation(engine *e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    engine_vfail(e, -EPROTO, fmt, ap);
    va_end(ap);
}

/* Waiters call this each spin: returns nonzero (and fills err) if the engine failed/stopped. */
static inline int engine_broken(engine *e, char *err, size_t errlen) {
    if (atomic_load_explicit(&e->failed, memory_order_acquire)) {
        pthread_mutex_lock(&e->fail_mu);
        set_err(err, errlen, "rank %d: proxy engine failed: %s", e->rank, e->fail_msg);
        int code = e->fail_code;
        pthread_mutex_unlock(&e->fail_mu);
        return code;
    }
    if (atomic_load_explicit(&e->stop, memory_order_acquire)) {
        set_err(err, errlen, "rank %d: proxy engine stopped (close() was called) while waiting", e->rank);
        return -ECANCELED;
    }
    return 0;
}

/* A short sleep of an idle channel thread: at most `us` on the futex wake_seq, so a producer or
 * waiter entering the engine (kick) ends it at once instead of at the timer's next tick (a plain
 * nanosleep of 20 us lasted ~70 with the default timer slack: the wake-up latency of every op
 * that follows an idle gap). Sequentially consistent with kick's (wake_seq, sleepers) pair: a
 * kick between the load of `seen` and the wait makes the wait return at once. */
static inline void nap(engine *e, long us) {
    uint32_t seen = atomic_load(&e->wake_seq);
    atomic_fetch_add(&e->sleepers, 1);
    if (!atomic_load(&e->stop)) {
        struct timespec ts = {0, us * 1000L};
        syscall(SYS_futex, &e->wake_seq, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
    }
    atomic_fetch_sub(&e->sleepers, 1);
}

/* Spin for spin_us after the last progress, then back off with short naps (2-core CI hosts run
 * several ranks x K channels; pure spinning there starves the very peer we wait for). While
 * spinning, every 64th turn yields the CPU: with a core to itself the call returns at once (a
 * microsecond), and where threads outnumber cores (ranks x (1 + channels) on a small host) the
 * thread that has the work we wait for (a channel thread polling its CQ, the peer) runs now
 * instead of after our time slice. */
static inline void idle_wait(engine *e, uint64_t idle_since, _Atomic uint64_t *sleeps) {
    static _Thread_local unsigned turns;
    if (now_ns() - idle_since < (uint64_t)e->spin_us * 1000ull) {
        if ((++turns & 63) == 0) sched_yield();
        else cpu_relax();
    } else {
        if (sleeps) atomic_fetch_add_explicit(sleeps, 1, memory_order_relaxed);
        nap(e, 20);
    }
}

/* The calling thread's waits (headers, data, our writes leaving): while spinning it yields the
 * CPU on every turn, not every 64th. The thread it waits on is usually a channel thread of this
 * or the peer's engine; where threads outnumber cores (ranks x (1 + channels) on a small host)
 * every turn it holds the CPU delays exactly the work it waits for. With a core to itself the
 * yield returns at once. */
static inline void waiter_idle(engine *e, uint64_t idle_since) {
    static _Thread_local int slack_set;
    if (now_ns() - idle_since < (uint64_t)e->spin_us * 1000ull) {
        sched_yield();
        return;
    }
    if (!slack_set) {
        /* this thread's sleeps end on time (the default slack of 50 us made each 20 us sleep
         * ~70, added to the end of every long wait); set once per waiting thread */
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
        slack_set = 1;
    }
    sleep_us(20);
}

/* Wakes channel threads blocked in channel_block (host-driven idle policy) or napping (spin
 * policy, after spin_us idle): a host thread posting or waiting. Sequentially
 * consistent with channel_block's (sleepers, waiters) pair, so a wake is never lost between a
 * sleeper's check and its futex wait (the futex rechecks wake_seq; the 1 ms bound covers the rest). */
static inline void kick(engine *e) {
    atomic_fetch_add(&e->wake_seq, 1);
    if (atomic_load(&e->sleepers))
        syscall(SYS_futex, &e->wake_seq, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

static inline void host_enter(engine *e) {
    atomic_fetch_add(&e->waiters, 1);
    kick(e);
}

static inline void host_leave(engine *e) { atomic_fetch_sub(&e->waiters, 1); }

/* A channel with nothing to do and nobody waiting: block until kicked, at most 1 ms (arrivals
 * nobody waits for yet are still progressed, late). */
static inline void channel_block(engine *e, channel *c) {
    uint32_t seen = atomic_load(&e->wake_seq);
    atomic_fetch_add(&e->sleepers, 1);
    if (!atomic_load(&e->waiters) && !atomic_load(&e->stop)) {
        struct timespec ts = {0, 1000000L};
        syscall(SYS_futex, &e->wake_seq, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
        atomic_fetch_add_explicit(&c->stats[ST_SLEEPS], 1, memory_order_relaxed);
    }
    atomic_fetch_sub(&e->sleepers, 1);
}

static inline uint64_t xorshift(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static inline engine *from_handle(uint64_t h) { return (engine *)(uintptr_t)h; }

/* Arrival counters are per channel: counters[(ch * world + src) * num_slots + slot]. A waiter
 * sums a (source, message)'s counter over the channels; each counter has one writer. */
static inline size_t counter_index(const engine *e, int ch, int src, uint32_t msg) {
    uint32_t slot = (msg & EFA_IMM_MSG_MASK) % e->num_slots;
    return ((size_t)ch * (size_t)e->world + (size_t)src) * e->num_slots + slot;
}

static inline uint64_t counter_sum(engine *e, int src, uint32_t msg) {
    uint64_t got = 0;
    for (int ch = 0; ch < e->num_channels; ch++)
        got += atomic_load_explicit(&e->counters[counter_index(e, ch, src, msg)], memory_order_acquire);
    return got;
}

static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Window regions: source r's region starts here (one region when recv_stride is 0). */
static inline uint64_t region_start(const engine *e, int r) {
    return e->recv_stride ? e->recv_off + (uint64_t)r * e->recv_stride : 0;
}

static inline uint64_t region_bytes(const engine *e) {
    return e->recv_stride ? e->recv_stride : e->window_bytes;
}

/* Internal entry points (hidden: not exported from the library) */
#define EFA_INTERNAL __attribute__((visibility("hidden")))
/* efa_channel.c: a channel thread: open its endpoint, insert peers, step until stopped */
EFA_INTERNAL void *efa_channel_main(void *arg);
/* efa_endpoint.c: the channel's endpoint (0 or a negative errno with the engine error set) */
EFA_INTERNAL int efa_channel_open(channel *c);
EFA_INTERNAL int efa_channel_insert_peers(channel *c);
EFA_INTERNAL void efa_channel_close(channel *c);
/* the provider's fi_info for an RDM endpoint (0, or a negative errno with msg set) */
EFA_INTERNAL int efa_get_info(const char *provider, int hmem, const char *node, struct fi_info **out,
                              char *msg, size_t msglen);

#endif /* EFA_ENGINE_H */
