"""Which transport the ``efa`` dispatcher uses, and its knobs: the one place that reads them.

Every ``EFA_EP_*`` environment variable is declared once, in :data:`VARIABLES` (name, variable,
type, default, allowed values, doc), and everything else is derived from that table: the
reader (:func:`raw` and :func:`read`, the only code in ``dispatcher/`` and ``efa_ep/tools/``
that reads ``EFA_EP_*``), the validation (:meth:`Variable.convert`: one :class:`ConfigError`
line naming the variable and the value), the tools' help text (:func:`help_lines`) and the
settings table of README.md and docs/cluster.md (:func:`markdown_table`; refresh them with
``python3 -m efa_ep.tools.config --settings-table --write``). A variable that gives a
transport option (``EFA_EP_PROXY_CHANNELS`` -> ``num_channels``) takes its type, default,
bounds and doc from that transport's option schema (:mod:`efa_ep.kernels.options`); the table
holds only the link.

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
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from efa_ep.kernels.options import (
    DEFAULT_MAX_TOKENS_PER_RANK, DEFAULT_TRANSPORT, MAX_MAX_TOKENS_PER_RANK, SCHEMAS,
    TRANSPORT_NAMES, ConfigError, Option, check_max_tokens_per_rank, check_resolved,
    check_transport_name, did_you_mean, parse_options_text, validate_options,
)

PREFIX = "EFA_EP_"
#: who reads a variable that this module does not read itself (``Variable.read_by``)
NATIVE_BUILD = "kernels/proxy/native.py"


@dataclasses.dataclass(frozen=True)
class Variable:
    """The declaration of one ``EFA_EP_*`` environment variable.

    Attributes:
        env: the variable, ``EFA_EP_...``.
        name: the setting it gives: a field of :class:`DispatcherSettings` or the name of a
            reader here (``transport``, ``capacity_overflow``, ...), or, with ``transport``,
            the option key in that transport's schema.
        type: ``int``, ``float`` or ``str``; the value is converted to it.
        default: the value when the variable is unset (None: none, or computed, see ``doc``).
        doc: what the setting means, one line (the error hint, the help and the README).
        choices: allowed values (strings are compared lower-cased), or None.
        min, max: inclusive bounds for numbers, or None.
        config: True when ``config.efa_ep_<name>`` on a Megatron config wins over the variable.
        transport: for a per-option variable, the transport whose schema declares the option;
            type, default, doc, choices and bounds then come from that schema.
        aliases: ``(spelling, value)`` pairs accepted for a value (``off`` for ``none``).
        allowed: how the allowed values read in the table when ``choices`` and bounds do not
            say it (``key=value,...``, ``a path``).
        read_by: "" when this module reads it; else the module that does (variables of the
            native build and of the tests, which are declared here for the table).
        check: a checker ``(value, where) -> value`` used instead of the generic one, for a
            setting whose schema lives in :mod:`efa_ep.kernels.options` with its own wording.
    """

    env: str
    name: str
    type: type = str
    default: Any = None
    doc: str = ""
    choices: Optional[Tuple[Any, ...]] = None
    min: Optional[float] = None
    max: Optional[float] = None
    config: bool = False
    transport: str = ""
    aliases: Tuple[Tuple[str, str], ...] = ()
    allowed: str = ""
    read_by: str = ""
    check: Optional[Callable[[Any, str], Any]] = dataclasses.field(default=None, compare=False)

    @property
    def config_attr(self) -> str:
        """``efa_ep_<name>``, the Megatron config attribute that wins, or ""."""
        return f"efa_ep_{self.name}" if self.config else ""

    @property
    def option(self) -> Optional[Option]:
        """The transport option this variable gives, or None."""
        return SCHEMAS[self.transport][self.name] if self.transport else None

    @property
    def transports(self) -> Tuple[str, ...]:
        """Transports that take this variable's option: its own, and every transport whose
        schema passes the very same option through (``hier`` passes the proxy's, but not
        ``hmem``; ``gda``'s ``timeout_s`` is another option)."""
        opt = self.option
        if opt is None:
            return ()
        return tuple(t for t, schema in SCHEMAS.items() if schema.get(self.name) is opt)

    def expected(self) -> str:
        """The allowed values in words: ``one of drop, error, grow``, ``an integer in [1, 64]``."""
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        if self.allowed:
            return self.allowed
        what = {int: "an integer", float: "a number", str: "a string"}[self.type]
        if self.min is not None and self.max is not None:
            return f"{what} in [{_num(self.min)}, {_num(self.max)}]"
        if self.min is not None:
            return f"{what} >= {_num(self.min)}"
        if self.max is not None:
            return f"{what} <= {_num(self.max)}"
        return what

    def hint(self) -> str:
        default = "" if self.default in (None, "") else f", default {self.default}"
        return f"{self.env}: {self.doc}; {self.expected()}{default}"

    def convert(self, value: Any, where: Optional[str] = None) -> Any:
        """``value`` (a string from the environment, or what a config attribute holds) as this
        setting's type, within its choices and bounds.

        Raises:
            ConfigError: one line, ``<where>=<value>: expected ...`` (``where`` defaults to the
                variable), the setting's doc as the hint.
        """
        where = where or self.env
        if self.check is not None:
            return self.check(value, where)
        if self.choices is not None:
            text = str(value).strip().lower()
            text = dict(self.aliases).get(text, text)
            if text not in self.choices:
                raise ConfigError(f"{where}={text!r}: expected {self.expected()}"
                                  f"{did_you_mean(text, self.choices)}", hint=self.hint())
            return text
        opt = Option(self.name, self.type, self.default, self.doc, min=self.min, max=self.max)
        try:
            return opt.convert(value, where)
        except ConfigError as e:
            # Name the variable itself (EFA_EP_X=abc), not "where: key=".
            raise ConfigError(str(e).replace(f"{where}: {self.name}=", f"{where}="),
                              hint=self.hint()) from None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _option_variable(env: str, transport: str, key: str) -> Variable:
    """A per-option variable: everything but the link comes from the transport's schema."""
    o = SCHEMAS[transport][key]
    return Variable(env, key, o.type, o.default, o.doc, o.choices, o.min, o.max, transport=transport)


def _transport_options(value: Any, where: str) -> Any:
    # Parsed here, checked against the schema of the transport that runs (DispatcherSettings).
    return parse_options(value, where) if isinstance(value, str) else value


#: Every ``EFA_EP_*`` variable, declared once. Dispatcher settings first, then the per-option
#: variables, then those read elsewhere (declared so that the table and the unknown-variable
#: check know them).
VARIABLES: Tuple[Variable, ...] = (
    Variable("EFA_EP_TRANSPORT", "transport", str, DEFAULT_TRANSPORT,
             "the transport: auto = hier when the EP group spans hosts, else gda where usable, "
             "else torch", choices=TRANSPORT_NAMES, config=True, check=check_transport_name),
    Variable("EFA_EP_MAX_TOKENS_PER_RANK", "max_tokens_per_rank", int, DEFAULT_MAX_TOKENS_PER_RANK,
             "T_MAX, the most tokens a rank passes to one dispatch; sizes the gda/proxy/hier "
             "windows", min=1, max=MAX_MAX_TOKENS_PER_RANK, config=True,
             check=check_max_tokens_per_rank),
    Variable("EFA_EP_TRANSPORT_OPTIONS", "transport_options", str, "",
             "options of the transport that runs, e.g. num_channels=4,provider=tcp (with auto: "
             "options of gda or hier)", allowed="key=value,...", config=True,
             check=_transport_options),
    Variable("EFA_EP_CAPACITY_OVERFLOW", "capacity_overflow", str, "drop",
             "a call that does not fit: drop or error raise on a dispatch over T_MAX (they "
             "differ for an over-capacity pair in drop-and-pad mode); grow enlarges the windows "
             "and replays the dispatch", choices=("drop", "error", "grow"), config=True),
    Variable("EFA_EP_GROW_MAX_TOKENS_PER_RANK", "grow_max_tokens_per_rank", int,
             MAX_MAX_TOKENS_PER_RANK, "the most tokens per rank grow sizes windows for; the "
             "smallest of the EP group counts", min=1, max=MAX_MAX_TOKENS_PER_RANK, config=True),
    Variable("EFA_EP_FALLBACK", "fallback", str, "none",
             "alltoall: when the efa transport cannot be created or fails a self-test on some "
             "rank, every EP rank builds Megatron's alltoall dispatcher instead (one log line "
             "says why); none: the transport's error is raised", choices=("none", "alltoall"),
             config=True, aliases=(("", "none"), ("off", "none"), ("0", "none"))),
    Variable("EFA_EP_REPLACE_DISPATCHER", "replace_dispatcher", str, None,
             "a Megatron dispatcher type (alltoall) whose layers get the efa dispatcher too, for "
             "stacks that validate the type string", allowed="a dispatcher type"),
    Variable("EFA_EP_CALIBRATION", "calibration", str, None,
             "an efa-ep-plan calibrate file; auto then takes hier's num_channels from the "
             "planner when none is given", allowed="a path"),
    _option_variable("EFA_EP_PROXY_PROVIDER", "proxy", "provider"),
    _option_variable("EFA_EP_PROXY_CHANNELS", "proxy", "num_channels"),
    _option_variable("EFA_EP_PROXY_TIMEOUT_S", "proxy", "timeout_s"),
    _option_variable("EFA_EP_PROXY_CHUNK_BYTES", "proxy", "chunk_bytes"),
    _option_variable("EFA_EP_PROXY_HMEM", "proxy", "hmem"),
    _option_variable("EFA_EP_PROXY_PRODUCER", "proxy", "producer"),
    _option_variable("EFA_EP_PROXY_SPIN_US", "proxy", "spin_us"),
    _option_variable("EFA_EP_PROXY_CPU_BASE", "proxy", "cpu_base"),
    _option_variable("EFA_EP_PROXY_INJECT", "proxy", "inject_reorder"),
    _option_variable("EFA_EP_NODE_SIZE", "hier", "node_size"),
    Variable("EFA_EP_PROXY_SO", "proxy_so", str, None,
             "a prebuilt native proxy library to load instead of building one", allowed="a path",
             read_by=NATIVE_BUILD),
    Variable("EFA_EP_CACHE_DIR", "cache_dir", str, "~/.cache/efa_ep",
             "where the native proxy library is built", allowed="a path", read_by=NATIVE_BUILD),
    Variable("EFA_EP_FI_INCLUDE", "fi_include", str, None,
             "libfabric headers for the native build (default /opt/amazon/efa/include where it "
             "exists)", allowed="a path", read_by=NATIVE_BUILD),
    Variable("EFA_EP_FI_LIB", "fi_lib", str, None,
             "libfabric library folder for the native build (default /opt/amazon/efa/lib where "
             "it exists); set with EFA_EP_FI_INCLUDE", allowed="a path", read_by=NATIVE_BUILD),
    Variable("EFA_EP_PROXY_TAMPER", "proxy_tamper", str, None,
             "test only: one rank of the proxy corrupts what it sends, in the named way",
             allowed="a tamper kind", read_by="kernels/proxy/options.py"),
    Variable("EFA_EP_REQUIRE_TRANSPORTS", "require_transports", str, "torch",
             "tests only: transports whose tests must run (fail instead of skip)",
             allowed="names, comma-separated", read_by="tests/test_required_transports.py"),
    Variable("EFA_EP_RELIABILITY_FULL", "reliability_full", str, None,
             "tests only: 1 runs the full reliability sets (more rounds, EP sizes, tamper kinds)",
             allowed="1", read_by="tests/kernels/test_*_reliability.py"),
    Variable("EFA_EP_RELIABILITY_REPORT", "reliability_report", str, None,
             "tests only: a file the reliability sets append their figures to (JSON lines)",
             allowed="a path", read_by="tests/kernels/test_*_reliability.py"),
    Variable("EFA_EP_STRESS_ROUNDS", "stress_rounds", int, 60, "tests only: rounds of the gda "
             "stress test", allowed="an integer", read_by="tests/kernels/test_gda_stress_gpu.py"),
    Variable("EFA_EP_TEST_HMEM_PROVIDER", "test_hmem_provider", str, "shm", "tests only: the "
             "provider of the proxy's FI_HMEM tests (efa on AWS)", allowed="a provider",
             read_by="tests/kernels/test_proxy.py"),
    Variable("EFA_EP_TEST_DEVICE", "test_device", str, "cpu", "tests only: the device of the "
             "proxy tests' ranks (the GPU tests set cuda)", allowed="a device",
             read_by="tests/kernels/test_proxy.py"),
)
VARIABLE: Dict[str, Variable] = {v.env: v for v in VARIABLES}

# Kept for importers of the earlier names.
ENV_TRANSPORT = "EFA_EP_TRANSPORT"
ENV_MAX_TOKENS = "EFA_EP_MAX_TOKENS_PER_RANK"
ENV_OPTIONS = "EFA_EP_TRANSPORT_OPTIONS"
ENV_CAPACITY_OVERFLOW = "EFA_EP_CAPACITY_OVERFLOW"
ENV_GROW_MAX_TOKENS = "EFA_EP_GROW_MAX_TOKENS_PER_RANK"
ENV_FALLBACK = "EFA_EP_FALLBACK"
ENV_REPLACE_DISPATCHER = "EFA_EP_REPLACE_DISPATCHER"
ENV_CALIBRATION = "EFA_EP_CALIBRATION"
CAPACITY_OVERFLOW_POLICIES = VARIABLE[ENV_CAPACITY_OVERFLOW].choices
FALLBACK_DISPATCHERS = tuple(c for c in VARIABLE[ENV_FALLBACK].choices if c != "none")
_NO_FALLBACK = ("none",) + tuple(a for a, v in VARIABLE[ENV_FALLBACK].aliases if v == "none")


# ----------------------------------------------------------------------------------------------
# The environment reader
# ----------------------------------------------------------------------------------------------
def raw(env: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The value of the declared variable ``env`` in ``environ`` (default ``os.environ``),
    stripped, or None when unset or blank. Not converted: :func:`read` converts.

    Raises:
        KeyError: ``env`` is not declared in :data:`VARIABLES` (declare it first).
    """
    if env not in VARIABLE:
        raise KeyError(f"{env} is not declared in efa_ep.dispatcher.settings.VARIABLES"
                       f"{did_you_mean(env, VARIABLE)}")
    value = (os.environ if environ is None else environ).get(env)
    value = value.strip() if value else ""
    return value or None


def read(env: str, config=None, environ: Optional[Mapping[str, str]] = None,
         names: Optional[Mapping[str, str]] = None) -> Any:
    """The value of setting ``env``: ``config.efa_ep_<name>`` where the setting has one and it
    is set (not None, not blank), else the variable in ``environ`` (default ``os.environ``),
    else the declared default; converted and checked.

    Args:
        names: optional ``{variable: what the user set}`` for messages (a recipe key).

    Raises:
        ConfigError: one line naming the attribute or variable and the value.
    """
    v = VARIABLE[env]
    if config is not None and v.config:
        value = getattr(config, v.config_attr, None)
        if value is not None and not (isinstance(value, str) and not value.strip()):
            return v.convert(value, f"config.{v.config_attr}")
    text = raw(env, environ)
    if text is None:
        return v.convert(v.default) if v.default is not None else None
    return v.convert(text, dict(names or {}).get(env, env))


def unknown_variables(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """``EFA_EP_*`` variables set in ``environ`` that :data:`VARIABLES` does not declare."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith(PREFIX) and k not in VARIABLE)


def variables_set(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``{variable: value}`` of the declared variables set in ``environ`` (for records)."""
    env = os.environ if environ is None else environ
    return {v.env: env[v.env] for v in VARIABLES if v.env in env}


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
    """Every per-option environment variable, sorted."""
    return tuple(sorted(v.env for v in VARIABLES if v.transport))


def _read_option_variables(env: Mapping[str, str]) -> tuple:
    """``(variable, value)`` of the per-option variables set (non-empty) in ``env``, sorted."""
    return tuple((name, value) for name in option_variables()
                 for value in [raw(name, env)] if value is not None)


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
    for v in VARIABLES:
        if v.env in given and transport in v.transports:
            out[v.name] = SCHEMAS[transport][v.name].convert(given[v.env], names.get(v.env, v.env))
    return out


# ----------------------------------------------------------------------------------------------
# Derived text: the tools' help and the README / docs table
# ----------------------------------------------------------------------------------------------
def _default_text(v: Variable) -> str:
    if v.default is None:
        return "automatic" if v.transport else "-"
    return "-" if v.default == "" else f"`{v.default}`"


def _set_by(v: Variable) -> str:
    if v.transport:
        return f"option `{v.name}` of " + ", ".join(f"`{t}`" for t in v.transports)
    if v.read_by:
        return f"read by `{v.read_by}`"
    return f"`config.{v.config_attr}` wins" if v.config else "-"


def markdown_table() -> str:
    """The settings table of README.md and docs/cluster.md, from :data:`VARIABLES` (what the
    marked regions there must equal; ``tests/test_settings_table.py`` checks)."""
    rows = ["| variable | values | default | also | what |", "| --- | --- | --- | --- | --- |"]
    for v in VARIABLES:
        doc = v.doc.replace("|", "\\|")
        values = v.expected().replace("|", "\\|")
        rows.append(f"| `{v.env}` | {values} | {_default_text(v)} | {_set_by(v)} | {doc} |")
    return "\n".join(rows) + "\n"


def help_lines() -> List[str]:
    """``  EFA_EP_X: <values> (default d)``, one line per variable the ranks read, for the
    tools' ``--help`` (the meanings are in :func:`markdown_table`)."""
    out = []
    for v in VARIABLES:
        if not v.read_by:
            default = "" if v.default in (None, "") else f" (default {v.default})"
            out.append(f"  {v.env}: {v.expected()}{default}")
    return out


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
