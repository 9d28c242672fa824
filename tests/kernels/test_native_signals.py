"""Loading the proxy's native library leaves the process's signal handling as it was.

Debian's libfabric links the PSM providers, whose ``libinfinipath`` installs its own handlers
for SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT when loaded (a SIGTERM then ends the process
with status 1, or hangs it); the package turns them off before its first load unless the user
set ``IPATH_NO_BACKTRACE``. Each case is a fresh Python process: it prints a line once the
library is loaded, the test reads that line (no sleep), signals it and waits with a deadline.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from efa_ep.kernels import proxy as proxy_mod

pytestmark = pytest.mark.skipif(proxy_mod.availability() is not None,
                                reason=f"proxy unavailable: {proxy_mod.availability()}")

_CHILD = r"""
import sys
from efa_ep.kernels.proxy import native
native.load()
for line in open("/proc/self/status"):
    if line.startswith("SigCgt:"):
        print("caught", int(line.split()[1], 16), flush=True)
sys.stdin.read()
"""

_HANDLED = (signal.SIGTERM, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT)


def _loaded_child(env):
    """A Python process that loaded the library; returns (process, its caught-signal mask)."""
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    if not line.startswith("caught "):
        p.kill()
        out, err = p.communicate(timeout=60)
        pytest.fail(f"the child did not load the library: {line}{out}{err}")
    return p, int(line.split()[1])


def test_loading_the_library_keeps_sigterm_and_crash_handling():
    env = {k: v for k, v in os.environ.items() if k != "IPATH_NO_BACKTRACE"}
    p, caught = _loaded_child(env)
    try:
        taken = [s.name for s in _HANDLED if caught >> (s - 1) & 1]
        assert not taken, f"loading the proxy library installed handlers for {taken}"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == -signal.SIGTERM  # ended by the signal, not by a handler
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=60)


def test_a_users_ipath_no_backtrace_is_kept():
    env = dict(os.environ, IPATH_NO_BACKTRACE="yes")
    code = ("import os; from efa_ep.kernels.proxy import native; native.load(); "
            "print(os.environ['IPATH_NO_BACKTRACE'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "yes"
