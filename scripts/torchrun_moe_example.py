#!/usr/bin/env python3
"""A Megatron GPT-MoE training step with the efa dispatcher under torchrun (the README snippet).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/torchrun_moe_example.py   # CPU: gloo, EP 2

prints one line per rank: its loss and the dispatcher class. Set OMP_NUM_THREADS as shown:
without it torchrun prints a 4-line banner (that it set it to 1) before this script runs. On
GPUs (one per rank) the same script uses NCCL. The transport comes from EFA_EP_TRANSPORT
(default auto: gda on GPUs, torch on CPU), checked before the model is built.

Known warnings are silenced here, each by its message, so that anything else still shows:
Megatron-Core's "Transformer Engine and Apex are not installed" / "Apex is not installed" (it
falls back to torch: expected on CPU and without Apex) and its "GPTModel IS DEPRECATED" notice
(GPTModel is still what this Megatron-Core version builds a GPT from; the efa dispatcher does not
depend on the model class).
"""
import logging
import os
import sys
import warnings

# Before anything imports Megatron-Core: these warnings fire at import time.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex are|Apex is) not installed")
# "GPTModel IS DEPRECATED", logged at WARNING by rank 0 when the model is built
logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import efa_ep  # noqa: F401,E402  registers moe_token_dispatcher_type="efa" with Megatron-Core
from efa_ep.dispatcher.settings import check_environment  # noqa: E402

if __name__ == "__main__":
    check_environment()  # a bad EFA_EP_* setting fails here, in one line, on every rank
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    from efa_ep.dispatcher import cpu_compat

    ep = dist.get_world_size()
    cpu_compat.enable()  # CPU only: patches Megatron's three CUDA-only MoE calls; no-op on GPUs
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    if cuda:
        tp_random.model_parallel_cuda_manual_seed(1234)
    else:
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        moe_ffn_hidden_size=128, num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=ep,
        moe_token_dispatcher_type="efa",                      # the one line that selects efa-ep
        use_cpu_initialization=True, gradient_accumulation_fusion=False,
        add_bias_linear=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, cuda_graph_modules=[])
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4),
                     vocab_size=128, max_sequence_length=32)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    model.to(device)
    tokens = torch.randint(0, 128, (4, 32), device=device)
    position_ids = torch.arange(32, device=device).expand(4, -1)
    mask = torch.ones(1, 1, 32, 32, dtype=torch.bool, device=device).triu(1)  # True = masked
    loss = model(tokens, position_ids, mask, labels=tokens).float().mean()
    loss.backward()
    # one write per line: the ranks share the terminal, and print() writes the text and its
    # newline separately when Python runs unbuffered (PYTHONUNBUFFERED=1)
    sys.stdout.write(f"rank {dist.get_rank()}: loss {loss.item():.4f}, dispatcher "
                     f"{type(model.decoder.layers[0].mlp.token_dispatcher).__name__}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
