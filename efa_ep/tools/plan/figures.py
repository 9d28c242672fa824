"""The planner's value types: :class:`Fig` (a value with its unit, provenance tag and source)
and :class:`Inputs` (the layout, model and fabric a plan is made for)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

TAGS = ("measured", "derived", "assumed")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


@dataclasses.dataclass(frozen=True)
class Fig:
    """A number with its provenance.

    Attributes:
        value: the number (or a (low, high) range / a small dict for the DeepEP-on-EFA study's
            comparison points).
        unit: its unit (``us``, ``B``, ``GB/s``, ``fraction`` ...).
        tag: ``measured`` (a measurement: this project's record or the DeepEP-on-EFA
            study's), ``derived`` (computed from other figures by this model), ``assumed`` (an
            input, a spec sheet or a modelling choice).
        source: where it comes from (record file and date, study experiment, spec sheet,
            formula).
    """

    value: Any
    unit: str
    tag: str
    source: str

    def __post_init__(self):
        if self.tag not in TAGS:
            raise ValueError(f"provenance tag={self.tag!r} must be one of {TAGS}")

    def to_dict(self) -> Dict[str, Any]:
        return {"value": self.value, "unit": self.unit, "tag": self.tag, "source": self.source}

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "Fig":
        v = d["value"]
        return Fig(tuple(v) if isinstance(v, list) else v, d["unit"], d["tag"], d["source"])


def derived(value: float, unit: str, formula: str) -> Fig:
    return Fig(value, unit, "derived", formula)


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Inputs:
    """Everything one plan needs, resolved to numbers (units in the names or comments)."""

    model: str
    hidden: int
    num_experts: int
    topk: int
    moe_layers: int
    moe_ffn_hidden: int           # per-expert FFN width (SwiGLU: 3 matrices H x F)
    seq_length: int
    micro_batch: int
    dtype: str                    # bf16 | fp16 | fp8 | fp32: the moved rows' dtype
    fabric: str
    nodes: int
    gpus_per_node: int
    ep: int
    tp: int = 1
    tokens_per_rank: Optional[int] = None       # default seq_length x micro_batch / tp
    micro_batches_per_step: Optional[int] = None  # default 1
    gpu: str = "?"
    hbm_gb: float = 80.0           # GB per GPU
    nvlink_gbps: float = 450.0     # GB/s per GPU per direction
    efa_gbps_per_node: float = 400.0   # GB/s per node (sum of NICs)
    gpu_tflops_bf16: float = 989.0     # dense bf16 TFLOPS per GPU
    gemm_efficiency: float = 0.5       # fraction of peak the expert GEMMs reach
    max_channels: int = 8
    chunk_bytes: int = 262144
    proxy_same_node: str = "channels"  # channels | nvlink
    max_tokens_per_rank: Optional[int] = None   # window sizing; default tokens_per_rank
    memory_budget: float = 0.7         # fraction of HBM the experts' weights+grads+optimizer may use
    win_margin: float = 0.9            # efa must be <= margin x the best Megatron path to win
    sources: Dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in ("hidden", "num_experts", "topk", "moe_layers", "moe_ffn_hidden", "seq_length",
                     "micro_batch", "nodes", "gpus_per_node", "ep", "tp", "max_channels", "chunk_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(DTYPE_BYTES)}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.ep:
            raise ValueError(f"num_experts={self.num_experts} must be a multiple of ep={self.ep} "
                             f"(experts split evenly over the EP ranks)")
        world = self.nodes * self.gpus_per_node
        if self.ep * self.tp > world:
            raise ValueError(f"ep={self.ep} x tp={self.tp} needs {self.ep * self.tp} GPUs, but "
                             f"nodes={self.nodes} x gpus_per_node={self.gpus_per_node} = {world}")
        if self.ep > self.gpus_per_node and self.ep % self.gpus_per_node:
            raise ValueError(f"ep={self.ep} spans nodes, so it must be a multiple of "
                             f"gpus_per_node={self.gpus_per_node}")
        if self.proxy_same_node not in ("channels", "nvlink"):
            raise ValueError(f"proxy_same_node={self.proxy_same_node!r} must be 'channels' or 'nvlink'")
        if self.tokens_per_rank is None:
            self.tokens_per_rank = max(1, self.seq_length * self.micro_batch // self.tp)
        if self.micro_batches_per_step is None:
            self.micro_batches_per_step = 1
        if self.max_tokens_per_rank is None:
            self.max_tokens_per_rank = self.tokens_per_rank

    @property
    def ranks_per_node(self) -> int:
        """L: ranks of one EP group on one node."""
        return min(self.ep, self.gpus_per_node)

    @property
    def group_nodes(self) -> int:
        return max(1, self.ep // self.ranks_per_node)

    @property
    def row_bytes(self) -> int:
        return self.hidden * DTYPE_BYTES[self.dtype]

    def src(self, key: str, default: str) -> str:
        return self.sources.get(key, default)
