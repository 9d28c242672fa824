"""``efa_ep.tools.bench`` (``efa-ep-bench``): times expert-parallel dispatch + combine of every
transport side by side, honestly.

One command launches its own ranks, times every arm with one boundary, checks every arm against
``torch`` before timing it, and writes raw records, a summary, a markdown table and box plots.
The method in code:

1. **One timing boundary for every arm**: inputs (x, route, weights) are built before it; each
   sample starts after all ranks pass a barrier and the device is synchronized, and ends when
   combine has completed. Nothing arm-specific happens inside. Two timing modes (``timing``):
   ``single`` is *barrier-aligned single shot* (host clock around one dispatch + combine and a
   device sync); ``steady`` times ``steady_iters`` back-to-back dispatch + combine iterations
   with CUDA events on the current stream (host clock after a device sync on CPU) and reports
   elapsed / ``steady_iters``. Every record says which (``timing``, ``clock``).
2. **Slowest rank** is the primary metric: every rank's per-sample times are gathered and the
   max is taken per sample (:func:`bench_stats.slowest_rank`); a start's value is the median
   over its measured samples. Aggregate input tokens/s = EP x tokens_per_rank / latency.
3. **Independent starts**: every start is a fresh launch of all ranks (>= 20 by default); the
   cell order is rotated by one position per start; warm-up samples are excluded. Summaries
   give n and the median of the start values, with a bootstrap interval only where n makes it
   meaningful (:func:`bench_stats.summarize`), otherwise min/median/max.
4. **Correctness before timing**: each arm's dispatch outputs and combine output are compared
   bit for bit with the ``torch`` transport on the same input (the contract requires equality);
   a failure voids the cell in that start and is reported.
5. **Provenance in every record**: git commit, versions (torch, Triton, megatron-core, the NCCL
   library actually loaded, libfabric), CPU/GPU model and SMs, the kernels' SM budget, MPS,
   ranks per GPU/node, the process group's backend, channel count, resolved transport options
   (gda ``num_programs``/``launch_gate``, proxy channels/provider), environment knobs, and
   whether the shapes were scaled down.

Arms of the ``transport`` view: each efa-ep transport, and the raw collective arm ``nccl``:
``torch.distributed.all_to_all_single`` of the same bytes as dispatch + combine (a
dispatch-sized exchange of each sent row with its routing metadata, then a combine-sized
exchange back, with the per-destination row counts the dispatcher sends), on the same ranks,
inside the same boundary. It needs an NCCL group (``backend=nccl``); ``arms.nccl_arm=gloo`` runs
the same exchange over gloo for CPU tests, named ``a2a:gloo``. Control collectives (check
agreement, barriers, broadcasts) put their tensors on :func:`collective_device` of the group.

``hier`` runs only when listed (``arms.transports=[torch,proxy,hier]``), as one arm per
``arms.hier_aggregate`` value (``hier:agg1`` once per destination node, ``hier:agg0`` once per
destination rank), with ``node_size`` = the emulated ranks per node (null: per host).

``gda`` runs as one arm per ``arms.gda_modes`` entry: ``gda`` (regular dispatch, compact
receive, one host sync), ``gda:fixed`` (``dispatch_fixed``: the window is the receive buffer,
no host sync) and ``gda:graph`` (that dispatch + combine captured once in a CUDA graph, each
sample one replay); the fixed arms are checked on the used window rows.

Network counts: every transport record has ``net_counts``: the network messages, rows, payload
bytes, libfabric writes and wire bytes of one dispatch and one combine, summed over the ranks
(from the transports' ``last_op_counts``; None for arms that do not count, e.g. ``torch``), and
the flat route's cross-node figure at the same layout; the table lists them per counting arm.

Views: ``transport`` (dispatch+combine of a transport; ``transport_view=false`` leaves it out)
and ``layer`` (one Megatron ``MoELayer`` forward+backward with the ``efa`` dispatcher on each
transport of ``layer.transports`` vs Megatron's ``alltoall``), once per training feature of
``layer.features`` (:mod:`.features`: ``plain``, ``pad`` drop-and-pad capacity mode, ``shared``
and ``shared_overlap`` shared expert without and with overlap); ``alltoall`` runs in the same
mode as ``efa`` in every feature, records carry the feature, and every record's
``vs_reference`` is its ratio to the reference arm in the same cell, feature and start.

Modules: :mod:`.schema` (record schema, timing modes), :mod:`.arms` (arms from the config,
config checks), :mod:`.features` (the layer view's training features), :mod:`.cells` (cells,
their order, route statistics), :mod:`.rank` (rank
context, inputs, checks, control collectives, timing), :mod:`.transport_cells`,
:mod:`.collective_cell` and :mod:`.layer_cell` (one cell of each kind), :mod:`.start` (one start
of all ranks), :mod:`.report` (summary, table, plots), :mod:`.cli` (the command). Routes are
:func:`efa_ep.testing.routes.bench_route`.

Usage::

    efa-ep-bench                        # conf/bench/default.yaml (CPU-feasible sizes)
    efa-ep-bench --quick                # CI smoke run (< 60 s)
    efa-ep-bench --config-name gpu      # real shapes, bf16, ranks as processes on one GPU
    efa-ep-bench --config-name gpu_nccl # real shapes, one rank per GPU, NCCL group, nccl arm
    efa-ep-bench --config-name gpu_layer_features  # layer view only: each feature, gda vs alltoall
"""
from .arms import (EXTERNAL, GDA_MODES, NCCL_ARM_MODES, Arm, collective_arm, gda_arms, hier_arms,
                   nccl_arm_refusal, resolve_arms, timing_modes, transport_view, validate_config)
from .cells import Cell, build_cells, rotate, route_stats
from .cli import main, run
from .collective_cell import pack_rows, run_collective_cell, unpack_rows
from .features import (FEATURES, check_features, efa_settings, feature_parts, layer_features,
                       megatron_overrides)
from .layer_cell import run_layer_cell
from .rank import (TRANSPORT_KNOBS, RankContext, all_ranks_ok, broadcast_, cell_inputs, clock_of,
                   collective_device, compare_to_reference, finish_record, resolve_device,
                   time_samples, transport_info, void_record)
from .report import (REFERENCE_ARMS, add_reference_ratios, box_plots, markdown_table,
                     net_counts_table, summarize_records)
from .schema import COLLECTIVE_ARM_NAMES, DTYPES, RECORD_FIELDS, SCHEMA, TIMING_MODES, timing_boundary
from .start import start_main
from .transport_cells import NET_COUNT_FIELDS, emulated_node_size, net_counts, run_transport_cell

__all__ = [
    "Arm", "COLLECTIVE_ARM_NAMES", "Cell", "DTYPES", "EXTERNAL", "FEATURES", "GDA_MODES",
    "NCCL_ARM_MODES", "NET_COUNT_FIELDS", "RECORD_FIELDS", "REFERENCE_ARMS", "RankContext",
    "SCHEMA", "TIMING_MODES", "TRANSPORT_KNOBS", "add_reference_ratios", "all_ranks_ok",
    "box_plots", "broadcast_", "build_cells", "cell_inputs", "check_features", "clock_of",
    "collective_arm", "collective_device", "compare_to_reference", "efa_settings",
    "emulated_node_size", "feature_parts", "finish_record", "gda_arms", "hier_arms",
    "layer_features", "main", "markdown_table", "megatron_overrides", "nccl_arm_refusal",
    "net_counts", "net_counts_table", "pack_rows", "resolve_arms", "resolve_device", "rotate",
    "route_stats", "run", "run_collective_cell", "run_layer_cell", "run_transport_cell",
    "start_main", "summarize_records", "time_samples", "timing_boundary", "timing_modes",
    "transport_info", "transport_view", "unpack_rows", "validate_config", "void_record",
]
