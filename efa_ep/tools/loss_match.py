"""Loss-match: does a dispatcher change training?

Trains the same tiny Megatron GPT-MoE (:mod:`efa_ep.tiny_moe`: weights seeded per global
parameter name, so the model is the same function at every EP size) on the same seeded
synthetic corpus, once per *arm*, and compares the per-step losses.

Arms (names used everywhere: config, JSON, plot, exported files):

- baselines: ``allgather`` (Megatron's all-gather dispatcher at the same EP size: the dense
  path, no expert all-to-all) and ``ep1`` (EP=1 in one process, every expert local);
- candidates: ``efa:<transport>`` for every transport in ``available_transports()`` (config
  entry ``efa:*``), and Megatron's ``alltoall`` as a control.

Every arm uses the same seeds, data order, optimizer and thread count; determinism is forced
(``torch.use_deterministic_algorithms``, fixed threads, ``CUBLAS_WORKSPACE_CONFIG`` on GPU).
The command launches its own ranks (:func:`efa_ep.distributed.run_ranks`): one launch per EP
size runs its arms one after another (a failed launch is retried one arm per launch, so one
broken transport cannot hide the others).

Output (``out_dir``): ``loss_match.json`` (config, provenance, per-arm per-step loss and grad
norm, per-candidate max abs / rel |d loss| vs each baseline, tolerances with reasons, pass/fail),
``loss_match.png`` (loss curves and per-step |d loss| on a log axis), and the last printed line
``loss-match: PASS max_rel_dloss=<x> tol=<t> steps=<n> arms=<list>`` (FAIL likewise, exit 1).

``--export-result DIR`` writes one ``<arm>.txt`` per arm with ``"<step> <repr(loss)>"`` lines;
``--import-result FILE`` adds such a file as a baseline arm ``file:<stem>``; with
``--assert-equal`` every candidate must equal every imported arm bit for bit (torchtitan's
``loss_compare.py`` pattern).

Usage::

    efa-ep-loss-match                                   # conf/loss_match/cpu.yaml
    efa-ep-loss-match --config-name gpu_bf16            # H200: bf16, 100 steps, ranks on cuda:0
    efa-ep-loss-match steps=20 arms.candidates=[alltoall] out_dir=/tmp/lm
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

SCHEMA = "efa_ep.loss_match/1"
RESULT_LINE = "loss-match:"


# ----------------------------------------------------------------------------------------------
# Arms
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Arm:
    """One training run.

    Attributes:
        name: ``allgather``, ``ep1``, ``alltoall``, ``efa:<transport>`` or ``file:<stem>``.
        role: ``baseline`` or ``candidate``.
        dispatcher: Megatron ``moe_token_dispatcher_type``.
        ep_size: expert-parallel size (= ranks launched; TP=PP=1, so DP = EP).
        transport: efa transport name (``efa`` arms only).
        transport_options: knobs passed to the transport (``EFA_EP_TRANSPORT_OPTIONS``).
    """

    name: str
    role: str
    dispatcher: str
    ep_size: int
    transport: Optional[str] = None
    transport_options: tuple = ()


def resolve_arms(cfg: Dict[str, Any], available: Sequence[str]) -> List[Arm]:
    """Turns ``cfg["arms"]`` into :class:`Arm` objects; ``efa:*`` expands to ``available``."""
    ep = int(cfg["ep_size"])
    opts_by_transport = cfg["arms"].get("transport_options") or {}
    out: List[Arm] = []
    for role, key in (("baseline", "baselines"), ("candidate", "candidates")):
        for spec in cfg["arms"].get(key) or []:
            names = [f"efa:{t}" for t in available] if spec == "efa:*" else [spec]
            for name in names:
                if name == "ep1":
                    arm = Arm(name, role, "allgather", 1)
                elif name in ("allgather", "alltoall"):
                    arm = Arm(name, role, name, ep)
                elif name.startswith("efa:"):
                    t = name.split(":", 1)[1]
                    arm = Arm(name, role, "efa", ep, t,
                              tuple(sorted((opts_by_transport.get(t) or {}).items())))
                else:
                    raise ValueError(f"arms.{key} entry {name!r} is not one of ep1, allgather, "
                                     f"alltoall, efa:<transport>, efa:*")
                if any(a.name == arm.name for a in out):
                    raise ValueError(f"arm {arm.name!r} is listed twice")
                out.append(arm)
    if not any(a.role == "baseline" for a in out):
        raise ValueError("arms.baselines is empty: a loss-match needs at least one baseline")
    if not any(a.role == "candidate" for a in out):
        raise ValueError("arms.candidates is empty (no transport available?)")
    return out


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


# ----------------------------------------------------------------------------------------------
# Data: a seeded Markov corpus (learnable: the loss falls towards the chain's entropy)
# ----------------------------------------------------------------------------------------------
def make_corpus(vocab: int, length: int, num_seqs: int, seed: int, branching: int):
    """``[num_seqs, length]`` int64 token ids from a fixed random Markov chain.

    Each token has ``branching`` possible successors with random (seeded) probabilities, so a
    model can learn the transition table: the optimal loss is the chain's conditional entropy
    (< log(branching)), far below the initial ~log(vocab).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    succ = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
    probs = torch.rand(vocab, branching, generator=g) + 0.1
    probs = probs / probs.sum(1, keepdim=True)
    cur = torch.randint(0, vocab, (num_seqs,), generator=g)
    cols = [cur]
    for _ in range(length - 1):
        pick = torch.multinomial(probs[cur], 1, generator=g).squeeze(1)
        cur = succ[cur, pick]
        cols.append(cur)
    return torch.stack(cols, dim=1)


def markov_entropy(vocab: int, seed: int, branching: int) -> float:
    """Conditional entropy (nats) of the chain, averaged uniformly over states: a loss floor."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(vocab):
        torch.randperm(vocab, generator=g)
    probs = torch.rand(vocab, branching, generator=g) + 0.1
    probs = probs / probs.sum(1, keepdim=True)
    return float(-(probs * probs.log()).sum(1).mean())


# ----------------------------------------------------------------------------------------------
# Rank side
# ----------------------------------------------------------------------------------------------
def _force_determinism(cfg: Dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(int(cfg["num_threads"]))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


class _DropLastRankPartial:
    """Fault injection (self-test only): a transport whose combine drops the last rank's
    partial sums, i.e. what a combine that forgets one source would do."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, item):
        return getattr(self._inner, item)

    def combine(self, y, handle):
        if self._inner.rank == self._inner.world_size - 1:
            y = y * 0
        return self._inner.combine(y, handle)


def _apply_fault(model, fault: Dict[str, Any], seed: int) -> None:
    """``weight_noise``: every parameter p <- p * (1 + scale * n), n ~ N(0, 1) seeded per name."""
    import torch

    if fault["kind"] == "weight_noise":
        scale = float(fault.get("scale", 1e-3))
        with torch.no_grad():
            for name, p in model.named_parameters():
                digest = hashlib.sha256(f"fault:{seed}:{name}".encode()).digest()
                g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
                noise = torch.randn(p.shape, generator=g).to(device=p.device, dtype=torch.float32)
                p.copy_((p.float() * (1 + scale * noise)).to(p.dtype))


def _param_digest(model) -> str:
    """sha256 over this rank's parameters (names and raw bytes), for bitwise comparisons."""
    import torch

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train_arm(rank: int, cfg: Dict[str, Any], arm: Arm, corpus, fault) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from efa_ep.dispatcher import settings as dsettings
    from efa_ep.dispatcher import token_dispatcher
    from efa_ep.kernels.base import collective_device
    from efa_ep.tiny_moe import TinyMoEConfig, build_gpt_moe, causal_inputs, is_expert_param, sync_grads

    mcfg = TinyMoEConfig(**cfg["model"])
    device = torch.device(cfg["device"])
    # Arm-specific dispatcher settings, reset between arms (env is what NeMo-RL workers see too).
    if arm.transport is not None:
        os.environ["EFA_EP_TRANSPORT"] = arm.transport
        os.environ["EFA_EP_TRANSPORT_OPTIONS"] = ",".join(f"{k}={v}" for k, v in arm.transport_options)
    else:
        os.environ.pop("EFA_EP_TRANSPORT", None)
        os.environ.pop("EFA_EP_TRANSPORT_OPTIONS", None)
    dsettings.reset()
    token_dispatcher.clear_transport_cache()
    faulted = fault is not None and fault.get("arm") == arm.name
    original_get = token_dispatcher.get_shared_transport
    if faulted and fault["kind"] == "drop_partial":
        token_dispatcher.get_shared_transport = lambda *a, **k: _DropLastRankPartial(original_get(*a, **k))

    torch.manual_seed(cfg["seed"])
    if device.type == "cuda":
        torch.cuda.manual_seed_all(cfg["seed"])
    model = build_gpt_moe(mcfg, dispatcher=arm.dispatcher, device=device)
    if faulted and fault["kind"] == "weight_noise":
        _apply_fault(model, fault, cfg["seed"])
    params = [p for p in model.parameters() if p.requires_grad]
    low_precision = mcfg.dtype != "fp32"
    # Mixed precision as Megatron does it: fp32 master weights, model weights a rounded copy.
    master = [p.detach().float().clone().requires_grad_(True) for p in params] if low_precision else params
    opt_cfg = cfg["optimizer"]
    opt = torch.optim.Adam(master, lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]),
                           eps=opt_cfg["eps"], weight_decay=opt_cfg["weight_decay"])
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    ep_group = parallel_state.get_expert_model_parallel_group()
    gb = int(cfg["global_batch"])
    if gb % dp_size:
        raise ValueError(f"global_batch={gb} must be a multiple of the data-parallel size {dp_size}")
    per = gb // dp_size
    losses: List[float] = []
    grad_norms: List[float] = []
    # Routing record: the experts each router picked, per step, to find routing flips (a
    # near-tied top-k choice that flips turns a 1e-7 weight difference into a loss jump).
    routed: List[Any] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: routed.append(out[1].detach()))
             for m in model.modules() if type(m).__name__ == "TopKRouter"]
    routing_steps: List[Any] = []
    t0 = time.perf_counter()
    try:
        for step in range(int(cfg["steps"])):
            routed.clear()
            batch = corpus[step * gb:(step + 1) * gb][dp_rank * per:(dp_rank + 1) * per].to(device)
            tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            position_ids, mask = causal_inputs(tokens)
            for p in params:
                p.grad = None
            per_token = model(tokens, position_ids, mask, labels=labels)  # [B, S] float
            per_token.float().mean().backward()
            sync_grads(model)
            routing_steps.append(_gather_routing(routed, tokens.shape, dp_group, dp_size))
            # Reported loss: float64 sum over the global batch / count (same for every arm).
            # Tensors of a collective live on the group's device (NCCL has no CPU backend).
            total = per_token.detach().double().sum().reshape(1).to(collective_device(dp_group))
            if dp_size > 1:
                dist.all_reduce(total, group=dp_group)
            losses.append(float(total) / (gb * tokens.shape[1]))
            # Grad norm over the whole model: dense grads are replicated, expert grads sharded.
            norm_device = collective_device(ep_group)
            dense_sq = torch.zeros(1, dtype=torch.float64, device=norm_device)
            expert_sq = torch.zeros(1, dtype=torch.float64, device=norm_device)
            for p in params:
                if p.grad is not None:
                    sq = p.grad.detach().double().pow(2).sum().to(norm_device)
                    if is_expert_param(p):
                        expert_sq += sq
                    else:
                        dense_sq += sq
            if dist.get_world_size(ep_group) > 1:
                dist.all_reduce(expert_sq, group=ep_group)
            grad_norms.append(math.sqrt(float(dense_sq + expert_sq)))
            if low_precision:
                for m, p in zip(master, params):
                    m.grad = None if p.grad is None else p.grad.float()
            opt.step()
            if low_precision:
                with torch.no_grad():
                    for m, p in zip(master, params):
                        p.copy_(m.to(p.dtype))
    finally:
        token_dispatcher.get_shared_transport = original_get
        for h in hooks:
            h.remove()
    seconds = time.perf_counter() - t0
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _param_digest(model))
    token_dispatcher.clear_transport_cache()
    return {"name": arm.name, "losses": losses, "grad_norms": grad_norms,
            "param_sha256": digests, "train_seconds": round(seconds, 3), "error": None,
            "_routing": routing_steps}


def _gather_routing(routed, tokens_shape, dp_group, dp_size):
    """Per-router ``routing_map [S*B_local, E]`` -> ``[layers, B_global, S, K]`` uint8 expert ids
    (sorted), gathered over the data-parallel ranks (rank r holds batch rows r*B_local...)."""
    import numpy as np
    import torch.distributed as dist

    b, s = tokens_shape
    layers = []
    for rmap in routed:
        ids = rmap.to("cpu").nonzero()[:, 1].view(s * b, -1)  # [S*B, K]: sb-major (Megatron [S, B])
        layers.append(ids.view(s, b, -1).permute(1, 0, 2).numpy().astype(np.uint8))
    mine = np.stack(layers) if layers else np.zeros((0, b, s, 0), np.uint8)
    if dp_size == 1:
        return mine
    parts = [None] * dp_size
    dist.all_gather_object(parts, mine, group=dp_group)
    return np.concatenate(parts, axis=1)


def _rank_main(rank: int, world: int, cfg: Dict[str, Any], arms: List[Arm], out_dir: str,
               fault) -> List[str]:
    """Runs ``arms`` (all with ep_size == world) one after another; rank 0 writes one JSON per
    finished arm into ``out_dir/arms/`` so a later failure keeps the finished ones."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")  # Megatron's "Apex/TE not installed" and deprecation noise
    logging.getLogger("megatron").setLevel(logging.ERROR)
    _force_determinism(cfg)
    if cfg["device"] == "cuda":  # one rank per GPU (what an NCCL group needs)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    elif cfg["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(cfg["device"]))
    import efa_ep  # noqa: F401,E501  (registers the efa dispatcher)
    from efa_ep.tiny_moe import init_megatron

    init_megatron(world, seed=cfg["seed"])
    d = cfg["data"]
    corpus = make_corpus(cfg["model"]["vocab_size"], cfg["model"]["seq_length"] + 1,
                         int(cfg["steps"]) * int(cfg["global_batch"]), d["seed"], d["branching"])
    done = []
    for arm in arms:
        result = _train_arm(rank, cfg, arm, corpus, fault)
        if rank != 0:
            result.pop("_routing", None)
        if rank == 0:
            import numpy as np

            routing = result.pop("_routing")
            np.save(os.path.join(out_dir, "arms", safe_name(arm.name) + ".routing.npy"),
                    np.stack(routing) if routing else np.zeros((0,), np.uint8))
            path = os.path.join(out_dir, "arms", safe_name(arm.name) + ".json")
            with open(path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(path + ".tmp", path)
        done.append(arm.name)
    return done


# ----------------------------------------------------------------------------------------------
# Parent side: launches, comparison, report
# ----------------------------------------------------------------------------------------------
def run_arms(cfg: Dict[str, Any], arms: List[Arm], out_dir: str, fault=None,
             log=print) -> Dict[str, Dict[str, Any]]:
    """Trains every arm (one launch per EP size, retried per arm on failure); returns
    ``{arm name: result dict}`` with ``error`` set for arms that failed."""
    from efa_ep.distributed import run_ranks

    os.makedirs(os.path.join(out_dir, "arms"), exist_ok=True)
    for a in arms:
        stale = os.path.join(out_dir, "arms", safe_name(a.name) + ".json")
        if os.path.exists(stale):
            os.remove(stale)
    env = {"FI_TCP_IFACE": os.environ.get("FI_TCP_IFACE", "lo"),
           "OMP_NUM_THREADS": str(cfg["num_threads"]), "PYTHONWARNINGS": "ignore"}
    by_ep: Dict[int, List[Arm]] = {}
    for a in arms:
        by_ep.setdefault(a.ep_size, []).append(a)

    def load(a: Arm):
        path = os.path.join(out_dir, "arms", safe_name(a.name) + ".json")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        return None

    def launch(group: List[Arm]) -> Optional[str]:
        log(f"[loss-match] launching EP={group[0].ep_size} ranks for arms "
            f"{[a.name for a in group]}", file=sys.stderr)
        res = run_ranks(_rank_main, group[0].ep_size, (cfg, group, out_dir, fault),
                        backend=cfg["backend"], timeout_s=float(cfg["timeout_s"]),
                        pg_timeout_s=float(cfg["pg_timeout_s"]), env=env, raise_on_error=False)
        bad = [f"rank {r}: {val}" for r, (ok, val) in enumerate(res) if not ok]
        return "\n".join(bad) if bad else None

    results: Dict[str, Dict[str, Any]] = {}
    for ep, group in by_ep.items():
        groups = [[a] for a in group] if cfg.get("isolate_arms") else [group]
        for g in groups:
            err = launch(g)
            missing = [a for a in g if load(a) is None]
            if err and len(g) > 1 and missing:
                log(f"[loss-match] EP={ep} launch failed; retrying {[a.name for a in missing]} "
                    f"one per launch", file=sys.stderr)
                for a in missing:
                    e = launch([a])
                    if load(a) is None:
                        results[a.name] = {"name": a.name, "error": e or "no result written"}
            elif missing:
                for a in missing:
                    results[a.name] = {"name": a.name, "error": err or "no result written"}
    for a in arms:
        r = load(a)
        if r is not None:
            results[a.name] = r
        elif a.name not in results:
            results[a.name] = {"name": a.name, "error": "no result"}
    return results


def load_routing(out_dir: str, name: str):
    """``[steps, layers, B_global, S, K]`` uint8 expert ids of arm ``name``, or None."""
    import numpy as np

    path = os.path.join(out_dir, "arms", safe_name(name) + ".routing.npy")
    return np.load(path) if os.path.exists(path) else None


def routing_diff(a, b) -> Optional[Dict[str, Any]]:
    """Per step, how many (layer, token) routing decisions differ between two arms."""
    import numpy as np

    if a is None or b is None or a.shape != b.shape or a.size == 0:
        return None
    per_step = (np.sort(a, -1) != np.sort(b, -1)).any(-1).reshape(a.shape[0], -1).sum(1)
    nz = np.nonzero(per_step)[0]
    return {"decisions_per_step": int(np.prod(a.shape[1:-1])),
            "first_flip_step": int(nz[0]) if nz.size else None,
            "flips_per_step": [int(x) for x in per_step],
            "total_flips": int(per_step.sum())}


def _dloss(cand: Sequence[float], base: Sequence[float]):
    n = min(len(cand), len(base))
    abs_d = [abs(cand[i] - base[i]) for i in range(n)]
    rel_d = [abs_d[i] / abs(base[i]) if base[i] != 0 else (0.0 if abs_d[i] == 0 else math.inf)
             for i in range(n)]
    return abs_d, rel_d


def compare(arms: List[Arm], results: Dict[str, Dict[str, Any]], tol: Dict[str, Any],
            steps: int, assert_equal_to: Sequence[str] = (), routing=None) -> Dict[str, Any]:
    """The verdict. Checks, each recorded with its outcome:

    - every arm finished all ``steps`` with finite losses;
    - each candidate vs each baseline: max |d loss| / |baseline loss| <= ``max_rel_dloss`` and
      max |d loss| <= ``max_abs_dloss`` (a null tolerance is not checked);
      ``per_baseline.<name>`` overrides them for one baseline (``gate: false`` reports that
      baseline's comparison without failing on it);
    - ``bitwise``: each ``efa:*`` arm equals the control arm bit for bit (losses, grad norms and
      final parameters of every rank);
    - ``assert_equal_to``: candidates equal those (imported) arms bit for bit.
    """
    failures: List[str] = []
    ok_arms = []
    for a in arms:
        r = results.get(a.name, {})
        if r.get("error"):
            failures.append(f"arm {a.name} failed: {r['error'].strip().splitlines()[-1][:300]}")
        elif len(r.get("losses", [])) != steps:
            failures.append(f"arm {a.name} has {len(r.get('losses', []))} of {steps} steps")
        elif not all(math.isfinite(x) for x in r["losses"]):
            failures.append(f"arm {a.name} has non-finite losses")
        else:
            ok_arms.append(a.name)
    comparisons = []
    routing = routing or {}
    for c in [a for a in arms if a.role == "candidate" and a.name in ok_arms]:
        for b in [a for a in arms if a.role == "baseline" and a.name in ok_arms]:
            t = {**tol, **((tol.get("per_baseline") or {}).get(b.name) or {})}
            rel_tol, abs_tol = t.get("max_rel_dloss"), t.get("max_abs_dloss")
            abs_d, rel_d = _dloss(results[c.name]["losses"], results[b.name]["losses"])
            i_abs = max(range(len(abs_d)), key=abs_d.__getitem__)
            i_rel = max(range(len(rel_d)), key=rel_d.__getitem__)
            within = (rel_tol is None or rel_d[i_rel] <= rel_tol) and (abs_tol is None or abs_d[i_abs] <= abs_tol)
            gated = t.get("gate", True)
            ok = within or not gated
            comparisons.append({
                "candidate": c.name, "baseline": b.name, "max_abs_dloss": abs_d[i_abs],
                "max_abs_step": i_abs, "max_rel_dloss": rel_d[i_rel], "max_rel_step": i_rel,
                "first_nonzero_step": next((i for i, d in enumerate(abs_d) if d != 0), None),
                "tol_rel": rel_tol, "tol_abs": abs_tol, "gated": gated, "within_tol": within,
                "routing": routing_diff(routing.get(c.name), routing.get(b.name)),
                "abs_dloss": abs_d, "pass": ok})
            if not ok:
                failures.append(
                    f"{c.name} vs {b.name}: max rel |dloss| {rel_d[i_rel]:.3e} (step {i_rel}), "
                    f"max abs {abs_d[i_abs]:.3e} (step {i_abs}) > tol rel={rel_tol} abs={abs_tol}")
    # Spread between the baselines themselves: the floor any candidate is measured against.
    spread = []
    bases = [a.name for a in arms if a.role == "baseline" and a.name in ok_arms]
    for i, b1 in enumerate(bases):
        for b2 in bases[i + 1:]:
            abs_d, rel_d = _dloss(results[b1]["losses"], results[b2]["losses"])
            spread.append({"a": b1, "b": b2, "max_abs_dloss": max(abs_d), "max_rel_dloss": max(rel_d),
                           "routing": routing_diff(routing.get(b1), routing.get(b2))})
    bitwise = []
    bw = tol.get("bitwise") or {}
    if bw.get("enabled"):
        control = bw.get("control", "alltoall")
        for c in [a for a in arms if a.name.startswith("efa:") and a.name in ok_arms]:
            if control not in ok_arms:
                failures.append(f"bitwise check of {c.name}: control arm {control!r} missing")
                continue
            rc, rb = results[c.name], results[control]
            same_loss = rc["losses"] == rb["losses"]
            same_gn = rc["grad_norms"] == rb["grad_norms"]
            same_params = rc.get("param_sha256") == rb.get("param_sha256")
            ok = same_loss and same_gn and same_params
            bitwise.append({"candidate": c.name, "control": control, "identical_losses": same_loss,
                            "identical_grad_norms": same_gn, "identical_final_params": same_params,
                            "pass": ok})
            if not ok:
                failures.append(f"{c.name} vs {control}: not bitwise identical (losses {same_loss}, "
                                f"grad norms {same_gn}, final params {same_params})")
    for ref in assert_equal_to:
        for c in [a for a in arms if a.role == "candidate" and a.name in ok_arms]:
            if results[c.name]["losses"] != results[ref]["losses"]:
                failures.append(f"--assert-equal: {c.name} differs from {ref}")
    gated_cmp = [c for c in comparisons if c["gated"]]
    max_rel = max((c["max_rel_dloss"] for c in gated_cmp), default=math.nan)
    max_abs = max((c["max_abs_dloss"] for c in gated_cmp), default=math.nan)
    return {"pass": not failures, "failures": failures, "max_rel_dloss": max_rel,
            "max_abs_dloss": max_abs, "steps": steps, "arms": [a.name for a in arms],
            "comparisons": comparisons, "baseline_spread": spread, "bitwise": bitwise}


def result_line(verdict: Dict[str, Any], tol: Dict[str, Any]) -> str:
    """``loss-match: PASS max_rel_dloss=<x> tol=<t>[,<baseline>:<t>] steps=<n> arms=<list>``.

    ``max_rel_dloss`` is the largest over every candidate/baseline pair; ``tol`` lists the
    default tolerance and each per-baseline override; ``worst=`` names the pair closest to (or
    furthest past) its own tolerance."""
    def fmt(t):
        return "none" if t is None else f"{t:g}"

    rel_tol, abs_tol = tol.get("max_rel_dloss"), tol.get("max_abs_dloss")
    per = tol.get("per_baseline") or {}
    def per_fmt(v, key, default):
        return "info" if not v.get("gate", True) else fmt(v.get(key, default))

    t = fmt(rel_tol) + "".join(f",{b}:{per_fmt(v, 'max_rel_dloss', rel_tol)}" for b, v in per.items())
    line = (f"{RESULT_LINE} {'PASS' if verdict['pass'] else 'FAIL'} "
            f"max_rel_dloss={verdict['max_rel_dloss']:.3e} tol={t}")
    if abs_tol is not None or any("max_abs_dloss" in v for v in per.values()):
        ta = fmt(abs_tol) + "".join(f",{b}:{per_fmt(v, 'max_abs_dloss', abs_tol)}" for b, v in per.items())
        line += f" max_abs_dloss={verdict['max_abs_dloss']:.3e} abs_tol={ta}"
    worst, ratio = None, -1.0
    for c in verdict.get("comparisons", []):
        if not c.get("gated", True):
            continue
        for d, tl in ((c["max_rel_dloss"], c["tol_rel"]), (c["max_abs_dloss"], c["tol_abs"])):
            if tl:
                r = d / tl
                if r > ratio:
                    worst, ratio = f"{c['candidate']}~{c['baseline']}({r:.2g}xtol)", r
    if worst:
        line += f" worst={worst}"
    return line + f" steps={verdict['steps']} arms={','.join(verdict['arms'])}"


def plot(path: str, arms: List[Arm], results, verdict, title: str) -> Optional[str]:
    """Loss curves (top) and per-step |d loss| of each candidate vs each baseline (log axis)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    for a in arms:
        r = results.get(a.name, {})
        if r.get("losses"):
            ax1.plot(r["losses"], label=f"{a.name} ({a.role}, EP={a.ep_size})",
                     linestyle="-" if a.role == "baseline" else "--")
    ax1.set_ylabel("loss (global batch mean)")
    ax1.legend(fontsize=8)
    ax1.set_title(title, fontsize=10)
    floor = 1e-17
    for c in verdict["comparisons"]:
        d = [x if x > 0 else floor for x in c["abs_dloss"]]
        zeros = sum(1 for x in c["abs_dloss"] if x == 0)
        ax2.semilogy(d, marker=".", linewidth=0.8,
                     label=f"{c['candidate']} vs {c['baseline']}"
                           + (f" ({zeros} steps exactly 0, drawn at {floor:g})" if zeros else ""))
    ax2.set_ylabel("|d loss| (log)")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def export_result(directory: str, results) -> List[str]:
    """One ``<arm>.txt`` per arm: ``"<step> <repr(loss)>"`` per line."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, r in results.items():
        if r.get("losses"):
            p = os.path.join(directory, safe_name(name) + ".txt")
            with open(p, "w") as f:
                f.writelines(f"{i} {x!r}\n" for i, x in enumerate(r["losses"]))
            paths.append(p)
    return paths


def import_result(path: str) -> List[float]:
    """Reads a ``"<step> <loss>"`` file; steps must be 0, 1, 2, ..."""
    losses = []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            step, value = line.split()
            if int(step) != len(losses):
                raise ValueError(f"{path}:{n + 1}: expected step {len(losses)}, got {step}")
            losses.append(float(value))
    return losses


def run(cfg: Dict[str, Any], *, fault=None, import_paths: Sequence[str] = (),
        assert_equal: bool = False, export_dir: Optional[str] = None, log=print) -> Dict[str, Any]:
    """The whole command minus argument parsing: returns the report dict (also written)."""
    from efa_ep.kernels import available_transports
    from .provenance import collect

    out_dir = os.path.abspath(cfg["out_dir"])
    os.makedirs(out_dir, exist_ok=True)
    available = available_transports()
    only = cfg["arms"].get("transports")
    if only:
        available = [t for t in available if t in only]
    arms = resolve_arms(cfg, available)
    t0 = time.perf_counter()
    results = run_arms(cfg, arms, out_dir, fault=fault, log=log)
    imported = []
    for p in import_paths:
        name = "file:" + os.path.splitext(os.path.basename(p))[0]
        arms.append(Arm(name, "baseline", "imported", 0))
        results[name] = {"name": name, "losses": import_result(p), "grad_norms": [], "error": None}
        imported.append(name)
    tol = cfg["tolerance"]
    routing = {a.name: load_routing(out_dir, a.name) for a in arms}
    verdict = compare(arms, results, tol, int(cfg["steps"]),
                      assert_equal_to=imported if assert_equal else (), routing=routing)
    report = {
        "schema": SCHEMA, "config": cfg, "fault": fault, "provenance": collect(),
        "available_transports": available, "wall_seconds": round(time.perf_counter() - t0, 1),
        "loss_floor_markov_entropy": markov_entropy(cfg["model"]["vocab_size"], cfg["data"]["seed"],
                                                    cfg["data"]["branching"]),
        "arms": {a.name: {**dataclasses.asdict(a), **results.get(a.name, {})} for a in arms},
        "tolerance": tol, "verdict": {k: v for k, v in verdict.items() if k != "comparisons"},
        "comparisons": verdict["comparisons"],
    }
    report["result_line"] = result_line(verdict, tol)
    for r in results.values():
        r.pop("_routing", None)
    with open(os.path.join(out_dir, "loss_match.json"), "w") as f:
        json.dump(report, f, indent=1)
    m = cfg["model"]
    title = (f"loss-match {m['dtype']} {cfg['device']} EP={cfg['ep_size']} steps={cfg['steps']} "
             f"L={m['num_layers']} E={m['num_moe_experts']} top{m['moe_router_topk']} "
             f"H={m['hidden_size']}: {'PASS' if verdict['pass'] else 'FAIL'}")
    report["plot"] = plot(os.path.join(out_dir, "loss_match.png"), arms, results, verdict, title)
    if export_dir:
        report["exported"] = export_result(export_dir, results)
    return report


def _flip_text(r) -> str:
    if not r:
        return ""
    if r["first_flip_step"] is None:
        return "; routing identical"
    return (f"; routing flips: {r['total_flips']} of {r['decisions_per_step']}x{len(r['flips_per_step'])}"
            f" token-layer decisions, first at step {r['first_flip_step']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .config import config_names

    parser = argparse.ArgumentParser(
        prog="efa-ep-loss-match",
        usage="efa-ep-loss-match [--config-name NAME] [options] [key=value ...]",
        description="Train the same tiny Megatron GPT-MoE once per dispatcher arm (Megatron's "
                    "allgather and EP=1 as baselines; efa on every transport usable here and "
                    "Megatron's alltoall as candidates) and compare the per-step losses. Prints "
                    "PASS/FAIL last; exit 0 on PASS, 1 on FAIL, 2 for a bad setting.",
        epilog=f"""\
configs (--config-name, efa_ep/conf/loss_match/): {', '.join(config_names('loss_match'))}
  cpu (default): fp32, EP 2 over gloo, 50 steps; about 3-5 minutes on a 2-core CPU machine
  ci: the same, 20 steps (what tests/test_loss_match.py runs); about 1-2 minutes
  gpu_bf16: bf16, 100 steps, both ranks on cuda:0
overrides (key=value, any key of the config), e.g.:
  steps=20 ep_size=4 arms.candidates=[alltoall] out_dir=/tmp/lm
output: <out_dir>/loss_match.json (every loss, the comparisons, provenance) and
  <out_dir>/loss_match.png; out_dir defaults to ./loss_match_out (ci: ./loss_match_ci)""",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", default="cpu", metavar="NAME",
                        help="a config of efa_ep/conf/loss_match (default cpu)")
    parser.add_argument("--export-result", metavar="DIR",
                        help="also write one <arm>.txt per arm, 'step loss' per line")
    parser.add_argument("--import-result", metavar="FILE", action="append", default=[],
                        help="add a 'step loss' file from an earlier run as a baseline arm "
                             "(repeatable)")
    parser.add_argument("--assert-equal", action="store_true",
                        help="every candidate must equal every imported arm bit for bit")
    parser.add_argument("--fault", choices=["weight_noise", "drop_partial"],
                        help="self-test: perturb --fault-arm so that the check must FAIL")
    parser.add_argument("--fault-arm", default="efa:torch", metavar="ARM",
                        help="the arm --fault perturbs (default efa:torch)")
    parser.add_argument("--fault-scale", type=float, default=1e-3, metavar="X",
                        help="size of the weight_noise perturbation (default 1e-3)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    from efa_ep.kernels.options import ConfigError
    from .config import compose

    try:
        cfg = compose("loss_match", args.config_name, args.overrides)
    except ConfigError as e:
        print(f"efa-ep-loss-match: error: {e}", file=sys.stderr)
        if e.hint:
            print(f"  hint: {e.hint}", file=sys.stderr)
        return 2
    fault = None
    if args.fault:
        fault = {"kind": args.fault, "arm": args.fault_arm, "scale": args.fault_scale}
    try:
        report = run(cfg, fault=fault, import_paths=args.import_result,
                     assert_equal=args.assert_equal, export_dir=args.export_result)
    except Exception:
        traceback.print_exc()
        print(f"{RESULT_LINE} FAIL error (see traceback above)")
        return 1
    v = report["verdict"]
    for c in report["comparisons"]:
        print(f"  {c['candidate']:>14} vs {c['baseline']:<10} max_abs={c['max_abs_dloss']:.3e} "
              f"max_rel={c['max_rel_dloss']:.3e} (step {c['max_rel_step']}) "
              f"tol={c['tol_rel'] if c['tol_rel'] is not None else c['tol_abs']} "
              f"{('ok' if c['within_tol'] else 'OVER') if c['gated'] else 'info (not gated)'}"
              f"{_flip_text(c['routing'])}")
    for s in v["baseline_spread"]:
        print(f"  baseline spread {s['a']} vs {s['b']}: max_abs={s['max_abs_dloss']:.3e} "
              f"max_rel={s['max_rel_dloss']:.3e}{_flip_text(s['routing'])}")
    for b in v["bitwise"]:
        print(f"  bitwise {b['candidate']} vs {b['control']}: "
              f"{'identical' if b['pass'] else 'DIFFERENT'} (losses {b['identical_losses']}, "
              f"grad norms {b['identical_grad_norms']}, params {b['identical_final_params']})")
    for f in v["failures"]:
        print(f"  FAIL: {f}")
    print(f"  report: {os.path.join(os.path.abspath(cfg['out_dir']), 'loss_match.json')}")
    print(report["result_line"], flush=True)
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
