"""What a benchmark record is: its schema id and fields, the timing modes and their
boundary in words, the dtype names of the configs."""
from __future__ import annotations

SCHEMA = "efa_ep.bench/2"
TIMING_MODES = ("single", "steady")
_BOUNDARY = {
    "single": ("barrier-aligned single shot: [all ranks barrier, device sync] t0 -> {op} -> "
               "device sync -> t1 (host perf_counter); inputs and route built before t0"),
    "steady": ("steady state: [all ranks barrier, device sync] start -> steady_iters x ({op}) "
               "back to back -> end; time per iteration = (end - start) / steady_iters; CUDA "
               "events on the current stream (cuda), host perf_counter after a device sync (cpu); "
               "inputs and route built before start"),
}
_BOUNDARY_OP = {"transport": "dispatch -> combine(recv_x)", "layer": "MoELayer forward + backward"}


def timing_boundary(timing: str, view: str = "transport") -> str:
    """The timing boundary of ``timing`` (single | steady) for ``view``, in words."""
    return _BOUNDARY[timing].replace("{op}", _BOUNDARY_OP[view])


# Fields every raw record has (tests check the schema against this list). ``feature``: the layer
# view's training feature (None in the transport view); ``vs_reference``: this start's median
# over that of the reference arm (torch / alltoall) in the same cell and feature of the same
# start (None when either is void).
RECORD_FIELDS = (
    "schema", "run_id", "start", "order_index", "view", "arm", "transport", "options",
    "num_channels", "profile", "shape", "route", "route_skew", "route_stats", "dtype", "feature",
    "tokens_per_rank", "hidden", "num_experts", "topk", "ep_size", "ranks_per_gpu",
    "ranks_per_node", "device", "collective_backend", "scaled", "scale_note", "warmup", "iters",
    "timing", "steady_iters", "clock", "timing_boundary", "check", "void", "void_reason",
    "slowest_us", "start_median_us", "per_rank_median_us", "vs_reference", "dispatch_rows",
    "dispatch_bytes", "collective_bytes", "net_counts", "sm_budget", "transport_info",
    "host_us", "provenance",
)
# Config dtype names -> torch dtype attribute names.
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}

# Names of the raw collective arms (``vs_collective`` is the ratio to whichever ran).
COLLECTIVE_ARM_NAMES = ("nccl", "a2a:gloo")
