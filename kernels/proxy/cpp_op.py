"""Planned proxy dispatch and combine as one C++ call each (``kernels/native/efa_proxy_op.cpp``).

A planned case (:mod:`.planned`) runs its op in one native call (a dispatch in two), but its
Python made the op's tensors, wrote both programs' variables and the op structs' per-call
fields, and read the row counts between a dispatch's two calls: a few dozen Python steps per
op, which on a GPU host cost more than the native calls themselves. With the extension built (on
first use, once per install: a C++ compiler and ``ninja``), :class:`~.planned.PlannedOps` hands
a planned dispatch or combine to one C++ function that checks the inputs are the plan's case
(else it runs nothing and the Python path takes the call), makes the tensors, writes the same
variables and makes the same native calls, so the results are the same bits. Python keeps the
plan lookup, the round's accounting, the errors and the handle.

``EFA_EP_PROXY_CPP=0`` keeps the Python glue (the other arm of a comparison);
:attr:`~.planned.PlannedOps.cpp_off` says why the C++ calls do not run where they do not.
"""
from __future__ import annotations

import ctypes

from .. import cpp_ext
from ..core.variables import raw

# The plans' constants, in the order of the D_* / C_* fields of efa_proxy_op.cpp.
DISPATCH_FIELDS = ("fn", "finish", "op", "dev", "pack", "reads", "device", "tokens", "hidden",
                   "x_stride", "x_dtype", "topk", "words", "o_send", "num_local", "programs",
                   "watcher", "err", "errlen")
COMBINE_FIELDS = ("fn", "op", "dev", "pack", "reads", "device", "hidden", "y_stride", "y_dtype",
                  "row_bytes", "send_area", "programs", "watcher", "chunk_bytes", "err", "errlen")
# efa_proxy_op.cpp's status of a call whose inputs are not its plan's case (nothing ran)
NOT_PLANNED = 100


def enabled() -> bool:
    """Whether a planned dispatch or combine goes to the C++ call (``EFA_EP_PROXY_CPP``, default
    on)."""
    return raw("EFA_EP_PROXY_CPP") not in ("0", "off", "false")


def load():
    """The built extension module; raises RuntimeError saying why it cannot be built."""
    return cpp_ext.load("efa_proxy_op.cpp", "the proxy's C++ ops", {
        "DISPATCH_FIELDS": len(DISPATCH_FIELDS), "COMBINE_FIELDS": len(COMBINE_FIELDS),
        "NOT_PLANNED": NOT_PLANNED})


class CppPlan:
    """The constants of one plan, an int64 array the C++ call reads by address (``address``), in
    the order of ``names`` (:data:`DISPATCH_FIELDS` or :data:`COMBINE_FIELDS`)."""

    __slots__ = ("values", "address")

    def __init__(self, names, **fields):
        missing = set(names) - set(fields)
        if missing:
            raise ValueError(f"CppPlan lacks {sorted(missing)}")
        self.values = (ctypes.c_int64 * len(names))(*(int(fields[f]) for f in names))
        self.address = ctypes.addressof(self.values)
