"""Recipe files load with NeMo-RL's loader semantics, resolve, and carry what NeMo-RL needs."""
import glob
import os

import pytest
from omegaconf import OmegaConf

from efa_ep.recipes.config_loader import (RECIPES_DIR, compose_conf, load_config, load_recipe,
                                          register_resolvers)
from efa_ep.recipes.grpo.config import TrainerConfig, trainer_config
from efa_ep.recipes.nemo_rl_ext import transport_env

PRODUCTION = sorted(glob.glob(str(RECIPES_DIR / "llm" / "*-efa.yaml")))
TWINS = sorted(glob.glob(str(RECIPES_DIR / "llm" / "*-alltoall.yaml")))
ALL = PRODUCTION + TWINS + [str(RECIPES_DIR / "grpo_tiny_moe_efa.yaml")]

# Sections and keys NeMo-RL's MasterConfig / Megatron policy path read unconditionally.
REQUIRED = {
    "grpo": ["num_prompts_per_step", "num_generations_per_prompt", "max_num_steps", "seed",
             "normalize_rewards", "use_leave_one_out_baseline", "val_period"],
    "loss_fn": ["reference_policy_kl_penalty", "ratio_clip_min", "ratio_clip_max", "token_level_loss"],
    "checkpointing": ["enabled", "checkpoint_dir"],
    "policy": ["model_name", "tokenizer", "train_global_batch_size", "train_micro_batch_size",
               "max_total_sequence_length", "precision", "generation", "dtensor_cfg", "megatron_cfg"],
    "data": [], "env": [], "logger": ["log_dir"], "cluster": ["gpus_per_node", "num_nodes"],
}
MEGATRON_REQUIRED = ["enabled", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size", "freeze_moe_router", "moe_router_dtype",
                     "moe_router_load_balancing_type", "moe_router_bias_update_rate",
                     "moe_enable_deepep", "moe_token_dispatcher_type", "moe_permute_fusion",
                     "optimizer", "scheduler", "env_vars"]


def test_recipe_set_is_complete():
    names = {os.path.basename(p) for p in PRODUCTION}
    assert {"grpo-qwen3-30ba3b-1n8g-megatron-ep8-efa.yaml", "grpo-qwen3-30ba3b-2n8g-megatron-ep16-efa.yaml",
            "grpo-moonlight-16ba3b-4n8g-megatron-ep32-efa.yaml"} <= names
    assert len(TWINS) == len(PRODUCTION)


@pytest.mark.parametrize("path", ALL, ids=os.path.basename)
def test_recipe_loads_resolves_and_has_nemo_rl_keys(path):
    cfg = load_recipe(path)
    for section, keys in REQUIRED.items():
        assert section in cfg, section
        for k in keys:
            assert k in cfg[section], f"{section}.{k}"
    m = cfg["policy"]["megatron_cfg"]
    for k in MEGATRON_REQUIRED:
        assert k in m, f"policy.megatron_cfg.{k}"
    assert m["enabled"] is True and cfg["policy"]["dtensor_cfg"]["enabled"] is False
    assert m["moe_enable_deepep"] is False and m["freeze_moe_router"] is True
    assert m["moe_token_dispatcher_type"] in ("efa", "alltoall")
    assert "efa_ep" in cfg
    world = cfg["cluster"]["gpus_per_node"] * cfg["cluster"]["num_nodes"]
    ep, tp = m["expert_model_parallel_size"], m["tensor_model_parallel_size"]
    if cfg["efa_ep"].get("trainer") != "builtin":  # built-in: EP ranks may share one GPU
        assert world % (tp * m["pipeline_model_parallel_size"]) == 0 and world % ep == 0
    samples = cfg["grpo"]["num_prompts_per_step"] * cfg["grpo"]["num_generations_per_prompt"]
    assert samples % cfg["policy"]["train_global_batch_size"] == 0


@pytest.mark.parametrize("path", PRODUCTION, ids=os.path.basename)
def test_production_recipe_sets_efa_env_and_has_check(path):
    cfg = load_recipe(path)
    m = cfg["policy"]["megatron_cfg"]
    assert m["moe_token_dispatcher_type"] == "efa"
    env = m["env_vars"]
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["EFA_EP_TRANSPORT"] == cfg["efa_ep"]["transport"]["transport"]
    assert cfg["cluster"]["gpus_per_node"] == 8
    text = open(path).read()
    assert "FI_EFA_USE_DEVICE_RDMA" in text and "/opt/amazon/ofi-nccl/lib" in text  # documented
    name = os.path.basename(path)[:-len(".yaml")]
    for variant in (name, name[:-len("-efa")] + "-alltoall"):
        check = RECIPES_DIR / "checks" / f"{variant}.sh"
        assert check.is_file() and os.access(check, os.X_OK), check
        body = check.read_text()
        assert "token_mult_prob_error" in body and "train/reward" in body and "total_step_time" in body


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("twin", TWINS + [None], ids=lambda p: os.path.basename(p) if p else "tiny")
def test_alltoall_twin_differs_by_one_key(twin, tmp_path):
    if twin is None:  # the tiny recipe's A/B is a one-key override
        a = load_recipe(RECIPES_DIR / "grpo_tiny_moe_efa.yaml")
        b = load_recipe(RECIPES_DIR / "grpo_tiny_moe_efa.yaml",
                        ["policy.megatron_cfg.moe_token_dispatcher_type=alltoall"])
    else:
        a = load_recipe(twin.replace("-alltoall.yaml", "-efa.yaml"))
        b = load_recipe(twin)
    fa, fb = _flatten(a), _flatten(b)
    diff = sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))
    assert diff == ["policy.megatron_cfg.moe_token_dispatcher_type"]
    assert fb[diff[0]] == "alltoall"


def test_overrides_follow_nemo_rl_struct_rules():
    path = RECIPES_DIR / "llm" / "grpo-qwen3-30ba3b-1n8g-megatron-ep8-efa.yaml"
    with pytest.raises(ValueError, match=r"\+policy.megatron_cfg.efa_foo"):
        load_recipe(path, ["policy.megatron_cfg.efa_foo=1"])
    cfg = load_recipe(path, ["+policy.megatron_cfg.efa_ep_transport=proxy",
                             "policy.megatron_cfg.moe_token_dispatcher_type=alltoall",
                             "cluster.num_nodes=2"])
    assert cfg["policy"]["megatron_cfg"]["moe_token_dispatcher_type"] == "alltoall"
    assert transport_env(cfg)["EFA_EP_TRANSPORT"] == "proxy"
    assert transport_env(load_recipe(path))["EFA_EP_TRANSPORT"] == "auto"


def test_defaults_chain_and_override_marker(tmp_path):
    (tmp_path / "parent.yaml").write_text("a: {x: 1, y: 2}\nb: ${mul:${a.x},3}\n")
    (tmp_path / "child.yaml").write_text("defaults: parent.yaml\na: {_override_: true, z: 5}\n")
    register_resolvers()
    cfg = load_config(tmp_path / "child.yaml")
    assert OmegaConf.to_container(cfg["a"]) == {"z": 5}
    (tmp_path / "c2.yaml").write_text("defaults: [parent.yaml]\na: {x: 4}\n")
    assert load_recipe(tmp_path / "c2.yaml")["b"] == 12


def test_tiny_recipe_and_hydra_conf_agree():
    recipe = trainer_config(load_recipe(RECIPES_DIR / "grpo_tiny_moe_efa.yaml"))
    composed = trainer_config(compose_conf())
    assert isinstance(recipe, TrainerConfig)
    assert recipe == composed
    gda = trainer_config(compose_conf(["transport=gda", "grpo.max_num_steps=3"]))
    assert gda.efa_ep.transport.transport == "gda" and gda.grpo.max_num_steps == 3


def test_trainer_config_validation():
    cfg = load_recipe(RECIPES_DIR / "grpo_tiny_moe_efa.yaml")
    cfg["efa_ep"]["bogus"] = 1
    with pytest.raises(ValueError, match=r"efa_ep: unknown key\(s\) \['bogus'\]"):
        trainer_config(cfg)
    cfg = load_recipe(RECIPES_DIR / "grpo_tiny_moe_efa.yaml", ["grpo.num_prompts_per_step=15"])
    with pytest.raises(ValueError, match="num_prompts_per_step=15"):
        trainer_config(cfg)
    cfg = load_recipe(RECIPES_DIR / "grpo_tiny_moe_efa.yaml", ["loss_fn.use_cispo=true"])
    with pytest.raises(ValueError, match="use_cispo"):
        trainer_config(cfg)
