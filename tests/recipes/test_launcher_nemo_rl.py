"""The launcher's NeMo-RL path, against fakes of NeMo-RL's hook points (``fake_nemo_rl/``).

NeMo-RL itself cannot run here (PyPI ``nemo-rl`` is a placeholder; the real package needs Ray,
vLLM and GPUs), so these tests check our side of the contract: the recipe is loaded with NeMo-RL's
semantics, ``grpo.setup`` gets a ``policy_factory`` that passes our ``worker_extension_cls_fqn``,
the class is registered with the Megatron venv, and - in a fresh interpreter that sees only the
``PYTHONPATH``/``EFA_EP_*`` the launcher put into ``policy.megatron_cfg.env_vars`` - the
extension imports, installs the ``efa`` dispatcher before the (fake) worker builds its Megatron
MoE layer, and the transport knob set by ``+policy.megatron_cfg.efa_ep_transport`` arrives.
"""
import functools
import os
import sys

import pytest

FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_nemo_rl")


@pytest.fixture
def fake_nemo_rl(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(FAKE)
    for name in list(sys.modules):
        if name == "ray" or name.startswith(("nemo_rl", "efa_ep.recipes.nemo_rl_worker")):
            monkeypatch.delitem(sys.modules, name)
    for k in list(os.environ):
        if k.startswith("EFA_EP_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    import nemo_rl

    nemo_rl.CALLS.clear()
    yield nemo_rl
    for name in list(sys.modules):
        if name == "ray" or name.startswith("nemo_rl"):
            sys.modules.pop(name, None)


def test_choose_trainer(fake_nemo_rl):
    from efa_ep.recipes.launcher import choose_trainer

    assert choose_trainer({"efa_ep": {"trainer": "auto"}})[0] == "nemo_rl"
    assert choose_trainer({})[0] == "nemo_rl"
    assert choose_trainer({"efa_ep": {"trainer": "builtin"}})[0] == "builtin"


def test_choose_trainer_without_nemo_rl(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_rl", None)  # import fails, as here without fakes
    from efa_ep.recipes.launcher import choose_trainer

    trainer, why = choose_trainer({"efa_ep": {"trainer": "auto"}})
    assert trainer == "builtin" and "not importable" in why
    with pytest.raises(RuntimeError, match="efa_ep.trainer=nemo_rl"):
        choose_trainer({"efa_ep": {"trainer": "nemo_rl"}})


def test_launcher_runs_nemo_rl_grpo_with_worker_extension(fake_nemo_rl, capsys):
    from efa_ep.recipes import launcher
    from efa_ep.recipes.nemo_rl_ext import WORKER_EXTENSION_FQN

    rc = launcher.main(["--config", "grpo-qwen3-30ba3b-1n8g-megatron-ep8-efa.yaml",
                        "grpo.max_num_steps=2", "+policy.megatron_cfg.efa_ep_transport=proxy",
                        "+policy.megatron_cfg.efa_ep_transport_options='num_channels=2'"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[efa-ep grpo] Ctrl-C stops the run")  # armed before anything else
    assert "NeMo-RL GRPO" in lines[1] and "worker extension" in lines[1]

    calls = {c[0]: c for c in fake_nemo_rl.CALLS}
    assert set(calls) >= {"init_ray", "setup", "Policy", "grpo_train", "shutdown_environments"}
    from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES

    assert ACTOR_ENVIRONMENT_REGISTRY[WORKER_EXTENSION_FQN] == PY_EXECUTABLES.MCORE
    _, master, factory = calls["setup"]
    assert isinstance(factory, functools.partial)
    assert factory.keywords == {"worker_extension_cls_fqn": WORKER_EXTENSION_FQN}
    assert "efa_ep" not in master.raw                       # our section never reaches NeMo-RL
    assert master.grpo.max_num_steps == 2
    assert master.logger["log_dir"].endswith("exp_001")
    mcfg = master.policy["megatron_cfg"]
    assert mcfg["moe_token_dispatcher_type"] == "efa"
    env_vars = mcfg["env_vars"]
    assert env_vars["EFA_EP_TRANSPORT"] == "proxy"          # + key wins over the recipe's auto
    assert env_vars["EFA_EP_TRANSPORT_OPTIONS"] == "num_channels=2"
    assert env_vars["FI_PROVIDER"] == "efa"
    assert env_vars["PYTHONPATH"].split(os.pathsep)[0].endswith(f"efa_ep_worker_path_{os.getuid()}")
    assert os.environ["EFA_EP_TRANSPORT"] == "proxy"         # driver env, forwarded by init_ray

    report = calls["Policy"][1]["report"]
    assert calls["Policy"][1]["worker_extension_cls_fqn"] == WORKER_EXTENSION_FQN
    assert report["hook_ready_before_build"] is True
    assert report["dispatcher_class"] == "EfaTokenDispatcher"
    assert report["transport_setting"] == "proxy"
    assert report["extension"]["num_efa_dispatcher_layers"] == 1
    assert report["extension"]["transport_options"] == {"num_channels": 2}
    assert report["remote_options"] == {"runtime_env": {"fake_runtime_env_for": "megatron_policy_worker"}}
    # The worker imported efa_ep through the one-package shim, not the checkout root.
    assert "efa_ep_worker_path" not in report["efa_ep_file"]
    assert report["efa_ep_file"].endswith(os.path.join("efa_ep", "__init__.py"))


def test_alltoall_twin_keeps_megatron_dispatcher(fake_nemo_rl):
    from efa_ep.recipes import launcher

    assert launcher.main(["--config", "grpo-qwen3-30ba3b-1n8g-megatron-ep8-alltoall.yaml"]) == 0
    report = [c for c in fake_nemo_rl.CALLS if c[0] == "Policy"][0][1]["report"]
    assert report["dispatcher_class"] == "MoEAlltoAllTokenDispatcher"


def test_check_recipe_rejects_dtensor_and_deepep():
    from efa_ep.recipes.nemo_rl_ext import check_recipe

    with pytest.raises(ValueError, match="megatron_cfg.enabled=true"):
        check_recipe({"policy": {"megatron_cfg": {"enabled": False}}})
    with pytest.raises(ValueError, match="moe_enable_deepep=false"):
        check_recipe({"policy": {"megatron_cfg": {"enabled": True, "moe_token_dispatcher_type": "efa",
                                                  "moe_enable_deepep": True}}})
