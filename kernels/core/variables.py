"""Every ``EFA_EP_*`` environment variable, declared once in :data:`VARIABLES` (name, variable,
type, default, allowed values, doc), and what is derived from that table: the reader
(:func:`raw` and :func:`read`, the only code of the package that reads ``EFA_EP_*`` from the
environment: the dispatcher's settings, the tools, the native build and the proxy's tamper fault
read through them; ``tests/test_no_environ_reads.py`` checks), the validation
(:meth:`Variable.convert`: one :class:`ConfigError` line naming the variable and the value), the
tools' help text (:func:`help_lines`) and the settings table of README.md and docs/cluster.md
(:func:`markdown_table`; refresh them with ``python3 -m efa_ep.tools.config --settings-table
--write``). A variable that gives a transport option (``EFA_EP_PROXY_CHANNELS`` ->
``num_channels``) takes its type, default, bounds and doc from that transport's option schema
(:mod:`efa_ep.kernels.options`); the table holds only the link. It lives in ``kernels/`` so
that the transports read through it too; :mod:`efa_ep.dispatcher.settings` builds the
dispatcher's settings from it and re-exports it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from efa_ep.kernels.options import (
    DEFAULT_MAX_TOKENS_PER_RANK, DEFAULT_TRANSPORT, MAX_MAX_TOKENS_PER_RANK, SCHEMAS,
    TRANSPORT_NAMES, ConfigError, Option, check_max_tokens_per_rank, check_transport_name,
    did_you_mean, parse_options_text,
)

PREFIX = "EFA_EP_"
#: the native build, which reads its variables through :func:`raw` (``Variable.read_by``)
NATIVE_BUILD = "kernels/proxy/native_build.py"


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
        read_by: "" for a setting of the dispatcher (checked by ``check_environment``, listed
            in the tools' help); else the code that uses it, for the table: the native build
            and the proxy read theirs through :func:`raw`, the tests theirs directly.
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
#: variables, then those of the native build, the proxy's tamper fault and the tests (``read_by``
#: set; declared so that the reader, the table and the unknown-variable check know them).
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
    Variable("EFA_EP_PROXY_ONE_CALL", "proxy_one_call", str, "1",
             "benchmarks only: 0 runs every packed proxy op of CUDA rows in its Python steps, "
             "even for a case that ran before (the other arm of a comparison)",
             allowed="0 or 1", read_by="kernels/proxy/planned.py"),
    Variable("EFA_EP_PROXY_CPP", "proxy_cpp", str, "1",
             "benchmarks only: 0 runs a planned proxy dispatch or combine through the Python "
             "glue around its native calls instead of one C++ call (the other arm of a "
             "comparison)", allowed="0 or 1", read_by="kernels/proxy/cpp_op.py"),
    Variable("EFA_EP_PROXY_EARLY_READS", "proxy_early_reads", str, "1",
             "benchmarks only: 0 launches the kernel that reads a one-call proxy op's received "
             "rows after the round completed, instead of as the rows' chunks arrive (the other "
             "arm of a comparison)", allowed="0 or 1", read_by="kernels/proxy/planned.py"),
    Variable("EFA_EP_PROXY_GRAPH_LAUNCH", "proxy_graph_launch", str, "1",
             "benchmarks only: 0 launches the proxy's bound kernel programs kernel by kernel "
             "instead of as one CUDA graph launch each (the other arm of a comparison)",
             allowed="0 or 1", read_by="kernels/proxy/device_path.py"),
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
        raise KeyError(f"{env} is not declared in efa_ep.kernels.core.variables.VARIABLES"
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
