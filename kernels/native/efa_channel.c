/* efa_channel.c: one channel of the proxy engine (see efa_proxy.c for the overview): its
 * libfabric endpoint, window registration and peer addresses, and its thread: pop descriptors
 * from the command ring, post them as RMA writes with immediate data, poll the completion
 * queue, publish arrivals into the counters (held back and shuffled under fault injection).
 * Internal structures and helpers: efa_engine.h. */
#define _GNU_SOURCE
#include "efa_engine.h"

/* ---------------------------------------------------------------------------------------- */
/* Immediate data: source rank (12 bits) | generation (4 bits) | mark (8 bits) | message id (8). */
static inline uint32_t make_imm(int src, uint32_t gen, uint32_t msg, uint32_t mark) {
    return ((uint32_t)src << EFA_MSG_BITS) | ((gen & EFA_IMM_GEN_MASK) << EFA_IMM_GEN_SHIFT) |
           ((mark & EFA_IMM_MARK_MASK) << EFA_IMM_MARK_SHIFT) | (msg & EFA_IMM_MSG_MASK);
}

/* A peer's immediate is untrusted: its source must be in the group, its generation this
 * engine's, and (once the consumer published its round) its message one the consumer can be
 * waiting for: header or data of round s, or the header of round s + 1 (a peer that finished
 * round s early). A chunk mark may ride only on data of round s, within EFA_MARK_CHUNKS, once
 * per chunk and round. Anything else is a stray, replayed or forged write: reported, never
 * counted. The mark is stored before the arrival is counted: a consumer that saw the count has
 * every mark of it. */
static inline void publish_arrival(engine *e, channel *c, uint32_t imm) {
    uint32_t src = imm >> EFA_MSG_BITS;
    uint32_t gen = (imm >> EFA_IMM_GEN_SHIFT) & EFA_IMM_GEN_MASK, msg = imm & EFA_IMM_MSG_MASK;
    uint32_t mark = (imm >> EFA_IMM_MARK_SHIFT) & EFA_IMM_MARK_MASK;
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
    uint32_t rel = 0, s = 0;
    int checked = atomic_load_explicit(&e->check_msgs, memory_order_acquire);
    if (checked) {
        s = atomic_load_explicit(&e->expect_seq, memory_order_acquire);
        uint32_t lo = (2u * s) & EFA_IMM_MSG_MASK;
        rel = (msg - lo) & EFA_IMM_MSG_MASK;
        if (rel > 2) {
            engine_violation(e, "rank %d channel %d: stray or replayed write from rank %u: "
                                "message %u, expected %u..%u (round %u); rejected, not counted",
                             e->rank, c->idx, src, msg, lo, (lo + 2) & EFA_IMM_MSG_MASK, s);
            return;
        }
    }
    if (mark) {
        if (!checked || rel != 1 || mark > EFA_MARK_CHUNKS) {
            engine_violation(e, "rank %d channel %d: write from rank %u (message %u) carries chunk "
                                "mark %u: marks ride only on a round's data, 1..%d; rejected",
                             e->rank, c->idx, src, msg, mark, EFA_MARK_CHUNKS);
            return;
        }
        if (e->marks) {
            _Atomic uint32_t *m = &e->marks[(size_t)src * EFA_MARKS + (mark - 1)];
            uint32_t tag = efa_mark_tag(s);
            if (atomic_load_explicit(m, memory_order_relaxed) == tag) {
                engine_violation(e, "rank %d channel %d: chunk %u of rank %u's data (round %u) "
                                    "arrived twice; rejected", e->rank, c->idx, mark - 1, src, s);
                return;
            }
            atomic_store_explicit(m, tag, memory_order_release);
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
    uint32_t field = (uint32_t)((d->w0 >> 32) & ((1u << EFA_MSG_BITS) - 1));
    uint32_t msg = field & EFA_IMM_MSG_MASK;
    uint32_t mark = (field >> EFA_IMM_MARK_SHIFT) & EFA_IMM_MARK_MASK;
    int dest = (int)(d->w0 >> 52);
    uint64_t loff = (d->w1 >> 32) << 4, roff = (d->w1 & 0xffffffffu) << 4;
    if (len == 0) {
        /* no-op marker: completes through the counters without touching the wire */
        atomic_fetch_add_explicit(&c->stats[ST_NOOP], 1, memory_order_relaxed);
        publish_arrival(e, c, make_imm(e->rank, e->gen, msg, 0));
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
    uint32_t gen = e->gen, imsg = msg, imark = mark;
    int tamper = atomic_load_explicit(&e->tamper, memory_order_relaxed);
    if (tamper && (msg & 1) && dest != e->rank && (tamper != EFA_TAMPER_MARK || mark) &&
        !atomic_exchange_explicit(&e->tamper_done, 1, memory_order_relaxed)) {
        /* test-only faults on the first data write after arming (see EFA_TAMPER_*) */
        if (tamper == EFA_TAMPER_OFFSET) raddr += rb;     /* into the next source's region */
        if (tamper == EFA_TAMPER_MSG) imsg = msg + 16;    /* an id nobody waits for */
        if (tamper == EFA_TAMPER_REPLAY) imsg = msg - 2;  /* the previous round's data id */
        if (tamper == EFA_TAMPER_GEN) gen = e->gen + 1;   /* another transport's generation */
        if (tamper == EFA_TAMPER_MARK) imark = EFA_MARK_CHUNKS + 1; /* beyond the marked chunks */
    }
    uint32_t imm = make_imm(e->rank, gen, imsg, imark);
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

void *efa_channel_main(void *arg) {
    channel *c = (channel *)arg;
    engine *e = c->eng;
    /* timed naps end on time, not up to the default 50 us timer slack later */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    if (e->cpu_base >= 0) {
        /* pin before opening the endpoint so its memory and rings sit on this CPU's node */
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(e->cpu_base + c->idx, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    if (efa_channel_open(c)) {
        atomic_store_explicit(&c->phase, PH_FAILED, memory_order_release);
        return NULL;
    }
    atomic_store_explicit(&c->phase, PH_READY, memory_order_release);

    /* wait for the creator to hand us the peers' names (or stop) */
    while (atomic_load_explicit(&c->phase, memory_order_acquire) != PH_PEERS_REQ) {
        if (atomic_load(&e->stop)) return NULL;
        sleep_us(100);
    }
    if (efa_channel_insert_peers(c)) {
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
