"""Selecting the dispatcher: registration, settings, unsupported options (single process)."""
import pytest
import torch

from efa_ep.distributed import run_ranks


def test_import_efa_ep_does_not_import_megatron():
    import subprocess
    import sys

    code = ("import sys, efa_ep, efa_ep.kernels, efa_ep.dispatcher; "
            "print(any(m.startswith('megatron') for m in sys.modules), "
            "any(m == 'triton' for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.stdout.split() == ["False", "False"], out


def test_settings_from_env_and_configure(monkeypatch):
    from efa_ep.dispatcher import settings

    monkeypatch.setenv("EFA_EP_TRANSPORT", "proxy")
    monkeypatch.setenv("EFA_EP_TRANSPORT_OPTIONS", "num_channels=4, provider=tcp,timeout_s=2.5")
    monkeypatch.setenv("EFA_EP_MAX_TOKENS_PER_RANK", "512")
    settings.reset()
    s = settings.current_settings()
    assert (s.transport, s.max_tokens_per_rank) == ("proxy", 512)
    assert dict(s.transport_options) == {"num_channels": 4, "provider": "tcp", "timeout_s": 2.5}

    class Cfg:  # attributes on a TransformerConfig instance beat the environment
        efa_ep_transport = "proxy"
        efa_ep_transport_options = "num_channels=2"

    s = settings.current_settings(Cfg())
    assert s.transport == "proxy" and dict(s.transport_options) == {"num_channels": 2}
    settings.configure(transport="gda", max_tokens_per_rank=64, timeout_s=5)
    try:
        assert settings.current_settings(Cfg()).transport == "gda"
        assert settings.current_settings().max_tokens_per_rank == 64
        assert dict(settings.current_settings().transport_options) == {"timeout_s": 5.0}
    finally:
        settings.reset()
    with pytest.raises(ValueError, match="not key=value"):
        settings.parse_options("num_channels")


def _unsupported_worker(rank, world, overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, init_megatron, transformer_config

    init_megatron(world)
    cfg = TinyMoEConfig(num_layers=1, hidden_size=32, num_moe_experts=4, ffn_hidden_size=64,
                        moe_ffn_hidden_size=64)
    try:
        config = transformer_config(cfg, "efa", world, **overrides)
        MoELayer(config, get_submodules(get_gpt_layer_local_submodules(num_experts=4).mlp))
    except ValueError as e:
        return str(e)
    return "built"


def test_unsupported_megatron_options_raise_at_construction():
    msgs = run_ranks(_unsupported_worker, 1, ({"moe_router_padding_for_quantization": True},),
                     timeout_s=60)
    assert "moe_router_padding_for_quantization" in msgs[0], msgs
    # Capacity dropping with and without padding, and shared-expert overlap (which Megatron's
    # config validation allows for "efa" as for "alltoall"), build.
    for overrides in ({"moe_expert_capacity_factor": 1.0},
                      {"moe_pad_expert_input_to_capacity": True, "moe_expert_capacity_factor": 1.0},
                      {"moe_shared_expert_intermediate_size": 32, "moe_shared_expert_overlap": True}):
        assert run_ranks(_unsupported_worker, 1, (overrides,), timeout_s=60) == ["built"], overrides


def _transport_choice_worker(rank, world):
    import os

    os.environ["EFA_EP_TRANSPORT"] = "nccl_magic"
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.kernels import TransportError
    from efa_ep.tiny_moe import TinyMoEConfig, init_megatron, transformer_config

    init_megatron(world)
    cfg = TinyMoEConfig(num_layers=1, hidden_size=32, num_moe_experts=4, ffn_hidden_size=64,
                        moe_ffn_hidden_size=64)
    try:
        MoELayer(transformer_config(cfg, "efa", world),
                 get_submodules(get_gpt_layer_local_submodules(num_experts=4).mlp))
    except (TransportError, ValueError) as e:  # ConfigError is a ValueError
        return str(e)
    return "built"


def test_unknown_transport_in_env_is_refused_at_construction():
    msg = run_ranks(_transport_choice_worker, 1, timeout_s=60)[0]
    assert "EFA_EP_TRANSPORT='nccl_magic' is not a transport" in msg


def _replace_worker(rank, world):
    import os

    os.environ["EFA_EP_REPLACE_DISPATCHER"] = "alltoall"
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import get_submodules

    from efa_ep.tiny_moe import TinyMoEConfig, init_megatron, transformer_config

    init_megatron(world)
    cfg = TinyMoEConfig(num_layers=1, hidden_size=32, num_moe_experts=4, ffn_hidden_size=64,
                        moe_ffn_hidden_size=64)
    config = transformer_config(cfg, "alltoall", world)
    layer = MoELayer(config, get_submodules(get_gpt_layer_local_submodules(num_experts=4).mlp))
    return type(layer.token_dispatcher).__name__, config.moe_token_dispatcher_type


def test_replace_dispatcher_keeps_a_legal_type_string():
    assert run_ranks(_replace_worker, 1, timeout_s=60) == [("EfaTokenDispatcher", "alltoall")]


def test_configure_does_not_carry_options_to_another_transport(monkeypatch):
    from efa_ep.dispatcher import settings

    monkeypatch.setenv("EFA_EP_TRANSPORT", "proxy")
    monkeypatch.setenv("EFA_EP_TRANSPORT_OPTIONS", "num_channels=4")
    settings.reset()
    try:
        assert settings.configure(transport="proxy").transport_options == (("num_channels", 4),)
        assert settings.configure(transport="torch").transport_options == ()
        assert settings.configure(transport="proxy", num_channels=2).transport_options == (
            ("num_channels", 2),)
    finally:
        settings.reset()


def test_the_dispatcher_lets_gda_pick_rows_in_window_unless_the_user_sets_it(monkeypatch):
    """The dispatcher copies received rows before its next transport call, so it runs gda with
    ``rows_in_window=auto`` by default; a user's value (any source) wins, and no other
    transport gets the option."""
    from efa_ep.dispatcher import settings

    monkeypatch.delenv("EFA_EP_TRANSPORT_OPTIONS", raising=False)
    settings.reset()
    try:
        s = settings.configure(transport="gda")
        assert dict(s.options_for("gda")) == {"rows_in_window": "auto"}
        assert dict(settings.configure(transport="gda", rows_in_window=0)
                    .options_for("gda")) == {"rows_in_window": "0"}
        assert "rows_in_window" not in dict(s.options_for("torch"))
        assert "rows_in_window" not in dict(s.options_for("hier"))
    finally:
        settings.reset()
    monkeypatch.setenv("EFA_EP_TRANSPORT", "gda")
    monkeypatch.setenv("EFA_EP_TRANSPORT_OPTIONS", "rows_in_window=1")
    settings.reset()
    try:
        assert dict(settings.current_settings().options_for("gda")) == {"rows_in_window": "1"}
    finally:
        settings.reset()


def test_option_variables_are_read_by_the_settings_only(monkeypatch):
    """EFA_EP_PROXY_* / EFA_EP_NODE_SIZE reach a transport only as options the settings resolve:
    under every explicit option, validated (naming the variable), for the transport that runs."""
    from efa_ep.dispatcher import settings
    from efa_ep.kernels.options import ConfigError

    monkeypatch.setenv("EFA_EP_TRANSPORT", "proxy")
    monkeypatch.setenv("EFA_EP_TRANSPORT_OPTIONS", "num_channels=4")
    monkeypatch.setenv("EFA_EP_PROXY_CHANNELS", "3")
    monkeypatch.setenv("EFA_EP_PROXY_TIMEOUT_S", "7")
    monkeypatch.setenv("EFA_EP_NODE_SIZE", "2")
    settings.reset()
    s = settings.current_settings()
    assert dict(s.transport_options) == {"num_channels": 4}  # explicit only
    assert dict(s.options_for("proxy")) == {"num_channels": 4, "timeout_s": 7.0}
    assert dict(s.options_for("hier")) == {"num_channels": 4, "timeout_s": 7.0, "node_size": 2}
    assert settings.environment_options("torch") == {} == settings.environment_options("gda")
    assert settings.environment_options("proxy") == {"num_channels": 3, "timeout_s": 7.0}
    # configure() keeps the variables under its own options
    try:
        assert dict(settings.configure(transport="proxy", num_channels=2).options_for("proxy")) == {
            "num_channels": 2, "timeout_s": 7.0}
    finally:
        settings.reset()
    monkeypatch.setenv("EFA_EP_PROXY_CHANNELS", "three")
    with pytest.raises(ConfigError, match="EFA_EP_PROXY_CHANNELS: num_channels='three' is not an integer"):
        settings.check_environment(check_available=False)
    with pytest.raises(ConfigError, match="EFA_EP_PROXY_CHANNELS"):
        settings.current_settings().options_for("proxy")
    settings.reset()
