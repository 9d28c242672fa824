"""Cells of the ``layer`` view: one Megatron ``MoELayer`` forward + backward with the ``efa``
dispatcher on a transport, checked against Megatron's ``alltoall`` layer in the same training
feature (:mod:`.features`) and timed."""
from __future__ import annotations

import dataclasses
import traceback
from typing import Any, Dict

from efa_ep.testing.routes import derived_seed

from .arms import Arm
from .cells import Cell
from .features import efa_settings, layer_features, megatron_overrides
from .rank import (RankContext, all_ranks_ok, broadcast_, finish_record, sm_budget, time_cell,
                   void_record)
from .schema import DTYPES


def _layer(ctx: RankContext, cell: Cell):
    """Megatron MoELayer for this cell's arm in its feature, kept per (feature, arm) for the
    whole start; every layer of a start has the same initial weights (seed 0, router
    broadcast from rank 0), the efa and alltoall layers of a feature alike."""
    import torch

    from efa_ep.dispatcher import settings as dsettings

    if not ctx.megatron_ready:
        import efa_ep  # noqa: F401
        from efa_ep.tiny_moe import init_megatron

        init_megatron(ctx.world, seed=int(ctx.cfg["seed"]))
        ctx.megatron_ready = True
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, transformer_config

    lay = ctx.cfg["layer"]

    def build(dispatcher, config_attrs=None, on_device=True, base_overrides=None, **extra):
        mcfg = TinyMoEConfig(num_layers=1, hidden_size=cell.hidden, num_moe_experts=cell.num_experts,
                             moe_router_topk=cell.topk, ffn_hidden_size=int(lay["ffn_hidden_size"]),
                             moe_ffn_hidden_size=int(lay["ffn_hidden_size"]), dtype=cell.dtype,
                             num_attention_heads=1)
        overrides = (megatron_overrides(cell.feature, lay) if base_overrides is None
                     else base_overrides)
        config = transformer_config(mcfg, dispatcher, ctx.world, **overrides, **extra)
        for k, v in (config_attrs or {}).items():
            setattr(config, k, v)  # efa settings on the config instance (over EFA_EP_* variables)
        sub = get_submodules(get_gpt_layer_local_submodules(num_experts=cell.num_experts).mlp)
        layer = MoELayer(config, sub)
        layer.set_layer_number(0)
        return layer.to(ctx.device) if on_device else layer

    if ctx.layer_weights is None:
        # One initialized layer per start gives every layer its weights: Megatron's CPU init of
        # every expert takes seconds per layer at real shapes. It has a shared expert when a
        # feature uses one (created after the router and the routed experts, so those are the
        # same with or without it); layers without one take the rest of the weights.
        shared = {k: v for f in layer_features(ctx.cfg)
                  for k, v in megatron_overrides(f, lay).items()
                  if k == "moe_shared_expert_intermediate_size"}
        torch.manual_seed(0)
        source = build("alltoall", on_device=False, base_overrides=shared)
        broadcast_(source.router.weight.data, src=0)  # same router on every rank
        ctx.layer_weights = source.state_dict()
    key = (cell.feature, cell.arm.name)
    if key not in ctx.layers:
        if cell.arm.transport is None:
            layer = build("alltoall", perform_initialization=False)
        else:
            options, attrs = efa_settings(cell.feature, lay, cell.arm.transport, cell.arm.options,
                                          cell.num_experts)
            t_max = lay.get("max_tokens_per_rank")
            dsettings.configure(transport=cell.arm.transport,
                                **({} if t_max is None else {"max_tokens_per_rank": int(t_max)}),
                                **dict(options))
            try:
                layer = build("efa", attrs, perform_initialization=False)
            finally:
                dsettings.reset()
        own = layer.state_dict()
        missing = sorted(set(own) - set(ctx.layer_weights))
        if missing:
            raise RuntimeError(f"layer view: no initial weights for {missing[:3]}")
        layer.load_state_dict({k: ctx.layer_weights[k] for k in own})
        ctx.layers[key] = layer
    return ctx.layers[key]


def _layer_transport_info(ctx: RankContext, cell: Cell) -> Dict[str, Any]:
    """The dispatcher of the cell's layer and what it runs with: the feature's Megatron
    settings and, for efa, the transport options and settings its dispatcher resolved."""
    info: Dict[str, Any] = {"feature": cell.feature,
                            "megatron": megatron_overrides(cell.feature, ctx.cfg["layer"])}
    if cell.arm.transport is None:
        return {"dispatcher": "megatron alltoall", **info}
    info = {"dispatcher": "efa", "transport": cell.arm.transport,
            "options": dict(cell.arm.options), **info}
    layer = ctx.layers.get((cell.feature, cell.arm.name))
    td = getattr(layer, "token_dispatcher", None)
    if td is not None and hasattr(td, "transport_options"):
        info.update(options=dict(td.transport_options),
                    max_tokens_per_rank=td.settings.max_tokens_per_rank,
                    capacity_overflow=td.capacity_overflow,
                    static_shapes=bool(td.drop_and_pad),
                    shared_expert_overlap=td.shared_experts is not None)
    return info


def run_layer_cell(ctx: RankContext, cell: Cell) -> Dict[str, Any]:
    """One ``layer`` cell on this rank: the arm's layer checked against the ``alltoall`` layer of
    the same feature (output and input grad, to rounding), then timed; returns the record's
    body."""
    import torch

    dtype = getattr(torch, DTYPES[cell.dtype])
    seq, batch = cell.tokens_per_rank // int(ctx.cfg["layer"]["micro_batch"]), int(ctx.cfg["layer"]["micro_batch"])
    g = torch.Generator().manual_seed(derived_seed(ctx.cfg["seed"], "layer", ctx.rank))
    x = torch.randn(seq, batch, cell.hidden, generator=g).to(dtype).to(ctx.device)
    grad = torch.randn(seq, batch, cell.hidden, generator=g).to(dtype).to(ctx.device)
    err = None
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    try:
        layer = _layer(ctx, cell)
        if cell.arm.transport is not None:
            ref = _layer(ctx, dataclasses.replace(cell, arm=Arm("alltoall", "layer", None)))
            xa = x.clone().requires_grad_(True)
            xb = x.clone().requires_grad_(True)
            oa, _ = ref(xa)
            ob, _ = layer(xb)
            oa.backward(grad)
            ob.backward(grad)
            if not torch.allclose(ob.float(), oa.float(), **tol):
                err = f"layer output differs from alltoall (max |diff| {(ob.float() - oa.float()).abs().max().item():.3g})"
            elif not torch.allclose(xb.grad.float(), xa.grad.float(), **tol):
                err = "layer input grad differs from alltoall"
    except Exception as e:
        err = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    ok = all_ranks_ok(err is None)
    check = "reference" if cell.arm.transport is None and err is None else ("pass" if ok else "fail")
    status: Dict[str, Any] = {"status": check, "detail": err}
    if cell.arm.transport is not None:
        status["compared"] = (f"output and input grad vs alltoall in feature {cell.feature} "
                              f"(allclose rtol={tol['rtol']:g} atol={tol['atol']:g})")
    rec: Dict[str, Any] = {"check": status, "dispatch_rows": None,
                           "dispatch_bytes": None, "collective_bytes": None, "net_counts": None,
                           "sm_budget": sm_budget(ctx, None, "layer view: not measured"),
                           "transport_info": _layer_transport_info(ctx, cell)}
    if not ok:
        return void_record(rec, err or "a peer rank's check failed")
    xin = x.clone().requires_grad_(True)

    def once():
        out, _ = layer(xin)
        out.backward(grad)
        xin.grad = None

    return finish_record(rec, time_cell(ctx, once, cell))
