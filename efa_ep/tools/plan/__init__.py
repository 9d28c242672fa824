"""``efa_ep.tools.plan`` (``efa-ep-plan``): a calibrated cost model that says whether an MoE
training job on p5/p5en/p6 should use the ``efa`` dispatcher (``gda`` inside a node, ``proxy``
with ``num_channels`` channels across nodes) or Megatron's ``alltoall``/``allgather``, before
renting the cluster.

Modules: :mod:`.model` (bytes, times, memory, verdict; :class:`~.model.Fig` = a number with
its provenance), :mod:`.presets` (model/fabric sources and the measured DeepEP-on-EFA figures),
:mod:`.calibrate` (fit from bench records, held-out check), :mod:`.report` (tables, JSON,
PNG), :mod:`.cli` (the console script).
"""
from .model import Fig, Inputs, choose_transport, make_plan  # noqa: F401
