"""``efa_ep.testing``: what the tests, the tools (``efa-ep-bench``) and the GPU scripts share to
build inputs and check results; nothing in the dispatcher or the transports imports it.

- :mod:`efa_ep.testing.routes`: seeded top-k routes, two families with distinct kind names:
  the contract routes of the transport tests and GPU scripts (``random``, ``hot_experts``,
  ``one_rank``, ``dropped``, ``one_node``) and the benchmark's routes (``balanced``,
  ``skewed``, ``uniform``: the names its configs and recorded results use).
- :mod:`efa_ep.testing.moe_layer`: the Megatron ``MoELayer`` of the GPU layer tests and the
  per-rank workers that check it (``gda`` against ``torch``; drop-and-pad CUDA-graph replay
  against eager).
- :mod:`efa_ep.testing.overlap_1f1b`: Megatron's combined-1F1B schedule
  (``overlap_moe_expert_parallel_comm``) driving a tiny GPTModel, one training step per arm
  (dispatcher, transport, overlap on/off), and the bitwise comparison of arms (CPU and GPU
  tests); with stand-ins for the schedule's CUDA-only calls on a CPU-only torch.
- :mod:`efa_ep.testing.reference`: the brute-force single-process reference of the transport
  contract (every rank's expected outputs from every rank's inputs, by loops).
- :mod:`efa_ep.testing.transports`: probes of transport creation (the error a ``proxy`` with
  given options gives).
- :mod:`efa_ep.testing.gda_host`: a ``gda`` transport on CPU tensors with a stand-in for its
  native library, for its host code (the tests of its bound plans, the Python-cost probe).

Importing ``efa_ep.testing`` or its modules needs only torch: Megatron and the transports are
imported inside the functions that use them.
"""
