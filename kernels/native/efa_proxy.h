/* efa_proxy.h: the native CPU proxy of efa-ep (C ABI, no Python, no torch types).
 *
 * An engine owns K channels. Each channel is one thread with its own libfabric fabric, domain,
 * RDM endpoint, completion queue (FI_CQ_FORMAT_DATA), address vector (FI_AV_TABLE) and memory
 * registration of the engine's window. Producers (torch code on the host, or a Triton kernel on
 * the GPU writing into pinned host memory) append 16-byte descriptors to a channel's command
 * ring and publish the ring's tail with a release store; the channel thread acquires the tail,
 * posts each descriptor as fi_writedata (an RMA write carrying 32 bits of immediate data) into
 * the destination rank's window, and releases the slots by advancing the head.
 *
 * The target side never infers completion from order (EFA's SRD delivers in no order): every
 * write carries imm = (source rank << 20) | (generation << 16) | (chunk mark << 8) | message id
 * (8 bits), and the target
 * channel thread (after checking source, generation and message id) adds one to its own counter
 * of (source, message id % num_slots) (host memory the receiver polls; see `counters` below) for
 * each remote completion it reads from its CQ. A receiver knows how many chunks a message has, so
 * it waits for that count (summed over the channels), never for "the last one".
 *
 * Memory the caller owns (allocated by Python, pinned when a GPU is present so a kernel can
 * reach it; all must outlive the engine):
 *   window   : window_bytes, 16-byte aligned; registered in every channel's domain. Descriptor
 *              offsets are relative to its base, locally and remotely (every rank lays its
 *              window out the same way). Host memory, or CUDA device memory when
 *              hmem_cuda_device >= 0 (registered with FI_HMEM_CUDA; the provider must offer
 *              FI_HMEM, see efa_probe_hmem). Rings, control words and counters stay in host memory.
 *   rings    : K * ring_slots * 2 uint64 (descriptor words, see EFA_DESC_* below).
 *   ring_ctrl: K * EFA_CTRL_STRIDE uint64; [ch*STRIDE + EFA_CTRL_TAIL] is written by the producer
 *              (release), [ch*STRIDE + EFA_CTRL_HEAD] by the channel thread (release). Separate
 *              cache lines so the two sides do not false-share.
 *   counters : num_channels * world * num_slots uint64 arrival counters, one set per channel:
 *              counters[(ch * world + src) * num_slots + msg % num_slots], written only by channel
 *              thread ch (atomic add, release), so channels never share a counter; waiters sum a
 *              (source, message) over the channels (acquire) and the consumer resets them.
 *
 * Descriptor (two little-endian uint64 words):
 *   w0 = dest_rank << 52 | (mark << 8 | msg_id) << 32 | length_bytes (32 bits); msg_id 8 bits,
 *        mark 8 bits (0: none; see "Chunk marks" below), the field's top 4 bits zero
 *   w1 = (local_offset >> 4) << 32 | (remote_offset >> 4)      (offsets 16-byte aligned, < 64 GiB)
 *   length 0 is a no-op marker: the thread counts it as an arrival from its own rank (used to
 *   measure the ring -> proxy -> counter round trip without the wire).
 *
 * Every function returns 0 on success or a negative errno-style code; on failure it writes a
 * message naming the verb, the peer and the message into err (errlen bytes, NUL-terminated).
 * Waits take a timeout in milliseconds and fail with -ETIMEDOUT naming the peer they waited for;
 * once the engine failed they return its failure: -EPROTO when a peer's write failed validation
 * (source, generation or message id of its immediate), -EIO for anything else (a failed write).
 */
#ifndef EFA_PROXY_H
#define EFA_PROXY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EFA_PROXY_ABI_VERSION 11
#define EFA_ADDR_MAX 256      /* bytes reserved per endpoint name (fi_getname) */
#define EFA_CTRL_STRIDE 16    /* uint64 per channel in ring_ctrl (128 bytes) */
#define EFA_CTRL_TAIL 0       /* producer index (next slot to write), monotonically increasing */
#define EFA_CTRL_HEAD 8       /* consumer index (next slot to read), monotonically increasing */
#define EFA_MSG_BITS 20
#define EFA_MAX_RANKS 4096    /* 12 bits of source rank in the immediate data */
/* imm = source rank << EFA_MSG_BITS | generation << EFA_IMM_GEN_SHIFT | mark << EFA_IMM_MARK_SHIFT
 * | message id (8 bits: a round's header 2s and data 2s + 1, mod 256) */
#define EFA_IMM_GEN_SHIFT 16
#define EFA_IMM_MARK_SHIFT 8
#define EFA_IMM_MSG_MASK 0xFFu
#define EFA_IMM_MARK_MASK 0xFFu
#define EFA_IMM_GEN_MASK 0xFu

/* Chunk marks: a receiver's kernel may read a source's first plane while the rest of the data
 * is still on the wire. Chunk j < EFA_MARK_CHUNKS of a marked data message carries mark j + 1;
 * on its arrival the channel thread stores the round's tag (efa_mark_tag of the consumer's
 * round) into marks[src * EFA_MARKS + j] (uint32, caller memory, efa_engine_set_marks), before
 * it counts the arrival. Index EFA_MARK_WHOLE of each source is the consumer's: it stores the
 * tag there once that source's data is wholly in (efa_engine_mark_whole), so a reader of a
 * chunk beyond the marked ones, or of an unmarked message, waits for that. A mark on anything
 * but a data message of the current round, beyond EFA_MARK_CHUNKS, or arriving twice in a round
 * is a protocol violation. Tags are never reset: a new round's differs from every older one. */
#define EFA_MARKS 256
#define EFA_MARK_CHUNKS 254
#define EFA_MARK_WHOLE 255
static inline uint32_t efa_mark_tag(uint64_t seq) { return (uint32_t)(seq & 0x3FFFFFFFu) + 1u; }

/* Tamper kinds (test-only): the first data write after efa_engine_tamper is altered. */
#define EFA_TAMPER_OFFSET 1   /* written past this rank's region (into the next source's) */
#define EFA_TAMPER_MSG 2      /* message id nobody waits for */
#define EFA_TAMPER_REPLAY 3   /* the previous round's data message id */
#define EFA_TAMPER_GEN 4      /* another generation */
#define EFA_TAMPER_MARK 5     /* a chunk mark beyond EFA_MARK_CHUNKS */

/* Inject flags (test-only fault injection). */
#define EFA_INJECT_TARGET 1   /* target side: hold completions, delay, publish shuffled in batches */
#define EFA_INJECT_SENDER 2   /* sender side: post popped descriptors in a shuffled order */

int efa_abi_version(void);

/* Checks that `provider` offers RDM endpoints with FI_RMA and FI_REMOTE_CQ_DATA. */
int efa_probe(const char *provider, char *err, size_t errlen);
/* Same, plus FI_HMEM with FI_MR_HMEM (device-memory windows). Whether CUDA memory really
 * registers is only known at efa_engine_create (fi_mr_regattr names the failure). */
int efa_probe_hmem(const char *provider, char *err, size_t errlen);

/* Creates the engine and starts its K channel threads; each thread pins itself (cpu_base >= 0:
 * channel c on CPU cpu_base + c), opens its endpoint and registers the window, then reports.
 * Returns once every thread reported ready (or the first init error, with the thread's verb). */
int efa_engine_create(const char *provider, int rank, int world, int num_channels,
                      void *window, uint64_t window_bytes, int hmem_cuda_device,
                      uint64_t *rings, uint32_t ring_slots, uint64_t *ring_ctrl,
                      uint64_t *counters, uint32_t num_slots,
                      int max_inflight, int spin_us, int inject, uint64_t seed, int cpu_base,
                      int timeout_ms, uint64_t *out_handle, char *err, size_t errlen);

/* Like efa_engine_create, hardened for the transport: source r may write only into its receive
 * region [recv_off + r * recv_stride, + recv_stride) of this window (one registration per region,
 * remote write only, key derived from key_seed: random per transport); the whole window is
 * registered for local access only (no remote read anywhere). node (tcp): the local address the
 * endpoint binds to (NULL/"" = provider's choice). gen (4 bits) rides in every immediate; an
 * arrival with another generation fails the engine. recv_stride 0 = one region, the whole window. */
int efa_engine_create_ex(const char *provider, int rank, int world, int num_channels,
                         void *window, uint64_t window_bytes, int hmem_cuda_device,
                         uint64_t *rings, uint32_t ring_slots, uint64_t *ring_ctrl,
                         uint64_t *counters, uint32_t num_slots,
                         int max_inflight, int spin_us, int inject, uint64_t seed, int cpu_base,
                         int timeout_ms, uint64_t recv_off, uint64_t recv_stride, uint64_t key_seed,
                         const char *node, uint32_t gen, uint64_t *out_handle, char *err,
                         size_t errlen);

/* Key and base of source src's receive region in this window, channel ch (what src needs). */
int efa_engine_region_info(uint64_t handle, int ch, int src, uint64_t *key, uint64_t *base,
                           char *err, size_t errlen);

/* The consumer is in round seq (message ids 2*seq, 2*seq+1): from now on an arrival whose
 * message id is not 2*seq, 2*seq+1 or 2*seq+2 (mod 2^16) fails the engine (stray/replayed). */
int efa_engine_expect(uint64_t handle, uint32_t seq);

/* Idle policy of the channel threads. linger_us > 0 (host-driven, for producers and waiters that
 * go through this API): a channel thread stays busy while it has work (queued, in flight) or a
 * thread is inside efa_wait_counters / efa_wait_idle, lingers linger_us after that, then blocks
 * (at most 1 ms at a time) until a waiter enters or a producer publishes (efa_post_messages,
 * efa_ring_push, efa_ring_publish). Frees the CPU for the host's own work where threads
 * outnumber cores. 0 (the default): spin spin_us after the last progress, then short sleeps
 * (producers that write the rings directly, e.g. a GPU, and wait outside the engine). */
int efa_engine_set_idle(uint64_t handle, int linger_us);

/* The chunk marks (see "Chunk marks"): marks [world * EFA_MARKS] uint32 of caller memory
 * (pinned when a GPU reads it), zeroed by the caller; NULL: none kept (arrivals still checked). */
int efa_engine_set_marks(uint64_t handle, uint32_t *marks);
/* The consumer's part of the marks: stores efa_mark_tag(seq) at EFA_MARK_WHOLE of every source
 * (the round's data is wholly in, or the round failed and nothing may wait for it any more). */
int efa_engine_mark_whole(uint64_t handle, uint64_t seq);

/* Test-only: arms one EFA_TAMPER_* fault (0 disarms). */
int efa_engine_tamper(uint64_t handle, int kind);

/* Channel ch's endpoint name (up to EFA_ADDR_MAX bytes), the remote key and base of this rank's
 * own receive region (the whole window for a one-region engine); base is the region's VA with
 * FI_MR_VIRT_ADDR, else 0; a writer adds (offset - region start) to it. */
int efa_engine_local_info(uint64_t handle, int ch, uint8_t *name, uint64_t *name_len,
                          uint64_t *key, uint64_t *base, char *err, size_t errlen);

/* Gives channel ch every rank's name/key/base (arrays indexed by rank; names EFA_ADDR_MAX apart).
 * The channel thread inserts them into its AV (so its domain stays single-threaded). */
int efa_engine_set_peers(uint64_t handle, int ch, const uint8_t *names, const uint64_t *name_lens,
                         const uint64_t *keys, const uint64_t *bases, int timeout_ms,
                         char *err, size_t errlen);

/* Producer side of ring ch: wait (bounded) until at least n slots are free. */
int efa_ring_wait_space(uint64_t handle, int ch, uint32_t n, int timeout_ms, char *err, size_t errlen);
/* Publish new_tail (release): the slots below it hold complete descriptors. */
int efa_ring_publish(uint64_t handle, int ch, uint64_t new_tail);
/* Convenience producer: copies n descriptors (2n words) into ring ch with back-pressure. */
int efa_ring_push(uint64_t handle, int ch, const uint64_t *descs, uint32_t n, int timeout_ms,
                  char *err, size_t errlen);

/* Producer for whole messages (the host path of a round: no per-chunk work in the caller): cuts
 * message i (sizes[i] bytes at local_offs[i] of this window, to remote_offs[i] of rank dests[i]'s
 * window) into chunk_bytes chunks in order; mark0 > 0 marks them: chunk k of each message
 * carries mark mark0 + k while that is at most EFA_MARK_CHUNKS (0: none). Chunk j of the call
 * goes to channel (*next_channel + j) % num_channels, and *next_channel advances past the last
 * one. Waits (bounded)
 * for ring space, publishing what it wrote first; publishes every ring's tail (release) at the end.
 * Offsets 16-byte aligned, sizes > 0. */
int efa_post_messages(uint64_t handle, uint32_t msg, uint32_t mark0, int n, const int64_t *dests,
                      const int64_t *local_offs, const int64_t *remote_offs, const int64_t *sizes,
                      uint32_t chunk_bytes, uint32_t *next_channel, int timeout_ms, char *err,
                      size_t errlen);

/* Waits until the arrivals of (srcs[i], msg), summed over the channels, reach expected[i] for
 * every i, then (reset != 0) stores 0 into those counters so the slot can serve a later message. */
int efa_wait_counters(uint64_t handle, uint32_t msg, int n, const int32_t *srcs,
                      const uint64_t *expected, int reset, int timeout_ms, char *err, size_t errlen);

/* Waits until every ring is drained and every posted write has completed locally (the window's
 * send side may be reused). Names the oldest outstanding (peer, message) on timeout. */
int efa_wait_idle(uint64_t handle, int timeout_ms, char *err, size_t errlen);

/* Per-channel statistics, 8 uint64 per channel: descriptors popped, writes posted, local write
 * completions, remote arrivals, -FI_EAGAIN retries, no-op markers, max in flight, idle sleeps. */
int efa_engine_stats(uint64_t handle, uint64_t *out, int n);

/* Geometry of an engine (any pointer may be NULL): what the benchmark entry points need. */
int efa_engine_query(uint64_t handle, int *rank, int *num_channels, uint32_t *ring_slots,
                     uint64_t *window_bytes);

/* Benchmark entry points (efa_bench.c; the caller thread is the producer, no Python between ops):
 * round trip: iters times { push one descriptor into ring ch: an RMA write of len bytes to this
 * rank's own window through the wire (len 0: the no-op marker, ring -> proxy -> counter without
 * the wire); wait until its arrival is counted }. out_ns[i] = nanoseconds of op i. Uses message
 * ids msg0 .. msg0 + iters - 1 (keep them clear of live transport traffic). */
int efa_bench_roundtrip(uint64_t handle, int ch, uint32_t len, uint32_t msg0, int iters,
                        uint64_t *out_ns, int timeout_ms, char *err, size_t errlen);
/* Issue rate: one producer thread per channel pushes n descriptors (len bytes each, to this
 * rank) into its ring (with back-pressure); waits until all n * nch arrivals are counted for
 * message msg (each channel counts its own); *out_ns = elapsed nanoseconds. */
int efa_bench_rate(uint64_t handle, int nch, uint32_t n, uint32_t len, uint32_t msg,
                   uint64_t *out_ns, int timeout_ms, char *err, size_t errlen);

/* ---------------------------------------------------------------------------------------- */
/* One round of the transport's wire protocol in native code (efa_round.c, a client of the ABI
 * above), for a host or a device window (`window_kind`). Python (kernels/proxy/wire.py) owns the
 * struct and fills the round's inputs; the calls below run the round with no per-message or
 * per-peer Python:
 *   efa_wire_begin    wait until our previous writes left the send side; enter round `seq`
 *                     (efa_engine_expect); build every peer's header in the window; lay out the
 *                     send area (`plan`) and the data messages (`msgs`); post the headers.
 *   (caller)          packs the planes at plan[p * world + d] (rows to rank d, plane p)
 *   efa_wire_exchange wait for every peer's header; copy them to `got`; check them
 *                     (efa_wire_check_headers); write the footers; post the data. A header
 *                     that is not clean posts nothing and returns check_headers' code.
 *   efa_wire_finish   wait for every peer's data (chunk counts from its header), check each
 *                     footer [rows, round tag]: -EPROTO with bad_peer set and the text in err.
 * A failed wait's text names the peer, the message, the operation and the round.
 * Header: int64 [status, op, rows, row_bytes, chunks, round tag, row format, extras...] then
 * error text. Messages: header 2*seq, data 2*seq+1 (mod 2^16). Send area (contiguous, from
 * off_data_send): plane p of every destination in rank order, each destination's start 16-byte
 * aligned, then the footers; a receiver reads source r's message at its own fixed region:
 * planes at off_recv + r * region_bytes + 2 * hdr_bytes, each 16-byte aligned, then the footer.
 * Every field is int64 (or a pointer) so the layout is the same from ctypes. */
#define EFA_HDR_FIXED 7
#define EFA_MAX_PLANES 4
typedef struct efa_wire {
    /* fixed at setup */
    uint64_t engine;
    uint8_t *window;
    int64_t rank, world, hdr_fields, num_extra;
    int64_t hdr_len, hdr_bytes, hdr_chunks;
    int64_t off_hdr_send, off_data_send, send_bytes, off_recv, region_bytes;
    int64_t chunk_bytes, max_rows, timeout_ms;
    uint32_t *next_channel; /* producer's channel rotation (shared with the Python producers) */
    int64_t *msgs;          /* scratch: 4 x max_msgs (dests, local offs, remote offs, sizes) */
    int64_t max_msgs;       /* >= world * (EFA_MAX_PLANES + 1) */
    int64_t *hmsgs;         /* scratch: 4 x world, the header messages */
    int32_t *wait_srcs;     /* scratch: world */
    uint64_t *wait_expected;/* scratch: world */
    /* one round: inputs */
    int64_t seq, op, status, nplanes, tag, fmt, row_bytes;
    int64_t widths[EFA_MAX_PLANES];
    int64_t *rows_to;       /* [world] rows to each rank (own entry ignored) */
    int64_t *extras;        /* [world * num_extra] or NULL */
    int64_t *n_recv;        /* [world] rows expected from each rank, or NULL (learned) */
    /* one round: outputs */
    int64_t *plan;          /* [(EFA_MAX_PLANES + 1) * world]: plane p / footer (row EFA_MAX_PLANES) of dest d, -1 none */
    int64_t *got;           /* [world * hdr_fields]: the peers' headers (own row zero) */
    int64_t *rows_from;     /* [world] */
    int64_t nmsgs, bad_peer;
    int64_t r_writes, r_wire_bytes, r_messages, r_rows; /* what this round handed to the engine */
    int64_t wait_ns;        /* cumulative time blocked in the engine's waits (and, through
                             * copies, on the stream) */
    /* How the round reaches the window: EFA_WINDOW_DIRECT (a host window, read and written in
     * place); EFA_WINDOW_CUDA (a device window: the headers and footers are built and read in
     * `stage`, pinned host memory, and copied by the CUDA driver on `stream`, the caller's
     * current stream, which each round synchronizes: also the caller's packing kernels);
     * EFA_WINDOW_COPIED (a host window reached only through memcpy of the same stage: the
     * CPU stand-in that runs the device window's steps in the tests). */
    int64_t window_kind;
    uint8_t *stage;         /* [efa_wire_stage_bytes] or NULL (direct): see below */
    uint64_t stream;        /* CUstream of the copies (EFA_WINDOW_CUDA; 0 = the legacy stream) */
} efa_wire;

#define EFA_WINDOW_DIRECT 0
#define EFA_WINDOW_CUDA 1
#define EFA_WINDOW_COPIED 2
/* The stage of a window reached through copies: the headers to send [world][hdr_bytes] (the
 * caller may edit them between efa_wire_begin(post_headers=0) and efa_wire_post_headers: an
 * error text), the peers' headers of the round [world][hdr_len] (with their error texts), the
 * footers to send [world][16] (in destination order, as in the send area), the footers
 * received [world][16] (by source). */
int64_t efa_wire_stage_bytes(int64_t world, int64_t hdr_bytes, int64_t hdr_len);

int efa_wire_begin(efa_wire *w, int post_headers, char *err, size_t errlen);
int efa_wire_post_headers(efa_wire *w, char *err, size_t errlen);
int efa_wire_exchange(efa_wire *w, int post_data, char *err, size_t errlen);
int efa_wire_post_data(efa_wire *w, char *err, size_t errlen);
int efa_wire_finish(efa_wire *w, char *err, size_t errlen);

/* The checks of the peers' headers already in `got` (rows_from set when clean), in the order
 * every rank applies them, so every rank raises the same error from the same headers. Returns 0;
 * EFA_RC_GROUP_INPUT: some rank (this one: status != 0) reports bad input, whose texts the
 * caller reads from the headers; EFA_RC_GROUP_MISMATCH: ranks are in different operations or
 * row formats (text in err); EFA_RC_HANDLE_MISMATCH: a peer sends other row counts than n_recv
 * (text); -EPROTO: a protocol violation (status, round tag, rows beyond max_rows, chunk count;
 * text naming the peer). */
#define EFA_STATUS_BAD_INPUT 4 /* kernels/base.py STATUS_BAD_INPUT */
#define EFA_RC_GROUP_INPUT 1
#define EFA_RC_GROUP_MISMATCH 2
#define EFA_RC_HANDLE_MISMATCH 3
#define EFA_RC_LOCAL_INPUT 4
int efa_wire_check_headers(efa_wire *w, char *err, size_t errlen);

/* ---------------------------------------------------------------------------------------- */
/* Operations (efa_op.c): a whole dispatch, dispatch_cached or combine on a host window in two
 * calls, post and complete; the caller allocates the outputs in between (their sizes come from
 * the checked headers). The calling thread does all of it (it blocks in the waits, bounded by
 * the wire's timeout_ms); one operation at a time per struct. Rows are row_bytes bytes; tokens
 * int64; every array is caller memory, sized at setup and reused (no allocation here).
 *   dispatch: post = routing layout of topk_idx/weights [tokens, topk] into send_idx [cap] and
 *             meta (value checks: EFA_RC_LOCAL_INPUT with flags as efa_route_layout's, nothing
 *             sent), headers, x's rows and the routing rows packed, headers checked, data posted;
 *             rows = S, num_send[W], counts[E], num_recv[W] (this rank's own included) set.
 *             complete = own rows, data waited for, footers checked, recv_x [sum num_recv, row]
 *             filled in source order, routing rows checked and unpacked into recv_idx [N, topk]
 *             int64, recv_w [N, topk] float32, tokens_per_expert [num_local] int64.
 *   cached:   post = x's rows send_idx[S] (grouped by num_send) packed, n_recv = num_recv;
 *             complete = recv_x as dispatch's.
 *   combine:  x = y [sum num_recv, row] grouped by destination; post = rows back to their
 *             sources; complete = out [tokens, row] = the float32 sum over source ranks in
 *             ascending order, rounded once (efa_reduce_rows; dtype EFA_DT_*; returns 1 when a
 *             sum is NaN: the caller recomputes).
 * Returns: 0; a check_headers code (post); EFA_RC_LOCAL_INPUT (dispatch post); -EPROTO with the
 * violation named (bad_peer, kind set for routing rows); other -errno with the text in err. */
typedef struct efa_op {
    efa_wire *wire;
    int64_t gen, num_experts, num_local;
    int64_t *meta;          /* [meta_rows * 2 * topk] int64: the dispatch's routing rows */
    int64_t meta_rows;
    int32_t *slot;          /* [slot_cap] combine's scratch (world * tokens) */
    int64_t slot_cap;
    int64_t *scratch;       /* [2 * world + 2 + num_local] */
    int64_t *aux;           /* [3 * world] */
    int64_t *counts;        /* [num_experts] */
    int64_t *num_send, *num_recv; /* [world] each */
    /* one call */
    int64_t seq, tokens, row_bytes, fmt, topk, cap, dtype;
    const uint8_t *x;
    const int64_t *topk_idx;
    const float *weights;
    int64_t *send_idx;
    uint8_t *recv_x;
    int64_t *recv_idx;
    float *recv_w;
    int64_t *tokens_per_expert;
    void *out;
    int64_t rows, flags, bad_peer, kind;
    /* dispatch_packed: the count block the device writes into host memory, [2 + world +
     * num_experts] int64: status, rows to each rank, (token, expert) pairs per expert, then the
     * ready word (1 once the rest is written; the caller zeroes it before the launch) */
    const volatile int64_t *dev_counts;
    /* the packed kinds: [progress_words] int64 the device writes, one per
     * storing program: the chunks of chunk_rows send rows (rank-major) it has stored; zeroed by
     * the caller */
    const volatile int64_t *progress;
    int64_t progress_words, chunk_rows;
} efa_op;

int efa_op_dispatch_post(efa_op *o, char *err, size_t errlen);
int efa_op_dispatch_complete(efa_op *o, char *err, size_t errlen);
int efa_op_cached_post(efa_op *o, char *err, size_t errlen);
int efa_op_cached_complete(efa_op *o, char *err, size_t errlen);
int efa_op_combine_post(efa_op *o, char *err, size_t errlen);
int efa_op_combine_complete(efa_op *o, char *err, size_t errlen);
/* The same rounds with the rows packed by the device (GPU stores into the window's send area,
 * plane 0 one run of the peers' rows in rank order; rows a multiple of 16 bytes), for CUDA
 * inputs on a host window. Each starts with `begin`, which posts the headers, so the header
 * exchange runs while the device is still storing the rows:
 *   dispatch_packed: begin = waits (deadline timeout_ms) for dev_counts' ready word, then takes
 *             the status, num_send[W] and counts[E] from it: EFA_RC_LOCAL_INPUT with flags = the
 *             status when the device flagged the routing (nothing sent, no round taken); else
 *             the headers posted. post = headers checked, then each destination's rows
 *             posted as the device's progress words say they are stored (cut at the wire's
 *             chunk boundaries), then, every row stored, meta (every sent row's routing row,
 *             rank-major) packed and posted with the footers (deadline timeout_ms for the
 *             device). complete = dispatch's without the row copies (the device reads the
 *             peers' rows from the window).
 *   cached_packed: as combine_packed, for a cached dispatch's rows (num_send[d] to rank d,
 *             num_recv[r] from rank r); complete = the data waited for and its footers checked
 *             (the caller copies the rows out of the window).
 *   combine_packed: begin = the headers posted (the counts are the handle's); post = headers
 *             checked, each destination's rows posted as the progress words say they are
 *             stored, then the footers; complete = the data waited for and its footers checked (the
 *             device reduces). */
int efa_op_dispatch_packed_begin(efa_op *o, char *err, size_t errlen);
int efa_op_dispatch_packed_post(efa_op *o, char *err, size_t errlen);
int efa_op_dispatch_packed_complete(efa_op *o, char *err, size_t errlen);
int efa_op_cached_packed_begin(efa_op *o, char *err, size_t errlen);
int efa_op_cached_packed_post(efa_op *o, char *err, size_t errlen);
int efa_op_cached_packed_complete(efa_op *o, char *err, size_t errlen);
int efa_op_combine_packed_begin(efa_op *o, char *err, size_t errlen);
int efa_op_combine_packed_post(efa_op *o, char *err, size_t errlen);
int efa_op_combine_packed_complete(efa_op *o, char *err, size_t errlen);
/* ---------------------------------------------------------------------------------------- */
/* A packed operation from the send side's quiesce to the kernel that reads what arrived, in one
 * call (efa_devop.c): the kernels go through the launch library (its efa_launch_run /
 * efa_launch_event_record / efa_launch_event_wait, addresses in run, event_record, event_wait),
 * whose programs' variables the caller has set for this call. With `early` the reading kernel
 * is launched right after the round's post, before its complete: it waits (on the device) for
 * the chunk marks of the rows it reads and for the whole marks (efa_engine_mark_whole, stored
 * after the complete, whatever it returned) for the rest, so it reads while the data still
 * arrives; without, it is launched after the complete (the order below otherwise).
 *   efa_devop_dispatch: our previous writes waited for (the wire's deadline), the progress words
 *       and the count block's ready word zeroed, the packing program `pack` launched on stream,
 *       the previous op's reads waited for (wait_event, 0: none), then dispatch_packed begin
 *       and post; on return recv_off[W + 1] is the prefix of the rows from each source and
 *       own_start the rows sent before this rank's own (o->recv_idx / recv_w hold routing_cap
 *       elements: checked here). The caller then allocates the outputs, sets the program
 *       `reads`' variables and calls efa_devop_dispatch_finish: `reads` launched, the round's
 *       complete (the routing rows unpacked into recv_idx / recv_w), the whole marks, then
 *       reads_event recorded (0: none).
 *   efa_devop_rows: the same front for combine_packed (kind EFA_DEVOP_COMBINE) or cached_packed
 *       (EFA_DEVOP_CACHED) rounds, then the round's begin and post, send_off[W + 1] (where
 *       given) the prefix of num_send, `reads` launched (0: none: the caller reads after the
 *       call), the complete, the whole marks (when reads ran) and the event.
 * step says how far a call got (EFA_STEP_*): a non-zero return is that step's (its codes as the
 * step's own function returns them). */
#define EFA_DEVOP_DISPATCH 1
#define EFA_DEVOP_COMBINE 2
#define EFA_DEVOP_CACHED 3
enum { EFA_STEP_QUIESCE = 1, EFA_STEP_LAUNCH = 2, EFA_STEP_WAIT_READS = 3, EFA_STEP_BEGIN = 4,
       EFA_STEP_POST = 5, EFA_STEP_COMPLETE = 6, EFA_STEP_READS = 7, EFA_STEP_DONE = 8 };
typedef struct efa_devop {
    int64_t run, event_record, event_wait; /* the launch library's entry points */
    int64_t stream;                        /* CUstream of the launches */
    int64_t pack, reads;                   /* program addresses (efa_launch_run's) */
    int64_t wait_event, reads_event;       /* CUevent handles, 0: none */
    int64_t kind;                          /* EFA_DEVOP_* */
    int64_t early;                         /* 1: reads launched before the complete (they
                                              follow the marks); 0: after it */
    int64_t *recv_off;                     /* dispatch: [W + 1] out */
    int64_t *send_off;                     /* rows ops: [W + 1] out (0: none) */
    int64_t routing_cap;                   /* dispatch: elements of o->recv_idx / o->recv_w */
    int64_t own_start;                     /* dispatch: out */
    int64_t step;                          /* out: EFA_STEP_* */
} efa_devop;
int efa_devop_dispatch(efa_op *o, efa_devop *d, char *err, size_t errlen);
int efa_devop_rows(efa_op *o, efa_devop *d, char *err, size_t errlen);
int efa_devop_dispatch_finish(efa_op *o, efa_devop *d, char *err, size_t errlen);
/* The step clock, for probes: with out (CLOCK_KINDS x (1 + EFA_STEP_DONE + 1) int64: per kind of
 * call (efa_devop_dispatch, efa_devop_dispatch_finish, efa_devop_rows) its calls, then the
 * nanoseconds spent in each step, step 0 being the time before the first), the sums since the
 * last call; then resets them and turns the clock on or off (out NULL: none of that). Returns
 * the number of int64 out holds. One caller thread at a time. */
int efa_devop_step_clock(int on, int64_t *out);
/* The text of a routing-rows problem efa_unpack_meta found in source src's n rows m [n, 2K]
 * (hdr_counts: the L counts of its header); returns -EPROTO. */
int efa_describe_meta(efa_wire *w, int64_t src, const int64_t *m, int64_t n, int64_t K, int64_t L,
                      const int64_t *hdr_counts, char *err, size_t errlen);

/* ---------------------------------------------------------------------------------------- */
/* Host-side data path helpers (efa_host.c; plain C over caller memory, no engine). */

/* Routing layout of one rank's T tokens (topk_idx [T, K] int64, weights [T, K] float32), the
 * reference being kernels/base.py compute_send_layout: rows are grouped by destination rank
 * ascending, tokens ascending inside a group. Writes send_idx [S] (source token of each row),
 * meta [S, 2K] int64 (local expert id or -1, then the weight's float bits sign-extended, 0 where
 * the id is -1), num_send [W], counts [E] ((token, expert) pairs per expert, i.e. [W, L]).
 * scratch: 2 * W int64. Capacity of send_idx / meta: cap rows. Returns S >= 0, or -1 with
 * *flags = 1 (an expert id outside [-1, E)) | 2 (a NaN/Inf weight) and nothing else written,
 * or -ENOSPC if S would exceed cap. */
int64_t efa_route_layout(const int64_t *topk_idx, const float *weights, int64_t T, int64_t K,
                         int64_t E, int64_t W, int64_t *send_idx, int64_t *meta, int64_t cap,
                         int64_t *num_send, int64_t *counts, int64_t *scratch, int64_t *flags);

/* Received routing rows -> recv_topk_idx [N, K] int64, recv_topk_weights [N, K] float32 and
 * tokens_per_expert [L] int64, sources in rank order (src_meta[r]: address of n[r] rows of 2K
 * int64). Sources with check[r] != 0 are validated (ids in [-1, L), >= 1 id per row, weight bits
 * 0 where the id is -1, finite weights, per-expert counts equal to hdr_counts + r * hdr_stride):
 * returns the first bad source (>= 0) with *kind set, or -1 when all are good. scratch: L int64. */
int64_t efa_unpack_meta(int64_t W, int64_t K, int64_t L, const int64_t *src_meta, const int64_t *n,
                        const int64_t *check, const int64_t *hdr_counts, int64_t hdr_stride,
                        int64_t *out_idx, float *out_w, int64_t *tokens_per_expert,
                        int64_t *scratch, int64_t *kind);

/* Combine's reduction, fused: out[t] = sum over ranks r ascending of float(rows_r[j]) for the row
 * j of rank r whose token is t (idx_r[j] == t), starting from +0.0 and rounded once to the output
 * dtype (round to nearest even), i.e. kernels/base.py reduce_rows_by_rank(...).to(dtype) bit for
 * bit. rows[r], idx[r]: addresses of n[r] rows of D elements / n[r] int64 tokens. dtypes:
 * EFA_DT_F32 / EFA_DT_BF16 in, the same out. slot: W * T int32 scratch. Returns 0; 1 if a sum is
 * NaN (the caller recomputes with torch: NaN payloads are not specified); -EINVAL for a token
 * outside [0, T) or twice in one rank's rows. */
#define EFA_DT_F32 1
#define EFA_DT_BF16 2
int efa_reduce_rows(int64_t W, int64_t T, int64_t D, int64_t in_dtype, int64_t out_dtype,
                    const int64_t *rows, const int64_t *n, const int64_t *idx, int32_t *slot,
                    void *out);

/* Stops every thread (waiters return -ECANCELED), closes endpoints. Idempotent. */
int efa_engine_stop(uint64_t handle);
/* Stops if needed and frees the engine. The handle is invalid afterwards. */
int efa_engine_destroy(uint64_t handle);

#ifdef __cplusplus
}
#endif
#endif /* EFA_PROXY_H */
