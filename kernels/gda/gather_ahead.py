"""The outputs of a planned ``gda`` regular dispatch allocated before its count read, so that
its one native call also gathers (see :mod:`efa_ep.kernels.gda.phases`): how many rows, and the
shape block the native call reads."""
from __future__ import annotations

import ctypes

#: a regular dispatch whose outputs fit this many bytes allocates them before its count read, at
#: the rows its shape's recent calls received, so that its one native call gathers too (a
#: larger op costs the device far more than a second native call costs the host)
GATHER_AHEAD_BYTES = 16 << 20


class GatherAhead:
    """The gather of a bound dispatch plan (see :data:`GATHER_AHEAD_BYTES`): its program once
    bound, the rows the outputs are allocated at (0: none ahead), and the native call's
    ``[10]`` int64 shape block (:meth:`~efa_ep.kernels.native_launch.Program.run_dispatch`)."""

    __slots__ = ("key", "prog", "cap", "row_bytes", "k", "shape", "shape_addr", "rows",
                 "rows_addr")

    def __init__(self, key, row_bytes: int, k: int, shape):
        self.key, self.prog, self.cap, self.row_bytes, self.k = key, None, 0, row_bytes, k
        self.shape = (ctypes.c_int64 * 10)(*shape)
        self.shape_addr = ctypes.addressof(self.shape)
        self.rows = ctypes.c_int64(-1)
        self.rows_addr = ctypes.addressof(self.rows)

    def fit(self, n: int) -> None:
        """Sizes the next calls' outputs after a call that received ``n`` rows: grown when
        outgrown, shrunk when a quarter of them went unused (1/8 headroom each time)."""
        if n > self.cap or 4 * n < 3 * self.cap:
            cap = n + n // 8
            self.cap = cap if cap * self.row_bytes <= GATHER_AHEAD_BYTES else 0
            self.shape[5] = self.cap

