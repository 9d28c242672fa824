"""Makes the checkout importable without an install (``efa_ep`` maps the top-level folders) and
puts ``tests/`` on the path for the shared route builders."""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.dirname(_here), _here):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("FI_TCP_IFACE", "lo")  # libfabric tcp traffic stays on loopback
