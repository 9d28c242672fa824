"""``efa_ep.recipes.checks``: NeMo-RL test-suite-style checks: ``<recipe>.sh`` runs N steps,
then :mod:`.check_metrics` asserts thresholds on the run's metrics."""
