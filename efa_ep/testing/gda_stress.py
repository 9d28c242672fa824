"""Workers of the ``gda`` stress suite (GPU): randomized rounds checked bit for bit against a
brute-force reference, and Megatron layer runs checked against the ``torch`` transport. Run by
``scripts/gpu/gda_stress.py`` (the figures) and ``tests/kernels/test_gda_stress_gpu.py``."""
from __future__ import annotations

import time

import torch

from efa_ep.testing.routes import contract_route_from

T_MAX = 4096
LAYOUTS = [(64, 2048, torch.bfloat16), (256, 7168, torch.bfloat16), (384, 2048, torch.float32),
           (256, 2048, torch.bfloat16), (64, 7168, torch.float32), (384, 7168, torch.bfloat16)]
# contract route kinds of efa_ep.testing.routes (a round draws one by index: keep the order)
KINDS = ("random", "hot_experts", "one_rank", "dropped")


def _round_inputs(seed, world, e, h, dtype, dev):
    """Every rank's (x, idx, w) for one round; identical on every rank (shared seed)."""
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, 9, (1,), generator=g))
    kind = KINDS[int(torch.randint(0, len(KINDS), (1,), generator=g))]
    ts = []
    decode = float(torch.rand(1, generator=g)) < 0.25  # a quarter of rounds decode-sized
    for _ in range(world):
        u = float(torch.rand(1, generator=g))
        hi = 256 if decode else T_MAX
        ts.append(0 if u < 0.05 else int(torch.randint(0, hi + 1, (1,), generator=g)))
    gd = torch.Generator(device=dev).manual_seed(seed)
    ins = []
    for s in range(world):
        idx, w = contract_route_from(gd, kind, ts[s], e, k, world)
        x = torch.randn(ts[s], h, generator=gd, device=dev).to(dtype)
        ins.append((x, idx, w))
    return ins, k, kind, ts


def _expected_dispatch(ins, me, num_local):
    xs, ids, ws = [], [], []
    for x, idx, w in ins:
        own = (idx >= 0) & (idx // num_local == me)
        sel = own.any(1)
        xs.append(x[sel])
        ids.append(torch.where(own, idx - me * num_local, -1)[sel])
        ws.append(torch.where(own, w, torch.zeros_like(w))[sel])
    rx, ri, rw = torch.cat(xs), torch.cat(ids), torch.cat(ws)
    tpe = torch.bincount(ri[ri >= 0], minlength=num_local).cpu()
    return rx, ri, rw, tpe


def _scale(d, dtype):
    return torch.tensor(0.5 + 0.25 * d, dtype=dtype)


def _bits(t):
    t = t.detach().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a, b, what, where):
    if a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
        raise AssertionError(f"{what} differs from the reference at {where}: shapes "
                             f"{tuple(a.shape)} vs {tuple(b.shape)}")


def stress_worker(rank, world, rounds, seed, torch_every, max_seconds):
    """One rank of the randomized rounds; returns counts and seconds. Stops early (on every
    rank alike, agreed through a collective) once ``max_seconds`` have passed."""
    import torch.distributed as dist

    from efa_ep.kernels import create_transport
    from efa_ep.kernels.base import collective_device

    ndev = torch.cuda.device_count()
    torch.cuda.set_device(rank % ndev)
    dev = torch.device("cuda", rank % ndev)
    per_layout = [rounds // len(LAYOUTS) + (1 if i < rounds % len(LAYOUTS) else 0)
                  for i in range(len(LAYOUTS))]
    stats = dict(rounds=0, rows_received=0, torch_checked=0, zero_token_ranks=0)
    t_start = time.time()
    for li, (e, h, dtype) in enumerate(LAYOUTS):
        if per_layout[li] == 0:
            continue
        num_local = e // world
        tr = create_transport("gda", None, e, h, T_MAX, dtype, timeout_s=60)
        ref_tr = create_transport("torch", None, e, h, T_MAX, dtype) if torch_every else None
        for r in range(per_layout[li]):
            if r % 20 == 0:
                late = torch.tensor([float(time.time() - t_start > max_seconds)],
                                    device=collective_device(None))
                dist.all_reduce(late, op=dist.ReduceOp.MAX)
                if late.item():
                    stats["stopped_early"] = True
                    break
            rs = seed * 1_000_003 + li * 10_007 + r
            ins, k, kind, ts = _round_inputs(rs, world, e, h, dtype, dev)
            where = dict(round=r, layout=(e, h, str(dtype)), k=k, kind=kind, ts=ts, rank=rank)
            x, idx, w = ins[rank]
            rx, ri, rw, tpe, handle = tr.dispatch(x, idx, w)
            ex, ei, ew, etpe = _expected_dispatch(ins, rank, num_local)
            _same(rx, ex, "recv_x", where)
            _same(ri, ei, "recv_topk_idx", where)
            _same(rw, ew, "recv_topk_weights", where)
            _same(tpe, etpe, "tokens_per_expert", where)
            # combine: destination d returns its rows scaled by c_d (in the rows' dtype)
            y = rx * _scale(rank, dtype).to(dev)
            out = tr.combine(y, handle)
            acc = torch.zeros(x.shape[0], h, dtype=torch.float32, device=dev)
            for d in range(world):
                to_d = ((idx >= 0) & (idx // num_local == d)).any(1)
                part = (x * _scale(d, dtype).to(dev)).float()
                acc = acc + torch.where(to_d[:, None], part, torch.zeros_like(part))
            _same(out, acc.to(dtype), "combine", where)
            x3 = x * _scale(3, dtype).to(dev)
            _same(tr.dispatch_cached(x3, handle), ex * _scale(3, dtype).to(dev),
                  "dispatch_cached", where)
            _same(tr.dispatch_cached(w, handle), torch.cat(
                [wi[((ii >= 0) & (ii // num_local == rank)).any(1)] for _, ii, wi in ins]),
                "dispatch_cached[T,K] float32", where)
            gw = rw * float(rank + 2)
            owner = torch.where(idx >= 0, idx // num_local, -1)
            want_w = torch.where(idx >= 0, w * (owner + 2).float(), torch.zeros_like(w))
            _same(tr.combine_topk_weights(gw, handle), want_w, "combine_topk_weights", where)
            if ref_tr is not None and r % torch_every == 0 and max(ts) <= 512:
                got = ref_tr.dispatch(x.cpu(), idx.cpu(), w.cpu())
                _same(got[0], rx.cpu(), "torch transport recv_x vs gda", where)
                _same(ref_tr.combine(y.cpu(), got[4]), out.cpu(), "torch transport combine vs gda",
                      where)
                stats["torch_checked"] += 1
            stats["rounds"] += 1
            stats["rows_received"] += rx.shape[0]
            stats["zero_token_ranks"] += int(x.shape[0] == 0)
        tr.check_errors()
        tr.close()
        if ref_tr is not None:
            ref_tr.close()
        del tr
        torch.cuda.empty_cache()
        dist.barrier()
    stats["seconds"] = time.time() - t_start
    return stats


def layer_worker(rank, world, iters, dtype, options):
    """``iters`` fresh Megatron layer pairs (torch vs gda) with fresh transports; returns the
    number of iterations whose output, x.grad and every parameter gradient were bitwise equal
    (a mismatch or an error raises)."""
    import torch.distributed as dist

    from efa_ep.dispatcher.token_dispatcher import clear_transport_cache
    from efa_ep.testing.moe_layer import gda_vs_torch_layer_worker

    done = 0
    for i in range(iters):
        gda_vs_torch_layer_worker(rank, world, dtype, seed=i, init=(i == 0), options=options)
        clear_transport_cache()
        dist.barrier()
        done += 1
    return done
