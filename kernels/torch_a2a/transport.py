"""The ``torch`` transport: the reference, built on ``torch.distributed.all_to_all_single``.

Runs on any backend with all-to-all (gloo on CPU, NCCL on GPU).

Every operation starts with the status exchange of :func:`efa_ep.kernels.base.exchange_status`:
one small all-to-all of ``[W, 9 + L]`` int64 headers that every rank enters, even one whose
inputs are bad, so a bad input on one rank is refused on every rank with the same message before
any row moves. For ``dispatch`` that exchange is also the count exchange (rows and rows per
local expert ride in the header), so a dispatch is three collectives: headers, rows, and the
routing metadata (local expert ids and the float32 weights' bit patterns in one int64 tensor).
``combine``, ``dispatch_cached`` and ``combine_topk_weights`` are two: headers, then rows.

Failures: a collective that fails (dead peer, closed connection, the process group's timeout),
a peer whose announced counts or routing metadata fail validation, or ranks running different
operations leave this transport broken: the call raises (:class:`PeerFailure`,
:class:`ProtocolError`) and every later call raises :class:`TransportBroken` carrying the
original error, without communicating. Input errors (:class:`DispatchInputError`) do not break
it. The deadline of every wait is the process group's timeout
(``init_process_group(timeout=...)``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..core.hosts import gather_processes, host_id, pid_exited
from ..base import (
    H_AUX, H_D, H_DTYPE, H_K, H_REF, H_ROWS, H_STATUS, OP_HEADER_FIELDS, STATUS_BAD_RECEIVED,
    DispatchHandle, DispatchInputError, HandleState, PeerFailure, ProtocolError, Transport,
    TransportBroken, TransportError, check_received_counts, compute_send_layout, count_sends,
    describe_value_errors, exchange_status, float_bits_to_int64, int64_to_float_bits,
    local_weight_grads, new_op_header, ranks_in_mask, received_metadata_errors, reduce_rows_by_rank,
    rows_input_error, validate_dispatch_inputs, value_error_flags,
)


def availability():
    """None: the torch transport runs wherever torch.distributed does."""
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    return None


@dataclasses.dataclass(frozen=True)
class TorchHandleState(HandleState):
    """``DispatchHandle.state`` of the torch transport.

    Attributes:
        owner: the transport object that made the handle (:class:`HandleState`).
        dispatch_seq: the operation number of the dispatch; ranks must pair a combine with the
            same dispatch, and the status exchange checks they do.
        k: K (top-k) of the dispatch.
    """

    dispatch_seq: int
    k: int


class TorchTransport(Transport):
    """Reference transport; see ``efa_ep.kernels.base`` for the contract.

    Synchronization: blocking collectives on the current stream (NCCL) or the host (gloo). The
    CPU waits once per operation, for the status headers (for dispatch these carry the counts
    Megatron needs on the host anyway). Not CUDA-graph capturable.

    Warning: on CUDA tensors the check of received routing metadata (local expert ids in
    [-1, L), per-expert counts equal to the announced ones) runs on the device and is reported
    by the next operation's status exchange, on every rank, so that dispatch keeps a single
    host sync; on the CPU it runs before dispatch returns.
    """

    name = "torch"
    state_type = TorchHandleState

    def __init__(self, cfg, group):
        super().__init__(cfg, group)
        self._seq = 0
        self._failure: Optional[TransportError] = None
        # Deferred device-side check of the last dispatch's received metadata (CUDA only):
        # (dispatch seq, int64 bitmask of bad sources on the device).
        self._pending_check = None
        self._group_ranks = dist.get_process_group_ranks(group)
        # Who is who, to name a dead peer when the backend only reports a socket error.
        self._peers = gather_processes(group)

    # Failure handling ---------------------------------------------------------------------
    def _describe_ranks(self) -> str:
        return f"EP group ranks 0..{self.world_size - 1} (global ranks {self._group_ranks})"

    def _dead_peers(self):
        me = host_id()
        dead, unknown = [], []
        for r, (host, pid) in enumerate(self._peers):
            if r == self.rank:
                continue
            if host != me:
                unknown.append(r)
            elif pid_exited(pid):
                dead.append(r)
        return dead, unknown

    @contextlib.contextmanager
    def _step(self, op: str, seq: int, stage: str):
        """Turns a failed collective into a :class:`PeerFailure` naming op, stage and peers."""
        try:
            yield
        except TransportError:
            raise
        except RuntimeError as e:  # gloo/NCCL errors (DistBackendError & co.) are RuntimeErrors
            text = str(e)
            dead, unknown = self._dead_peers()
            closed = any(w in text.lower() for w in ("closed", "reset", "broken pipe"))
            for _ in range(10):  # a peer that closed its sockets may still be exiting
                if dead or not closed:
                    break
                time.sleep(0.05)
                dead, unknown = self._dead_peers()
            if "timed out" in text.lower() or "timeout" in text.lower():
                kind = "missed the deadline (the process group's timeout)"
            else:
                kind = "failed"
            if dead:
                who = f"peer rank(s) {dead} exited (pids {[self._peers[r][1] for r in dead]})"
            else:
                who = "no peer on this host has exited (a peer is slow, hung, or on another host)"
            if unknown:
                who += f"; rank(s) {unknown} are on other hosts (not checked)"
            raise PeerFailure(
                f"rank {self.rank}: torch {op} #{seq} {kind} in {stage} over "
                f"{self._describe_ranks()}: {who}; backend error: {type(e).__name__}: "
                f"{str(e).strip()[:500]}") from e

    def _all_to_all(self, op, seq, stage, out, inp, out_splits=None, in_splits=None):
        """The only place this transport communicates (tests replace it to tamper with data)."""
        with self._step(op, seq, stage):
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def _run(self, op: str, body, *args):
        """Runs one operation: refuses when broken, numbers it, marks the transport broken on
        any failure other than an input error (which every rank raised together)."""
        if self._failure is not None:
            raise TransportBroken(
                f"rank {self.rank}: torch {op} refused: this transport failed earlier and is "
                f"broken; create a new one. Original error: {self._failure}") from self._failure
        self._seq += 1
        try:
            return body(self._seq, *args)
        except DispatchInputError:
            raise
        except TransportError as e:
            self._failure = e
            raise
        except Exception as e:
            # A local failure in the middle of an operation leaves the peers' collectives out of
            # step with ours: nothing after it can be trusted.
            self._failure = TransportError(
                f"rank {self.rank}: torch {op} #{self._seq} failed locally: {type(e).__name__}: {e}")
            raise

    def _header(self, op, seq, device, **fields):
        h = new_op_header(self.world_size, self.cfg.num_local_experts, device, op=op, seq=seq,
                          **fields)
        if self._pending_check is not None:
            # The last dispatch's received-metadata check, folded in without a host sync.
            _, mask = self._pending_check
            mask = mask.to(h.device)
            h[:, H_STATUS] |= torch.where(mask != 0, STATUS_BAD_RECEIVED, 0)
            h[:, H_AUX] = mask
        return h

    def _describe_status(self, bits: int) -> Optional[str]:
        if bits & STATUS_BAD_RECEIVED and self._pending_check is not None:
            dseq, mask = self._pending_check
            return self._bad_metadata_message(dseq, int(mask))
        return None

    def _bad_metadata_message(self, dispatch_seq: int, mask: int) -> str:
        return (f"rank {self.rank}: routing metadata received in dispatch #{dispatch_seq} from "
                f"rank(s) {ranks_in_mask(mask, self.world_size)} failed validation: expected "
                f"local expert ids in [-1, {self.cfg.num_local_experts}), at least one local "
                f"expert per row, and per-expert counts equal to the announced ones")

    def _exchange(self, op, seq, header, error, describe=None, agree=()):
        try:
            return exchange_status(
                self.group, self.rank, op, seq, header, error,
                describe=describe or self._describe_status, agree=agree,
                all_to_all=lambda o, i: self._all_to_all(op, seq, "the status exchange", o, i))
        finally:
            self._pending_check = None  # reported (or clean) once it has been exchanged

    # Operations ---------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, topk_weights):
        return self._run("dispatch", self._dispatch, x, topk_idx, topk_weights)

    def _dispatch(self, seq, x, topk_idx, topk_weights):
        cfg, world, op = self.cfg, self.world_size, "dispatch"
        error = validate_dispatch_inputs(cfg, self.rank, x, topk_idx, topk_weights,
                                         value_checks=False)
        device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
        if error is None and topk_idx.device.type == "meta":
            error = f"rank {self.rank}: x, topk_idx and topk_weights must hold data, got meta tensors"
        k = topk_idx.shape[1] if error is None else -1
        header = self._header(op, seq, device if error is None else "cpu", k=k, d=cfg.hidden,
                              dtype=cfg.dtype)
        if error is None:
            # No host sync here: value checks and counts stay on the device until the exchange.
            header[:, H_STATUS] |= value_error_flags(cfg, topk_idx, topk_weights)
            num_per_rank, num_per_expert = count_sends(topk_idx, cfg.num_experts, world)
            header[:, H_ROWS] = num_per_rank
            header[:, OP_HEADER_FIELDS:] = num_per_expert.view(world, cfg.num_local_experts)

        def describe(bits):
            return self._describe_status(bits) or describe_value_errors(
                cfg, self.rank, topk_idx, topk_weights)

        send, recv = self._exchange(op, seq, header, error, describe, agree=(H_K,))
        num_send = send[:, H_ROWS].tolist()
        num_recv = recv[:, H_ROWS].tolist()
        recv_per_expert = recv[:, OP_HEADER_FIELDS:]
        bad = check_received_counts(self.rank, num_recv, recv_per_expert, k,
                                    cfg.max_tokens_per_rank)
        if bad is not None:
            raise ProtocolError(f"torch dispatch #{seq}: {bad}")
        tokens_per_expert = recv_per_expert.sum(0)
        layout = compute_send_layout(topk_idx, cfg.num_experts, world, num_rows=sum(num_send))
        send_x = x.index_select(0, layout.send_token_idx_S)
        n_recv = sum(num_recv)
        recv_x = x.new_empty((n_recv, x.shape[1]))
        self._all_to_all(op, seq, "the all-to-all of rows", recv_x, send_x, num_recv, num_send)
        # Weights travel as exact float32 bit patterns beside the ids: one collective, lossless.
        send_w = torch.where(layout.send_topk_idx_SK >= 0,
                             topk_weights.index_select(0, layout.send_token_idx_S), 0.0)
        send_meta = torch.cat([layout.send_topk_idx_SK, float_bits_to_int64(send_w)], dim=1)
        recv_meta = send_meta.new_empty((n_recv, 2 * k))
        self._all_to_all(op, seq, "the all-to-all of routing metadata", recv_meta,
                         send_meta.contiguous(), num_recv, num_send)
        recv_topk_idx = recv_meta[:, :k].contiguous()
        recv_topk_weights = int64_to_float_bits(recv_meta[:, k:]).contiguous()
        mask = received_metadata_errors(recv_topk_idx, num_recv, recv_per_expert,
                                        cfg.num_local_experts)
        if mask.device.type == "cpu":
            if int(mask):
                raise ProtocolError(f"torch dispatch #{seq}: "
                                    + self._bad_metadata_message(seq, int(mask)))
        else:
            self._pending_check = (seq, mask)
        handle = DispatchHandle(
            num_tokens=x.shape[0], num_recv_tokens=n_recv, topk_idx=topk_idx,
            send_token_idx=layout.send_token_idx_S, num_send_per_rank=tuple(num_send),
            num_recv_per_rank=tuple(num_recv), recv_topk_idx=recv_topk_idx,
            state=TorchHandleState(owner=self.uid, dispatch_seq=seq, k=k))
        return recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle

    def dispatch_cached(self, x, handle):
        return self._run("dispatch_cached", self._dispatch_cached, x, handle)

    def _dispatch_cached(self, seq, x, handle):
        op = "dispatch_cached"
        error = self.handle_error(handle) or rows_input_error(
            self.rank, "cached dispatch input x", x, handle.num_tokens,
            device=handle.topk_idx.device)
        self._handle_op_status(op, seq, x, handle, error, back=False)
        send_x = x.index_select(0, handle.send_token_idx)
        recv_x = x.new_empty((handle.num_recv_tokens, x.shape[1]))
        self._all_to_all(op, seq, "the all-to-all of rows", recv_x, send_x,
                         list(handle.num_recv_per_rank), list(handle.num_send_per_rank))
        return recv_x

    def combine(self, y, handle):
        return self._run("combine", self._combine, y, handle, "combine")

    def combine_topk_weights(self, grad_recv_topk_weights, handle):
        """``[N, K]`` float32 -> ``[T, K]`` float32 (see :class:`Transport`); its inputs are
        checked in the status exchange like every other operation's."""
        return self._run("combine_topk_weights", self._combine, grad_recv_topk_weights, handle,
                         "combine_topk_weights")

    def _combine(self, seq, y, handle, op):
        error = self.handle_error(handle)
        if error is None:
            error = rows_input_error(
                self.rank,
                "combine_topk_weights input grad" if op != "combine" else "combine input y",
                y, handle.num_recv_tokens, device=handle.topk_idx.device)
        if error is None and op == "combine_topk_weights":
            k = handle.state.k
            if y.shape[1] != k or y.dtype != torch.float32:
                error = (f"rank {self.rank}: combine_topk_weights input must be "
                         f"[{handle.num_recv_tokens}, {k}] torch.float32 (K of the dispatch), "
                         f"got {list(y.shape)} {y.dtype}")
        self._handle_op_status(op, seq, y, handle, error, back=True)
        if op == "combine_topk_weights":
            # Each slot is non-zero in exactly one destination row once the -1 slots are masked,
            # and 0.0 + v == v exactly, so the float32 sum returns the values unchanged.
            y = local_weight_grads(y, handle.recv_topk_idx)
        back = y.new_empty((sum(handle.num_send_per_rank), y.shape[1]))
        self._all_to_all(op, seq, "the all-to-all of rows", back, y.contiguous(),
                         list(handle.num_send_per_rank), list(handle.num_recv_per_rank))
        out = reduce_rows_by_rank(back, handle.send_token_idx, handle.num_send_per_rank,
                                  handle.num_tokens)
        return out.to(y.dtype)

    # Checks -------------------------------------------------------------------------------
    def _handle_op_status(self, op, seq, rows, handle, error, back: bool) -> None:
        """The status exchange of an op on a dispatch's handle: ``rows`` ``[n, D]`` (``error``:
        what is wrong with them or the handle, or None) go the dispatch's way (cached dispatch)
        or, with ``back``, the way back (the combines); the peers must announce the rows the
        handle expects from each of them."""
        ok = error is None
        header = self._header(op, seq, rows.device if ok else "cpu",
                              d=rows.shape[1] if ok else -1, dtype=rows.dtype if ok else None,
                              ref=handle.state.dispatch_seq if ok else -1)
        if ok:
            out_W = handle.num_recv_per_rank if back else handle.num_send_per_rank
            header[:, H_ROWS] = torch.tensor(out_W)
        _, recv = self._exchange(op, seq, header, error, agree=(H_REF, H_D, H_DTYPE))
        self._check_rows_match(op, seq, recv,
                               handle.num_send_per_rank if back else handle.num_recv_per_rank)

    def _check_rows_match(self, op, seq, recv, expected_W) -> None:
        """Rows each source says it will send here must equal what the handle expects."""
        announced = recv[:, H_ROWS].tolist()
        if announced != list(expected_W):
            raise ProtocolError(
                f"rank {self.rank}: torch {op} #{seq}: peers announced {announced} rows for this "
                f"rank, the handle of dispatch expects {list(expected_W)} (rank r's entry is from "
                f"rank r); the ranks' handles do not describe the same dispatch")
