"""The autouse fixture of tests/conftest.py restores every ``EFA_EP_*`` variable after each test
(the transports' settings read them; a test that sets one must not change later tests).
The two tests run in file order: the first changes the environment, the second checks it."""
import os

_KEY = "EFA_EP_CONTRACT_ENV_PROBE"


def test_a_test_may_set_change_and_remove_efa_ep_variables():
    assert _KEY not in os.environ
    os.environ[_KEY] = "1"
    os.environ["EFA_EP_PROXY_TIMEOUT_S"] = "12345"
    os.environ.pop("EFA_EP_TRANSPORT", None)


def test_the_next_test_sees_the_environment_as_before():
    assert _KEY not in os.environ
    assert os.environ.get("EFA_EP_PROXY_TIMEOUT_S") != "12345"
