"""``efa_ep.kernels.hier``: the ``hier`` transport, NVLink inside a node and the network across
nodes (``transport.py``: :class:`HierTransport`, which composes two transports of the same
contract, ``gda`` or ``torch`` inside the node and ``proxy`` or ``torch`` across nodes; it has no
window or kernels of its own)."""
from .transport import HierDispatchState, HierTransport, availability, node_layout

__all__ = ["HierDispatchState", "HierTransport", "availability", "node_layout"]
