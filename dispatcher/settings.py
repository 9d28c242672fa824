"""Which transport the ``efa`` dispatcher uses, and its knobs.

Every ``EFA_EP_*`` environment variable is declared once, in
:data:`~efa_ep.kernels.core.variables.VARIABLES`, whose module holds the one reader, the
validation and the derived help and docs tables (re-exported here). This module builds the
dispatcher's settings from them.

Precedence (highest first): :func:`configure` in this process; attributes set on the Megatron
``TransformerConfig`` instance (``config.efa_ep_<name>``: ``efa_ep_transport``,
``efa_ep_max_tokens_per_rank``, ``efa_ep_transport_options``, ``efa_ep_capacity_overflow``,
``efa_ep_grow_max_tokens_per_rank``, ``efa_ep_fallback``); the environment. A per-option
variable is used only for an option that no channel above (``EFA_EP_TRANSPORT_OPTIONS``
included) gives, and only by a transport whose schema has that option;
:meth:`DispatcherSettings.options_for` merges them for the transport that runs.

Every value is checked where it enters: a wrong name, an unknown option key (with "did you
mean") or a value of the wrong type raises :class:`~efa_ep.kernels.options.ConfigError` naming
the variable, attribute or call it came from. Launchers call :func:`check_environment` before
starting ranks, so the same error appears once, in seconds, instead of once per rank after the
model is built.

Environment variables reach every rank and every NeMo-RL worker, which is why they are the
default channel; every rank of an EP group must resolve the same settings (checked at setup).
Code inside one process passes settings objects instead (:func:`configure`, :func:`use`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Tuple

from efa_ep.kernels.core.variables import (  # noqa: F401 (the declarations and reader, re-exported)
    CAPACITY_OVERFLOW_POLICIES, ENV_CALIBRATION, ENV_CAPACITY_OVERFLOW, ENV_FALLBACK,
    ENV_GROW_MAX_TOKENS, ENV_MAX_TOKENS, ENV_OPTIONS, ENV_REPLACE_DISPATCHER, ENV_TRANSPORT,
    FALLBACK_DISPATCHERS, NATIVE_BUILD, PREFIX, VARIABLE, VARIABLES, Variable,
    _convert_option_variables, _read_option_variables, environment_options, help_lines,
    markdown_table, option_variables, parse_options, raw, read, unknown_variables, variables_set,
)
from efa_ep.kernels.options import (
    DEFAULT_MAX_TOKENS_PER_RANK, DEFAULT_TRANSPORT, ConfigError, check_max_tokens_per_rank,
    check_resolved, check_transport_name, did_you_mean, validate_options,
)



#: Options the dispatcher gives a transport unless the user sets them. ``gda``'s received rows
#: may be views of its window, valid until its next call (``rows_in_window``): the dispatcher
#: copies them (its permute) before it calls the transport again, so it lets ``auto`` choose
#: the window where that pays (large batches).
DISPATCHER_OPTION_DEFAULTS = {"gda": {"rows_in_window": "auto"}}


@dataclasses.dataclass(frozen=True)
class DispatcherSettings:
    """Settings of the ``efa`` dispatcher, checked against the transport's schema on creation.

    Attributes:
        transport: transport name (``auto``, ``torch``, ``gda``, ``proxy``, ``hier``).
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
        its schema over :data:`DISPATCHER_OPTION_DEFAULTS`, overridden by
        :attr:`transport_options`. This is what the transport uses and what
        ``create_transport`` compares across the EP group.

        Raises:
            ConfigError: a per-option variable with a bad value, naming the variable.
        """
        merged = dict(DISPATCHER_OPTION_DEFAULTS.get(transport, {}))
        merged.update(_convert_option_variables(transport, self.option_variables))
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
        # Raw strings: __post_init__ checks them against the schema, naming ``sources``.
        return DispatcherSettings(
            transport=raw(ENV_TRANSPORT, env) or VARIABLE[ENV_TRANSPORT].default,
            max_tokens_per_rank=raw(ENV_MAX_TOKENS, env) or VARIABLE[ENV_MAX_TOKENS].default,
            transport_options=raw(ENV_OPTIONS, env) or VARIABLE[ENV_OPTIONS].default,
            option_variables=_read_option_variables(env),
            calibration=read(ENV_CALIBRATION, environ=env),
            sources=tuple(names.get(v, v) for v in (ENV_TRANSPORT, ENV_MAX_TOKENS, ENV_OPTIONS)))

    def replace(self, **changes) -> "DispatcherSettings":
        """A copy with ``changes`` (``transport=``, ``transport_options=``, ...), checked again;
        a changed field's source becomes ``DispatcherSettings.<field>`` for messages."""
        fields = ("transport", "max_tokens_per_rank", "transport_options")
        sources = tuple(f"DispatcherSettings.{f}" if f in changes else s
                        for f, s in zip(fields, self.sources))
        return dataclasses.replace(self, sources=sources, **changes)


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


def use(settings: Optional[DispatcherSettings]) -> Optional[DispatcherSettings]:
    """Makes ``settings`` this process's dispatcher settings (as :func:`configure` does, with a
    whole settings object: a tool that runs several configurations in one process passes each
    this way instead of writing ``EFA_EP_*`` into ``os.environ``); None forgets them."""
    global _override
    _override = settings
    return settings


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
    return read(ENV_CAPACITY_OVERFLOW, config, environ, names)


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
    return read(ENV_GROW_MAX_TOKENS, config, environ, names)


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
    value = read(ENV_FALLBACK, config, environ, names)
    return None if value == "none" else value


def replaced_dispatcher_type(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``EFA_EP_REPLACE_DISPATCHER``: a Megatron dispatcher type (``alltoall``) whose layers get
    the efa dispatcher too, or None. For stacks that validate the type string (some
    Megatron-Bridge providers): their config keeps a legal value."""
    return read(ENV_REPLACE_DISPATCHER, environ=environ)


def check_environment(environ: Optional[Mapping[str, str]] = None,
                      names: Optional[Mapping[str, str]] = None,
                      check_available: bool = True) -> DispatcherSettings:
    """What a launcher calls before starting ranks on this machine: the settings the ranks will
    read from ``environ``, validated (every variable of :data:`VARIABLES` that the ranks read,
    the transport's per-option variables included; an undeclared ``EFA_EP_*`` is refused), with
    ``auto`` resolved and (``check_available``) the transport's availability checked here;
    with ``EFA_EP_FALLBACK`` set, a transport that cannot run here is left to the ranks, which
    then agree on the fallback.

    Raises:
        ConfigError: one line naming the variable, with a hint (e.g. ``gda`` on a machine
            without a GPU: use ``torch`` or ``auto``).
    """
    unknown = unknown_variables(environ)
    if unknown:
        # A misspelled variable would otherwise be silently ignored.
        raise ConfigError(f"{unknown[0]}: not an efa-ep variable"
                          f"{did_you_mean(unknown[0], VARIABLE)}",
                          hint="the variables: python3 -m efa_ep.tools.config --settings-table")
    s = DispatcherSettings.from_env(environ, names)
    read_above = (ENV_TRANSPORT, ENV_MAX_TOKENS, ENV_OPTIONS)  # from_env checked them
    for v in VARIABLES:  # every other setting the ranks read, by its declaration
        if not v.read_by and not v.transport and v.env not in read_above:
            read(v.env, None, environ, names)
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


__all__ = ["DispatcherSettings", "configure", "use", "reset", "current_settings",
           "check_environment", "parse_options", "ConfigError", "capacity_overflow_policy",
           "grow_max_tokens_per_rank", "environment_options", "fallback_dispatcher",
           "replaced_dispatcher_type", "option_variables", "Variable", "VARIABLES", "VARIABLE",
           "raw", "read", "unknown_variables", "variables_set", "markdown_table", "help_lines"]
