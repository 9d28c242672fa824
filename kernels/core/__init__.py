"""The transport core: what every transport shares, one definition each.

``errors`` (the error kinds), ``handles`` (settings agreed by the ranks, dispatch handles,
network counters), ``routing`` (where tokens go, combine's ordered reduction, sizes), ``checks``
(the status word, input checks raised on every rank), ``exchange`` (the status exchange and
the checks of what peers send), ``contract`` (the :class:`~efa_ep.kernels.base.Transport` base
class). :mod:`efa_ep.kernels.base` re-exports all of it with the contract's documentation;
import from there. Also here: ``hosts`` (which host each rank runs on, whether a peer process
still runs), ``variables`` (every ``EFA_EP_*`` environment variable, declared once, and its
one reader) and ``host_pool`` (large CPU outputs on blocks reused once the caller drops them).
"""
