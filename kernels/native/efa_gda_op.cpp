// efa_gda_op.cpp: a planned gda regular dispatch, fixed-capacity dispatch, combine and cached
// dispatch, each as one C++ call (a torch extension).
//
// The Python path of a planned dispatch (kernels/gda/phases.py) makes a dozen tensor objects per
// call (scratch, outputs, their views, tokens_per_expert) and packs three programs' variables
// before its one native call (efa_launch_dispatch of kernels/native/efa_launch.c). This does the
// same here: the scratch and the outputs carved out of one allocation (see carve), the variables
// written straight into the programs, the native call through its function pointer, then the
// views of a call that gathered. Python keeps
// the plan, the checks of a call that did not gather, and the handle. Built on first use by
// kernels/gda/cpp_op.py (torch.utils.cpp_extension); without it the Python path runs.
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "efa_tensor_views.h"

namespace {

// efa_program_t of efa_launch.h: only its variables are written here
struct Program {
    void *recs;
    int64_t num_recs;
    const int64_t *uses;
    int64_t num_uses;
    int64_t *vars;
    int64_t graph_mode;
    void *graph;
};

typedef int (*GatedFn)(const void *, const void *, int64_t, int64_t *, int, int, int64_t, int64_t,
                       const int64_t *, int64_t, int64_t, int64_t *, int64_t *, char *, size_t);

typedef int (*RunFn)(const void *, int64_t, char *, size_t);

typedef int (*CopyFn)(int64_t, int64_t, int64_t, int64_t, char *, size_t);

typedef int (*DispatchFn)(const void *, const void *, const void *, int64_t, int64_t *, int, int,
                          int64_t, int64_t, const int64_t *, int64_t, int64_t, const int64_t *,
                          int64_t *, int64_t *, int64_t *, char *, size_t);

// The plan's constants, an int64 array the caller keeps (kernels/gda/cpp_op.py, PLAN_FIELDS).
enum {
    P_FN, P_FRONT, P_HEADER, P_GATHER, P_GATE, P_WORLD, P_RANK, P_SPIN_NS, P_FLAG, P_WAIT_NS,
    P_SHAPE, P_ROWS, P_WORDS, P_O_SLOT, P_O_SEND, P_O_RANK, P_O_OUT, P_O_OFFSETS, P_N_INFO,
    P_LOCAL, P_HIDDEN, P_TOPK, P_TOKENS, P_RUN, P_MERGED, P_NUM_FIELDS
};

// A compact dispatch plan's constants (kernels/gda/compact.py, COMPACT_FIELDS).
enum {
    K_FN, K_COUNTS, K_ROWS, K_HEADER, K_GATE, K_GATE_FN, K_RUN, K_WORLD, K_RANK, K_SPIN_NS,
    K_FLAG, K_WAIT_NS, K_SHAPE, K_ROWS_OUT, K_WORDS, K_O_SLOT, K_O_SEND, K_O_RANK, K_O_OUT,
    K_O_OFFSETS, K_N_INFO, K_LOCAL, K_HIDDEN, K_TOPK, K_TOKENS, K_DATA_OFF, K_IDX_OFF, K_W_OFF,
    K_COPY, K_IDS_ROWS, K_HEADER_IDS, K_NUM_FIELDS
};

typedef int (*GateFn)(int64_t *, int, int, int64_t, int64_t, int64_t *);

// A fixed-capacity dispatch plan's constants (kernels/gda/fixed.py, FIXED_FIELDS).
enum {
    F_FN, F_FRONT, F_HEADER, F_GATE, F_WORLD, F_RANK, F_SPIN_NS, F_WORDS, F_O_SLOT, F_O_SEND,
    F_LOCAL, F_HIDDEN, F_TOPK, F_TOKENS, F_T_MAX, F_NUM_FIELDS
};

// A fixed-capacity handle's cached dispatch plan (kernels/gda/fixed.py, FIXED_CACHED_FIELDS).
enum { FC_FN, FC_STORE, FC_WAIT, FC_GATE, FC_WORLD, FC_RANK, FC_SPIN_NS, FC_ROWS, FC_NUM_FIELDS };

// A combine plan's constants (kernels/gda/cpp_op.py, COMBINE_FIELDS).
enum {
    C_FN, C_STORE, C_REDUCE, C_GATE, C_WORLD, C_RANK, C_SPIN_NS, C_MAX_GRID, C_FIXED_ROWS,
    C_NUM_FIELDS
};

// The host-time trace of the last call (see trace()): steady-clock nanoseconds at its entry,
// before its native call, after it, and before its result is built, then the native call's
// device and gate waits, then (a compact dispatch only, else 0) before and after its received
// ids' allocation and copy. Off unless a probe turns it on: one branch per stamp.
bool g_trace_on = false;
int64_t g_trace[8];

inline void stamp(int i) {
    if (g_trace_on) {
        g_trace[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now().time_since_epoch())
                         .count();
        if (i == 0) g_trace[6] = g_trace[7] = 0;
    }
}

inline void waits(int64_t sync_ns, int64_t gate_ns) {
    if (g_trace_on) {
        g_trace[4] = sync_ns;
        g_trace[5] = gate_ns;
    }
}

}  // namespace

// Turns the host-time trace on or off and returns the last traced call's
// (entry, before native, after native, before result, sync_ns, gate_ns, before the ids' copy,
// after it (0, 0: not a compact dispatch)); the clock is
// CLOCK_MONOTONIC's, as Python's time.perf_counter_ns(). For the probes (never on in a run).
py::tuple trace(bool on) {
    g_trace_on = on;
    return py::make_tuple(g_trace[0], g_trace[1], g_trace[2], g_trace[3], g_trace[4],
                          g_trace[5], g_trace[6], g_trace[7]);
}

// Status of a dispatch whose inputs are not the plan's clean case (see inputs_fit): nothing
// ran, the caller takes the checked path.
constexpr int NOT_PLANNED = 100;

// Status of a dispatch with rows_in_window=auto whose choice is the other way than its plan's
// (regular or compact): nothing ran, its size is posted; the caller runs the other way.
constexpr int OTHER_WAY = 102;

// The choice of option rows_in_window=auto (kernels/gda/gate.py, LaunchGate.next_dispatch: the
// same steps, the same count), from `block` (LaunchGate.choice_block: [count, address of the
// parity 0 sizes, of parity 1, world, rank, threshold rows]): posts this dispatch's size (rows
// it sends at most, T x min(W, K); 0 for ids that are not [T, K]) and returns whether the
// largest size every rank posted for the previous dispatch reaches the threshold (no answer,
// false: the first dispatch, or a slot stamped with another dispatch).
static bool compact_chosen(int64_t block, const at::Tensor &topk_idx) {
    int64_t *a = reinterpret_cast<int64_t *>(block);
    if (a[1] == 0) return false;  // the gate is closed
    const int64_t count = ++a[0], w = a[3];
    int64_t largest = -1;
    if (count > 1) {
        const int64_t *s = reinterpret_cast<const int64_t *>(a[1 + ((count - 1) & 1)]);
        int64_t most = -1, r = 0;
        for (; r < w; r++) {  // a peer writes its size, then its stamp
            if (__atomic_load_n(&s[2 * r], __ATOMIC_ACQUIRE) != count - 1) break;
            most = std::max(most, __atomic_load_n(&s[2 * r + 1], __ATOMIC_RELAXED));
        }
        if (r == w) largest = most;
    }
    const bool ids = topk_idx.dim() == 2;
    const int64_t rows = ids ? topk_idx.size(0) * std::min(w, topk_idx.size(1)) : 0;
    int64_t *mine = reinterpret_cast<int64_t *>(a[1 + (count & 1)]) + 2 * a[4];
    __atomic_store_n(&mine[1], rows, __ATOMIC_RELAXED);
    __atomic_store_n(&mine[0], count, __ATOMIC_RELEASE);
    return largest >= a[5];
}

using efa_views::carve;
using efa_views::on;
using efa_views::up256;

// rows [num_rows, D] with dense rows on `device` (see on), for combine and cached dispatch
static bool rows_fit(const at::Tensor &a, int64_t num_rows, int64_t device) {
    return a.dim() == 2 && a.size(0) == num_rows && (a.stride(1) == 1 || a.size(1) == 1) &&
           on(a, device);
}

// Whether a dispatch's inputs are the case the plan was bound for, as the caller found it by
// (top-k shape, x's dtype, x's row stride, x's width): x [T, H] rows dense, topk_idx [T, K]
// int64 and topk_weights [T, K] float32 contiguous, all on CUDA device `device`, each 16-byte
// aligned (`device` -2: CPU tensors, for the host-only stand-in of the tests). The caller's
// checks produce the error for anything else (this only decides).
static bool inputs_fit(const at::Tensor &x, const at::Tensor &idx, const at::Tensor &w,
                       int64_t t, int64_t k, int64_t device) {
    return x.dim() == 2 && x.size(0) == t && x.stride(1) == 1 && on(x, device) &&
           idx.dim() == 2 && idx.size(0) == t && idx.size(1) == k &&
           idx.scalar_type() == at::kLong && idx.is_contiguous() && on(idx, device) &&
           w.dim() == 2 && w.size(0) == t && w.size(1) == k && w.scalar_type() == at::kFloat &&
           w.is_contiguous() && on(w, device);
}


// The dispatch's outputs [rows, H] in x's dtype, [rows, K] int64, [rows, K] float32 carved from
// `buf` at `at` bytes on (256-byte aligned each: the gather's kernel was bound for 16-byte
// aligned outputs); returns the bytes they take.
static int64_t outputs_bytes(int64_t rows, int64_t hidden, int64_t k, int64_t elem) {
    return up256(rows * hidden * elem) + up256(rows * k * 8) + up256(rows * k * 4);
}

struct Outputs {
    at::Tensor x, idx, w;
};

// The addresses of the outputs [rows, H] in x's dtype, [rows, K] int64, [rows, K] float32 laid
// out from byte `at` of `buf` on (256-byte aligned each: the gather's kernel was bound for 16-byte
// aligned outputs), for the kernels' variables before any view of them is made.
struct OutputAddrs {
    int64_t at_x, at_idx, at_w;  // byte offsets in buf
    int64_t x, idx, w;           // addresses
};

static OutputAddrs output_addrs(const at::Tensor &buf, int64_t at, int64_t rows, int64_t hidden,
                                int64_t k, int64_t elem) {
    OutputAddrs a;
    a.at_x = at;
    a.at_idx = a.at_x + up256(rows * hidden * elem);
    a.at_w = a.at_idx + up256(rows * k * 8);
    const int64_t base = reinterpret_cast<int64_t>(buf.data_ptr());
    a.x = base + a.at_x;
    a.idx = base + a.at_idx;
    a.w = base + a.at_w;
    return a;
}

// The outputs' views of their first n rows, laid out by output_addrs in buf.
static Outputs carve_outputs(const at::Tensor &buf, const OutputAddrs &a, int64_t n,
                             int64_t hidden, int64_t k, at::ScalarType x_type) {
    return Outputs{carve(buf, x_type, {n, hidden}, {hidden, 1}, a.at_x),
                   carve(buf, at::kLong, {n, k}, {k, 1}, a.at_idx),
                   carve(buf, at::kFloat, {n, k}, {k, 1}, a.at_w)};
}

// The result of a dispatch whose counts were read clean (see dispatch): the row counts from the
// header's `info` (n_info int64 before the completion word: tokens_per_expert is its last
// num_local, the rows received per source and sent per destination are read there), the
// received rows rx / ri / rw, and the handle's layout carved from the scratch, which starts at
// byte 0 of `base` (slot [t, w] at word o_slot, offsets [w + 1] at o_offsets, send_token_idx
// [rows sent] at o_send). `scratch` goes in the result as it is (None where no caller reads it:
// one Python object less per call).
static py::tuple clean_result(int rc, int64_t sync_ns, int64_t gate_ns, const at::Tensor &base,
                              const py::object &scratch, const at::Tensor &rx,
                              const at::Tensor &ri, const at::Tensor &rw, const int64_t *info,
                              int64_t n_info, int64_t w, int64_t num_local, int64_t t,
                              int64_t o_slot, int64_t o_offsets, int64_t o_send) {
    auto tokens_per_expert = at::empty({num_local}, at::TensorOptions().dtype(at::kLong));
    std::memcpy(tokens_per_expert.data_ptr(), info + n_info - num_local, 8 * num_local);
    const int64_t end = 1 + w * (2 + num_local);
    py::tuple num_send(w), num_recv(w);
    int64_t sent = 0;
    for (int64_t s = 0; s < w; s++) {
        num_recv[s] = py::int_(info[2 + s * (2 + num_local)]);
        num_send[s] = py::int_(info[end + s]);
        sent += info[end + s];
    }
    auto slot = carve(base, at::kLong, {t, w}, {w, 1}, 8 * o_slot);
    auto offsets = carve(base, at::kLong, {w + 1}, {1}, 8 * o_offsets);
    auto send_idx = carve(base, at::kLong, {sent}, {1}, 8 * o_send);
    stamp(3);
    return py::make_tuple(rc, sync_ns, gate_ns, scratch, rx, ri, rw, slot, offsets, send_idx,
                          tokens_per_expert, num_send, num_recv);
}

// Outputs are allocated ahead at the plan's capacity (shape[5] rows) before the native call, which
// then gathers too (with shape[10], the early gather: launched before the count read, it reads the
// clean row count on the device; its row-count variable is the capacity); a plan of capacity 0
// (outputs larger than the caller allocates ahead) gets them allocated here after the call read
// clean counts (at most world x t_max rows: the peers' counts are bounded there), then its gather
// launched (p[P_RUN], efa_launch_run).
// Returns (status, sync_ns, gate_ns, scratch (None when status is 0 and `device` is not -1: the
// transport's planned calls read the views), then when status is 0: recv_x, recv_topk_idx,
// recv_topk_weights [rows, ...] (views of the outputs), slot [T, W],
// offsets [W + 1], send_token_idx [S] (views of scratch), tokens_per_expert [L] int64 CPU,
// rows sent per destination, rows received per source; when negative: the library's error
// text). The GIL is released during the native call (it waits for peers and the device).
// With `device` >= 0 (or -2) the inputs are checked first (inputs_fit): (NOT_PLANNED,) when
// they are not the plan's case. With `choice` (rows_in_window=auto's block, see
// compact_chosen) the choice is made before anything else: (OTHER_WAY,) when it is compact.
py::tuple dispatch(const at::Tensor &x, const at::Tensor &topk_idx, const at::Tensor &topk_weights,
                   int64_t plan_address, int64_t delta, int64_t record, int64_t stream,
                   int64_t device, int64_t choice) {
    stamp(0);
    if (choice && compact_chosen(choice, topk_idx)) return py::make_tuple(OTHER_WAY);
    const int64_t *p = reinterpret_cast<const int64_t *>(plan_address);
    const int64_t *shape = reinterpret_cast<const int64_t *>(p[P_SHAPE]);
    const int64_t w = p[P_WORLD], cap = shape[5], k = p[P_TOPK], t = p[P_TOKENS];
    if (device != -1 && !inputs_fit(x, topk_idx, topk_weights, t, k, device))
        return py::make_tuple(NOT_PLANNED);
    // one allocation: the scratch (layout, counts: the handle's), then the outputs ahead; the
    // tensors over it are made once the rows are known (each is a Python object to make and
    // free per call)
    const int64_t elem = x.element_size(), hidden = p[P_HIDDEN], words = p[P_WORDS];
    const int64_t scratch_bytes = up256(8 * words);
    auto buf = at::empty({scratch_bytes + outputs_bytes(cap, hidden, k, elem)},
                         x.options().dtype(at::kByte));
    const bool after = cap == 0;  // the outputs once the counts are read
    const OutputAddrs oa = output_addrs(buf, scratch_bytes, cap, hidden, k, elem);
    const int64_t sp = reinterpret_cast<int64_t>(buf.data_ptr());
    // the scratch as a tensor, for the results that hand it to the caller
    auto scratch = [&]() { return carve(buf, at::kLong, {words}, {1}, 0); };
    auto *front = reinterpret_cast<Program *>(p[P_FRONT]);
    auto *header = reinterpret_cast<Program *>(p[P_HEADER]);
    auto *gather = reinterpret_cast<Program *>(p[P_GATHER]);
    const int64_t fv[5] = {reinterpret_cast<int64_t>(x.data_ptr()),
                           reinterpret_cast<int64_t>(topk_idx.data_ptr()),
                           reinterpret_cast<int64_t>(topk_weights.data_ptr()), sp, delta};
    std::memcpy(front->vars, fv, sizeof fv);
    const int64_t hv[3] = {sp + 8 * p[P_O_RANK], sp + 8 * p[P_O_OUT], delta};
    const int64_t gv[6] = {sp + 8 * p[P_O_OFFSETS], oa.x, oa.idx, oa.w, cap,
                           cap < shape[6] ? cap : shape[6]};
    // the header and the early gather as one program (gather_early=2): one launch less; its
    // variables are the header's tensors, the gather's, then the op number, the rows, the grid
    auto *merged = reinterpret_cast<Program *>(p[P_MERGED]);
    const bool merge = merged != nullptr && cap > 0;
    if (merge) {
        const int64_t mv[9] = {hv[0], hv[1], gv[0], gv[1], gv[2], gv[3], delta, gv[4], gv[5]};
        std::memcpy(merged->vars, mv, sizeof mv);
    } else {
        std::memcpy(header->vars, hv, sizeof hv);
        std::memcpy(gather->vars, gv, sizeof gv);
    }
    int64_t sync_ns = 0, gate_ns = 0;
    char err[512] = {0};
    auto fn = reinterpret_cast<DispatchFn>(p[P_FN]);
    auto *rows_out = reinterpret_cast<int64_t *>(p[P_ROWS]);
    int rc;
    stamp(1);
    {
        py::gil_scoped_release unlocked;  // the call waits for peers and the device
        rc = fn(front, merge ? merged : header, merge ? nullptr : gather, stream,
                reinterpret_cast<int64_t *>(p[P_GATE]),
                static_cast<int>(w), static_cast<int>(p[P_RANK]), record, p[P_SPIN_NS],
                reinterpret_cast<const int64_t *>(p[P_FLAG]), record, p[P_WAIT_NS], shape,
                rows_out, &sync_ns, &gate_ns, err, sizeof err);
    }
    stamp(2);
    waits(sync_ns, gate_ns);
    if (rc < 0) return py::make_tuple(rc, sync_ns, gate_ns, scratch(), std::string(err));
    const int64_t n = *rows_out;
    Outputs out;
    if (after && rc == 3 && n > 0) {  // clean counts, rows > 0: gather them now
        // (outputs of their own: large, and each may be freed without the others)
        out = Outputs{at::empty({n, hidden}, x.options()),
                      at::empty({n, k}, topk_idx.options()),
                      at::empty({n, k}, topk_weights.options())};
        const int64_t av[6] = {sp + 8 * p[P_O_OFFSETS], reinterpret_cast<int64_t>(out.x.data_ptr()),
                               reinterpret_cast<int64_t>(out.idx.data_ptr()),
                               reinterpret_cast<int64_t>(out.w.data_ptr()), n,
                               n < shape[6] ? n : shape[6]};
        std::memcpy(gather->vars, av, sizeof av);
        rc = reinterpret_cast<RunFn>(p[P_RUN])(gather, stream, err, sizeof err);
        if (rc < 0) return py::make_tuple(rc, sync_ns, gate_ns, scratch(), std::string(err));
    } else if (rc == 0) {
        out = carve_outputs(buf, oa, n, hidden, k, x.scalar_type());
    }
    if (rc != 0) return py::make_tuple(rc, sync_ns, gate_ns, scratch());
    const int64_t n_info = p[P_N_INFO];
    // (the planned calls from the transport's methods, device != -1, read no scratch here)
    return clean_result(rc, sync_ns, gate_ns, buf, device == -1 ? py::object(py::cast(scratch()))
                                                               : py::object(py::none()),
                        out.x, out.idx, out.w,
                        reinterpret_cast<const int64_t *>(p[P_FLAG]) - n_info, n_info, w,
                        p[P_LOCAL], t, p[P_O_SLOT], p[P_O_OFFSETS], p[P_O_SEND]);
}

// Status of a compact dispatch whose counts op ran but whose peers had not all published it
// at the launch gate within the plan's spin: the caller waits (deadline) and goes on.
constexpr int COUNTS_GATE_LATE = 101;

// A planned compact dispatch (option rows_in_window, kernels/gda/compact.py) in one call: the
// scratch allocated, the counts op's program run (layout, counts published), its launch gate,
// then the rows op's program (count wait, compact stores), gate and header with the count read
// (efa_launch_dispatch with capacity 0: the check of the counts, no gather). Clean counts:
// (0, sync_ns, gate_ns, None, recv_x [N, H] and recv_topk_weights [N, K] as views of
// `window` (this rank's window, uint8) at the plan's row offsets, recv_topk_idx [N, K] a copy,
// slot, offsets, send_token_idx, tokens_per_expert, rows sent, rows received) as dispatch
// returns. (COUNTS_GATE_LATE, gate_ns, scratch): a peer late at the counts gate. Otherwise
// (status, sync_ns, gate_ns, scratch[, error text]) as dispatch: the caller takes over. With
// `choice`: (OTHER_WAY,) when rows_in_window=auto chooses the regular way (see dispatch).
py::tuple dispatch_compact(const at::Tensor &x, const at::Tensor &topk_idx,
                           const at::Tensor &topk_weights, const at::Tensor &window,
                           int64_t plan_address, int64_t delta_counts, int64_t delta,
                           int64_t record_counts, int64_t record, int64_t stream, int64_t device,
                           int64_t choice) {
    stamp(0);
    if (choice && !compact_chosen(choice, topk_idx)) return py::make_tuple(OTHER_WAY);
    const int64_t *p = reinterpret_cast<const int64_t *>(plan_address);
    const int64_t w = p[K_WORLD], k = p[K_TOPK], t = p[K_TOKENS];
    if (device != -1 && !inputs_fit(x, topk_idx, topk_weights, t, k, device))
        return py::make_tuple(NOT_PLANNED);
    // one allocation: the scratch, then room for the received ids of as many rows as the plan's
    // recent calls received (its field K_IDS_ROWS, which this call updates): no allocation of
    // their own when they fit
    const int64_t words = p[K_WORDS], ids_rows = p[K_IDS_ROWS];
    const int64_t scratch_bytes = up256(8 * words);
    auto buf = at::empty({scratch_bytes + ids_rows * k * 8}, x.options().dtype(at::kByte));
    auto scratch = [&]() { return carve(buf, at::kLong, {words}, {1}, 0); };
    const int64_t sp = reinterpret_cast<int64_t>(buf.data_ptr());
    const int64_t xp = reinterpret_cast<int64_t>(x.data_ptr());
    const int64_t ip = reinterpret_cast<int64_t>(topk_idx.data_ptr());
    const int64_t wp = reinterpret_cast<int64_t>(topk_weights.data_ptr());
    auto *counts = reinterpret_cast<Program *>(p[K_COUNTS]);
    auto *rows = reinterpret_cast<Program *>(p[K_ROWS]);
    auto *header = reinterpret_cast<Program *>(p[K_HEADER]);
    const int64_t cv[4] = {ip, wp, sp, delta_counts};
    std::memcpy(counts->vars, cv, sizeof cv);
    const int64_t rv[6] = {xp, ip, wp, sp, delta_counts, delta};
    std::memcpy(rows->vars, rv, sizeof rv);
    // the header that also copies the received ids into the room after the scratch when they
    // fit it (its variables: the header's, the room, the op number, the rows the room holds)
    auto *header_ids = reinterpret_cast<Program *>(p[K_HEADER_IDS]);
    if (header_ids != nullptr) {
        const int64_t iv[5] = {sp + 8 * p[K_O_RANK], sp + 8 * p[K_O_OUT], sp + scratch_bytes,
                               delta, ids_rows};
        std::memcpy(header_ids->vars, iv, sizeof iv);
        header = header_ids;
    } else {
        const int64_t hv[3] = {sp + 8 * p[K_O_RANK], sp + 8 * p[K_O_OUT], delta};
        std::memcpy(header->vars, hv, sizeof hv);
    }
    char err[512] = {0};
    int64_t sync_ns = 0, gate_ns = 0;
    int rc;
    stamp(1);
    {
        py::gil_scoped_release unlocked;  // the gates wait for peers, the count read the device
        rc = reinterpret_cast<RunFn>(p[K_RUN])(counts, stream, err, sizeof err);
        if (rc == 0 && p[K_GATE] &&
            !reinterpret_cast<GateFn>(p[K_GATE_FN])(reinterpret_cast<int64_t *>(p[K_GATE]),
                                                   static_cast<int>(w),
                                                   static_cast<int>(p[K_RANK]), record_counts,
                                                   p[K_SPIN_NS], &gate_ns))
            rc = COUNTS_GATE_LATE;
        if (rc == 0) {
            int64_t rows_gate_ns = 0;
            rc = reinterpret_cast<DispatchFn>(p[K_FN])(
                rows, header, header, stream, reinterpret_cast<int64_t *>(p[K_GATE]),
                static_cast<int>(w), static_cast<int>(p[K_RANK]), record, p[K_SPIN_NS],
                reinterpret_cast<const int64_t *>(p[K_FLAG]), record, p[K_WAIT_NS],
                reinterpret_cast<const int64_t *>(p[K_SHAPE]),
                reinterpret_cast<int64_t *>(p[K_ROWS_OUT]), &sync_ns, &rows_gate_ns, err,
                sizeof err);
            gate_ns += rows_gate_ns;
        }
    }
    stamp(2);
    waits(sync_ns, gate_ns);
    if (rc == COUNTS_GATE_LATE) return py::make_tuple(rc, gate_ns, scratch());
    if (rc < 0) return py::make_tuple(rc, sync_ns, gate_ns, scratch(), std::string(err));
    const int64_t n = *reinterpret_cast<int64_t *>(p[K_ROWS_OUT]);
    if (rc != 3 || n < 0) return py::make_tuple(rc == 3 ? 3 : rc, sync_ns, gate_ns, scratch());
    const int64_t n_info = p[K_N_INFO], hidden = p[K_HIDDEN];
    auto rx = carve(window, x.scalar_type(), {n, hidden}, {hidden, 1}, p[K_DATA_OFF]);
    // the ids (the handle keeps them): copied into the room by the header's program when they
    // fit it, else out of the window by the driver (a tensor copy costs more host)
    stamp(6);
    const bool fit = n <= ids_rows;
    auto ri = fit ? carve(buf, at::kLong, {n, k}, {k, 1}, scratch_bytes)
                  : at::empty({n, k}, topk_idx.options());
    if (!fit || 4 * n < 3 * ids_rows)  // the next calls' room: these rows and 1/8 more
        const_cast<int64_t *>(p)[K_IDS_ROWS] = n + n / 8;
    if (n > 0 && !(fit && header_ids != nullptr)) {
        const int64_t src = reinterpret_cast<int64_t>(window.data_ptr()) + p[K_IDX_OFF];
        rc = reinterpret_cast<CopyFn>(p[K_COPY])(reinterpret_cast<int64_t>(ri.data_ptr()), src,
                                                 8 * n * k, stream, err, sizeof err);
        if (rc < 0) return py::make_tuple(rc, sync_ns, gate_ns, scratch(), std::string(err));
    }
    stamp(7);
    auto rw = carve(window, at::kFloat, {n, k}, {k, 1}, p[K_W_OFF]);
    return clean_result(0, sync_ns, gate_ns, buf, py::none(), rx, ri, rw,
                        reinterpret_cast<const int64_t *>(p[K_FLAG]) - n_info, n_info, w,
                        p[K_LOCAL], t, p[K_O_SLOT], p[K_O_OFFSETS], p[K_O_SEND]);
}

// The first program, the launch gate and the second in one native call (efa_launch_run_gated
// at `fn`, no completion word), the GIL released: the gate may wait for peers. Returns its
// status; the device and gate waits go to sync_ns / gate_ns, a failure's text to err.
static int gated(int64_t fn, int64_t gate, int64_t world, int64_t rank, int64_t spin_ns,
                 Program *first, Program *second, int64_t record, int64_t stream,
                 int64_t *sync_ns, int64_t *gate_ns, char *err, size_t errlen) {
    int rc;
    stamp(1);
    {
        py::gil_scoped_release unlocked;
        rc = reinterpret_cast<GatedFn>(fn)(first, second, stream,
                                           reinterpret_cast<int64_t *>(gate),
                                           static_cast<int>(world), static_cast<int>(rank),
                                           record, spin_ns, nullptr, 0, 0, sync_ns, gate_ns, err,
                                           errlen);
    }
    stamp(2);
    waits(*sync_ns, *gate_ns);
    return rc;
}

// gated() of a combine plan `p`. Returns (status, sync_ns, gate_ns, out), and when negative the
// library's error text.
static py::tuple run_gated(const int64_t *p, Program *first, Program *second,
                           const at::Tensor &out, int64_t record, int64_t stream) {
    int64_t sync_ns = 0, gate_ns = 0;
    char err[512] = {0};
    const int rc = gated(p[C_FN], p[C_GATE], p[C_WORLD], p[C_RANK], p[C_SPIN_NS], first, second,
                         record, stream, &sync_ns, &gate_ns, err, sizeof err);
    stamp(3);
    if (rc < 0) return py::make_tuple(rc, sync_ns, gate_ns, out, std::string(err));
    return py::make_tuple(rc, sync_ns, gate_ns, out);
}

// A planned fixed-capacity dispatch (kernels/gda/fixed.py) in one call: one allocation for the
// layout's scratch and the device counts (num_recv [W], tokens_per_expert [L] int64), the
// front's variables (x, topk_idx, topk_weights, scratch, delta) and the fixed header's
// (num_recv, tokens_per_expert, delta, full), then the front, the launch gate and the header in
// one native call (efa_launch_run_gated with no completion word: nothing is read on the host),
// the GIL released. `data`, `ids`, `weights`: this parity's receive regions of the window (flat,
// x's dtype / int64 / float32). Returns (status, gate_ns, slot [T, W], send_token_idx [T * W]
// (views of the scratch), num_recv, tokens_per_expert, recv_x [W * T_MAX, H], recv_topk_idx and
// recv_topk_weights [W * T_MAX, K] (views of the regions)) with status 0 (both ran) or 1 (a peer
// late at the gate: the front ran and is published, the header's variables are written, the
// caller waits and runs it); (status, gate_ns, error text) when negative; with `device` != -1,
// (NOT_PLANNED,) unless the inputs are the plan's case (inputs_fit): nothing ran.
py::tuple dispatch_fixed(const at::Tensor &x, const at::Tensor &topk_idx,
                         const at::Tensor &topk_weights, const at::Tensor &data,
                         const at::Tensor &ids, const at::Tensor &weights, int64_t plan_address,
                         int64_t delta, int64_t full, int64_t record, int64_t stream,
                         int64_t device) {
    stamp(0);
    const int64_t *p = reinterpret_cast<const int64_t *>(plan_address);
    const int64_t w = p[F_WORLD], k = p[F_TOPK], t = p[F_TOKENS], local = p[F_LOCAL];
    if (device != -1 && !inputs_fit(x, topk_idx, topk_weights, t, k, device))
        return py::make_tuple(NOT_PLANNED);
    // scratch, then num_recv and tokens_per_expert, each 256-byte aligned (the header's kernel
    // was bound for 16-byte aligned pointers)
    const int64_t scratch_bytes = up256(8 * p[F_WORDS]), recv_bytes = up256(8 * w);
    auto buf = at::empty({scratch_bytes + recv_bytes + 8 * local}, x.options().dtype(at::kByte));
    auto scratch = carve(buf, at::kLong, {p[F_WORDS]}, {1}, 0);
    auto num_recv = carve(buf, at::kLong, {w}, {1}, scratch_bytes);
    auto tokens_per_expert = carve(buf, at::kLong, {local}, {1}, scratch_bytes + recv_bytes);
    const int64_t sp = reinterpret_cast<int64_t>(scratch.data_ptr());
    auto *front = reinterpret_cast<Program *>(p[F_FRONT]);
    auto *header = reinterpret_cast<Program *>(p[F_HEADER]);
    const int64_t fv[5] = {reinterpret_cast<int64_t>(x.data_ptr()),
                           reinterpret_cast<int64_t>(topk_idx.data_ptr()),
                           reinterpret_cast<int64_t>(topk_weights.data_ptr()), sp, delta};
    std::memcpy(front->vars, fv, sizeof fv);
    const int64_t hv[4] = {reinterpret_cast<int64_t>(num_recv.data_ptr()),
                           reinterpret_cast<int64_t>(tokens_per_expert.data_ptr()), delta, full};
    std::memcpy(header->vars, hv, sizeof hv);
    int64_t sync_ns = 0, gate_ns = 0;
    char err[512] = {0};
    const int rc = gated(p[F_FN], p[F_GATE], w, p[F_RANK], p[F_SPIN_NS], front, header, record,
                         stream, &sync_ns, &gate_ns, err, sizeof err);
    if (rc < 0) return py::make_tuple(rc, gate_ns, std::string(err));
    const int64_t rows = w * p[F_T_MAX], hidden = p[F_HIDDEN];
    auto slot = carve(scratch, at::kLong, {t, w}, {w, 1}, 8 * p[F_O_SLOT]);
    auto send_idx = carve(scratch, at::kLong, {t * w}, {1}, 8 * p[F_O_SEND]);
    auto rx = carve(data, data.scalar_type(), {rows, hidden}, {hidden, 1}, 0);
    auto ri = carve(ids, at::kLong, {rows, k}, {k, 1}, 0);
    auto rw = carve(weights, at::kFloat, {rows, k}, {k, 1}, 0);
    return py::make_tuple(rc, gate_ns, slot, send_idx, num_recv, tokens_per_expert, rx, ri, rw);
}

// A planned cached dispatch along a fixed-capacity handle (kernels/gda/fixed.py): the store
// program's variables (x, slot, delta), the wait's (delta), then the store, the launch gate and
// the wait for every source in one native call (efa_launch_run_gated), the GIL released; the
// rows land in this parity's data region of the window (`data`, flat), returned as
// [W * T_MAX, D] in x's dtype. Returns (status, gate_ns, rows) with status 0, or 1 (a peer late
// at the gate: the store ran and is published, the caller waits and runs the wait);
// (status, gate_ns, error text) when negative; with `device` != -1, (NOT_PLANNED,) unless x is
// [num_tokens, D] with dense rows there (rows_fit): nothing ran.
py::tuple cached_fixed(const at::Tensor &x, const at::Tensor &slot, const at::Tensor &data,
                       int64_t plan_address, int64_t delta, int64_t record, int64_t stream,
                       int64_t num_tokens, int64_t device) {
    stamp(0);
    const int64_t *p = reinterpret_cast<const int64_t *>(plan_address);
    if (device != -1 && !rows_fit(x, num_tokens, device)) return py::make_tuple(NOT_PLANNED);
    auto *store = reinterpret_cast<Program *>(p[FC_STORE]);
    auto *wait = reinterpret_cast<Program *>(p[FC_WAIT]);
    const int64_t sv[3] = {reinterpret_cast<int64_t>(x.data_ptr()),
                           reinterpret_cast<int64_t>(slot.data_ptr()), delta};
    std::memcpy(store->vars, sv, sizeof sv);
    wait->vars[0] = delta;
    int64_t sync_ns = 0, gate_ns = 0;
    char err[512] = {0};
    const int rc = gated(p[FC_FN], p[FC_GATE], p[FC_WORLD], p[FC_RANK], p[FC_SPIN_NS], store,
                         wait, record, stream, &sync_ns, &gate_ns, err, sizeof err);
    if (rc < 0) return py::make_tuple(rc, gate_ns, std::string(err));
    const int64_t d = x.size(1);
    return py::make_tuple(rc, gate_ns, carve(data, x.scalar_type(), {p[FC_ROWS], d}, {d, 1}, 0));
}

// A planned combine (or weight combine, with ids) of y [N, D] into a new out [T, D] in y's
// dtype: the store program's variables (y, offsets, [ids], N, delta, grid), the reduce
// program's (slot, out, delta, T, grid), then the store, the launch gate and the reduce in one
// native call (efa_launch_run_gated), the GIL released. Returns (status, sync_ns, gate_ns, out),
// and when negative the library's error text; status 1 (a peer late at the gate): the store ran
// and is published, the reduce's variables are written, the caller waits and runs it. With
// `device` != -1, (NOT_PLANNED,) unless y is [num_rows, D] with dense rows there (rows_fit),
// and ids, when given, [num_rows, D] int64 contiguous there.
py::tuple combine(const at::Tensor &y, const at::Tensor &offsets,
                  const c10::optional<at::Tensor> &ids, const at::Tensor &slot,
                  int64_t num_tokens, int64_t plan_address, int64_t delta, int64_t record,
                  int64_t stream, int64_t num_rows, int64_t device) {
    stamp(0);
    if (device != -1 &&
        (!rows_fit(y, num_rows, device) ||
         (ids.has_value() && !(rows_fit(*ids, num_rows, device) && ids->is_contiguous() &&
                               ids->size(1) == y.size(1) && ids->scalar_type() == at::kLong))))
        return py::make_tuple(NOT_PLANNED);
    const int64_t *p = reinterpret_cast<const int64_t *>(plan_address);
    auto out = at::empty({num_tokens, y.size(1)}, y.options());
    auto *store = reinterpret_cast<Program *>(p[C_STORE]);
    auto *reduce = reinterpret_cast<Program *>(p[C_REDUCE]);
    const int64_t n = y.size(0), max_grid = p[C_MAX_GRID];
    const int64_t rows = p[C_FIXED_ROWS] ? p[C_FIXED_ROWS] : n;
    const int64_t grid = std::max<int64_t>(1, std::min(rows, max_grid));
    int64_t *sv = store->vars;
    int i = 0;
    sv[i++] = reinterpret_cast<int64_t>(y.data_ptr());
    sv[i++] = reinterpret_cast<int64_t>(offsets.data_ptr());
    if (ids.has_value()) sv[i++] = reinterpret_cast<int64_t>(ids->data_ptr());
    sv[i++] = n;
    sv[i++] = delta;
    sv[i++] = grid;
    const int64_t rv[5] = {reinterpret_cast<int64_t>(slot.data_ptr()),
                           reinterpret_cast<int64_t>(out.data_ptr()), delta, num_tokens,
                           std::min(num_tokens, max_grid)};
    std::memcpy(reduce->vars, rv, sizeof rv);
    return run_gated(p, store, reduce, out, record, stream);
}

// A planned cached dispatch of x [T, D] into a new out [N, D] in x's dtype (N = num_rows): the
// store program's variables (x, slot, delta), the gather's (offsets, out, delta, N, grid), then
// the store, the launch gate and the gather in one native call; the plan is a combine plan
// (C_STORE: the store, C_REDUCE: the gather). Returns as combine; with `device` != -1,
// (NOT_PLANNED,) unless x is [num_tokens, D] with dense rows there.
py::tuple cached(const at::Tensor &x, const at::Tensor &slot, const at::Tensor &offsets,
                 int64_t num_rows, int64_t plan_address, int64_t delta, int64_t record,
                 int64_t stream, int64_t num_tokens, int64_t device) {
    stamp(0);
    if (device != -1 && !rows_fit(x, num_tokens, device)) return py::make_tuple(NOT_PLANNED);
    const int64_t *p = reinterpret_cast<const int64_t *>(plan_address);
    auto out = at::empty({num_rows, x.size(1)}, x.options());
    auto *store = reinterpret_cast<Program *>(p[C_STORE]);
    auto *gather = reinterpret_cast<Program *>(p[C_REDUCE]);
    const int64_t sv[3] = {reinterpret_cast<int64_t>(x.data_ptr()),
                           reinterpret_cast<int64_t>(slot.data_ptr()), delta};
    std::memcpy(store->vars, sv, sizeof sv);
    const int64_t gv[5] = {reinterpret_cast<int64_t>(offsets.data_ptr()),
                           reinterpret_cast<int64_t>(out.data_ptr()), delta, num_rows,
                           std::min(num_rows, p[C_MAX_GRID])};
    std::memcpy(gather->vars, gv, sizeof gv);
    return run_gated(p, store, gather, out, record, stream);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("cached", &cached, "a planned gda cached dispatch in one call (see the file)");
    m.def("dispatch", &dispatch, "a planned gda regular dispatch in one call (see the file)");
    m.def("cached_fixed", &cached_fixed,
          "a planned gda cached dispatch along a fixed-capacity handle (see the file)");
    m.def("dispatch_fixed", &dispatch_fixed,
          "a planned gda fixed-capacity dispatch in one call (see the file)");
    m.def("dispatch_compact", &dispatch_compact,
          "a planned gda dispatch with compact rows in one call (see the file)");
    m.def("combine", &combine, "a planned gda combine in one call (see the file)");
    m.def("trace", &trace, "the host-time trace of the last call, on or off (see the file)");
    m.attr("PLAN_FIELDS") = static_cast<int64_t>(P_NUM_FIELDS);
    m.attr("COMBINE_FIELDS") = static_cast<int64_t>(C_NUM_FIELDS);
    m.attr("COMPACT_FIELDS") = static_cast<int64_t>(K_NUM_FIELDS);
    m.attr("FIXED_FIELDS") = static_cast<int64_t>(F_NUM_FIELDS);
    m.attr("FIXED_CACHED_FIELDS") = static_cast<int64_t>(FC_NUM_FIELDS);
    m.attr("COUNTS_GATE_LATE") = static_cast<int64_t>(COUNTS_GATE_LATE);
    m.attr("NOT_PLANNED") = static_cast<int64_t>(NOT_PLANNED);
    m.attr("OTHER_WAY") = static_cast<int64_t>(OTHER_WAY);
}
