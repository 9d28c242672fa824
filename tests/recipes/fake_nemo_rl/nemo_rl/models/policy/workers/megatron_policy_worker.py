"""FAKE MegatronPolicyWorkerImpl: like the real one, builds the Megatron model from the policy
config inside __init__ (here: one MoE layer of the efa-ep tiny model, world size 1, gloo)."""


class MegatronPolicyWorkerImpl:
    def __init__(self, config, tokenizer=None, weights_path=None, optimizer_path=None,
                 init_optimizer=True, init_reference_model=True, *, worker_sharding_annotations=None,
                 skip_weight_load=False, **kwargs):
        import sys

        moe_layer_mod = sys.modules.get("megatron.core.transformer.moe.moe_layer")
        # What matters: was the dispatcher installed before the model is built?
        hook_ready = bool(moe_layer_mod and getattr(moe_layer_mod.MoELayer.__init__, "_efa_ep_wrapped", False)) \
            or any(type(f).__name__ == "_RegisterOnImport" for f in sys.meta_path)
        import socket

        import torch.distributed as dist
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.spec_utils import get_submodules

        from efa_ep.tiny_moe import TinyMoEConfig, init_megatron, transformer_config

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        init_megatron(1)
        cfg = TinyMoEConfig(num_layers=1, hidden_size=32, num_moe_experts=4, ffn_hidden_size=64,
                            moe_ffn_hidden_size=64)
        mc = config["megatron_cfg"]
        tc = transformer_config(cfg, mc["moe_token_dispatcher_type"], 1)
        layer = MoELayer(tc, get_submodules(get_gpt_layer_local_submodules(num_experts=4).mlp))
        self.model = layer
        from efa_ep.dispatcher import current_settings

        import efa_ep
        self.fake_report = {"hook_ready_before_build": hook_ready,
                            "dispatcher_class": type(layer.token_dispatcher).__name__,
                            "transport_setting": current_settings(tc).transport,
                            "efa_ep_file": efa_ep.__file__}
        dist.destroy_process_group()


class MegatronPolicyWorker(MegatronPolicyWorkerImpl):
    pass
