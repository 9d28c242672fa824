"""A bound plan of ``gda`` (a regular dispatch's front, gate and header; a combine's store,
gate and reduce; a weight combine with its ids) hands the native library exactly what the phase
methods hand it on the call that binds it: the call's tensors' addresses at the same offsets of
the dispatch's scratch, the op's number, the row counts and grids. The transport runs its real
host code over a stand-in library (:mod:`efa_ep.testing.gda_host`: no GPU); the GPU tests check
what the kernels then do with these arguments."""
import ctypes

import pytest
import torch

from efa_ep.kernels.gda import launches as kern
from efa_ep.testing.gda_host import header_info, last_completion, with_host_window

# (tests/kernels is on sys.path under pytest)
from gda_stand_in import E, H, K, L, T, T_MAX, W
from gda_stand_in import stand_in_transport as _transport


@pytest.fixture
def tr(tmp_path, monkeypatch):
    return _transport(tmp_path, monkeypatch)


@pytest.fixture(params=["python", "cpp"])
def tr_any(request, tmp_path, monkeypatch):
    """The transport with a repeated dispatch in Python, or in one C++ call (fast_launch=4)."""
    return _transport(tmp_path, monkeypatch, cpp=request.param == "cpp")


def _inputs(seed):
    """(generator, x [T, H] bf16, topk_idx [T, K], topk_weights [T, K]) of one seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return g, x, torch.randint(0, E, (T, K), generator=g), torch.rand(T, K, generator=g)


def _vars(prog):
    return list(prog._vars)


def _dispatch(tr, x, idx, w):
    out = tr.dispatch(x, idx, w)
    ph = tr._phases
    parity = tr._epoch % 2
    front = ph._progs[("front", parity, T, K, x.dtype, x.stride(0), H)]
    header = ph._progs[("header", parity)]
    return out, _vars(front), _vars(header), last_completion(tr.stand_in)


def test_dispatch_plan_passes_what_the_phase_methods_pass(tr):
    _, x, idx, w = _inputs(3)
    _, _, o_rank, o_slot, o_send, _, words = kern._layout_offsets(T, E, W, K)[1:]
    n_info = 1 + W * (2 + L) + W + L
    o_offsets = words + kern._even(n_info)
    plans = []
    for call in range(4):  # calls 0, 1 bind (one per parity); 2, 3 run the bound plans
        (recv_x, recv_idx, recv_w, tpe, h), front, header, (flag, value) = _dispatch(tr, x, idx, w)
        epoch = tr._epoch
        base = h.state.slot_TW.data_ptr() - 8 * o_slot  # the call's scratch
        assert front == [x.data_ptr(), idx.data_ptr(), w.data_ptr(), base, epoch]
        assert header == [base + 8 * o_rank, base + 8 * words, epoch]
        assert h.state.recv_offsets.data_ptr() == base + 8 * o_offsets
        assert h.send_token_idx.data_ptr() == base + 8 * o_send and h.send_token_idx.numel() == T + 6
        assert (flag, value) == (tr._phases._host[0] + 8 * n_info, kern.wait_record(epoch, "dispatch"))
        # the counts the header gave
        assert h.num_recv_per_rank == (T, 5) and h.num_send_per_rank == (T, 6)
        assert recv_x.shape == (T + 5, H) and recv_idx.shape == recv_w.shape == (T + 5, K)
        assert tpe.tolist() == [2] * L
        plans.append(sum(k[0] == "dispatch" for k in tr._phases._plans))
    assert plans == [1, 2, 2, 2]  # both parities' plans bound, then reused


def _next_gather_prog(tr, early=False):
    """The bound gather program the next dispatch (its parity) launches (``early``: the gather
    launched before the count read, bound once its plan gathers ahead)."""
    key = ("gather_early" if early else "gather", (tr._epoch + 1) % 2, K, H, torch.bfloat16)
    return tr._phases._progs.get(key)


@pytest.mark.parametrize("early", [0, 1])
def test_dispatch_gathers_in_its_native_call_once_its_rows_are_known(tr_any, early):
    tr = tr_any
    tr.gather_early = early
    # calls 0, 1 bind each parity's plan, 2, 3 learn the rows they receive; from call 4 the
    # outputs are allocated ahead and the library checks the counts and launches the gather:
    # after its count read, with the rows it read, or (early) before it, with the rows the
    # outputs hold (the kernel reads the count the header left on the device)
    _, x, idx, w = _inputs(6)
    n = T + 5
    cap = n + n // 8
    for call in range(8):
        gather = _next_gather_prog(tr, early and call >= 4) if call >= 2 else None
        if gather is not None:
            gather._vars[4] = -7  # the call must write the row count (or capacity) itself
        recv_x, recv_idx, recv_w, tpe, h = tr.dispatch(x, idx, w)
        assert recv_x.shape == (n, H) and recv_idx.shape == recv_w.shape == (n, K)
        assert h.num_recv_per_rank == (T, 5) and h.num_send_per_rank == (T, 6)
        assert h.send_token_idx.numel() == T + 6 and tpe.tolist() == [2] * L
        if call >= 4:
            rows = cap if early else n
            assert _vars(gather) == [h.state.recv_offsets.data_ptr(), recv_x.data_ptr(),
                                     recv_idx.data_ptr(), recv_w.data_ptr(), rows,
                                     min(rows, tr.num_programs)]
            # allocated ahead with headroom: the outputs are views of larger blocks
            assert recv_x.untyped_storage().nbytes() >= cap * H * 2 > n * H * 2
        elif call >= 2:  # gathered from Python, into outputs of exactly n rows
            assert recv_x.untyped_storage().nbytes() == n * H * 2
    # the early gather is a program of its own; the phases' gather is the one Python launches
    assert (_next_gather_prog(tr, True) is not None) == bool(early)


def test_cpp_dispatch_too_large_to_allocate_ahead_gathers_after_its_count_read(
        tmp_path, monkeypatch):
    """Outputs above what is allocated ahead (prefill-sized; here every size): from the third
    call the C++ call reads the counts, allocates outputs of exactly the rows received and
    launches the gather with them; before, Python gathered after the native call."""
    from efa_ep.kernels.gda import gather_ahead

    monkeypatch.setattr(gather_ahead, "GATHER_AHEAD_BYTES", 0)
    tr = _transport(tmp_path, monkeypatch, cpp=True)
    ran, cpp_dispatch = [], tr._phases.cpp.dispatch

    def counted(*a):
        res = cpp_dispatch(*a)
        ran.append(res[0])
        return res

    monkeypatch.setattr(tr._phases.cpp, "dispatch", counted)
    _, x, idx, w = _inputs(8)
    n = T + 5
    for call in range(6):
        # (the plan's gather: the early one, bound by the first call of the plan; it copies the
        # rows the header left on the device, up to the rows it is given: here all of them)
        gather = _next_gather_prog(tr, early=True) if call >= 3 else None
        if gather is not None:
            gather._vars[4] = -7  # the C++ call must write the row count it read
        epoch = tr._epoch
        recv_x, recv_idx, recv_w, tpe, h = tr.dispatch(x, idx, w)
        assert tr._epoch == epoch + 1  # one op number either way
        assert recv_x.shape == (n, H) and recv_idx.shape == recv_w.shape == (n, K)
        assert recv_x.untyped_storage().nbytes() == n * H * 2  # exact: nothing ahead
        assert h.num_recv_per_rank == (T, 5) and tpe.tolist() == [2] * L
        if call >= 2:
            if gather is None:  # (this call's parity)
                gather = tr._phases._progs[("gather_early", tr._epoch % 2, K, H, torch.bfloat16)]
            assert _vars(gather) == [h.state.recv_offsets.data_ptr(), recv_x.data_ptr(),
                                     recv_idx.data_ptr(), recv_w.data_ptr(), n,
                                     min(n, tr.num_programs)]
    assert ran == [0] * 4  # calls 2-5 each ran whole in the C++ call (status 0: gathered)


def test_cpp_dispatch_carves_its_outputs_and_layout_from_one_allocation(tmp_path, monkeypatch):
    """A dispatch that gathers in its C++ call makes one allocation: the layout scratch and the
    outputs are tensors over it, each of its own dtype, shape and strides, 256-byte aligned,
    none overlapping another; the handle is the transport's own frozen objects with every
    field; the Python path gives the same counts and the same layout for the same inputs."""
    import dataclasses

    from efa_ep.kernels.base import DispatchHandle
    from efa_ep.kernels.gda.window import GdaDispatchState

    tr = _transport(tmp_path, monkeypatch, cpp=True)
    (tmp_path / "py").mkdir()
    ref = _transport(tmp_path / "py", monkeypatch)
    _, x, idx, w = _inputs(9)
    n = T + 5
    for _ in range(6):  # from call 4 the C++ call gathers into outputs allocated ahead
        out = tr.dispatch(x, idx, w)
        want = ref.dispatch(x, idx, w)
    recv_x, recv_idx, recv_w, tpe, h = out
    st = h.state
    parts = [(recv_x, torch.bfloat16, (n, H)), (recv_idx, torch.int64, (n, K)),
             (recv_w, torch.float32, (n, K)), (st.slot_TW, torch.int64, (T, W)),
             (st.recv_offsets, torch.int64, (W + 1,)), (h.send_token_idx, torch.int64, (T + 6,))]
    base = recv_x.untyped_storage().data_ptr()
    spans = []
    for t, dtype, shape in parts:
        assert t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous()
        assert t.untyped_storage().data_ptr() == base  # one allocation
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    for t, _, _ in parts[:3]:  # (CUDA's allocator aligns the base to 512 bytes, CPU's to 64)
        assert (t.data_ptr() - base) % 256 == 0 and t.data_ptr() % 16 == 0
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two overlap
    assert type(h) is DispatchHandle and type(st) is GdaDispatchState
    assert dataclasses.asdict(st).keys() == {f.name for f in dataclasses.fields(st)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.num_tokens = 0
    wh = want[-1]
    assert (h.num_tokens, h.num_recv_tokens) == (wh.num_tokens, wh.num_recv_tokens) == (T, n)
    assert h.num_send_per_rank == wh.num_send_per_rank and h.topk_idx is idx
    assert h.num_recv_per_rank == wh.num_recv_per_rank
    assert (st.epoch, st.owner, st.fixed, st.num_recv_W) == (tr._epoch, tr.uid, False, None)
    assert torch.equal(tpe, want[3])


def test_cpp_dispatch_checks_its_inputs_and_leaves_other_cases_to_the_checked_path(tmp_path,
                                                                                 monkeypatch):
    tr = _transport(tmp_path, monkeypatch, cpp=True)
    _, x, idx, w = _inputs(6)
    checked, errors = [], []
    host_check = tr._host_check
    tr._host_check = lambda *a: (checked.append(tr._epoch + 1), errors.append(host_check(*a)),
                                 errors[-1])[2]
    # per parity: one call binds the plan, one makes the C++ constants (and gathers after its
    # count read in C++), then the C++ call straight from the transport's method
    for call in range(6):
        tr.dispatch(x, idx, w)
    assert checked == [1, 2, 3, 4]

    def run(*args):
        before, n_checked = tr._epoch, len(checked)
        out = tr.dispatch(*args)
        assert tr._epoch == before + 1 and out[-1].state.epoch == before + 1  # one op number
        assert out[-1].num_recv_per_rank == (T, 5) and out[0].shape == (T + 5, H)
        return len(checked) > n_checked  # whether the checked path ran

    # from then on the C++ call checks the inputs, straight from Python: the same tensors,
    # other tensors of the plan's case
    other = torch.empty(T * H + 8, dtype=torch.bfloat16)[8:].view(T, H)  # 16-byte aligned
    other.copy_(x)
    assert not run(x, idx, w) and not run(x, idx, w) and not run(other, idx.clone(), w.clone())
    # inputs that are not the plan's case take the checked path: valid ones run there...
    assert run(x, idx, w.t().contiguous().t())  # the same values, not contiguous
    # ...and invalid ones reach its checks, which name the tensor (the bad-input round that
    # follows launches kernels: not on this machine)
    for bad, what in ((idx.to(torch.int32), "topk_idx must be torch.int64"),
                      (idx.view(T, K, 1), "topk_idx must be [")):
        with pytest.raises(Exception):
            tr.dispatch(x, bad, w)
        assert what in errors[-1]


def test_cpp_combine_and_cached_dispatch_check_their_input_else_the_checked_path_runs(
        tmp_path, monkeypatch):
    from efa_ep.kernels.base import DispatchInputError

    tr = _transport(tmp_path, monkeypatch, cpp=True)
    g, x, idx, w = _inputs(8)
    checked = []
    row_fits = tr._check_row_fits
    tr._check_row_fits = lambda d, dt, what: (checked.append(what), row_fits(d, dt, what))[1]
    recv_x, *_, h = tr.dispatch(x, idx, w)
    n = h.num_recv_tokens
    y = torch.randn(n, H, generator=g).to(torch.bfloat16)

    gw = torch.randn(n, K, generator=g)

    def ops(y, x2, gw):
        before = len(checked), tr._epoch
        out, back, wback = tr.combine(y, h), tr.dispatch_cached(x2, h), \
            tr.combine_topk_weights(gw, h)
        assert tr._epoch == before[1] + 3 and out.shape == (T, H) and back.shape == (n, H)
        assert wback.shape == (T, K) and wback.dtype == torch.float32
        return checked[before[0]:]

    # these bind the plans (one per parity)...
    assert ops(y, x, gw) == ["combine", "cached dispatch", "weight combine"]
    assert ops(y, x, gw) == ["combine", "cached dispatch", "weight combine"]
    assert ops(y, x, gw) == [] and ops(y.clone(), x.clone(), gw.clone()) == []  # ...then C++
    yt = torch.randn(H, n, generator=g).to(torch.bfloat16).t()  # rows not dense
    gwt = torch.randn(K, n, generator=g).t()
    assert ops(yt, x, gwt) == ["combine", "weight combine"]
    # input errors reach the checked path's message (its round that tells the peers launches
    # kernels: not on this machine)
    from efa_ep.kernels.gda import refusal

    def refuse(tr, msg, kind):
        raise DispatchInputError(msg)

    monkeypatch.setattr(refusal, "refuse", refuse)
    with pytest.raises(DispatchInputError, match=rf"combine input y must be \[{n}, D\]"):
        tr.combine(y[:-1], h)
    with pytest.raises(DispatchInputError, match=rf"cached dispatch input x must be \[{T}, D\]"):
        tr.dispatch_cached(x[:-1], h)


def test_dispatch_leaves_counts_the_library_refuses_to_the_transport(tr_any):
    tr = tr_any
    from efa_ep.kernels.base import ProtocolError
    from efa_ep.testing.gda_host import header_info

    _, x, idx, w = _inputs(7)
    for _ in range(6):
        tr.dispatch(x, idx, w)
    # more rows than the capacity: gathered from Python into exact outputs, capacity grown
    info = header_info(W, L, rows_from=[T, T_MAX], rows_to=[T, 6], per_expert=[2] * L)
    tr.stand_in.stand_in_set_info((ctypes.c_int64 * len(info))(*info), len(info))
    recv_x, *_, h = tr.dispatch(x, idx, w)
    assert recv_x.shape == (T + T_MAX, H) and recv_x.untyped_storage().nbytes() == recv_x.nbytes
    assert h.num_recv_per_rank == (T, T_MAX)
    # a peer's count beyond max_tokens_per_rank: the transport's own check names it
    info = header_info(W, L, rows_from=[T, T_MAX + 1], rows_to=[T, 6], per_expert=[2] * L)
    tr.stand_in.stand_in_set_info((ctypes.c_int64 * len(info))(*info), len(info))
    with pytest.raises(ProtocolError, match=r"source rank\(s\) \[1\] announced row counts"):
        tr.dispatch(x, idx, w)


def test_dispatch_with_a_late_peer_gathers_after_the_transport_waited(tr_any):
    tr = tr_any
    # the peer is late at the launch gate of a dispatch that would gather in its native call:
    # the transport waits for it (its deadline), runs the header, and gathers from Python
    _, x, idx, w = _inputs(8)
    for _ in range(6):
        tr.dispatch(x, idx, w)
    tr.stand_in.stand_in_gate_late(1)
    recv_x, recv_idx, recv_w, tpe, h = tr.dispatch(x, idx, w)
    n = T + 5
    assert recv_x.shape == (n, H) and recv_x.untyped_storage().nbytes() == n * H * 2
    gather = tr._phases._progs[("gather", tr._epoch % 2, K, H, torch.bfloat16)]
    assert _vars(gather) == [h.state.recv_offsets.data_ptr(), recv_x.data_ptr(),
                             recv_idx.data_ptr(), recv_w.data_ptr(), n, min(n, tr.num_programs)]
    assert h.num_recv_per_rank == (T, 5) and tpe.tolist() == [2] * L
    recv_x, *_ = tr.dispatch(x, idx, w)  # and the next one gathers in its native call again
    assert recv_x.untyped_storage().nbytes() > n * H * 2


@pytest.mark.parametrize("change, rows", [
    ({}, 13), ({0: 1}, -1), ({1: 4}, -1), ({2: 33}, -1), ({2: -1}, -1), ("expert", -1),
    ("pairs", -1)])
def test_native_count_check_accepts_only_clean_counts(change, rows):
    from efa_ep.kernels import native_launch as nl
    from efa_ep.testing.gda_host import header_info

    try:
        nl.load()
    except nl.NativeLaunchError as e:
        pytest.skip(str(e))
    info = header_info(W, L, rows_from=[T, 5], rows_to=[T, 6], per_expert=[2] * L)
    if change == "expert":
        info[-1] = -1
    elif change == "pairs":  # more (row, expert) pairs than rows x top-k
        info[-1] = 13 * K - 2 * (L - 1) + 1
    else:
        for i, v in change.items():
            info[i] = v
    shape = (ctypes.c_int64 * 10)(W, 2 + L, L, T_MAX, K, 0, 0, 0, 0, len(info))
    buf = (ctypes.c_int64 * len(info))(*info)
    assert nl.rows_received(ctypes.addressof(buf), ctypes.addressof(shape)) == rows


def test_combine_and_weight_combine_plans_pass_their_tensors(tr_any):
    tr = tr_any
    g, x, idx, w = _inputs(4)
    ph = tr._phases
    for call in range(4):  # the dispatch, its combine and weight combine on alternating parities
        recv_x, recv_idx, recv_w, _, h = tr.dispatch(x, idx, w)
        n = recv_x.shape[0]
        y = torch.randn(n, H, generator=g).to(torch.bfloat16)
        out = tr.combine(y, h)
        parity = tr._epoch % 2
        store = ph._progs[("cstore", parity, H, y.dtype, y.stride(0), False, False)]
        reduce = ph._progs[("creduce", parity, H, out.dtype, "combine")]
        grid = min(n, tr.num_programs)
        assert _vars(store) == [y.data_ptr(), h.state.recv_offsets.data_ptr(), n, tr._epoch, grid]
        assert _vars(reduce) == [h.state.slot_TW.data_ptr(), out.data_ptr(), tr._epoch, T,
                                 min(T, tr.num_programs)]
        gw = torch.randn(n, K, generator=g)
        back = tr.combine_topk_weights(gw, h)
        parity = tr._epoch % 2
        store = ph._progs[("cstore", parity, K, torch.float32, K, False, True)]
        assert _vars(store) == [gw.data_ptr(), h.state.recv_offsets.data_ptr(),
                                h.recv_topk_idx.data_ptr(), n, tr._epoch, grid]
        assert back.shape == (T, K) and back.dtype == torch.float32
    assert {k[-1] for k in ph._plans if k[0] == "combine"} == {False, True}
    # with fast_launch=4 the planned combines were C++ calls (the plans carry their constants)
    assert all((p[2] is not None) == (tr.fast_launch == 4)
               for k, p in ph._plans.items() if k[0] == "combine")


def test_combine_and_cached_dispatch_with_a_late_peer_finish_after_the_transport_waited(tr_any):
    tr = tr_any
    g, x, idx, w = _inputs(6)
    ph = tr._phases
    waits = []
    await_peers = tr._await_peers
    tr._await_peers = lambda epoch, kind: (waits.append((epoch, kind)), await_peers(epoch, kind))
    lib, ran = tr.stand_in, []
    run = lib.efa_launch_run
    lib.efa_launch_run = lambda prog, *a: (ran.append(prog), run(prog, *a))[1]
    for call in range(4):  # the first calls bind the plans (one per parity), the later take them
        recv_x, *_, h = tr.dispatch(x, idx, w)
        y = torch.randn(recv_x.shape[0], H, generator=g).to(torch.bfloat16)
        tr.stand_in.stand_in_gate_late(1)  # the combine's store runs, a peer is late at the gate
        out = tr.combine(y, h)
        parity = tr._epoch % 2
        reduce = ph._progs[("creduce", parity, H, out.dtype, "combine")]
        # the reduce ran on its own after the wait, with this call's output
        assert ran[-1] == reduce._addr and waits[-1] == (tr._epoch, "combine")
        assert _vars(reduce) == [h.state.slot_TW.data_ptr(), out.data_ptr(), tr._epoch, T,
                                 min(T, tr.num_programs)]
        assert out.shape == (T, H)
        # likewise a cached dispatch's store and gather, once its plan is bound (before that
        # its gate is the transport's own, which finds the peers ahead here)
        x2 = torch.randn(T, H, generator=g).to(torch.bfloat16)
        planned = ("cached", (tr._epoch + 1) % 2, T, H, x2.dtype, H) in ph._plans
        tr.stand_in.stand_in_gate_late(int(planned))
        back = tr.dispatch_cached(x2, h)
        if planned:
            gather = ph._progs[("cgather", tr._epoch % 2, H, back.dtype)]
            n = h.num_recv_tokens
            assert ran[-1] == gather._addr and waits[-1] == (tr._epoch, "cached dispatch")
            assert _vars(gather) == [h.state.recv_offsets.data_ptr(), back.data_ptr(),
                                     tr._epoch, n, min(n, tr.num_programs)]
    assert len(waits) == 4 + 2  # every combine, the cached dispatches of calls 3 and 4


def test_cached_dispatch_plan_passes_its_tensors(tr_any):
    tr = tr_any
    g, x, idx, w = _inputs(5)
    ph = tr._phases
    *_, h = tr.dispatch(x, idx, w)
    for call in range(4):  # alternating parities: two calls bind, two run the plans
        x2 = torch.randn(T, H // 2, generator=g)  # float32 rows of the window's row bytes
        out = tr.dispatch_cached(x2, h)
        parity = tr._epoch % 2
        store = ph._progs[("cstore_x", parity, T, H // 2, x2.dtype, x2.stride(0))]
        gather = ph._progs[("cgather", parity, H // 2, x2.dtype)]
        n = h.num_recv_tokens
        assert out.shape == (n, H // 2) and out.dtype == torch.float32
        assert _vars(store) == [x2.data_ptr(), h.state.slot_TW.data_ptr(), tr._epoch]
        assert _vars(gather) == [h.state.recv_offsets.data_ptr(), out.data_ptr(), tr._epoch, n,
                                 min(n, tr.num_programs)]
        assert tr._gate.issued[0] == kern.wait_record(tr._epoch, "cached dispatch")
    assert sum(k[0] == "cached" for k in ph._plans) == 2
    assert all((p[2] is not None) == (tr.fast_launch == 4)
               for k, p in ph._plans.items() if k[0] == "cached")


def test_wait_in_reduce_binds_one_step_reading_programs_with_a_capped_grid(tr_any, monkeypatch):
    """With ``wait_in_reduce=1`` a combine's reduce and a cached dispatch's gather are bound as
    one step (the wait inside the kernel) whose grid is at most SMs / ranks sharing the GPU,
    on the Python path and in the C++ calls' plans; the dispatch's own gather keeps its grid."""
    from efa_ep.kernels.gda import cpp_op, phases

    fake = type("Tr", (), {"device": torch.device("cpu"), "timeout_s": 1.0, "layout_in_store": 1,
                           "num_programs": 264, "wait_programs": 66, "graph_launch": 1})
    made = {v: phases.GdaPhases(type("T", (fake,), {"wait_in_reduce": v})(), 3) for v in (0, 1)}
    assert (made[1].read_programs, made[1]._read_step, made[1].wait_in_kernel) == (66, 0, True)
    assert (made[0].read_programs, made[0]._read_step, made[0].wait_in_kernel) == (264, 1, False)
    tr = tr_any
    ph = tr._phases
    ph.wait_in_kernel, ph.read_programs, ph._read_step = True, 3, 0  # as wait_in_reduce=1 would
    steps = {}
    bind = phases.GdaPhases._program

    def recording(self, key, launch, tensors, ints=phases._EPOCH, grid_steps=()):
        steps[key[0]] = tuple(grid_steps)
        return bind(self, key, launch, tensors, ints, grid_steps)

    monkeypatch.setattr(phases.GdaPhases, "_program", recording)
    g, x, idx, w = _inputs(11)
    for call in range(4):  # two calls bind each parity's programs, two run the plans
        recv_x, _, _, _, h = tr.dispatch(x, idx, w)
        n = recv_x.shape[0]
        out = tr.combine(torch.randn(n, H, generator=g).to(torch.bfloat16), h)
        reduce = ph._progs[("creduce", tr._epoch % 2, H, out.dtype, "combine")]
        assert _vars(reduce)[2:] == [tr._epoch, T, min(T, 3)]
        x2 = torch.randn(T, H // 2, generator=g)
        back = tr.dispatch_cached(x2, h)
        gather = ph._progs[("cgather", tr._epoch % 2, H // 2, x2.dtype)]
        assert _vars(gather)[2:] == [tr._epoch, n, min(n, 3)] and back.shape == (n, H // 2)
    assert steps["creduce"] == steps["cgather"] == (0,) and n > 3
    assert _vars(_next_gather_prog(tr))[-1] == min(n, tr.num_programs)  # the dispatch's own
    if tr.fast_launch == 4:  # the C++ calls' plans carry the capped grid
        at = cpp_op.COMBINE_FIELDS.index("max_grid")
        assert {p[2].values[at] for k, p in ph._plans.items() if k[0] in ("combine", "cached")} \
            == {3}


def test_no_program_is_bound_from_a_call_with_an_empty_tensor():
    # (an empty tensor's address, 0 for every one of them, would bind the wrong argument:
    # a weight combine of zero rows once bound its ids as its gradient)
    from efa_ep.kernels.gda import phases

    ph = object.__new__(phases.GdaPhases)
    ph.tr = type("Tr", (), {"_capturing": False})()
    ph.native_off, ph._progs, ph.fast, ph.graph_launch = None, {}, True, True
    launched = []
    empty = torch.empty(0, K, dtype=torch.float32)
    assert ph._program(("k",), launched.append, (empty, torch.zeros(3))) is None
    assert launched == [] and ph._progs == {} and ph.native_off is None


def test_backward_check_runs_once_when_the_pass_ends(tr):
    """``after_backward`` inside a backward pass queues one error check for the pass's end (one
    host sync however many layers call it); outside a pass it checks at once; an error the check
    raises comes out of ``backward()``, before any optimizer step."""
    events = []
    real_check = tr.check_errors

    def check(op="call"):
        events.append("check")
        real_check(op)

    tr.check_errors = check

    class Layer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            events.append("layer backward")
            tr.after_backward()
            return g * 2

    x = torch.ones(3, requires_grad=True)
    Layer.apply(Layer.apply(Layer.apply(x))).sum().backward()
    assert events == ["layer backward"] * 3 + ["check"], events
    events.clear()
    tr.after_backward()  # no pass running: at once
    assert events == ["check"], events

    def failing(op="call"):
        events.append("check")
        raise RuntimeError("rank 0: gda combine (op 7) gave up waiting for source rank(s) [1]")

    tr.check_errors = failing
    events.clear()
    with pytest.raises(RuntimeError, match=r"gave up waiting for source rank\(s\) \[1\]"):
        Layer.apply(Layer.apply(x)).sum().backward()
    assert events == ["layer backward"] * 2 + ["check"], events
    tr.check_errors = check  # the next pass queues its own check again
    events.clear()
    Layer.apply(x).sum().backward()
    assert events == ["layer backward", "check"], events


def test_cpp_dispatch_says_why_it_is_off(monkeypatch):
    import torch.utils.cpp_extension as cpp

    from efa_ep.kernels import cpp_ext
    from efa_ep.kernels.gda import cpp_op, phases

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_ext, "_mods", {})
    monkeypatch.setattr(cpp_ext, "_why", {})
    monkeypatch.setattr(cpp, "verify_ninja_availability", no_ninja)
    why = cpp_op.availability()
    assert why is not None and "ninja" in why and "pip install ninja" in why
    # a transport asking for it (fast_launch=4) keeps the Python path and says why
    tr = type("Tr", (), {"device": torch.device("cpu"), "timeout_s": 1.0, "layout_in_store": 1,
                         "wait_in_reduce": 0, "num_programs": 8, "wait_programs": 4,
                         "graph_launch": 1})()
    monkeypatch.setattr(cpp_op, "_warned", False)
    monkeypatch.setattr(phases, "availability", lambda: None)  # native launching works here
    with pytest.warns(UserWarning, match="ninja"):
        ph = phases.GdaPhases(tr, 4)
    assert ph.cpp is None and ph.cpp_off is not None and "ninja" in ph.cpp_off
    assert phases.GdaPhases(tr, 3).cpp_off == "fast_launch < 4"


def test_token_counts_that_keep_changing_keep_the_program_tables_bounded(tr, monkeypatch):
    from efa_ep.kernels.gda import phases

    monkeypatch.setattr(phases, "MAX_PROGRAMS", 12)
    ph = tr._phases
    most = 0
    for t in [1, 2, 3, 4, 5, 6, 7, 8] * 2 + list(range(9, 30)):  # seen, seen again, then new
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, H, generator=g).to(torch.bfloat16)
        idx = torch.randint(0, E, (t, K), generator=g)
        recv_x, *_, h = tr.dispatch(x, idx, torch.rand(t, K, generator=g))
        assert recv_x.shape == (T + 5, H) and h.num_tokens == t
        most = max(most, len(ph._progs))
    # without the bound every token count would keep its front programs and plans (> 50 here)
    assert most <= 12 + 4 and len(ph._plans) <= 12


def test_compact_dispatch_in_its_cpp_call_passes_what_its_phases_pass(tmp_path, monkeypatch):
    """Option rows_in_window: the first dispatch of a shape runs phase by phase (binding the
    counts op's program, the rows op's and the compact header), a later one of the same parity
    runs whole in the C++ call; both hand the library the same variables at the same offsets of
    their scratch (the counts op's number, then the rows op's, one apart), and both return the
    rows and weights as views of the window at the parity's regions, the ids as a copy, and the
    same counts and handle. From the C++ call's second run on, the ids' copy lies in the
    scratch's allocation (room sized by the calls before), not in an allocation of its own, and
    the header's program makes it (no copy of the driver's after the count read)."""
    from efa_ep.kernels.gda import compact

    tr = with_host_window(_transport(tmp_path, monkeypatch, cpp=True))
    ph = tr._phases
    calls = []
    real = ph.cpp

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def dispatch_compact(self, *args):
            calls.append(args[6] - args[5])  # the rows op's number less the counts op's
            return real.dispatch_compact(*args)

    ph.cpp = Counting()
    _, x, idx, w = _inputs(3)
    n = T + 5
    words, _, _, o_rank, _, o_out, _, _ = compact._scratch_layout(tr, T, K)
    shape = (T, K, x.dtype, x.stride(0), H)
    ids = tr._buf[tr._offs[0]["idx_off"]:].view(torch.int64)[:n * K].view(n, K)
    room = [0, 0, n + n // 8]  # the rows of the ids' room each call gives its header program
    for call in range(3):  # ops 1, 2 then 3, 4, then 5, 6: the rows op on parity 0 each time
        ids.copy_(torch.arange(n * K).view(n, K) + 1000 * call)  # what the sources stored
        copies = tr.stand_in.stand_in_copies()
        recv_x, recv_idx, recv_w, tpe, h = tr.dispatch(x, idx, w)
        assert torch.equal(recv_idx, ids), call  # a copy of the window's ids
        # the driver copied them after the count read in the first C++ call (no room yet)
        assert tr.stand_in.stand_in_copies() - copies == (call == 1), call
        counts, rows, header, header_ids = (_vars(ph._progs[key]) for key in (
            ("compact_counts", 1) + shape, ("compact_rows", 0) + shape, ("header_compact", 0),
            ("header_compact_ids", 0, K)))
        sp = h.state.slot_TW.untyped_storage().data_ptr()  # the dispatch's scratch
        assert h.state.slot_TW.untyped_storage().nbytes() >= 8 * words
        op_c, op = 2 * call + 1, 2 * call + 2
        assert counts == [idx.data_ptr(), w.data_ptr(), sp, op_c], call
        assert rows == [x.data_ptr(), idx.data_ptr(), w.data_ptr(), sp, op_c, op], call
        if call == 0:  # the phases' header
            assert header == [sp + 8 * o_rank, sp + 8 * o_out, op], call
        else:  # the C++ call's: the header with the ids' copy into the room after the scratch
            assert header_ids == [sp + 8 * o_rank, sp + 8 * o_out, sp + -(-8 * words // 256) * 256,
                                  op, room[call]], call
        offs, win = tr._offs[0], tr._buf.untyped_storage().data_ptr()
        assert recv_x.shape == (n, H) and recv_x.data_ptr() == win + offs["data_off"]
        assert recv_w.shape == (n, K) and recv_w.data_ptr() == win + offs["w_off"]
        assert recv_idx.shape == (n, K) and recv_idx.untyped_storage().data_ptr() != win
        # (the first C++ call learns the rows; the next carves the ids after the scratch)
        assert (recv_idx.untyped_storage().data_ptr() == sp) == (call == 2), call
        assert h.recv_topk_idx is recv_idx and tr._epoch == op
        assert tpe.tolist() == [2] * L and h.num_recv_tokens == n
        assert h.num_recv_per_rank == (T, 5) and h.num_send_per_rank == (T, 6)
        assert calls == [1] * call, calls  # the second call went to C++, whole


def test_compact_rows_not_as_announced_raise_at_the_next_count_read(tr_any):
    """With rows_in_window the host reads the counts the sources announced, before their rows
    arrive; the header read after the stores sets ROWS_MISPLACED and the source's bit in the
    error word when a source stored other rows or elsewhere. The next dispatch's count read
    carries that word: it raises ProtocolError naming the source (first call of a shape and a
    repeated one, Python or C++), and the transport refuses every later call."""
    from efa_ep.kernels.base import ProtocolError, TransportBroken

    tr = with_host_window(tr_any)
    _, x, idx, w = _inputs(3)
    for _ in range(2):  # the shape's first call binds its programs, the second runs planned
        tr.dispatch(x, idx, w)
    tr._err.copy_(torch.tensor([kern.ROWS_MISPLACED, 0, 0, 0b10]))  # what the header read left
    info = header_info(W, L, rows_from=[T, 5], rows_to=[T, 6], per_expert=[2] * L)
    info[0] = kern.ROWS_MISPLACED  # the count wait's copy of the error word
    tr.stand_in.stand_in_set_info((ctypes.c_int64 * len(info))(*info), len(info))
    with pytest.raises(ProtocolError, match=r"rank 0: .*source rank\(s\) \[1\] stored other"):
        tr.dispatch(x, idx, w)
    with pytest.raises(TransportBroken):
        tr.dispatch(x, idx, w)


def test_auto_way_chosen_once_per_dispatch_in_the_cpp_call_or_python(tmp_path, monkeypatch):
    """Option rows_in_window=auto with the C++ dispatch: every dispatch posts its size exactly
    once on the launch gate's board (in the C++ call of the way the last dispatch took once
    that way is planned for the shape, else in Python) and takes the way the previous
    dispatch's sizes choose: compact (rows as views of the window) after a dispatch in which
    some rank sent at least the threshold, regular otherwise, switching either way, planned or
    not; no choice is made twice."""
    tr = with_host_window(_transport(tmp_path, monkeypatch, cpp=True))
    tr.rows_in_window, tr._rows_mode = False, "auto"
    gate, real = tr._gate, tr._phases.cpp
    tr._compact_rows = 20  # this rank sends T x min(W, K) = 16 at most: the peer's size decides
    tr._choice = gate.choice_block(20)
    made = []  # per dispatch: which C++ calls it made, with a choice block or without

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def dispatch(self, *args):
            made[-1].append(("regular", args[-1] != 0))
            return real.dispatch(*args)

        def dispatch_compact(self, *args):
            made[-1].append(("compact", args[-1] != 0))
            return real.dispatch_compact(*args)

    tr._phases.cpp = Counting()
    _, x, idx, w = _inputs(3)
    win = tr._buf.untyped_storage().data_ptr()
    peer = [0, 30, 1, 1, 30, 30, 30, 1, 1, 30, 1]  # rank 1's size in dispatch 1, 2, ...
    for c, size in enumerate(peer, start=1):
        made.append([])
        recv_x = tr.dispatch(x, idx, w)[0]
        compact_way = c > 1 and peer[c - 2] >= 20
        assert (recv_x.untyped_storage().data_ptr() == win) == compact_way, (c, made)
        assert gate.dispatches_posted == c, c  # posted once, by Python or C++
        mine = gate._size_base[c & 1]
        assert gate._slots[mine:mine + 2].tolist() == [c, T * min(W, K)], c
        # as the peer: its size for dispatch c, then its stamp
        gate._slots[mine + 3], gate._slots[mine + 2] = size, c
    assert tr.compact_dispatches == sum(s >= 20 for s in peer[:-1])
    # at most one C++ call with a choice per dispatch; once both ways are planned, a repeat of
    # the way is one C++ call that chose (none in Python), a switch the other way's call next
    assert all(sum(ch for _, ch in m) <= 1 for m in made), made
    assert made[6] == made[7] == [("compact", True)] and made[9] == [("regular", True)], made
    assert made[8] == [("compact", True), ("regular", False)], made
    assert made[10] == [("regular", True), ("compact", False)], made


def test_gather_early_2_runs_header_and_gather_as_one_program(tmp_path, monkeypatch):
    """``gather_early=2`` with the C++ dispatch: once a shape's outputs are allocated ahead, the
    header read and the early gather run as one bound program (one launch), its variables the
    header's (the call's scratch regions, the op number) and the gather's (the offsets, the
    outputs, the rows they hold, the grid) in its order; the gather's own program is not
    launched, and the results are those of the two programs (gather_early=1)."""
    tr = _transport(tmp_path, monkeypatch, cpp=True)
    tr.gather_early = 2
    _, x, idx, w = _inputs(6)
    n = T + 5
    cap = n + n // 8
    _, _, o_rank, o_slot, _, _, words = kern._layout_offsets(T, E, W, K)[1:]
    for call in range(8):
        parity = (tr._epoch + 1) % 2
        merged = tr._phases._progs.get(("header_gather", parity, K, H, torch.bfloat16))
        gather = _next_gather_prog(tr, True)
        if merged is not None:
            merged._vars[7] = -7  # the call must write the rows itself
            gather._vars[4] = -7
        recv_x, recv_idx, recv_w, tpe, h = tr.dispatch(x, idx, w)
        assert recv_x.shape == (n, H) and recv_idx.shape == recv_w.shape == (n, K), call
        assert h.num_recv_per_rank == (T, 5) and tpe.tolist() == [2] * L
        if call >= 4:
            base = h.state.slot_TW.data_ptr() - 8 * o_slot  # the call's scratch
            assert _vars(merged) == [base + 8 * o_rank, base + 8 * words,
                                     h.state.recv_offsets.data_ptr(), recv_x.data_ptr(),
                                     recv_idx.data_ptr(), recv_w.data_ptr(), tr._epoch, cap,
                                     min(cap, tr.num_programs)], call
            assert gather._vars[4] == -7, call  # the gather's own program was not launched
            assert recv_x.untyped_storage().nbytes() >= cap * H * 2 > n * H * 2
    assert merged is not None
