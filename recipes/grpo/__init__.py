"""``efa_ep.recipes.grpo``: the built-in GRPO trainer: NeMo-RL's GRPO algorithm and config names,
a tiny Megatron GPT-MoE policy on the ``efa`` dispatcher, expert-parallel over local ranks, a
verifiable synthetic task.

- :mod:`.algorithm`: advantages, KL, clipped loss (pure torch).
- :mod:`.config`: one dataclass per recipe section.
- :mod:`.task`: the addition task and its character tokenizer.
- :mod:`.trainer`: the rank loop and :func:`~.trainer.run`.
- :mod:`.metrics`: JSONL / TensorBoard / PNG.
"""
