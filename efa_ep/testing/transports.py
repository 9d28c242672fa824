"""Probes of transport creation shared by the transport tests and the GPU check scripts
(``scripts/gpu/gpu_hmem_check.sh``). Transports are imported inside the functions."""
from __future__ import annotations

import torch


def proxy_creation_error(**options) -> str:
    """``'no error'`` if a ``proxy`` transport with ``options`` starts (and closes) in this
    process (E 4, H 8, 16 tokens, float32, no group: world 1), else ``'TransportError: <msg>'``."""
    from efa_ep.kernels import TransportError, create_transport

    try:
        create_transport("proxy", None, 4, 8, 16, torch.float32, **options).close()
        return "no error"
    except TransportError as e:
        return f"TransportError: {e}"


def hmem_creation_error_worker(rank, world, provider) -> str:
    """Rank worker (:func:`efa_ep.distributed.run_ranks`): what ``hmem='cuda'`` over
    ``provider`` gives here (:func:`proxy_creation_error`)."""
    return proxy_creation_error(provider=provider, hmem="cuda")
