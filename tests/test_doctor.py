"""efa-ep-doctor: every check's ok / warn / fail / skip path (on hand-built hosts and faked probes),
the self-test's arms and its failure path, the verdict's join with the planner, the JSON
document, the command line's errors, and one real run on this machine."""
import dataclasses
import json

import pytest

from efa_ep.tools.doctor import checks as C
from efa_ep.tools.doctor import probes, selftest, verdict
from efa_ep.tools.doctor.checks import Check, Host, Layout

P5EN = Layout(nodes=2, gpus_per_node=8, ep=16)
ONE_NODE = Layout(nodes=1, gpus_per_node=8, ep=8)


def _host(**over) -> Host:
    """A healthy p5en-like host: 8 H200s over NVLink, 16 EFA devices, the EFA installer's
    libfabric with FI_HMEM, 192 CPUs."""
    base = dict(
        python="3.11.7", versions={"torch": "2.13.0", "triton": "3.9.0", "megatron-core": "0.19.2"},
        torch_cuda="12.8", gpus=8, gpu_name="NVIDIA H200",
        topology={"source": "nvidia-smi topo -m",
                  "pairs": {f"{i}-{j}": "NV18" for i in range(8) for j in range(i + 1, 8)}},
        mps=False, symm_mem=None,
        native={"path": "/c/libefa_proxy-x.so", "built": True, "prebuilt": False, "abi": 5,
                "expected_abi": 5, "problem": None, "temporary": None, "load_s": 0.1},
        libfabric={"path": "/opt/amazon/efa/lib/libfabric.so.1", "version": "1.22", "loaded": True,
                   "source": "efa installer", "fi_info": "1.22.0"},
        providers={"efa": None, "tcp": None, "shm": None}, hmem={"efa": None, "shm": None},
        efa_devices=[f"rdmap{i}s0" for i in range(16)], cpus=192,
        channels={"value": 4, "source": "default", "cpu_base": None},
        transports={"torch": None, "gda": None, "proxy": None, "hier": None})
    base.update(over)
    return Host(**base)


NO_GPU = dict(gpus=0, gpu_name=None, topology=None, torch_cuda=None, hmem={})
WHY = "fi_getinfo(prov_name=efa, FI_EP_RDM) failed: No data available (-61); the provider is missing"
CASES = [
    # (check, host overrides, layout, status, words in the detail)
    ("python", {}, P5EN, "ok", "3.11.7"),
    ("python", {"python": "3.10.12"}, P5EN, "warn", "megatron-core 0.19 declares >= 3.12"),
    ("python", {"python": "3.9.18"}, P5EN, "fail", "requires >= 3.10"),
    ("torch", {}, P5EN, "ok", "CUDA 12.8 build"),
    ("torch", {"versions": {"torch": None}}, P5EN, "fail", "not installed"),
    ("torch", {"versions": {"torch": "2.5.1"}}, P5EN, "fail", ">= 2.6"),
    ("torch", {"torch_cuda": None}, P5EN, "fail", "CPU build"),
    ("triton", {}, P5EN, "ok", "3.9.0"),
    ("triton", {"versions": {"triton": None}}, P5EN, "fail", "gda"),
    ("triton", {"versions": {"triton": None}, **NO_GPU}, P5EN, "skip", "needs a GPU"),
    ("triton", {"versions": {"triton": "3.1.0"}}, P5EN, "fail", ">= 3.2"),
    ("triton", {"versions": {"triton": "3.1.0"}, **NO_GPU}, P5EN, "warn", ">= 3.2"),
    ("megatron", {}, P5EN, "ok", "0.19.2"),
    ("megatron", {"versions": {"megatron-core": None}}, P5EN, "fail", "not installed"),
    ("megatron", {"versions": {"megatron-core": "0.20.1"}}, P5EN, "warn", ">= 0.19, < 0.20"),
    ("gpus", {}, P5EN, "ok", "8 x NVIDIA H200"),
    ("gpus", {"gpus": 4}, P5EN, "warn", "the layout says 8"),
    ("gpus", NO_GPU, P5EN, "skip", "no CUDA GPU"),
    ("nvlink", {}, P5EN, "ok", "all 28 pairs"),
    ("nvlink", {"topology": {"source": "nvidia-smi topo -m", "pairs": {"0-1": "NV18", "0-2": "SYS", "1-2": "PIX"}},
                "gpus": 3}, P5EN, "warn", "2 of 3 GPU pairs without NVLink"),
    ("nvlink", {"topology": {"source": "torch.cuda.can_device_access_peer", "pairs": {"0-1": "peer"}},
                "gpus": 2}, P5EN, "ok", "link type is unknown"),
    ("nvlink", {"topology": {"source": "torch.cuda.can_device_access_peer", "pairs": {"0-1": "none"}},
                "gpus": 2}, P5EN, "warn", "no peer access"),
    ("nvlink", {"gpus": 1, "topology": None}, P5EN, "skip", "one GPU"),
    ("nvlink", NO_GPU, P5EN, "skip", "no GPU"),
    ("mps", {}, P5EN, "ok", "not needed"),
    ("mps", {"gpus": 1}, P5EN, "fail", "8 ranks share each GPU"),
    ("mps", {"gpus": 1, "mps": True}, P5EN, "ok", "running"),
    ("mps", NO_GPU, P5EN, "skip", "no GPU"),
    ("symm_mem", {}, P5EN, "ok", "importable"),
    ("symm_mem", {"symm_mem": "ImportError: no module"}, P5EN, "fail", "does not import"),
    ("symm_mem", NO_GPU, P5EN, "skip", "no GPU"),
    ("libfabric", {}, P5EN, "ok", "efa installer"),
    ("libfabric", {"libfabric": {"path": "/usr/lib/x86_64-linux-gnu/libfabric.so.1", "version": "1.17",
                                 "loaded": True, "source": "distribution", "fi_info": None}},
     P5EN, "warn", "not the EFA installer's"),
    ("libfabric", {"libfabric": {"path": None, "version": None, "loaded": False, "source": None}}, P5EN,
     "fail", "not found"),
    ("libfabric", {"libfabric": {"path": None, "version": None, "loaded": False, "source": None}}, ONE_NODE,
     "warn", "not found"),
    ("libfabric", {"libfabric": {"path": "/x/libfabric.so", "version": "1.5", "loaded": True,
                                 "source": "custom"}}, P5EN, "fail", ">= 1.9"),
    ("provider_efa", {}, P5EN, "ok", "default provider"),
    ("provider_efa", {"providers": {"efa": WHY, "tcp": None, "shm": None}}, P5EN, "fail", "16 EFA device(s)"),
    ("provider_efa", {"providers": {"efa": WHY, "tcp": None, "shm": None}, "efa_devices": []}, P5EN, "warn",
     "would run over tcp"),
    ("provider_efa", {"providers": {"efa": WHY, "tcp": None, "shm": None}, "efa_devices": []}, ONE_NODE,
     "skip", "no EFA device"),
    ("provider_efa", {"native": {"problem": "no C compiler found"}}, P5EN, "skip", "cannot probe"),
    ("provider_tcp", {}, P5EN, "ok", "usable"),
    ("provider_tcp", {"providers": {"efa": None, "tcp": "fi_getinfo failed", "shm": None}}, P5EN, "warn",
     "unusable"),
    ("provider_shm", {"providers": {"efa": None, "tcp": None, "shm": "fi_getinfo failed"}}, P5EN, "warn",
     "unusable"),
    ("hmem", {}, P5EN, "ok", "GPUDirect"),
    ("hmem", {"hmem": {"efa": "fi_getinfo(FI_HMEM) failed", "shm": "fi_getinfo(FI_HMEM) failed"}}, P5EN,
     "warn", "stages rows through host memory"),
    ("hmem", {"hmem": {"efa": "no", "shm": None}}, P5EN, "warn", "only shm"),
    ("hmem", NO_GPU, P5EN, "skip", "no GPU"),
    ("efa_devices", {}, P5EN, "ok", "2 per GPU"),
    ("efa_devices", {"efa_devices": ["rdmap0s0"]}, P5EN, "warn", "fewer than one per GPU"),
    ("efa_devices", {"efa_devices": []}, P5EN, "skip", "none"),
    ("nic_spread", {}, P5EN, "warn", "share one NIC"),
    ("nic_spread", {"efa_devices": ["rdmap0s0"], "gpus": 1}, P5EN, "ok", "one EFA device"),
    ("nic_spread", {"efa_devices": []}, P5EN, "skip", "no EFA device"),
    ("cpu_cores", {}, P5EN, "ok", "192 CPUs (24 per rank) for 8 ranks"),
    ("cpu_cores", {"cpus": 16}, P5EN, "warn", "EFA_EP_PROXY_CHANNELS=1"),
    ("cpu_cores", {"channels": {"value": 4, "source": "EFA_EP_PROXY_CHANNELS", "cpu_base": 8}}, P5EN, "warn",
     "share CPUs 8..11"),
    ("native", {}, P5EN, "ok", "ABI 5 (expects 5)"),
    ("native", {"native": {"path": "/p.so", "prebuilt": True, "built": True, "abi": 5, "expected_abi": 5,
                           "problem": None}}, P5EN, "ok", "EFA_EP_PROXY_SO"),
    ("native", {"native": {"path": "/tmp/x.so", "expected_path": "/c/l.so", "built": False, "prebuilt": False,
                           "abi": 5, "expected_abi": 5, "problem": None, "temporary": "/tmp", "load_s": 2.0}},
     P5EN, "warn", "compiles it into /c/l.so"),
    ("native", {"native": {"path": "/p.so", "prebuilt": True, "built": True, "abi": 4, "expected_abi": 5,
                           "problem": "cannot load the native proxy: /p.so: ABI version 4 != 5"}}, P5EN, "fail",
     "ABI 4"),
    ("native", {"native": {"problem": "no C compiler found (cc/gcc/clang)"}}, P5EN, "fail", "no C compiler"),
    ("native", {"native": {"problem": "no C compiler found (cc/gcc/clang)"}}, ONE_NODE, "warn", "no C compiler"),
    ("settings", {}, P5EN, "ok", "EFA_EP_FALLBACK unset"),
    ("settings", {"settings": {"transport": "proxy", "options": {"num_channels": 4}, "fallback": "alltoall",
                               "error": None}}, P5EN, "ok", "EFA_EP_TRANSPORT=proxy (num_channels=4); EFA_EP_FALLBACK"),
    ("settings", {"settings": {"error": "EFA_EP_FALLBACK='yes': expected alltoall (or none)", "hint": "h"}}, P5EN,
     "fail", "EFA_EP_FALLBACK='yes'"),
]


def _fn(name):
    if name.startswith("provider_"):
        return C.check_provider(name.split("_", 1)[1])
    return getattr(C, f"check_{name}")


@pytest.mark.parametrize("name,over,lay,status,words", CASES,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_check_paths(name, over, lay, status, words):
    c = _fn(name)(_host(**over), lay)
    assert isinstance(c, Check) and c.status == status, c.line()
    assert words in c.line(), c.line()
    assert "\n" not in c.line()
    assert bool(c.fix) == (status in ("warn", "fail")), c.line()  # every warn and fail says what to do


def test_every_check_has_all_its_statuses_covered():
    seen = {(name, status) for name, _, _, status, _ in CASES}
    # the four statuses appear, and every check of CHECKS is exercised
    assert {s for _, s in seen} == set(C.STATUSES)
    names = {fn.__name__.replace("check_", "") for fn in C.CHECKS}
    assert names == {n for n, _ in seen}, names ^ {n for n, _ in seen}


def test_symmetric_memory_line_follows_gda_selftest():
    ok = C.check_symm_mem(_host(), P5EN)
    assert C.update_symm_mem(ok, Check("selftest gda", "ok", "bit-identical")).detail.endswith("gda's self-test")
    failed = C.update_symm_mem(ok, Check("selftest gda", "fail", "setup: rendezvous failed", "fix it"))
    assert failed.status == "fail" and "rendezvous failed" in failed.detail
    assert "not allocated" in C.update_symm_mem(ok, Check("selftest gda", "skip", "no MPS")).detail


def test_a_broken_check_becomes_one_fail_line(monkeypatch):
    def check_broken(h, lay):
        raise KeyError("x")

    monkeypatch.setattr(C, "CHECKS", [C.check_python, check_broken])
    got = C.run_checks(_host(), P5EN)
    assert [c.status for c in got] == ["ok", "fail"] and "KeyError" in got[1].detail


TOPO = ("\x1b[4m\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\tSYS\tPIX\t0-47\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tNV18\tSYS\t0-47\t0\t\tN/A\n"
        "GPU2\tSYS\tNV18\t X \tSYS\t48-95\t1\t\tN/A\n"
        "NIC0\tPIX\tSYS\tSYS\t X \n\nLegend:\n\n  X    = Self\n"
        "  NV#  = Connection traversing a bonded set of # NVLinks\n")


def test_parse_nvidia_smi_topo():
    assert probes.parse_topo(TOPO) == {"0-1": "NV18", "0-2": "SYS", "1-2": "NV18"}


def test_gather_host_with_faked_probes(monkeypatch):
    """A GPU host without a compiler, seen through faked probes: the facts reach the checks."""
    monkeypatch.setattr(probes, "gpus", lambda: {"count": 2, "name": "NVIDIA H100"})
    monkeypatch.setattr(probes, "nvidia_smi_topo", lambda: TOPO)
    monkeypatch.setattr(probes, "native_library", lambda: {
        "path": None, "built": False, "prebuilt": False, "abi": None, "expected_abi": 5,
        "problem": "no C compiler found (cc/gcc/clang; apt-get install gcc)", "temporary": None, "load_s": None})
    monkeypatch.setattr(probes, "provider", lambda *a, **k: pytest.fail("no probe without the library"))
    monkeypatch.setattr(probes, "dist_version", {"torch": "2.7.0", "triton": None, "megatron-core": "0.19.0"}.get)
    monkeypatch.setattr(probes, "torch_cuda_build", lambda: "12.6")
    monkeypatch.setattr(probes, "mps_running", lambda: False)
    monkeypatch.setattr(probes, "efa_devices", lambda: ["rdmap0s0", "rdmap1s0"])
    monkeypatch.setattr(probes, "libfabric", lambda: {"path": None, "version": None, "loaded": False,
                                                      "source": None, "fi_info": None})
    monkeypatch.setattr(probes, "cpus", lambda: 8)
    h = C.gather_host()
    assert h.gpus == 2 and h.topology["pairs"] == {"0-1": "NV18", "0-2": "SYS", "1-2": "NV18"}
    assert all(str(v).startswith("not probed") for v in h.providers.values()) and h.hmem == {}
    got = {c.name: c.status for c in C.run_checks(h, P5EN)}
    assert got["triton"] == "fail" and got["megatron-core"] == "ok" and got["libfabric"] == "fail"
    assert got["native library"] == "fail" and got["provider efa"] == "skip" and got["gpus"] == "warn"


def test_expected_library_path_is_the_build_cache_name():
    from efa_ep.kernels.proxy import native

    if native.build_problem() is not None:
        pytest.skip(native.build_problem())
    assert probes.expected_library_path() == native.build()  # the same name, no rebuild


def test_selftest_arms_follow_the_host():
    labels = lambda arms: {a.label: a.skip for a in arms}  # noqa: E731
    got = labels(selftest.plan_arms(_host(), 2))
    assert all(v is None for v in got.values()) and "hier:efa" in got and "gda" in got
    cpu = labels(selftest.plan_arms(_host(**NO_GPU, efa_devices=[], transports={
        "torch": None, "gda": "no CUDA GPU is visible (needs a CUDA GPU)", "proxy": None, "hier": None},
        providers={"efa": WHY, "tcp": None, "shm": None}), 2))
    assert cpu["gda"] == "no CUDA GPU is visible" and cpu["proxy:efa"] == "no EFA device on this host"
    assert cpu["proxy:tcp"] is None and cpu["hier:tcp"] is None
    shared = labels(selftest.plan_arms(_host(gpus=1), 2))
    assert "without MPS" in shared["gda"]
    noproxy = labels(selftest.plan_arms(_host(transports={"torch": None, "gda": None, "hier": None,
                                                          "proxy": "no C compiler (needs ...)"}), 2))
    assert noproxy["proxy:tcp"] == "no C compiler" and "network stage" in noproxy["hier"]


def test_selftest_reports_a_transport_that_fails_to_start():
    """This host's proxy told efa is usable (it is not): the efa arm fails on every rank with
    the proxy's own one-line error, the torch reference still runs and is timed."""
    from efa_ep.kernels import transport_status

    if transport_status().get("proxy") is not None or probes.provider("efa") is None:
        pytest.skip("needs a proxy that can run and no efa provider")
    h = _host(**NO_GPU, efa_devices=[], transports={"torch": None, "gda": "no GPU", "proxy": None, "hier": None},
              providers={"efa": None, "tcp": "off in this test", "shm": "off in this test"})
    cfg = dict(ranks=2, tokens=16, hidden=32, num_experts=4, topk=2, dtype="fp32", iters=3, warmup=1,
               arm_budget_s=0.5, timeout_s=60)
    st = selftest.run_selftest(h, cfg)
    got = {c.name: c for c in st["checks"]}
    assert got["selftest torch"].status == "ok" and "fixed cost" in got["selftest torch"].detail
    assert got["selftest proxy:efa"].status == "fail" and "setup:" in got["selftest proxy:efa"].detail
    assert got["selftest proxy:efa"].fix and got["selftest gda"].status == "skip"
    assert got["selftest hier:efa"].status == "fail", got["selftest hier:efa"].line()


CFG = {"model": "qwen3_30b_a3b", "fabric": "p5en", "nodes": 2, "gpus_per_node": 8, "ep": None,
       "tokens_per_rank": None, "calibration": None, "selftest": {"enabled": False}}



def test_auto_pick_and_advice():
    assert verdict.auto_pick(_host(), ONE_NODE)["name"] == "gda"
    cpu = _host(**NO_GPU, transports={"torch": None, "gda": "no CUDA GPU is visible (needs x)", "proxy": None,
                                      "hier": None})
    assert verdict.auto_pick(cpu, ONE_NODE)["name"] == "torch"
    a = verdict.auto_pick(_host(), P5EN)
    assert (a["name"], a["provider"], a["local"], a["runs"]) == ("hier", "efa", "gda", True)
    lay = C.Layout(2, 8, 16)
    v = verdict.verdict(_host(), lay, dict(CFG, tokens_per_rank=4096), [], None)
    assert v["advice"] == "use efa" and v["ratio"] < 0.9 and v["auto_dc_us"]["tag"] == "derived"
    v = verdict.verdict(_host(), lay, dict(CFG, tokens_per_rank=128), [], None)
    assert v["advice"] == "EP only for capacity", v["advice_detail"]
    # auto runs hier across nodes; where the planner's fastest efa path is another, the advice
    # says how to run that one
    v = verdict.verdict(_host(), lay, dict(CFG, tokens_per_rank=1024), [], None)
    assert v["advice"] == "use efa" and v["planner"]["transport"] == "proxy", v["advice_detail"]
    k = v["planner"]["num_channels"]
    assert (f"auto runs hier:agg1, the planner's fastest efa path is proxy with {k} channels: set "
            f"EFA_EP_TRANSPORT=proxy EFA_EP_TRANSPORT_OPTIONS=num_channels={k}") in v["advice_detail"]
    small = dict(CFG, model="moonlight_16b_a3b", nodes=1, ep=8, tokens_per_rank=128)
    v = verdict.verdict(_host(), C.Layout(1, 8, 8), small, [], None)
    assert v["advice"] in ("stay on alltoall", "use efa", "EP only for capacity")
    from efa_ep.tools.plan.model import Fig

    one_node, lay1 = dict(CFG, nodes=1, ep=8, tokens_per_rank=8192), C.Layout(1, 8, 8)
    inp, cal, note = verdict.make_inputs(one_node, lay1)
    fast_gda = (inp, {**cal, "gda_fixed_us": Fig(1.0, "us", "assumed", "test")}, note)  # gda wins
    v = verdict.verdict(_host(), lay1, one_node, [], None, inputs=fast_gda)
    assert v["advice"] == "use efa" and v["auto"]["name"] == "gda", v["advice_detail"]
    v = verdict.verdict(cpu, lay1, one_node, [], None, inputs=fast_gda)
    assert v["advice"] == "stay on alltoall" and "auto runs torch" in v["advice_detail"]
    broken = _host(transports={"torch": None, "gda": None, "hier": None, "proxy": "no compiler (needs cc)"})
    v = verdict.verdict(broken, lay, dict(CFG, tokens_per_rank=4096), [Check("native library", "fail", "x", "y")],
                        None)
    assert v["advice"] == "stay on alltoall" and "EFA_EP_FALLBACK=alltoall" in v["advice_detail"]
    assert "failing checks: native library" in v["advice_detail"]


def test_measured_fixed_cost_replaces_the_calibration():
    from efa_ep.tools.plan.model import Fig

    cal = {"proxy_fixed_us": Fig(277.0, "us", "derived", "x"), "gda_fixed_us": Fig(273.0, "us", "measured", "y")}
    st = {"ranks": 2, "shape": {"tokens": 64, "hidden": 256, "dtype": "bf16"},
          "results": [{"label": "proxy:efa", "status": "ok", "op_us": 150.0, "device": "cuda:0"},
                      {"label": "gda", "status": "ok", "op_us": 90.0, "device": "cuda:0"},
                      {"label": "proxy:tcp", "status": "ok", "op_us": 900.0, "device": "cuda:0"}]}
    out, subs = verdict.measured_calibration(cal, verdict.auto_pick(_host(), P5EN), st)
    assert out["proxy_fixed_us"].value == 150.0 and out["proxy_fixed_us"].tag == "measured"
    assert out["gda_fixed_us"].value == 90.0 and set(subs) == {"proxy_fixed_us", "gda_fixed_us"}
    # auto runs hier: with no hier self-test its fixed cost is the measured stages' sum ...
    assert out["hier_fixed_us"].value == 240.0 and out["hier_fixed_us"].tag == "derived"
    # ... and with one, hier's own measured cost
    st["results"].append({"label": "hier:efa", "status": "ok", "op_us": 700.0, "device": "cuda:0"})
    out, subs = verdict.measured_calibration(cal, verdict.auto_pick(_host(), P5EN), st)
    assert out["hier_fixed_us"].value == 700.0 and out["hier_fixed_us"].tag == "measured"
    assert subs["hier_fixed_us"]["label"] == "hier:efa"
    assert verdict.measured_calibration(cal, verdict.auto_pick(_host(), P5EN), None) == (cal, {})


def test_json_document(monkeypatch, capsys):
    from efa_ep.tools.doctor import cli

    monkeypatch.setattr(C, "gather_host", lambda: _host())
    assert cli.main(["--json", "selftest.enabled=false", "tokens_per_rank=4096"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "efa_ep.doctor/1"
    assert set(doc) == {"schema", "created_utc", "host", "layout", "config", "checks", "selftest", "verdict",
                        "summary"}
    for c in doc["checks"]:
        assert set(c) == {"name", "status", "detail", "fix", "data"} and c["status"] in C.STATUSES
    assert doc["layout"] == {"nodes": 2, "gpus_per_node": 8, "ep": 16, "ranks_per_host": 8}
    s = doc["summary"]
    assert s["ok"] + s["warn"] + s["fail"] + s["skip"] == len(doc["checks"])
    assert s["advice"] in verdict.ADVICE.values() and doc["verdict"]["auto"]["name"] == "hier"
    assert {"advice", "advice_detail", "auto", "planner", "measured"} <= set(doc["verdict"])


def test_text_output_and_exit_code(monkeypatch, capsys):
    from efa_ep.tools.doctor import cli

    monkeypatch.setattr(C, "gather_host", lambda: _host(python="3.9.1"))
    assert cli.main(["selftest.enabled=false"]) == 1  # a failed check
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("efa-ep-doctor:") and lines[-1].startswith("doctor: ok=")
    assert any(ln.startswith("fail  python") and "-> fix:" in ln for ln in lines)
    assert any(ln.startswith("verdict  advice: ") for ln in lines)


@pytest.mark.parametrize("argv,words", [
    (["modle=deepseek_v3"], "did you mean 'model'"),
    (["model=gpt5"], "gpt5"),
    (["ep=12"], "num_experts=128 must be a multiple of ep=12"),
    (["nodes=0"], ">= 1"),
    (["selftest.ranks=1"], "selftest.ranks=1 must be in [2, 8]"),
    (["selftest.dtype=int8"], "is not one of bf16, fp16, fp32"),
    (["selftest.ranks=3"], "must be a multiple of selftest.ranks=3"),
])
def test_bad_settings_are_one_line_and_exit_2(argv, words, capsys):
    from efa_ep.tools.doctor import cli

    assert cli.main(argv + (["selftest.enabled=false"] if "selftest.ranks=3" not in argv else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("efa-ep-doctor: error: ") and words in err[0], err
    assert len(err) <= 2


def test_console_script_is_declared():
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    proj = tomllib.loads((root / "pyproject.toml").read_text())
    assert proj["project"]["scripts"]["efa-ep-doctor"] == "efa_ep.tools.doctor.cli:main"
    pk = proj["tool"]["setuptools"]["packages"]
    assert "efa_ep.tools.doctor" in pk and "efa_ep.conf.doctor" in pk


def test_doctor_on_this_machine():
    """The real thing, as a user runs it: every line, the self-test against torch, the verdict,
    within a minute, and nothing left behind."""
    import os
    import subprocess
    import sys
    import time

    root = __file__.rsplit("/tests/", 1)[0]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "efa_ep.tools.doctor", "--json", "selftest.iters=5"],
                       capture_output=True, text=True, cwd=root, timeout=180)
    wall = time.monotonic() - t0
    assert p.returncode in (0, 1), p.stderr[-2000:]
    doc = json.loads(p.stdout)
    got = {c["name"]: c for c in doc["checks"]}
    assert got["selftest torch"]["status"] == "ok", got["selftest torch"]
    for name, c in got.items():
        if name.startswith("selftest ") and c["status"] == "ok" and name != "selftest torch":
            assert c["detail"].startswith("bit-identical to torch"), c
    from efa_ep.kernels import transport_status

    if transport_status().get("proxy") is None:
        assert got["selftest proxy:tcp"]["status"] == "ok", got["selftest proxy:tcp"]
    tmp = (doc["host"]["native"] or {}).get("temporary")
    assert tmp is None or not os.path.exists(tmp)
    assert wall < 120, wall  # < 60 s on an idle 2-core machine; headroom for a loaded one


def test_layout_defaults():
    from efa_ep.tools.doctor.cli import layout_of

    assert layout_of({"nodes": 2, "gpus_per_node": 8, "ep": None}) == Layout(2, 8, 16)
    lay = layout_of({"nodes": 4, "gpus_per_node": 8, "ep": 8})
    assert not lay.spans_nodes and lay.ranks_per_host == 8 and dataclasses.asdict(lay)["ep"] == 8


def test_missing_native_library_is_built_aside_and_removed(tmp_path):
    """Nothing changes on the machine: a library missing from the user's cache is built into a
    temporary folder, which cleanup removes, and EFA_EP_CACHE_DIR is put back."""
    import os
    import subprocess
    import sys

    from efa_ep.kernels.proxy import native

    if native.build_problem() is not None:
        pytest.skip(native.build_problem())
    cache = tmp_path / "cache"
    code = ("import os; from efa_ep.tools.doctor import probes; n = probes.native_library(); "
            "print(n['built'], n['abi'], n['expected_path'].startswith(os.environ['EFA_EP_CACHE_DIR']) is False); "
            "probes.cleanup(); print(os.path.exists(n['temporary']), os.environ['EFA_EP_CACHE_DIR'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "EFA_EP_CACHE_DIR": str(cache)},
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.split("\n")[:2]
    assert first == f"False {native.ABI_VERSION} True", out.stdout
    assert second == f"False {cache}", out.stdout
    assert not cache.exists()  # the user's cache was not written
