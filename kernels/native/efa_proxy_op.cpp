// efa_proxy_op.cpp: a planned proxy dispatch and combine of CUDA rows, each as one C++ call (a
// torch extension).
//
// A planned case's Python path (kernels/proxy/planned.py) allocated the op's tensors, wrote the
// programs' variables and the op structs' per-call fields, then made its native calls
// (efa_devop.c); a dispatch read the row counts between its two calls to size its outputs. This
// does the same here: the inputs checked against the plan's case, the tensors made, the variables
// written straight into the programs, both native calls through their function pointers (the GIL
// released: they wait for peers), the row counts and the round's counters returned. Python keeps
// the plans, the accounting of the wire's round number, the errors and the handle. Built on first
// use by kernels/proxy/cpp_op.py (torch.utils.cpp_extension); without it the Python path runs.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "efa_tensor_views.h"

extern "C" {
#include "efa_launch.h"
#include "efa_proxy.h"
}

namespace {

// Writes a bound program's variables for its next run (the program at `address`, an
// efa_program_t whose vars the caller owns: the launch library only reads them).
template <size_t N>
void set_vars(int64_t address, const int64_t (&values)[N]) {
    auto *prog = reinterpret_cast<efa_program_t *>(address);
    std::memcpy(const_cast<int64_t *>(prog->vars), values, sizeof values);
}

typedef int (*DevopFn)(efa_op *, efa_devop *, char *, size_t);

// A dispatch plan's constants, an int64 array the caller keeps (kernels/proxy/cpp_op.py,
// DISPATCH_FIELDS).
enum {
    D_FN, D_FINISH, D_OP, D_DEV, D_PACK, D_READS, D_DEVICE, D_TOKENS, D_HIDDEN, D_X_STRIDE,
    D_X_DTYPE, D_TOPK, D_WORDS, D_O_SEND, D_LOCAL, D_PROGRAMS, D_WATCHER, D_ERR, D_ERRLEN,
    D_NUM_FIELDS
};

// A combine plan's constants (kernels/proxy/cpp_op.py, COMBINE_FIELDS).
enum {
    C_FN, C_OP, C_DEV, C_PACK, C_READS, C_DEVICE, C_HIDDEN, C_Y_STRIDE, C_Y_DTYPE, C_ROW_BYTES,
    C_SEND_AREA, C_PROGRAMS, C_WATCHER, C_CHUNK_BYTES, C_ERR, C_ERRLEN, C_NUM_FIELDS
};

// Status of a call whose inputs are not the plan's case: nothing ran, the caller's Python path
// takes it (and its checks name anything wrong).
constexpr int NOT_PLANNED = 100;

using efa_views::carve;
using efa_views::on;
using efa_views::up256;

// [rows, width] with unit column stride and row stride `stride`, of dtype `dtype` (an
// at::ScalarType's number), on `device`.
bool rows_fit(const at::Tensor &a, int64_t rows, int64_t width, int64_t stride, int64_t dtype,
              int64_t device) {
    return a.dim() == 2 && a.size(0) == rows && a.size(1) == width && a.stride(1) == 1 &&
           a.stride(0) == stride && static_cast<int64_t>(a.scalar_type()) == dtype &&
           on(a, device);
}

bool routing_fit(const at::Tensor &a, int64_t t, int64_t k, at::ScalarType dtype,
                 int64_t device) {
    return a.dim() == 2 && a.size(0) == t && a.size(1) == k && a.scalar_type() == dtype &&
           a.is_contiguous() && on(a, device);
}

at::TensorOptions on_device(at::ScalarType dtype, int64_t device) {
    auto o = at::TensorOptions().dtype(dtype);
    return device == -2 ? o : o.device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
}

int64_t i64(const void *p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

// The reading kernel's programs for n rows or tokens (kernels/proxy/device.py reads_grid).
int64_t reads_grid(int64_t n, int64_t programs, int64_t watcher) {
    return std::max<int64_t>(1, std::min(n, programs)) + watcher;
}

// The chunk marks' tag of round seq when the reading kernel is launched before the complete
// (efa_mark_tag; kernels/proxy/native.py mark_tag), else 0.
int64_t tag(const efa_devop *d, int64_t seq) { return d->early ? (seq & 0x3FFFFFFF) + 1 : 0; }

py::tuple counters(const efa_op *o) {
    const efa_wire *w = o->wire;
    return py::make_tuple(w->r_writes, w->r_wire_bytes, w->r_messages, w->r_rows);
}

// Sets the per-call fields both native calls read: the round's number, the stream, the previous
// op's reads event (0: none) and the step.
void per_call(efa_op *o, efa_devop *d, int64_t seq, int64_t stream, int64_t wait_event) {
    o->seq = seq;
    d->stream = stream;
    d->wait_event = wait_event;
    d->step = 0;
}

}  // namespace

// A planned dispatch of x [T, H], topk_idx [T, K] int64, topk_weights [T, K] float32 (the plan's
// case: its T, H, x's row stride and dtype, K, the device; 16-byte aligned): the scratch and
// tokens_per_expert made, the packing program's variables (x, idx, weights, scratch), the first
// native call (efa_devop_dispatch: quiesce, pack, the previous reads waited for, the round's
// begin and post, the row counts), the outputs sized by the counts, the reading program's
// variables, the second call (efa_devop_dispatch_finish: reads, complete, event). `seq`: the
// round's number; `wait_event`: the previous op's reads event or 0.
// Returns (NOT_PLANNED,) having run nothing when the inputs are not the plan's case; else
// (rc, step, counters, rc_finish, outputs): rc and step of the first call (rc != 0: outputs None
// and rc_finish 0), the round's counters (writes, wire bytes, messages, rows) after it, then
// the finish's rc and, when both returned 0, (recv_x, recv_idx, recv_w, tokens_per_expert,
// send_idx, num_send, num_recv).
py::tuple dispatch(const at::Tensor &x, const at::Tensor &topk_idx,
                   const at::Tensor &topk_weights, int64_t plan_address, int64_t seq,
                   int64_t stream, int64_t wait_event) {
    const int64_t *p = reinterpret_cast<const int64_t *>(plan_address);
    const int64_t device = p[D_DEVICE], t = p[D_TOKENS], k = p[D_TOPK];
    if (!rows_fit(x, t, p[D_HIDDEN], p[D_X_STRIDE], p[D_X_DTYPE], device) ||
        !routing_fit(topk_idx, t, k, at::kLong, device) ||
        !routing_fit(topk_weights, t, k, at::kFloat, device))
        return py::make_tuple(NOT_PLANNED);
    auto *o = reinterpret_cast<efa_op *>(p[D_OP]);
    auto *d = reinterpret_cast<efa_devop *>(p[D_DEV]);
    auto *err = reinterpret_cast<char *>(p[D_ERR]);
    const size_t errlen = static_cast<size_t>(p[D_ERRLEN]);
    auto scratch = at::empty({p[D_WORDS]}, on_device(at::kLong, device));
    auto tpe = at::empty({p[D_LOCAL]}, at::TensorOptions().dtype(at::kLong));
    const int64_t xp = i64(x.data_ptr()), sp = i64(scratch.data_ptr());
    const int64_t pv[4] = {xp, i64(topk_idx.data_ptr()), i64(topk_weights.data_ptr()), sp};
    set_vars(p[D_PACK], pv);
    o->tokens_per_expert = static_cast<int64_t *>(tpe.data_ptr());
    per_call(o, d, seq, stream, wait_event);
    int rc;
    {
        py::gil_scoped_release unlocked;  // the call waits for peers and our previous writes
        rc = reinterpret_cast<DevopFn>(p[D_FN])(o, d, err, errlen);
    }
    const int64_t step = d->step;
    auto round = counters(o);
    if (rc) return py::make_tuple(rc, step, round, 0, py::none());
    const int64_t w = o->wire->world;
    int64_t n = 0, sent = 0;
    py::tuple num_send(w), num_recv(w);
    for (int64_t r = 0; r < w; r++) {  // bounded by the round's checked headers
        n += o->num_recv[r];
        sent += o->num_send[r];
        num_recv[r] = py::int_(o->num_recv[r]);
        num_send[r] = py::int_(o->num_send[r]);
    }
    // the received ids and weights carved out of one allocation (small; the handle keeps the
    // ids); the rows get their own, which the caller may free while the handle lives
    auto recv_x = at::empty({n, p[D_HIDDEN]}, x.options());
    const int64_t idx_bytes = up256(n * k * 8);
    auto routing = at::empty({idx_bytes + n * k * 4}, x.options().dtype(at::kByte));
    auto recv_idx = carve(routing, at::kLong, {n, k}, {k, 1}, 0);
    auto recv_w = carve(routing, at::kFloat, {n, k}, {k, 1}, idx_bytes);
    const int64_t rv[9] = {xp, sp + 8 * p[D_O_SEND], i64(recv_x.data_ptr()),
                           i64(recv_idx.data_ptr()), i64(recv_w.data_ptr()), d->own_start, n,
                           tag(d, o->seq), reads_grid(n, p[D_PROGRAMS], p[D_WATCHER])};
    set_vars(p[D_READS], rv);
    {
        py::gil_scoped_release unlocked;
        rc = reinterpret_cast<DevopFn>(p[D_FINISH])(o, d, err, errlen);
    }
    if (rc) return py::make_tuple(0, step, round, rc, py::none());
    auto send_idx = carve(scratch, at::kLong, {sent}, {1}, 8 * p[D_O_SEND]);
    return py::make_tuple(0, step, round, 0,
                          py::make_tuple(recv_x, recv_idx, recv_w, tpe, send_idx, num_send,
                                         num_recv));
}

// A planned combine of y [N, H] (the plan's H, row stride and dtype, on its device, 16-byte
// aligned) along a handle whose rows are send_idx [S] int64 (on the device, 16-byte aligned),
// num_send / num_recv its rows per rank (W each), into a new out [T, H] (T = num_tokens): the
// row counts into the op's arrays, the packing program's variables (y, own start and end, N,
// rows a chunk, grid), the reading program's (y, send_idx, out, own start, T, tag, grid), then
// one native call (efa_devop_rows: quiesce, pack, the previous reads waited for, begin, post,
// reads, complete, event). Returns (NOT_PLANNED,) having run nothing when the inputs are not the
// plan's case, N is not the handle's rows received or the peers' rows exceed the send area;
// else (rc, step, counters, out) with out None unless rc is 0.
py::tuple combine(const at::Tensor &y, const at::Tensor &send_idx,
                  const std::vector<int64_t> &num_send, const std::vector<int64_t> &num_recv,
                  int64_t num_tokens, int64_t plan_address, int64_t seq, int64_t stream,
                  int64_t wait_event) {
    const int64_t *p = reinterpret_cast<const int64_t *>(plan_address);
    auto *o = reinterpret_cast<efa_op *>(p[C_OP]);
    auto *d = reinterpret_cast<efa_devop *>(p[C_DEV]);
    const int64_t device = p[C_DEVICE], w = o->wire->world, me = o->wire->rank;
    if (static_cast<int64_t>(num_send.size()) != w || static_cast<int64_t>(num_recv.size()) != w)
        return py::make_tuple(NOT_PLANNED);
    int64_t n = 0, s_me = 0;
    for (int64_t r = 0; r < w; r++) {
        if (r < me) s_me += num_recv[r];
        n += num_recv[r];
    }
    if (num_tokens <= 0 || n <= 0 ||
        !rows_fit(y, n, p[C_HIDDEN], p[C_Y_STRIDE], p[C_Y_DTYPE], device) || send_idx.dim() != 1 ||
        send_idx.scalar_type() != at::kLong || send_idx.numel() == 0 || !on(send_idx, device) ||
        (n - num_recv[me]) * p[C_ROW_BYTES] > p[C_SEND_AREA])
        return py::make_tuple(NOT_PLANNED);
    auto *err = reinterpret_cast<char *>(p[C_ERR]);
    const size_t errlen = static_cast<size_t>(p[C_ERRLEN]);
    std::memcpy(o->num_send, num_send.data(), 8 * w);
    std::memcpy(o->num_recv, num_recv.data(), 8 * w);
    const int64_t grid = std::max<int64_t>(1, std::min(n, p[C_PROGRAMS]));
    const int64_t per_program = std::max<int64_t>(
        1, (p[C_CHUNK_BYTES] + p[C_ROW_BYTES] * grid - 1) / (p[C_ROW_BYTES] * grid));
    const int64_t chunk_rows = grid * per_program;  // DevicePath._chunk_rows
    o->progress_words = grid;
    o->chunk_rows = chunk_rows;
    auto out = at::empty({num_tokens, y.size(1)}, y.options());
    const int64_t yp = i64(y.data_ptr());
    const int64_t pv[6] = {yp, s_me, s_me + num_recv[me], n, chunk_rows, grid};
    set_vars(p[C_PACK], pv);
    per_call(o, d, seq, stream, wait_event);
    const int64_t rv[7] = {yp, i64(send_idx.data_ptr()), i64(out.data_ptr()), s_me, num_tokens,
                           tag(d, seq), reads_grid(num_tokens, p[C_PROGRAMS], p[C_WATCHER])};
    set_vars(p[C_READS], rv);
    int rc;
    {
        py::gil_scoped_release unlocked;  // the call waits for peers and our previous writes
        rc = reinterpret_cast<DevopFn>(p[C_FN])(o, d, err, errlen);
    }
    const int64_t step = d->step;
    if (rc) return py::make_tuple(rc, step, counters(o), py::none());
    return py::make_tuple(0, step, counters(o), out);
}

// The number of a's dtype as the plans hold it (at::ScalarType).
int64_t scalar_type(const at::Tensor &a) { return static_cast<int64_t>(a.scalar_type()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("scalar_type", &scalar_type, "the number of a tensor's dtype as a plan holds it");
    m.def("dispatch", &dispatch, "a planned proxy dispatch in one call (see the file)");
    m.def("combine", &combine, "a planned proxy combine in one call (see the file)");
    m.attr("DISPATCH_FIELDS") = static_cast<int64_t>(D_NUM_FIELDS);
    m.attr("COMBINE_FIELDS") = static_cast<int64_t>(C_NUM_FIELDS);
    m.attr("NOT_PLANNED") = static_cast<int64_t>(NOT_PLANNED);
}
