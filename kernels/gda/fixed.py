"""gda's fixed-capacity dispatch: no host sync, static launch grids, the window is the receive
buffer (what capacity mode and CUDA graph capture run).

Eager, its phases are two native programs run in one call with the launch gate between them
(the front: layout and stores; the fixed header: the wait for every source, the counts and the
unused rows marked), bound on the first call of a shape as the regular dispatch's are
(:class:`~.phases.GdaPhases`); inside a capture, or with bad input, or where programs cannot be
bound, the same kernels are launched from Python with the gate passed in Python.
"""
from __future__ import annotations

import torch

from ..base import STATUS_BAD_INPUT, DispatchHandle, DispatchInputError
from . import phases as _phases
from .window import GdaDispatchState

# the fixed header program's integer variables, after its tensors (num_recv, tokens_per_expert)
_HEADER_INTS = ("epoch_delta", "full")


def _regions(tr, parity: int, k: int):
    """This parity's receive regions as flat typed views of the window, made once per (parity,
    top-k): rows ``[W * T_MAX * H]`` cfg.dtype, ids ``[W * T_MAX * K]`` int64, weights
    ``[W * T_MAX * K]`` float32 (callers get fresh ``view``s of them: a tensor returned twice
    would carry the autograd history of its last use)."""
    key = (parity, k)
    got = tr._fixed_regions.get(key)
    if got is None:
        offs, rows = tr._offs[parity], tr.world_size * tr.cfg.max_tokens_per_rank
        got = (tr._region(offs["data_off"], rows * tr.cfg.hidden * tr._elem, tr.cfg.dtype),
               tr._region(offs["idx_off"], rows * k * 8, torch.int64),
               tr._region(offs["w_off"], rows * k * 4, torch.float32))
        tr._fixed_regions[key] = got
    return got


def dispatch(tr, x, topk_idx, topk_weights):
    """``GdaTransport.dispatch_fixed`` of ``tr`` (its docstring has the contract): returns
    (recv_x ``[W * T_MAX, H]``, recv_topk_idx ``[W * T_MAX, K]`` int64, recv_topk_weights
    ``[W * T_MAX, K]`` float32: views of the window; num_recv ``[W]`` and tokens_per_expert
    ``[L]`` int64 on the device; the handle). All work on the current stream, no host sync."""
    kern, cfg, world = tr._kern, tr.cfg, tr.world_size
    error = tr._host_check(x, topk_idx, topk_weights)
    epoch = tr._begin_op("dispatch")
    parity = epoch % 2
    if error is not None:  # take part with no rows and a bad status (see dispatch)
        x = torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=tr.device)
        topk_idx = torch.empty(0, topk_idx.shape[1] if topk_idx.dim() == 2 else 1,
                               dtype=torch.int64, device=tr.device)
        topk_weights = torch.empty(0, topk_idx.shape[1], dtype=torch.float32, device=tr.device)
    x = x.contiguous() if x.stride(-1) != 1 else x
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
    k = topk_idx.shape[1]
    ph = tr._phases
    # the gate in the native call: not inside a capture, whose replays issue every op at once
    native = error is None and not tr._capturing
    front = ph.front(x, topk_idx, topk_weights, epoch,
                     None if error is None else STATUS_BAD_INPUT, defer=native)
    slot, send_idx = front[1], front[2]
    first = front[3] if native else None  # (program, values) to run with the gate, or None
    full = tr._note_idx_width(parity, k)
    rows = world * cfg.max_tokens_per_rank
    num_recv = torch.empty(world, dtype=torch.int64, device=tr.device)
    tokens_per_expert = torch.empty(cfg.num_local_experts, dtype=torch.int64, device=tr.device)
    data, idx_region, w_region = _regions(tr, parity, k)
    op = ph._op(epoch)

    def launch(plan):
        kern.recv_header_fixed(tr._my_sig, tr._hdr[parity], tr._err, tr._hw[parity], num_recv,
                               tokens_per_expert, idx_region, w_region, num_topk=k,
                               t_max=cfg.max_tokens_per_rank, **op, full=full, kind="dispatch",
                               **tr._wait_kw, plan=plan)

    prog = (ph._program(("header_fixed", parity, k), launch, (num_recv, tokens_per_expert),
                        _HEADER_INTS) if native and ph.native else None)
    if prog is None:
        ph._then(first, epoch, "dispatch")
        launch(None)
    else:
        values = (num_recv.data_ptr(), tokens_per_expert.data_ptr(), op["epoch"], int(full))
        if first is not None:
            ph._gated(first, prog, values, epoch, "dispatch")
        else:
            ph._then(None, epoch, "dispatch")
            prog.run(values, _phases._stream(ph._dev))
    if error is not None:
        raise DispatchInputError(error)
    recv_idx, recv_w = idx_region.view(rows, k), w_region.view(rows, k)
    handle = DispatchHandle(
        num_tokens=x.shape[0], num_recv_tokens=rows, topk_idx=topk_idx,
        send_token_idx=send_idx, num_send_per_rank=(), num_recv_per_rank=(),
        recv_topk_idx=recv_idx,
        state=GdaDispatchState(owner=tr.uid, slot_TW=slot, recv_offsets=None, epoch=epoch,
                               fixed=True, num_recv_W=num_recv))
    return data.view(rows, cfg.hidden), recv_idx, recv_w, num_recv, tokens_per_expert, handle
