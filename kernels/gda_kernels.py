"""Former name of :mod:`efa_ep.kernels.gda.launches` (gda's kernel wrappers) and of the device
helpers the ``proxy``'s device path shares; import from there."""
from .gda.device import _round_f32_to, _source_of_row, next_pow2  # noqa: F401
from .gda.launches import *  # noqa: F401,F403
from .gda.launches import _block_d, _warps  # noqa: F401
