"""Loss-match regression, CPU.

- The short config (conf/loss_match/ci.yaml: fp32, EP 2, 20 steps, every available transport)
  passes its tolerances: efa == alltoall bit for bit, == allgather within 1e-5, ep1 within the
  documented floor.
- The check can fail: a candidate with a 1e-3 relative weight perturbation is reported FAIL,
  and so is the pure comparison logic fed a dropped partial / a differing bit.
- The ``step loss`` export/import round-trips exactly (repr floats).
"""
import json
import math


from efa_ep.tools import loss_match
from efa_ep.tools.config import compose


def _line(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    assert out, "no output"
    return out[-1]


def test_ci_config_passes(tmp_path, capsys):
    out = tmp_path / "lm"
    rc = loss_match.main(["--config-name", "ci", f"out_dir={out}",
                          "--export-result", str(tmp_path / "export")])
    line = _line(capsys)
    report = json.loads((out / "loss_match.json").read_text())
    assert rc == 0, (line, report["verdict"]["failures"])
    assert line.startswith("loss-match: PASS: vs allgather max rel |dloss| ") and "steps=20" in line, line
    # each baseline with its own tolerance (cpu.yaml: 1e-5 vs allgather, 2e-4 vs ep1), each <=
    assert " <= 1e-05; vs ep1 max rel |dloss| " in line and " <= 0.0002; " in line, line
    assert (out / "loss_match.png").stat().st_size > 1000
    v = report["verdict"]
    arms = report["arms"]
    assert {"allgather", "ep1", "alltoall", "efa:torch"} <= set(arms)
    # The loss falls (the corpus is learnable) and every arm ran every step.
    for name, a in arms.items():
        assert len(a["losses"]) == 20 and len(a["grad_norms"]) == 20, name
    assert arms["ep1"]["losses"][-1] < arms["ep1"]["losses"][0] - 0.5
    # The stated tolerances, asserted here as well as by the command.
    for c in report["comparisons"]:
        if c["baseline"] == "allgather":
            assert c["max_rel_dloss"] <= 1e-5, c
        assert c["max_rel_dloss"] <= c["tol_rel"], c
    assert v["bitwise"] and all(b["pass"] for b in v["bitwise"]), v["bitwise"]
    assert {b["candidate"] for b in v["bitwise"]} == {a for a in arms if a.startswith("efa:")}
    # Provenance and config travel with the result.
    assert report["provenance"]["versions"]["torch"] and report["config"]["steps"] == 20
    # Exported 'step loss' files re-import bit for bit.
    exported = tmp_path / "export" / "efa_torch.txt"
    assert loss_match.import_result(str(exported)) == arms["efa:torch"]["losses"]


def test_perturbed_candidate_fails(tmp_path, capsys):
    """A check that cannot fail is a defect: 1e-3 relative weight noise on efa:torch."""
    out = tmp_path / "fault"
    rc = loss_match.main(["--config-name", "ci", f"out_dir={out}", "steps=8",
                          "arms.baselines=[allgather]", "arms.candidates=[efa:torch]",
                          "arms.transports=[torch]", "tolerance.bitwise.enabled=false",
                          "--fault", "weight_noise", "--fault-arm", "efa:torch",
                          "--fault-scale", "1e-3"])
    line = _line(capsys)
    assert rc == 1 and line.startswith("loss-match: FAIL"), line
    report = json.loads((out / "loss_match.json").read_text())
    (c,) = report["comparisons"]
    assert c["max_rel_dloss"] > 1e-5 and not c["pass"]
    assert report["fault"]["kind"] == "weight_noise"


def _arms():
    A = loss_match.Arm
    return [A("allgather", "baseline", "allgather", 2), A("efa:torch", "candidate", "efa", 2, "torch"),
            A("alltoall", "candidate", "alltoall", 2)]


def _tol(**kw):
    t = {"max_rel_dloss": 1e-5, "max_abs_dloss": None, "bitwise": {"enabled": True, "control": "alltoall"}}
    t.update(kw)
    return t


def test_compare_logic_catches_dropped_partial_and_one_bit():
    base = [4.0, 3.5, 3.0]
    res = {"allgather": {"losses": base, "grad_norms": [1, 1, 1], "param_sha256": ["a", "b"]},
           "alltoall": {"losses": list(base), "grad_norms": [1, 1, 1], "param_sha256": ["a", "b"]},
           "efa:torch": {"losses": list(base), "grad_norms": [1, 1, 1], "param_sha256": ["a", "b"]}}
    assert loss_match.compare(_arms(), res, _tol(), 3)["pass"]
    # A combine that drops one rank's partial: the loss moves by far more than 1e-5.
    res["efa:torch"] = {**res["efa:torch"], "losses": [4.0, 3.9, 3.8]}
    v = loss_match.compare(_arms(), res, _tol(), 3)
    assert not v["pass"] and any("efa:torch vs allgather" in f for f in v["failures"])
    # One ulp: within 1e-5 of the baseline, but no longer bitwise equal to alltoall.
    res["efa:torch"] = {**res["alltoall"], "losses": [4.0, math.nextafter(3.5, 4), 3.0]}
    v = loss_match.compare(_arms(), res, _tol(), 3)
    assert not v["pass"] and v["max_rel_dloss"] < 1e-5
    assert any("not bitwise identical" in f for f in v["failures"])
    # A different final parameter on one rank is caught even with equal losses.
    res["efa:torch"] = {**res["alltoall"], "param_sha256": ["a", "c"]}
    assert not loss_match.compare(_arms(), res, _tol(), 3)["pass"]
    # Missing steps, NaN and crashed arms fail.
    res["efa:torch"] = {**res["alltoall"], "losses": base[:2]}
    assert not loss_match.compare(_arms(), res, _tol(), 3)["pass"]
    res["efa:torch"] = {**res["alltoall"], "losses": [4.0, float("nan"), 3.0]}
    assert not loss_match.compare(_arms(), res, _tol(), 3)["pass"]
    res["efa:torch"] = {"error": "RuntimeError: boom"}
    v = loss_match.compare(_arms(), res, _tol(), 3)
    assert not v["pass"] and "boom" in v["failures"][0]


def test_per_baseline_tolerance_and_result_line():
    A = loss_match.Arm
    arms = [A("allgather", "baseline", "allgather", 2), A("ep1", "baseline", "allgather", 1),
            A("alltoall", "candidate", "alltoall", 2)]
    res = {"allgather": {"losses": [2.0, 2.0]}, "alltoall": {"losses": [2.0, 2.0]},
           "ep1": {"losses": [2.0, 2.0001]}}
    tol = _tol(bitwise={"enabled": False}, per_baseline={"ep1": {"max_rel_dloss": 1e-4}})
    v = loss_match.compare(arms, res, tol, 2)
    assert v["pass"], v["failures"]
    # Each comparison with its own measured value and its own tolerance: 5e-5 is within ep1's
    # 1e-4 and is never set against allgather's 1e-5.
    line = loss_match.result_line(v, tol)
    assert line == ("loss-match: PASS: vs allgather max rel |dloss| 0 <= 1e-05; vs ep1 max rel "
                    "|dloss| 5.000e-05 <= 0.0001; steps=2 arms=allgather,ep1,alltoall"), line
    tol["per_baseline"]["ep1"]["max_rel_dloss"] = 1e-5
    v = loss_match.compare(arms, res, tol, 2)
    assert not v["pass"]
    assert loss_match.result_line(v, tol) == (
        "loss-match: FAIL: vs allgather max rel |dloss| 0 <= 1e-05; vs ep1 max rel |dloss| "
        "5.000e-05 > 1e-05 (alltoall); steps=2 arms=allgather,ep1,alltoall")
    # bf16-style: an absolute tolerance, ep1 reported but not gated; the bitwise check named
    arms.append(A("efa:torch", "candidate", "efa", 2, "torch"))
    res = {k: {**r, "grad_norms": [1, 1]} for k, r in res.items()}
    res["efa:torch"] = dict(res["alltoall"])
    tol = _tol(max_rel_dloss=None, max_abs_dloss=1e-4,
               per_baseline={"ep1": {"gate": False, "max_rel_dloss": None, "max_abs_dloss": None}})
    v = loss_match.compare(arms, res, tol, 2)
    assert v["pass"], v["failures"]
    assert loss_match.result_line(v, tol) == (
        "loss-match: PASS: vs allgather max abs |dloss| 0 <= 0.0001; vs ep1 max abs |dloss| "
        "1.000e-04 (not gated); bitwise efa == alltoall; steps=2 arms=allgather,ep1,alltoall,efa:torch")
    # a failure the comparisons do not show (a crashed arm) is counted on the line
    res["efa:torch"] = {"error": "RuntimeError: boom"}
    line = loss_match.result_line(loss_match.compare(arms, res, tol, 2), tol)
    assert line.startswith("loss-match: FAIL: ") and "; 1 other failure (listed above); " in line, line


def test_export_import_roundtrip(tmp_path):
    losses = [4.170861911494285, 1e-17, 3.0000000000000004]
    (p,) = loss_match.export_result(str(tmp_path), {"efa:torch": {"losses": losses}})
    assert open(p).read().splitlines()[0] == "0 4.170861911494285"
    assert loss_match.import_result(p) == losses


def test_configs_compose():
    for name in ("cpu", "ci", "gpu_bf16"):
        cfg = compose("loss_match", name)
        arms = loss_match.resolve_arms(cfg, ["torch", "gda"])
        assert [a.name for a in arms] == ["allgather", "ep1", "efa:torch", "efa:gda", "alltoall"]
        assert cfg["tolerance"]["max_rel_dloss_reason"] and cfg["tolerance"]["bitwise"]["reason"]
    gpu = compose("loss_match", "gpu_bf16")
    assert gpu["model"]["dtype"] == "bf16" and gpu["steps"] == 100 and gpu["device"] == "cuda:0"
    assert gpu["backend"] == "gloo" and gpu["tolerance"]["max_abs_dloss"] == 1e-4
    assert gpu["tolerance"]["per_baseline"]["ep1"]["gate"] is False
    cpu = compose("loss_match", "cpu")
    assert cpu["steps"] == 50 and cpu["model"]["dtype"] == "fp32" and cpu["ep_size"] == 2
    assert cpu["tolerance"]["max_rel_dloss"] == 1e-5


def test_markov_corpus_is_deterministic_and_learnable():
    a = loss_match.make_corpus(64, 65, 4, seed=99, branching=4)
    b = loss_match.make_corpus(64, 65, 4, seed=99, branching=4)
    assert a.equal(b) and a.shape == (4, 65)
    assert loss_match.markov_entropy(64, 99, 4) < math.log(4) < math.log(64)
