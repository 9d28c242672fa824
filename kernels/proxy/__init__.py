"""``efa_ep.kernels.proxy``: the CPU-proxy transport over libfabric (the design EFA needs).

One concern per module, read top to bottom along a token's path:

- ``options.py``: the transport's options and their EFA_EP_PROXY_* environment variables;
- ``window.py``: the registered window's layout, header and footer formats;
- ``ring.py``: command rings and the descriptor producers (host code, Triton kernel);
- ``wire.py``: one round of the protocol (header exchange, data, checks);
- ``transport.py``: :class:`ProxyTransport`, the contract methods, setup and failure state;
- ``device.py``: the Triton kernels of CUDA inputs on a host window (combine's reduction from
  the window; optionally the dispatch's layout, packing and receive);
- ``native.py``: the one ctypes boundary to the C engine (``kernels/native/``).
"""
from . import native
from .options import ProxyOptions, default_provider, resolve_options
from .ring import describe_messages
from .transport import ProxyTransport, availability

__all__ = ["ProxyTransport", "ProxyOptions", "availability", "default_provider",
           "describe_messages", "native", "resolve_options"]
