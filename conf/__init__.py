"""``efa_ep.conf`` (this folder, ``conf/``): the Hydra configs of efa-ep-bench (``bench/``),
efa-ep-loss-match (``loss_match/``), efa-ep-plan (``plan/``), efa-ep-doctor (``doctor/``), the
GRPO trainer (``grpo/``), models and transports; data only."""
