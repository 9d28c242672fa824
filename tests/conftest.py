"""Makes the checkout importable without an install (``efa_ep`` maps the top-level folders)."""
import os
import sys

import pytest

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _root not in sys.path:
    sys.path.insert(0, _root)
os.environ.setdefault("FI_TCP_IFACE", "lo")  # libfabric tcp traffic stays on loopback


@pytest.fixture(autouse=True)
def _restore_efa_ep_environment():
    """Every ``EFA_EP_*`` variable as it was before the test: a test that sets, changes or
    removes one (directly or through code it calls) cannot leak it into later tests."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("EFA_EP_")}
    yield
    for key in [k for k in os.environ if k.startswith("EFA_EP_") and k not in saved]:
        del os.environ[key]
    os.environ.update(saved)
