"""A tiny Megatron GPTModel (local spec, MoE in every layer) trains 5 steps with the efa
dispatcher and with Megatron's alltoall: the per-step losses are identical (fp32, CPU, EP 2)."""
import torch

from efa_ep.distributed import run_ranks


def _train_worker(rank, world, dispatcher, steps):
    import os

    os.environ["EFA_EP_TRANSPORT"] = "torch"
    from efa_ep.tiny_moe import TinyMoEConfig, build_gpt_moe, causal_inputs, init_megatron, sync_grads

    init_megatron(world)
    cfg = TinyMoEConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, moe_ffn_hidden_size=128,
                        num_moe_experts=4, vocab_size=32, seq_length=16)
    model = build_gpt_moe(cfg, dispatcher)
    dispatchers = {type(l.mlp.token_dispatcher).__name__ for l in model.decoder.layers}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(42 + rank)
    losses = []
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)  # memorised
    for _ in range(steps):
        labels = torch.roll(tokens, -1, dims=1)
        position_ids, mask = causal_inputs(tokens)
        opt.zero_grad()
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
        loss.backward()
        sync_grads(model)
        opt.step()
        losses.append(loss.item())
    return losses, sorted(dispatchers)


def test_gpt_moe_trains_identically_with_efa_and_alltoall():
    efa = run_ranks(_train_worker, 2, ("efa", 5), timeout_s=180)
    a2a = run_ranks(_train_worker, 2, ("alltoall", 5), timeout_s=180)
    for (l_efa, d_efa), (l_a2a, d_a2a) in zip(efa, a2a):
        assert d_efa == ["EfaTokenDispatcher"] and d_a2a == ["MoEAlltoAllTokenDispatcher"]
        assert l_efa == l_a2a, (l_efa, l_a2a)  # bitwise: same floats, every step
        assert l_efa[-1] < l_efa[0]  # it does train
