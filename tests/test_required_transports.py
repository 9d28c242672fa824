"""CI sets EFA_EP_REQUIRE_TRANSPORTS (e.g. "torch,proxy") so that a transport whose tests would
otherwise skip (missing libfabric, failed native build) turns CI red instead of silently
skipping. Locally, without the variable, this test only checks that ``torch`` is usable."""
import os

from efa_ep.kernels import transport_status


def test_required_transports_are_usable():
    required = [n for n in os.environ.get("EFA_EP_REQUIRE_TRANSPORTS", "torch").split(",") if n]
    status = transport_status()
    missing = {n: status.get(n, "unknown transport") for n in required if status.get(n, "x") is not None}
    assert not missing, f"required transports unusable here: {missing}"
