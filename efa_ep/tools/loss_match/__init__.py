"""``efa_ep.tools.loss_match`` (``efa-ep-loss-match``): does a dispatcher change training?

Trains the same tiny Megatron GPT-MoE (:mod:`efa_ep.tiny_moe`: weights seeded per global
parameter name, so the model is the same function at every EP size) on the same seeded
synthetic corpus, once per *arm*, and compares the per-step losses.

Arms (names used everywhere: config, JSON, plot, exported files):

- baselines: ``allgather`` (Megatron's all-gather dispatcher at the same EP size: the dense
  path, no expert all-to-all) and ``ep1`` (EP=1 in one process, every expert local);
- candidates: ``efa:<transport>`` for every transport in ``available_transports()`` (config
  entry ``efa:*``), and Megatron's ``alltoall`` as a control.

Every arm uses the same seeds, data order, optimizer and thread count; determinism is forced
(``torch.use_deterministic_algorithms``, fixed threads, ``CUBLAS_WORKSPACE_CONFIG`` on GPU).
The command launches its own ranks (:func:`efa_ep.distributed.run_ranks`): one launch per EP
size runs its arms one after another (a failed launch is retried one arm per launch, so one
broken transport cannot hide the others).

Output (``out_dir``): ``loss_match.json`` (config, provenance, per-arm per-step loss and grad
norm, per-candidate max abs / rel |d loss| vs each baseline, tolerances with reasons, pass/fail),
``loss_match.png`` (loss curves and per-step |d loss| on a log axis), and the last printed line,
each baseline with its own measured value and its own tolerance (FAIL likewise, exit 1):
``loss-match: PASS: vs allgather max rel |dloss| 0 <= 1e-05; vs ep1 max rel |dloss| 2.208e-05 <=
0.0002; bitwise efa == alltoall; steps=<n> arms=<list>``.

``--export-result DIR`` writes one ``<arm>.txt`` per arm with ``"<step> <repr(loss)>"`` lines;
``--import-result FILE`` adds such a file as a baseline arm ``file:<stem>``; with
``--assert-equal`` every candidate must equal every imported arm bit for bit (torchtitan's
``loss_compare.py`` pattern).

Modules: :mod:`.arms` (arms from the config, config checks), :mod:`.corpus` (the seeded data),
:mod:`.train` (training per rank), :mod:`.launch` (rank launches, per-arm results),
:mod:`.verdict` (comparison and result line), :mod:`.report` (plot, export/import),
:mod:`.cli` (the command).

Usage::

    efa-ep-loss-match                                   # conf/loss_match/cpu.yaml
    efa-ep-loss-match --config-name gpu_bf16            # H200: bf16, 100 steps, ranks on cuda:0
    efa-ep-loss-match steps=20 arms.candidates=[alltoall] out_dir=/tmp/lm
"""
from .arms import Arm, resolve_arms, safe_name, validate_config
from .cli import SCHEMA, main, run
from .corpus import make_corpus, markov_entropy
from .launch import load_routing, run_arms
from .report import export_result, import_result, plot
from .train import rank_main
from .verdict import RESULT_LINE, compare, result_line, routing_diff

__all__ = [
    "Arm", "RESULT_LINE", "SCHEMA", "compare", "export_result", "import_result", "load_routing",
    "main", "make_corpus", "markov_entropy", "plot", "rank_main", "resolve_arms", "result_line",
    "routing_diff", "run", "run_arms", "safe_name", "validate_config",
]
