"""``gda``'s fixed-capacity dispatch, eager: its front and fixed header run as two bound programs
in one native call with the launch gate between them, and hand the native library what the
Python launches would: the call's tensors' addresses, the op's number and whether the id region
must be cleared whole. The transport runs its real host code over a stand-in library
(:mod:`efa_ep.testing.gda_host`: no GPU); the GPU tests check what the kernels then do."""
import pytest
import torch

from efa_ep.kernels.gda import launches as kern

# (tests/kernels is on sys.path under pytest)
from gda_stand_in import E, H, K, L, T, T_MAX, W
from gda_stand_in import stand_in_transport as _transport


@pytest.fixture
def tr(tmp_path, monkeypatch):
    return _transport(tmp_path, monkeypatch)


def _inputs(seed, k=K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return x, torch.randint(0, E, (T, k), generator=g), torch.rand(T, k, generator=g)


def test_fixed_dispatch_programs_pass_what_the_python_launches_pass(tr):
    x, idx, w = _inputs(1)
    o_slot, o_send = kern._layout_offsets(T, E, W, K)[4:6]
    rows = W * T_MAX
    seen = {}
    for call in range(6):  # calls 0, 1 bind (one program pair per parity); the rest run them
        recv_x, recv_idx, recv_w, num_recv, tpe, h = tr.dispatch_fixed(x, idx, w)
        epoch, parity = tr._epoch, tr._epoch % 2
        progs = tr._phases._progs
        front = list(progs[("front", parity, T, K, x.dtype, x.stride(0), H)]._vars)
        header = list(progs[("header_fixed", parity, K)]._vars)
        base = h.state.slot_TW.data_ptr() - 8 * o_slot  # the call's scratch
        assert front == [x.data_ptr(), idx.data_ptr(), w.data_ptr(), base, epoch]
        # the id region is cleared whole the first time a parity is written with this top-k
        assert header == [num_recv.data_ptr(), tpe.data_ptr(), epoch, int(call < 2)]
        assert h.send_token_idx.data_ptr() == base + 8 * o_send
        assert h.state.fixed and h.state.num_recv_W is num_recv and h.num_recv_tokens == rows
        # the receive buffers are the window: fresh views of this parity's regions each call
        assert recv_x.shape == (rows, H) and recv_idx.shape == recv_w.shape == (rows, K)
        offs = tr._offs[parity]
        assert recv_x.data_ptr() == tr._buf.data_ptr() + offs["data_off"]
        assert recv_idx.data_ptr() == tr._buf.data_ptr() + offs["idx_off"]
        assert recv_w.data_ptr() == tr._buf.data_ptr() + offs["w_off"]
        assert all(v is not seen.get((parity, i)) for i, v in enumerate((recv_x, recv_idx)))
        seen.update({(parity, 0): recv_x, (parity, 1): recv_idx})
    # another top-k: its own header program, the id region cleared whole again
    x, idx, w = _inputs(2, k=K + 1)
    *_, num_recv, tpe, h = tr.dispatch_fixed(x, idx, w)
    header = list(tr._phases._progs[("header_fixed", tr._epoch % 2, K + 1)]._vars)
    assert header == [num_recv.data_ptr(), tpe.data_ptr(), tr._epoch, 1]


def test_fixed_dispatch_with_a_late_peer_runs_its_header_after_the_transport_waited(tr,
                                                                                  monkeypatch):
    x, idx, w = _inputs(3)
    for _ in range(2):
        tr.dispatch_fixed(x, idx, w)
    waited = []
    real = tr._await_peers
    monkeypatch.setattr(tr, "_await_peers", lambda e, kind: (waited.append((e, kind)),
                                                             real(e, kind)))
    tr.stand_in.stand_in_gate_late(1)
    *_, num_recv, tpe, h = tr.dispatch_fixed(x, idx, w)
    assert waited == [(tr._epoch, "dispatch")]
    header = list(tr._phases._progs[("header_fixed", tr._epoch % 2, K)]._vars)
    assert header == [num_recv.data_ptr(), tpe.data_ptr(), tr._epoch, 0]



@pytest.mark.parametrize("cpp", [False, True], ids=["python", "cpp"])
def test_fixed_combine_plan_passes_its_tensors_and_goes_straight_to_cpp(tmp_path, monkeypatch,
                                                                       cpp):
    """A combine along a fixed-capacity handle: the store reads the device's row counts over a
    grid of T_MAX rows; once its plan is bound, with fast_launch=4 the call goes to C++ before
    the transport's checked path, as a regular combine's does."""
    tr = _transport(tmp_path, monkeypatch, cpp=cpp)
    checked = []
    real = tr._combine
    monkeypatch.setattr(tr, "_combine", lambda *a, **k: (checked.append(1), real(*a, **k))[1])
    x, idx, w = _inputs(5)
    ph, rows = tr._phases, W * T_MAX
    g = torch.Generator().manual_seed(6)
    parities = set()
    for call in range(6):
        recv_x, _, _, num_recv, _, h = tr.dispatch_fixed(x, idx, w)
        y = torch.randn(rows, H, generator=g).to(torch.bfloat16)
        out = tr.combine(y, h)
        parity = tr._epoch % 2
        parities.add(parity)
        store = ph._progs[("cstore", parity, H, y.dtype, y.stride(0), True, False)]
        reduce = ph._progs[("creduce", parity, H, out.dtype, "combine")]
        assert list(store._vars) == [y.data_ptr(), num_recv.data_ptr(), rows, tr._epoch,
                                     min(T_MAX, tr.num_programs)]
        assert list(reduce._vars) == [h.state.slot_TW.data_ptr(), out.data_ptr(), tr._epoch, T,
                                      min(T, tr.num_programs)]
        assert out.shape == (T, H) and out.dtype == torch.bfloat16
    # the first call of each parity binds its plan through the checked path; later ones: C++
    assert len(checked) == (len(parities) if cpp else 6)
    if cpp:  # rows that are not the handle's are left to the checked path, nothing ran
        from efa_ep.kernels.gda import cpp_op

        *_, h = tr.dispatch_fixed(x, idx, w)
        epoch = tr._epoch
        assert cpp_op.combine_planned(ph, torch.zeros(rows - 1, H, dtype=torch.bfloat16),
                                      h) is None
        assert tr._epoch == epoch


def test_fixed_dispatch_in_one_cpp_call_passes_what_the_phase_methods_pass(tmp_path,
                                                                          monkeypatch):
    """fast_launch=4: once a shape's programs are bound, a fixed dispatch goes from the
    transport's method to one C++ call, which writes the same variables the Python path writes
    and returns the same views; inputs that are not the plan's case are left to the checked
    path with nothing run."""
    from efa_ep.kernels.gda import fixed

    tr = _transport(tmp_path, monkeypatch, cpp=True)
    checked = []
    real = tr._host_check
    monkeypatch.setattr(tr, "_host_check", lambda *a: (checked.append(1), real(*a))[1])
    x, idx, w = _inputs(7)
    o_slot, o_send = kern._layout_offsets(T, E, W, K)[4:6]
    rows, ph = W * T_MAX, tr._phases
    for call in range(6):
        recv_x, recv_idx, recv_w, num_recv, tpe, h = tr.dispatch_fixed(x, idx, w)
        epoch, parity = tr._epoch, tr._epoch % 2
        front = list(ph._progs[("front", parity, T, K, x.dtype, x.stride(0), H)]._vars)
        header = list(ph._progs[("header_fixed", parity, K)]._vars)
        base = h.state.slot_TW.data_ptr() - 8 * o_slot
        assert front == [x.data_ptr(), idx.data_ptr(), w.data_ptr(), base, epoch]
        assert header == [num_recv.data_ptr(), tpe.data_ptr(), epoch, int(call < 2)]
        assert h.state.slot_TW.shape == (T, W) and h.send_token_idx.shape == (T * W,)
        assert h.send_token_idx.data_ptr() == base + 8 * o_send
        assert num_recv.shape == (W,) and tpe.shape == (L,) and num_recv.dtype == torch.int64
        assert num_recv.data_ptr() % 16 == 0 and tpe.data_ptr() % 16 == 0
        assert h.state.fixed and h.state.num_recv_W is num_recv and h.state.epoch == epoch
        assert h.num_recv_tokens == rows and h.topk_idx is idx
        offs = tr._offs[parity]
        assert recv_x.shape == (rows, H) and recv_x.dtype == torch.bfloat16
        assert recv_x.data_ptr() == tr._buf.data_ptr() + offs["data_off"]
        assert recv_idx.shape == recv_w.shape == (rows, K) and recv_w.dtype == torch.float32
        assert recv_idx.data_ptr() == tr._buf.data_ptr() + offs["idx_off"]
        assert recv_w.data_ptr() == tr._buf.data_ptr() + offs["w_off"]
        assert tr._idx_k[parity] == K and tr._idx_epoch[parity] == epoch
    assert len(checked) == 2  # the first call of each parity bound its programs
    # not the plan's case (ids not contiguous): nothing ran, the checked path takes it
    idx_t = idx.t().contiguous().t()
    epoch = tr._epoch
    assert fixed.dispatch_planned(tr, x, idx_t, w) is None and tr._epoch == epoch
    *_, num_recv, tpe, h = tr.dispatch_fixed(x, idx_t, w)
    assert len(checked) == 3 and tr._epoch == epoch + 1
    # a peer late at the gate: the transport waits for it, then runs the header
    waited = []
    real_wait = tr._await_peers
    monkeypatch.setattr(tr, "_await_peers", lambda e, kind: (waited.append((e, kind)),
                                                             real_wait(e, kind)))
    tr.stand_in.stand_in_gate_late(1)
    *_, num_recv, tpe, h = tr.dispatch_fixed(x, idx, w)
    assert waited == [(tr._epoch, "dispatch")] and len(checked) == 3
    header = list(ph._progs[("header_fixed", tr._epoch % 2, K)]._vars)
    assert header == [num_recv.data_ptr(), tpe.data_ptr(), tr._epoch, 0]


@pytest.mark.parametrize("cpp", [False, True], ids=["python", "cpp"])
def test_fixed_cached_dispatch_and_weight_combine_plans(tmp_path, monkeypatch, cpp):
    """Along a fixed-capacity handle: a cached dispatch's store and wait run as bound programs
    in one native call with the gate between them and return the window's data region; a
    weight combine's store reads the device's row counts and the window's ids. With
    fast_launch=4 both go straight to C++ once planned (the weight combine not once a later
    dispatch overwrote the ids)."""
    tr = _transport(tmp_path, monkeypatch, cpp=cpp)
    checked, begun = [], []
    real, real_begin = tr._combine, tr._begin_op
    monkeypatch.setattr(tr, "_combine", lambda *a, **k: (checked.append(a[2]), real(*a, **k))[1])
    monkeypatch.setattr(tr, "_begin_op", lambda op: (begun.append(op), real_begin(op))[1])
    x, idx, w = _inputs(8)
    ph, rows = tr._phases, W * T_MAX
    g = torch.Generator().manual_seed(9)
    wparities = set()
    for call in range(6):
        *_, num_recv, _, h = tr.dispatch_fixed(x, idx, w)
        x2 = torch.randn(T, H, generator=g).to(torch.bfloat16)
        got = tr.dispatch_cached(x2, h)
        epoch, parity = tr._epoch, tr._epoch % 2
        store = list(ph._progs[("cstore_x", parity, T, H, x2.dtype, x2.stride(0))]._vars)
        assert store == [x2.data_ptr(), h.state.slot_TW.data_ptr(), epoch]
        assert list(ph._progs[("wait", "cached dispatch")]._vars) == [epoch]
        assert got.shape == (rows, H) and got.dtype == x2.dtype
        assert got.data_ptr() == tr._buf.data_ptr() + tr._offs[parity]["data_off"]
        gw = torch.randn(rows, K, generator=g)
        back = tr.combine_topk_weights(gw, h)
        parity = tr._epoch % 2
        wparities.add(parity)
        wstore = list(ph._progs[("cstore", parity, K, torch.float32, K, True, True)]._vars)
        assert wstore == [gw.data_ptr(), num_recv.data_ptr(), h.recv_topk_idx.data_ptr(), rows,
                          tr._epoch, min(T_MAX, tr.num_programs)]
        assert back.shape == (T, K) and back.dtype == torch.float32
    weight = [k for k in checked if k == "weight combine"]
    # the first weight combine of each parity binds its plan through the checked path
    assert len(weight) == (len(wparities) if cpp else 6)
    # likewise the cached dispatch (its ops land on alternating parities too)
    assert begun.count("dispatch_cached") == (len(wparities) if cpp else 6)
    if cpp:  # ids overwritten by two later dispatches: left to the checked path, which refuses
        from efa_ep.kernels.gda import cpp_op

        *_, h = tr.dispatch_fixed(x, idx, w)
        tr.dispatch_fixed(x, idx, w)
        tr.dispatch_fixed(x, idx, w)
        epoch = tr._epoch
        assert cpp_op.weight_combine_planned(ph, torch.zeros(rows, K), h) is None
        assert tr._epoch == epoch
        # a cached dispatch of other rows than the handle's tokens: nothing ran (its C++ check)
        from efa_ep.kernels.gda import fixed

        *_, h = tr.dispatch_fixed(x, idx, w)
        tr.dispatch_cached(torch.zeros(T, H, dtype=torch.bfloat16), h)  # (plans this parity's)
        *_, h = tr.dispatch_fixed(x, idx, w)
        epoch = tr._epoch
        assert ("cached_fixed", (epoch + 1) & 1, T, H, torch.bfloat16, H) in ph._plans
        assert fixed.cached_planned(tr, torch.zeros(T - 1, H, dtype=torch.bfloat16), h) is None
        assert tr._epoch == epoch
