"""The benchmark's arms (what moves tokens: a transport with options, a raw collective, a
Megatron dispatcher) resolved from the config, and the config checks made before any rank
starts."""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .features import check_features
from .schema import TIMING_MODES


@dataclasses.dataclass(frozen=True)
class Arm:
    """A thing that moves tokens: a transport with options, an external library, a raw
    collective, or (layer view) a Megatron dispatcher. ``name`` is unique: ``torch``,
    ``proxy:k4``, ``nccl``, ``efa:gda``, ``alltoall``. ``collective`` is the process-group
    backend a raw ``all_to_all_single`` arm requires (``nccl``; ``gloo`` for CPU tests)."""

    name: str
    view: str                    # transport | layer
    transport: Optional[str]     # efa-ep transport name (None: raw collective / alltoall / external)
    options: tuple = ()
    external: Optional[str] = None
    collective: Optional[str] = None
    mode: str = "regular"        # gda: regular | fixed (dispatch_fixed) | graph (fixed, CUDA graph)

    @property
    def num_channels(self) -> Optional[int]:
        return dict(self.options).get("num_channels")


# External EP libraries: benchmarked only when importable (and an adapter exists).
EXTERNAL = {"deep_ep": "deep_ep", "uccl_ep": "uccl.ep", "nccl_ep": "nccl.ep"}


# arms.nccl_arm values: auto = run the nccl arm when backend=nccl, else list it as not run;
# require = refuse a run whose backend is not nccl; gloo = the same raw exchange on a gloo group
# (CPU tests), named a2a:gloo so that it is never mistaken for NCCL; off = no raw arm.
NCCL_ARM_MODES = ("auto", "require", "gloo", "off")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def nccl_arm_refusal(backend: str) -> str:
    """Why the nccl arm cannot run on a ``backend`` group, and what to set instead."""
    return (f"the nccl arm times NCCL's all_to_all_single and needs an NCCL process group; this "
            f"run's group is backend={backend}. Set backend=nccl device=cuda (one rank per GPU), "
            f"or arms.nccl_arm=gloo to time the same raw exchange over gloo (arm a2a:gloo)")


def resolve_arms(cfg: Dict[str, Any], available: Sequence[str]) -> Tuple[List[Arm], Dict[str, str]]:
    """Arms to run, and ``{name: reason}`` for arms that will not run here.

    ``transport_view`` (default true) gives the transport view's arms (each transport of
    ``arms.transports``, the raw collective arm, the external libraries); ``layer.enabled`` the
    layer view's: ``alltoall`` and ``efa:<t>`` for each transport of ``layer.transports`` (null:
    those of ``arms.transports``).

    Raises:
        ValueError: the transport view runs and the torch reference is not available;
            ``arms.nccl_arm`` is unknown, or asks for a raw arm the configured backend cannot
            run (``require`` without ``backend=nccl``, ``gloo`` without ``backend=gloo``).
    """
    arms: List[Arm] = []
    not_run: Dict[str, str] = {}
    per_opts = cfg["arms"].get("transport_options") or {}
    if transport_view(cfg):
        names = _transport_names(cfg["arms"].get("transports"), available, not_run, "")
        if "torch" not in names:
            raise ValueError("the torch transport must be available: it is the correctness reference")
        channels = cfg["arms"].get("proxy_channels") or []
        for t in names:
            base = tuple(sorted((per_opts.get(t) or {}).items()))
            if t == "proxy" and channels:
                for nc in channels:
                    opts = tuple(sorted({**dict(base), "num_channels": int(nc)}.items()))
                    arms.append(Arm(f"proxy:k{nc}", "transport", "proxy", opts))
            elif t == "hier":
                arms.extend(hier_arms(cfg, dict(base)))
            elif t == "gda":
                arms.extend(gda_arms(cfg, base))
            else:
                arms.append(Arm(t, "transport", t, base))
        raw = collective_arm(cfg)
        if isinstance(raw, Arm):
            arms.append(raw)
        elif raw:
            not_run["nccl"] = raw
        for name, module in EXTERNAL.items():
            if name not in (cfg["arms"].get("external") or []):
                continue
            not_run[name] = ("installed, but efa-ep has no adapter for it yet" if _importable(module)
                             else f"not installed (import {module} failed)")
    lay = cfg.get("layer") or {}
    if lay.get("enabled"):
        want = lay.get("transports")
        names = _transport_names(cfg["arms"].get("transports") if want is None else want,
                                 available, not_run, "efa:")
        arms.append(Arm("alltoall", "layer", None))
        for t in names:
            base = tuple(sorted((per_opts.get(t) or {}).items()))
            if t == "hier":
                arms.extend(Arm(f"efa:{h.name}", "layer", "hier", h.options)
                            for h in hier_arms(cfg, dict(base)))
            else:
                arms.append(Arm(f"efa:{t}", "layer", t, base))
    return arms, not_run


def transport_view(cfg: Dict[str, Any]) -> bool:
    """Whether the run has the transport view (``transport_view``, default true)."""
    return bool(cfg.get("transport_view", True))


def _transport_names(want, available: Sequence[str], not_run: Dict[str, str],
                     prefix: str) -> List[str]:
    """The transports of ``want`` (``"*"``/empty: every flat one available) that are available;
    the others go to ``not_run`` as ``<prefix><name>``."""
    # "*": the flat transports; hier composes them and needs a node layout: name it explicitly
    if not want or want == "*":
        return [t for t in available if t != "hier"]
    want = [want] if isinstance(want, str) else list(want)
    for t in want:
        if t not in available:
            not_run[f"{prefix}{t}"] = "transport not available here"
    return [t for t in want if t in available]


GDA_MODES = ("regular", "fixed", "graph")


def gda_arms(cfg: Dict[str, Any], base: tuple) -> List[Arm]:
    """One gda arm per ``arms.gda_modes`` entry: ``gda`` (regular dispatch: compact receive,
    one host sync), ``gda:fixed`` (``dispatch_fixed``: window layout, no host sync) and
    ``gda:graph`` (the fixed D+C captured once with ``GdaTransport.capture``, each sample one
    ``replay()``).

    Raises:
        ValueError: an unknown mode.
    """
    arms = []
    for mode in cfg["arms"].get("gda_modes") or ["regular"]:
        if mode not in GDA_MODES:
            raise ValueError(f"arms.gda_modes: {mode!r} is not one of {', '.join(GDA_MODES)}")
        arms.append(Arm("gda" if mode == "regular" else f"gda:{mode}", "transport", "gda", base,
                        mode=mode))
    return arms


def hier_arms(cfg: Dict[str, Any], base: Dict[str, Any]) -> List[Arm]:
    """``hier:agg1`` / ``hier:agg0`` arms (``arms.hier_aggregate``), each with ``node_size``
    (the emulated ranks per node; None = from host names) and ``base`` options.

    Raises:
        ValueError: an ``arms.hier_aggregate`` value or ``node_size`` the hier schema refuses.
    """
    from efa_ep.kernels.options import ConfigError, SCHEMAS

    node_size = cfg.get("node_size")
    arms = []
    for agg in cfg["arms"].get("hier_aggregate") or [1]:
        opts = dict(base)
        try:
            opts["aggregate"] = SCHEMAS["hier"]["aggregate"].convert(agg, "arms.hier_aggregate")
            if node_size is not None:
                opts["node_size"] = SCHEMAS["hier"]["node_size"].convert(node_size, "node_size")
        except ConfigError as e:
            raise ValueError(str(e)) from None
        arms.append(Arm(f"hier:agg{opts['aggregate']}", "transport", "hier",
                        tuple(sorted(opts.items()))))
    return arms


def collective_arm(cfg: Dict[str, Any]):
    """The raw ``all_to_all_single`` arm ``arms.nccl_arm`` asks for: an :class:`Arm`, a reason
    it does not run (str), or None (``off``)."""
    mode = cfg["arms"].get("nccl_arm", "auto")
    mode = "off" if mode in (False, None) else str(mode)
    if mode not in NCCL_ARM_MODES:
        raise ValueError(f"arms.nccl_arm={mode!r}: expected one of {', '.join(NCCL_ARM_MODES)}")
    backend = str(cfg["backend"]).lower()
    if mode == "off":
        return None
    if mode == "gloo":
        if backend != "gloo":
            raise ValueError(f"arms.nccl_arm=gloo requires backend=gloo, got backend={backend} "
                             f"(on an NCCL group use arms.nccl_arm=auto or require)")
        return Arm("a2a:gloo", "transport", None, collective="gloo")
    if backend == "nccl":
        return Arm("nccl", "transport", None, collective="nccl")
    if mode == "require":
        raise ValueError(f"arms.nccl_arm=require: {nccl_arm_refusal(backend)}")
    return nccl_arm_refusal(backend)


def _check_experts(where: str, shape: Dict[str, Any], ep: int) -> None:
    """``topk`` <= ``num_experts``, and the experts split evenly over the ``ep`` ranks."""
    experts, topk = int(shape["num_experts"]), int(shape["topk"])
    if topk > experts:
        raise ValueError(f"{where}.topk={topk} must be <= {where}.num_experts={experts}")
    if experts % ep:
        raise ValueError(f"{where}.num_experts={experts} must be a multiple of ep_size={ep} (experts "
                         f"split evenly over the ranks)")


def timing_modes(cfg: Dict[str, Any]) -> List[str]:
    """``timing`` as a list: ``single``, ``steady`` or both (each a cell of its own)."""
    t = cfg.get("timing", "single")
    modes = [t] if isinstance(t, str) else list(t or [])
    if not modes or any(m not in TIMING_MODES for m in modes):
        raise ValueError(f"timing={t!r}: expected single, steady or a list of them")
    if "steady" in modes and int(cfg.get("steady_iters", 0)) < 1:
        raise ValueError(f"timing=steady requires steady_iters >= 1, got {cfg.get('steady_iters')}")
    return modes


def validate_config(cfg: Dict[str, Any]) -> None:
    """Settings that cannot run, refused in the parent before any rank starts: every key's value
    (``efa_ep.tools.config.SETTINGS["bench"]``: ``starts`` >= 1, ``warmup`` >= 0, ...), then
    combinations (a run with no cell, top-k above the experts, backend vs device, ...).

    Raises:
        ValueError: one line naming the key, its value and what is expected
            (:class:`~efa_ep.kernels.options.ConfigError`, with a hint, for a single key).
    """
    from ..config import SETTINGS, check_settings

    check_settings(cfg, SETTINGS["bench"])
    gda_arms(cfg, ())  # arms.gda_modes, checked where gda is not available too
    ep = int(cfg["ep_size"])
    if transport_view(cfg):
        for key in ("profiles", "use_shapes", "routes"):
            if not cfg.get(key):
                raise ValueError(f"{key}={cfg.get(key)!r}: the transport view needs at least one "
                                 f"(or transport_view=false for the layer view alone)")
        for name in cfg["use_shapes"]:
            if name not in (cfg.get("shapes") or {}):
                raise ValueError(f"use_shapes: {name!r} is not a key of shapes "
                                 f"({', '.join(cfg.get('shapes') or {}) or 'none'})")
            _check_experts(f"shapes.{name}", cfg["shapes"][name], ep)
    if cfg.get("layer", {}).get("enabled"):
        lay = cfg["layer"]
        _check_experts("layer", lay, ep)
        if int(lay["tokens_per_rank"]) % int(lay["micro_batch"]):
            raise ValueError(f"layer.tokens_per_rank={lay['tokens_per_rank']} must be a multiple of "
                             f"layer.micro_batch={lay['micro_batch']} (sequences of equal length)")
    backend, device = str(cfg["backend"]).lower(), str(cfg["device"])
    if backend == "nccl" and not device.startswith("cuda"):
        raise ValueError(f"backend=nccl requires device=cuda (NCCL moves GPU memory only), "
                         f"got device={device}")
    if backend == "nccl" and device.startswith("cuda:") and int(cfg["ep_size"]) > 1:
        raise ValueError(f"backend=nccl requires one rank per GPU (device=cuda puts rank r on "
                         f"cuda:r % num_gpus); device={device} puts every rank on one GPU, which "
                         f"NCCL refuses (use backend=gloo for ranks sharing a GPU)")
    timing_modes(cfg)
    if cfg.get("layer", {}).get("enabled"):
        check_features(cfg)
        t_max = cfg["layer"].get("max_tokens_per_rank")
        tokens = int(cfg["layer"]["tokens_per_rank"])
        if t_max is not None and (not isinstance(t_max, int) or t_max < tokens):
            raise ValueError(f"layer.max_tokens_per_rank={t_max!r} must be null (the dispatcher's "
                             f"EFA_EP_MAX_TOKENS_PER_RANK) or an integer >= layer.tokens_per_rank="
                             f"{tokens}")
    if not transport_view(cfg) and not cfg.get("layer", {}).get("enabled"):
        raise ValueError("transport_view=false and layer.enabled=false: no view to run")
    ns = cfg.get("node_size")
    if ns is not None and (not isinstance(ns, int) or ns < 1 or int(cfg["ep_size"]) % ns):
        raise ValueError(f"node_size={ns!r} must be a positive integer dividing ep_size="
                         f"{cfg['ep_size']} (the emulated ranks per node)")
