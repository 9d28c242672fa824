"""Makes ``moe_token_dispatcher_type="efa"`` work in plain Megatron-Core (no fork, no file edits).

Megatron's ``MoELayer.__init__`` picks its dispatcher with an if/elif on the type string and
raises for unknown values. We wrap ``MoELayer.__init__``: for ``"efa"`` it builds the layer with
the cheap ``allgather`` dispatcher as a placeholder (it creates no streams and communicates
nothing at construction), restores the type on the config, and installs
:class:`~efa_ep.dispatcher.token_dispatcher.EfaTokenDispatcher`. Every other type is untouched.

``import efa_ep`` only installs an import hook: the wrap happens when Megatron's ``moe_layer``
module is first imported (or immediately, if it already was), so importing efa_ep does not
import Megatron.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import threading

EFA_DISPATCHER_TYPE = "efa"
_MOE_LAYER_MODULE = "megatron.core.transformer.moe.moe_layer"
_lock = threading.Lock()


def uses_efa(dispatcher_type) -> bool:
    """True for ``"efa"``, and for the type named by ``EFA_EP_REPLACE_DISPATCHER`` (e.g.
    ``alltoall``): stacks that validate the type string (some Megatron-Bridge providers) keep a
    legal value in their config and still get the efa dispatcher."""
    replaced = os.environ.get("EFA_EP_REPLACE_DISPATCHER", "").strip()
    return dispatcher_type == EFA_DISPATCHER_TYPE or (bool(replaced) and dispatcher_type == replaced)


def register_with_megatron(moe_layer_module=None) -> None:
    """Wraps ``MoELayer.__init__`` so ``moe_token_dispatcher_type="efa"`` builds our dispatcher.

    Idempotent. Called by the import hook; callable directly after importing Megatron.
    """
    if moe_layer_module is None:
        moe_layer_module = importlib.import_module(_MOE_LAYER_MODULE)
    layer_cls = moe_layer_module.MoELayer
    with _lock:
        if getattr(layer_cls.__init__, "_efa_ep_wrapped", False):
            return
        original_init = layer_cls.__init__

        @functools.wraps(original_init)
        def __init__(self, config, *args, **kwargs):
            requested = getattr(config, "moe_token_dispatcher_type", None)
            if not uses_efa(requested):
                return original_init(self, config, *args, **kwargs)
            from efa_ep.dispatcher import cpu_compat
            from efa_ep.dispatcher.token_dispatcher import EfaTokenDispatcher, check_supported

            check_supported(config)
            cpu_compat.enable()  # no-op where CUDA is available
            config.moe_token_dispatcher_type = "allgather"  # placeholder, replaced below
            try:
                original_init(self, config, *args, **kwargs)
            finally:
                config.moe_token_dispatcher_type = requested
            pg_collection = kwargs.get("pg_collection", args[2] if len(args) > 2 else None)
            if pg_collection is None:
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

                pg_collection = get_default_pg_collection()
            self.token_dispatcher = EfaTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config,
                pg_collection=pg_collection)

        __init__._efa_ep_wrapped = True
        layer_cls.__init__ = __init__


class _RegisterOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds Megatron's moe_layer through the other finders, runs it, then registers."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MOE_LAYER_MODULE:
            return None
        sys.meta_path.remove(self)  # let the real finders locate it
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        register_with_megatron(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install_import_hook() -> None:
    """Registers now if Megatron's moe_layer is imported, else when it is. Idempotent."""
    if _MOE_LAYER_MODULE in sys.modules:
        register_with_megatron(sys.modules[_MOE_LAYER_MODULE])
        return
    if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
