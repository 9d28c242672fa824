"""Every run writes into its own directory ``<logger.log_dir>/<UTC start time>/`` (``latest`` links to
the newest): runs never overwrite each other, a failed run leaves earlier runs' files alone, a
refused one makes no directory. And the verdict that ends a finished run."""
import datetime
import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

from efa_ep.recipes.grpo.metrics import new_run_dir, point_latest
from efa_ep.recipes.grpo.verdict import verdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = [sys.executable, os.path.join(ROOT, "scripts", "run_grpo.py")]
# One GRPO step of the recipe shrunk to a 1-layer model: seconds after start-up.
_SHORT = ["grpo.max_num_steps=1", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
          "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
          "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4",
          "efa_ep.warmup.sft_steps=1", "efa_ep.model.num_layers=1", "efa_ep.model.hidden_size=32",
          "logger.tensorboard_enabled=false", "logger.progress_bar=false"]


def test_run_dir_unique_within_one_second_and_latest_follows(tmp_path):
    now = datetime.datetime(2026, 12, 1, 10, 15, 30, tzinfo=datetime.timezone.utc)
    dirs = [new_run_dir(str(tmp_path / "runs"), now) for _ in range(3)]
    assert [os.path.basename(d) for d in dirs] == ["20261201T101530Z", "20261201T101530Z-2",
                                                   "20261201T101530Z-3"]
    for d in dirs:
        link = point_latest(d)
        assert link == str(tmp_path / "runs" / "latest")
        assert os.readlink(link) == os.path.basename(d)  # relative: the tree can be moved
        assert os.path.samefile(link, d)
    assert sorted(os.listdir(tmp_path / "runs")) == sorted([os.path.basename(d) for d in dirs] + ["latest"])


def _launch(log_dir, extra=(), summary=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFA_EP_")}
    env["PYTHONPATH"] = ROOT
    cmd = (LAUNCHER + ["--config", "grpo_tiny_moe_efa.yaml"] + _SHORT + list(extra)
           + [f"logger.log_dir={log_dir}"])
    if summary:
        cmd += ["--summary-json", str(summary)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc):
    out, err = proc.communicate(timeout=400)
    return proc.returncode, out, err


def _snapshot(path):
    """Every file under ``path``: its size, mtime and content hash."""
    snap = {}
    for root, _, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                snap[p] = (os.path.getsize(p), os.stat(p).st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return snap


def test_runs_keep_their_own_directories_and_a_failed_run_touches_none(tmp_path):
    base = tmp_path / "runs"
    # Two runs at once (likely within one second), each with its summary file.
    procs = [_launch(base, summary=tmp_path / f"summary{i}.json") for i in range(2)]
    done = [_finish(p) for p in procs]
    run_dirs = []
    for i, (rc, out, err) in enumerate(done):
        assert rc == 0, out[-3000:] + err[-3000:]
        summary = json.load(open(tmp_path / f"summary{i}.json"))
        run_dir = summary["run_dir"]
        assert os.path.dirname(run_dir) == str(base) and summary["status"] == "pass"
        lines = out.splitlines()
        assert lines[-2].startswith(f"[efa-ep grpo] run directory: {run_dir}: metrics.jsonl")
        assert lines[-1].startswith("[efa-ep grpo] verdict: PASS - ")
        assert json.load(open(os.path.join(run_dir, "summary.json")))["run_dir"] == run_dir
        run_dirs.append(run_dir)
    assert run_dirs[0] != run_dirs[1]
    assert sorted(os.listdir(base)) == sorted([os.path.basename(d) for d in run_dirs] + ["latest"])
    assert os.readlink(base / "latest") in [os.path.basename(d) for d in run_dirs]
    before = _snapshot(base)

    # A run whose ranks fail (top-5 routing over 4 experts): its own directory, with the log.
    rc, out, err = _finish(_launch(base, ["efa_ep.model.moe_router_topk=5"]))
    assert rc == 1, out[-3000:] + err[-3000:]
    failed = os.path.join(base, os.readlink(base / "latest"))
    assert failed not in run_dirs and os.path.dirname(failed) == str(base)
    assert f"full tracebacks of every rank: {failed}/rank_errors.log" in err
    assert os.path.exists(os.path.join(failed, "rank_errors.log"))
    assert json.load(open(os.path.join(failed, "summary.json")))["status"] == "rank_failed"
    after = _snapshot(base)
    assert {p: v for p, v in after.items() if not p.startswith(failed + os.sep)} == before

    # A refused run (a setting is wrong): exit 2, no directory, latest unchanged.
    rc, out, err = _finish(_launch(base, ["grpo.max_num_steps=ten"]))
    assert rc == 2 and "grpo.max_num_steps='ten'" in err, err
    assert len(os.listdir(base)) == 4 and os.path.join(base, os.readlink(base / "latest")) == failed
    assert _snapshot(base) == after


def _cfg(world=2, layers=2, steps=600, dispatcher="efa"):
    return SimpleNamespace(
        policy=SimpleNamespace(megatron_cfg=SimpleNamespace(moe_token_dispatcher_type=dispatcher)),
        efa_ep=SimpleNamespace(model=SimpleNamespace(num_layers=layers)),
        grpo=SimpleNamespace(max_num_steps=steps), world_size=world)


def _summary(**kw):
    rank = {"class": "EfaTokenDispatcher", "layers": 2, "dispatches": [1206, 1206], "transports": ["torch"]}
    s = {"steps": 600, "dispatch": [dict(rank), dict(rank)], "nonfinite": None,
         "warmup_nonfinite_step": None, "token_mult_prob_error_max": 1.0000003,
         "reward_start": 0.092, "reward_end": 0.216, "reward_window": 10}
    s.update(kw)
    return s


def test_verdict_pass_says_what_was_checked_and_reward_is_information():
    ok, text = verdict(_summary(), _cfg())
    assert ok and text == (
        "PASS - the efa dispatcher moved the tokens of every MoE layer (2 layer(s) x 2 ranks) over "
        "transport torch; all 600 GRPO steps ran; loss, KL, grad norm and reward finite at every "
        "step; sampler and trainer logprobs agree (token_mult_prob_error max 1.0000 <= 1.05); "
        "reward 0.092 -> 0.216 (first/last 10 steps; not a pass criterion: it varies with seed and "
        "machine)")
    # a reward that does not rise (seed 43 on one machine: 0.048 -> 0.049) still passes
    assert verdict(_summary(reward_start=0.048, reward_end=0.047), _cfg())[0]
    alltoall = dict(_summary()["dispatch"][0], **{"class": "MoEAlltoAllTokenDispatcher", "transports": []})
    ok, text = verdict(_summary(dispatch=[alltoall, alltoall]), _cfg(dispatcher="alltoall"))
    assert ok and "Megatron's alltoall dispatcher (the A/B twin, not efa) moved" in text


def test_verdict_fail_names_every_problem():
    idle = {"class": "EfaTokenDispatcher", "layers": 2, "dispatches": [5, 0], "transports": ["torch"]}
    other = {"class": "MoEAlltoAllTokenDispatcher", "layers": 2, "dispatches": [5, 5], "transports": []}
    ok, text = verdict(_summary(dispatch=[idle, other], steps=599,
                                nonfinite={"step": 17, "key": "train/loss", "value": "nan"},
                                warmup_nonfinite_step=3, token_mult_prob_error_max=1.2), _cfg())
    assert not ok and text == (
        "FAIL - rank 0's MoE layer(s) [1] never dispatched; rank 1's MoE layers built "
        "MoEAlltoAllTokenDispatcher, not EfaTokenDispatcher; GRPO ran 599 of 600 steps; "
        "train/loss=nan at GRPO step 17; warm-start loss not finite at warm-start step 3; sampler "
        "and trainer logprobs disagree: token_mult_prob_error max 1.2000 > 1.05")
    ok, text = verdict(_summary(dispatch=_summary()["dispatch"][:1]), _cfg())
    assert not ok and text == "FAIL - dispatcher use reported by 1 of 2 ranks"
