"""Which transport the ``efa`` dispatcher uses, and its knobs.

Precedence (highest first): :func:`configure` in this process; attributes set on the Megatron
``TransformerConfig`` instance (``config.efa_ep_transport``, ``config.efa_ep_max_tokens_per_rank``,
``config.efa_ep_transport_options``); environment variables:

- ``EFA_EP_TRANSPORT``: ``auto`` (default: ``gda`` where usable, else ``torch``), ``torch``,
  ``gda``, ``proxy``.
- ``EFA_EP_MAX_TOKENS_PER_RANK``: bound on tokens per rank per MoE call (default 16384); sizes
  the fixed windows of ``gda``/``proxy``.
- ``EFA_EP_TRANSPORT_OPTIONS``: comma-separated ``key=value`` knobs passed to the transport,
  e.g. ``num_channels=4,provider=tcp`` (ints and floats are parsed).

Environment variables reach every rank and every NeMo-RL worker, which is why they are the
default channel; every rank of an EP group must resolve the same settings (checked at setup).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional


def parse_options(text: str) -> Dict[str, Any]:
    """``"a=1,b=x,c=0.5"`` -> ``{"a": 1, "b": "x", "c": 0.5}``; raises on a malformed item."""
    out: Dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"EFA_EP_TRANSPORT_OPTIONS item {item!r} is not key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        for conv in (int, float):
            try:
                value = conv(value)
                break
            except ValueError:
                pass
        out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class DispatcherSettings:
    """Settings of the ``efa`` dispatcher.

    Attributes:
        transport: transport name (``auto``, ``torch``, ``gda``, ``proxy``).
        max_tokens_per_rank: bound on the tokens one rank passes to one dispatch.
        transport_options: extra knobs forwarded to ``create_transport``.
    """

    transport: str = "auto"
    max_tokens_per_rank: int = 16384
    transport_options: tuple = ()

    @staticmethod
    def from_env() -> "DispatcherSettings":
        return DispatcherSettings(
            transport=os.environ.get("EFA_EP_TRANSPORT", "auto").strip() or "auto",
            max_tokens_per_rank=int(os.environ.get("EFA_EP_MAX_TOKENS_PER_RANK", "16384")),
            transport_options=tuple(sorted(parse_options(
                os.environ.get("EFA_EP_TRANSPORT_OPTIONS", "")).items())),
        )


_override: Optional[DispatcherSettings] = None


def configure(transport: Optional[str] = None, max_tokens_per_rank: Optional[int] = None,
              **transport_options) -> DispatcherSettings:
    """Sets this process's dispatcher settings (overrides config attributes and environment).

    Call before building the model; layers already built keep their transport.
    """
    global _override
    base = _override or DispatcherSettings.from_env()
    _override = DispatcherSettings(
        transport=transport or base.transport,
        max_tokens_per_rank=max_tokens_per_rank or base.max_tokens_per_rank,
        transport_options=tuple(sorted(transport_options.items())) if transport_options
        else base.transport_options)
    return _override


def reset() -> None:
    """Forgets :func:`configure` (tests)."""
    global _override
    _override = None


def current_settings(config=None) -> DispatcherSettings:
    """The settings a dispatcher built now for ``config`` would use."""
    if _override is not None:
        return _override
    s = DispatcherSettings.from_env()
    if config is not None:
        opts = getattr(config, "efa_ep_transport_options", None)
        if isinstance(opts, str):
            opts = parse_options(opts)
        s = DispatcherSettings(
            transport=getattr(config, "efa_ep_transport", None) or s.transport,
            max_tokens_per_rank=getattr(config, "efa_ep_max_tokens_per_rank", None) or s.max_tokens_per_rank,
            transport_options=tuple(sorted(dict(opts).items())) if opts else s.transport_options)
    return s
