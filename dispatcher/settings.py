"""Which transport the ``efa`` dispatcher uses, and its knobs: the one place that reads them.

Every ``EFA_EP_*`` knob is read here (transports take their options explicitly; the registry's
``create_transport`` checks once, across the EP group, that every rank passes the same ones).
Precedence (highest first): :func:`configure` in this process; attributes set on the Megatron
``TransformerConfig`` instance (``config.efa_ep_transport``, ``config.efa_ep_max_tokens_per_rank``,
``config.efa_ep_transport_options``); environment variables:

- ``EFA_EP_TRANSPORT``: ``auto`` (default: ``gda`` where usable, else ``torch``), ``torch``,
  ``gda``, ``proxy``.
- ``EFA_EP_MAX_TOKENS_PER_RANK``: bound on tokens per rank per MoE call (default 16384); sizes
  the fixed windows of ``gda``/``proxy``.
- ``EFA_EP_TRANSPORT_OPTIONS``: comma-separated ``key=value`` knobs passed to the transport,
  e.g. ``num_channels=4,provider=tcp``.
- One variable per option that has one in the transport's schema (``Option.env`` in
  :mod:`efa_ep.kernels.options`): ``EFA_EP_PROXY_CHANNELS``, ``EFA_EP_PROXY_PROVIDER``,
  ``EFA_EP_PROXY_TIMEOUT_S``, ... (``proxy`` and ``hier``), ``EFA_EP_NODE_SIZE`` (``hier``). An
  option given by any channel above (``EFA_EP_TRANSPORT_OPTIONS`` included) wins over its
  variable; :meth:`DispatcherSettings.options_for` merges them for the transport that runs.
- ``EFA_EP_CAPACITY_OVERFLOW``: what happens when a call does not fit: ``drop`` (default) or
  ``error`` (both raise on a dispatch of more than ``max_tokens_per_rank`` tokens; they differ
  in drop-and-pad mode, for a (rank, expert) pair over capacity), or ``grow`` (the windows grow,
  collectively, and the dispatch is replayed; over-capacity pairs are dropped as with
  ``drop``). ``config.efa_ep_capacity_overflow`` wins; see :func:`capacity_overflow_policy`.
- ``EFA_EP_GROW_MAX_TOKENS_PER_RANK``: the most tokens per rank ``grow`` sizes windows for
  (default and maximum 2**24; a dispatch that needs more raises);
  ``config.efa_ep_grow_max_tokens_per_rank`` wins; see :func:`grow_max_tokens_per_rank`.
- ``EFA_EP_FALLBACK``: ``alltoall`` makes every rank of an EP group run Megatron's
  ``alltoall`` dispatcher instead of ``efa`` when the transport cannot be created or fails its
  self-test on some rank (decided together, one log line says why); unset or ``none`` (default):
  the transport's error is raised, one line on every rank. ``config.efa_ep_fallback`` wins; see
  :func:`fallback_dispatcher` and :mod:`efa_ep.dispatcher.transports`.

Every value is checked against the transport's option schema (:mod:`efa_ep.kernels.options`)
where it enters: a wrong name, an unknown option key (with "did you mean") or a value of the
wrong type raises :class:`~efa_ep.kernels.options.ConfigError` naming the variable, attribute or
call it came from. Launchers call :func:`check_environment` before starting ranks, so the same
error appears once, in seconds, instead of once per rank after the model is built.

Environment variables reach every rank and every NeMo-RL worker, which is why they are the
default channel; every rank of an EP group must resolve the same settings (checked at setup).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from efa_ep.kernels.options import (
    DEFAULT_MAX_TOKENS_PER_RANK, DEFAULT_TRANSPORT, MAX_MAX_TOKENS_PER_RANK, SCHEMAS, ConfigError,
    check_max_tokens_per_rank, check_resolved, check_transport_name, did_you_mean,
    parse_options_text, validate_options,
)

ENV_TRANSPORT = "EFA_EP_TRANSPORT"
ENV_MAX_TOKENS = "EFA_EP_MAX_TOKENS_PER_RANK"
ENV_OPTIONS = "EFA_EP_TRANSPORT_OPTIONS"


def parse_options(text: str, where: str = ENV_OPTIONS) -> Dict[str, Any]:
    """``"a=1,b=x,c=0.5"`` -> ``{"a": 1, "b": "x", "c": 0.5}`` (ints and floats parsed, before
    any schema); raises ConfigError on a malformed item."""
    out: Dict[str, Any] = {}
    for key, value in parse_options_text(text, where).items():
        for conv in (int, float):
            try:
                value = conv(value)
                break
            except ValueError:
                pass
        out[key] = value
    return out


def option_variables() -> Tuple[str, ...]:
    """Every per-option environment variable of every transport's schema, sorted."""
    return tuple(sorted({o.env for schema in SCHEMAS.values() for o in schema.values() if o.env}))


def _read_option_variables(env: Mapping[str, str]) -> tuple:
    """``(variable, value)`` of the per-option variables set (non-empty) in ``env``, sorted."""
    return tuple((v, env[v].strip()) for v in option_variables() if (env.get(v) or "").strip())


def environment_options(transport: str, environ: Optional[Mapping[str, str]] = None,
                        names: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The options of ``transport`` (a name that runs: ``torch``, ``gda``, ``proxy``, ``hier``)
    given by their own variables (``EFA_EP_PROXY_CHANNELS=4`` -> ``{"num_channels": 4}``),
    read from ``environ`` (default ``os.environ``) and converted by the schema.

    Args:
        names: optional ``{variable: what the user set}`` for messages.

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the variable.
    """
    env = os.environ if environ is None else environ
    return _convert_option_variables(transport, _read_option_variables(env), names)


def _convert_option_variables(transport: str, variables: tuple,
                              names: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    given = dict(variables)
    names = dict(names or {})
    out: Dict[str, Any] = {}
    for key, opt in SCHEMAS.get(transport, {}).items():
        if opt.env and opt.env in given:
            out[key] = opt.convert(given[opt.env], names.get(opt.env, opt.env))
    return out


@dataclasses.dataclass(frozen=True)
class DispatcherSettings:
    """Settings of the ``efa`` dispatcher, checked against the transport's schema on creation.

    Attributes:
        transport: transport name (``auto``, ``torch``, ``gda``, ``proxy``).
        max_tokens_per_rank: bound on the tokens one rank passes to one dispatch.
        transport_options: sorted ``(key, value)`` knobs given explicitly (configure, config
            attribute, ``EFA_EP_TRANSPORT_OPTIONS``), values converted to the schema's types.
        option_variables: sorted ``(variable, value)`` of the per-option variables
            (``EFA_EP_PROXY_*``, ``EFA_EP_NODE_SIZE``) set when the settings were read; they
            give the options that ``transport_options`` does not (:meth:`options_for`).
        calibration: ``EFA_EP_CALIBRATION``, a calibration file of ``efa-ep-plan calibrate``
            from which ``auto`` takes ``hier``'s ``num_channels`` when none is given (None: the
            transport's default).
        sources: where each field came from (for error messages); not part of equality.
    """

    transport: str = DEFAULT_TRANSPORT
    max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK
    transport_options: tuple = ()
    option_variables: tuple = ()
    calibration: Optional[str] = None
    sources: Tuple[str, str, str] = dataclasses.field(
        default=("DispatcherSettings.transport", "DispatcherSettings.max_tokens_per_rank",
                 "DispatcherSettings.transport_options"), compare=False, repr=False)

    def __post_init__(self):
        where_t, where_m, where_o = self.sources
        name = check_transport_name(self.transport, where_t)
        tokens = check_max_tokens_per_rank(self.max_tokens_per_rank, where_m)
        opts = self.transport_options
        if isinstance(opts, str):
            opts = parse_options(opts, where_o)
        opts = validate_options(name, dict(opts), where_o)
        object.__setattr__(self, "transport", name)
        object.__setattr__(self, "max_tokens_per_rank", tokens)
        object.__setattr__(self, "transport_options", tuple(sorted(opts.items())))

    def resolved_transport(self) -> str:
        """The transport that runs here (``auto`` resolved), refusing options it would ignore."""
        from efa_ep.kernels import resolve_transport_name

        resolved = resolve_transport_name(self.transport)
        check_resolved(self.transport, resolved, dict(self.transport_options), self.sources[2])
        return resolved

    def options_for(self, transport: str) -> tuple:
        """Every option ``transport`` (the name that runs, e.g. :meth:`resolved_transport`) gets,
        as sorted ``(key, value)`` pairs for ``create_transport``: the per-option variables of
        its schema, overridden by :attr:`transport_options`. This is what the transport uses
        and what ``create_transport`` compares across the EP group.

        Raises:
            ConfigError: a per-option variable with a bad value, naming the variable.
        """
        merged = _convert_option_variables(transport, self.option_variables)
        merged.update(dict(self.transport_options))
        return tuple(sorted(merged.items()))

    @staticmethod
    def from_env(environ: Optional[Mapping[str, str]] = None,
                 names: Optional[Mapping[str, str]] = None) -> "DispatcherSettings":
        """Settings from ``EFA_EP_*`` variables of ``environ`` (default ``os.environ``).

        Args:
            names: optional ``{variable: what the user set}`` for messages, e.g.
                ``{"EFA_EP_TRANSPORT": "efa_ep.transport.transport"}`` when a recipe key set it.
        """
        env = os.environ if environ is None else environ
        names = dict(names or {})
        return DispatcherSettings(
            transport=(env.get(ENV_TRANSPORT) or "").strip() or DEFAULT_TRANSPORT,
            max_tokens_per_rank=(env.get(ENV_MAX_TOKENS) or "").strip() or DEFAULT_MAX_TOKENS_PER_RANK,
            transport_options=env.get(ENV_OPTIONS, ""),
            option_variables=_read_option_variables(env),
            calibration=(env.get("EFA_EP_CALIBRATION") or "").strip() or None,
            sources=tuple(names.get(v, v) for v in (ENV_TRANSPORT, ENV_MAX_TOKENS, ENV_OPTIONS)))


_override: Optional[DispatcherSettings] = None


def configure(transport: Optional[str] = None, max_tokens_per_rank: Optional[int] = None,
              **transport_options) -> DispatcherSettings:
    """Sets this process's dispatcher settings (overrides config attributes and environment).

    Call before building the model; layers already built keep their transport. Fields not given
    keep the environment's (or an earlier call's) values, except that a new transport name
    without options starts with none (one transport's knobs do not carry to another).

    Raises:
        ConfigError: an unknown transport or option key, or a value of the wrong type.
    """
    global _override
    base = _override or DispatcherSettings.from_env()
    given_t, given_m, given_o = transport is not None, max_tokens_per_rank is not None, bool(transport_options)
    if given_t and not given_o and str(transport).strip() != base.transport:
        given_o = True  # options of the previous transport are not this one's
    _override = DispatcherSettings(
        transport=transport if given_t else base.transport,
        max_tokens_per_rank=max_tokens_per_rank if given_m else base.max_tokens_per_rank,
        transport_options=tuple(sorted(transport_options.items())) if given_o else base.transport_options,
        option_variables=base.option_variables, calibration=base.calibration,
        sources=("configure(transport=...)" if given_t else base.sources[0],
                 "configure(max_tokens_per_rank=...)" if given_m else base.sources[1],
                 "configure(**transport_options)" if given_o else base.sources[2]))
    return _override


def reset() -> None:
    """Forgets :func:`configure` (tests)."""
    global _override
    _override = None


def current_settings(config=None) -> DispatcherSettings:
    """The settings a dispatcher built now for ``config`` would use (validated)."""
    if _override is not None:
        return _override
    s = DispatcherSettings.from_env()
    if config is None:
        return s
    t = getattr(config, "efa_ep_transport", None)
    m = getattr(config, "efa_ep_max_tokens_per_rank", None)
    o = getattr(config, "efa_ep_transport_options", None)
    if not (t or m or o):
        return s
    where_o = "config.efa_ep_transport_options"
    if isinstance(o, str):
        o = parse_options(o, where_o)
    return DispatcherSettings(
        transport=t or s.transport,
        max_tokens_per_rank=m or s.max_tokens_per_rank,
        transport_options=tuple(sorted(dict(o).items())) if o else s.transport_options,
        option_variables=s.option_variables, calibration=s.calibration,
        sources=("config.efa_ep_transport" if t else s.sources[0],
                 "config.efa_ep_max_tokens_per_rank" if m else s.sources[1],
                 where_o if o else s.sources[2]))


ENV_CAPACITY_OVERFLOW = "EFA_EP_CAPACITY_OVERFLOW"
CAPACITY_OVERFLOW_POLICIES = ("drop", "error", "grow")
ENV_GROW_MAX_TOKENS = "EFA_EP_GROW_MAX_TOKENS_PER_RANK"


def capacity_overflow_policy(config=None, environ: Optional[Mapping[str, str]] = None,
                             names: Optional[Mapping[str, str]] = None) -> str:
    """What the ``efa`` dispatcher does with a call that does not fit; every EP rank must use
    the same value (the dispatcher checks, and raises one line on every rank otherwise).

    - ``drop`` (default): a dispatch of more than ``max_tokens_per_rank`` (T_MAX) tokens on
      any rank raises the transport's error on every rank. Drop-and-pad mode
      (``moe_pad_expert_input_to_capacity``): a (source rank, expert) pair holding more than
      ``capacity`` tokens keeps the first ``capacity`` in token order (Megatron's semantics, no
      host sync).
    - ``error``: as ``drop`` for T_MAX; in drop-and-pad mode an over-capacity pair raises (one
      all-gather of the per-expert counts and a host read per dispatch; every EP rank raises
      one line naming the rank, the expert, the count and the capacity).
    - ``grow``: a dispatch that needs more than T_MAX tokens on any rank enlarges the windows
      instead: every rank learns it from the refused dispatch, one small all-gather agrees on
      the new T_MAX (the group's largest T, rounded up to a power of two, at most
      :func:`grow_max_tokens_per_rank`), a transport of that size replaces the old one for
      every layer of the EP group, rank 0 of the group logs one line, and the dispatch is
      replayed. Windows never shrink. Drop-and-pad mode: shapes are static (C from the capacity
      factor), so over-capacity pairs are dropped as with ``drop``; a T over T_MAX (the same T
      on every rank, as the mode requires) grows the windows before the dispatch.

    From ``config.efa_ep_capacity_overflow`` if set, else ``EFA_EP_CAPACITY_OVERFLOW``.

    Args:
        names: optional ``{variable: what the user set}`` for messages.

    Raises:
        ConfigError: any other value, one line naming where it came from.
    """
    value = getattr(config, "efa_ep_capacity_overflow", None) if config is not None else None
    where = "config.efa_ep_capacity_overflow"
    if not value:
        env = os.environ if environ is None else environ
        where = dict(names or {}).get(ENV_CAPACITY_OVERFLOW, ENV_CAPACITY_OVERFLOW)
        value = (env.get(ENV_CAPACITY_OVERFLOW) or "").strip() or "drop"
    value = str(value).strip().lower()
    if value not in CAPACITY_OVERFLOW_POLICIES:
        raise ConfigError(
            f"{where}={value!r}: expected one of {', '.join(CAPACITY_OVERFLOW_POLICIES)}"
            f"{did_you_mean(value, CAPACITY_OVERFLOW_POLICIES)}",
            hint="drop (default) or error: a dispatch over max_tokens_per_rank raises; grow: "
                 "the windows grow and the dispatch is replayed")
    return value


def grow_max_tokens_per_rank(config=None, environ: Optional[Mapping[str, str]] = None,
                             names: Optional[Mapping[str, str]] = None) -> int:
    """The most tokens per rank the ``grow`` policy sizes windows for (default and maximum
    2**24, the bound on ``max_tokens_per_rank``): a dispatch that needs more raises on every
    EP rank instead of growing. Where ranks differ, the smallest value of the group counts.
    The windows' memory is bounded separately: a grow whose windows
    (:func:`efa_ep.kernels.memory.window_bytes`) exceed the free memory of any rank raises.

    From ``config.efa_ep_grow_max_tokens_per_rank`` if set, else
    ``EFA_EP_GROW_MAX_TOKENS_PER_RANK``.

    Raises:
        ConfigError: not a positive integer up to 2**24, one line naming where it came from.
    """
    value = getattr(config, "efa_ep_grow_max_tokens_per_rank", None) if config is not None else None
    where = "config.efa_ep_grow_max_tokens_per_rank"
    if not value:
        env = os.environ if environ is None else environ
        where = dict(names or {}).get(ENV_GROW_MAX_TOKENS, ENV_GROW_MAX_TOKENS)
        value = (env.get(ENV_GROW_MAX_TOKENS) or "").strip() or MAX_MAX_TOKENS_PER_RANK
    try:
        return check_max_tokens_per_rank(value, where)
    except ConfigError as e:
        raise ConfigError(str(e), hint=f"a positive integer, default and maximum "
                                       f"{MAX_MAX_TOKENS_PER_RANK}") from None


ENV_FALLBACK = "EFA_EP_FALLBACK"
FALLBACK_DISPATCHERS = ("alltoall",)
_NO_FALLBACK = ("", "none", "off", "0")


def fallback_dispatcher(config=None, environ: Optional[Mapping[str, str]] = None,
                        names: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The Megatron dispatcher type every EP rank builds instead of ``efa`` when the efa
    transport cannot run on some rank of the group (``alltoall``), or None: no fallback, the
    transport's error is raised on every rank (the default). Why a fallback exists: a job that
    prefers running on Megatron's path to stopping, e.g. on a cluster where some hosts lack
    the libfabric provider. The probe and the agreement are in
    :mod:`efa_ep.dispatcher.transports`.

    From ``config.efa_ep_fallback`` if set, else ``EFA_EP_FALLBACK``; ``none``, ``off`` or empty
    mean no fallback.

    Raises:
        ConfigError: any other value, one line naming where it came from.
    """
    value = getattr(config, "efa_ep_fallback", None) if config is not None else None
    where = "config.efa_ep_fallback"
    if value is None or (isinstance(value, str) and not value.strip()):
        env = os.environ if environ is None else environ
        where = dict(names or {}).get(ENV_FALLBACK, ENV_FALLBACK)
        value = env.get(ENV_FALLBACK) or ""
    value = str(value).strip().lower()
    if value in _NO_FALLBACK:
        return None
    if value not in FALLBACK_DISPATCHERS:
        raise ConfigError(
            f"{where}={value!r}: expected {' or '.join(FALLBACK_DISPATCHERS)} (or none)"
            f"{did_you_mean(value, FALLBACK_DISPATCHERS)}",
            hint="alltoall: every EP rank runs Megatron's alltoall dispatcher when the efa "
                 "transport cannot run on some rank; none (default): raise the transport's error")
    return value


def check_environment(environ: Optional[Mapping[str, str]] = None,
                      names: Optional[Mapping[str, str]] = None,
                      check_available: bool = True) -> DispatcherSettings:
    """What a launcher calls before starting ranks on this machine: the settings the ranks will
    read from ``environ``, validated (the transport's per-option variables,
    ``EFA_EP_CAPACITY_OVERFLOW`` and ``EFA_EP_GROW_MAX_TOKENS_PER_RANK`` included), with
    ``auto`` resolved and (``check_available``) the transport's availability checked here;
    with ``EFA_EP_FALLBACK`` set, a transport that cannot run here is left to the ranks, which
    then agree on the fallback.

    Raises:
        ConfigError: one line naming the variable, with a hint (e.g. ``gda`` on a machine
            without a GPU: use ``torch`` or ``auto``).
    """
    s = DispatcherSettings.from_env(environ, names)
    capacity_overflow_policy(None, environ, names)
    grow_max_tokens_per_rank(None, environ, names)
    fallback = fallback_dispatcher(None, environ, names)
    if not check_available:
        if s.transport != "auto":
            _convert_option_variables(s.transport, s.option_variables, names)
        return s
    from efa_ep.kernels import transport_status
    from efa_ep.kernels.options import unavailable_hint

    resolved = s.resolved_transport()
    _convert_option_variables(resolved, s.option_variables, names)
    why = _status_keeping_sigint(transport_status).get(resolved)
    if why is not None and fallback is None:
        short = why.split(" (needs ")[0]
        raise ConfigError(f"{s.sources[0]}={s.transport!r}: transport {resolved!r} cannot run on "
                          f"this machine: {short}", hint=unavailable_hint(resolved, s.sources[0]))
    return s


def _status_keeping_sigint(status_fn):
    """``status_fn()`` with Python's SIGINT handler put back afterwards: probing the proxy loads
    libfabric, whose providers install their own SIGINT handler, and that handler ends the
    process with status 1 and no message on Ctrl-C instead of raising KeyboardInterrupt."""
    import signal
    import threading

    try:
        return status_fn()
    finally:
        if threading.current_thread() is threading.main_thread():
            handler = signal.getsignal(signal.SIGINT)
            if handler is not None:  # None: installed from C, not by Python; leave it
                signal.signal(signal.SIGINT, handler)


__all__ = ["DispatcherSettings", "configure", "reset", "current_settings", "check_environment",
           "parse_options", "ConfigError", "capacity_overflow_policy", "grow_max_tokens_per_rank",
           "environment_options", "fallback_dispatcher",
           "option_variables"]
