"""The host-only ``gda`` transport the CPU tests of its plans share (not a test module): rank 0
of 2 over the stand-in native library (:mod:`efa_ep.testing.gda_host`), at a small shape whose
every dispatch header reads the same counts (``T`` rows from rank 0, 5 from rank 1, 2 pairs per
local expert)."""
import pytest

from efa_ep.testing.gda_host import header_info, host_only_transport, stand_in_library

W, E, H, T_MAX, K, T = 2, 16, 64, 32, 2, 8
L = E // W


def stand_in_transport(tmp_path, monkeypatch, cpp=False):
    """The transport, its library as ``.stand_in``; with ``cpp`` the C++ calls on
    (``fast_launch=4``). Skips where no C compiler, or (``cpp``) no C++ extension, is here."""
    try:
        lib = stand_in_library(str(tmp_path))
    except (OSError, FileNotFoundError) as e:
        pytest.skip(f"no C compiler here: {e}")
    if cpp:
        from efa_ep.kernels.gda import cpp_op

        why = cpp_op.availability()
        if why is not None:
            pytest.skip(why)
    info = header_info(W, L, rows_from=[T, 5], rows_to=[T, 6], per_expert=[2] * L)
    t = host_only_transport(lib, world=W, num_experts=E, hidden=H, t_max=T_MAX, info=info,
                            patch=monkeypatch.setattr, cpp=cpp)
    t.stand_in = lib
    return t
