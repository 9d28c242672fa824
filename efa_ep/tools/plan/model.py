"""The planner's cost model: bytes, times and memory of one MoE layer's token exchange.

Symbols (per EP rank unless said otherwise):

- ``P`` EP size, ``G`` GPUs per node, ``L`` = min(P, G) ranks of the EP group per node
  (the group is laid out node-contiguously, as Megatron does), ``P / L`` nodes per group;
- ``E`` experts, ``k`` top-k, ``q = E / P`` experts per rank, ``H`` hidden, ``b`` bytes per
  element, ``T`` tokens per rank per micro-batch; ``num_channels`` proxy channels (the printed
  tables and figure sources write it ``K=<num_channels>``, as the recorded results do);
- ``p_r = 1 - C(E - q, k) / C(E, k)``: the chance that a token has at least one of its k
  experts on a given rank (uniform routing, experts split evenly and contiguously). A token is
  sent once per destination rank (the ``efa`` dispatcher's dedup), so a rank sends
  ``T p_r`` rows to each peer: ``T (L - 1) p_r`` over NVLink and ``T (P - L) p_r`` over EFA.

One *op* is one dispatch or one combine (a combine returns the same rows). One MoE layer's
forward is one dispatch + one combine ("D+C"); its backward is a combine + a dispatch of the
same sizes, so a training step moves ``2 x`` the forward bytes per layer and micro-batch.

Time of one op on each path (microseconds; bytes / (GB/s x 1e3) = us):

- ``gda`` (group inside one node): ``fixed_gda + bytes_nvl / (nvlink x eff_gda)``;
- ``proxy`` with ``num_channels`` channels: ``fixed_proxy + max(issue(num_channels), wire)``
  where ``issue(num_channels) = (msgs x post + bytes_ch / channel_rate) / num_channels**alpha``
  (the CPU proxy's per-op post path: the "issue-bound" regime that the DeepEP-on-EFA study,
  :mod:`.presets`, measured) and ``wire = bytes_efa / efa_per_gpu``;
  ``msgs`` = descriptors = destinations x ceil(bytes per destination / chunk);
  ``bytes_ch`` = EFA bytes, plus NVLink-peer bytes when same-node rows go through the channels
  (``proxy_same_node="channels"``, what today's ``proxy`` transport does);
- Megatron ``alltoall`` on NCCL: ``fixed_nccl + max(nvl / (nvlink x eff_nccl), efa /
  (efa_per_gpu x eff_nccl_efa))`` with its bytes per (token, expert) pair (no dedup);
- Megatron ``allgather``: every rank receives every other rank's T rows (and reduce-scatters
  them back), same link terms as ``alltoall``;
- ``hier`` (the transport ``auto`` picks across nodes), two designs, network stage then local
  stage: ``fixed_hier + max(issue(num_channels), wire) + NVLink bytes / (nvlink x eff_gda)``
  with the network terms of its own traffic (:func:`hier_net`); ``fixed_hier`` is measured as a
  whole on one host with emulated nodes (both stages, the status exchange, the permutation), or
  ``fixed_proxy + fixed_gda`` where no hier record was given:

  * ``hier:agg1`` (``aggregate=1``): a token crosses EFA once per destination *node*, to the
    rail peer (same local index), which forwards it over NVLink: ``N - 1`` EFA peers,
    ``T (N - 1) p_n`` EFA rows with ``p_n = 1 - C(E - E/N, k) / C(E, k)`` (N = P / L nodes),
    ``N T (L - 1) p_r`` NVLink rows (the rail brought N sources' tokens);
  * ``hier:agg0`` (``aggregate=0``): once per destination *rank*, straight to it: ``P - L``
    EFA peers, ``T (P - L) p_r`` EFA rows, ``T (L - 1) p_r`` NVLink rows.

  EFA messages per op (peers with >= 1 row) = peers x (1 - (1 - p)^T), what the transports
  count (``last_op_counts``) and ``efa-ep-bench`` reports; ``efa-ep-plan counts`` compares the
  two (:mod:`efa_ep.tools.plan.counts`).

Every figure is a :class:`Fig` carrying value, unit, provenance tag and source.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

from .figures import DTYPE_BYTES, TAGS, Fig, Inputs, derived  # noqa: F401 (public names)

PATHS = ("gda", "proxy", "alltoall", "allgather", "hier:agg1", "hier:agg0")
HIER_DESIGNS = {"hier:agg1": 1, "hier:agg0": 0}


def p_rank(num_experts: int, topk: int, ep: int) -> float:
    """Chance that a token routed uniformly to ``topk`` of ``num_experts`` experts has at least
    one expert on a given rank holding ``num_experts / ep`` of them: 1 - C(E-q, k) / C(E, k)."""
    q = num_experts // ep
    if num_experts - q < topk:
        return 1.0
    return 1.0 - math.comb(num_experts - q, topk) / math.comb(num_experts, topk)


# ----------------------------------------------------------------------------------------------
# Bytes
# ----------------------------------------------------------------------------------------------
def traffic(inp: Inputs) -> Dict[str, Fig]:
    """Rows and bytes one rank sends in one op (dispatch; a combine returns the same), per
    layer forward (D+C), per layer training (fwd+bwd) and per step; for the ``efa`` dispatcher
    (dedup per destination rank) and for Megatron's alltoall (one row per token-expert pair)
    and allgather (every token to every rank)."""
    P, L, T, k, rb = inp.ep, inp.ranks_per_node, inp.tokens_per_rank, inp.topk, inp.row_bytes
    pr = p_rank(inp.num_experts, k, P)
    why = "uniform routing, experts split evenly"
    out: Dict[str, Fig] = {
        "p_rank": derived(pr, "fraction", f"1 - C(E-E/P,k)/C(E,k), E={inp.num_experts} k={k} P={P}; {why}"),
        "rows_per_token": derived(P * pr, "rows", "P x p_rank (destination ranks per token, self included)"),
        "efa_rows_nvlink_op": derived(T * (L - 1) * pr, "rows", f"T x (L-1) x p_rank, L={L}"),
        "efa_rows_efa_op": derived(T * (P - L) * pr, "rows", f"T x (P-L) x p_rank, P-L={P - L}"),
    }
    out["efa_bytes_nvlink_op"] = derived(out["efa_rows_nvlink_op"].value * rb, "B", f"rows x H x b = rows x {rb}")
    out["efa_bytes_efa_op"] = derived(out["efa_rows_efa_op"].value * rb, "B", f"rows x H x b = rows x {rb}")
    out["bytes_per_dest_op"] = derived(T * pr * rb, "B", "T x p_rank x H x b (one peer)")
    out["a2a_bytes_nvlink_op"] = derived(T * k * (L - 1) / P * rb, "B", "T x k x (L-1)/P x H x b (Megatron alltoall: no dedup)")
    out["a2a_bytes_efa_op"] = derived(T * k * (P - L) / P * rb, "B", "T x k x (P-L)/P x H x b")
    out["ag_bytes_nvlink_op"] = derived(T * (L - 1) * rb, "B", "T x (L-1) x H x b (allgather: every token to every rank)")
    out["ag_bytes_efa_op"] = derived(T * (P - L) * rb, "B", "T x (P-L) x H x b")
    per_layer = 2 * (out["efa_bytes_nvlink_op"].value + out["efa_bytes_efa_op"].value)
    out["efa_bytes_layer_fwd"] = derived(per_layer, "B", "2 ops (D+C) x (NVLink + EFA bytes)")
    for link in ("nvlink", "efa"):
        op = out[f"efa_bytes_{link}_op"].value
        out[f"efa_bytes_{link}_layer_train"] = derived(4 * op, "B", "4 ops per layer: D+C forward, C+D backward")
        out[f"efa_bytes_{link}_step"] = derived(4 * op * inp.moe_layers * inp.micro_batches_per_step, "B",
                                                f"layer_train x {inp.moe_layers} MoE layers x "
                                                f"{inp.micro_batches_per_step} micro-batches")
    return out


# ----------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PathResult:
    """One path's prediction. ``d_us``/``c_us``: one dispatch / combine; ``dc_us``: D+C per
    layer forward (one micro-batch); ``bound``: what dominates (``launch``, ``nvlink``,
    ``issue``, ``wire``, ``latency``); ``terms``: the parts of one op in us."""

    name: str
    applicable: bool
    why_not: str = ""
    num_channels: int = 0
    d_us: Optional[Fig] = None
    c_us: Optional[Fig] = None
    dc_us: Optional[Fig] = None
    bound: str = ""
    terms: Dict[str, float] = dataclasses.field(default_factory=dict)
    extra: Dict[str, Fig] = dataclasses.field(default_factory=dict)
    by_channels: Dict[int, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "applicable": self.applicable, "why_not": self.why_not,
                "num_channels": self.num_channels, "bound": self.bound, "terms_us": self.terms,
                "d_us": self.d_us.to_dict() if self.d_us else None,
                "c_us": self.c_us.to_dict() if self.c_us else None,
                "dc_us": self.dc_us.to_dict() if self.dc_us else None,
                "by_channels_dc_us": {str(k): v for k, v in self.by_channels.items()},
                "extra": {k: v.to_dict() for k, v in self.extra.items()}}


def _cal(cal: Dict[str, Fig], name: str) -> float:
    if name not in cal:
        raise KeyError(f"calibration has no parameter {name!r} (known: {sorted(cal)}); rebuild it "
                       f"with `efa-ep-plan calibrate`")
    return float(cal[name].value)


def _us(nbytes: float, gbps: float) -> float:
    """Microseconds to move ``nbytes`` at ``gbps`` GB/s (1 GB = 1e9 B)."""
    return nbytes / (gbps * 1e3) if gbps > 0 else math.inf


def _op(name: str, t: float, src: str) -> Fig:
    return derived(t, "us", src)


def path_gda(inp: Inputs, tr: Dict[str, Fig], cal: Dict[str, Fig]) -> PathResult:
    if inp.group_nodes > 1:
        return PathResult("gda", False, f"the EP group spans {inp.group_nodes} nodes; gda stores reach "
                                        f"NVLink peers only")
    fixed = _cal(cal, "gda_fixed_us")
    eff = _cal(cal, "gda_link_eff")
    link = _us(tr["efa_bytes_nvlink_op"].value, inp.nvlink_gbps * eff)
    t = fixed + link
    src = (f"gda_fixed_us {fixed:.1f} + NVLink bytes / ({inp.nvlink_gbps:g} GB/s x gda_link_eff {eff:.2f})")
    r = PathResult("gda", True, d_us=_op("d", t, src), c_us=_op("c", t, src),
                   dc_us=derived(2 * t, "us", "D + C"), bound="launch" if fixed >= link else "nvlink",
                   terms={"fixed": fixed, "nvlink": link})
    return r


def proxy_op_us(inp: Inputs, tr: Dict[str, Fig], cal: Dict[str, Fig],
                num_channels: int) -> Tuple[float, Dict[str, float]]:
    """One proxy op with ``num_channels`` channels: (us, terms). See the module docstring."""
    fixed = _cal(cal, "proxy_fixed_us")
    post = _cal(cal, "proxy_post_us")
    alpha = _cal(cal, "proxy_channel_alpha")
    rate = _cal(cal, "proxy_channel_gbps")
    P, L = inp.ep, inp.ranks_per_node
    through_channels = inp.proxy_same_node == "channels"
    dests = (P - 1) if through_channels else (P - L)
    bytes_ch = tr["efa_bytes_efa_op"].value + (tr["efa_bytes_nvlink_op"].value if through_channels else 0.0)
    msgs = dests * max(1, math.ceil(tr["bytes_per_dest_op"].value / inp.chunk_bytes)) if dests else 0
    nc_eff = num_channels ** alpha
    issue = (msgs * post + _us(bytes_ch, rate)) / nc_eff if bytes_ch else 0.0
    wire = _us(tr["efa_bytes_efa_op"].value, inp.efa_gbps_per_node / inp.gpus_per_node)
    nvl = 0.0 if through_channels else _us(tr["efa_bytes_nvlink_op"].value, inp.nvlink_gbps * _cal(cal, "gda_link_eff"))
    t = fixed + max(issue, wire, nvl)
    return t, {"fixed": fixed, "issue": issue, "wire": wire, "nvlink": nvl, "msgs": float(msgs),
               "post": msgs * post / nc_eff, "channel_copy": _us(bytes_ch, rate) / nc_eff if bytes_ch else 0.0}


def path_proxy(inp: Inputs, tr: Dict[str, Fig], cal: Dict[str, Fig]) -> PathResult:
    if inp.ep == 1:
        return PathResult("proxy", False, "EP size 1: nothing to send")
    by_nc = {}
    terms_nc = {}
    for nc in range(1, inp.max_channels + 1):
        t, terms = proxy_op_us(inp, tr, cal, nc)
        by_nc[nc] = 2 * t
        terms_nc[nc] = terms
    best = min(by_nc.values())
    # Fewest channels within 2% of the best: every channel is a spinning CPU thread.
    nc = min(c for c, v in by_nc.items() if v <= best * 1.02)
    terms = terms_nc[nc]
    t = by_nc[nc] / 2
    bound = "issue" if terms["fixed"] + terms["issue"] >= max(terms["wire"], terms["nvlink"]) else (
        "wire" if terms["wire"] >= terms["nvlink"] else "nvlink")
    src = (f"proxy_fixed_us + max(issue(K={nc}) = (msgs x proxy_post_us + channel bytes / "
           f"proxy_channel_gbps) / K^proxy_channel_alpha, EFA bytes / (EFA per GPU "
           f"{inp.efa_gbps_per_node / inp.gpus_per_node:g} GB/s))")
    nic = tr["efa_bytes_efa_op"].value / (t * 1e3) / (inp.efa_gbps_per_node / inp.gpus_per_node) if t else 0.0
    so = tr["efa_bytes_efa_op"].value / (t * 1e3) if t else 0.0
    r = PathResult("proxy", True, num_channels=nc, d_us=_op("d", t, src), c_us=_op("c", t, src),
                   dc_us=derived(2 * t, "us", "D + C"), bound=bound, terms=terms, by_channels=by_nc)
    r.extra["nic_utilisation"] = derived(nic, "fraction", "EFA bytes per op / op time / EFA per GPU")
    r.extra["so_gbps"] = derived(so, "GB/s", "EFA (scale-out) bytes per op / op time, as the DeepEP-on-EFA "
                                               "study's SO figure")
    return r


def hier_net(ep: int, node_size: int, tokens: float, num_experts: int, topk: int, row_bytes: float,
             aggregate: int, chunk_bytes: int = 262144) -> Dict[str, float]:
    """One rank's traffic in one hier op (dispatch; a combine returns the same rows), uniform
    routing, for ``aggregate`` 1 (once per node via the rail peer) or 0 (once per rank).

    Returns (expected values, floats): ``peers`` network peers a rank may send to,
    ``messages`` peers that get >= 1 row (peers x (1 - (1 - p)^T)), ``rows`` and ``bytes``
    over the network (rows x ``row_bytes``), ``bytes_per_peer``, ``descriptors``
    (peers x ceil(bytes per peer / chunk), the proxy model's post count), ``nvlink_rows`` and
    ``nvlink_bytes`` the local stage moves. A flat design (the ``proxy`` transport) is
    ``aggregate=0`` with ``node_size=1`` (every peer is a network peer).
    """
    P, L = int(ep), int(node_size)
    n = max(1, P // L)
    pr = p_rank(num_experts, topk, P)
    if aggregate:
        peers, p = n - 1, p_rank(num_experts, topk, n) if n > 1 else 1.0
        nvl_rows = n * tokens * (L - 1) * pr
    else:
        peers, p = P - L, pr
        nvl_rows = tokens * (L - 1) * pr
    per_peer = tokens * p * row_bytes
    return {"peers": float(peers), "p": p, "messages": peers * (1.0 - (1.0 - p) ** tokens),
            "rows": tokens * peers * p, "bytes": tokens * peers * p * row_bytes,
            "bytes_per_peer": per_peer,
            "descriptors": float(peers * max(1, math.ceil(per_peer / chunk_bytes))) if peers else 0.0,
            "nvlink_rows": nvl_rows, "nvlink_bytes": nvl_rows * row_bytes}


def hier_traffic(inp: Inputs) -> Dict[str, Fig]:
    """:func:`hier_net` of both designs as figures (``hier:agg1_*``, ``hier:agg0_*``)."""
    out: Dict[str, Fig] = {}
    for name, agg in HIER_DESIGNS.items():
        h = hier_net(inp.ep, inp.ranks_per_node, inp.tokens_per_rank, inp.num_experts, inp.topk,
                     inp.row_bytes, agg, inp.chunk_bytes)
        how = ("once per destination node, to the rail peer: N-1 peers, p_n = 1 - C(E-E/N,k)/C(E,k)"
               if agg else "once per destination rank: P-L peers, p_r")
        out[f"{name}_efa_messages_op"] = derived(h["messages"], "messages", f"peers x (1-(1-p)^T); {how}")
        out[f"{name}_efa_rows_op"] = derived(h["rows"], "rows", f"T x peers x p; {how}")
        out[f"{name}_efa_bytes_op"] = derived(h["bytes"], "B", "EFA rows x H x b")
        out[f"{name}_descriptors_op"] = derived(h["descriptors"], "descriptors",
                                                "peers x ceil(bytes per peer / chunk_bytes)")
        out[f"{name}_nvlink_bytes_op"] = derived(
            h["nvlink_bytes"], "B", "N T (L-1) p_r x H x b (forward what the rail brought)" if agg
            else "T (L-1) p_r x H x b (this rank's own tokens)")
    return out


def path_hier(inp: Inputs, tr: Dict[str, Fig], cal: Dict[str, Fig], name: str) -> PathResult:
    """The hier transport of design ``name`` (``hier:agg1`` | ``hier:agg0``), best channel count."""
    if inp.group_nodes < 2:
        return PathResult(name, False, "the EP group lives on one node: hier is its local stage (gda)")
    h = hier_net(inp.ep, inp.ranks_per_node, inp.tokens_per_rank, inp.num_experts, inp.topk,
                 inp.row_bytes, HIER_DESIGNS[name], inp.chunk_bytes)
    fixed = _cal(cal, "hier_fixed_us")  # both stages, the status exchange, the permutation
    post = _cal(cal, "proxy_post_us")
    alpha = _cal(cal, "proxy_channel_alpha")
    rate = _cal(cal, "proxy_channel_gbps")
    local = _us(h["nvlink_bytes"], inp.nvlink_gbps * _cal(cal, "gda_link_eff"))
    wire = _us(h["bytes"], inp.efa_gbps_per_node / inp.gpus_per_node)
    by_nc, terms_nc = {}, {}
    for nc in range(1, inp.max_channels + 1):
        issue = (h["descriptors"] * post + _us(h["bytes"], rate)) / nc ** alpha if h["bytes"] else 0.0
        t = fixed + max(issue, wire) + local
        by_nc[nc] = 2 * t
        terms_nc[nc] = {"fixed": fixed, "issue": issue, "wire": wire, "local": local,
                      "msgs": h["descriptors"], "efa_messages": h["messages"]}
    best = min(by_nc.values())
    nc = min(c for c, v in by_nc.items() if v <= best * 1.02)
    terms = terms_nc[nc]
    t = by_nc[nc] / 2
    bound = max((("issue", terms["fixed"] + terms["issue"]), ("wire", terms["wire"]),
                 ("local", terms["local"])), key=lambda kv: kv[1])[0]
    src = (f"hier_fixed_us + max(issue(K={nc}), EFA wire) + NVLink bytes / "
           f"(NVLink x gda_link_eff); network traffic of {name} (hier_net)")
    r = PathResult(name, True, num_channels=nc, d_us=_op("d", t, src), c_us=_op("c", t, src),
                   dc_us=derived(2 * t, "us", "D + C"), bound=bound, terms=terms, by_channels=by_nc)
    r.extra["efa_messages_op"] = derived(h["messages"], "messages", "EFA peers with >= 1 row per op")
    r.extra["efa_bytes_op"] = derived(h["bytes"], "B", "EFA bytes per op")
    return r


def _nccl(inp: Inputs, name: str, nvl_b: float, efa_b: float, cal: Dict[str, Fig], what: str) -> PathResult:
    fixed = _cal(cal, "nccl_fixed_us")
    eff = _cal(cal, "nccl_link_eff")
    eff_efa = _cal(cal, "nccl_efa_eff")
    nvl = _us(nvl_b, inp.nvlink_gbps * eff)
    efa = _us(efa_b, inp.efa_gbps_per_node / inp.gpus_per_node * eff_efa)
    t = fixed + max(nvl, efa)
    bound = "latency" if fixed >= max(nvl, efa) else ("wire" if efa >= nvl else "nvlink")
    src = (f"nccl_fixed_us {fixed:.1f} + max(NVLink bytes / ({inp.nvlink_gbps:g} x nccl_link_eff {eff:.2f}), "
           f"EFA bytes / (EFA per GPU x nccl_efa_eff {eff_efa:.2f})); {what}")
    return PathResult(name, inp.ep > 1, "" if inp.ep > 1 else "EP size 1", d_us=_op("d", t, src),
                      c_us=_op("c", t, src), dc_us=derived(2 * t, "us", "D + C"), bound=bound,
                      terms={"fixed": fixed, "nvlink": nvl, "wire": efa})


def path_alltoall(inp, tr, cal) -> PathResult:
    return _nccl(inp, "alltoall", tr["a2a_bytes_nvlink_op"].value, tr["a2a_bytes_efa_op"].value, cal,
                 "Megatron alltoall: one row per (token, expert) pair; permutes not counted")


def path_allgather(inp, tr, cal) -> PathResult:
    return _nccl(inp, "allgather", tr["ag_bytes_nvlink_op"].value, tr["ag_bytes_efa_op"].value, cal,
                 "Megatron allgather: all-gather of every rank's tokens, reduce-scatter back")


# ----------------------------------------------------------------------------------------------
# Compute, memory, verdict
# ----------------------------------------------------------------------------------------------
def expert_gemm_us(inp: Inputs) -> Dict[str, Fig]:
    """Expert GEMM time of one layer and one micro-batch on one rank (balanced load):
    forward FLOPs = 2 x T x k x 3 x H x F (SwiGLU: gate, up, down); backward = 2 x forward."""
    flops = 2.0 * inp.tokens_per_rank * inp.topk * 3 * inp.hidden * inp.moe_ffn_hidden
    rate = inp.gpu_tflops_bf16 * 1e12 * inp.gemm_efficiency
    fwd = flops / rate * 1e6
    return {"gemm_flops_fwd": derived(flops, "FLOP", "2 x T x k x 3 x H x F"),
            "gemm_fwd_us": derived(fwd, "us", f"FLOPs / ({inp.gpu_tflops_bf16:g} TFLOPS x "
                                              f"gemm_efficiency {inp.gemm_efficiency:g})"),
            "gemm_train_us": derived(3 * fwd, "us", "forward + backward (2 x forward)")}


def memory(inp: Inputs, num_channels: int) -> Dict[str, Fig]:
    """Window memory per rank (gda, proxy with ``num_channels`` channels) and the experts' memory
    per GPU without EP."""
    P, Tm, b = inp.ep, inp.max_tokens_per_rank, DTYPE_BYTES[inp.dtype]
    gda = 2 * P * Tm * (inp.hidden * b + 12 * 16)
    prox = 2 * P * Tm * (inp.hidden * b + 12 * inp.topk + 16)
    expert_params = inp.moe_layers * inp.num_experts * 3 * inp.hidden * inp.moe_ffn_hidden
    world = inp.nodes * inp.gpus_per_node
    no_ep = expert_params * (6 + 12 / world)
    with_ep = expert_params / inp.ep * (6 + 12 / max(1, world // inp.ep))
    return {
        "gda_window_bytes": derived(gda, "B", "2 parities x P x T_MAX x (H x b + 12 x K_CAP=16) (kernels/gda/window.py layout)"),
        "proxy_window_bytes": derived(prox, "B", "send slots + receive regions: 2 x P x T_MAX x (H x b + 12 k + 16) (kernels/proxy/ layout, approx.)"),
        "proxy_engine_bytes": Fig(72e6 * num_channels, "B", "measured",
                                  "RESULTS.md 'Reliability: proxy': 72 MB resident per channel (tcp;ofi_rxm, 2-core VM); x K"),
        "expert_params": derived(expert_params, "params", "MoE layers x E x 3 x H x F"),
        "expert_bytes_per_gpu_no_ep": derived(no_ep, "B", f"params x (2 B bf16 weight + 4 B fp32 grad + 12 B Adam state / {world} GPUs, distributed optimizer)"),
        "expert_bytes_per_gpu_ep": derived(with_ep, "B", f"params / EP {P} x (6 B + 12 B / expert-DP)"),
        "hbm_budget_bytes": derived(inp.hbm_gb * 1e9 * inp.memory_budget, "B",
                                    f"HBM {inp.hbm_gb:g} GB x memory_budget {inp.memory_budget:g} (rest: activations, dense part)"),
    }


@dataclasses.dataclass
class Plan:
    inputs: Inputs
    traffic: Dict[str, Fig]
    paths: Dict[str, PathResult]
    compute: Dict[str, Fig]
    memory: Dict[str, Fig]
    shares: Dict[str, Fig]
    step: Dict[str, Fig]
    verdict: str
    transport: str
    num_channels: int
    reason: str
    bound: str
    dc_us: float
    ranking: List[Dict[str, Any]] = dataclasses.field(default_factory=list)


EFA_PATHS = ("gda", "proxy", "hier:agg1", "hier:agg0")


def rank_paths(paths: Dict[str, "PathResult"], ref: "PathResult") -> List[Dict[str, Any]]:
    """Every applicable path, fastest first: ``name``, ``dc_us``, ``x_ref`` (D+C / ``ref``'s D+C),
    ``efa`` (one of the efa dispatcher's transports: gda, proxy, hier designs)."""
    rows = [{"name": n, "dc_us": p.dc_us.value, "x_ref": p.dc_us.value / ref.dc_us.value, "efa": n in EFA_PATHS}
            for n, p in paths.items() if p.applicable]
    return sorted(rows, key=lambda r: r["dc_us"])


def ranking_text(ranking: List[Dict[str, Any]], ref: str) -> str:
    return f"ranked by D+C (x Megatron {ref}): " + ", ".join(
        f"{r['name']} {r['dc_us']:.0f} us ({r['x_ref']:.2f}x)" for r in ranking)


def _path_fns():
    fns = {"gda": path_gda, "proxy": path_proxy, "alltoall": path_alltoall, "allgather": path_allgather}
    for name in HIER_DESIGNS:
        fns[name] = (lambda n: lambda inp, tr, cal: path_hier(inp, tr, cal, n))(name)
    return fns


def make_plan(inp: Inputs, cal: Dict[str, Fig]) -> Plan:
    """The full plan: traffic, every path's D+C, shares of the step, memory and the verdict.

    Verdict: ``efa`` when the best ``efa`` path (gda inside a node; across nodes the fastest of
    ``proxy`` and the ``hier`` designs, ``hier:agg1`` being what ``EFA_EP_TRANSPORT=auto`` runs)
    is at most ``win_margin`` x the best Megatron path; else ``capacity`` when the experts do not
    fit a GPU without EP (weights + grads + optimizer > ``memory_budget`` x HBM): EP is needed to
    fit, take the fastest path; else ``dense``: the all-to-all buys nothing, use Megatron's
    ``allgather`` dispatcher (or no EP). ``ranking``: every applicable path, fastest first, with
    its D+C over the best Megatron path's (:func:`rank_paths`); the reason ends with it.
    """
    tr = {**traffic(inp), **hier_traffic(inp)}
    paths = {n: f(inp, tr, cal) for n, f in _path_fns().items()}
    comp = expert_gemm_us(inp)
    gemm_train = comp["gemm_train_us"].value
    shares, step = {}, {}
    per_step = inp.moe_layers * inp.micro_batches_per_step
    for n, p in paths.items():
        if not p.applicable:
            continue
        comm_train = 2 * p.dc_us.value
        shares[n] = derived(comm_train / (comm_train + gemm_train), "fraction",
                            "2 x D+C / (2 x D+C + expert GEMM fwd+bwd), per MoE layer; no overlap, "
                            "attention and dense layers not counted")
        step[n] = derived(comm_train * per_step, "us", f"2 x D+C x {inp.moe_layers} MoE layers x "
                                                      f"{inp.micro_batches_per_step} micro-batches")
    step["gemm"] = derived(gemm_train * per_step, "us", "expert GEMM fwd+bwd x layers x micro-batches")
    cands = [paths[n] for n in (("gda",) if paths["gda"].applicable else ("proxy", "hier:agg1", "hier:agg0"))
             if paths[n].applicable]
    efa = min(cands, key=lambda p: p.dc_us.value) if cands else paths["proxy"]
    efa_name = efa.name
    megatron = {n: paths[n] for n in ("alltoall", "allgather") if paths[n].applicable}
    nc = efa.num_channels if efa.num_channels else paths["proxy"].num_channels
    mem = memory(inp, max(1, nc))
    fits = mem["expert_bytes_per_gpu_no_ep"].value <= mem["hbm_budget_bytes"].value
    if not efa.applicable or not megatron:
        verdict, chosen = "dense", "allgather"
        reason = "EP size 1: no expert-parallel exchange"
        return Plan(inp, tr, paths, comp, mem, shares, step, verdict, chosen, 0, reason, "none", 0.0)
    best_m = min(megatron.values(), key=lambda p: p.dc_us.value)
    ranking = rank_paths(paths, best_m)
    ratio = efa.dc_us.value / best_m.dc_us.value
    fastest = min([efa] + list(megatron.values()), key=lambda p: p.dc_us.value)
    gb = 1e9
    if ratio <= inp.win_margin:
        verdict, chosen = "efa", efa
        reason = (f"{efa_name} D+C {efa.dc_us.value:.0f} us is {ratio:.2f}x Megatron {best_m.name} "
                  f"({best_m.dc_us.value:.0f} us), below the {inp.win_margin:g} margin")
    elif not fits:
        verdict, chosen = "capacity", fastest
        reason = (f"experts need {mem['expert_bytes_per_gpu_no_ep'].value / gb:.0f} GB per GPU without "
                  f"EP (> {mem['hbm_budget_bytes'].value / gb:.0f} GB budget): EP is needed to fit; "
                  f"the best efa path ({efa_name}) is {ratio:.2f}x Megatron {best_m.name}, not a throughput "
                  f"win; fastest: {fastest.name}")
    else:
        verdict, chosen = "dense", paths["allgather"]
        reason = (f"the best efa path ({efa_name}) is {ratio:.2f}x Megatron {best_m.name} (no win below "
                  f"{inp.win_margin:g}) and the experts fit without EP "
                  f"({mem['expert_bytes_per_gpu_no_ep'].value / gb:.0f} GB <= "
                  f"{mem['hbm_budget_bytes'].value / gb:.0f} GB): use Megatron allgather")
    reason += "; " + ranking_text(ranking, best_m.name)
    nc = chosen.num_channels if chosen.name in EFA_PATHS else 0
    return Plan(inp, tr, paths, comp, mem, shares, step, verdict, chosen.name, nc, reason,
                chosen.bound, chosen.dc_us.value, ranking)


def choose_transport(ep_size: int, ranks_per_node: int, available: List[str], cal: Dict[str, Fig],
                     hidden: int = 2048, num_experts: int = 128, topk: int = 8,
                     tokens_per_rank: int = 4096, efa_gbps_per_gpu: float = 50.0,
                     nvlink_gbps: float = 450.0, max_channels: int = 8) -> Tuple[str, int, str]:
    """What ``EFA_EP_TRANSPORT=auto`` should pick for one EP group: ``(transport, num_channels,
    reason)``.

    ``gda`` when the group lives on one node and gda is usable; ``proxy`` with the model's best
    channel count (fewest channels within 2% of the fastest, from ``cal``) when the group spans
    nodes and proxy is usable; otherwise ``torch``. ``num_channels`` is 0 unless the transport is
    ``proxy``.
    """
    if ep_size < 1 or ranks_per_node < 1:
        raise ValueError(f"ep_size={ep_size} and ranks_per_node={ranks_per_node} must be >= 1")
    if ep_size <= ranks_per_node:
        if "gda" in available:
            return "gda", 0, f"EP group of {ep_size} ranks on one node: gda (NVLink stores)"
        return "torch", 0, f"EP group on one node but gda is not usable here: torch"
    if "proxy" not in available:
        return "torch", 0, f"EP group spans {ep_size // ranks_per_node} nodes but proxy is not usable here: torch"
    num_experts = max(num_experts - num_experts % ep_size, ep_size)
    inp = Inputs(model="auto", hidden=hidden, num_experts=num_experts, topk=min(topk, num_experts),
                 moe_layers=1, moe_ffn_hidden=1, seq_length=tokens_per_rank, micro_batch=1,
                 dtype="bf16", fabric="auto", nodes=ep_size // ranks_per_node,
                 gpus_per_node=ranks_per_node, ep=ep_size, nvlink_gbps=nvlink_gbps,
                 efa_gbps_per_node=efa_gbps_per_gpu * ranks_per_node, max_channels=max_channels)
    p = path_proxy(inp, traffic(inp), cal)
    return "proxy", p.num_channels, (f"EP group spans {inp.group_nodes} nodes: proxy with K={p.num_channels} "
                                     f"(predicted D+C {p.dc_us.value:.0f} us at {tokens_per_rank} tokens/rank, "
                                     f"bound {p.bound}; calibration {cal.get('_name', Fig('-', '', 'assumed', '')).value})")
