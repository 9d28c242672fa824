"""The ``gda`` transport: GPU-initiated dispatch and combine through symmetric-memory windows.

The GPU moves every byte: Triton kernels store token rows straight into the peers' receive
windows (torch symmetric memory, CUDA backend: NVLink peers of one host, or several ranks as
processes on one GPU) and raise per-source flags; no CPU on the data path. Kernels and the flag
protocol: :mod:`efa_ep.kernels.gda.device` (read its module docstring first).

Symbols: W ranks, T tokens here, K top-k, E experts, L = E // W, H hidden, D row width,
T_MAX = ``max_tokens_per_rank``, N rows received, S rows sent.

Windows (allocated once per transport, collective, reused by every call):
    One ``symm_mem.empty`` byte buffer per rank holding two parities of
    ``data [W, T_MAX, H * elem bytes] | idx [W, T_MAX, K_CAP] int64 | wts [W, T_MAX, K_CAP] f32 |
    hdr [W, 2 + L] int64``, each region 256-byte aligned; ``K_CAP`` = option ``max_topk``
    (default 16). Bytes per rank ~= 2 * W * T_MAX * (H * elem + 12 * K_CAP). Op ``e`` uses parity
    ``e % 2`` for every window kind (data of dispatch, returned rows of combine), which is what
    lets windows be reused with no resets and no extra acknowledgement (protocol step 5).

One dispatch (collective, current stream; kernels in order):
    1. host: shape/dtype/capacity checks (no sync). An overflow (T > T_MAX, K > K_CAP, rows wider
       than the window) raises here, before any byte moves, on the offending rank; it still
       takes part in the count exchange with ``status`` set, so its peers raise too instead of
       timing out.
    2. ``layout`` (2 launches over token blocks): slot of every (token, destination), rows per
       destination, (token, expert) pairs per expert, value checks (bad ids, NaN weights).
    3. ``dispatch_store``: every token row stored once per destination rank at
       ``window[me * T_MAX + slot]`` of that rank (16-byte stores), with its local expert ids and
       weights; program 0 also writes the count header ``[status, rows, rows per local expert]``
       into every destination (the count exchange); the grid's last program raises the
       per-source signal (release, system scope).
    4. ``recv_header`` (1 program): waits (acquire, bounded) for all W sources, gathers headers
       and the error word into one small array and writes it over the bus into page-locked host
       memory, then the op's record after it (release, system scope); the host waits for that
       word (natively launched ops; the Python launch path copies and synchronizes instead):
       **the one host sync per dispatch** (Megatron needs ``tokens_per_expert`` on the CPU, as
       in its alltoall dispatcher).
    5. ``gather_rows``: the receive permutation, window -> compact ``recv_x [N, H]`` in
       (source, token) order, with ids and weights.
Combine: ``combine_store`` returns row i to its source's window at ``me * T_MAX + j`` and signals
(a weight combine's gradient goes back with the slots of experts on other ranks as 0);
a one-program wait kernel waits (bounded) for every source; ``combine_reduce`` then sums the
partials in ascending rank order in float32 from +0.0, rounding once: bit-equal to ``torch``.
No host sync; a deadline expiry is recorded in the error word and raised at the next dispatch
(or by :meth:`GdaTransport.check_errors` / ``after_backward``, or at once with option
``check_every_call=1``). ``dispatch_cached`` replays the layout with new rows, no host sync.

Never stuck, never silently wrong:
    * The stall this design prevents (4 ranks as MPS clients of one H200, every run before
      it): a combine wait spun until its deadline for a store its peer had not issued, every
      rank's host sat in Triton's module load, and the reduce then summed without that peer's
      rows. Measured since (``scripts/probes/gda_stall_probe.py``): a module load waits for the
      process's *own* running kernels (1.7 s behind a 2 s spin; 0.3 ms idle), so a rank whose
      wait spins cannot issue anything until that wait ends. A wait must therefore only ever
      wait for stores already in the peers' streams. Hence the **launch gate**: a rank launches
      a waiting kernel only after every source has *issued* (enqueued) the op's stores, told
      through a host shared-memory board (:class:`LaunchGate`, on by default). A wait then depends only on kernels already in
      streams, which complete whatever the hosts do; a peer that never issues is found on the
      host, within ``timeout_s``, and named. Pre-loading kernels is not enough: any library may
      load a module or allocate between two ops.
    * Waits run in one-program kernels, so a spinning wait holds one program slot, never the SMs
      a peer's store on the same GPU needs (full-width spinning grids starved them).
    * An expired wait records the op (number and kind: dispatch, combine, cached dispatch,
      weight combine) and the missing sources in the error word; every later gather/reduce of
      the transport writes NaN rows, so no output looks valid; the host raises
      :class:`PeerTimeoutError` naming the op, its kind, the waiting rank and the missing ranks
      at the next dispatch, ``check_errors`` or ``after_backward``. After any deadline or peer
      failure the transport refuses further calls on every rank that sees it (the group's
      epochs no longer agree): rebuild it.
    * Bad input raises the same :class:`DispatchInputError` on every rank, with the offending
      rank's own words, and the transport stays usable: the offending rank posts its words on
      the launch gate's board and still takes part in the op (a dispatch with no rows and a bad
      status in its header; a combine or cached dispatch that moves no rows but signals and
      waits, so every epoch stays in step); the peers read the words after the count read or
      after the op's gate. With ``launch_gate=off`` only the dispatch's status travels: a bad
      combine input then breaks the transport and the peers' waits expire as above.

Fixed-capacity mode (:meth:`GdaTransport.dispatch_fixed`; inference and decode):
    no host sync and no receive copy: the layout, store and a one-program fixed receive
    (``recv_header_fixed``: counts into device tensors, unused rows of the window marked with
    ids -1 / weights 0) and then the returned ``recv_x [W * T_MAX, H]`` *is* the window; every
    launch has a grid fixed by T and T_MAX. ``combine`` with its handle takes ``y`` in the same
    layout and returns only rows ``j < n_s`` (counts read on the device). The views are
    overwritten two ops later (window parity): hold at most one fixed dispatch result while its
    combine runs, as in DeepEP's low-latency mode; training keeps the regular ``dispatch``
    (activations saved for backward must outlive that).

CUDA graphs (:meth:`GdaTransport.capture`, :class:`GdaGraph`): fixed-capacity ops have static
grids and no host sync, so a sequence of them is captured once and replayed with one host
call (decode D+C on one H200: ~7 us of host time instead of ~500). Kernels take op numbers as
``op_base[0] + delta`` with the base on the device; the graph's last node advances it, and a
replay first moves it past any eager call made since (and restores the window parity with a
barrier op when needed), so graphs and eager calls interleave freely.

Package layout: ``transport`` (:class:`GdaTransport`: op sequencing, checks, errors), ``gate``
(:class:`LaunchGate` for ranks sharing a GPU), ``window`` (:class:`WindowLayout`, the handle
state), ``graph`` (CUDA graph capture and replay), ``phases`` (each op phase's launches, natively
or through the wrappers), ``fixed`` (the fixed-capacity dispatch), ``launches`` (the
kernels' host wrappers), ``device`` and
``layout_kernels`` (the Triton kernels), ``refusal`` (bad input on one rank: the same error on
every rank).
"""
from __future__ import annotations

from .gate import LaunchGate, PeerFailedError, PeerTimeoutError
from .graph import GdaGraph
from .transport import GdaTransport, availability
from .window import GdaDispatchState, WindowLayout

__all__ = ["GdaTransport", "GdaGraph", "availability", "LaunchGate", "PeerTimeoutError",
           "PeerFailedError", "WindowLayout", "GdaDispatchState"]
