"""``efa_ep.tools``: the command-line tools (efa-ep-bench, efa-ep-loss-match, efa-ep-plan)
and their helpers (configs, provenance, statistics)."""
