"""FAKE nemo_rl for efa-ep tests (see ../README.md)."""
__version__ = "0.0.0-fake"
CALLS = []
