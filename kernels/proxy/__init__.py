"""``efa_ep.kernels.proxy``: the CPU-proxy transport over libfabric (the design EFA needs).

One concern per module, read top to bottom along a token's path:

- ``options.py``: the transport's options, resolved once;
- ``window.py``: the registered window's layout, header and footer formats;
- ``ring.py``: command rings and the descriptor producers (host code, Triton kernel);
- ``wire.py``: one round of the protocol (header exchange, data, checks) in native steps over a
  host window (in place) or a device window (through copies of a pinned stage);
  ``tamper.py`` the test-only faults of a round;
- ``transport.py``: :class:`ProxyTransport`, the contract methods, setup and failure state;
- ``round_ops.py``: the operations as wire rounds (routing, packing, reductions, the handle);
- ``hostop.py``: a whole operation on CPU rows over a host window in two native calls;
- ``device_path.py`` and ``device.py``: CUDA inputs on a host window (the Triton kernels of the
  dispatch's layout, packing and receive, and of combine's reduction from the window);
  ``planned.py`` the same operations in one native call each once their case ran;
- ``native.py``: the one ctypes boundary to the C engine (``kernels/native/``), which
  ``native_build.py`` compiles.
"""
from . import native
from .options import ProxyOptions, default_provider, resolve_options
from .ring import describe_messages
from .transport import ProxyTransport, availability

__all__ = ["ProxyTransport", "ProxyOptions", "availability", "default_provider",
           "describe_messages", "native", "resolve_options"]
