#!/usr/bin/env python3
"""Host cost of a token dispatcher's own code per Megatron MoE layer step (forward + backward), on
the CPU over gloo, at sizes small enough that host overhead dominates.

The layer: hidden ``--hidden`` (64), ``--experts`` (128) experts top-``--topk`` (8), expert FFN
``--ffn`` (64), ``--tokens`` (256) tokens per rank, fp32, dropless, EP ``--world`` (2) ranks as
processes. ``--dispatcher efa`` (transport ``--transport``, default ``torch``) or ``alltoall``
(Megatron's ``MoEAlltoAllTokenDispatcher``, the yardstick).

What counts as the dispatcher's own code: its six steps (forward), and in backward the autograd
nodes those steps created (found by walking the graph from each step's outputs back to its
inputs; their node hooks mark the backward). Communication is excluded: the transport's methods
(efa) or ``all_to_all_single`` and Megatron's all-gather (alltoall), wrapped with a timer.

Per layer step it reports:

- ``ops``: aten ops that reach the backend (a ``TorchDispatchMode``; CompositeImplicit ops such
  as ``.contiguous()`` on a contiguous tensor are free and not seen), and ``compute_ops`` (the
  same without view/metadata-only ops: what would launch a kernel on a GPU);
- ``host_reads``: reads of tensor values on the host inside that code (``_local_scalar_dense``:
  ``.item()``/``int()``/``bool()``; ``.tolist()``; ``.numpy()``), and ``sync_ops`` (ops whose
  output size depends on values: ``nonzero``, ``masked_select``, ... a device sync on a GPU).
  Which of them touch device tensors on a GPU is stated in RESULTS.md, by inspection;
- ``host_ms``: wall time of that code minus the time inside the communication calls, median
  over ``--steps`` steps after ``--warmup`` (a separate pass without the op counter), the
  slowest rank's; ``--repeats`` launches give n and the spread;
- a cProfile top list of one pass (per step; rank 0).

    python3 scripts/probes/dispatcher_host_profile.py [--dispatcher efa|alltoall] [--world 2]
        [--repeats 3] [--steps 20] [--tag before]
        [--repo PATH]   # import efa_ep from another checkout (a before/after comparison)

Writes ``results/dispatcher_host/<dispatcher>_<tag>.json`` (``--out`` for elsewhere) and prints
a summary line.
"""
import argparse
import collections
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
         "token_combine", "combine_postprocess")
TRANSPORT_METHODS = ("dispatch", "dispatch_fixed", "combine", "dispatch_cached",
                     "combine_topk_weights", "after_backward")
# Ops that only make a new view or change metadata: no kernel on a GPU.
VIEW_OPS = {"view", "_unsafe_view", "reshape", "alias", "detach", "t", "transpose", "permute",
            "expand", "slice", "select", "as_strided", "unsqueeze", "squeeze", "unbind", "split",
            "split_with_sizes", "narrow", "_reshape_alias", "view_as", "lift_fresh",
            "unflatten", "flatten"}
# Ops whose output size depends on tensor values: a host sync on a GPU.
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
            "unique_consecutive", "unique_dim", "argwhere", "repeat_interleave", "masked_scatter"}


class Probe:
    """Marks where the dispatcher's own code runs and where communication runs inside it."""

    def __init__(self):
        self.disp_depth = 0      # inside a dispatcher step (forward) or one of its backward nodes
        self.comm_depth = 0      # inside a communication call
        self.nodes = {}          # id -> autograd node created by the dispatcher this step
        self.disp_s = 0.0
        self.comm_s = 0.0
        self.region_s = collections.Counter()  # outermost region -> host seconds (no comm)
        self.ops = collections.Counter()
        self.region_ops = collections.Counter()  # outermost region -> ops
        self.comm_ops = 0
        self.all_ops = 0
        self.reads = collections.Counter()
        self.counting = False

    # Regions --------------------------------------------------------------------------------
    def enter(self, region):
        self.disp_depth += 1
        if self.disp_depth == 1:
            self._region, self._c0 = region, self.comm_s
            self._t0 = time.perf_counter()

    def leave(self):
        self.disp_depth -= 1
        if self.disp_depth == 0:
            dt = time.perf_counter() - self._t0
            self.disp_s += dt
            self.region_s[self._region] += dt - (self.comm_s - self._c0)

    def wrap_step(self, fn):
        probe = self

        @functools.wraps(fn)
        def step(disp, *args):
            probe.enter(fn.__name__)
            try:
                out = fn(disp, *args)
            finally:
                probe.leave()
            probe.adopt(out, args)
            return out
        return step

    def wrap_comm(self, fn):
        probe = self

        @functools.wraps(fn)
        def comm(*args, **kwargs):
            if probe.comm_depth:
                return fn(*args, **kwargs)
            probe.comm_depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                probe.comm_s += time.perf_counter() - t0
                probe.comm_depth -= 1
        return comm

    # Backward attribution -------------------------------------------------------------------
    def adopt(self, out, args):
        """Adds the autograd nodes between a step's outputs and its inputs, with hooks that mark
        their backward as dispatcher code."""
        stop = {id(a.grad_fn) for a in _tensors(args) if a.grad_fn is not None}
        todo = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or id(node) in stop or id(node) in self.nodes:
                continue
            if type(node).__name__ == "AccumulateGrad":
                continue
            self.nodes[id(node)] = node
            node.register_prehook(lambda grad_outputs: self.enter("backward"))
            node.register_hook(lambda grad_inputs, grad_outputs: self.leave())
            todo.extend(n for n, _ in node.next_functions)

    # Counting -------------------------------------------------------------------------------
    def on_op(self, name):
        self.all_ops += 1
        if self.comm_depth:
            self.comm_ops += 1
        elif self.disp_depth:
            self.ops[name] += 1
            self.region_ops[self._region] += 1

    def on_read(self, what):
        if self.counting and self.disp_depth and not self.comm_depth:
            self.reads[what] += 1

    def reset(self):
        self.nodes.clear()
        self.disp_s = self.comm_s = 0.0
        self.region_s.clear()
        self.ops.clear()
        self.region_ops.clear()
        self.reads.clear()
        self.comm_ops = self.all_ops = 0


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)


def _rank(rank, world, dispatcher, transport, shape, steps, warmup, profile, repo):
    sys.path.insert(0, repo)
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.set_num_threads(1)
    import efa_ep  # noqa: F401
    from efa_ep.dispatcher import configure

    configure(transport=transport)  # this process's settings, not its environment
    from efa_ep.tiny_moe import TinyMoEConfig, init_megatron, transformer_config

    init_megatron(world)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    probe = Probe()
    hidden, experts, topk, ffn, tokens = (shape[k] for k in ("hidden", "experts", "topk", "ffn",
                                                             "tokens"))
    torch.manual_seed(0)
    cfg = TinyMoEConfig(num_layers=1, hidden_size=hidden, num_moe_experts=experts,
                        moe_router_topk=topk, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn)
    config = transformer_config(cfg, dispatcher, world)
    layer = MoELayer(config, get_submodules(get_gpt_layer_local_submodules(
        num_experts=experts).mlp))
    layer.set_layer_number(0)
    dist.broadcast(layer.router.weight.data, src=0)
    disp = layer.token_dispatcher
    cls = type(disp)
    for name in STEPS:
        setattr(cls, name, probe.wrap_step(getattr(cls, name)))
    if dispatcher == "alltoall":
        dist.all_to_all_single = probe.wrap_comm(dist.all_to_all_single)
        mappings.dist_all_gather_func = probe.wrap_comm(mappings.dist_all_gather_func)

    # Host reads that no aten op shows (on a CPU tensor .tolist() reads memory directly).
    for meth in ("tolist", "numpy"):
        orig = getattr(torch.Tensor, meth)

        def counted(self, *a, _orig=orig, _meth=meth, **k):
            probe.on_read(_meth)
            return _orig(self, *a, **k)
        setattr(torch.Tensor, meth, counted)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            probe.on_op(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, 1, hidden, generator=gen)
    g = torch.randn(tokens, 1, hidden, generator=gen)

    def step():
        probe.reset()
        for p in layer.parameters():
            p.grad = None
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi)
        out.backward(g)

    for i in range(warmup):
        step()
        if i == 0 and dispatcher == "efa":  # the transport exists after the first dispatch
            tr = disp.transport
            for m in TRANSPORT_METHODS:
                if hasattr(tr, m):
                    setattr(tr, m, probe.wrap_comm(getattr(tr, m)))
    # Pass 1: counts (one step; the counts do not change from step to step).
    probe.counting = True
    with Count():
        step()
    probe.counting = False
    ops = dict(probe.ops)
    counts = dict(
        ops=sum(ops.values()),
        compute_ops=sum(n for k, n in ops.items() if k not in VIEW_OPS),
        sync_ops={k: n for k, n in ops.items() if k in SYNC_OPS},
        host_reads=dict(probe.reads, _local_scalar_dense=ops.get("_local_scalar_dense", 0)),
        comm_ops=probe.comm_ops, layer_ops=probe.all_ops, by_region=dict(probe.region_ops),
        by_op=dict(sorted(ops.items(), key=lambda kv: -kv[1])))
    # Pass 2: time.
    host_ms, comm_ms, step_ms, regions = [], [], [], collections.defaultdict(list)
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        host_ms.append((probe.disp_s - probe.comm_s) * 1e3)
        comm_ms.append(probe.comm_s * 1e3)
        for name, sec in probe.region_s.items():
            regions[name].append(sec * 1e3)
    # Pass 3: cProfile (rank 0 prints; every rank runs the same collectives).
    top = None
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            step()
        pr.disable()
        top = _top(pr, steps, repo)
    return dict(rank=rank, counts=counts, host_ms=statistics.median(host_ms),
                host_ms_all=[round(v, 3) for v in host_ms], comm_ms=statistics.median(comm_ms),
                step_ms=statistics.median(step_ms), cprofile=top,
                region_ms={k: statistics.median(v) for k, v in regions.items()},
                transport=getattr(getattr(disp, "transport", None), "name", None))


# Files (and Megatron helpers) whose functions the cProfile list keeps: the dispatchers' own.
MINE = ("dispatcher/", "megatron/core/transformer/moe/token_dispatcher.py",
        "megatron/core/tensor_parallel/mappings.py")
MOE_UTILS_HELPERS = ("(permute)", "(unpermute)", "(sort_chunks_by_idxs)", "(get_capacity)")


def _mine(func: str) -> bool:
    if func.startswith("megatron/core/transformer/moe/moe_utils.py"):
        return func.endswith(MOE_UTILS_HELPERS)
    return func.startswith(MINE) and "cpu_compat" not in func


def _top(pr, steps, repo, n=25):
    """Top functions by own time inside the dispatchers' files and Megatron's permutation
    helpers (per step)."""
    st = pstats.Stats(pr, stream=io.StringIO())
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        short = file.replace(repo + "/", "")
        if "site-packages/" in short:
            short = short.split("site-packages/", 1)[1]
        rows.append(dict(func=f"{short}:{line}({fn})", calls=nc / steps,
                         tottime_ms=tt * 1e3 / steps,
                         cumtime_ms=ct * 1e3 / steps))
    mine = [r for r in rows if _mine(r["func"])]
    by = lambda key: [dict(r, **{k: round(r[k], 4) for k in ("calls", "tottime_ms", "cumtime_ms")})
                      for r in sorted(mine, key=lambda r: -r[key])[:n]]
    return dict(by_tottime=by("tottime_ms"), by_cumtime=by("cumtime_ms"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dispatcher", default="efa", choices=("efa", "alltoall"))
    ap.add_argument("--transport", default="torch")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(REPO, "results", "dispatcher_host"))
    ap.add_argument("--repo", default=REPO,
                    help="checkout to import efa_ep from (a before/after comparison)")
    args = ap.parse_args()
    repo = os.path.abspath(args.repo)
    sys.path.insert(0, repo)  # the ranks inherit it: they import efa_ep from there
    import torch

    from efa_ep.distributed import run_ranks

    shape = dict(hidden=args.hidden, experts=args.experts, topk=args.topk, ffn=args.ffn,
                 tokens=args.tokens)
    runs = []
    for i in range(args.repeats):
        res = run_ranks(_rank, args.world, (args.dispatcher, args.transport, shape,
                                            args.steps, args.warmup, i == 0, repo),
                        timeout_s=900, pg_timeout_s=600)
        runs.append(res)
    first = runs[0]
    host = [max(r["host_ms"] for r in res) for res in runs]   # slowest rank, per launch
    comm = [max(r["comm_ms"] for r in res) for res in runs]
    step = [max(r["step_ms"] for r in res) for res in runs]
    c0 = first[0]["counts"]
    rec = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command="python3 " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
        host=os.uname().nodename, cpus=os.cpu_count(), load_avg=os.getloadavg(),
        torch=torch.__version__, repo=repo, dispatcher=args.dispatcher,
        transport=first[0]["transport"] if args.dispatcher == "efa" else None,
        shape=dict(shape, world=args.world, dtype="fp32", dropless=True),
        n=args.repeats, steps_per_repeat=args.steps, warmup=args.warmup,
        ops_per_step=c0["ops"], compute_ops_per_step=c0["compute_ops"],
        sync_ops_per_step=c0["sync_ops"], host_reads_per_step=c0["host_reads"],
        comm_ops_per_step=c0["comm_ops"], layer_ops_per_step=c0["layer_ops"],
        ops_per_rank=[r["counts"]["ops"] for r in first],
        host_ms=dict(median=statistics.median(host), min=min(host), max=max(host), runs=host,
                     what="dispatcher code minus communication, per step: slowest rank's median "
                          "over steps, per launch"),
        comm_ms=dict(median=statistics.median(comm), runs=comm),
        layer_step_ms=dict(median=statistics.median(step), runs=step),
        region_host_ms_rank0_first=first[0]["region_ms"], ops_by_region=c0["by_region"],
        ops_by_name=c0["by_op"], cprofile_rank0=first[0]["cprofile"])
    os.makedirs(args.out, exist_ok=True)
    name = f"{args.dispatcher}{'_' + args.tag if args.tag else ''}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(rec, f, indent=1)
    print(f"{args.dispatcher}{':' + str(rec['transport']) if rec['transport'] else ''} EP "
          f"{args.world} H {args.hidden} E {args.experts} top-{args.topk} {args.tokens} tok/rank: "
          f"{rec['ops_per_step']} ops ({rec['compute_ops_per_step']} compute) per step, host "
          f"reads {rec['host_reads_per_step']}, sync ops {rec['sync_ops_per_step']}, host "
          f"{rec['host_ms']['median']:.2f} ms [{min(host):.2f}, {max(host):.2f}] "
          f"(n={args.repeats}), comm {rec['comm_ms']['median']:.2f} ms, layer step "
          f"{rec['layer_step_ms']['median']:.1f}"
          f" ms -> {os.path.join(args.out, name)}")


if __name__ == "__main__":
    main()
