"""FAKE nemo_rl.algorithms.grpo: MasterConfig, setup(policy_factory=...), grpo_train."""
from types import SimpleNamespace

import nemo_rl


class MasterConfig:
    def __init__(self, **cfg):
        self.raw = cfg
        for k, v in cfg.items():
            setattr(self, k, v)
        async_cfg = (cfg.get("grpo") or {}).get("async_grpo") or {}
        self.grpo = SimpleNamespace(async_grpo=SimpleNamespace(
            enabled=bool(async_cfg.get("enabled", False)),
            max_trajectory_age_steps=async_cfg.get("max_trajectory_age_steps", 1)), **{
            k: v for k, v in (cfg.get("grpo") or {}).items() if k != "async_grpo"})


def setup(master_config, tokenizer, dataset, val_dataset, processor=None, policy_factory=None):
    nemo_rl.CALLS.append(("setup", master_config, policy_factory))
    policy = policy_factory(cluster="fake-cluster", config=master_config.policy, tokenizer=tokenizer,
                            processor=processor, weights_path=None, optimizer_path=None,
                            init_optimizer=True, init_reference_model=True)
    return (policy, None, None, ("c", "c"), "dl", None, "loss_fn", "logger", "ckpt", {},
            master_config, None, None)


def grpo_train(*args):
    nemo_rl.CALLS.append(("grpo_train", args))


def async_grpo_train(**kwargs):
    nemo_rl.CALLS.append(("async_grpo_train", kwargs))


def shutdown_environments(*args):
    nemo_rl.CALLS.append(("shutdown_environments", args))
