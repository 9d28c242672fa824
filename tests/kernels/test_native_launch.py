"""Native kernel programs (``efa_ep.kernels.native_launch``) on the CPU machine.

No GPU here: the library is built and loaded for real (and says why it cannot launch), and the
binding logic runs against a stand-in driver that records the launch records it is given. The
records are what ``cuLaunchKernel`` would receive, so these tests pin the rule that matters:
per call exactly the variable parameters change, each to the call's address plus the bound
offset, and a kernel whose parameter list differs from its signature is refused."""
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


class _FakeLib:
    """The library's entry points over a stand-in driver: parameter sizes per function handle;
    every run keeps a copy of the records it was asked to launch."""

    def __init__(self, sizes):
        self.sizes, self.runs = sizes, []

    def efa_launch_init(self, err, errlen):
        return 0

    def efa_launch_param_sizes(self, function, out, max_params, err, errlen):
        got = self.sizes[function]
        for i, s in enumerate(got):
            out[i] = s
        return len(got)

    def efa_launch_run(self, recs, n, stream, err, errlen):
        import ctypes
        words = list((ctypes.c_int64 * (n * nl._RECORD_WORDS)).from_address(recs))
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
    lib = _FakeLib({0xABC: [8, 8, 8, 4, 4, 8, 8]})  # + Triton's two scratch pointers
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
