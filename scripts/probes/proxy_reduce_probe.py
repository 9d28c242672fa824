#!/usr/bin/env python3
"""How fast is the proxy's combine reduction when every row is already in the window?

One process, one GPU: :func:`~efa_ep.kernels.proxy.device.reduce_combine` of a prefill-sized
combine (``--tokens`` tokens, DeepSeek-V3 rows: H 7168 bf16, top-8 of 256 experts over
``--world`` ranks, this rank 0), this rank's own rows in device memory and every peer's
returned rows in pinned host memory (read over PCIe, as the window is), no round in flight
(``tag`` 0: nothing to wait for). Timed with CUDA events, median of ``--reps``, for each reader
count of ``--programs`` and each row block (``--blocks``: ``default`` is the package's choice,
``row`` one block spanning the whole row, so each token's rows are looked up once per rank
instead of once per block); ``--pair`` also times two reductions at once on two streams (two
ranks sharing the GPU's link). Every variant's output is checked bit for bit against the
float32 sum in rank order.

    python3 scripts/probes/proxy_reduce_probe.py [--tokens 4096] [--programs 66,132] [--pair]
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402


def _case(tokens: int, world: int, hidden: int, experts: int, topk: int, dev, seed: int = 0):
    """(send_token_idx [S] device, send_off [W + 1] pinned, y [n_0, H] device, peer rows
    [W] of [n_r, H] pinned (None for rank 0), reference out [T, H]) of a random route."""
    from efa_ep.kernels.base import compute_send_layout, reduce_rows_by_rank
    from efa_ep.testing.routes import contract_route

    idx, _ = contract_route("random", tokens, experts, topk, world, seed=seed)
    layout = compute_send_layout(idx, experts, world)
    counts = layout.num_tokens_per_rank_W.tolist()
    g = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(n, hidden, generator=g).to(torch.bfloat16) for n in counts]
    send_off = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).pin_memory()
    ref = reduce_rows_by_rank(torch.cat(blocks), layout.send_token_idx_S, counts, tokens)
    return (layout.send_token_idx_S.to(dev), send_off, blocks[0].to(dev),
            [None] + [b.pin_memory() for b in blocks[1:]], ref.to(torch.bfloat16))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--programs", default="66,132")
    ap.add_argument("--blocks", default="default,row")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pair", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from efa_ep.kernels.gda import launches
    from efa_ep.kernels.proxy import device as pdev

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    default_block = launches._block_d
    blocks = {"default": default_block,
              "row": lambda d, elem: max(16, pdev.next_pow2(d))}
    cases = [_case(a.tokens, a.world, 7168, 256, 8, dev, seed) for seed in (0, 1)]
    marks = torch.zeros(a.world, 256, dtype=torch.int32).pin_memory()
    dev_marks = torch.zeros(a.world, 256, dtype=torch.int32, device=dev)
    records = []

    # each case's peer addresses on the device once, before any side stream reads them
    ptrs_of = [torch.tensor([0] + [p.data_ptr() for p in c[3][1:]], dtype=torch.int64,
                            device=dev) for c in cases]
    torch.cuda.synchronize()

    def run(i, out, programs, stream):
        send_token_idx, send_off, y, _, _ = cases[i]
        ptrs = ptrs_of[i]
        with torch.cuda.stream(stream):
            pdev.reduce_combine(y, send_token_idx, send_off, ptrs, out, me=0, own_start=0,
                                num_programs=programs, marks=marks, dev_marks=dev_marks, tag=0)

    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    for block in a.blocks.split(","):
        launches._block_d = blocks[block]
        try:
            for programs in (int(p) for p in a.programs.split(",")):
                outs = [torch.empty(a.tokens, 7168, dtype=torch.bfloat16, device=dev)
                        for _ in cases]
                for pair in ((False, True) if a.pair else (False,)):
                    times = []
                    for rep in range(a.reps + 2):
                        torch.cuda.synchronize()
                        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
                        e0.record(s0)
                        s1.wait_event(e0)
                        run(0, outs[0], programs, s0)
                        if pair:
                            run(1, outs[1], programs, s1)
                            s0.wait_stream(s1)
                        e1.record(s0)
                        torch.cuda.synchronize()
                        if rep >= 2:
                            times.append(e0.elapsed_time(e1) * 1e3)
                    exact = all(torch.equal(outs[i].cpu(), cases[i][4])
                                for i in range(2 if pair else 1))
                    rec = dict(block=block, programs=programs, pair=pair, exact=exact,
                               median_us=statistics.median(times), min_us=min(times),
                               max_us=max(times), tokens=a.tokens, world=a.world,
                               peer_bytes=sum(p.numel() * 2 for p in cases[0][3][1:]))
                    records.append(rec)
                    print(f"block {block:7s} programs {programs:4d} {'pair' if pair else 'one '}: "
                          f"{rec['median_us']:8.1f} us [{rec['min_us']:.1f}-{rec['max_us']:.1f}] "
                          f"bit-exact {exact}; peer rows {rec['peer_bytes'] / 1e6:.1f} MB "
                          f"({rec['peer_bytes'] / rec['median_us'] / 1e3:.1f} GB/s of them)",
                          flush=True)
        finally:
            launches._block_d = default_block
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), records=records), f, indent=1)


if __name__ == "__main__":
    main()
