"""NeMo-RL Megatron policy-worker extension that installs the ``efa`` dispatcher.

Imported by NeMo-RL inside each policy worker (by its fully qualified name,
:data:`efa_ep.recipes.nemo_rl_ext.WORKER_EXTENSION_FQN`), never by the built-in trainer: it
imports ``ray`` and ``nemo_rl`` at module level, as NeMo-RL's own worker classes do.
"""
from typing import Any, Dict

import ray
from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

from .nemo_rl_ext import install_dispatcher_in_worker


# Classes decorated with @ray.remote can't be subclassed: extend the Impl, as NeMo-RL's own
# MegatronPolicyWorker does (research/template_project/template_project/worker_extension.py).
@ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))  # pragma: no cover
class EfaMegatronPolicyWorker(MegatronPolicyWorkerImpl):
    """``MegatronPolicyWorkerImpl`` with the efa dispatcher registered before the model is built."""

    def __init__(self, config, *args, **kwargs):
        # Must run before super().__init__(): setup_model_and_optimizer builds the MoE layers there.
        self.efa_ep_settings = install_dispatcher_in_worker(config)
        print(f"[efa-ep worker] dispatcher settings: {self.efa_ep_settings}", flush=True)
        super().__init__(config, *args, **kwargs)

    def efa_ep_report(self) -> Dict[str, Any]:
        """Settings plus how many MoE layers of this worker's model run an EfaTokenDispatcher."""
        from efa_ep.dispatcher.token_dispatcher import EfaTokenDispatcher

        models = getattr(self, "model", None)
        models = models if isinstance(models, (list, tuple)) else [models]
        n = sum(isinstance(getattr(m, "token_dispatcher", None), EfaTokenDispatcher)
                for model in models if model is not None for m in model.modules())
        return {**self.efa_ep_settings, "num_efa_dispatcher_layers": n}
