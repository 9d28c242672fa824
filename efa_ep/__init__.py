"""``efa_ep`` (efa-ep): expert-parallel token dispatch for Megatron-Core and NeMo-RL on AWS EFA.

Subpackages (the repository's top-level folders, mapped by ``pyproject.toml`` for installs and by
a small import finder below for a plain checkout on sys.path):

- ``efa_ep.kernels``: transports that move tokens (``torch``, ``gda``, ``proxy``); no Megatron.
- ``efa_ep.dispatcher``: the Megatron ``MoETokenDispatcher`` selected with
  ``moe_token_dispatcher_type="efa"``; no libfabric.
- ``efa_ep.recipes``: NeMo-RL GRPO recipes, their launcher and the built-in GRPO trainer.

``import efa_ep`` needs only torch: it registers the ``efa`` dispatcher with Megatron-Core lazily,
when (and if) ``megatron.core.transformer.moe.moe_layer`` is imported.
"""
import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys

__version__ = "0.1.0"

# The subpackages that live in the repository's top-level folders, as pyproject.toml maps them
# for installs (``package-dir``). In a plain source checkout on sys.path (no install), this
# finder gives the same mapping, and only it: other top-level folders (tests/, scripts/) are not
# part of the package.
_SUBPACKAGES = ("dispatcher", "kernels", "recipes", "conf")
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


class _CheckoutFinder(_abc.MetaPathFinder):
    """``efa_ep.<name>`` -> ``<checkout>/<name>/`` for the names in ``_SUBPACKAGES``."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, name = fullname.partition(".")
        if head != "efa_ep" or name not in _SUBPACKAGES:
            return None
        init = _os.path.join(_root, name, "__init__.py")
        if not _os.path.isfile(init):
            return None
        return _util.spec_from_file_location(fullname, init,
                                             submodule_search_locations=[_os.path.dirname(init)])


# A source checkout (this package's folder next to pyproject.toml and kernels/): its own
# subpackages win over any other installation's (e.g. an editable install of another clone).
if (_os.path.isfile(_os.path.join(_root, "pyproject.toml"))
        and _os.path.isfile(_os.path.join(_root, "kernels", "gda.py"))
        and not any(isinstance(f, _CheckoutFinder) for f in _sys.meta_path)):
    _sys.meta_path.insert(0, _CheckoutFinder())

from efa_ep.dispatcher.registration import install_import_hook as _install_import_hook  # noqa: E402

_install_import_hook()
