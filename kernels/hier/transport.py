"""The ``hier`` transport: NVLink inside a node, the network across nodes; with ``aggregate=1``
(the default) each token crosses the network once per destination *node*, with
``aggregate=0`` once per destination *rank*.

Symbols: W ranks = N nodes x G ranks per node, node-major (rank r is local rank r % G of node
r // G); E experts, L = E // W per rank; T tokens here; K top-k; D row width (H for x);
T_MAX = ``max_tokens_per_rank``.

It composes two transports of the same contract (it forks neither):

* ``network``: the transport across nodes (``proxy`` by default, ``num_channels`` channels over
  libfabric; ``torch`` for tests).
* ``local``: one per node, the node's G ranks (``gda`` when usable, else ``torch``), with the
  node's E / N experts split over them.

``aggregate=1`` (DeepEP's normal-kernel route: RDMA once per node, then NVLink). The network
stage runs on each *rail*, the N ranks with the same local index, with the E experts split over
the N nodes: a token goes once to each node that owns one of its experts, to that node's rank
with this rank's local index, with its ids made local to the node. The local stage forwards
what the rail brought (up to N * T_MAX rows) to the ranks that own the experts. Dispatch =
network dispatch, then local dispatch of the received rows, then one permutation from (local
source, source node, token) order to the contract's (source rank, token) order; the
per-(local source, node) counts are the flat send counts of the sources each local rank
forwards for, which ride to every rank with the op's status exchange (each local source's
must add up to the rows it forwarded). Combine runs the reverse: inverse permutation, local
combine, network combine.

``aggregate=0`` (no aggregation, DeepEP's low-latency route: every remote destination rank is
written directly, nothing is forwarded). The network stage runs on the whole EP group and
carries only the slots whose expert lives on another node, straight to the rank that owns it;
the local stage carries the slots of this node's experts from this rank's own tokens (T_MAX
rows). A token with experts on several ranks of one remote node crosses the network once per
such rank. Dispatch = both stages' dispatches, their rows merged into (source rank, token)
order (the sources of each stage are disjoint); no count exchange, no permutation.

Combine sums (both modes accumulate in float32 from +0.0 and convert to y's dtype):

* ``aggregate=1``: per token and node, the local stage sums the node's destination ranks in
  ascending order (converted to y's dtype); the network stage then sums those per-node partials
  over nodes in ascending order (converted once).
* ``aggregate=0``: the network stage sums the token's remote destination ranks in ascending
  order (converted to y's dtype), the local stage this node's destination ranks in ascending
  order (converted to y's dtype); the two partials are added in float32 and converted once.

With at most two destination ranks per token, or with all of a token's destinations in one
group (one node for ``aggregate=1``; this node, or only other nodes, for ``aggregate=0``), that
is the ``torch`` transport's sum bit for bit; otherwise it equals it to rounding (the sums are
grouped). ``dispatch``, ``dispatch_cached`` and ``combine_topk_weights`` are exact in both
modes. With one node (N = 1) the modes are the same: everything goes through the local stage.

Network accounting: every operation records what this rank handed to the network stage for
rows that cross nodes (:class:`~efa_ep.kernels.base.NetOpCounts`: messages, rows, payload
bytes; with a ``proxy`` network also the libfabric writes and bytes its wire queued, headers
included) in :attr:`HierTransport.last_op_counts`; :meth:`HierTransport.op_totals` sums them.

Every operation makes one small status exchange over the whole group, so a bad input on any
rank raises on every rank (each stage's own exchange covers only its rail or node). It is
started without waiting and runs under the op's stages: a rank with bad input takes part in
them (a dispatch with no rows; an op along a handle with none, which the stage refuses on its
group's ranks, who then refuse their next stage too: :mod:`.refusing`), and every rank raises
once the exchange is in.

Options (explicit; the dispatcher's settings fill them from ``EFA_EP_NODE_SIZE`` and the
``EFA_EP_PROXY_*`` variables): ``node_size`` (G; default: ranks grouped by host name,
which must give equal, contiguous blocks), ``network`` (``proxy``|``torch``), ``local``
(``auto``|``gda``|``torch``), ``aggregate`` (1|0, default 1); other options (``num_channels``,
``provider``, ``timeout_s``, ...) go to the network transport, and ``timeout_s`` also to the
local one. A bad value raises :class:`~efa_ep.kernels.base.TransportError` in one line.

Synchronization: every call is collective over the EP group and returns when this rank's
outputs are ready; the stages synchronize as they do alone (host syncs: one per stage
dispatch and the copy of the routing to the host for the checks).
"""
from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..core.hosts import gather_hosts, gather_processes, host_id, pid_exited
from .refusing import RefusingStages
from .routing import flat_send, routing_on_host, to_device
from ..options import SCHEMAS
from ..base import (
    DispatchHandle, DispatchInputError, HandleState, NetCounter, NetOpCounts, PeerFailure,
    ProtocolError,
    Transport, TransportBroken, TransportError, collective_device,
    describe_value_errors, rows_input_error,
    validate_dispatch_inputs,
)

_OWN_OPTIONS = ("node_size", "network", "local", "aggregate")
_SHARED_OPTIONS = ("timeout_s",)


def availability() -> Optional[str]:
    """None when hier can run here (its stages are checked when it is created)."""
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    return None


def node_layout(group, node_size: Optional[int] = None):
    """(N nodes, G ranks per node) of ``group``: from ``node_size`` when given, else from the
    ranks' host names (collective over ``group``). Raises unless nodes are equal, contiguous
    blocks of ranks."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if node_size:
        g = int(node_size)
        if g < 1 or world % g:
            raise TransportError(f"rank {rank}: hier node_size={g} must divide the EP group "
                                 f"size {world}")
        return world // g, g
    hosts = gather_hosts(group)
    order = list(dict.fromkeys(hosts))
    g = hosts.count(order[0])
    expect = [h for h in order for _ in range(g)]
    if hosts != expect:
        raise TransportError(
            f"rank {rank}: hier needs each node's ranks as one contiguous block of equal size "
            f"(node-major ranks); the EP group's hosts are {hosts}; set node_size "
            f"(EFA_EP_NODE_SIZE) to emulate nodes, or order the ranks by node")
    return len(order), g


@dataclasses.dataclass(frozen=True)
class HierDispatchState(HandleState):
    """``DispatchHandle.state`` of a hier dispatch.

    Attributes:
        owner: the transport object that made it (:class:`~efa_ep.kernels.base.HandleState`).
        net: the network stage's handle. local: the local stage's handle.
        perm: ``aggregate=1``: ``[N]`` int64 (x's device), row i of the result is row
            ``perm[i]`` of the local stage's output; None with ``aggregate=0``.
        inverse: ``aggregate=1``: ``[N]`` int64, ``perm``'s inverse (row i of the local
            stage's rows is row ``inverse[i]`` of the result: combine's gather); else None.
        split: ``aggregate=0``: ``(a, b)``, the result is the network stage's first ``a`` rows
            (sources on lower nodes), the local stage's ``b`` rows, then the network stage's
            other rows; None with ``aggregate=1``.
    """

    net: DispatchHandle
    local: DispatchHandle
    perm: Optional[torch.Tensor]
    split: Optional[Tuple[int, int]] = None
    inverse: Optional[torch.Tensor] = None


def _hier_option(key: str, value, where: str):
    """``value`` checked against the hier schema (kernels/options.py); one-line TransportError."""
    from ..options import ConfigError

    try:
        return SCHEMAS["hier"][key].convert(value, where)
    except ConfigError as e:
        raise TransportError(f"{e} ({e.hint})" if e.hint else str(e)) from None


class HierTransport(Transport):
    """Hierarchical transport (module docstring); contract in ``efa_ep.kernels.base``.

    Attributes:
        num_nodes, node_size: N and G. node, local_rank: this rank's node and index in it.
        aggregate: 1 or 0 (module docstring). stage_names: (network, local) transport names.
        last_op_counts: ``{op: NetOpCounts}`` of the most recent call of each op (this rank's
            rows that crossed nodes; see :class:`~efa_ep.kernels.base.NetOpCounts` for units).
    """

    name = "hier"
    state_type = HierDispatchState

    def __init__(self, cfg, group):
        super().__init__(cfg, group)
        from .. import create_transport

        opts = dict(cfg.options)
        who = f"rank {self.rank}: hier option"
        node_size = (_hier_option("node_size", opts["node_size"], who)
                     if opts.get("node_size") is not None else None)
        self.num_nodes, self.node_size = node_layout(group, node_size)
        n, g = self.num_nodes, self.node_size
        self.node, self.local_rank = divmod(self.rank, g)
        net_name = _hier_option("network", opts.get("network", "proxy"), who)
        local_name = _hier_option("local", opts.get("local", "auto"), who)
        self.aggregate = _hier_option("aggregate", opts.get("aggregate", 1), who)
        if local_name == "auto":
            from .. import gda
            local_name = "gda" if gda.availability() is None else "torch"
        ranks = [dist.get_global_rank(group, i) for i in range(self.world_size)]
        backend = dist.get_backend(group)
        # The stage groups carry the transport's deadline: a torch local stage waits no longer
        # than the network stage does (a group's default would be 30 minutes).
        deadline = datetime.timedelta(seconds=float(
            opts.get("timeout_s", SCHEMAS["hier"]["timeout_s"].default)))
        node_ranks = ranks[self.node * g:(self.node + 1) * g]
        # Only the members create each subgroup (the EP group may be one of many in WORLD).
        self.node_group = dist.new_group(node_ranks, backend=backend, timeout=deadline,
                                         use_local_synchronization=True)
        net_opts = {k: v for k, v in opts.items() if k not in _OWN_OPTIONS}
        local_opts = {k: v for k, v in opts.items() if k in _SHARED_OPTIONS}
        # aggregate=0 across nodes: the network stage spans the whole group, direct to ranks.
        self._direct = self.aggregate == 0 and n > 1
        if net_name == "torch":
            net_opts = {}  # the proxy's knobs mean nothing to torch
        if self._direct:
            self.rail_group = None
            self.network = create_transport(net_name, group, cfg.num_experts, cfg.hidden,
                                            cfg.max_tokens_per_rank, cfg.dtype, **net_opts)
            self.local = create_transport(local_name, self.node_group, cfg.num_experts // n,
                                          cfg.hidden, cfg.max_tokens_per_rank, cfg.dtype,
                                          **local_opts)
        else:
            rail_ranks = ranks[self.local_rank::g]
            self.rail_group = dist.new_group(rail_ranks, backend=backend, timeout=deadline,
                                             use_local_synchronization=True)
            if n == 1:
                net_name, net_opts = "torch", {}  # one node: the rail is this rank alone
            self.network = create_transport(net_name, self.rail_group, cfg.num_experts,
                                            cfg.hidden, cfg.max_tokens_per_rank, cfg.dtype,
                                            **net_opts)
            self.local = create_transport(local_name, self.node_group, cfg.num_experts // n,
                                          cfg.hidden, n * cfg.max_tokens_per_rank, cfg.dtype,
                                          **local_opts)
        self.stage_names = (self.network.name, self.local.name)
        # the network stage's index of this rank, whose own rows never cross nodes
        self._net_self = self.rank if self._direct else self.node
        self._ctl = collective_device(group)
        self._broken: Optional[str] = None
        self._net = NetCounter()
        self._op = "setup"  # the operation in progress, for failure messages
        # EP ranks of each stage's group, to name a stage's peers in EP terms
        self._net_ranks = (list(range(self.world_size)) if self._direct
                           else list(range(self.local_rank, self.world_size, g)))
        self._node_ranks = list(range(self.node * g, (self.node + 1) * g))
        # Who is who, to name a dead peer when gloo only reports a socket error (as torch does).
        self._peers = gather_processes(group)

    @property
    def last_op_counts(self) -> Dict[str, NetOpCounts]:
        """``{op: NetOpCounts}``: what the most recent call of each op on this rank handed to
        the network stage for other nodes (messages = destination ranks with >= 1 row, rows,
        payload bytes; with a ``proxy`` network also its wire's writes and bytes, headers to
        every network peer included). Host counts, read after the call; no synchronization."""
        return dict(self._net.last)

    def op_totals(self) -> dict:
        """Per-op sums of :attr:`last_op_counts` since creation
        (:class:`~efa_ep.kernels.base.NetCounter`)."""
        return self._net.totals()

    def _count(self, op: str, per_peer, row_bytes: int) -> None:
        """Records ``op``: ``per_peer`` = rows this rank handed the network stage per network
        peer (its own entry never crosses nodes), ``row_bytes`` = payload bytes per row."""
        rows = [int(v) for i, v in enumerate(per_peer) if i != self._net_self]
        counts = getattr(self.network, "net_counts", None)  # (a proxy network's wire counts)
        wire = counts(op) if counts is not None else None
        sent = sum(rows)
        self._net.add(op, sum(1 for v in rows if v), sent, sent * int(row_bytes),
                      None if wire is None else wire[3], None if wire is None else wire[4])

    # ------------------------------------------------------------------------------------
    def _begin(self, op: str) -> None:
        if self._broken is not None:
            raise TransportBroken(f"rank {self.rank}: hier transport unusable after an earlier "
                                  f"failure ({self._broken}); create a new one")
        self._op = op

    def _where(self, fn) -> Tuple[str, list]:
        """(what ``fn`` is, the EP ranks of the group it runs over)."""
        owner = getattr(fn, "__self__", None)
        if owner is self.network:
            return f"the network stage's {fn.__name__}", self._net_ranks
        if owner is self.local:
            return f"the local stage's {fn.__name__}", self._node_ranks
        return "the status exchange", list(range(self.world_size))  # (finish_agreement)

    def _exited(self, ranks, text: str) -> str:
        """Names the peers among EP ``ranks`` whose process on this host has exited (a peer
        that closed its sockets may still be exiting: looked at for up to 0.5 s)."""
        me = host_id()
        closed = any(w in text.lower() for w in ("closed", "reset", "broken pipe"))
        for attempt in range(11):
            dead = [r for r in ranks if r != self.rank and self._peers[r][0] == me
                    and pid_exited(self._peers[r][1])]
            if dead or not closed or attempt == 10:
                break
            time.sleep(0.05)
        other = [r for r in ranks if r != self.rank and self._peers[r][0] != me]
        who = (f"peer rank(s) {dead} exited (pids {[self._peers[r][1] for r in dead]})" if dead
               else "no peer on this host has exited (a peer is slow, hung, or on another host)")
        return who + (f"; rank(s) {other} are on other hosts (not checked)" if other else "")

    def _stage(self, fn, *args):
        """Runs one stage (a transport's op or a collective of hier's own). A failure other than
        a group's input error breaks hier on this rank; a backend error of a collective (gloo and
        NCCL raise RuntimeError) and a stage's :class:`PeerFailure` become a :class:`PeerFailure`
        naming hier's op, the stage, its EP ranks and the peers that exited."""
        try:
            return fn(*args)
        except DispatchInputError:
            raise
        except PeerFailure as e:
            raise self._peer_failure(fn, e) from e
        except TransportError as e:  # ProtocolError & co: named by the stage
            self._broken = self._broken or str(e)
            raise
        except RuntimeError as e:
            raise self._peer_failure(fn, e) from e

    def _peer_failure(self, fn, e: Exception) -> PeerFailure:
        """The :class:`PeerFailure` for ``e`` raised by ``fn`` (see :meth:`_stage`); breaks hier."""
        what, ranks = self._where(fn)
        text = str(e).strip()
        if isinstance(e, PeerFailure):  # a stage's ranks are not EP ranks: say which they are
            msg = (f"{text[:1000]} [rank {self.rank}: hier {self._op}: {what}, over EP ranks "
                   f"{ranks} (its ranks 0..{len(ranks) - 1}): {self._exited(ranks, text)}]")
        else:
            late = "timed out" in text.lower() or "timeout" in text.lower()
            kind = "missed the deadline (timeout_s)" if late else "failed"
            msg = (f"rank {self.rank}: hier {self._op} {kind} in {what} over EP ranks {ranks}: "
                   f"{self._exited(ranks, text)}; backend error: {type(e).__name__}: "
                   f"{text[:500]}")
        self._broken = self._broken or msg
        return PeerFailure(msg)

    # ------------------------------------------------------------------------------------
    def _dispatch_input(self, x, topk_idx, topk_weights):
        """This rank's dispatch input error (None: valid) and, when the shapes are valid, its
        routing on the host: ``topk_idx`` as a ``[T, K]`` int64 numpy array (the ids and
        weights copied from the device once; the value checks read both, the flat send layout
        the ids)."""
        cfg = self.cfg
        error = validate_dispatch_inputs(cfg, self.rank, x, topk_idx, topk_weights,
                                         value_checks=False)
        if error is not None:
            return error, None
        idx, w = routing_on_host(topk_idx, topk_weights)
        if idx.size and (idx.min() < -1 or idx.max() >= cfg.num_experts
                         or not np.isfinite(w).all()):
            error = describe_value_errors(cfg, self.rank, torch.from_numpy(idx),
                                          torch.from_numpy(w))
        return error, idx

    def dispatch(self, x, topk_idx, topk_weights):
        """See ``efa_ep.kernels.base``: ``x`` ``[T, H]`` (the transport's dtype), ``topk_idx``
        ``[T, K]`` int64, ``topk_weights`` ``[T, K]`` float32, one device; returns rows in
        (source rank, token) order. Host work (the checks, the counts, the permutation) runs
        on numpy copies of the routing and counts: the ids and weights copied from the device,
        the local stage's send order copied from it, the permutation copied to it."""
        error, idx_h = self._dispatch_input(x, topk_idx, topk_weights)
        # The status exchange runs under the stages (it on the EP group, theirs on the rail
        # and the node): a rank with bad input takes part in them with no rows, and every rank
        # raises once the exchange is in. Saves the exchange's latency (gloo: 0.1-0.5 ms a
        # call on one host) per dispatch. With aggregate=1 it also carries this rank's flat
        # send counts, which are the rows each rail peer forwards for it inside its node.
        send = None
        if error is None:
            send = flat_send(idx_h, self.world_size, self.cfg.num_experts)
        counts = None
        if not self._direct:
            counts = np.asarray(send[1] if send else (0,) * self.world_size, dtype=np.int64)
        stages = RefusingStages(self, "dispatch", error, counts)
        if error is not None:
            x, topk_idx, topk_weights, idx_h = self._no_rows(x, topk_idx)
            send = flat_send(idx_h, self.world_size, self.cfg.num_experts)
        return stages.complete(
            lambda: (self._dispatch_direct(x, topk_idx, topk_weights, send) if self._direct
                     else self._dispatch_rail(stages, x, topk_idx, topk_weights, send)))

    def _no_rows(self, x, topk_idx):
        """Empty dispatch inputs (``[0, H]``, ``[0, K]``) that every stage accepts, for a rank
        whose own input was refused: it takes part in the stages without rows. K is the
        refused ``topk_idx``'s where it has one (peers check it), on the local stage's device
        (or ``x``'s)."""
        k = topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else 1
        dev = getattr(self.local, "device", None)
        if dev is None:
            dev = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
        cfg = self.cfg
        return (torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=dev),
                torch.empty(0, k, dtype=torch.int64, device=dev),
                torch.empty(0, k, dtype=torch.float32, device=dev),
                np.empty((0, k), dtype=np.int64))

    def _dispatch_rail(self, stages, x, topk_idx, topk_weights, send):
        """``aggregate=1`` (see the module): the network stage on the rail, the local stage on
        the node, then the permutation. ``send``: :func:`.routing.flat_send` of this rank's
        routing. The rows each local source forwards here per source node are the flat send
        counts of the sources it forwards for, which came with the status exchange."""
        x1, i1, w1, _, h1 = self._stage(self.network.dispatch, x, topk_idx, topk_weights)
        self._count("dispatch", h1.num_send_per_rank, self.cfg.hidden * x.element_size())
        n, g = self.num_nodes, self.node_size
        x2, i2, w2, tpe, h2 = self._stage(self.local.dispatch, x1, i1, w1)
        recv_counts = self._forwarded_counts(stages.status(), h2.num_recv_per_rank)  # [g, n]
        # (local source j, node m) blocks arrive j-major; the contract wants m-major. The
        # inverse order (combine's) and the handle's send order go to the device with it.
        flat_counts = recv_counts.reshape(-1)
        block_start = (np.cumsum(flat_counts) - flat_counts).reshape(g, n)
        ends = block_start + recv_counts
        perm_np = np.concatenate([np.arange(block_start[j, m], ends[j, m], dtype=np.int64)
                                  for m in range(n) for j in range(g)])
        inverse_np = np.empty_like(perm_np)
        inverse_np[perm_np] = np.arange(len(perm_np))
        num_recv = tuple(int(recv_counts[j, m]) for m in range(n) for j in range(g))
        send_np, num_send = send
        if topk_idx.device == x2.device:  # one copy
            perm, inverse, send_token_idx = to_device([perm_np, inverse_np, send_np], x2.device)
        else:
            perm, inverse = to_device([perm_np, inverse_np], x2.device)
            send_token_idx, = to_device([send_np], topk_idx.device)
        recv_idx = i2.index_select(0, perm)
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=int(perm.numel()), topk_idx=topk_idx,
            send_token_idx=send_token_idx, num_send_per_rank=num_send,
            num_recv_per_rank=num_recv, recv_topk_idx=recv_idx,
            state=HierDispatchState(owner=self.uid, net=h1, local=h2, perm=perm,
                                    inverse=inverse))
        return x2.index_select(0, perm), recv_idx, w2.index_select(0, perm), tpe, handle

    def _dispatch_direct(self, x, topk_idx, topk_weights, send):
        """``aggregate=0``: slots of other nodes' experts go to the network stage (whole group,
        global ids), slots of this node's experts to the local stage (ids local to the node);
        the two results are merged in (source rank, token) order. ``send``:
        :func:`.routing.flat_send` of this rank's routing."""
        n, g, cfg = self.num_nodes, self.node_size, self.cfg
        per_node = cfg.num_experts // n
        used = topk_idx >= 0
        here = used & (torch.div(topk_idx, per_node, rounding_mode="floor") == self.node)
        none = torch.full_like(topk_idx, -1)
        net_idx = torch.where(used & ~here, topk_idx, none)
        loc_idx = torch.where(here, topk_idx - self.node * per_node, none)
        x1, i1, w1, tpe1, h1 = self._stage(self.network.dispatch, x, net_idx, topk_weights)
        self._count("dispatch", h1.num_send_per_rank, cfg.hidden * x.element_size())
        x2, i2, w2, tpe2, h2 = self._stage(self.local.dispatch, x, loc_idx, topk_weights)
        lo = self.node * g
        a = sum(h1.num_recv_per_rank[:lo])
        b = x2.shape[0]

        def merge(net, loc):
            return torch.cat([net[:a], loc, net[a:]], 0)

        num_recv = tuple(h2.num_recv_per_rank[s - lo] if lo <= s < lo + g
                         else h1.num_recv_per_rank[s] for s in range(self.world_size))
        send_np, num_send = send
        send_token_idx, = to_device([send_np], topk_idx.device)
        recv_idx = merge(i1, i2)
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=int(recv_idx.shape[0]), topk_idx=topk_idx,
            send_token_idx=send_token_idx, num_send_per_rank=num_send,
            num_recv_per_rank=num_recv, recv_topk_idx=recv_idx,
            state=HierDispatchState(owner=self.uid, net=h1, local=h2, perm=None, split=(a, b)))
        return merge(x1, x2), recv_idx, merge(w1, w2), tpe1 + tpe2, handle

    def _forwarded_counts(self, received: np.ndarray, local_recv) -> np.ndarray:
        """``[G, N]`` int64 numpy: the rows local source j forwards here from node m, which are
        the flat send counts to this rank of EP rank m * G + j (``received[r, 0]``: rank r's
        count, from the status exchange). Peers' counts are untrusted: each must be
        non-negative and each local source's must add up to the rows the local stage received
        from it (``local_recv``, G ints), or hier breaks with a :class:`ProtocolError` naming
        the ranks."""
        n, g = self.num_nodes, self.node_size
        if received.shape != (self.world_size, 1):
            self._broken = (f"rank {self.rank}: protocol violation: hier's status exchange "
                            f"brought counts of shape {tuple(received.shape)}, expected "
                            f"({self.world_size}, 1)")
            raise ProtocolError(self._broken)
        counts = np.ascontiguousarray(received[:, 0].reshape(n, g).T)
        bad = [j for j in range(g)
               if (counts[j] < 0).any() or int(counts[j].sum()) != int(local_recv[j])]
        if bad:
            j = bad[0]
            sources = list(range(j, self.world_size, g))
            self._broken = (f"rank {self.rank}: protocol violation: hier's forward counts of "
                            f"ranks {sources} (forwarded by rank {self._node_ranks[j]}) are "
                            f"{counts[j].tolist()}, which do not add up to the "
                            f"{int(local_recv[j])} rows the local stage received from rank "
                            f"{self._node_ranks[j]}")
            raise ProtocolError(self._broken)
        return counts

    def dispatch_cached(self, x, handle):
        """Replays ``handle``'s route for ``x`` ``[T, D]`` (any float dtype): returns ``[N, D]``.
        Its status exchange runs under its stages (:mod:`.refusing`)."""
        err = self.handle_error(handle) or rows_input_error(
            self.rank, "cached dispatch input x", x, handle.num_tokens,
            device=handle.topk_idx.device)
        stages = RefusingStages(self, "dispatch_cached", err)
        return stages.complete(lambda: self._cached_stages(stages, x, handle))

    def _cached_stages(self, stages, x, handle):
        """The stages of :meth:`dispatch_cached` (None when refused: see :mod:`.refusing`)."""
        st = None if stages.refused else handle.state
        x1 = stages.run(self.network.dispatch_cached, x, st and st.net)
        if not stages.refused:
            self._count("dispatch_cached", st.net.num_send_per_rank, x.shape[1] * x.element_size())
        if self._direct:  # aggregate=0: both stages take x, merged in source order
            x2 = stages.run(self.local.dispatch_cached, x, st and st.local)
            if stages.refused:
                return None
            a = st.split[0]
            return torch.cat([x1[:a], x2, x1[a:]], 0)
        x2 = stages.run(self.local.dispatch_cached, x1, st and st.local)
        return None if stages.refused else x2.index_select(0, st.perm)

    def _unpermute(self, y, st):
        return y.index_select(0, st.inverse)  # (a gather: faster than index_copy_ on a CPU)

    def _split_rows(self, y, st):
        """``aggregate=0``: ``y`` ``[N, D]`` -> (network stage's rows, local stage's rows)."""
        a, b = st.split
        return torch.cat([y[:a], y[a + b:]], 0), y[a:a + b]

    def _combine_stages(self, op: str, stages, y, st, network, local):
        """The stages of a combine-like op ``op`` of dense rows ``y`` ``[N, D]`` along handle
        state ``st`` (None when this rank refused): ``network`` and ``local`` the stages' ops.
        Returns ``[T, D]`` (float32 sums for aggregate=0, the caller converts), or None when
        refused."""
        row_bytes = 0 if st is None else y.shape[1] * y.element_size()
        if self._direct:  # aggregate=0: both stages, sums added
            y_net, y_loc = (None, None) if st is None else self._split_rows(y, st)
            z1 = stages.run(network, None if y_net is None else y_net.contiguous(),
                            st and st.net)
            if not stages.refused:
                self._count(op, st.net.num_recv_per_rank, row_bytes)
            z2 = stages.run(local, None if y_loc is None else y_loc.contiguous(),
                            st and st.local)
            # float32 from +0.0: 0 + z1 == z1 exactly (a stage's sum is never -0.0), + z2
            return None if stages.refused else z1.float() + z2.float()
        z1 = stages.run(local, None if st is None else self._unpermute(y, st), st and st.local)
        out = stages.run(network, z1, st and st.net)
        if not stages.refused:
            self._count(op, st.net.num_recv_per_rank, row_bytes)
        return out

    def combine(self, y, handle):
        """``y`` ``[N, D]`` -> ``[T, D]`` in y's dtype; sums grouped (module docstring). Its
        status exchange runs under its stages (:mod:`.refusing`)."""
        err = self.handle_error(handle) or rows_input_error(
            self.rank, "combine input y", y, handle.num_recv_tokens, device=handle.topk_idx.device)
        stages = RefusingStages(self, "combine", err)

        def body():
            st = None if stages.refused else handle.state
            out = self._combine_stages("combine", stages, None if st is None else y.contiguous(),
                                       st, self.network.combine, self.local.combine)
            return out.to(y.dtype) if out is not None and self._direct else out  # converted once
        return stages.complete(body)

    def combine_topk_weights(self, grad_recv_topk_weights, handle):
        """``[N, K]`` float32 -> ``[T, K]`` float32 (exact: one non-zero source per slot)."""
        g = grad_recv_topk_weights
        err = self.handle_error(handle) or rows_input_error(
            self.rank, "combine_topk_weights input", g, handle.num_recv_tokens,
            width=handle.recv_topk_idx.shape[1], device=handle.topk_idx.device)
        stages = RefusingStages(self, "combine_topk_weights", err)

        def body():
            st = None if stages.refused else handle.state
            # (aggregate=0: every slot is non-zero in at most one stage's sum: exact)
            return self._combine_stages(
                "combine_topk_weights", stages, None if st is None else g.float().contiguous(),
                st, self.network.combine_topk_weights, self.local.combine_topk_weights)
        return stages.complete(body)

    def after_backward(self) -> None:
        self.network.after_backward()
        self.local.after_backward()

    def close(self) -> None:
        for t in (getattr(self, "local", None), getattr(self, "network", None)):
            if t is not None:
                t.close()
        self._broken = self._broken or "closed"
