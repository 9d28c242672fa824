// efa_gda_op.cpp: a planned gda regular dispatch, combine and cached dispatch, each as one C++
// call (a torch extension).
//
// The Python path of a planned dispatch (kernels/gda/phases.py) makes a dozen tensor objects per
// call (scratch, outputs, their views, tokens_per_expert) and packs three programs' variables
// before its one native call (efa_launch_dispatch of kernels/native/efa_launch.c). This does the
// same here: the tensors through ATen, the variables written straight into the programs, the
// native call through its function pointer, then the views of a call that gathered. Python keeps
// the plan, the checks of a call that did not gather, and the handle. Built on first use by
// kernels/gda/cpp_op.py (torch.utils.cpp_extension); without it the Python path runs.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace {

// efa_program_t of efa_launch.c: only its variables are written here
struct Program {
    void *recs;
    int64_t num_recs;
    const int64_t *uses;
    int64_t num_uses;
    int64_t *vars;
};

typedef int (*GatedFn)(const void *, const void *, int64_t, int64_t *, int, int, int64_t, int64_t,
                       const int64_t *, int64_t, int64_t, int64_t *, int64_t *, char *, size_t);

typedef int (*RunFn)(const void *, int64_t, char *, size_t);

typedef int (*DispatchFn)(const void *, const void *, const void *, int64_t, int64_t *, int, int,
                          int64_t, int64_t, const int64_t *, int64_t, int64_t, const int64_t *,
                          int64_t *, int64_t *, int64_t *, char *, size_t);

// The plan's constants, an int64 array the caller keeps (kernels/gda/cpp_op.py, PLAN_FIELDS).
enum {
    P_FN, P_FRONT, P_HEADER, P_GATHER, P_GATE, P_WORLD, P_RANK, P_SPIN_NS, P_FLAG, P_WAIT_NS,
    P_SHAPE, P_ROWS, P_WORDS, P_O_SLOT, P_O_SEND, P_O_RANK, P_O_OUT, P_O_OFFSETS, P_N_INFO,
    P_LOCAL, P_HIDDEN, P_TOPK, P_TOKENS, P_RUN, P_NUM_FIELDS
};

// A combine plan's constants (kernels/gda/cpp_op.py, COMBINE_FIELDS).
enum {
    C_FN, C_STORE, C_REDUCE, C_GATE, C_WORLD, C_RANK, C_SPIN_NS, C_MAX_GRID, C_FIXED_ROWS,
    C_NUM_FIELDS
};

}  // namespace

// Status of a dispatch whose inputs are not the plan's clean case (see inputs_fit): nothing
// ran, the caller takes the checked path.
constexpr int NOT_PLANNED = 100;

// Whether a dispatch's inputs are the case the plan was bound for, as the caller found it by
// (top-k shape, x's dtype, x's row stride, x's width): x [T, H] rows dense, topk_idx [T, K]
// int64 and topk_weights [T, K] float32 contiguous, all on CUDA device `device`, each 16-byte
// aligned (`device` -2: CPU tensors, for the host-only stand-in of the tests). The caller's
// checks produce the error for anything else (this only decides).
static bool on(const at::Tensor &a, int64_t device) {
    const bool here = device == -2 ? a.is_cpu() : a.is_cuda() && a.get_device() == device;
    return here && (reinterpret_cast<uintptr_t>(a.data_ptr()) & 15) == 0;
}

// rows [num_rows, D] with dense rows on `device` (see on), for combine and cached dispatch
static bool rows_fit(const at::Tensor &a, int64_t num_rows, int64_t device) {
    return a.dim() == 2 && a.size(0) == num_rows && (a.stride(1) == 1 || a.size(1) == 1) &&
           on(a, device);
}

static bool inputs_fit(const at::Tensor &x, const at::Tensor &idx, const at::Tensor &w,
                       int64_t t, int64_t k, int64_t device) {
    return x.dim() == 2 && x.size(0) == t && x.stride(1) == 1 && on(x, device) &&
           idx.dim() == 2 && idx.size(0) == t && idx.size(1) == k &&
           idx.scalar_type() == at::kLong && idx.is_contiguous() && on(idx, device) &&
           w.dim() == 2 && w.size(0) == t && w.size(1) == k && w.scalar_type() == at::kFloat &&
           w.is_contiguous() && on(w, device);
}

// Outputs are allocated ahead at the plan's capacity (shape[5] rows) before the native call, which
// then gathers too; a plan of capacity 0 (outputs larger than the caller allocates ahead) gets
// them allocated here after the call read clean counts (at most world x t_max rows: the peers'
// counts are bounded there), then its gather launched (p[P_RUN], efa_launch_run).
// Returns (status, sync_ns, gate_ns, scratch, then when status is 0: recv_x, recv_topk_idx,
// recv_topk_weights [rows, ...] (views of the outputs), slot [T, W],
// offsets [W + 1], send_token_idx [S] (views of scratch), tokens_per_expert [L] int64 CPU,
// rows sent per destination, rows received per source; when negative: the library's error
// text). The GIL is released during the native call (it waits for peers and the device).
// With `device` >= 0 (or -2) the inputs are checked first (inputs_fit): (NOT_PLANNED,) when
// they are not the plan's case.
py::tuple dispatch(const at::Tensor &x, const at::Tensor &topk_idx, const at::Tensor &topk_weights,
                   int64_t plan_address, int64_t delta, int64_t record, int64_t stream,
                   int64_t device) {
    const int64_t *p = reinterpret_cast<const int64_t *>(plan_address);
    const int64_t *shape = reinterpret_cast<const int64_t *>(p[P_SHAPE]);
    const int64_t w = p[P_WORLD], cap = shape[5], k = p[P_TOPK], t = p[P_TOKENS];
    if (device != -1 && !inputs_fit(x, topk_idx, topk_weights, t, k, device))
        return py::make_tuple(NOT_PLANNED);
    auto scratch = at::empty({p[P_WORDS]}, x.options().dtype(at::kLong));
    const bool after = cap == 0;  // the outputs once the counts are read
    auto recv_x = at::empty({cap, p[P_HIDDEN]}, x.options());
    auto recv_idx = at::empty({cap, k}, topk_idx.options());
    auto recv_w = at::empty({cap, k}, topk_weights.options());
    const int64_t sp = reinterpret_cast<int64_t>(scratch.data_ptr());
    auto *front = reinterpret_cast<Program *>(p[P_FRONT]);
    auto *header = reinterpret_cast<Program *>(p[P_HEADER]);
    auto *gather = reinterpret_cast<Program *>(p[P_GATHER]);
    const int64_t fv[5] = {reinterpret_cast<int64_t>(x.data_ptr()),
                           reinterpret_cast<int64_t>(topk_idx.data_ptr()),
                           reinterpret_cast<int64_t>(topk_weights.data_ptr()), sp, delta};
    std::memcpy(front->vars, fv, sizeof fv);
    const int64_t hv[3] = {sp + 8 * p[P_O_RANK], sp + 8 * p[P_O_OUT], delta};
    std::memcpy(header->vars, hv, sizeof hv);
    const int64_t gv[6] = {sp + 8 * p[P_O_OFFSETS], reinterpret_cast<int64_t>(recv_x.data_ptr()),
                           reinterpret_cast<int64_t>(recv_idx.data_ptr()),
                           reinterpret_cast<int64_t>(recv_w.data_ptr()), cap,
                           cap < shape[6] ? cap : shape[6]};
    std::memcpy(gather->vars, gv, sizeof gv);
    int64_t sync_ns = 0, gate_ns = 0;
    char err[512] = {0};
    auto fn = reinterpret_cast<DispatchFn>(p[P_FN]);
    auto *rows_out = reinterpret_cast<int64_t *>(p[P_ROWS]);
    int rc;
    {
        py::gil_scoped_release unlocked;  // the call waits for peers and the device
        rc = fn(front, header, gather, stream, reinterpret_cast<int64_t *>(p[P_GATE]),
                static_cast<int>(w), static_cast<int>(p[P_RANK]), record, p[P_SPIN_NS],
                reinterpret_cast<const int64_t *>(p[P_FLAG]), record, p[P_WAIT_NS], shape,
                rows_out, &sync_ns, &gate_ns, err, sizeof err);
    }
    if (rc < 0) return py::make_tuple(rc, sync_ns, gate_ns, scratch, std::string(err));
    if (after && rc == 3 && *rows_out > 0) {  // clean counts, rows > 0: gather them now
        const int64_t rows = *rows_out;
        recv_x = at::empty({rows, p[P_HIDDEN]}, x.options());
        recv_idx = at::empty({rows, k}, topk_idx.options());
        recv_w = at::empty({rows, k}, topk_weights.options());
        const int64_t av[6] = {sp + 8 * p[P_O_OFFSETS],
                               reinterpret_cast<int64_t>(recv_x.data_ptr()),
                               reinterpret_cast<int64_t>(recv_idx.data_ptr()),
                               reinterpret_cast<int64_t>(recv_w.data_ptr()), rows,
                               rows < shape[6] ? rows : shape[6]};
        std::memcpy(gather->vars, av, sizeof av);
        rc = reinterpret_cast<RunFn>(p[P_RUN])(gather, stream, err, sizeof err);
        if (rc < 0) return py::make_tuple(rc, sync_ns, gate_ns, scratch, std::string(err));
    }
    if (rc != 0) return py::make_tuple(rc, sync_ns, gate_ns, scratch);
    const int64_t n = *rows_out, num_local = p[P_LOCAL], n_info = p[P_N_INFO];
    const int64_t *info = reinterpret_cast<const int64_t *>(p[P_FLAG]) - n_info;
    auto tokens_per_expert = at::empty({num_local}, at::TensorOptions().dtype(at::kLong));
    std::memcpy(tokens_per_expert.data_ptr(), info + n_info - num_local, 8 * num_local);
    const int64_t end = 1 + w * (2 + num_local);
    std::vector<int64_t> num_send(info + end, info + end + w), num_recv(w);
    int64_t sent = 0;
    for (int64_t s = 0; s < w; s++) {
        num_recv[s] = info[2 + s * (2 + num_local)];
        sent += num_send[s];
    }
    return py::make_tuple(
        rc, sync_ns, gate_ns, scratch, recv_x.narrow(0, 0, n), recv_idx.narrow(0, 0, n),
        recv_w.narrow(0, 0, n), scratch.as_strided({t, w}, {w, 1}, p[P_O_SLOT]),
        scratch.as_strided({w + 1}, {1}, p[P_O_OFFSETS]),
        scratch.as_strided({sent}, {1}, p[P_O_SEND]), tokens_per_expert, num_send, num_recv);
}

// The first program, the launch gate and the second in one native call of a combine plan `p`
// (the GIL released: the gate may wait for peers). Returns (status, sync_ns, gate_ns, out), and
// when negative the library's error text.
static py::tuple run_gated(const int64_t *p, Program *first, Program *second,
                           const at::Tensor &out, int64_t record, int64_t stream) {
    int64_t sync_ns = 0, gate_ns = 0;
    char err[512] = {0};
    auto fn = reinterpret_cast<GatedFn>(p[C_FN]);
    int rc;
    {
        py::gil_scoped_release unlocked;
        rc = fn(first, second, stream, reinterpret_cast<int64_t *>(p[C_GATE]),
                static_cast<int>(p[C_WORLD]), static_cast<int>(p[C_RANK]), record,
                p[C_SPIN_NS], nullptr, 0, 0, &sync_ns, &gate_ns, err, sizeof err);
    }
    if (rc < 0) return py::make_tuple(rc, sync_ns, gate_ns, out, std::string(err));
    return py::make_tuple(rc, sync_ns, gate_ns, out);
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
    m.def("combine", &combine, "a planned gda combine in one call (see the file)");
    m.attr("PLAN_FIELDS") = static_cast<int64_t>(P_NUM_FIELDS);
    m.attr("COMBINE_FIELDS") = static_cast<int64_t>(C_NUM_FIELDS);
    m.attr("NOT_PLANNED") = static_cast<int64_t>(NOT_PLANNED);
}
