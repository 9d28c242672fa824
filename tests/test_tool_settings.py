"""Settings the tools refuse before any rank starts: a meaningless value (``starts=-1``,
``iters=0``, ``tokens_per_rank=0`` ...) is one line naming the key, the value and what is
expected, plus a hint, and exit code 2, for efa-ep-bench, efa-ep-loss-match and efa-ep-plan; a
misspelled plan preset lists the presets; a misspelled transport option gets a short hint."""
import os
import subprocess

import pytest

from efa_ep.kernels.options import ConfigError, validate_options
from efa_ep.tools import bench, loss_match
from efa_ep.tools.config import SETTINGS, Setting, check_settings, compose
from efa_ep.tools.plan import cli as plan_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _refused(capsys, rc):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert "Traceback" not in "\n".join(err)
    return err


@pytest.mark.parametrize("override, expect", [
    ("starts=-1", "command line: starts=-1 must be an integer >= 1"),
    ("starts=0", "command line: starts=0 must be an integer >= 1"),
    ("iters=0", "command line: iters=0 must be an integer >= 1"),
    ("warmup=-1", "command line: warmup=-1 must be an integer >= 0"),
    ("steady_iters=0", "command line: steady_iters=0 must be an integer >= 1"),
    ("ep_size=0", "command line: ep_size=0 must be an integer >= 1"),
    ("num_threads=0", "command line: num_threads=0 must be an integer >= 1"),
    ("profiles.decode.tokens_per_rank=0",
     "command line: profiles.decode.tokens_per_rank=0 must be an integer >= 1"),
    ("layer.tokens_per_rank=-4", "command line: layer.tokens_per_rank=-4 must be an integer >= 1"),
    ("arms.proxy_channels=[1,0]", "command line: arms.proxy_channels[1]=0 must be an integer in [1, 64]"),
    ("alpha=0", "command line: alpha=0 must be a number in (0, 1)"),
    ("start_timeout_s=0", "command line: start_timeout_s=0 must be a number > 0"),
    ("routes=[balanced,skew]",
     "command line: routes[1]='skew' is not one of balanced, skewed, uniform; did you mean 'skewed'?"),
])
def test_bench_refuses_a_meaningless_value(override, expect, tmp_path, capsys):
    out = tmp_path / "bench"
    err = _refused(capsys, bench.main(["--quick", override, f"out_dir={out}", "progress=false"]))
    assert len(err) == 2 and err[0] == f"efa-ep-bench: error: {expect}", err
    assert err[1].startswith("  hint: ")
    assert not out.exists()  # refused before the run made its folder or started a rank


@pytest.mark.parametrize("override, expect", [
    ("routes=[]", "routes=[]: the transport view needs at least one"),
    ("use_shapes=[big]", "use_shapes: 'big' is not a key of shapes (deepseek_v3, qwen3_30b_a3b, tiny)"),
    ("ep_size=3", "shapes.tiny.num_experts=16 must be a multiple of ep_size=3"),
    ("shapes.tiny.topk=32", "shapes.tiny.topk=32 must be <= shapes.tiny.num_experts=16"),
    ("layer.micro_batch=3", "layer.tokens_per_rank=32 must be a multiple of layer.micro_batch=3"),
    ("arms.nccl_arm=require", "arms.nccl_arm=require: the nccl arm times NCCL's all_to_all_single"),
    ("arms.gda_modes=[regular,fast]", "arms.gda_modes: 'fast' is not one of regular, fixed, graph"),
])
def test_bench_refuses_a_run_with_nothing_or_no_sense_in_it(override, expect, tmp_path, capsys):
    err = _refused(capsys, bench.main(["--quick", override, f"out_dir={tmp_path / 'b'}"]))
    assert len(err) == 1 and err[0].startswith(f"efa-ep-bench: error: {expect}"), err


def test_validate_config_checks_values_without_compose():
    """run() callers that build the config themselves get the same checks."""
    quick = compose("bench", "quick")
    bench.validate_config(quick)
    with pytest.raises(ConfigError, match=r"^config: starts=-1 must be an integer >= 1$"):
        bench.validate_config({**quick, "starts": -1})
    with pytest.raises(ConfigError, match=r"iters=0 must be"):
        bench.run({**quick, "iters": 0, "out_dir": "/nonexistent/never"})
    cpu = compose("loss_match", "ci")
    loss_match.validate_config(cpu)
    with pytest.raises(ConfigError, match=r"^config: steps=0 must be an integer >= 1$"):
        loss_match.validate_config({**cpu, "steps": 0})


@pytest.mark.parametrize("override, expect, hint", [
    ("steps=0", "command line: steps=0 must be an integer >= 1", True),
    ("ep_size=0", "command line: ep_size=0 must be an integer >= 1", True),
    ("global_batch=0", "command line: global_batch=0 must be an integer >= 1", True),
    ("num_threads=0", "command line: num_threads=0 must be an integer >= 1", True),
    ("optimizer.lr=0", "command line: optimizer.lr=0 must be a number > 0", True),
    ("optimizer.betas=[0.9,1.0]",
     "command line: optimizer.betas[1]=1.0 must be a number in [0, 1)", True),
    ("tolerance.max_rel_dloss=-1",
     "command line: tolerance.max_rel_dloss=-1 must be a number >= 0 or null", True),
    ("model.num_moe_experts=0", "command line: model.num_moe_experts=0 must be an integer >= 1", True),
    ("global_batch=7", "global_batch=7 must be a multiple of ep_size=2", False),
    ("model.moe_router_topk=16", "model.moe_router_topk=16 must be <= model.num_moe_experts=8", False),
    ("arms.candidates=[efa:proxi]", "arms.candidates entry efa:<transport>='proxi' is not a transport; "
                                    "did you mean 'proxy'?", True),
])
def test_loss_match_refuses_a_meaningless_value(override, expect, hint, tmp_path, capsys):
    out = tmp_path / "lm"
    err = _refused(capsys, loss_match.main(["--config-name", "ci", override, f"out_dir={out}"]))
    assert err[0].startswith(f"efa-ep-loss-match: error: {expect}"), err
    assert len(err) == (2 if hint else 1), err
    assert not out.exists()


@pytest.mark.parametrize("override, expect", [
    ("tokens_per_rank=0", "tokens_per_rank=0 must be an integer >= 1 or null"),
    ("micro_batches_per_step=0", "micro_batches_per_step=0 must be an integer >= 1"),
    ("gemm_efficiency=0", "gemm_efficiency=0 must be a number in (0, 1]"),
    ("memory_budget=1.5", "memory_budget=1.5 must be a number in (0, 1]"),
    ("win_margin=0", "win_margin=0 must be a number > 0"),
    ("max_tokens_per_rank=0", "max_tokens_per_rank=0 must be an integer >= 1 or null"),
    ("token_sweep=[16,0]", "token_sweep[1]=0 must be an integer >= 1"),
    ("ep=0", "ep=0 must be an integer >= 1"),
    ("model.hidden=0", "model.hidden=0 must be an integer >= 1"),
    ("fabric.hbm_gb=0", "fabric.hbm_gb=0 must be a number > 0"),
])
def test_plan_refuses_a_meaningless_value(override, expect, tmp_path, capsys):
    out = tmp_path / "plan"
    err = _refused(capsys, plan_cli.main([override, f"out_dir={out}"]))
    assert err == [f"efa-ep-plan: error: command line: {expect}", err[1]] and err[1].startswith("  hint: ")
    assert not out.exists()


@pytest.mark.parametrize("override, names, near", [
    ("model=qwen3_30b", "deepseek_v3, kimi_k2, moonlight_16b_a3b, qwen3_30b_a3b", "qwen3_30b_a3b"),
    ("fabric=p5e", "p5, p5en, p6-b200, p6-b300", "p5en"),
    ("fabric=p6b200", "p5, p5en, p6-b200, p6-b300", "p6-b200"),
])
def test_plan_preset_typo_lists_the_presets_in_one_line(override, names, near, capsys):
    err = _refused(capsys, plan_cli.main([override]))
    key, value = override.split("=")
    assert err == [f"efa-ep-plan: error: command line: {key}={value!r} is not one of {names}; "
                   f"did you mean {near!r}?"], err
    assert "Could not find" not in err[0]


def test_plan_output_folders_are_ignored_by_git():
    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0

    assert ignored("plan_qwen3_30b_a3b_p5en/plan.json")   # the default out_dir
    assert not ignored("results/plan/calibration.json")     # shipped plan results stay tracked


def test_every_shipped_config_passes_its_settings():
    from efa_ep.tools.config import config_names

    for group in SETTINGS:
        for name in config_names(group):
            check_settings(compose(group, name), SETTINGS[group])


def test_setting_wording():
    assert Setting("a", int, None, "d", min=1).expected() == "an integer >= 1"
    assert Setting("a", float, None, "d", above=0, max=1).expected() == "a number in (0, 1]"
    assert Setting("a", float, None, "d", min=0, below=1).expected() == "a number in [0, 1)"
    assert Setting("a", int, None, "d", min=1, nullable=True).expected() == "an integer >= 1 or null"
    assert Setting("a", str, None, "d", choices=("x", "y")).expected() == "one of x, y"
    with pytest.raises(ConfigError, match=r"^here: a='x' must be an integer >= 1$") as e:
        Setting("a", int, None, "what a is", min=1).convert("x", "here")
    assert e.value.hint == "a: what a is"
    assert Setting("a", int, None, "d", min=1, nullable=True).convert(None, "here") is None


def test_misspelled_transport_option_hint_is_short_and_names_the_option():
    with pytest.raises(ConfigError) as e:
        validate_options("proxy", {"num_chanels": "4"}, "EFA_EP_TRANSPORT_OPTIONS")
    printed = [f"efa-ep-grpo: error: {e.value}", f"  hint: {e.value.hint}"]
    assert all(len(ln) <= 160 for ln in printed), [len(ln) for ln in printed]
    assert "did you mean 'num_channels'?" in printed[0] and e.value.hint.startswith("num_channels: ")
    # no close key: the transport's option names (not their types and defaults)
    with pytest.raises(ConfigError) as e:
        validate_options("gda", {"zzz": 1}, "X")
    assert e.value.hint.startswith("gda options: max_topk, timeout_s, num_programs")
    assert "=" not in e.value.hint
    with pytest.raises(ConfigError) as e:
        validate_options("hier", {"zzz": 1}, "X")
    assert e.value.hint == "hier options: node_size, network, local, aggregate, and the proxy's except hmem"
