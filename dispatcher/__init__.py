"""``efa_ep.dispatcher`` (this folder, ``dispatcher/``): the Megatron side of efa-ep, what
Megatron-Core sees. Knows nothing of libfabric.

- :class:`EfaTokenDispatcher`: a ``MoETokenDispatcher`` built for ``moe_token_dispatcher_type="efa"``.
- :func:`configure` / :class:`DispatcherSettings`: which transport and knobs it uses (defaults
  from ``EFA_EP_*`` environment variables, read through their declarations in
  :mod:`efa_ep.kernels.core.variables`).
- ``transport_cache``: the transports shared by every layer (one per EP group and setup).
- ``layout`` (index math), ``autograd_functions`` (transport calls with their backward) and
  ``capacity`` (window-grow and overflow-policy helpers): pieces of the dispatcher.
- :func:`register_with_megatron`: done automatically by ``import efa_ep``.

Megatron is imported lazily: ``import efa_ep.dispatcher`` alone does not import it.
"""
from .registration import EFA_DISPATCHER_TYPE, register_with_megatron  # noqa: F401
from .settings import DispatcherSettings, configure, current_settings  # noqa: F401


def __getattr__(name):
    if name in ("EfaTokenDispatcher", "check_supported"):
        from . import token_dispatcher

        return getattr(token_dispatcher, name)
    raise AttributeError(name)

__all__ = ["EFA_DISPATCHER_TYPE", "register_with_megatron", "DispatcherSettings", "configure",
           "current_settings", "EfaTokenDispatcher", "check_supported"]
