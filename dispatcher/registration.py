"""Makes ``moe_token_dispatcher_type="efa"`` work in plain Megatron-Core (no fork, no file edits).

Megatron's ``MoELayer.__init__`` picks its dispatcher with an if/elif on the type string and
raises for unknown values. We wrap ``MoELayer.__init__``: for ``"efa"`` it builds the layer with
the cheap ``allgather`` dispatcher as a placeholder (it creates no streams and communicates
nothing at construction), restores the type on the config, and installs
:class:`~efa_ep.dispatcher.token_dispatcher.EfaTokenDispatcher`. Every other type is untouched.

``TransformerConfig.__post_init__`` is wrapped too: its checks run for ``"efa"`` as for
``"alltoall"`` (the efa dispatcher is a drop-in for it), so options Megatron only allows with
``alltoall``/``flex`` (``moe_shared_expert_overlap``) pass its validation; the type string stays
``"efa"``.

With ``EFA_EP_FALLBACK=alltoall`` (or ``config.efa_ep_fallback``) the wrap first asks every
rank of the EP group whether the efa transport can be created and passes a self-test there
(:func:`efa_ep.dispatcher.transports.decide_fallback`, collective); if any rank says no, every
rank builds the layer with Megatron's ``alltoall`` dispatcher instead (the same placeholder
mechanism, with ``alltoall`` in place of ``allgather``), and one log line says why.

``import efa_ep`` only installs an import hook: each wrap happens when its Megatron module
(``moe_layer``, ``transformer_config``) is first imported (or immediately, if it already was),
so importing efa_ep does not import Megatron.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import threading

EFA_DISPATCHER_TYPE = "efa"
_MOE_LAYER_MODULE = "megatron.core.transformer.moe.moe_layer"
_CONFIG_MODULE = "megatron.core.transformer.transformer_config"
_lock = threading.Lock()


def uses_efa(dispatcher_type) -> bool:
    """True for ``"efa"``, and for the type named by ``EFA_EP_REPLACE_DISPATCHER`` (e.g.
    ``alltoall``): stacks that validate the type string (some Megatron-Bridge providers) keep a
    legal value in their config and still get the efa dispatcher."""
    from .settings import replaced_dispatcher_type

    if dispatcher_type == EFA_DISPATCHER_TYPE:
        return True
    replaced = replaced_dispatcher_type()
    return replaced is not None and dispatcher_type == replaced


def register_with_megatron(moe_layer_module=None) -> None:
    """Wraps ``MoELayer.__init__`` so ``moe_token_dispatcher_type="efa"`` builds our dispatcher.

    Idempotent. Called by the import hook; callable directly after importing Megatron.
    """
    if moe_layer_module is None:
        moe_layer_module = importlib.import_module(_MOE_LAYER_MODULE)
    def wrap(original_init):
        @functools.wraps(original_init)
        def __init__(self, config, *args, **kwargs):
            requested = getattr(config, "moe_token_dispatcher_type", None)
            if not uses_efa(requested):
                return original_init(self, config, *args, **kwargs)
            from . import cpu_compat
            from .token_dispatcher import EfaTokenDispatcher, check_supported

            check_supported(config)
            cpu_compat.enable()  # no-op where CUDA is available
            pg_collection = kwargs.get("pg_collection", args[2] if len(args) > 2 else None)
            if pg_collection is None:
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

                pg_collection = get_default_pg_collection()
            fallback = _fallback_for(config, pg_collection)
            # placeholder, replaced below; with a fallback, Megatron's own dispatcher stays
            config.moe_token_dispatcher_type = fallback or "allgather"
            try:
                original_init(self, config, *args, **kwargs)
            finally:
                config.moe_token_dispatcher_type = requested
            if fallback:
                return
            self.token_dispatcher = EfaTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config,
                pg_collection=pg_collection)
            if self.shared_experts is not None and self.shared_expert_overlap:
                self.token_dispatcher.set_shared_experts(self.shared_experts)
        return __init__

    _wrap_once(moe_layer_module.MoELayer, "__init__", wrap)


def _fallback_for(config, pg_collection):
    """The Megatron dispatcher type to build instead of efa (``EFA_EP_FALLBACK``), when one is
    asked for and the EP group agreed that the efa transport cannot run on some rank; else
    None. Collective over the EP group only when a fallback is asked for."""
    from .settings import fallback_dispatcher

    fallback = fallback_dispatcher(config)
    if fallback is None:
        return None
    from .transports import decide_fallback

    return fallback if decide_fallback(config, pg_collection.ep, fallback) else None


def register_config_validation(config_module=None) -> None:
    """Wraps ``TransformerConfig.__post_init__`` so that a config with an efa dispatcher type is
    validated as ``"alltoall"`` (the type is restored afterwards, also when validation raises).
    Idempotent."""
    if config_module is None:
        config_module = importlib.import_module(_CONFIG_MODULE)
    def wrap(original):
        @functools.wraps(original)
        def __post_init__(self, *args, **kwargs):
            requested = getattr(self, "moe_token_dispatcher_type", None)
            if not (uses_efa(requested) and requested != "alltoall"):
                return original(self, *args, **kwargs)
            self.moe_token_dispatcher_type = "alltoall"
            try:
                return original(self, *args, **kwargs)
            finally:
                self.moe_token_dispatcher_type = requested
        return __post_init__

    _wrap_once(config_module.TransformerConfig, "__post_init__", wrap)


def _wrap_once(cls, name: str, wrap) -> None:
    """Replaces ``cls.<name>`` by ``wrap(original)`` unless that was done already (marked)."""
    with _lock:
        original = getattr(cls, name)
        if getattr(original, "_efa_ep_wrapped", False):
            return
        wrapped = wrap(original)
        wrapped._efa_ep_wrapped = True
        setattr(cls, name, wrapped)


_HOOKS = {_MOE_LAYER_MODULE: register_with_megatron, _CONFIG_MODULE: register_config_validation}


class _HookLoader(importlib.abc.Loader):
    """Runs a module with its real loader, then its registration hook."""

    def __init__(self, inner, hook):
        self._inner, self._hook = inner, hook

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._hook(module)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds Megatron's moe_layer / transformer_config through the other finders and gives them
    a loader that registers after running them; leaves sys.meta_path once both are done."""

    def find_spec(self, fullname, path=None, target=None):
        hook = _HOOKS.get(fullname)
        if hook is None:
            return None
        sys.meta_path.remove(self)  # let the real finders locate it
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if any(m not in sys.modules and m != fullname for m in _HOOKS):
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookLoader(spec.loader, hook)
        return spec


def install_import_hook() -> None:
    """Registers now what of Megatron is imported, the rest when it is. Idempotent."""
    pending = False
    for name, hook in _HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            pending = True
    if pending and not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
