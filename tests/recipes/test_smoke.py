"""A few steps of the built-in trainer through the launcher: EP 2 over gloo, efa dispatcher; the
run's own directory and the verdict line."""
import json
import os
import subprocess
import sys

from efa_ep.recipes.checks.check_metrics import check, load_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_builtin_trainer_smoke_through_launcher(tmp_path):
    log_dir = tmp_path / "run"
    summary = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFA_EP_")}
    env["PYTHONPATH"] = ROOT
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "run_grpo.py"),
           "--config", "grpo_tiny_moe_efa.yaml", "--summary-json", str(summary),
           "grpo.max_num_steps=3", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
           "grpo.val_period=2", "grpo.max_val_samples=16", "policy.train_global_batch_size=8",
           "policy.train_micro_batch_size=2", "policy.logprob_batch_size=4",
           "efa_ep.warmup.sft_steps=2", "efa_ep.model.num_layers=1", "efa_ep.model.hidden_size=32",
           "efa_ep.transport.transport=torch", "logger.progress_bar=false", f"logger.log_dir={log_dir}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=str(tmp_path), env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("[efa-ep grpo] Ctrl-C stops the run")
    assert lines[1].startswith("[efa-ep grpo] trainer: built-in GRPO trainer") and "not NeMo-RL" in lines[1]
    assert "moe_token_dispatcher_type='efa', EP=2" in out.stdout and "transport=torch" in out.stdout
    # the run's own directory, named at the start and in the last lines; latest links to it
    run_dir = log_dir / os.readlink(log_dir / "latest")
    assert sorted(p.name for p in log_dir.iterdir()) == sorted([run_dir.name, "latest"])
    assert f"[efa-ep grpo] run directory: {run_dir} ({log_dir / 'latest'} points to it)" in lines
    assert lines[-2].startswith(f"[efa-ep grpo] run directory: {run_dir}: metrics.jsonl, grpo_curves.png")
    # the verdict: what was checked, the transport auto or the recipe chose, the reward as information
    assert lines[-1].startswith("[efa-ep grpo] verdict: PASS - the efa dispatcher moved the tokens of "
                                "every MoE layer (1 layer(s) x 2 ranks) over transport torch; all 3 "
                                "GRPO steps ran; loss, KL, grad norm and reward finite"), lines[-1]
    assert "not a pass criterion" in lines[-1]
    log_dir = run_dir

    rows = [json.loads(l) for l in open(log_dir / "metrics.jsonl")]
    steps = [r for r in rows if "train/reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        for k in ("train/loss", "train/kl_penalty", "train/clip_fraction", "train/token_mult_prob_error",
                  "timing/train/total_step_time", "performance/tokens_per_sec"):
            assert k in r, k
        assert 0.0 <= r["train/reward"] <= 1.0
        # the sampler and the trainer's recomputed logprobs come from the same weights
        assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3
    assert any("validation/accuracy" in r for r in rows)
    assert (log_dir / "grpo_curves.png").stat().st_size > 1000
    assert list((log_dir / "tensorboard").glob("events.out.tfevents.*"))
    s = json.load(open(summary))
    assert s["steps"] == 3 and s["world_size"] == 2 and s["backend"] == "gloo"
    assert s["status"] == "pass" and s["verdict"] in lines[-1] and s["run_dir"] == str(run_dir)
    assert [d["dispatches"][0] > 0 and d["transports"] == ["torch"] for d in s["dispatch"]] == [True, True]
    assert json.load(open(run_dir / "summary.json")) == s

    # the NeMo-RL-style check reads these metrics, from JSONL and from TensorBoard events
    data = load_metrics(str(log_dir))
    assert check(data, ['max(data["train/token_mult_prob_error"]) < 1.05',
                        'min(data["train/probs_ratio_clamped_min"]) > 0.79',
                        'mean(data["timing/train/total_step_time"], -2) < 60'])
    tb = load_metrics(str(log_dir / "tensorboard"))
    assert set(tb["train/reward"]) == {"1", "2", "3"}
    assert not check(data, ['data["train/missing"]["1"] > 0'])
