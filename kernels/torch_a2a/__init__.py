"""``efa_ep.kernels.torch_a2a``: the ``torch`` transport, the reference (``transport.py``:
:class:`TorchTransport` over ``torch.distributed.all_to_all_single``; no window, no device
kernels, no native code)."""
from .transport import TorchHandleState, TorchTransport, availability

__all__ = ["TorchHandleState", "TorchTransport", "availability"]
