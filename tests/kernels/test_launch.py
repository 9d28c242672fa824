"""FastKernel's cache key and launch path, with a stand-in for a Triton JIT function (CPU).

The direct path is only correct if its key is at least as fine as Triton's own specialization:
a call whose arguments Triton would compile differently must miss the cache and go through
``fn[grid](...)``. These tests pin that rule, and that hits call the compiled kernel's native
launch function with tensors passed as their addresses."""
import types

import pytest
import torch

from efa_ep.kernels import launch


class _Param:
    def __init__(self, name, constexpr=False, dns=False):
        self.name, self.is_constexpr, self.do_not_specialize = name, constexpr, dns


class _FakeJit:
    """``fn[grid](*args, num_warps=...)`` records the call and returns a compiled kernel whose
    ``run`` (a launcher object with a native ``launch``) records direct launches."""

    def __init__(self, params):
        self.params = params
        self.slow, self.direct = [], []
        jit = self

        class _Launcher:
            global_scratch_size = 0
            profile_scratch_size = 0
            launch_cooperative_grid = False
            launch_pdl = False

            def __call__(self, *a):  # kernel.run(...) through the Python frame
                jit.direct.append(("run",) + a)

        class _Native:  # a C function in Triton (a Python function there is a wrapper)
            def __call__(self, *a):
                jit.direct.append(("launch",) + a)

        _Launcher.launch = _Native()
        self.kernel = types.SimpleNamespace(run=_Launcher(), function=0xF00,
                                            packed_metadata=(4, 1, 0))

    def __getitem__(self, grid):
        def call(*args, num_warps):
            self.slow.append((grid, args, num_warps))
            return self.kernel
        return call


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(launch, "fast_launch_supported", lambda: True)
    monkeypatch.setattr(launch, "_current_stream", lambda: 1234)
    monkeypatch.setattr(launch, "_hooks_set", lambda: False)
    params = [_Param("x"), _Param("n"), _Param("epoch", dns=True), _Param("B", constexpr=True)]
    jit = _FakeJit(params)
    return jit, launch.FastKernel(jit)


def test_hit_calls_the_native_launch_with_addresses(fast):
    jit, k = fast
    x = torch.zeros(64, dtype=torch.int64)
    k.launch((3,), (x, 32, 5, 128), 4)
    assert len(jit.slow) == 1 and not jit.direct
    k.launch((3,), (x, 32, 6, 128), 4)   # another op number: same specialization
    assert len(jit.slow) == 1 and len(jit.direct) == 1
    call = jit.direct[0]
    assert call[0] == "launch" and call[1:4] == (3, 1, 1) and call[4] == 1234
    assert call[5] == 0xF00                       # the compiled function handle
    assert call[-4:] == (x.data_ptr(), 32, 6, 128)  # tensor as its address, constexpr passed


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int value", "dns int64", "constexpr",
                                    "num_warps"])
def test_a_different_specialization_misses(fast, change):
    jit, k = fast
    x = torch.zeros(64, dtype=torch.int64)
    k.launch((1,), (x, 32, 5, 128), 4)
    k.launch((1,), (x, 32, 5, 128), 4)
    assert len(jit.slow) == 1 and len(jit.direct) == 1
    args, warps = [x, 32, 5, 128], 4
    if change == "misaligned":
        args[0] = x.view(torch.int32)[2:]         # 8 bytes in: Triton drops the 16-byte hint
        assert args[0].data_ptr() % 16 == 8
    elif change == "dtype":
        args[0] = x.view(torch.float64)
    elif change == "int value":
        args[1] = 48                              # specialized ints are keyed by value
    elif change == "dns int64":
        args[2] = 1 << 40                         # Triton types it i64 instead of i32
    elif change == "constexpr":
        args[3] = 256
    else:
        warps = 8
    k.launch((1,), tuple(args), warps)
    assert len(jit.slow) == 2, change             # compiled (or looked up) by Triton again
    k.launch((1,), tuple(args), warps)
    assert len(jit.direct) == 2                   # and cached under its own key


def test_dns_ints_share_an_entry_inside_int32(fast):
    jit, k = fast
    x = torch.zeros(8, dtype=torch.int64)
    for e in (1, 2, 1000, (1 << 31) - 1):
        k.launch((1,), (x, 32, e, 128), 4)
    assert len(jit.slow) == 1 and len(jit.direct) == 3


def test_fast_false_and_hooks_take_tritons_path(fast, monkeypatch):
    jit, k = fast
    x = torch.zeros(8, dtype=torch.int64)
    k.launch((1,), (x, 32, 1, 128), 4)
    k.launch((1,), (x, 32, 1, 128), 4, fast=False)
    assert len(jit.slow) == 2 and not jit.direct
    monkeypatch.setattr(launch, "_hooks_set", lambda: True)  # a profiler's launch hooks
    k.launch((1,), (x, 32, 1, 128), 4)
    assert len(jit.slow) == 3 and not jit.direct


def test_scratch_memory_keeps_the_python_launcher(fast):
    jit, k = fast
    type(jit.kernel.run).global_scratch_size = 128  # the launcher must allocate: its own frame
    x = torch.zeros(8, dtype=torch.int64)
    k.launch((2,), (x, 32, 1, 128), 4)
    k.launch((2,), (x, 32, 1, 128), 4)
    assert jit.direct[0][0] == "run" and jit.direct[0][1:5] == (2, 1, 1, 1234)


def test_constexprs_must_come_last(monkeypatch):
    monkeypatch.setattr(launch, "fast_launch_supported", lambda: True)
    with pytest.raises(ValueError, match="constexpr"):
        launch.FastKernel(_FakeJit([_Param("A", constexpr=True), _Param("x")]))


def test_disabled_without_cuda_or_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.fast_launch_supported()
    jit = _FakeJit([_Param("x")])
    k = launch.FastKernel(jit)
    x = torch.zeros(8)
    k.launch((1,), (x,), 4)
    k.launch((1,), (x,), 4)
    assert len(jit.slow) == 2 and not jit.direct
