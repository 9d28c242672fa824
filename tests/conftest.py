"""Makes the checkout importable without an install (``efa_ep`` maps the top-level folders)."""
import os
import sys

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _root not in sys.path:
    sys.path.insert(0, _root)
os.environ.setdefault("FI_TCP_IFACE", "lo")  # libfabric tcp traffic stays on loopback
