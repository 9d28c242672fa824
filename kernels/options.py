"""One option schema per transport: every knob's key, type, allowed values and default.

The schema is checked where settings enter, before any rank starts: the ``efa-ep-grpo``
launcher, :func:`efa_ep.dispatcher.configure`, the config attributes and the ``EFA_EP_*``
environment variables (:mod:`efa_ep.dispatcher.settings`). A problem raises :class:`ConfigError`:
one line naming where the value came from (``EFA_EP_TRANSPORT_OPTIONS``, ``configure()``, a
recipe key), the key and the value, plus a separate hint. Unknown keys are refused with the
closest known key ("did you mean"), because a misspelled knob that is silently ignored looks
like a knob that does nothing.

    >>> validate_options("proxy", {"num_channels": "4"}, where="EFA_EP_TRANSPORT_OPTIONS")
    {'num_channels': 4}

Knows nothing of Megatron; transports may import it (``SCHEMAS[name][key].default``).
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from .core.errors import ConfigError

TRANSPORT_NAMES = ("auto", "torch", "gda", "proxy", "hier")
DEFAULT_TRANSPORT = "auto"
DEFAULT_MAX_TOKENS_PER_RANK = 16384
# Upper bound that still leaves the fixed windows addressable (proxy descriptor offsets are 36
# bits); a typo with extra zeros fails here in the launcher rather than as an allocation failure.
MAX_MAX_TOKENS_PER_RANK = 1 << 24


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, or ``""`` when none is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclasses.dataclass(frozen=True)
class Option:
    """One transport knob.

    Attributes:
        key: the name in ``key=value`` / ``configure(key=...)``.
        type: ``int``, ``float`` or ``str`` (the value is converted to it).
        default: what the transport uses when the key is absent (None: computed, see doc).
        doc: one line for humans.
        choices: allowed values (after conversion), or None.
        min, max: inclusive bounds for numbers, or None.

    Transports read no option from the environment. The ``EFA_EP_*`` variable that gives an
    option to the Megatron dispatcher, if any, is declared with the other variables in
    :data:`efa_ep.kernels.core.variables.VARIABLES`, which links it to the option here.
    """

    key: str
    type: type
    default: Any
    doc: str
    choices: Optional[Tuple[Any, ...]] = None
    min: Optional[float] = None
    max: Optional[float] = None

    def describe(self) -> str:
        allowed = (" | ".join(map(str, self.choices)) if self.choices is not None
                   else self.type.__name__)
        default = "automatic" if self.default is None else self.default
        return f"{self.key}={allowed} (default {default})"

    def convert(self, value: Any, where: str) -> Any:
        """``value`` as ``self.type`` within bounds/choices, or ConfigError naming ``where``."""
        raw = value
        try:
            if self.type is int:
                if isinstance(value, bool):
                    value = int(value)
                elif isinstance(value, float):
                    if not value.is_integer():
                        raise ValueError
                    value = int(value)
                else:
                    value = int(str(value).strip())
            elif self.type is float:
                if isinstance(value, bool):
                    raise ValueError
                value = float(str(value).strip()) if not isinstance(value, (int, float)) else float(value)
            else:
                value = str(value).strip()
        except ValueError:
            raise ConfigError(f"{where}: {self.key}={raw!r} is not {_a(self.type)}",
                              hint=f"{self.key}: {self.doc}; expected {self.describe()}") from None
        if self.choices is not None and value not in self.choices:
            raise ConfigError(
                f"{where}: {self.key}={raw!r} is not one of {', '.join(map(str, self.choices))}"
                f"{did_you_mean(value, map(str, self.choices))}",
                hint=f"{self.key}: {self.doc}")
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            bounds = (f">= {self.min}" if self.max is None else
                      f"<= {self.max}" if self.min is None else f"in [{self.min}, {self.max}]")
            raise ConfigError(f"{where}: {self.key}={raw!r} must be {bounds}",
                              hint=f"{self.key}: {self.doc}")
        return value


def _a(t: type) -> str:
    return {int: "an integer", float: "a number", str: "a string"}[t]


def _schema(*options: Option) -> Dict[str, Option]:
    return {o.key: o for o in options}


# The transports' own docstrings explain each knob in depth; these lines are what a user sees
# in an error. Keep them in step with kernels/proxy/ and kernels/gda/
SCHEMAS: Dict[str, Dict[str, Option]] = {
    # torch's only deadline is the process group's timeout (init_process_group(timeout=...)).
    "torch": _schema(),
    "gda": _schema(
        Option("max_topk", int, 16, "most top-k slots a dispatch may carry", min=1, max=1024),
        Option("timeout_s", float, 60.0, "deadline of every device-side wait, seconds", min=1e-3),
        Option("num_programs", int, None, "grid of the store/gather kernels (default 4 x SMs)",
               min=1),
        Option("check_every_call", int, 0, "1 = sync after combine to raise deadline errors at once",
               choices=(0, 1)),
        Option("check_backward", int, 1, "1 = one sync at the end of each backward pass raises "
               "deferred errors", choices=(0, 1)),
        Option("launch_gate", str, "auto", "host board of the group's ranks: waiting kernels "
               "launch only after every source issued its stores (needed when ranks share a "
               "GPU), and bad input reaches every rank with its words (auto = on)",
               choices=("auto", "on", "off", "0", "1")),
        Option("fast_launch", int, 4, "4 = as 3, and a dispatch, combine or cached dispatch of "
               "a shape seen before in one C++ call (a torch extension built once per install; "
               "needs ninja, else 3); 3 = as "
               "2, and an op's two phases with the launch gate between them in one native call; "
               "2 = each op phase's kernels in one native call (where the driver allows, else 1); "
               "1 = each kernel through its compiled launcher; 0 = Triton's own launch path",
               choices=(0, 1, 2, 3, 4)),
        Option("layout_in_store", int, 1, "1 = a small batch's routing layout (decode sizes) is "
               "computed inside the dispatch's store kernel, one launch instead of two; 0 = its "
               "own launch first", choices=(0, 1)),
        Option("wait_in_reduce", int, 0, "1 = a combine's or cached dispatch's wait for its "
               "sources runs inside its reduce/gather kernel (one launch instead of two; that "
               "kernel's grid capped at SMs / ranks sharing the GPU); 0 = a one-program wait "
               "kernel first", choices=(0, 1)),
        Option("gather_early", int, 2, "1 = a repeated regular dispatch launches its gather "
               "right after its header kernel, before the host reads the counts (the kernel "
               "copies only counts that are clean and fit the outputs allocated ahead); 2 = "
               "the same, in the C++ dispatch as a kernel of the header's program (one launch "
               "less); 0 = after the count read", choices=(0, 1, 2)),
        Option("graph_launch", int, 1, "1 = each bound kernel program (an op phase's kernels) "
               "goes to the GPU as one CUDA graph launch, its nodes' arguments set per call (one "
               "host submission instead of one per kernel); 0 = kernel by kernel",
               choices=(0, 1)),
        Option("rows_in_window", str, "0", "1 = a regular dispatch exchanges its row counts "
               "first (a second op; the counts reach the host before the rows) and stores the "
               "rows compact, so the received rows are views of the window (no copy), valid "
               "until the transport's next call: faster for large batches, slower for small "
               "ones; 0 = copied out of the window into tensors of their own; auto = 1 for a "
               "dispatch whose previous dispatch was large on some rank (rows_in_window_bytes), "
               "else 0 (the Megatron dispatcher's default)", choices=("0", "1", "auto")),
        Option("rows_in_window_bytes", int, 32 << 20, "rows_in_window=auto: compact when the "
               "previous dispatch's largest input over the ranks, as rows to send (tokens x "
               "min(ranks, top-k)) x row bytes, reached this many bytes", min=1),
    ),
    "proxy": _schema(
        Option("provider", str, None, "libfabric provider (default efa where usable, else tcp)",
               choices=("efa", "tcp", "shm")),
        Option("num_channels", int, None, "proxy channels (threads + endpoints; default 4 on "
               "hosts with >= 8 CPUs, else 2)", min=1, max=64),
        Option("timeout_s", float, 60.0, "deadline of every wait, seconds", min=1e-3),
        Option("chunk_bytes", int, 256 << 10, "bytes per descriptor", min=16, max=(1 << 32) - 1),
        Option("hmem", str, "auto", "where the window lives: off = host, cuda = GPU memory with "
               "FI_HMEM", choices=("auto", "off", "cuda")),
        Option("producer", str, "auto", "who writes the descriptors", choices=("auto", "torch", "triton")),
        Option("max_topk", int, 8, "top-k the windows are sized for", min=1, max=1024),
        Option("max_row_bytes", int, None, "override of the per-row slot size", min=16),
        Option("ring_slots", int, 1024, "descriptor ring slots per channel", min=1),
        Option("max_inflight", int, 64, "writes in flight per channel", min=1),
        Option("spin_us", int, 200, "microseconds a proxy thread spins before napping", min=0),
        Option("cpu_base", int, -1, "pin channel c to CPU cpu_base + c (-1: no pinning)", min=-1),
        Option("inject_reorder", int, 0, "test-only fault injection (0 off)", min=0),
    ),
}
# hier composes a network stage (proxy by default: its knobs pass through) and a local stage.
SCHEMAS["hier"] = {
    **_schema(
        Option("node_size", int, None, "ranks per node (default: from host names)", min=1),
        Option("network", str, "proxy", "transport across nodes, one per rail",
               choices=("proxy", "torch")),
        Option("local", str, "auto", "transport inside a node (auto: gda on a GPU, else torch)",
               choices=("auto", "gda", "torch")),
        Option("aggregate", int, 1, "1 = a token crosses the network once per destination node "
               "(rail peer forwards over NVLink); 0 = once per destination rank, straight to it",
               choices=(0, 1)),
    ),
    **{k: v for k, v in SCHEMAS["proxy"].items() if k not in ("hmem",)},
}


def describe_transport(name: str) -> str:
    """``"proxy options: provider=efa | tcp | shm (default None), ..."`` for hints."""
    schema = SCHEMAS.get(name, {})
    if not schema:
        return f"{name} takes no options"
    return f"{name} options: " + ", ".join(o.describe() for o in schema.values())


def option_names(name: str) -> str:
    """``"proxy options: provider, num_channels, ..."``: the keys alone, short enough for a hint
    line (:func:`describe_transport` has types and defaults). hier names its own keys and the
    proxy's it passes through."""
    schema = SCHEMAS.get(name, {})
    if not schema:
        return f"{name} takes no options"
    if name == "hier":
        own = [k for k in schema if k not in SCHEMAS["proxy"]]
        left_out = [k for k in SCHEMAS["proxy"] if k not in schema]
        return (f"hier options: {', '.join(own)}, and the proxy's"
                + (f" except {', '.join(left_out)}" if left_out else ""))
    return f"{name} options: " + ", ".join(schema)


def check_transport_name(name: Any, where: str) -> str:
    """``name`` stripped and checked against :data:`TRANSPORT_NAMES`."""
    text = str(name).strip()
    if text not in TRANSPORT_NAMES:
        raise ConfigError(f"{where}={text!r} is not a transport{did_you_mean(text, TRANSPORT_NAMES)}",
                          hint=f"one of {', '.join(TRANSPORT_NAMES)} (auto: hier across hosts, "
                               f"else gda on a GPU, else torch)")
    return text


def check_max_tokens_per_rank(value: Any, where: str) -> int:
    """A positive integer bound on the tokens one rank passes to one dispatch."""
    opt = Option("max_tokens_per_rank", int, DEFAULT_MAX_TOKENS_PER_RANK,
                 "bound on tokens per rank per MoE call; sizes the gda/proxy windows",
                 min=1, max=MAX_MAX_TOKENS_PER_RANK)
    try:
        return opt.convert(value, where)
    except ConfigError as e:
        # Name the variable itself (EFA_EP_MAX_TOKENS_PER_RANK=abc), not "where: key=".
        msg = str(e).replace(f"{where}: max_tokens_per_rank=", f"{where}=")
        raise ConfigError(msg, hint=f"a positive integer, default {DEFAULT_MAX_TOKENS_PER_RANK}") from None


def parse_options_text(text: str, where: str) -> Dict[str, Any]:
    """``"a=1,b=x"`` -> ``{"a": "1", "b": "x"}`` (values stay strings; the schema converts)."""
    out: Dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        if "=" not in item:
            raise ConfigError(f"{where}: item {item!r} is not key=value",
                              hint="comma-separated key=value pairs, e.g. num_channels=4,provider=tcp")
        key, value = (s.strip() for s in item.split("=", 1))
        if not key:
            raise ConfigError(f"{where}: item {item!r} has no key",
                              hint="comma-separated key=value pairs, e.g. num_channels=4,provider=tcp")
        if key in out:
            raise ConfigError(f"{where}: key {key!r} given twice", hint="give each option once")
        out[key] = value
    return out


def validate_options(name: str, options: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """``options`` checked against transport ``name``'s schema, values converted.

    Args:
        name: a transport name (``torch``, ``gda``, ``proxy``); ``auto`` is checked against the
            transports it may pick (see :func:`validate_for_auto`).
        options: ``{key: value}``, values as parsed from text or given by code.
        where: what the user set (``EFA_EP_TRANSPORT_OPTIONS``, ``configure()``, a recipe key);
            it starts every message.

    Raises:
        ConfigError: unknown key (with the closest known key), or a value of the wrong type or
            out of range (naming key and value).
    """
    if name == "auto":
        return validate_for_auto(options, where)
    schema = SCHEMAS[name]
    out: Dict[str, Any] = {}
    for key, value in options.items():
        if key not in schema:
            if not schema:
                raise ConfigError(f"{where}: transport {name!r} takes no options (got {key!r})",
                                  hint=f"remove them, or pick the transport they belong to "
                                       f"({_owners(key)})")
            # The hint stays one short line: the suggested option's meaning, else the key names
            # (describe_transport's types and defaults of every key would run to 500 characters).
            elsewhere = _owners(key, exclude=name)
            close = difflib.get_close_matches(key, list(schema), n=1, cutoff=0.6)
            hint = (f"{close[0]}: {schema[close[0]].doc}" if close else
                    (f"{key!r} is an option of {elsewhere}; " if elsewhere != "none" else "")
                    + option_names(name))
            raise ConfigError(
                f"{where}: unknown option {key!r} for transport {name!r}{did_you_mean(key, schema)}",
                hint=hint)
        out[key] = schema[key].convert(value, where)
    return out


def validate_for_auto(options: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """Options with ``auto``: ``auto`` picks ``hier`` across hosts, ``gda`` on a GPU and
    ``torch`` elsewhere; torch takes none, so each key must belong to gda or hier (checked
    against the first that has it), and :func:`check_resolved` refuses options when ``auto``
    resolves to ``torch``."""
    out: Dict[str, Any] = {}
    candidates = [n for n in ("gda", "hier") if n in TRANSPORT_NAMES and n in SCHEMAS]
    for key, value in options.items():
        owner = next((n for n in candidates if key in SCHEMAS[n]), None)
        if owner is None:
            keys = sorted({k for n in candidates for k in SCHEMAS[n]})
            raise ConfigError(f"{where}: unknown option {key!r} for transport 'auto' (which picks "
                              f"{' or '.join(candidates + ['torch'])}){did_you_mean(key, keys)}",
                              hint="name the transport the options are for (EFA_EP_TRANSPORT=proxy, ...)")
        out[key] = SCHEMAS[owner][key].convert(value, where)
    return out


def check_resolved(requested: str, resolved: str, options: Mapping[str, Any], where: str) -> None:
    """Refuses options that the resolved transport would ignore (``auto`` -> ``torch``)."""
    if options and not SCHEMAS[resolved]:
        raise ConfigError(
            f"{where}: transport {requested!r} resolved to {resolved!r} on this machine, which "
            f"takes no options (got {', '.join(sorted(options))})",
            hint="name the transport the options belong to (EFA_EP_TRANSPORT=gda or proxy), "
                 "or drop the options")


def _owners(key: str, exclude: str = "") -> str:
    names = [n for n, s in SCHEMAS.items() if key in s and n != exclude]
    return ", ".join(names) if names else "none"


def unavailable_hint(name: str, where: str = "EFA_EP_TRANSPORT") -> str:
    """What to do when transport ``name`` cannot run here, in this machine's terms; ``where``
    is the setting to change (an environment variable or a recipe key)."""
    import torch

    if name == "gda" and not torch.cuda.is_available():
        return (f"this machine has no CUDA GPU: use {where}=torch (or auto, which picks torch "
                f"here); gda needs a GPU with triton>=3.2 (pip install 'efa-ep[gpu]')")
    if name == "proxy":
        return (f"install libfabric headers and a C compiler (apt-get install libfabric-dev gcc; "
                f"on AWS the EFA installer), or use {where}=torch")
    return f"use {where}=auto to pick what runs here"


__all__ = ["ConfigError", "Option", "SCHEMAS", "TRANSPORT_NAMES", "validate_options",
           "check_transport_name", "check_max_tokens_per_rank", "parse_options_text",
           "check_resolved", "describe_transport", "option_names", "unavailable_hint", "did_you_mean"]
