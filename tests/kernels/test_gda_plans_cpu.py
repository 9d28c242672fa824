"""A bound plan of ``gda`` (a regular dispatch's front, gate and header; a combine's store,
gate and reduce; a weight combine with its ids) hands the native library exactly what the phase
methods hand it on the call that binds it: the call's tensors' addresses at the same offsets of
the dispatch's scratch, the op's number, the row counts and grids. The transport runs its real
host code over a stand-in library (:mod:`efa_ep.testing.gda_host`: no GPU); the GPU tests check
what the kernels then do with these arguments."""
import pytest
import torch

from efa_ep.kernels.gda import launches as kern
from efa_ep.testing.gda_host import header_info, host_only_transport, last_completion, stand_in_library

W, E, H, T_MAX, K, T = 2, 16, 64, 32, 2, 8
L = E // W


@pytest.fixture
def tr(tmp_path, monkeypatch):
    try:
        lib = stand_in_library(str(tmp_path))
    except (OSError, FileNotFoundError) as e:
        pytest.skip(f"no C compiler here: {e}")
    info = header_info(W, L, rows_from=[T, 5], rows_to=[T, 6], per_expert=[2] * L)
    t = host_only_transport(lib, world=W, num_experts=E, hidden=H, t_max=T_MAX, info=info,
                            patch=monkeypatch.setattr)
    t.stand_in = lib
    return t


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


def test_combine_and_weight_combine_plans_pass_their_tensors(tr):
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


def test_cached_dispatch_plan_passes_its_tensors(tr):
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


def test_no_program_is_bound_from_a_call_with_an_empty_tensor():
    # (an empty tensor's address, 0 for every one of them, would bind the wrong argument:
    # a weight combine of zero rows once bound its ids as its gradient)
    from efa_ep.kernels.gda import phases

    ph = object.__new__(phases.GdaPhases)
    ph.tr = type("Tr", (), {"_capturing": False})()
    ph.native_off, ph._progs, ph.fast = None, {}, True
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
