"""Cells of the ``layer`` view: one Megatron ``MoELayer`` forward + backward with the ``efa``
dispatcher on a transport, checked against Megatron's ``alltoall`` layer and timed."""
from __future__ import annotations

import traceback
from typing import Any, Dict

from efa_ep.testing.routes import derived_seed

from .cells import Cell
from .rank import (RankContext, all_ranks_ok, broadcast_, finish_record, sm_budget, time_cell,
                   void_record)
from .schema import DTYPES


def _layer(ctx: RankContext, cell: Cell):
    """Megatron MoELayer for this cell's arm; efa layers copy the alltoall layer's weights."""
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

    def build(dispatcher):
        mcfg = TinyMoEConfig(num_layers=1, hidden_size=cell.hidden, num_moe_experts=cell.num_experts,
                             moe_router_topk=cell.topk, ffn_hidden_size=int(lay["ffn_hidden_size"]),
                             moe_ffn_hidden_size=int(lay["ffn_hidden_size"]), dtype=cell.dtype,
                             num_attention_heads=1)
        config = transformer_config(mcfg, dispatcher, ctx.world)
        sub = get_submodules(get_gpt_layer_local_submodules(num_experts=cell.num_experts).mlp)
        layer = MoELayer(config, sub)
        layer.set_layer_number(0)
        return layer.to(ctx.device)

    if "alltoall" not in ctx.layers:
        torch.manual_seed(0)
        ref = build("alltoall")
        broadcast_(ref.router.weight.data, src=0)  # same router on every rank
        ctx.layers["alltoall"] = ref
    if cell.arm.name not in ctx.layers:
        dsettings.configure(transport=cell.arm.transport, **dict(cell.arm.options))
        try:
            layer = build("efa")
        finally:
            dsettings.reset()
        layer.load_state_dict(ctx.layers["alltoall"].state_dict())
        ctx.layers[cell.arm.name] = layer
    return ctx.layers[cell.arm.name]


def _layer_transport_info(cell: Cell) -> Dict[str, Any]:
    """Options the layer arm's transport was configured with (the dispatcher resolves the rest)."""
    if cell.arm.transport is None:
        return {"dispatcher": "megatron alltoall"}
    return {"dispatcher": "efa", "transport": cell.arm.transport, "options": dict(cell.arm.options)}


def run_layer_cell(ctx: RankContext, cell: Cell) -> Dict[str, Any]:
    """One ``layer`` cell on this rank: the arm's layer checked against the ``alltoall`` layer
    (output and input grad, to rounding), then timed; returns the record's body."""
    import torch

    dtype = getattr(torch, DTYPES[cell.dtype])
    seq, batch = cell.tokens_per_rank // int(ctx.cfg["layer"]["micro_batch"]), int(ctx.cfg["layer"]["micro_batch"])
    g = torch.Generator().manual_seed(derived_seed(ctx.cfg["seed"], "layer", ctx.rank))
    x = torch.randn(seq, batch, cell.hidden, generator=g).to(dtype).to(ctx.device)
    grad = torch.randn(seq, batch, cell.hidden, generator=g).to(dtype).to(ctx.device)
    err = None
    try:
        layer = _layer(ctx, cell)
        ref = ctx.layers["alltoall"]
        if layer is not ref:
            xa = x.clone().requires_grad_(True)
            xb = x.clone().requires_grad_(True)
            oa, _ = ref(xa)
            ob, _ = layer(xb)
            oa.backward(grad)
            ob.backward(grad)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            if not torch.allclose(ob.float(), oa.float(), **tol):
                err = f"layer output differs from alltoall (max |diff| {(ob.float() - oa.float()).abs().max().item():.3g})"
            elif not torch.allclose(xb.grad.float(), xa.grad.float(), **tol):
                err = "layer input grad differs from alltoall"
    except Exception as e:
        err = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    ok = all_ranks_ok(err is None)
    check = "reference" if cell.arm.name == "alltoall" and err is None else ("pass" if ok else "fail")
    rec: Dict[str, Any] = {"check": {"status": check, "detail": err}, "dispatch_rows": None,
                           "dispatch_bytes": None, "collective_bytes": None, "net_counts": None,
                           "sm_budget": sm_budget(ctx, None, "layer view: not measured"),
                           "transport_info": _layer_transport_info(cell)}
    if not ok:
        return void_record(rec, err or "a peer rank's check failed")
    xin = x.clone().requires_grad_(True)

    def once():
        out, _ = layer(xin)
        out.backward(grad)
        xin.grad = None

    return finish_record(rec, time_cell(ctx, once, cell))
