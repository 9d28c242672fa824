"""``efa_ep.tools.doctor`` (``efa-ep-doctor``): a preflight that tells a user, on their own host,
whether the ``efa`` dispatcher will work and pay off for their job.

Modules: :mod:`.probes` (what is read from the machine, one function per fact), :mod:`.checks`
(each fact judged: ok / warn / fail / skip with the fix), :mod:`.selftest` (every usable
transport on loopback against ``torch``, bit for bit, with its fixed cost per op),
:mod:`.verdict` (the checks joined with the planner of :mod:`efa_ep.tools.plan`), :mod:`.cli`
(the console script).
"""
from .cli import main, run_doctor  # noqa: F401
