"""Old import path of :mod:`efa_ep.kernels.proxy.native` (the proxy's ctypes boundary).

``from efa_ep.kernels import proxy_native`` yields that very module (not a copy), so patching an
attribute here patches the transport's loader too.
"""
import sys

from .proxy import native as _native

sys.modules[__name__] = _native
