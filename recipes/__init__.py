"""``efa_ep.recipes`` (this folder, ``recipes/``): NeMo-RL GRPO recipes for the ``efa``
dispatcher, their launcher, and the built-in trainer.

- ``*.yaml`` here and under ``llm/``: recipes in NeMo-RL's GRPO schema (``grpo_tiny_moe_efa.yaml``
  runs anywhere; ``llm/`` holds the p5en production recipes and their ``alltoall`` twins).
- :mod:`.launcher`: ``efa-ep-grpo --config <recipe> [overrides]``.
- :mod:`.nemo_rl_ext`: the NeMo-RL path (policy-worker extension + ``policy_factory``).
- :mod:`.grpo`: the built-in GRPO trainer.
- ``checks/``: NeMo-RL test-suite-style scripts (run N steps, assert metric thresholds).
"""
