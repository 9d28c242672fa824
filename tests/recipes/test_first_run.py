"""What a first run sees: the option schema, one-line errors with exit 2 before any rank starts,
a rank failure reported once, and Ctrl-C (exit 130 with the partial run's plot)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from efa_ep.kernels.options import ConfigError, validate_options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = [sys.executable, os.path.join(ROOT, "scripts", "run_grpo.py")]
# Seconds a refused launch may take: interpreter, torch and hydra imports, on a busy 2-core CI
# machine (a few seconds when idle); the point is that no rank and no model is started.
FAST_S = 60


# ----------------------------------------------------------------------------- schema
def test_schema_unknown_key_did_you_mean_and_values_named():
    with pytest.raises(ConfigError, match=r"EFA_EP_TRANSPORT_OPTIONS: unknown option 'num_chanels' "
                                          r"for transport 'proxy'; did you mean 'num_channels'\?"):
        validate_options("proxy", {"num_chanels": "4"}, "EFA_EP_TRANSPORT_OPTIONS")
    with pytest.raises(ConfigError, match=r"X: num_channels='abc' is not an integer"):
        validate_options("proxy", {"num_channels": "abc"}, "X")
    with pytest.raises(ConfigError, match=r"num_channels=0 must be in \[1, 64\]"):
        validate_options("proxy", {"num_channels": 0}, "X")
    with pytest.raises(ConfigError, match=r"hmem='gpu' is not one of auto, off, cuda"):
        validate_options("proxy", {"hmem": "gpu"}, "X")
    with pytest.raises(ConfigError, match=r"transport 'torch' takes no options"):
        validate_options("torch", {"num_channels": 2}, "X")
    assert validate_options("proxy", {"num_channels": "4", "timeout_s": 5, "provider": "tcp"}, "X") == \
        {"num_channels": 4, "timeout_s": 5.0, "provider": "tcp"}
    assert validate_options("gda", {"check_every_call": 1, "launch_gate": "on"}, "X") == \
        {"check_every_call": 1, "launch_gate": "on"}


def test_schema_guards_configure_config_attributes_and_environment(monkeypatch):
    from efa_ep.dispatcher import settings

    for var in ("EFA_EP_TRANSPORT", "EFA_EP_TRANSPORT_OPTIONS", "EFA_EP_MAX_TOKENS_PER_RANK"):
        monkeypatch.delenv(var, raising=False)
    settings.reset()
    try:
        with pytest.raises(ConfigError, match=r"configure\(\*\*transport_options\): unknown option "
                                              r"'num_chanels'.*did you mean 'num_channels'"):
            settings.configure(transport="proxy", num_chanels=4)
        with pytest.raises(ConfigError, match=r"configure\(transport=...\)='proxi'.*did you mean 'proxy'"):
            settings.configure(transport="proxi")

        class Cfg:
            efa_ep_transport = "proxy"
            efa_ep_transport_options = "num_channels=x"

        with pytest.raises(ConfigError, match=r"config.efa_ep_transport_options: num_channels='x'"):
            settings.current_settings(Cfg())
        monkeypatch.setenv("EFA_EP_MAX_TOKENS_PER_RANK", "16k")
        with pytest.raises(ConfigError, match=r"EFA_EP_MAX_TOKENS_PER_RANK='16k' is not an integer"):
            settings.current_settings()
        monkeypatch.delenv("EFA_EP_MAX_TOKENS_PER_RANK")
        # auto -> torch would drop options silently: refused, naming what to do
        monkeypatch.setenv("EFA_EP_TRANSPORT_OPTIONS", "timeout_s=5")
        if not torch.cuda.is_available():
            with pytest.raises(ConfigError, match=r"'auto' resolved to 'torch'.*takes no options"):
                settings.check_environment()
    finally:
        settings.reset()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-machine hint")
def test_gda_on_a_cpu_machine_suggests_torch():
    from efa_ep.dispatcher.settings import check_environment

    with pytest.raises(ConfigError, match="cannot run on this machine") as e:
        check_environment({"EFA_EP_TRANSPORT": "gda"})
    assert "EFA_EP_TRANSPORT=torch" in e.value.hint and "auto" in e.value.hint


# ----------------------------------------------------------------------------- launcher
def _launch(args, env_extra=None, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFA_EP_")}
    env["PYTHONPATH"] = ROOT
    env.update(env_extra or {})
    return subprocess.run(LAUNCHER + args, capture_output=True, text=True, env=env, **kw)


@pytest.mark.parametrize("args, env, expect", [
    (["grpo.max_num_stepz=3"], {}, "did you mean 'grpo.max_num_steps'"),
    ([], {"EFA_EP_TRANSPORT": "proxy", "EFA_EP_TRANSPORT_OPTIONS": "num_chanels=4"},
     "EFA_EP_TRANSPORT_OPTIONS: unknown option 'num_chanels' for transport 'proxy'; did you mean"),
    (["efa_ep.transport.transport=torch", "efa_ep.transport.max_tokens_per_rank=-5"], {},
     "efa_ep.transport.max_tokens_per_rank=-5 must be in"),
])
def test_bad_setting_exits_2_with_one_line_before_ranks_start(args, env, expect, tmp_path):
    t0 = time.time()
    out = _launch(["--config", "grpo_tiny_moe_efa.yaml", f"logger.log_dir={tmp_path}"] + args, env,
                  timeout=FAST_S * 3)
    took = time.time() - t0
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert errors[0].startswith("efa-ep-grpo: error: ") and expect in errors[0], out.stderr
    assert len(errors) == 2 and errors[1].startswith("  hint: "), out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert "policy: tiny Megatron" not in out.stdout  # no rank got as far as building a model
    assert took < FAST_S, took


def _fails_on_rank_1(rank, world, flag):
    if rank == 1:
        open(flag, "w").close()
        raise ValueError("boom on rank 1\nsecond line")
    # rank 0 fails after rank 1, as the peer of a dead rank does
    deadline = time.time() + 120
    while not os.path.exists(flag) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(2)
    raise RuntimeError("peer 1 is gone")


def test_rank_failure_reported_once_with_log_file(tmp_path, capsys):
    from efa_ep.distributed import RankFailure, run_ranks
    from efa_ep.recipes.config_loader import load_recipe
    from efa_ep.recipes.grpo.config import trainer_config
    from efa_ep.recipes.launcher import ERROR_LOG_NAME, _rank_failed

    with pytest.raises(RankFailure) as e:
        run_ranks(_fails_on_rank_1, 2, (str(tmp_path / "flag"),), backend=None, timeout_s=240)
    assert e.value.failures[0][0] == 1
    rc = _rank_failed(e.value, trainer_config(load_recipe("grpo_tiny_moe_efa.yaml",
                                                          [f"logger.log_dir={tmp_path}"])))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 1 and len(err) == 2, err
    assert err[0].startswith("efa-ep-grpo: error: rank 1 failed: ValueError: boom on rank 1 "
                             "(1 other rank(s) failed after it)"), err
    assert str(tmp_path / ERROR_LOG_NAME) in err[1]
    log = (tmp_path / ERROR_LOG_NAME).read_text()
    assert "Traceback" in log and "--- rank 1 ---" in log and "--- rank 0 ---" in log


def test_ctrl_c_writes_partial_plot_and_exits_130(tmp_path):
    log_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFA_EP_")}
    env["PYTHONPATH"] = ROOT
    cmd = LAUNCHER + ["--config", "grpo_tiny_moe_efa.yaml", "grpo.max_num_steps=500",
                      "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
                      "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
                      "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4",
                      "efa_ep.warmup.sft_steps=0", "efa_ep.model.num_layers=1",
                      "efa_ep.model.hidden_size=32", "efa_ep.transport.transport=torch",
                      "logger.tensorboard_enabled=false", f"logger.log_dir={log_dir}"]
    # Its own session, so the signal reaches the launcher and its ranks as a terminal's Ctrl-C does.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    jsonl = log_dir / "metrics.jsonl"

    def steps_logged():
        return sum("train/reward" in ln for ln in jsonl.read_text().splitlines()) if jsonl.exists() else 0

    # Start-up is ~15 s on an idle 2-core machine and minutes on a shared one: wait for two GRPO
    # steps, but interrupt anyway at the deadline (then the run stops before its first step).
    deadline = time.time() + 420
    try:
        while time.time() < deadline and proc.poll() is None and steps_logged() < 2:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert len(lines) == 1, err
    if "interrupted at step " in lines[0]:
        step = int(lines[0].split("interrupted at step ")[1].split()[0])
        rows = [json.loads(ln) for ln in jsonl.read_text().splitlines()]
        assert step == max(r["step"] for r in rows) >= 1
        assert (log_dir / "grpo_curves.png").stat().st_size > 1000
    else:
        assert "interrupted before the first GRPO step" in lines[0], err
