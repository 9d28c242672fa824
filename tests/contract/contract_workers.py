"""Rank workers of the transport conformance suite (``tests/contract``).

Every function named ``*_worker`` runs in each rank of :func:`efa_ep.distributed.run_ranks`
(spawned processes, gloo group on loopback) and returns plain data (strings, lists, dicts) for
the test process to assert on; the assertions live in ``test_contract_*.py`` so that every case
has its own test id per transport. Spawning ranks is most of the suite's time, so one launch
per transport runs every case of one kind:

- :func:`healthy_worker`: the contract cases (dispatch, combine, dispatch_cached,
  combine_topk_weights bit for bit against the brute-force reference of
  ``efa_ep/testing/reference.py``) and the bad-input cases (the transport stays usable).
- :func:`fault_worker`: ranks running different operations, a tampered header / write, a peer
  that skips a call, a peer that exits (last: the world is one rank short afterwards). Each
  fault runs on a fresh transport over a fresh group whose timeout is the transport's deadline
  (``torch`` and ``hier`` wait as long as their group's timeout; ``proxy`` waits ``timeout_s``).

Symbols as in ``kernels/base.py``: W ranks, E experts, L = E / W, T tokens, K top-k, H hidden.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Dict, List, Optional

import torch

#: the contract's error classes, most specific first (names travel back to the test process)
ERROR_KINDS = ("TooManyTokensError", "DispatchInputError", "PeerFailure", "ProtocolError",
               "TransportBroken", "TransportError")
#: every transport the suite knows (gda needs a CUDA GPU; the tests mark it); gda-window is gda
#: with its option rows_in_window (the dispatch's rows stored compact, read in the window)
TRANSPORTS = ("torch", "proxy", "hier", "gda", "gda-window")
VARIANTS = {"gda-window": ("gda", {"rows_in_window": 1})}


def base_name(name: str) -> str:
    """The transport a suite name runs (``gda-window`` -> ``gda``)."""
    return VARIANTS.get(name, (name,))[0]
OPS = ("dispatch", "combine", "dispatch_cached", "combine_topk_weights")

# Sizes of the healthy launch: E experts over W ranks (hier: 2 emulated nodes of W/2 ranks).
HEALTHY_WORLD = 4
EXPERTS = 16
HIDDEN = 8
T_MAX = 24
KS = (1, 2, 3, 8)
ROUTE_KINDS = ("random", "hot_experts", "one_rank", "dropped")

# The fault launch: 2 ranks (hier: 2 emulated nodes of one rank), deadline of every wait.
FAULT_WORLD = 2
DEADLINE_S = 4.0
#: a peer that fails must be reported within the deadline plus this (a loaded 2-core host)
SLACK_S = 4.0
BAD_RANK = 1

ENV = {"FI_TCP_IFACE": "lo", "FI_PROVIDER": "tcp", "OMP_NUM_THREADS": "1",
       "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}


def transport_options(name: str, world: int, deadline_s: float = DEADLINE_S) -> dict:
    """The options each transport runs with here: loopback tcp, small chunks (many descriptors
    per message) and a short deadline where the transport has one of its own."""
    if name == "proxy":
        return dict(provider="tcp", num_channels=2, chunk_bytes=512, timeout_s=deadline_s)
    if name == "hier":
        # CPU tensors (device_of), so a torch local stage on every machine: "auto" would take
        # gda where a GPU is visible, which refuses CPU rows
        return dict(node_size=max(1, world // 2), network="proxy", local="torch", provider="tcp",
                    num_channels=1, chunk_bytes=512, timeout_s=deadline_s)
    if base_name(name) == "gda":
        return dict(timeout_s=deadline_s, **VARIANTS.get(name, ("", {}))[1])
    return {}


def device_of(name: str) -> torch.device:
    return torch.device("cuda", 0) if base_name(name) == "gda" else torch.device("cpu")


def make(name: str, world: int, group=None, dtype=torch.float32, deadline_s: float = DEADLINE_S):
    from efa_ep.kernels import create_transport

    torch.set_num_threads(1)
    if base_name(name) == "gda":
        torch.cuda.set_device(0)
    return create_transport(base_name(name), group, EXPERTS, HIDDEN, T_MAX, dtype,
                            **transport_options(name, world, deadline_s))


def error_kinds(e: BaseException) -> List[str]:
    """The contract classes (``kernels/base.py``) ``e`` is an instance of, by name."""
    from efa_ep.kernels import base

    return [k for k in ERROR_KINDS if isinstance(e, getattr(base, k))]


def outcome(fn) -> dict:
    """Runs ``fn``: ``{"kinds": [...], "type": ..., "message": ..., "seconds": ...}``; kinds
    ``[]`` and message ``"no error"`` when it returned."""
    t0 = time.monotonic()
    try:
        fn()
        return dict(kinds=[], type=None, message="no error", seconds=time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001  (any exception is a result here)
        return dict(kinds=error_kinds(e), type=type(e).__name__, message=str(e),
                    seconds=time.monotonic() - t0)


def drop(t) -> None:
    """Releases a transport without its closing barrier (its peers may be gone or broken):
    its stages first (hier), then itself."""
    for s in (getattr(t, "network", None), getattr(t, "local", None), t):
        if s is None:
            continue
        try:
            s.close(barrier=False)
        except TypeError:
            try:
                s.close()
            except Exception:  # noqa: BLE001
                pass
        except Exception:  # noqa: BLE001
            pass


# ----------------------------------------------------------------------------------------------
# Inputs and the reference
# ----------------------------------------------------------------------------------------------
def tokens_of(rank: int, case: int) -> int:
    """Uneven T per rank; rank 1 has no tokens in every other case (an empty source)."""
    return 0 if (rank == 1 and case % 2) else 3 + 4 * rank + case % 5


def all_inputs(world: int, kind: str, k: int, case: int) -> list:
    """Every rank's ``(x, topk_idx, topk_weights)`` (CPU), the same in every rank."""
    from efa_ep.testing.routes import contract_route

    data = []
    for r in range(world):
        n = tokens_of(r, case)
        idx, w = contract_route(kind, n, EXPERTS, k, world, seed=1000 * case + r)
        x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(31 * case + r))
        data.append((x, idx, w))
    return data


def reference_weight_combine(grads, recv_idxs, sources, num_tokens, k) -> list:
    """``combine_topk_weights`` by loops: slot j of source token t gets ``grad[row, j]`` from
    the row of the destination rank whose local id in slot j is >= 0 (0 for unused slots)."""
    outs = [torch.zeros(n, k, dtype=torch.float32) for n in num_tokens]
    for dst, rows in enumerate(sources):
        for i, (s, t) in enumerate(rows):
            for j in range(k):
                if int(recv_idxs[dst][i, j]) >= 0:
                    outs[s][t, j] = grads[dst][i, j]
    return outs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_round(t, rank: int, world: int, kind: str, k: int, case: int, dev) -> Dict[str, list]:
    """One round of all four operations on one route; ``{op: [what differs]}``."""
    from efa_ep.testing.reference import reference_combine, reference_dispatch

    data = all_inputs(world, kind, k, case)
    ref = reference_dispatch(*zip(*data), num_experts=EXPERTS)
    ex, ei, ew, ec, sources = ref[rank]
    x, idx, w = (v.to(dev) for v in data[rank])
    bad: Dict[str, list] = {op: [] for op in OPS}
    rx, ri, rw, tpe, h = t.dispatch(x, idx, w)
    for name, got, want in (("recv_x", rx, ex), ("recv_topk_idx", ri, ei),
                            ("recv_topk_weights", rw, ew), ("tokens_per_expert", tpe, ec)):
        if not same_bits(got, want):
            bad["dispatch"].append(name)
    if tpe.device.type != "cpu" or tpe.dtype != torch.int64:
        bad["dispatch"].append(f"tokens_per_expert is {tpe.dtype} on {tpe.device}, not CPU int64")
    num_recv = tuple(sum(1 for s, _ in sources if s == src) for src in range(world))
    if tuple(h.num_recv_per_rank) != num_recv:
        bad["dispatch"].append(f"handle.num_recv_per_rank {h.num_recv_per_rank} != {num_recv}")
    num_send = tuple(sum(1 for s, _ in ref[d][4] if s == rank) for d in range(world))
    if tuple(h.num_send_per_rank) != num_send:
        bad["dispatch"].append(f"handle.num_send_per_rank {h.num_send_per_rank} != {num_send}")

    g = torch.Generator().manual_seed(7 + case)
    ys = [torch.randn(ref[d][0].shape[0], HIDDEN, generator=g) for d in range(world)]
    want = reference_combine(ys, [ref[d][4] for d in range(world)], [d[0].shape[0] for d in data])
    got = t.combine(ys[rank].to(dev), h)
    if not same_bits(got, want[rank]):
        diff = (got.cpu().float() - want[rank].float()).abs().max().item() if (
            got.shape == want[rank].shape and got.numel()) else "shape"
        bad["combine"].append(f"combine differs (max abs diff {diff})")

    # replay with new rows of another width: row i of the result is x2[source token of row i]
    x2s = [torch.randn(d[0].shape[0], 3, generator=g) for d in data]
    want2 = (torch.stack([x2s[s][tk] for s, tk in sources]) if sources
             else torch.empty(0, 3))
    if not same_bits(t.dispatch_cached(x2s[rank].to(dev), h), want2):
        bad["dispatch_cached"].append("rows differ from x2[source token]")

    grads = [torch.randn(ref[d][0].shape[0], k, generator=g) for d in range(world)]
    want3 = reference_weight_combine(grads, [ref[d][1] for d in range(world)],
                                     [ref[d][4] for d in range(world)],
                                     [d[0].shape[0] for d in data], k)
    if not same_bits(t.combine_topk_weights(grads[rank].to(dev), h), want3[rank]):
        bad["combine_topk_weights"].append("values differ from the owning rows' slots")
    if not same_bits(t.combine_topk_weights(rw, h), w):
        bad["combine_topk_weights"].append("combine_topk_weights(recv_topk_weights) != topk_weights")
    return bad


# ----------------------------------------------------------------------------------------------
# Bad input on one rank
# ----------------------------------------------------------------------------------------------
#: (case id, operation, words the offending rank's message must contain)
BAD_CASES = (
    ("x_dtype", "dispatch", "x must be torch.float32"),
    ("x_shape", "dispatch", f"x must be [num_tokens, {HIDDEN}]"),
    ("idx_dtype", "dispatch", "topk_idx must be torch.int64"),
    ("expert_out_of_range", "dispatch", f"topk_idx holds expert id {EXPERTS}"),
    ("weight_nan", "dispatch", "NaN"),
    ("weight_inf", "dispatch", "NaN/Inf"),
    ("too_many_tokens", "dispatch", f"max_tokens_per_rank={T_MAX}"),
    ("combine_rows", "combine", "combine input y must be ["),
    ("combine_handle", "combine", "handle must be the DispatchHandle"),
    ("cached_rows", "dispatch_cached", "must be ["),
    ("weights_k", "combine_topk_weights", "must be ["),
)


def _bad_call(t, case: str, mine: bool, x, idx, w, rx, h, dev):
    """The call of ``case``, with this rank's argument broken when ``mine``."""
    n, k = idx.shape
    if case.startswith(("x_", "idx_", "expert_", "weight_", "too_")):
        if mine:
            if case == "x_dtype":
                x = x.double()
            elif case == "x_shape":
                x = torch.zeros(n, HIDDEN + 1, device=dev)
            elif case == "idx_dtype":
                idx = idx.int()
            elif case == "expert_out_of_range":
                idx = idx.clone()
                idx[0, 0] = EXPERTS
            elif case in ("weight_nan", "weight_inf"):
                w = w.clone()
                w[0, 0] = float("nan") if case == "weight_nan" else float("inf")
            elif case == "too_many_tokens":
                x = torch.zeros(T_MAX + 1, HIDDEN, device=dev)
                idx = torch.zeros(T_MAX + 1, k, dtype=torch.int64, device=dev)
                w = torch.ones(T_MAX + 1, k, device=dev)
        return lambda: t.dispatch(x, idx, w)
    if case == "combine_rows":
        y = torch.zeros(rx.shape[0] + 1, HIDDEN, device=dev) if mine else rx
        return lambda: t.combine(y, h)
    if case == "combine_handle":
        return lambda: t.combine(rx, None if mine else h)
    if case == "cached_rows":
        xc = torch.zeros(n + 1, HIDDEN, device=dev) if mine else x
        return lambda: t.dispatch_cached(xc, h)
    if case == "weights_k":
        gw = torch.zeros(rx.shape[0], k + 1, device=dev) if mine else torch.zeros(rx.shape[0], k,
                                                                                device=dev)
        return lambda: t.combine_topk_weights(gw, h)
    raise ValueError(case)


def bad_input_cases(t, rank: int, world: int, dev) -> dict:
    """Each bad case on rank :data:`BAD_RANK`, followed by a checked good round (the transport
    must still be usable). ``{case: outcome + {"usable_after": [what failed]}}``."""
    out = {}
    for i, (case, _, _) in enumerate(BAD_CASES):
        data = all_inputs(world, "random", 2, 100 + 2 * i)  # even: rank 1 has tokens
        x, idx, w = (v.to(dev) for v in data[rank])
        rx, _, _, _, h = t.dispatch(x, idx, w)
        res = outcome(_bad_call(t, case, rank == BAD_RANK, x, idx, w, rx, h, dev))
        try:
            after = check_round(t, rank, world, "dropped", 2, 200 + i, dev)
            res["usable_after"] = [f"{op}: {b}" for op, bs in after.items() for b in bs]
        except Exception as e:  # noqa: BLE001
            res["usable_after"] = [f"raised {type(e).__name__}: {e}"]
        out[case] = res
        if res["usable_after"]:
            break  # out of step or broken: later cases would only repeat it
    return out


def healthy_worker(rank: int, world: int, name: str) -> dict:
    """The contract cases for every K (all route kinds per K), then the bad-input cases.

    Returns ``{"contract": {f"{op}-K{k}": [failures]}, "bad_input": {...}}``."""
    dev = device_of(name)
    t = make(name, world)
    contract: Dict[str, list] = {f"{op}-K{k}": [] for op in OPS for k in KS}
    case = 0
    for k in KS:
        for kind in ROUTE_KINDS:
            try:
                bad = check_round(t, rank, world, kind, k, case, dev)
            except Exception as e:  # noqa: BLE001
                bad = {"dispatch": [f"raised {type(e).__name__}: {e}"]}
            for op, items in bad.items():
                contract[f"{op}-K{k}"] += [f"{kind} (T={[tokens_of(r, case) for r in range(world)]}): "
                                           f"{b}" for b in items]
            case += 1
    bad_input = bad_input_cases(t, rank, world, dev)
    drop(t)
    return {"contract": contract, "bad_input": bad_input}


# ----------------------------------------------------------------------------------------------
# Faults: different operations, tampering, a peer that skips a call, a peer that exits
# ----------------------------------------------------------------------------------------------
def _deadline_group():
    """A group of every rank whose collectives time out after :data:`DEADLINE_S`; entered in step
    on the default group first, so a slow process start is never the fault."""
    import torch.distributed as dist

    group = dist.new_group(timeout=datetime.timedelta(seconds=DEADLINE_S))
    dist.barrier()
    return group


def _store():
    """A client of the launcher's store: the events the ranks wait for (no fixed sleeps)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), None, False,
                         datetime.timedelta(seconds=120))


def _broken_calls(t, dev, x, idx, w, rx, h) -> dict:
    """Every operation once on a transport that should be broken: ``{op: outcome}``."""
    k = idx.shape[1]
    calls = {"dispatch": lambda: t.dispatch(x, idx, w),
             "combine": lambda: t.combine(rx, h),
             "dispatch_cached": lambda: t.dispatch_cached(x, h),
             "combine_topk_weights": lambda: t.combine_topk_weights(
                 torch.zeros(rx.shape[0], k, device=dev), h)}
    return {op: outcome(fn) for op, fn in calls.items()}


def _good_round(t, world, rank, dev, case):
    data = all_inputs(world, "random", 2, case)
    x, idx, w = (v.to(dev) for v in data[rank])
    rx, _, _, _, h = t.dispatch(x, idx, w)
    return x, idx, w, rx, h


def _desync(name, rank, world, dev) -> dict:
    """Rank 0 combines while the others replay the dispatch (both with valid inputs)."""
    t = make(name, world, _deadline_group())
    x, idx, w, rx, h = _good_round(t, world, rank, dev, 300)
    first = outcome(lambda: t.combine(rx, h) if rank == 0 else t.dispatch_cached(x, h))
    later = _broken_calls(t, dev, x, idx, w, rx, h) if first["kinds"] else {}
    drop(t)
    return dict(first=first, later=later)


def _tamper_torch(t, kind: str) -> None:
    """Test hook of the torch transport (``_all_to_all``, the only place it communicates)."""
    from efa_ep.kernels.base import H_ROWS

    real = t._all_to_all

    def lying(op, seq, stage, out, inp, *splits):
        inp = inp.clone()
        if op == "dispatch" and stage == "the status exchange" and kind == "header":
            inp[0, H_ROWS] += t.cfg.max_tokens_per_rank + 5  # rows announced to rank 0
        elif (op == "dispatch" and stage == "the all-to-all of routing metadata"
              and kind == "write" and splits[1][0]):
            inp[0, 0] = 999  # rank 0's first row: a local expert id rank 0 does not have
        return real(op, seq, stage, out, inp, *splits)

    t._all_to_all = lying


#: what each transport's hook does for a tamper case ("header": the rows a header announces;
#: "write": a data write after a valid header)
PROXY_TAMPER = {"header": "rows", "write": "gen"}


def _tamper(name, rank, world, dev, kind) -> dict:
    """Rank 1 tampers with what it sends rank 0; rank 0 must raise ProtocolError (and be
    broken afterwards); every rank must return within the deadline."""
    group = _deadline_group()
    hooked = rank == 1 and name in ("proxy", "hier")
    if hooked:
        os.environ["EFA_EP_PROXY_TAMPER"] = PROXY_TAMPER[kind]
    try:
        t = make(name, world, group)
    finally:
        os.environ.pop("EFA_EP_PROXY_TAMPER", None)
    if rank == 1 and name == "torch":
        _tamper_torch(t, kind)
    data = all_inputs(world, "random", 2, 400)
    x, idx, w = (v.to(dev) for v in data[rank])
    # every token has an expert on rank 0, so rank 1 sends rank 0 rows
    idx = idx.clone()
    idx[:, 0] = torch.arange(idx.shape[0], device=dev) % (EXPERTS // world)
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 1] + 1) % EXPERTS, idx[:, 1])
    box = {}

    def run():
        box["out"] = t.dispatch(x, idx, w)
        t.combine(box["out"][0], box["out"][4])

    first = outcome(run)
    later = {"dispatch": outcome(lambda: t.dispatch(x, idx, w))} if first["kinds"] else {}
    drop(t)
    return dict(first=first, later=later)


def _missing_peer(name, rank, world, dev, mode) -> Optional[dict]:
    """After a good round, rank 1 skips the next call (``skip``: it waits, alive, until the
    survivors are done) or exits without closing anything (``exit``)."""
    import torch.distributed as dist

    group = _deadline_group()
    t = make(name, world, group)
    x, idx, w, rx, h = _good_round(t, world, rank, dev, 500)
    # everyone finished that round (its last writes landed) before the fault
    dist.barrier()
    if rank == 1:
        if mode == "exit":
            os._exit(0)
        store = _store()
        store.wait([f"skip-done-{r}" for r in range(world) if r != 1])
        drop(t)
        return None
    first = outcome(lambda: t.combine(rx, h))
    later = _broken_calls(t, dev, x, idx, w, rx, h) if first["kinds"] else {}
    drop(t)
    if mode == "skip":
        _store().set(f"skip-done-{rank}", "1")
    return dict(first=first, later=later)


def fault_worker(rank: int, world: int, name: str) -> Optional[dict]:
    """Every fault case in one launch, each on a fresh transport and group; the ranks meet on
    the default group between cases. The exiting peer comes last, so the other ranks hand their
    results to rank 0 through the store first. Returns (rank 0) ``{rank: {case: result}}``."""
    import pickle

    import torch.distributed as dist

    dev = device_of(name)
    out = {"desync": _desync(name, rank, world, dev)}
    dist.barrier()
    if base_name(name) != "gda":  # gda has no tamper hook
        for kind in ("header", "write"):
            out[f"tamper_{kind}"] = _tamper(name, rank, world, dev, kind)
            dist.barrier()
    out["skip"] = _missing_peer(name, rank, world, dev, "skip")
    dist.barrier()
    store = _store()
    if rank != 0:
        store.set(f"faults-{rank}", pickle.dumps(out))
    out["exit"] = _missing_peer(name, rank, world, dev, "exit")
    if rank != 0:
        return None
    every = {0: out}
    for r in range(1, world):
        every[r] = pickle.loads(store.get(f"faults-{r}"))
    return every


# ----------------------------------------------------------------------------------------------
# A rank that drops out in the middle of an operation (EP 4)
# ----------------------------------------------------------------------------------------------
MIDOP_WORLD = 4


def midop_worker(rank: int, world: int, name: str) -> dict:
    """Rank 1 tampers with a dispatch header; the rank that receives it raises and leaves the
    operation while its peers are still in it, and then stays alive (as a training process that
    catches the error would) until every rank is done or the bound below passes. Every other
    rank must raise within the deadline, also in a stage it shares with that rank only (hier:
    the local stage of the receiver's node)."""
    res = _tamper(name, rank, world, device_of(name), "header")
    store = _store()
    store.set(f"midop-done-{rank}", "1")
    try:
        store.wait([f"midop-done-{r}" for r in range(world)],
                   datetime.timedelta(seconds=DEADLINE_S + SLACK_S + 2))
    except Exception:  # noqa: BLE001  (a rank still stuck: the test names it)
        pass
    return res
