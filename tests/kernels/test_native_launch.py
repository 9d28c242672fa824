"""Native kernel programs (``efa_ep.kernels.native_launch``) on the CPU machine.

No GPU here: the library is built and loaded for real (and says why it cannot launch), and the
binding logic runs against a stand-in driver that records the launch records it is given, after
the real library has written the call's variables into them. The records are what
``cuLaunchKernel`` would receive, so these tests pin the rule that matters:
per call exactly the variable parameters change, each to the call's address plus the bound
offset, and a kernel whose parameter list differs from its signature is refused."""
import struct
import types

import pytest
import torch

from efa_ep.kernels import native_launch as nl


def test_library_builds_and_says_why_it_cannot_launch_without_a_driver():
    try:
        nl.load()
    except nl.NativeLaunchError as e:
        pytest.skip(f"no C compiler here: {e}")
    why = nl.availability()
    if why is None:
        pytest.skip("an NVIDIA driver is present: launching is possible here")
    assert "libcuda" in why or "driver" in why


def _records(real, addr):
    """The flat int64 records of the program at ``addr`` after the real library bound them."""
    import ctypes
    real.efa_launch_bind(addr)
    desc = nl._ProgramDesc.from_address(addr)
    return desc.num_recs, list((ctypes.c_int64 * (desc.num_recs * nl._RECORD_WORDS))
                               .from_address(desc.recs))


class _FakeLib:
    """The library's entry points over a stand-in driver: parameter sizes per function handle;
    every run keeps a copy of the records it was asked to launch, bound by the real library."""

    def __init__(self, sizes, real):
        self.sizes, self.runs, self.real = sizes, [], real
        self.efa_launch_bind = real.efa_launch_bind

    def efa_launch_init(self, err, errlen):
        return 0

    def efa_launch_param_sizes(self, function, out, max_params, err, errlen):
        got = self.sizes[function]
        for i, s in enumerate(got):
            out[i] = s
        return len(got)

    def efa_launch_run(self, prog, stream, err, errlen):
        n, words = _records(self.real, prog)
        self.runs.append((stream, n, words))
        return 0


class _FakeKernel:
    """What FastKernel offers a Program: runtime parameter names and a compiled kernel."""

    def __init__(self, name, params, signature, function, num_warps=4, shared=0):
        self.fn = types.SimpleNamespace(__name__=name)
        self._params = params
        run = types.SimpleNamespace(global_scratch_size=0, profile_scratch_size=0,
                                    launch_cooperative_grid=False, launch_pdl=False)
        self.kernel = types.SimpleNamespace(
            run=run, function=function, src=types.SimpleNamespace(signature=signature),
            metadata=types.SimpleNamespace(num_warps=num_warps, shared=shared, num_ctas=1))
        self.compiled_calls = 0

    def runtime_names(self):
        return self._params

    def compiled(self, grid, args, num_warps):
        self.compiled_calls += 1
        return self.kernel


def _words(run, step):
    """(head, params, values) of record ``step`` in a recorded run."""
    w = run[2][step * nl._RECORD_WORDS:(step + 1) * nl._RECORD_WORDS]
    return w[:nl._HEAD], w[nl._HEAD:nl._VALUES], w[nl._VALUES:]


@pytest.fixture
def fake(monkeypatch):
    # x_ptr, table (constant), scratch view, n (i32, variable), d (i32 constant),
    # one=1 specialized away by Triton (constexpr in the signature), then a real constexpr
    sig = {"x_ptr": "*bf16", "table": "*i64", "out_ptr": "*i64", "num_rows": "i32",
           "D": "i32", "one": "constexpr", "BLOCK": "constexpr"}
    k = _FakeKernel("k", ("x_ptr", "table", "out_ptr", "num_rows", "D", "one"), sig, 0xABC,
                    num_warps=8, shared=1024)
    try:
        real = nl.load()
    except nl.NativeLaunchError as e:
        pytest.skip(f"the native library cannot be built here: {e}")
    lib = _FakeLib({0xABC: [8, 8, 8, 4, 4, 8, 8]}, real)  # + Triton's two scratch pointers
    monkeypatch.setattr(nl, "load", lambda: lib)
    return k, lib


def test_only_variables_change_and_follow_their_tensor(fake):
    k, lib = fake
    x = torch.zeros(16, 8, dtype=torch.bfloat16)
    table = torch.zeros(4, dtype=torch.int64)
    scratch = torch.zeros(64, dtype=torch.int64)
    out_view = scratch[10:20]  # a view: bound as scratch + 80 bytes
    steps = [nl.MemsetStep(scratch, 48),
             nl.KernelStep(k, (3,), (x, table, out_view, 16, 8, 1, 128), 8)]
    prog = nl.Program(steps, (x, scratch), ("num_rows",), (1,))
    assert prog.num_vars == 4 and k.compiled_calls == 1

    x2 = torch.zeros(16, 8, dtype=torch.bfloat16)
    scratch2 = torch.zeros(64, dtype=torch.int64)
    prog.run((x2.data_ptr(), scratch2.data_ptr(), 5, 2), stream=77)
    stream, n, _ = lib.runs[-1]
    assert (stream, n) == (77, 2)

    head, _, values = _words(lib.runs[-1], 0)  # memset of the new scratch
    assert head[0] == 0 and values[0] == scratch2.data_ptr() and values[1] == 48

    head, params, values = _words(lib.runs[-1], 1)
    assert head[:7] == [0xABC, 2, 1, 1, 256, 1024, 7]  # grid from the call, block 32 x warps
    assert values[0] == x2.data_ptr()                # variable tensor
    assert values[1] == table.data_ptr()             # constant tensor kept
    assert values[2] == scratch2.data_ptr() + 80     # view follows its allocation
    assert values[3] == 5                            # variable integer
    assert values[4] == 8                            # constant integer
    assert values[5] == 0 and values[6] == 0         # no scratch memory
    base = params[0]
    assert params[:7] == [base + 8 * i for i in range(7)]  # each parameter points at its slot

    prog.run((x.data_ptr(), scratch.data_ptr(), -1, 0), stream=78)
    head, _, values = _words(lib.runs[-1], 1)
    assert head[1] == 0                              # grid 0: the launcher skips the step
    assert values[0] == x.data_ptr() and values[3] == -1  # i32 reads the low half: still -1

    launched = len(lib.runs)
    with pytest.raises(struct.error):  # one variable short: refused before anything launches
        prog.run((x.data_ptr(), scratch.data_ptr(), 5), stream=79)
    assert len(lib.runs) == launched


def test_variable_tensors_that_share_addresses_are_refused(fake):
    # Two empty tensors (address 0 or one shared block) or a view of another variable would
    # make an argument inside them ambiguous: it could be rewritten as the wrong one.
    k, _ = fake
    x = torch.zeros(16, 8, dtype=torch.bfloat16)
    table = torch.zeros(4, dtype=torch.int64)
    scratch = torch.zeros(64, dtype=torch.int64)
    steps = [nl.KernelStep(k, (3,), (x, table, scratch, 16, 8, 1, 128), 8)]
    with pytest.raises(nl.NativeLaunchError, match="share addresses"):
        nl.Program(steps, (x, scratch, scratch[8:16]), ("num_rows",))
    e1, e2 = torch.empty(0, 8, dtype=torch.bfloat16), torch.empty(0, dtype=torch.int64)
    if e1.data_ptr() == e2.data_ptr():  # (torch gives empty CPU tensors address 0)
        with pytest.raises(nl.NativeLaunchError, match="share addresses"):
            nl.Program([nl.KernelStep(k, (3,), (e1, table, e2, 0, 8, 1, 128), 8)], (e1, e2),
                       ("num_rows",))


def test_a_parameter_list_that_differs_from_the_signature_is_refused(fake, monkeypatch):
    k, lib = fake
    lib.sizes[0xABC] = [8, 8, 8, 8, 4, 8, 8]  # num_rows compiled as 64-bit: not this layout
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    s = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(nl.NativeLaunchError, match="do not match"):
        nl.Program([nl.KernelStep(k, (1,), (x, s, s, 4, 8, 1, 128), 8)], (x,))
    lib.sizes[0xABC] = [8, 8, 8, 4, 4, 8, 8, 8, 8]  # more trailing parameters than scratch
    with pytest.raises(nl.NativeLaunchError, match="do not match"):
        nl.Program([nl.KernelStep(k, (1,), (x, s, s, 4, 8, 1, 128), 8)], (x,))


def test_scratch_memory_or_launch_attributes_are_refused(fake):
    k, _ = fake
    k.kernel.run.global_scratch_size = 256
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(nl.NativeLaunchError, match="scratch"):
        nl.Program([nl.KernelStep(k, (1,), (x, x, x, 4, 8, 1, 128), 8)], (x,))


# The launch gate's native fast path, for real (no driver needed) ------------------------------
def _real_lib():
    try:
        nl.load()
    except nl.NativeLaunchError as e:
        pytest.skip(f"no C compiler here: {e}")


def test_gate_fast_path_publishes_and_reports_whether_every_rank_has():
    import numpy as np

    _real_lib()
    slots = np.array([7, 6, 7], dtype=np.int64)
    ready, waited = nl.gate_publish_wait(slots.ctypes.data, 3, 1, 7, 10_000_000)
    assert ready and slots.tolist() == [7, 7, 7]          # rank 1's publish completed the op
    slots[:] = (8, 7, 7)
    ready, waited = nl.gate_publish_wait(slots.ctypes.data, 3, 2, 8, 1_000_000)
    assert not ready and slots.tolist() == [8, 7, 8]      # rank 1 has not issued op 8
    assert waited >= 1e-3                                 # it waited its spin, no more needed


def test_gate_fast_path_passes_only_ranks_in_the_same_operation():
    import numpy as np

    from efa_ep.kernels.gda.gate import wait_record

    _real_lib()
    combine, cached = wait_record(5, "combine"), wait_record(5, "cached dispatch")
    slots = np.array([0, cached, wait_record(6, "dispatch")], dtype=np.int64)
    ready, _ = nl.gate_publish_wait(slots.ctypes.data, 3, 0, cached, 10_000_000)
    assert ready  # rank 2 is past op 5 (it agreed), rank 1 issued the same op
    slots[:] = (0, cached, cached)
    ready, waited = nl.gate_publish_wait(slots.ctypes.data, 3, 0, combine, 1_000_000)
    assert not ready and slots[0] == combine  # same op, another kind: the caller's wait decides
    assert waited >= 1e-3


def test_gate_fast_path_sees_a_peer_that_publishes_while_it_waits():
    import threading

    import numpy as np

    _real_lib()
    slots = np.zeros(2, dtype=np.int64)
    seen = []

    def peer():  # rank 1 answers once it sees rank 0's publish (an event, not a sleep)
        while slots[0] != 3:
            pass
        seen.append(True)
        slots[1] = 3

    t = threading.Thread(target=peer)
    t.start()
    ready, _ = nl.gate_publish_wait(slots.ctypes.data, 2, 0, 3, 60_000_000_000)
    t.join()
    assert ready and seen and slots.tolist() == [3, 3]


def test_run_gated_binds_both_programs_and_says_when_the_gate_was_not_passed(fake):
    k, lib = fake
    calls = []

    def run_gated(p1, p2, stream, gate, world, rank, epoch, spin, flag, value, wait_ns,
                  sync_ns, gate_ns, err, errlen):
        import ctypes
        _, w1 = _records(lib.real, p1)
        _, w2 = _records(lib.real, p2)
        calls.append((w1, w2, stream, gate, world, rank, epoch, spin, flag, value, wait_ns))
        ctypes.c_int64.from_address(gate_ns).value = 2000
        return lib.gated_rc

    lib.efa_launch_run_gated = run_gated
    x = torch.zeros(16, 8, dtype=torch.bfloat16)
    scratch = torch.zeros(64, dtype=torch.int64)
    first = nl.Program([nl.KernelStep(k, (3,), (x, scratch, scratch, 16, 8, 1, 128), 8)],
                       (x,), ("num_rows",))
    second = nl.Program([nl.KernelStep(k, (1,), (x, scratch, scratch[4:], 16, 8, 1, 128), 8)],
                        (scratch,), ("num_rows",))
    x2, s2 = torch.zeros_like(x), torch.zeros_like(scratch)
    lib.gated_rc = nl.RAN
    status, sync_s, gate_s = first.run_gated((x2.data_ptr(), 9), second, (s2.data_ptr(), 4),
                                             stream=5, gate=1234, world=2, rank=1, record=11,
                                             spin_ns=99, flag=4096, value=11, wait_ns=64)
    assert status == nl.RAN and gate_s == pytest.approx(2e-6)
    w1, w2, *rest = calls[-1]
    assert rest == [5, 1234, 2, 1, 11, 99, 4096, 11, 64]
    v1 = w1[nl._VALUES:nl._VALUES + 7]
    v2 = w2[nl._VALUES:nl._VALUES + 7]
    assert v1[0] == x2.data_ptr() and v1[3] == 9          # first: its own variables
    assert v2[2] == s2.data_ptr() + 32 and v2[3] == 4     # second: its own, views followed
    lib.gated_rc = nl.GATE_LATE
    status, _, _ = first.run_gated((x.data_ptr(), 1), second, (scratch.data_ptr(), 1), 0, 0, 2,
                                   0, 12, 99)
    assert status == nl.GATE_LATE and calls[-1][3] is None  # no gate: NULL to the library
    assert calls[-1][8] is None                             # no completion word: NULL
    lib.gated_rc = -5
    with pytest.raises(nl.NativeLaunchError):
        first.run_gated((x.data_ptr(), 1), second, (scratch.data_ptr(), 1), 0, 0, 2, 0, 13, 99)


def test_completion_word_wait_sees_the_value_or_gives_up_at_its_deadline():
    import ctypes
    import threading
    try:
        nl.load()
    except nl.NativeLaunchError as e:
        pytest.skip(f"the native library cannot be built here: {e}")
    word = ctypes.c_int64(5)
    addr = ctypes.addressof(word)
    seen, _ = nl.wait_flag(addr, 5, 10**9)
    assert seen
    seen, waited = nl.wait_flag(addr, 6, 2_000_000)  # another op's value: not seen
    assert not seen and waited >= 0.002
    started = threading.Event()

    def writer():
        started.wait()
        word.value = 7

    t = threading.Thread(target=writer)
    t.start()
    started.set()
    seen, _ = nl.wait_flag(addr, 7, 60 * 10**9)  # written while it waits
    t.join()
    assert seen
