"""The doctor's verdict: the checks joined with the planner (:mod:`efa_ep.tools.plan`) for the
user's model and layout.

- Which transport ``EFA_EP_TRANSPORT=auto`` will run: ``gda`` when the EP group fits one node and
  gda can run here, else ``torch``; across nodes ``hier`` (``aggregate=1``: the network stage over
  the proxy, with ``efa`` when usable here, else ``tcp``; the local stage ``gda``, else ``torch``),
  as :func:`efa_ep.kernels.auto_choice` does.
- Its predicted D+C per MoE layer against Megatron's ``alltoall``, from the planner with the
  shipped calibration (every figure a :class:`~efa_ep.tools.plan.model.Fig` with its tag), and
  again with this host's fixed cost per op as the self-test measured it, where it measured the
  transport the prediction rests on (the proxy's provider ``auto`` would use; ``gda``).
- The advice: ``use efa``, ``stay on alltoall`` or ``EP only for capacity`` (the planner's
  ``efa`` / ``dense`` / ``capacity``), or ``stay on alltoall`` when the transport ``auto`` picks
  cannot run here, or is ``torch`` where the planner's win is ``gda``'s.
"""
from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional, Sequence

from .checks import Host, Layout

_TAG = {"measured": "M", "derived": "D", "assumed": "A"}
ADVICE = {"efa": "use efa", "dense": "stay on alltoall", "capacity": "EP only for capacity"}


def plan_overrides(cfg: Dict[str, Any], lay: Layout) -> List[str]:
    """The ``efa-ep-plan`` overrides of the doctor's config."""
    out = [f"model={cfg['model']}", f"fabric={cfg['fabric']}", f"nodes={lay.nodes}",
           f"gpus_per_node={lay.gpus_per_node}", f"ep={lay.ep}"]
    if cfg.get("tokens_per_rank"):
        out.append(f"tokens_per_rank={int(cfg['tokens_per_rank'])}")
    if cfg.get("calibration"):
        out.append(f"calibration={cfg['calibration']}")
    return out


def make_inputs(cfg: Dict[str, Any], lay: Layout):
    """``(Inputs, calibration, note)`` for the doctor's job. Raises ConfigError / ValueError on
    an unknown preset or a layout the planner refuses (checked before anything runs)."""
    from ..config import compose
    from ..plan.cli import inputs_from_config, load_calibration

    overrides = plan_overrides(cfg, lay)
    pcfg = compose("plan", "default", overrides)
    inp = inputs_from_config(pcfg, overrides)
    notes: List[str] = []
    cal = load_calibration(pcfg.get("calibration"), log=lambda *a, **k: notes.append(" ".join(map(str, a))))
    return inp, cal, "; ".join(notes)


def auto_pick(h: Host, lay: Layout) -> Dict[str, Any]:
    """What ``auto`` runs for ``lay`` on hosts like this one: ``name`` (``gda``, ``torch``,
    ``hier``), ``path`` (the planner's path, or None for ``torch``), ``how`` (one line),
    ``runs`` (whether it can run here) and ``why_not``."""
    gda_ok = h.transports.get("gda") is None
    if not lay.spans_nodes:
        if gda_ok:
            return {"name": "gda", "path": "gda", "how": f"gda (one node, {lay.ep} ranks over NVLink)",
                    "runs": True, "why_not": None}
        why = (h.transports.get("gda") or "").split(" (needs ")[0]
        return {"name": "torch", "path": None, "how": f"torch (one node; gda cannot run here: {why})",
                "runs": True, "why_not": None}
    provider = "efa" if h.providers.get("efa") is None else "tcp"
    local = "gda" if gda_ok else "torch"
    why_proxy = h.transports.get("proxy")
    return {"name": "hier", "path": "hier:agg1", "provider": provider, "local": local,
            "how": f"hier (aggregate=1; network: proxy over {provider}, local: {local}) for {lay.ep} ranks "
                   f"on {lay.group_nodes} nodes",
            "runs": why_proxy is None,
            "why_not": (None if why_proxy is None else
                        f"its network stage needs the proxy: {why_proxy.split(' (needs ')[0]}")}


def measured_calibration(cal: Dict[str, Any], auto: Dict[str, Any], selftest: Optional[Dict[str, Any]]):
    """``(calibration, substituted)``: ``cal`` with the fixed costs per op the self-test
    measured for the transports ``auto`` rests on (``hier_fixed_us`` from hier over ``auto``'s
    provider, ``proxy_fixed_us`` from the proxy over it, ``gda_fixed_us`` from gda), tagged
    measured; for hier without a hier self-test, ``hier_fixed_us`` derived from the stages'
    measured costs. ``substituted`` names the measured ones (empty: nothing measured applies, and
    ``cal`` is returned unchanged)."""
    from ..plan.calibrate import hier_from_stages
    from ..plan.model import Fig

    if not selftest:
        return cal, {}
    res = {r["label"]: r for r in selftest.get("results", []) if r.get("status") == "ok"}
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    shape = selftest.get("shape", {})
    where = (f"efa-ep-doctor loopback self-test {when}: {selftest.get('ranks')} ranks on one host, "
             f"{shape.get('tokens')} tokens x {shape.get('hidden')} {shape.get('dtype')}, median D+C / 2")
    out, subs = dict(cal), {}
    want = []
    if auto.get("name") == "hier":
        want.append(("hier_fixed_us", f"hier:{auto['provider']}"))
        want.append(("proxy_fixed_us", f"proxy:{auto['provider']}"))
        if auto.get("local") == "gda":
            want.append(("gda_fixed_us", "gda"))
    elif auto.get("name") == "gda":
        want.append(("gda_fixed_us", "gda"))
    for param, label in want:
        r = res.get(label)
        if r and r.get("op_us") is not None:
            out[param] = Fig(float(r["op_us"]), "us", "measured", f"{where} ({label} on {r.get('device')})")
            subs[param] = {"label": label, "value": float(r["op_us"]), "device": r.get("device")}
    if auto.get("name") == "hier" and "hier_fixed_us" not in subs and subs and \
            "proxy_fixed_us" in out and "gda_fixed_us" in out:
        out["hier_fixed_us"] = hier_from_stages(out, f"no hier self-test here; {where}")
    return (out if subs else cal), subs


def _fig(fig) -> str:
    return f"{fig.value:.0f} us [{_TAG[fig.tag]}]"


def verdict(h: Host, lay: Layout, cfg: Dict[str, Any], checks: Sequence, selftest: Optional[Dict[str, Any]],
            inputs=None) -> Dict[str, Any]:
    """The verdict document (see the module docstring); ``lines`` are what the doctor prints."""
    from ..plan.model import make_plan

    inp, cal, note = inputs or make_inputs(cfg, lay)
    plan = make_plan(inp, cal)
    auto = auto_pick(h, lay)
    a2a = plan.paths["alltoall"]
    lines = [f"auto -> {auto['how']}"]
    doc: Dict[str, Any] = {"auto": auto, "calibration_note": note or None,
                           "planner": {"verdict": plan.verdict, "transport": plan.transport,
                                       "num_channels": plan.num_channels, "reason": plan.reason,
                                       "bound": plan.bound}}
    head = (f"{inp.model} on {inp.fabric}, {inp.tokens_per_rank} tokens/rank, EP {inp.ep} over "
            f"{inp.group_nodes} node(s)")
    path = plan.paths.get(auto["path"]) if auto["path"] else None
    if a2a.applicable:
        doc["alltoall_dc_us"] = a2a.dc_us.to_dict()
    if path is not None and path.applicable and a2a.applicable:
        ratio = path.dc_us.value / a2a.dc_us.value
        lines.append(f"predicted D+C per MoE layer ({head}): {auto['path']} {_fig(path.dc_us)} vs Megatron "
                     f"alltoall {_fig(a2a.dc_us)} = {ratio:.2f}x [D]")
        doc["auto_dc_us"] = path.dc_us.to_dict()
        doc["ratio"] = ratio
    elif auto["name"] == "torch":
        lines.append(f"predicted D+C ({head}): torch is not modelled by the planner (all_to_all_single plus a "
                     f"status exchange per op: expect at least Megatron alltoall's {_fig(a2a.dc_us)})")
    else:
        lines.append(f"predicted D+C ({head}): {auto['path']} not applicable: "
                     f"{path.why_not if path is not None else 'not modelled'}")
    mcal, subs = measured_calibration(cal, auto, selftest)
    doc["measured"] = None
    if subs:
        mplan = make_plan(inp, mcal)
        mpath = mplan.paths.get(auto["path"])
        what = ", ".join(f"{s['label']} {s['value']:.0f} us/op [M] on {s['device']}" for s in subs.values())
        if mpath is not None and mpath.applicable:
            mratio = mpath.dc_us.value / a2a.dc_us.value
            lines.append(f"with this host's measured fixed cost ({what}): {auto['path']} {_fig(mpath.dc_us)} vs "
                         f"alltoall {_fig(a2a.dc_us)} = {mratio:.2f}x [D]; planner verdict {mplan.verdict}")
            doc["measured"] = {"substituted": subs, "dc_us": mpath.dc_us.to_dict(), "ratio": mratio,
                               "verdict": mplan.verdict}
    if not auto["runs"]:
        advice = "stay on alltoall"
        detail = (f"auto runs {auto['name']} for this layout, which cannot run here ({auto['why_not']}); "
                  f"fix the failing lines above, or set EFA_EP_FALLBACK=alltoall so a job falls back by itself")
    elif auto["name"] == "torch" and plan.verdict == "efa":
        advice = "stay on alltoall"
        detail = (f"the planner's efa win is {plan.transport}'s, but auto runs torch here ({auto['how']}); "
                  f"torch moves the same rows with no faster path than Megatron's")
    else:
        advice = ADVICE[plan.verdict]
        detail = plan.reason.split("; ranked by")[0]
        if plan.verdict == "efa" and auto["path"] and plan.transport != auto["path"]:
            detail += (f"; auto runs {auto['path']}, the planner's fastest efa path is {plan.transport}"
                       + (f" with {plan.num_channels} channels" if plan.num_channels else "")
                       + f": {_how_to_run(plan.transport, plan.num_channels)}")
        if auto["name"] == "hier" and auto["provider"] != "efa":
            detail += "; this host has no efa provider: the prediction is for the fabric preset, not for tcp"
    fails = [c.name for c in checks if c.status == "fail"]
    if fails:
        detail += f"; failing checks: {', '.join(fails)}"
    lines.append(f"advice: {advice} - {detail}")
    doc.update(advice=advice, advice_detail=detail, lines=lines)
    return doc


def _how_to_run(path: str, num_channels: int) -> str:
    """The settings that run the planner's efa ``path`` (``proxy``, ``hier:agg1``, ...)."""
    name, _, design = path.partition(":")
    opts = [f"num_channels={num_channels}"] if num_channels else []
    if design == "agg0":
        opts.append("aggregate=0")
    return (f"set EFA_EP_TRANSPORT={name}"
            + (f" EFA_EP_TRANSPORT_OPTIONS={','.join(opts)}" if opts else ""))


__all__ = ["verdict", "auto_pick", "measured_calibration", "make_inputs", "plan_overrides", "ADVICE"]
