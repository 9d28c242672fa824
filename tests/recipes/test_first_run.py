"""What a first run sees: the option schema, one-line errors with exit 2 before any rank starts
(every recipe key's type included), a rank failure reported once, and Ctrl-C at any moment
(exit 130, one ``interrupted`` line, the partial run's plot)."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
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
    # a rank would have failed on it after the warm-start, minutes in
    (["grpo.max_num_steps=ten"], {}, "grpo.max_num_steps='ten': expected int, got a string"),
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


@pytest.mark.parametrize("override, expect", [
    ("grpo.max_num_steps=ten", "grpo.max_num_steps='ten': expected int, got a string"),
    ("policy.megatron_cfg.optimizer.lr=fast",
     "policy.megatron_cfg.optimizer.lr='fast': expected float, got a string"),
    ("loss_fn.ratio_clip_min=wide", "loss_fn.ratio_clip_min='wide': expected float, got a string"),
    ("grpo.val_at_start=maybe", "grpo.val_at_start='maybe': expected bool (true or false), got a string"),
    ("grpo.normalize_rewards=1", "grpo.normalize_rewards=1: expected bool (true or false), got an int"),
    ("grpo.max_num_steps=2.5", "grpo.max_num_steps=2.5: expected int, got a float"),
    ("efa_ep.transport.max_tokens_per_rank=lots",
     "efa_ep.transport.max_tokens_per_rank='lots': expected int or null, got a string"),
    ("+efa_ep.warmup.sft_stepz=3", "efa_ep.warmup: unknown key(s) ['sft_stepz']; did you mean 'sft_steps'?"),
    ("efa_ep.warmup.sft_stepz=3", "did you mean 'efa_ep.warmup.sft_steps'?"),
    # a key added to a NeMo-RL section that the built-in trainer would never read
    ("+grpo.max_num_stepz=3", "override +grpo.max_num_stepz=3: the built-in trainer reads no key "
                              "'grpo.max_num_stepz'; did you mean 'grpo.max_num_steps'?"),
    ("+policy.megatron_cfg.efa_ep_transport=torch", "the built-in trainer does not read "
                                                    "policy.megatron_cfg.efa_ep_transport"),
])
def test_every_key_type_checked_before_ranks_start(override, expect, tmp_path, capsys):
    from efa_ep.recipes.launcher import main

    rc = main(["--config", "grpo_tiny_moe_efa.yaml", f"logger.log_dir={tmp_path}", override])
    out, err = capsys.readouterr()
    errors = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, out + err
    assert len(errors) == 2 and errors[0].startswith("efa-ep-grpo: error: ") and expect in errors[0], err
    assert errors[1].startswith("  hint: "), err
    assert "run directory" not in out and not os.listdir(tmp_path)  # no rank, no run directory


def test_type_hint_names_type_and_default(capsys):
    from efa_ep.recipes.launcher import main

    assert main(["--config", "grpo_tiny_moe_efa.yaml", "efa_ep.warmup.sft_steps=many"]) == 2
    assert "hint: efa_ep.warmup.sft_steps takes int (default: 0)" in capsys.readouterr().err
    # an int where a float is declared is a float; the recipe's own values all pass
    from efa_ep.recipes.config_loader import RECIPES_DIR, load_recipe
    from efa_ep.recipes.grpo.config import check_recipe_types, trainer_config

    cfg = trainer_config(load_recipe("grpo_tiny_moe_efa.yaml", ["policy.megatron_cfg.optimizer.lr=1"]))
    assert cfg.policy.megatron_cfg.optimizer.lr == 1.0 and isinstance(cfg.efa_ep.timeout_s, float)
    for path in sorted(RECIPES_DIR.rglob("*.yaml")):
        if "nemo_rl_base" not in path.parts:
            check_recipe_types(load_recipe(path))


# ----------------------------------------------------------------------------- Ctrl-C
# The recipe shrunk to seconds per step (1 layer, 16 samples per step, no validation).
_TINY = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.val_period=0",
         "grpo.val_at_start=false", "grpo.val_at_end=false", "policy.train_global_batch_size=8",
         "policy.train_micro_batch_size=4", "efa_ep.model.num_layers=1",
         "efa_ep.model.hidden_size=32", "logger.tensorboard_enabled=false"]
_RUN_DIR = "[efa-ep grpo] run directory: "


def _steps_logged(run_dir):
    jsonl = os.path.join(run_dir, "metrics.jsonl") if run_dir else ""
    if not os.path.exists(jsonl):
        return 0
    return sum('"train/reward"' in ln for ln in open(jsonl))


# moment -> (overrides, is_now(line, run_dir)): the event after which SIGINT is sent.
_MOMENTS = {
    # the launcher has only just armed its handler: recipe not yet loaded, no rank
    "armed": (["grpo.max_num_steps=500", "efa_ep.warmup.sft_steps=0"],
              lambda line, run_dir: "Ctrl-C" in line),
    # settings checked, run directory made: the ranks are being started
    "ranks-starting": (["grpo.max_num_steps=500", "efa_ep.warmup.sft_steps=0"],
                       lambda line, run_dir: line.startswith(_RUN_DIR)),
    # rank 0's first status line: the model is built, the (endless) warm-start begins
    "warm-start": (["grpo.max_num_steps=500", "efa_ep.warmup.sft_steps=100000"],
                   lambda line, run_dir: "policy: tiny Megatron" in line),
    # GRPO steps logged
    "grpo": (["grpo.max_num_steps=500", "efa_ep.warmup.sft_steps=0"],
             lambda line, run_dir: _steps_logged(run_dir) >= 2),
    # the last step's status line: rank 0 plots, the launcher reports
    "shutdown": (["grpo.max_num_steps=2", "efa_ep.warmup.sft_steps=0"],
                 lambda line, run_dir: "GRPO 2/2" in line),
}


@pytest.mark.parametrize("moment, inherited_ignore", [
    ("armed", False), ("ranks-starting", True), ("warm-start", True), ("grpo", True),
    ("shutdown", False)])
def test_ctrl_c_at_any_moment_exits_130_with_one_line(moment, inherited_ignore, tmp_path):
    """SIGINT to the run's whole process group, as a terminal's Ctrl-C, sent when the moment's
    event shows on stdout (never after a fixed sleep). ``inherited_ignore``: started with SIGINT
    ignored, as a script's background job is: the launcher must take the signal over, not let
    the run go on. Transport ``auto``, the recipe's: the ranks load libfabric, whose SIGINT
    handler ends a process with status 1 (a "rank failed" report) unless the ranks block it."""
    overrides, is_now = _MOMENTS[moment]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFA_EP_")}
    env["PYTHONPATH"] = ROOT
    cmd = (LAUNCHER + ["--config", "grpo_tiny_moe_efa.yaml"] + _TINY + overrides
           + [f"logger.log_dir={tmp_path}"])
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherited_ignore else None
    # Its own session, so the signal reaches the launcher and its ranks as a terminal's Ctrl-C does.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=preexec)
    lines, out, err = queue.Queue(), [], []

    def read(stream, keep, q=None):
        for ln in stream:
            keep.append(ln)
            if q is not None:
                q.put(ln)
        if q is not None:
            q.put(None)

    threads = [threading.Thread(target=read, args=(proc.stdout, out, lines), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, err), daemon=True)]
    for t in threads:
        t.start()
    run_dir, sent, deadline = None, False, time.time() + 420
    try:
        while time.time() < deadline:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:
                break  # stdout closed: the run ended without the event
            if line.startswith(_RUN_DIR):
                run_dir = line[len(_RUN_DIR):].split()[0].rstrip(":")
            if is_now(line, run_dir):
                os.killpg(proc.pid, signal.SIGINT)
                sent = True
                break
        assert sent, "".join(out + err)
        proc.wait(timeout=120)
        for t in threads:
            t.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out, err = "".join(out), "".join(err)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "failed" not in err, err
    interrupted = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert len(interrupted) == 1, err
    line = interrupted[0]
    # No rank outlives the launcher (multiprocessing's resource tracker may take a moment).
    for _ in range(50):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"processes of the run's group still alive after it exited: {line}")
    if moment == "armed":
        assert "before the run started" in line, line
        assert not os.listdir(tmp_path)
        return
    assert f"run directory: {run_dir}" in line, line
    if moment in ("ranks-starting", "warm-start"):
        assert "interrupted before the first GRPO step (of 500)" in line, line
        return
    from efa_ep.recipes.grpo.metrics import read_jsonl  # skips a line cut short by the stop

    step = int(line.split("interrupted at step ")[1].split()[0])
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert step == max(r["step"] for r in rows if "train/reward" in r) >= (2 if moment == "grpo" else 1)
    assert os.path.getsize(os.path.join(run_dir, "grpo_curves.png")) > 1000
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["status"] == "interrupted"
