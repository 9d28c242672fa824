"""The ``hier`` transport: NVLink inside a node, the network across nodes, each token sent over
the network once per destination node.

Symbols: W ranks = N nodes x G ranks per node, node-major (rank r is local rank r % G of node
r // G); E experts, L = E // W per rank; T tokens here; K top-k; H row width; T_MAX =
``max_tokens_per_rank``.

It composes two transports of the same contract (it forks neither):

* ``network``: one per *rail*, the N ranks with the same local index (``proxy`` by default,
  K channels over libfabric; ``torch`` for tests), with the E experts split over the N nodes.
  Its dispatch sends a token once to each node that owns one of its experts, to that node's
  rank with this rank's local index (DeepEP's normal-kernel route: RDMA once per node, then
  NVLink), with its ids made local to the node.
* ``local``: one per node, the node's G ranks (``gda`` when usable, else ``torch``), with the
  node's E / N experts split over them. It forwards what the rail brought (up to N * T_MAX
  rows) to the ranks that own the experts.

Dispatch = network dispatch, then local dispatch of the received rows, then one permutation
from (local source, source node, token) order to the contract's (source rank, token) order;
the per-(local source, node) counts come from one small count exchange inside the node.
Combine runs the reverse: inverse permutation, local combine (per token and node: a float32
sum over the node's destination ranks in ascending order, rounded to y's dtype), network
combine (a float32 sum over nodes in ascending order, rounded once). With at most two
destination ranks per token, or with all of a token's destinations on one node, that is the
``torch`` transport's sum bit for bit; otherwise it equals it to rounding (the sums are
grouped by node). ``dispatch``, ``dispatch_cached`` and ``combine_topk_weights`` are exact.

Every operation starts with one small status exchange over the whole group, so a bad input on
any rank raises on every rank (each stage's own exchange covers only its rail or node).

Options: ``node_size`` (G; env ``EFA_EP_NODE_SIZE``; default: ranks grouped by host name,
which must give equal, contiguous blocks), ``network`` (``proxy``|``torch``), ``local``
(``auto``|``gda``|``torch``); other options (``num_channels``, ``provider``, ``timeout_s``,
...) go to the network transport, and ``timeout_s`` also to the local one.

Synchronization: as the stages (host syncs: one per stage dispatch, the count exchange).
"""
from __future__ import annotations

import dataclasses
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from efa_ep.kernels.base import (
    DispatchHandle, DispatchInputError, Transport, TransportError, collective_device,
    compute_send_layout, validate_dispatch_inputs,
)

_OWN_OPTIONS = ("node_size", "network", "local")
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
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
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
class HierDispatchState:
    """``DispatchHandle.state`` of a hier dispatch.

    Attributes:
        net: the network stage's handle. local: the local stage's handle.
        perm: ``[N]`` int64 (x's device): row i of the result is row ``perm[i]`` of the local
            stage's output. owner: ``id()`` of the transport that made it.
    """

    net: DispatchHandle
    local: DispatchHandle
    perm: torch.Tensor
    owner: int


class HierTransport(Transport):
    """Hierarchical transport (module docstring); contract in ``efa_ep.kernels.base``."""

    name = "hier"

    def __init__(self, cfg, group):
        super().__init__(cfg, group)
        from efa_ep.kernels import create_transport

        opts = dict(cfg.options)
        node_size = opts.get("node_size") or os.environ.get("EFA_EP_NODE_SIZE") or None
        self.num_nodes, self.node_size = node_layout(group, node_size)
        n, g = self.num_nodes, self.node_size
        self.node, self.local_rank = divmod(self.rank, g)
        net_name = str(opts.get("network", "proxy"))
        local_name = str(opts.get("local", "auto"))
        if net_name not in ("proxy", "torch"):
            raise TransportError(f"rank {self.rank}: hier option network must be proxy or "
                                 f"torch, got {net_name!r}")
        if local_name not in ("auto", "gda", "torch"):
            raise TransportError(f"rank {self.rank}: hier option local must be auto, gda or "
                                 f"torch, got {local_name!r}")
        if local_name == "auto":
            from efa_ep.kernels import gda
            local_name = "gda" if gda.availability() is None else "torch"
        ranks = [dist.get_global_rank(group, i) for i in range(self.world_size)]
        backend = dist.get_backend(group)
        node_ranks = ranks[self.node * g:(self.node + 1) * g]
        rail_ranks = ranks[self.local_rank::g]
        # Only the members create each subgroup (the EP group may be one of many in WORLD).
        self.node_group = dist.new_group(node_ranks, backend=backend,
                                         use_local_synchronization=True)
        self.rail_group = dist.new_group(rail_ranks, backend=backend,
                                         use_local_synchronization=True)
        net_opts = {k: v for k, v in opts.items() if k not in _OWN_OPTIONS}
        local_opts = {k: v for k, v in opts.items() if k in _SHARED_OPTIONS}
        if n == 1 or net_name == "torch":
            net_name, net_opts = "torch", {}  # one node: the rail is this rank alone
        self.network = create_transport(net_name, self.rail_group, cfg.num_experts, cfg.hidden,
                                        cfg.max_tokens_per_rank, cfg.dtype, **net_opts)
        self.local = create_transport(local_name, self.node_group, cfg.num_experts // n,
                                      cfg.hidden, n * cfg.max_tokens_per_rank, cfg.dtype,
                                      **local_opts)
        self.stage_names = (self.network.name, self.local.name)
        self._ctl = collective_device(group)
        self._broken: Optional[str] = None

    # ------------------------------------------------------------------------------------
    def _agree(self, op: str, error: Optional[str]) -> None:
        """The group-wide status exchange: every rank raises if any rank's input is bad."""
        if self._broken is not None:
            raise TransportError(f"rank {self.rank}: hier transport unusable after an earlier "
                                 f"failure ({self._broken}); create a new one")
        flags = [torch.zeros(1, dtype=torch.int64, device=self._ctl)
                 for _ in range(self.world_size)]
        mine = torch.tensor([1 if error else 0], dtype=torch.int64, device=self._ctl)
        dist.all_gather(flags, mine, group=self.group)
        bad = [r for r, f in enumerate(flags) if int(f.item())]
        if error:
            raise DispatchInputError(error)
        if bad:
            raise DispatchInputError(f"rank {self.rank}: EP peer rank(s) {bad} passed invalid "
                                     f"{op} inputs (see their error)")

    def _stage(self, fn, *args):
        try:
            return fn(*args)
        except DispatchInputError:
            raise
        except TransportError as e:
            self._broken = str(e)
            raise

    def _state(self, handle: DispatchHandle) -> Optional[str]:
        st = handle.state
        if not isinstance(st, HierDispatchState) or st.owner != id(self):
            return f"rank {self.rank}: handle was not made by this hier transport's dispatch"
        return None

    def _rows_check(self, t, rows: int, what: str, width=None) -> Optional[str]:
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != rows or (
                width is not None and t.shape[1] != width):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            want = f"[{rows}, {width if width is not None else 'D'}]"
            return f"rank {self.rank}: {what} must be {want}, got {shape}"
        return None

    # ------------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights):
        """See ``efa_ep.kernels.base``; returns rows in (source rank, token) order."""
        self._agree("dispatch", validate_dispatch_inputs(self.cfg, self.rank, x, topk_idx,
                                                         topk_weights))
        x1, i1, w1, _, h1 = self._stage(self.network.dispatch, x, topk_idx, topk_weights)
        x2, i2, w2, tpe, h2 = self._stage(self.local.dispatch, x1, i1, w1)
        n, g = self.num_nodes, self.node_size
        # Rows this rank forwards to each local rank d, split by the node they came from.
        src_node = torch.repeat_interleave(
            torch.arange(n), torch.tensor(h1.num_recv_per_rank, dtype=torch.int64))
        fwd = h2.send_token_idx.cpu()
        counts = torch.zeros(g, n, dtype=torch.int64)
        start = 0
        for d, cnt in enumerate(h2.num_send_per_rank):
            if cnt:
                counts[d] = torch.bincount(src_node[fwd[start:start + cnt]], minlength=n)
            start += cnt
        recv_counts = self._exchange_counts(counts)          # [g source, n node]
        # (local source j, node m) blocks arrive j-major; the contract wants m-major.
        block_start = torch.cumsum(recv_counts.flatten(), 0) - recv_counts.flatten()
        block_start = block_start.view(g, n)
        pieces = [torch.arange(int(block_start[j, m]), int(block_start[j, m] + recv_counts[j, m]))
                  for m in range(n) for j in range(g)]
        perm = (torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)).to(x2.device)
        num_recv = tuple(int(recv_counts[j, m]) for m in range(n) for j in range(g))
        flat = compute_send_layout(topk_idx, self.cfg.num_experts, self.world_size)
        recv_idx = i2.index_select(0, perm)
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=int(perm.numel()), topk_idx=topk_idx,
            send_token_idx=flat.send_token_idx_S,
            num_send_per_rank=tuple(int(v) for v in flat.num_tokens_per_rank_W.tolist()),
            num_recv_per_rank=num_recv, recv_topk_idx=recv_idx,
            state=HierDispatchState(net=h1, local=h2, perm=perm, owner=id(self)))
        return x2.index_select(0, perm), recv_idx, w2.index_select(0, perm), tpe, handle

    def _exchange_counts(self, counts_GN: torch.Tensor) -> torch.Tensor:
        """All-to-all inside the node: row d of ``counts_GN`` goes to local rank d; returns
        ``[G, N]`` int64 (CPU): what each local source forwards here, per source node."""
        g, n = counts_GN.shape
        send = counts_GN.to(self._ctl).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.node_group)
        recv = recv.cpu()
        if (recv < 0).any() or int(recv.sum()) > n * g * self.cfg.max_tokens_per_rank:
            self._broken = f"rank {self.rank}: hier received invalid forward counts {recv.tolist()}"
            raise TransportError(self._broken)
        return recv

    def dispatch_cached(self, x, handle):
        """Replays ``handle``'s route for ``x`` ``[T, D]``: returns ``[N, D]``."""
        err = self._state(handle) or self._rows_check(x, handle.num_tokens, "cached dispatch x")
        self._agree("dispatch_cached", err)
        st = handle.state
        x1 = self._stage(self.network.dispatch_cached, x, st.net)
        x2 = self._stage(self.local.dispatch_cached, x1, st.local)
        return x2.index_select(0, st.perm)

    def _unpermute(self, y, st):
        y2 = torch.empty_like(y)
        y2.index_copy_(0, st.perm, y)
        return y2

    def combine(self, y, handle):
        """``y`` ``[N, D]`` -> ``[T, D]`` in y's dtype; sums grouped by node (module docstring)."""
        err = self._state(handle) or self._rows_check(y, handle.num_recv_tokens, "combine y")
        self._agree("combine", err)
        st = handle.state
        z1 = self._stage(self.local.combine, self._unpermute(y.contiguous(), st), st.local)
        return self._stage(self.network.combine, z1, st.net)

    def combine_topk_weights(self, grad_recv_topk_weights, handle):
        """``[N, K]`` float32 -> ``[T, K]`` float32 (exact: one non-zero source per slot)."""
        g = grad_recv_topk_weights
        err = self._state(handle) or self._rows_check(
            g, handle.num_recv_tokens, "combine_topk_weights input", handle.recv_topk_idx.shape[1])
        self._agree("combine_topk_weights", err)
        st = handle.state
        z1 = self._stage(self.local.combine_topk_weights,
                         self._unpermute(g.float().contiguous(), st), st.local)
        return self._stage(self.network.combine_topk_weights, z1, st.net)

    def after_backward(self) -> None:
        self.network.after_backward()
        self.local.after_backward()

    def close(self) -> None:
        for t in (getattr(self, "local", None), getattr(self, "network", None)):
            if t is not None:
                t.close()
        self._broken = self._broken or "closed"
