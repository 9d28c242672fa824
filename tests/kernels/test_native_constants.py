"""The constants the C sources and the Python side both rely on agree (no compiler, no GPU).

The native engine, the wire round and the kernel launcher are built from ``kernels/native/``;
ctypes has no view of C ``#define``s or ``enum``s, so each constant is written on both sides.
This test reads the C text and compares: a value changed on one side only fails here, not as
corrupted headers or a refused peer at run time."""
import os
import re

import pytest

from efa_ep.kernels import base, native_launch
from efa_ep.kernels.proxy import native, window

NATIVE = os.path.join(os.path.dirname(native_launch.__file__), "native")


def _defines(name: str) -> dict:
    text = open(os.path.join(NATIVE, name)).read()
    return {k: int(v.rstrip("uU"), 0)
            for k, v in re.findall(r"^#define\s+(\w+)\s+(0x[0-9A-Fa-f]+u?|\d+u?)\b", text, re.M)}


def _enum(name: str, first: str) -> list:
    """The names of the C enum in ``name`` whose first member is ``first``, in order (plain
    ``enum { A, B, ... }``) or ``{name: value}`` when members are assigned."""
    text = open(os.path.join(NATIVE, name)).read()
    m = re.search(r"enum\s*\{\s*(" + first + r"\b[^}]*)\}", text)
    assert m, f"enum starting with {first} not found in {name}"
    members = [p.strip() for p in m.group(1).split(",") if p.strip()]
    if all("=" in p for p in members):
        return {k.strip(): int(v, 0) for k, v in (p.split("=") for p in members)}
    return members


H = _defines("efa_proxy.h")


@pytest.mark.parametrize("c_name,value", [
    ("EFA_PROXY_ABI_VERSION", native.ABI_VERSION),
    ("EFA_ADDR_MAX", native.ADDR_MAX),
    ("EFA_CTRL_STRIDE", native.CTRL_STRIDE),
    ("EFA_CTRL_TAIL", native.CTRL_TAIL),
    ("EFA_CTRL_HEAD", native.CTRL_HEAD),
    ("EFA_MSG_BITS", native.MSG_BITS),
    ("EFA_MAX_RANKS", native.MAX_RANKS),
    ("EFA_IMM_MSG_MASK", native.IMM_MSG_MASK),
    ("EFA_IMM_GEN_MASK", native.IMM_GEN_MASK),
    ("EFA_MARKS", native.MARKS),
    ("EFA_MARK_CHUNKS", native.MARK_CHUNKS),
    ("EFA_MARK_WHOLE", native.MARK_WHOLE),
    ("EFA_INJECT_TARGET", native.INJECT_TARGET),
    ("EFA_INJECT_SENDER", native.INJECT_SENDER),
    ("EFA_HDR_FIXED", window.HDR_FIXED),
    ("EFA_STATUS_BAD_INPUT", base.STATUS_BAD_INPUT),
    ("EFA_DT_F32", native.DT_F32),
    ("EFA_DT_BF16", native.DT_BF16),
])
def test_proxy_header_constants_match_python(c_name, value):
    assert H[c_name] == value, f"efa_proxy.h {c_name}={H[c_name]} but Python has {value}"


def test_tamper_kinds_match():
    c = {k[len("EFA_TAMPER_"):].lower(): v for k, v in H.items() if k.startswith("EFA_TAMPER_")}
    assert c == native.TAMPER_KINDS


def test_wire_header_fields_and_op_codes_match():
    fields = _enum("efa_round.c", "H_STATUS")
    assert len(fields) == window.HDR_FIXED
    for i, name in enumerate(fields):
        assert getattr(window, name) == i, f"efa_round.c {name} is field {i}"
    ops = _enum("efa_op.c", "OP_DISPATCH")
    assert ops == {"OP_DISPATCH": window.OP_DISPATCH, "OP_COMBINE": window.OP_COMBINE,
                   "OP_CACHED": window.OP_CACHED}
    c = _defines("efa_round.c")
    assert c["FOOTER_BYTES"] == window.FOOTER_BYTES


def test_launcher_constants_match_python():
    c = _defines("efa_launch.h")
    assert c["EFA_LAUNCH_ABI"] == native_launch.ABI_VERSION
    assert c["EFA_LAUNCH_MAX_PARAMS"] == native_launch.MAX_PARAMS
