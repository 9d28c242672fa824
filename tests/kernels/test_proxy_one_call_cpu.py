"""The proxy's one-call path (``kernels/proxy/planned.py`` over ``efa_devop.c``) on the CPU.

On a GPU a packed op's kernels store the send plane and read the window; here a stand-in
device does that work in Python when the native call launches a "program" (the launch
library's entry points are replaced by callbacks that run the stand-in and record every launch,
event wait and record). The round itself is the real one: two ranks over libfabric tcp on
loopback, the native begin / post / complete with their checks. Checked: dispatch and combine
bit-identical to the ``torch`` transport through the transport's own methods; the order of the
native call's steps (the packing launch before the previous op's reads are waited for, the
reading launch, then its event); a routing the stand-in device flags is refused on every rank,
naming the rank, and the transport stays usable; a failing launch breaks the transport with the
library's message. The GPU test (``test_proxy.py``, ``gpu_host_staged`` and ``one_call``) runs
the same path with the real kernels.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from efa_ep.distributed import run_ranks
from efa_ep.kernels import proxy as proxy_mod

pytestmark = pytest.mark.skipif(proxy_mod.availability() is not None,
                                reason=f"proxy unavailable: {proxy_mod.availability()}")

LOOPBACK = {"FI_TCP_IFACE": "lo", "FI_PROVIDER": "tcp", "OMP_NUM_THREADS": "1"}
E, H, T, K, MAX_T = 8, 32, 12, 2, 16
_RUN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                        ctypes.c_size_t)
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_size_t)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t)


def _at(ptr: int, shape, dtype) -> torch.Tensor:
    """A CPU tensor over the memory at ``ptr`` (what a device kernel would address)."""
    n = int(np.prod(shape)) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=dtype).view(shape)


class _ProgramStruct(ctypes.Structure):
    """The launch library's program record as the C++ calls see it: they write ``vars``."""

    _fields_ = [("recs", ctypes.c_void_p), ("num_recs", ctypes.c_int64),
                ("uses", ctypes.c_void_p), ("num_uses", ctypes.c_int64),
                ("vars", ctypes.POINTER(ctypes.c_int64)), ("graph_mode", ctypes.c_int64),
                ("graph", ctypes.c_void_p)]


class _Program:
    """Stands in for a bound native program of ``num_vars`` variables: ``set_vars`` (the Python
    path) or the C++ call writes them into its record, the native call's launch runs
    ``device(values)`` (a reading program's at the event recorded after it)."""

    def __init__(self, device, programs, num_vars, reads=False):
        self.device, self.reads, self.num_vars = device, reads, num_vars
        self._vars = (ctypes.c_int64 * num_vars)()
        self._rec = _ProgramStruct(vars=ctypes.cast(self._vars, ctypes.POINTER(ctypes.c_int64)))
        self._addr = ctypes.addressof(self._rec)
        programs[self._addr] = self

    def set_vars(self, values):
        assert len(values) == self.num_vars, values
        self._vars[:] = list(values)

    @property
    def values(self):
        return tuple(self._vars)


class _Event:
    cuda_event = 77


def _one_call_rank(rank, world):
    from efa_ep.kernels import create_transport
    from efa_ep.kernels.base import DispatchInputError, TransportError
    from efa_ep.kernels.proxy import native
    from efa_ep.kernels.proxy.planned import PlannedOps, _combine_key, _dispatch_key
    from efa_ep.testing.routes import contract_route

    ref = create_transport("torch", None, E, H, MAX_T, torch.float32)
    # chunks of two rows: every peer's rows span several chunk marks
    px = create_transport("proxy", None, E, H, MAX_T, torch.float32, provider="tcp",
                          num_channels=2, timeout_s=30, chunk_bytes=2 * H * 4)
    px._native_off = None  # (programs are stand-ins here)
    planned = px._planned = PlannedOps.create(px)
    log, programs, fail, pending = [], {}, {"launch": False}, []

    def run(prog, stream, err, n):
        if fail["launch"]:
            ctypes.memmove(err, b"stand-in launch failed\0", 23)
            return -5
        log.append(("run", prog))
        p = programs[prog]
        if p.reads:  # launched before the round completed: runs at its event, as on a stream
            pending.append(p)  # after the marks (checked there) say its rows are in
        else:
            p.device(p.values)
        return 0

    def record(ev, stream, err, n):
        log.append(("record", ev))
        while pending:
            p = pending.pop(0)
            p.device(p.values)
        return 0

    def wait(ev, err, n):
        log.append(("wait", ev))
        return 0

    keep = (_RUN(run), _RECORD(record), _WAIT(wait))
    planned._fns = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in keep)
    lay, window = px.layout, px.window
    send_area = window[lay.off_data_send:lay.off_recv].view(torch.float32)
    plane = send_area[:send_area.numel() // H * H].view(-1, H)
    ops = px._op_struct()
    L, W, me = E // world, world, rank

    def peer_rows(r, n):
        off = lay.data_recv_off(r)
        return window[off:off + n * H * 4].view(torch.float32).view(n, H)

    # dispatch: the stand-in front (routing layout, count block, rows to peers, progress)
    cap = T * min(W, K)
    counts = torch.zeros(2 + W + E, dtype=torch.int64)
    meta = torch.zeros(cap * 2 * K, dtype=torch.int64)
    progress = torch.zeros(4, dtype=torch.int64)
    in_idx, in_w = torch.zeros(W * MAX_T * K, dtype=torch.int64), torch.zeros(W * MAX_T * K)
    recv_off = torch.zeros(W + 1, dtype=torch.int64)
    o_send, words = 0, cap

    def front(values):
        xp, ip, wp, sp = values
        x, idx, w = _at(xp, (T, H), torch.float32), _at(ip, (T, K), torch.int64), \
            _at(wp, (T, K), torch.float32)
        send_idx = _at(sp, (words,), torch.int64)
        num_send, cnt = np.zeros(W, np.int64), np.zeros(E, np.int64)
        scratch, flags = np.zeros(2 * W, np.int64), np.zeros(1, np.int64)
        s = native.route_layout(idx.data_ptr(), w.data_ptr(), T, K, E, W, send_idx.data_ptr(),
                                meta.data_ptr(), cap, num_send.ctypes.data, cnt.ctypes.data,
                                scratch.ctypes.data, flags.ctypes.data)
        if s < 0:
            counts[0] = int(flags[0])
        else:
            counts[0] = 0
            counts[1:1 + W] = torch.from_numpy(num_send)
            counts[1 + W:1 + W + E] = torch.from_numpy(cnt)
            st = np.concatenate([[0], np.cumsum(num_send)])
            peer = torch.cat([send_idx[:st[me]], send_idx[st[me + 1]:s]])
            plane[:peer.numel()] = x[peer]
        progress.fill_(1 << 40)  # every chunk stored
        counts[-1] = 1  # the ready word, last

    marks = px.marks.view(W, native.MARKS)
    report_marks = []

    def check_marks(tag, rows_from):
        """Every chunk of every peer's rows marked with this round's tag by the engine, and
        the whole marks stored after the complete."""
        ok = tag != 0 and bool((marks[:, native.MARK_WHOLE] == tag).all())
        for r in range(W):
            if r != me and rows_from[r]:
                chunks = -(-rows_from[r] * H * 4 // px.chunk_bytes)
                ok &= chunks > 1 and bool((marks[r, :chunks] == tag).all())
        report_marks.append(ok)

    def gather(values):
        xp, sip, rxp, rip, rwp, own, n, tag, grid = values
        offs = recv_off.tolist()
        check_marks(tag, [offs[r + 1] - offs[r] for r in range(W)])
        x = _at(xp, (T, H), torch.float32)
        rx = _at(rxp, (n, H), torch.float32)
        offs = recv_off.tolist()
        for r in range(W):
            a, b = offs[r], offs[r + 1]
            rx[a:b] = x[_at(sip + 8 * own, (b - a,), torch.int64)] if r == me else \
                peer_rows(r, b - a)
        _at(rip, (n, K), torch.int64).copy_(in_idx[:n * K].view(n, K))
        _at(rwp, (n, K), torch.float32).copy_(in_w[:n * K].view(n, K))

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g)
    idx, w = contract_route("random", T, E, K, world, seed=rank)
    planned.plan_dispatch(_dispatch_key(x, idx, w), x.device, _Program(front, programs, 4),
                          _Program(gather, programs, 9, True), _Event(), counts, meta, progress, 1,
                          words, o_send, in_idx, in_w, recv_off)

    def pack(values):  # combine: y's rows back to the ranks they came from, rank order
        yp, s_me, e_me, n, chunk_rows, grid = values
        y = _at(yp, (n, H), torch.float32)
        rows = torch.cat([y[:s_me], y[e_me:]])
        plane[:rows.shape[0]] = rows
        op = planned.plans[_combine_key(y, T)].op
        _at(op.progress, (op.progress_words,), torch.int64).fill_(1 << 40)

    def reduce(values):
        yp, ip, outp, own, t, tag, grid = values
        sends = list(handle_now["h"].num_send_per_rank)
        check_marks(tag, sends)
        sst = np.concatenate([[0], np.cumsum(sends)]).tolist()
        y = _at(yp, (handle_now["h"].num_recv_tokens, H), torch.float32)
        views = [y[own:own + sends[me]] if r == me else peer_rows(r, sends[r]) for r in range(W)]
        out = px._reduce_torch(views, _at(ip, (sst[-1],), torch.int64), sends, sst, t, y)
        _at(outp, (t, H), torch.float32).copy_(out)

    handle_now = {}
    report = {"equal": [], "errors": [], "dispatch_log": [], "combine_log": []}
    lib = native.load()
    clock = (ctypes.c_int64 * lib.efa_devop_step_clock(1, None))()
    lib.efa_devop_step_clock(1, clock)  # on, from zero: the probes' step clock
    for step in range(4):
        idx, w = contract_route("random", T, E, K, world, seed=10 * step + rank)
        if step == 1 and rank == 1:
            idx = idx.clone()
            idx[2, 0] = E  # out of range, on this rank only: the stand-in layout flags it
        log.clear()
        try:
            got = px.dispatch(x, idx, w)
        except DispatchInputError as e:
            report["errors"].append(str(e))
            continue
        exp = ref.dispatch(x, idx, w)
        equal = all(torch.equal(a, b) for a, b in zip(exp[:4], got[:4]))
        equal &= exp[4].num_send_per_rank == got[4].num_send_per_rank
        report["dispatch_log"].append([k for k, _ in log])
        y = torch.randn(exp[0].shape[0], H, generator=g)
        if step == 0:  # the combine case's plan, once its shape is known
            planned.plan_rows(_combine_key(y, T), y, _Program(pack, programs, 6),
                              _Program(reduce, programs, 7, True), _Event())
        handle_now["h"] = got[4]
        log.clear()
        equal &= torch.equal(ref.combine(y, exp[4]), px.combine(y, got[4]))
        report["combine_log"].append([k for k, _ in log])
        report["equal"].append(equal)
    lib.efa_devop_step_clock(0, clock)
    report["clock"] = list(clock)
    report["one_calls"] = px.one_calls
    report["cpp_calls"], report["cpp_off"] = dict(planned.cpp_calls), planned.cpp_off
    report["marks"] = report_marks
    fail["launch"] = True
    idx, w = contract_route("random", T, E, K, world, seed=99 + rank)
    try:
        px.dispatch(x, idx, w)
    except TransportError as e:
        report["launch_error"] = str(e)
    report["broken"] = px.broken
    px.close(barrier=False)
    return report


@pytest.mark.parametrize("cpp", ["cpp", "python"])
def test_one_call_path_over_a_stand_in_device(cpp):
    """Both arms of a planned op: the C++ call (the default where it builds) and the Python
    glue (``EFA_EP_PROXY_CPP=0``) around the same native calls."""
    if cpp == "cpp":
        from efa_ep.kernels.proxy import cpp_op

        try:
            cpp_op.load()  # built here once, before the ranks start
        except RuntimeError as e:
            pytest.skip(str(e))
    env = dict(LOOPBACK, EFA_EP_PROXY_CPP="1" if cpp == "cpp" else "0")
    out = run_ranks(_one_call_rank, 2, (), timeout_s=240, pg_timeout_s=60, env=env)
    for rank, r in enumerate(out):
        want = {"dispatch": 3, "combine": 3} if cpp == "cpp" else {"dispatch": 0, "combine": 0}
        assert r["cpp_calls"] == want, (rank, r)
        assert (r["cpp_off"] is None) == (cpp == "cpp"), (rank, r)
        assert r["equal"] == [True, True, True], (rank, r)
        assert len(r["errors"]) == 1 and "rank 1" in r["errors"][0], (rank, r)
        assert r["one_calls"] == {"dispatch": 3, "combine": 3, "cached": 0}, (rank, r)
        # each reading kernel found every chunk of its peer's rows marked by the engine, with
        # the round's tag, and the whole marks stored
        assert r["marks"] == [True] * 6, (rank, r)
        # the packing launched, the previous op's reads waited for (none before the first op
        # and after the refused one, which waited), then the reading kernel and its event
        assert r["dispatch_log"] == [["run", "run", "record"]] * 2 + [
            ["run", "wait", "run", "record"]], (rank, r)
        assert r["combine_log"] == [["run", "wait", "run", "record"]] * 3, (rank, r)
        # the step clock: per kind of native call (dispatch, its finish, combine) its calls,
        # then nanoseconds per step; the refused dispatch stopped at its begin
        per = len(r["clock"]) // 3
        calls = [r["clock"][i * per] for i in range(3)]
        steps = [r["clock"][i * per + 1:(i + 1) * per] for i in range(3)]
        assert calls == [4, 3, 3], (rank, r["clock"])
        assert all(v >= 0 for row in steps for v in row), (rank, r["clock"])
        begin, post, complete, reads = 4, 5, 6, 7  # EFA_STEP_*
        assert steps[0][begin] > 0 and steps[0][post] > 0 and steps[0][reads] == 0, r["clock"]
        assert steps[1][complete] > 0 and steps[1][begin] == 0, r["clock"]
        assert steps[2][begin] > 0 and steps[2][complete] > 0, r["clock"]
    # the failing launch: the library's message, the transport refuses further calls
    assert "stand-in launch failed" in out[0]["launch_error"], out[0]
    assert out[0]["broken"] is not None


def test_cpp_ops_say_why_they_are_off(monkeypatch):
    """Without ninja the proxy's C++ ops are not built: loading raises the reason, the same text
    on every later call, and nothing is cached as built."""
    import torch.utils.cpp_extension as cpp

    from efa_ep.kernels import cpp_ext
    from efa_ep.kernels.proxy import cpp_op

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_ext, "_mods", {})
    monkeypatch.setattr(cpp_ext, "_why", {})
    monkeypatch.setattr(cpp, "verify_ninja_availability", no_ninja)
    with pytest.raises(RuntimeError, match="pip install ninja") as first:
        cpp_op.load()
    assert "the proxy's C++ ops could not be built" in str(first.value)
    with pytest.raises(RuntimeError) as again:
        cpp_op.load()
    assert str(again.value) == str(first.value) and cpp_ext._mods == {}

