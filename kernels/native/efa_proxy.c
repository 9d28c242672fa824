/* efa_proxy.c: K channel threads, command rings, libfabric RDM wire, arrival counters.
 * See efa_proxy.h for the memory the caller owns, the descriptor format and the protocol.
 *
 * Build: cc -O2 -std=c11 -shared -fPIC efa_proxy.c efa_bench.c -o libefa_proxy.so -lfabric -lpthread
 * (the benchmark entry points live in efa_bench.c, a client of the public ABI).
 *
 * Per channel thread, in this order (step()):
 *   1. commands : acquire the ring's tail, copy descriptors out, release the head (slots reusable);
 *   2. post     : fi_writedata each descriptor (bounded in flight; -FI_EAGAIN -> progress, retry);
 *   3. poll CQ  : local write completions free their context; remote completions (FI_REMOTE_CQ_DATA)
 *                 become arrivals (source, message) taken from the 32-bit immediate data;
 *   4. publish  : add arrivals to the counters (release), shuffled/delayed under fault injection.
 * Data-path failures become an engine error naming the verb, the peer and the message; every
 * waiter checks it, so nobody waits on a dead engine.
 */
#define _GNU_SOURCE
#include "efa_proxy.h"

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
     * after the last progress, then short sleeps (producers that never enter the engine: the
     * GPU, the benchmark loops). */
    uint64_t linger_ns;
    _Atomic int waiters;
    _Atomic uint32_t wake_seq;
    _Atomic int sleepers;
    pthread_mutex_t fail_mu;
    char fail_msg[1024];
    channel *ch;
} engine;

/* ---------------------------------------------------------------------------------------- */
static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_us(int us) {
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

static void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* The first data-path or init failure wins; later ones are dropped (they are usually echoes).
 * code is what every later wait returns: the caller maps a transfer failure (-EIO) and a peer's
 * write that breaks the protocol (-EPROTO) to different error kinds. */
static void engine_vfail(engine *e, int code, const char *fmt, va_list ap) {
    pthread_mutex_lock(&e->fail_mu);
    if (!atomic_load(&e->failed)) {
        vsnprintf(e->fail_msg, sizeof e->fail_msg, fmt, ap);
        e->fail_code = code;
        atomic_store_explicit(&e->failed, 1, memory_order_release);
    }
    pthread_mutex_unlock(&e->fail_mu);
}

static void engine_fail(engine *e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    engine_vfail(e, -EIO, fmt, ap);
    va_end(ap);
}

/* A received write whose immediate fails validation: the peer broke the protocol. */
static void engine_violation(engine *e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    engine_vfail(e, -EPROTO, fmt, ap);
    va_end(ap);
}

/* Waiters call this each spin: returns nonzero (and fills err) if the engine failed/stopped. */
static int engine_broken(engine *e, char *err, size_t errlen) {
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

/* Spin for spin_us after the last progress, then back off with short sleeps (2-core CI hosts run
 * several ranks x K channels; pure spinning there starves the very peer we wait for). While
 * spinning, every 64th turn yields the CPU: with a core to itself the call returns at once (a
 * microsecond), and where threads outnumber cores (ranks x (1 + channels) on a small host) the
 * thread that has the work we wait for (a channel thread polling its CQ, the peer) runs now
 * instead of after our time slice. */
static void idle_wait(engine *e, uint64_t idle_since, _Atomic uint64_t *sleeps) {
    static _Thread_local unsigned turns;
    if (now_ns() - idle_since < (uint64_t)e->spin_us * 1000ull) {
        if ((++turns & 63) == 0) sched_yield();
        else cpu_relax();
    } else {
        if (sleeps) atomic_fetch_add_explicit(sleeps, 1, memory_order_relaxed);
        sleep_us(20);
    }
}

/* The calling thread's waits (headers, data, our writes leaving): while spinning it yields the
 * CPU on every turn, not every 64th. The thread it waits on is usually a channel thread of this
 * or the peer's engine; where threads outnumber cores (ranks x (1 + channels) on a small host)
 * every turn it holds the CPU delays exactly the work it waits for. With a core to itself the
 * yield returns at once. */
static void waiter_idle(engine *e, uint64_t idle_since) {
    if (now_ns() - idle_since < (uint64_t)e->spin_us * 1000ull) sched_yield();
    else sleep_us(20);
}

/* Wakes channel threads blocked in channel_block (host-driven idle policy). Sequentially
 * consistent with channel_block's (sleepers, waiters) pair, so a wake is never lost between a
 * sleeper's check and its futex wait (the futex rechecks wake_seq; the 1 ms bound covers the rest). */
static void kick(engine *e) {
    if (!e->linger_ns) return;
    atomic_fetch_add(&e->wake_seq, 1);
    if (atomic_load(&e->sleepers))
        syscall(SYS_futex, &e->wake_seq, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

static void host_enter(engine *e) {
    atomic_fetch_add(&e->waiters, 1);
    kick(e);
}

static void host_leave(engine *e) { atomic_fetch_sub(&e->waiters, 1); }

/* A channel with nothing to do and nobody waiting: block until kicked, at most 1 ms (arrivals
 * nobody waits for yet are still progressed, late). */
static void channel_block(engine *e, channel *c) {
    uint32_t seen = atomic_load(&e->wake_seq);
    atomic_fetch_add(&e->sleepers, 1);
    if (!atomic_load(&e->waiters) && !atomic_load(&e->stop)) {
        struct timespec ts = {0, 1000000L};
        syscall(SYS_futex, &e->wake_seq, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
        atomic_fetch_add_explicit(&c->stats[ST_SLEEPS], 1, memory_order_relaxed);
    }
    atomic_fetch_sub(&e->sleepers, 1);
}

static uint64_t xorshift(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static engine *from_handle(uint64_t h) { return (engine *)(uintptr_t)h; }

/* Arrival counters are per channel: counters[(ch * world + src) * num_slots + slot]. A waiter
 * sums a (source, message)'s counter over the channels; each counter has one writer. */
static inline size_t counter_index(const engine *e, int ch, int src, uint32_t msg) {
    uint32_t slot = (msg & ((1u << EFA_MSG_BITS) - 1)) % e->num_slots;
    return ((size_t)ch * (size_t)e->world + (size_t)src) * e->num_slots + slot;
}

static inline uint64_t counter_sum(engine *e, int src, uint32_t msg) {
    uint64_t got = 0;
    for (int ch = 0; ch < e->num_channels; ch++)
        got += atomic_load_explicit(&e->counters[counter_index(e, ch, src, msg)], memory_order_acquire);
    return got;
}

/* ---------------------------------------------------------------------------------------- */
int efa_abi_version(void) { return EFA_PROXY_ABI_VERSION; }

static struct fi_info *make_hints(const char *provider, int hmem, int prov_key) {
    struct fi_info *hints = fi_allocinfo();
    if (!hints) return NULL;
    hints->ep_attr->type = FI_EP_RDM;
    /* remote CQ data is not a capability bit in 1.17 (it is an op flag); the provider's
     * domain_attr->cq_data_size says whether writes can carry it, checked in get_info() */
    hints->caps = FI_RMA;
    /* our op contexts start with a struct fi_context2, so either context mode is satisfied */
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    /* modes we honour: local descs, VA-based remote addresses, endpoint binding; provider keys
     * only where the provider insists (efa), else our random keys (get_info tries both) */
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_ENDPOINT;
    if (prov_key) hints->domain_attr->mr_mode |= FI_MR_PROV_KEY;
    if (hmem) {
        /* device memory in the window: the provider must accept FI_HMEM registrations */
        hints->caps |= FI_HMEM;
        hints->domain_attr->mr_mode |= FI_MR_HMEM;
    }
    hints->domain_attr->threading = FI_THREAD_DOMAIN; /* one thread drives each domain */
    hints->domain_attr->av_type = FI_AV_TABLE;
    hints->fabric_attr->prov_name = strdup(provider);
    return hints;
}

/* fi_getinfo for provider; "tcp" also tries the RDM layering "tcp;ofi_rxm" (1.17 has no native
 * tcp RDM endpoint). Returns 0 and *out, or a libfabric error with err filled. */
static int get_info(const char *provider, int hmem, const char *node, struct fi_info **out,
                    char *err, size_t errlen) {
    const char *names[2] = {provider, NULL};
    char layered[80];
    if (!strchr(provider, ';')) {
        snprintf(layered, sizeof layered, "%s;ofi_rxm", provider);
        names[1] = layered;
    }
    int rc = -FI_ENODATA;
    /* node: bind the endpoint to that local address (FI_SOURCE), so tcp listens on the process
     * group's interface only */
    const char *n = (node && node[0]) ? node : NULL;
    for (int i = 0; i < 4 && names[i / 2]; i++) {
        struct fi_info *hints = make_hints(names[i / 2], hmem, i % 2);
        if (!hints) {
            set_err(err, errlen, "fi_allocinfo failed (out of memory)");
            return -FI_ENOMEM;
        }
        /* FI_HMEM exists from API 1.10 on; host windows keep the 1.9 semantics */
        rc = fi_getinfo(hmem ? FI_VERSION(1, 10) : FI_VERSION(1, 9), n, NULL, n ? FI_SOURCE : 0,
                        hints, out);
        fi_freeinfo(hints);
        if (rc == 0) {
            if ((*out)->domain_attr->cq_data_size < 4) {
                set_err(err, errlen,
                        "provider %s offers only %zu bytes of remote CQ data; the proxy needs 4 "
                        "(FI_REMOTE_CQ_DATA with a 32-bit immediate)",
                        (*out)->fabric_attr->prov_name, (size_t)(*out)->domain_attr->cq_data_size);
                fi_freeinfo(*out);
                *out = NULL;
                return -FI_ENODATA;
            }
            return 0;
        }
    }
    if (n && !hmem) {
        set_err(err, errlen,
                "fi_getinfo(prov_name=%s, FI_EP_RDM, caps=FI_RMA, bound to local address %s) failed: "
                "%s (%d); no interface of this provider holds that address (set FI_TCP_IFACE to the "
                "interface the process group uses)", provider, n, fi_strerror(-rc), rc);
        return rc;
    }
    if (hmem)
        set_err(err, errlen,
                "fi_getinfo(prov_name=%s, FI_EP_RDM, caps=FI_RMA|FI_HMEM, mr_mode FI_MR_HMEM) failed: "
                "%s (%d); this libfabric's %s provider does not offer device-memory registration "
                "(fi_info -p %s -c FI_HMEM shows it; tcp never does, efa and shm do when libfabric "
                "is built with CUDA, as the AWS EFA installer's is); use hmem='off' (host-staged)",
                provider, fi_strerror(-rc), rc, provider, provider);
    else
        set_err(err, errlen,
                "fi_getinfo(prov_name=%s, FI_EP_RDM, caps=FI_RMA, FI_AV_TABLE) failed: %s (%d); "
                "the provider is missing or lacks RMA / remote CQ data (fi_info -p %s shows what it "
                "offers; for tcp set FI_TCP_IFACE to a configured interface, e.g. lo)",
                provider, fi_strerror(-rc), rc, provider);
    return rc;
}

int efa_probe(const char *provider, char *err, size_t errlen) {
    struct fi_info *info = NULL;
    int rc = get_info(provider, 0, NULL, &info, err, errlen);
    if (info) fi_freeinfo(info);
    return rc;
}

int efa_probe_hmem(const char *provider, char *err, size_t errlen) {
    struct fi_info *info = NULL;
    int rc = get_info(provider, 1, NULL, &info, err, errlen);
    if (info) fi_freeinfo(info);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
#define CHECK_FI(call, what)                                                                     \
    do {                                                                                         \
        int _rc = (int)(call);                                                                   \
        if (_rc) {                                                                               \
            engine_fail(e, "rank %d channel %d: %s failed: %s (%d) [%s:%d]", e->rank, c->idx,    \
                        what, fi_strerror(-_rc), _rc, __FILE__, __LINE__);                       \
            return _rc;                                                                          \
        }                                                                                        \
    } while (0)

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static uint64_t region_start(const engine *e, int r) {
    return e->recv_stride ? e->recv_off + (uint64_t)r * e->recv_stride : 0;
}

static uint64_t region_bytes(const engine *e) {
    return e->recv_stride ? e->recv_stride : e->window_bytes;
}

/* Registers window[off, off + len) with `access`; binds it to the endpoint where required. */
static int register_range(channel *c, uint64_t off, uint64_t len, uint64_t access, uint64_t key,
                          struct fid_mr **out) {
    engine *e = c->eng;
    int rc;
    if (e->hmem_cuda_device >= 0) {
        /* the window is CUDA memory: the provider (NIC DMA on efa, cudaMemcpy on tcp/shm) reads
         * and writes it directly, no host staging */
        struct iovec iov = {.iov_base = e->window + off, .iov_len = (size_t)len};
        struct fi_mr_attr attr;
        memset(&attr, 0, sizeof attr);
        attr.mr_iov = &iov;
        attr.iov_count = 1;
        attr.access = access;
        attr.requested_key = key;
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = e->hmem_cuda_device;
        rc = fi_mr_regattr(c->domain, &attr, 0, out);
    } else {
        rc = fi_mr_reg(c->domain, e->window + off, (size_t)len, access, 0, key, 0, out, NULL);
    }
    if (rc) return rc;
    if (c->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        rc = fi_mr_bind(*out, &c->ep->fid, 0);
        if (!rc) rc = fi_mr_enable(*out);
    }
    return rc;
}

static int channel_open(channel *c) {
    engine *e = c->eng;
    char msg[512] = {0};
    int rc = get_info(e->provider, e->hmem_cuda_device >= 0, e->node, &c->info, msg, sizeof msg);
    if (rc) {
        engine_fail(e, "rank %d channel %d: %s", e->rank, c->idx, msg);
        return rc;
    }
    struct fi_info *info = c->info;
    CHECK_FI(fi_fabric(info->fabric_attr, &c->fabric, NULL), "fi_fabric");
    CHECK_FI(fi_domain(c->fabric, info, &c->domain, NULL), "fi_domain");

    struct fi_av_attr av_attr = {0};
    av_attr.type = FI_AV_TABLE;
    av_attr.count = (size_t)e->world;
    CHECK_FI(fi_av_open(c->domain, &av_attr, &c->av, NULL), "fi_av_open");

    struct fi_cq_attr cq_attr = {0};
    cq_attr.format = FI_CQ_FORMAT_DATA; /* remote completions carry the 32-bit immediate */
    cq_attr.wait_obj = FI_WAIT_NONE;    /* the thread polls; no wait object needed */
    cq_attr.size = (size_t)(e->max_inflight * 4 + 4096);
    CHECK_FI(fi_cq_open(c->domain, &cq_attr, &c->cq, NULL), "fi_cq_open");

    CHECK_FI(fi_endpoint(c->domain, info, &c->ep, NULL), "fi_endpoint");
    CHECK_FI(fi_ep_bind(c->ep, &c->av->fid, 0), "fi_ep_bind(av)");
    /* FI_RECV: remote writes with FI_REMOTE_CQ_DATA complete on the receive side of this CQ */
    CHECK_FI(fi_ep_bind(c->ep, &c->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    CHECK_FI(fi_enable(c->ep), "fi_enable");

    uint64_t mr_mode = (uint64_t)info->domain_attr->mr_mode;
    /* Two kinds of registration, no remote read anywhere: the whole window with local access
     * only (the source of our writes), and one receive region per source with remote write only,
     * each under its own random key that only that source learns; a peer's write outside its own
     * region is refused by the target's provider. */
    /* a CUDA window registers through fi_mr_regattr (FI_HMEM_CUDA): name the call that failed */
    const int cuda = e->hmem_cuda_device >= 0;
    CHECK_FI(register_range(c, 0, e->window_bytes, FI_WRITE, 0, &c->mr),
             cuda ? "fi_mr_regattr(window, FI_HMEM_CUDA, local)" : "fi_mr_reg(window, local)");
    c->mr_desc = fi_mr_desc(c->mr);
    c->mr_recv = calloc((size_t)e->num_regions, sizeof(struct fid_mr *));
    c->region_key = calloc((size_t)e->num_regions, sizeof(uint64_t));
    c->region_base = calloc((size_t)e->num_regions, sizeof(uint64_t));
    if (!c->mr_recv || !c->region_key || !c->region_base) {
        engine_fail(e, "rank %d channel %d: out of memory for registrations", e->rank, c->idx);
        return -FI_ENOMEM;
    }
    for (int r = 0; r < e->num_regions; r++) {
        uint64_t off = region_start(e, r), len = region_bytes(e);
        /* keys differ per (channel, region) because the domain is per channel */
        uint64_t key = splitmix64(e->key_seed ^ (((uint64_t)c->idx << 32) | (uint64_t)r));
        size_t ks = info->domain_attr->mr_key_size;
        if (ks && ks < 8) key &= (1ull << (8 * ks)) - 1;
        int access = FI_REMOTE_WRITE;
        if (!e->recv_stride) access |= FI_WRITE; /* one region: also our local source */
        CHECK_FI(register_range(c, off, len, access, key, &c->mr_recv[r]),
                 cuda ? "fi_mr_regattr(receive region, FI_HMEM_CUDA)" : "fi_mr_reg(receive region)");
        c->region_key[r] = fi_mr_key(c->mr_recv[r]);
        if (c->region_key[r] == FI_KEY_NOTAVAIL) {
            engine_fail(e, "rank %d channel %d: fi_mr_key returned FI_KEY_NOTAVAIL (raw keys are not "
                           "supported by this proxy)", e->rank, c->idx);
            return -FI_ENOSYS;
        }
        c->region_base[r] = (mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)(e->window + off) : 0;
    }

    c->name_len = sizeof c->name;
    CHECK_FI(fi_getname(&c->ep->fid, c->name, &c->name_len), "fi_getname");

    c->ctx = calloc((size_t)e->max_inflight, sizeof(op_ctx));
    c->held = calloc(PENDING_CAP, sizeof(held_arrival));
    if (!c->ctx || !c->held) {
        engine_fail(e, "rank %d channel %d: out of memory for contexts", e->rank, c->idx);
        return -FI_ENOMEM;
    }
    for (int i = 0; i < e->max_inflight; i++) c->ctx[i].next_free = i + 1 < e->max_inflight ? i + 1 : -1;
    c->free_ctx = 0;
    return 0;
}

static int channel_insert_peers(channel *c) {
    engine *e = c->eng;
    for (int r = 0; r < e->world; r++) {
        /* one insert per rank keeps the fi_addr_t <-> rank mapping explicit */
        int n = fi_av_insert(c->av, c->req_names + (size_t)r * EFA_ADDR_MAX, 1, &c->peer_addr[r], 0, NULL);
        if (n != 1) {
            engine_fail(e, "rank %d channel %d: fi_av_insert(address of rank %d) inserted %d: %s",
                        e->rank, c->idx, r, n, n < 0 ? fi_strerror(-n) : "invalid address");
            return n < 0 ? n : -FI_EINVAL;
        }
    }
    return 0;
}

static void channel_close(channel *c) {
    engine *e = c->eng;
    if (c->mr_recv)
        for (int r = 0; r < e->num_regions; r++)
            if (c->mr_recv[r]) {
                fi_close(&c->mr_recv[r]->fid);
                c->mr_recv[r] = NULL;
            }
    if (c->mr) fi_close(&c->mr->fid);
    if (c->ep) fi_close(&c->ep->fid);
    if (c->cq) fi_close(&c->cq->fid);
    if (c->av) fi_close(&c->av->fid);
    if (c->domain) fi_close(&c->domain->fid);
    if (c->fabric) fi_close(&c->fabric->fid);
    if (c->info) fi_freeinfo(c->info);
    c->mr = NULL; c->ep = NULL; c->cq = NULL; c->av = NULL; c->domain = NULL; c->fabric = NULL;
    c->info = NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* Immediate data: source rank (12 bits) | generation (4 bits) | message id (16 bits). */
static inline uint32_t make_imm(int src, uint32_t gen, uint32_t msg) {
    return ((uint32_t)src << EFA_MSG_BITS) | ((gen & EFA_IMM_GEN_MASK) << EFA_IMM_MSG_BITS) |
           (msg & EFA_IMM_MSG_MASK);
}

/* A peer's immediate is untrusted: its source must be in the group, its generation this
 * engine's, and (once the consumer published its round) its message one the consumer can be
 * waiting for: header or data of round s, or the header of round s + 1 (a peer that finished
 * round s early). Anything else is a stray or replayed write: reported, never counted. */
static inline void publish_arrival(engine *e, channel *c, uint32_t imm) {
    uint32_t src = imm >> EFA_MSG_BITS;
    uint32_t gen = (imm >> EFA_IMM_MSG_BITS) & EFA_IMM_GEN_MASK, msg = imm & EFA_IMM_MSG_MASK;
    if ((int)src >= e->world) {
        engine_violation(e, "rank %d channel %d: remote completion with immediate 0x%08x names "
                            "source rank %u outside the group of %d", e->rank, c->idx, imm, src,
                         e->world);
        return;
    }
    if (gen != (e->gen & EFA_IMM_GEN_MASK)) {
        engine_violation(e, "rank %d channel %d: write from rank %u (message %u) carries "
                            "generation %u, this transport's is %u: a stray write from another "
                            "transport instance, rejected", e->rank, c->idx, src, msg, gen,
                         e->gen & EFA_IMM_GEN_MASK);
        return;
    }
    if (atomic_load_explicit(&e->check_msgs, memory_order_acquire)) {
        uint32_t s = atomic_load_explicit(&e->expect_seq, memory_order_acquire);
        uint32_t lo = (2u * s) & EFA_IMM_MSG_MASK, rel = (msg - lo) & EFA_IMM_MSG_MASK;
        if (rel > 2) {
            engine_violation(e, "rank %d channel %d: stray or replayed write from rank %u: "
                                "message %u, expected %u..%u (round %u); rejected, not counted",
                             e->rank, c->idx, src, msg, lo, (lo + 2) & EFA_IMM_MSG_MASK, s);
            return;
        }
    }
    /* this channel's own counter of (source, message): channels never share a cache line */
    atomic_fetch_add_explicit(&e->counters[counter_index(e, c->idx, (int)src, msg)], 1,
                              memory_order_release);
    atomic_fetch_add_explicit(&c->stats[ST_ARRIVED], 1, memory_order_relaxed);
}

/* Under EFA_INJECT_TARGET: hold each arrival for a random 0..300 us; publish the due ones in a
 * shuffled order, and only in batches (>= 4 due, or the oldest overdue by 300 us). */
static int publish_held(engine *e, channel *c, int force) {
    if (!c->num_held) return 0;
    uint64_t t = now_ns();
    int due = 0;
    uint64_t oldest = UINT64_MAX;
    for (int i = 0; i < c->num_held; i++) {
        if (c->held[i].due_ns <= t) due++;
        if (c->held[i].due_ns < oldest) oldest = c->held[i].due_ns;
    }
    if (!force && due < 4 && !(due && t - oldest > 300000ull)) return 0;
    /* shuffle, then publish the due entries and compact the rest */
    for (int i = c->num_held - 1; i > 0; i--) {
        int j = (int)(xorshift(&c->rng) % (uint64_t)(i + 1));
        held_arrival tmp = c->held[i];
        c->held[i] = c->held[j];
        c->held[j] = tmp;
    }
    int keep = 0;
    for (int i = 0; i < c->num_held; i++) {
        if (force || c->held[i].due_ns <= t) publish_arrival(e, c, c->held[i].imm);
        else c->held[keep++] = c->held[i];
    }
    int published = c->num_held - keep;
    c->num_held = keep;
    return published;
}

static void arrival(engine *e, channel *c, uint32_t imm) {
    if (!(e->inject & EFA_INJECT_TARGET)) {
        publish_arrival(e, c, imm);
        return;
    }
    if (c->num_held == PENDING_CAP) publish_held(e, c, 1);
    c->held[c->num_held].imm = imm;
    c->held[c->num_held].due_ns = now_ns() + (xorshift(&c->rng) % 300) * 1000ull;
    c->num_held++;
}

/* Step 3: drain the CQ. Returns completions handled, or < 0 after an engine failure. */
static int poll_cq(engine *e, channel *c) {
    struct fi_cq_data_entry ent[CQ_BATCH];
    ssize_t n = fi_cq_read(c->cq, ent, CQ_BATCH);
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry ee;
        memset(&ee, 0, sizeof ee);
        fi_cq_readerr(c->cq, &ee, 0);
        op_ctx *x = (op_ctx *)ee.op_context;
        char prov[256] = "";
        fi_cq_strerror(c->cq, ee.prov_errno, ee.err_data, prov, sizeof prov);
        if (x && x >= c->ctx && x < c->ctx + e->max_inflight)
            engine_fail(e, "rank %d channel %d: RMA write to rank %d (message %u, %u bytes) failed: "
                           "fi_cq_readerr: %s (prov_errno %d: %s); is rank %d alive?",
                        e->rank, c->idx, x->dest, x->msg, x->len, fi_strerror(ee.err), ee.prov_errno,
                        prov, x->dest);
        else
            engine_fail(e, "rank %d channel %d: fi_cq_readerr: %s (prov_errno %d: %s), flags 0x%llx",
                        e->rank, c->idx, fi_strerror(ee.err), ee.prov_errno, prov,
                        (unsigned long long)ee.flags);
        return -1;
    }
    if (n < 0) {
        engine_fail(e, "rank %d channel %d: fi_cq_read failed: %s (%zd)", e->rank, c->idx,
                    fi_strerror((int)-n), n);
        return -1;
    }
    for (ssize_t i = 0; i < n; i++) {
        if (ent[i].flags & FI_REMOTE_CQ_DATA) {
            /* a peer's write landed in our window: count it by (source, message) */
            arrival(e, c, (uint32_t)ent[i].data);
        } else {
            op_ctx *x = (op_ctx *)ent[i].op_context;
            if (!x || x < c->ctx || x >= c->ctx + e->max_inflight || !x->in_use) {
                engine_fail(e, "rank %d channel %d: completion with unknown context %p flags 0x%llx",
                            e->rank, c->idx, (void *)x, (unsigned long long)ent[i].flags);
                return -1;
            }
            x->in_use = 0;
            if (c->connected && x->dest >= 0 && x->dest < e->world) c->connected[x->dest] = 1;
            x->next_free = c->free_ctx;
            c->free_ctx = (int)(x - c->ctx);
            atomic_fetch_sub_explicit(&c->inflight, 1, memory_order_release);
            atomic_fetch_add_explicit(&c->stats[ST_TX_DONE], 1, memory_order_relaxed);
        }
    }
    return (int)n;
}

/* tcp/rxm answers writes to a peer whose connection is gone (the process died) with -FI_EAGAIN
 * while it tries to reconnect. With nothing of ours in flight, back-pressure cannot explain it:
 * after EAGAIN_DEAD_MS of refusals the peer is declared unreachable, well before the deadline. */
#define EAGAIN_DEAD_MS 500
static int eagain_check(engine *e, channel *c, int dest) {
    uint64_t t = now_ns();
    /* before the first completed write the provider may still be connecting (slowly, on a
     * loaded host): only a connection that existed can be lost */
    if (!c->connected || !c->connected[dest] || !c->eagain_since || c->eagain_dest != dest ||
        atomic_load_explicit(&c->inflight, memory_order_relaxed)) {
        c->eagain_since = t;
        c->eagain_dest = dest;
        return 0;
    }
    if (t - c->eagain_since < (uint64_t)EAGAIN_DEAD_MS * 1000000ull) return 0;
    engine_fail(e, "rank %d channel %d: rank %d is unreachable: the provider refused every write to "
                   "it for %d ms with nothing else in flight (-FI_EAGAIN: connection lost and not "
                   "re-established); is rank %d alive?", e->rank, c->idx, dest, EAGAIN_DEAD_MS, dest);
    return 1;
}

/* Step 2 for one descriptor. Returns 1 posted, 0 must retry later (no context / EAGAIN), <0 fail. */
static int post_one(engine *e, channel *c, const desc_t *d) {
    uint32_t len = (uint32_t)(d->w0 & 0xffffffffu);
    uint32_t msg = (uint32_t)((d->w0 >> 32) & ((1u << EFA_MSG_BITS) - 1));
    int dest = (int)(d->w0 >> 52);
    uint64_t loff = (d->w1 >> 32) << 4, roff = (d->w1 & 0xffffffffu) << 4;
    if (len == 0) {
        /* no-op marker: completes through the counters without touching the wire */
        atomic_fetch_add_explicit(&c->stats[ST_NOOP], 1, memory_order_relaxed);
        publish_arrival(e, c, make_imm(e->rank, e->gen, msg));
        return 1;
    }
    /* our own writes stay inside our region of the destination's window (its provider enforces
     * the same through the region's key; this names the bug on the sending side) */
    uint64_t rs = region_start(e, e->recv_stride ? e->rank : 0), rb = region_bytes(e);
    if (dest >= e->world || loff + len > e->window_bytes || roff < rs || roff + len > rs + rb) {
        engine_fail(e, "rank %d channel %d: bad descriptor for message %u: dest rank %d (world %d), "
                       "local offset %llu, remote offset %llu, length %u: outside the window (%llu "
                       "bytes) or this rank's slot [%llu, %llu) of the destination's window",
                    e->rank, c->idx, msg, dest, e->world, (unsigned long long)loff,
                    (unsigned long long)roff, len, (unsigned long long)e->window_bytes,
                    (unsigned long long)rs, (unsigned long long)(rs + rb));
        return -1;
    }
    if (c->free_ctx < 0) return 0; /* max_inflight writes outstanding: progress first */
    op_ctx *x = &c->ctx[c->free_ctx];
    uint64_t raddr = c->peer_base[dest] + (roff - rs);
    uint32_t gen = e->gen, imsg = msg;
    int tamper = atomic_load_explicit(&e->tamper, memory_order_relaxed);
    if (tamper && (msg & 1) && dest != e->rank &&
        !atomic_exchange_explicit(&e->tamper_done, 1, memory_order_relaxed)) {
        /* test-only faults on the first data write after arming (see EFA_TAMPER_*) */
        if (tamper == EFA_TAMPER_OFFSET) raddr += rb;     /* into the next source's region */
        if (tamper == EFA_TAMPER_MSG) imsg = msg + 16;    /* an id nobody waits for */
        if (tamper == EFA_TAMPER_REPLAY) imsg = msg - 2;  /* the previous round's data id */
        if (tamper == EFA_TAMPER_GEN) gen = e->gen + 1;   /* another transport's generation */
    }
    uint32_t imm = make_imm(e->rank, gen, imsg);
    ssize_t rc = fi_writedata(c->ep, e->window + loff, len, c->mr_desc, imm, c->peer_addr[dest],
                              raddr, c->peer_key[dest], &x->fctx);
    if (rc == -FI_EAGAIN) {
        atomic_fetch_add_explicit(&c->stats[ST_EAGAIN], 1, memory_order_relaxed);
        if (tamper) atomic_store_explicit(&e->tamper_done, 0, memory_order_relaxed);
        return eagain_check(e, c, dest) ? -1 : 0;
    }
    c->eagain_since = 0;
    if (rc) {
        engine_fail(e, "rank %d channel %d: fi_writedata(to rank %d, message %u, %u bytes) failed: "
                       "%s (%zd)", e->rank, c->idx, dest, msg, len, fi_strerror((int)-rc), rc);
        return -1;
    }
    c->free_ctx = x->next_free;
    x->in_use = 1;
    x->dest = dest;
    x->msg = msg;
    x->len = len;
    x->post_ns = now_ns();
    int inflight = atomic_fetch_add_explicit(&c->inflight, 1, memory_order_release) + 1;
    if ((uint64_t)inflight > atomic_load_explicit(&c->stats[ST_MAX_INFLIGHT], memory_order_relaxed))
        atomic_store_explicit(&c->stats[ST_MAX_INFLIGHT], (uint64_t)inflight, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->stats[ST_POSTED], 1, memory_order_relaxed);
    return 1;
}

/* Liveness probe: a 16-byte fi_write (no immediate, so the target counts nothing) into the last
 * 16 bytes of our region of dest's window, a pad nobody reads. Over a connection whose peer died
 * the provider fails it (error completion naming dest) instead of letting waiters run to their
 * deadline. Returns 1 posted (or not needed), 0 retry later, < 0 failure. */
static int probe_peer(engine *e, channel *c, int dest) {
    if (!e->recv_stride || dest < 0 || dest >= e->world || dest == e->rank) return 1;
    if (c->free_ctx < 0) return 0;
    op_ctx *x = &c->ctx[c->free_ctx];
    uint64_t rs = region_start(e, e->rank), rb = region_bytes(e);
    ssize_t rc = fi_write(c->ep, e->window, 16, c->mr_desc, c->peer_addr[dest],
                          c->peer_base[dest] + rb - 16, c->peer_key[dest], &x->fctx);
    (void)rs;
    if (rc == -FI_EAGAIN) return eagain_check(e, c, dest) ? -1 : 0;
    c->eagain_since = 0;
    if (rc) {
        engine_fail(e, "rank %d channel %d: liveness probe fi_write to rank %d failed: %s (%zd); is "
                       "rank %d alive?", e->rank, c->idx, dest, fi_strerror((int)-rc), rc, dest);
        return -1;
    }
    c->free_ctx = x->next_free;
    x->in_use = 1;
    x->dest = dest;
    x->msg = 0;
    x->len = 16;
    x->post_ns = now_ns();
    atomic_fetch_add_explicit(&c->inflight, 1, memory_order_release);
    return 1;
}

/* One pass of the protocol; returns nonzero if anything moved. */
static int step(engine *e, channel *c) {
    int progressed = 0;

    /* 1. commands: acquire the producer's tail so the descriptor words below it are visible */
    if (c->q_count == 0) {
        uint64_t tail = atomic_load_explicit(c->tail, memory_order_acquire);
        uint64_t avail = tail - c->local_head;
        if (avail > e->ring_slots) {
            engine_fail(e, "rank %d channel %d: ring tail %llu is %llu slots ahead of head %llu "
                           "(ring holds %u): producer overran the ring", e->rank, c->idx,
                        (unsigned long long)tail, (unsigned long long)avail,
                        (unsigned long long)c->local_head, e->ring_slots);
            return -1;
        }
        int n = avail < LOCAL_QUEUE ? (int)avail : LOCAL_QUEUE;
        if (n) {
            for (int i = 0; i < n; i++) c->queue[i] = c->ring[(c->local_head + i) % e->ring_slots];
            c->q_first = 0;
            c->q_count = n;
            atomic_store_explicit(&c->queued, n, memory_order_release);
            c->local_head += (uint64_t)n;
            /* copied out: the producer may reuse these slots */
            atomic_store_explicit(c->head, c->local_head, memory_order_release);
            atomic_fetch_add_explicit(&c->stats[ST_POPPED], (uint64_t)n, memory_order_relaxed);
            if (e->inject & EFA_INJECT_SENDER) {
                for (int i = n - 1; i > 0; i--) {
                    int j = (int)(xorshift(&c->rng) % (uint64_t)(i + 1));
                    desc_t t = c->queue[i];
                    c->queue[i] = c->queue[j];
                    c->queue[j] = t;
                }
            }
            progressed = 1;
        }
    }

    /* 2. post: in order of the local queue; stop at the in-flight bound or -FI_EAGAIN */
    while (c->q_count) {
        int r = post_one(e, c, &c->queue[c->q_first]);
        if (r < 0) return -1;
        if (r == 0) break; /* progress the CQ below, retry next step */
        c->q_first++;
        c->q_count--;
        atomic_store_explicit(&c->queued, c->q_count, memory_order_release);
        progressed = 1;
    }

    /* 2b. a waiter asked whether a silent peer is still there */
    int pd = atomic_exchange_explicit(&c->probe_req, 0, memory_order_acq_rel);
    if (pd) {
        int r = probe_peer(e, c, pd - 1);
        if (r < 0) return -1;
        if (r == 0) atomic_store_explicit(&c->probe_req, pd, memory_order_relaxed);
    }

    /* 3. poll the completion queue (also drives manual progress for tcp/rxm) */
    int n = poll_cq(e, c);
    if (n < 0) return -1;
    if (n > 0) progressed = 1;

    /* 4. publish arrivals held back by fault injection */
    if (c->num_held && publish_held(e, c, 0) > 0) progressed = 1;
    return progressed;
}

static void *channel_main(void *arg) {
    channel *c = (channel *)arg;
    engine *e = c->eng;
    if (e->cpu_base >= 0) {
        /* pin before opening the endpoint so its memory and rings sit on this CPU's node */
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(e->cpu_base + c->idx, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    if (channel_open(c)) {
        atomic_store_explicit(&c->phase, PH_FAILED, memory_order_release);
        return NULL;
    }
    atomic_store_explicit(&c->phase, PH_READY, memory_order_release);

    /* wait for the creator to hand us the peers' names (or stop) */
    while (atomic_load_explicit(&c->phase, memory_order_acquire) != PH_PEERS_REQ) {
        if (atomic_load(&e->stop)) return NULL;
        sleep_us(100);
    }
    if (channel_insert_peers(c)) {
        atomic_store_explicit(&c->phase, PH_FAILED, memory_order_release);
        return NULL;
    }
    atomic_store_explicit(&c->phase, PH_RUNNING, memory_order_release);

    uint64_t idle_since = now_ns();
    while (!atomic_load_explicit(&e->stop, memory_order_acquire)) {
        int r = step(e, c);
        if (r < 0) {
            /* the engine error is set; keep draining the CQ so peers' writes still complete */
            while (!atomic_load(&e->stop)) {
                if (poll_cq(e, c) <= 0) sleep_us(200);
            }
            break;
        }
        if (e->linger_ns) {
            /* host-driven: busy while there is work or a host thread waits on the engine */
            uint64_t t = now_ns();
            if (r > 0 || c->num_held || c->q_count ||
                atomic_load_explicit(&c->inflight, memory_order_relaxed) ||
                atomic_load_explicit(&e->waiters, memory_order_acquire)) {
                idle_since = t;
            } else if (t - idle_since > e->linger_ns) {
                channel_block(e, c);
                idle_since = now_ns();
                continue;
            }
            if (r == 0) {
                /* only our own writes in flight, nobody waiting: the host is doing its own work
                 * (packing, copying out, reducing), so hand it the CPU on every idle turn */
                if (!atomic_load_explicit(&e->waiters, memory_order_relaxed)) sched_yield();
                else idle_wait(e, t, NULL);
            }
            continue;
        }
        if (r > 0 || c->num_held || atomic_load_explicit(&c->inflight, memory_order_relaxed))
            idle_since = r > 0 ? now_ns() : idle_since;
        if (r == 0) idle_wait(e, idle_since, &c->stats[ST_SLEEPS]);
    }
    if (c->num_held) publish_held(e, c, 1);
    return NULL;
}

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
        if (pthread_create(&e->ch[i].thread, NULL, channel_main, &e->ch[i])) {
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

int efa_post_messages(uint64_t handle, uint32_t msg, int n, const int64_t *dests,
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
            slot->w0 = ((uint64_t)dests[i] << 52) |
                       ((uint64_t)(msg & ((1u << EFA_MSG_BITS) - 1)) << 32) | len;
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
        channel_close(c);
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
