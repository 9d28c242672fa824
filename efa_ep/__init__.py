"""efa-ep: expert-parallel token dispatch for Megatron-Core and NeMo-RL on AWS EFA.

Subpackages (mapped from the repository's top-level folders by ``pyproject.toml``):

- ``efa_ep.kernels``: transports that move tokens (``torch``, ``gda``, ``proxy``); no Megatron.
- ``efa_ep.dispatcher``: the Megatron ``MoETokenDispatcher`` selected with
  ``moe_token_dispatcher_type="efa"``; no libfabric.
- ``efa_ep.recipes``: NeMo-RL GRPO recipes, their launcher and the built-in GRPO trainer.

``import efa_ep`` needs only torch: it registers the ``efa`` dispatcher with Megatron-Core lazily,
when (and if) ``megatron.core.transformer.moe.moe_layer`` is imported.
"""
import os as _os

__version__ = "0.1.0"

# In a source checkout the subpackages live beside this folder (dispatcher/, kernels/, ...), not
# inside it; setuptools maps them for installs, this makes a plain checkout on sys.path work too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")) and _root not in __path__:
    __path__.append(_root)

from efa_ep.dispatcher.registration import install_import_hook as _install_import_hook  # noqa: E402

_install_import_hook()
