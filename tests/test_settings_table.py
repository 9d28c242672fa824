"""Every ``EFA_EP_*`` variable is declared once (``efa_ep.kernels.core.variables.VARIABLES``): the
docs' tables are generated from it, the reader refuses undeclared names, per-option variables
take their type from the transport's schema, and a bad value is one line naming the variable."""
import os
import re

import pytest

from efa_ep.dispatcher import settings
from efa_ep.kernels.options import SCHEMAS, ConfigError
from efa_ep.tools import config as tool_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("rel", tool_config.TABLE_FILES)
def test_docs_table_equals_the_declarations(rel):
    with open(os.path.join(ROOT, rel)) as f:
        text = f.read()
    assert text.count(tool_config.TABLE_START) == 1 == text.count(tool_config.TABLE_END), rel
    assert tool_config.with_settings_table(text, rel) == text, (
        f"{rel}: the settings table differs from efa_ep.kernels.core.variables.VARIABLES; run "
        f"python3 -m efa_ep.tools.config --settings-table --write")


def test_the_table_command_prints_every_variable(capsys):
    assert tool_config.main(["--settings-table"]) == 0
    out = capsys.readouterr().out
    for v in settings.VARIABLES:
        assert f"| `{v.env}` |" in out


def test_every_variable_the_code_names_is_declared():
    """A variable named in the code but not declared would be missing from the table and be
    refused by check_environment; one declared but named nowhere is dead."""
    named = set()
    for top in ("dispatcher", "kernels", "efa_ep", "recipes", "scripts", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                # test_contract_env names a probe variable; this file names misspellings
                if name.endswith(".py") and name not in ("test_contract_env.py", "test_settings_table.py"):
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        named |= set(re.findall(r"\b(EFA_EP_[A-Z][A-Z0-9_]*[A-Z0-9])\b", f.read()))
    assert sorted(named - set(settings.VARIABLE)) == []
    assert sorted(set(settings.VARIABLE) - named) == []


def test_option_variables_come_from_the_schema():
    v = settings.VARIABLE["EFA_EP_PROXY_CHANNELS"]
    assert v.option is SCHEMAS["proxy"]["num_channels"] and v.transports == ("proxy", "hier")
    assert (v.type, v.min, v.max, v.doc) == (int, 1, 64, SCHEMAS["proxy"]["num_channels"].doc)
    assert settings.VARIABLE["EFA_EP_PROXY_HMEM"].transports == ("proxy",)  # hier has no hmem
    assert settings.VARIABLE["EFA_EP_PROXY_TIMEOUT_S"].transports == ("proxy", "hier")  # not gda's
    assert settings.VARIABLE["EFA_EP_NODE_SIZE"].transports == ("hier",)
    assert not hasattr(SCHEMAS["proxy"]["num_channels"], "env")  # the link lives in one place


def test_the_reader_refuses_an_undeclared_name():
    with pytest.raises(KeyError, match="EFA_EP_PROXY_CHANNEL is not declared.*EFA_EP_PROXY_CHANNELS"):
        settings.raw("EFA_EP_PROXY_CHANNEL", {})
    assert settings.raw("EFA_EP_CALIBRATION", {"EFA_EP_CALIBRATION": "  "}) is None
    assert settings.read("EFA_EP_CAPACITY_OVERFLOW", environ={}) == "drop"


@pytest.mark.parametrize("env, line", [
    ({"EFA_EP_PROXY_CHANEL": "4"},
     "EFA_EP_PROXY_CHANEL: not an efa-ep variable; did you mean 'EFA_EP_PROXY_CHANNELS'?"),
    ({"EFA_EP_FALLBACK": "yes"}, "EFA_EP_FALLBACK='yes': expected one of none, alltoall"),
    ({"EFA_EP_MAX_TOKENS_PER_RANK": "0"}, "EFA_EP_MAX_TOKENS_PER_RANK='0' must be in [1, 16777216]"),
    ({"EFA_EP_PROXY_HMEM": "gpu"}, None),  # torch takes no hmem: not read, not refused
])
def test_check_environment_names_the_variable_and_value(env, line):
    env = {"EFA_EP_TRANSPORT": "torch", **env}
    if line is None:
        settings.check_environment(env, check_available=False)
        return
    with pytest.raises(ConfigError) as e:
        settings.check_environment(env, check_available=False)
    assert str(e.value) == line and e.value.hint


def test_use_passes_a_settings_object_without_the_environment(monkeypatch):
    monkeypatch.setenv("EFA_EP_TRANSPORT", "proxy")
    monkeypatch.setenv("EFA_EP_TRANSPORT_OPTIONS", "num_channels=4")
    monkeypatch.setenv("EFA_EP_MAX_TOKENS_PER_RANK", "512")
    try:
        s = settings.use(settings.DispatcherSettings.from_env().replace(
            transport="hier", transport_options=(("node_size", 2),)))
        got = settings.current_settings()
        assert got is s and got.transport == "hier" and got.max_tokens_per_rank == 512
        assert dict(got.transport_options) == {"node_size": 2}
        assert os.environ["EFA_EP_TRANSPORT"] == "proxy"  # nothing written
        with pytest.raises(ConfigError, match="DispatcherSettings.transport_options: unknown option"):
            settings.DispatcherSettings().replace(transport_options=(("num_chanels", 2),))
        settings.use(None)
        assert settings.current_settings().transport == "proxy"
    finally:
        settings.reset()


def test_bench_checks_the_variables_it_passes_to_the_ranks():
    from efa_ep.tools.bench.cli import rank_env

    assert rank_env({"env": {"EFA_EP_PROXY_CHANNELS": 2, "NCCL_DEBUG": "INFO"}}) == {
        "EFA_EP_PROXY_CHANNELS": "2", "NCCL_DEBUG": "INFO"}
    with pytest.raises(ConfigError, match=r"^env.EFA_EP_PROXY_CHANNELS: num_channels='0' must be"):
        rank_env({"env": {"EFA_EP_PROXY_CHANNELS": 0}})
    with pytest.raises(ConfigError, match=r"^env.EFA_EP_TRANSPROT: not an efa-ep variable; did you"):
        rank_env({"env": {"EFA_EP_TRANSPROT": "torch"}})


def test_tools_help_lists_the_variables(capsys):
    from efa_ep.tools import bench, loss_match
    from efa_ep.tools.doctor import cli as doctor_cli

    for main in (bench.main, loss_match.main, doctor_cli.main):
        with pytest.raises(SystemExit):
            main(["--help"])
        out = capsys.readouterr().out
        assert "EFA_EP_CAPACITY_OVERFLOW: one of drop, error, grow (default drop)" in out
        assert "EFA_EP_PROXY_CHANNELS: an integer in [1, 64]" in out
