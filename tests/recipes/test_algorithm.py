"""GRPO math vs hand-computed values (NeMo-RL's definitions; see recipes/grpo/algorithm.py)."""
import math

import pytest
import torch

from efa_ep.recipes.grpo.algorithm import (baseline_and_std_per_prompt, calculate_kl,
                                           clipped_pg_loss, grpo_advantages, masked_mean)
from efa_ep.recipes.grpo.config import ClippedPGLossConfig


def test_leave_one_out_baseline_and_std():
    # one group of 4: rewards [1, 0, 0, 1]; baseline_i = (2 - r_i) / 3
    ids = torch.tensor([0, 0, 0, 0])
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    b, std = baseline_and_std_per_prompt(ids, r)
    torch.testing.assert_close(b, torch.tensor([1 / 3, 2 / 3, 2 / 3, 1 / 3]))
    # others of sample 0 = [0, 0, 1]: mean 1/3, E[r^2] 1/3, var*(3/2) = (1/3 - 1/9) * 3/2 = 1/3
    torch.testing.assert_close(std, torch.full((4,), 1 / math.sqrt(3)))


def test_plain_baseline_without_leave_one_out():
    b, std = baseline_and_std_per_prompt(torch.tensor([0, 0, 0, 0]), torch.tensor([1.0, 0, 0, 1]),
                                         leave_one_out_baseline=False)
    torch.testing.assert_close(b, torch.full((4,), 0.5))
    torch.testing.assert_close(std, torch.full((4,), math.sqrt(1 / 3)))  # 0.25 * 4/3


def test_advantages_normalised_only_where_std_positive():
    # group 0: [1, 0, 0, 1] -> (r - b) / (std + 1e-6); group 1: [1, 1, 1, 1] -> 0;
    # group 2 (two samples) [1, 0]: LOO baseline [0, 1], std nan*0 -> 0 -> not normalised
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 1, 0])
    a = grpo_advantages(ids, r)
    s = 1 / math.sqrt(3) + 1e-6
    want = torch.tensor([2 / 3 / s, -2 / 3 / s, -2 / 3 / s, 2 / 3 / s, 0, 0, 0, 0, 1, -1])
    torch.testing.assert_close(a, want)
    torch.testing.assert_close(grpo_advantages(ids, r, normalize_rewards=False)[:4],
                               torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    clipped = grpo_advantages(ids, r, advantage_clip_low=-0.5, advantage_clip_high=0.5)
    assert clipped.max() == 0.5 and clipped.min() == -0.5


def test_groups_by_prompt_tokens_and_single_valid_sample():
    prompts = torch.tensor([[5, 6], [5, 6], [7, 8], [7, 8]])
    b, _ = baseline_and_std_per_prompt(prompts, torch.tensor([1.0, 0, 1, 1]))
    torch.testing.assert_close(b, torch.tensor([0.0, 1, 1, 1]))
    b, std = baseline_and_std_per_prompt(torch.tensor([0, 0]), torch.tensor([1.0, 0.0]),
                                         valid_mask=torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(b, torch.tensor([1.0, 0.0]))  # <= 1 valid: baseline = reward
    torch.testing.assert_close(std, torch.zeros(2))


def test_k3_kl_and_clamps():
    cur, ref = torch.tensor([-1.0, -2.0, -1.0]), torch.tensor([-2.0, -2.0, 29.0])
    kl = calculate_kl(cur, ref, "k3", input_clamp_value=20.0, output_clamp_value=10.0)
    # logr = ref - cur = [-1, 0, 30 -> clamped 20]; k3 = e^logr - 1 - logr, output clamped to 10
    torch.testing.assert_close(kl, torch.tensor([math.exp(-1), 0.0, 10.0]))
    torch.testing.assert_close(calculate_kl(cur[:1], ref[:1], "k1"), torch.tensor([1.0]))
    torch.testing.assert_close(calculate_kl(cur[:1], ref[:1], "k2"), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="k4"):
        calculate_kl(cur, ref, "k4")


def _loss_inputs():
    # sample 0: A=+1, ratio 1.5 (clipped to 1.2), then ratio 1.0; sample 1: A=-1, ratio 0.5
    # (clipped to 0.8), then a padding token.
    prev = torch.zeros(2, 2)
    curr = torch.tensor([[math.log(1.5), 0.0], [math.log(0.5), 0.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return prev, curr, adv, mask


def test_clipped_loss_hand_values_and_gradient():
    prev, curr, adv, mask = _loss_inputs()
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0)
    loss, m = clipped_pg_loss(curr, prev, prev, None, adv, mask, mask.sum(), cfg)
    # token losses max(-A r, -A clamp(r)): [-1.2, -1.0], [0.8, pad] -> mean over 3 valid tokens
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 0.8) / 3, abs=1e-6)
    loss.backward()
    # clipped tokens get no gradient; token (0,1): d(-A r)/d logp = -r = -1, / 3 tokens
    torch.testing.assert_close(curr.grad, torch.tensor([[0.0, -1 / 3], [0.0, 0.0]]))
    assert m["clip_fraction"] == pytest.approx(2 / 3)
    assert m["probs_ratio_clamped_min"] == pytest.approx(0.8)
    assert m["probs_ratio_clamped_max"] == pytest.approx(1.2)
    assert m["token_mult_prob_error"] == pytest.approx(1.0)  # generation == prev


def test_kl_term_and_global_normalisation_over_microbatches():
    prev, curr, adv, mask = _loss_inputs()
    ref = prev - 1.0
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1)
    full, m = clipped_pg_loss(curr, prev, prev, ref, adv, mask, mask.sum(), cfg)
    logr = (ref - curr).detach()
    k3 = (logr.exp() - 1 - logr) * mask
    assert full.item() == pytest.approx((-1.2 - 1.0 + 0.8) / 3 + 0.1 * k3.sum().item() / 3, abs=1e-6)
    assert m["kl_penalty"] == pytest.approx(k3.sum().item() / 3, abs=1e-6)
    # microbatches normalised by the global token count add up to the full-batch loss
    parts = [clipped_pg_loss(curr[i:i + 1], prev[i:i + 1], prev[i:i + 1], ref[i:i + 1], adv[i:i + 1],
                             mask[i:i + 1], mask.sum(), cfg)[0] for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(full.item(), abs=1e-6)


def test_sequence_level_loss_and_dual_clip():
    prev, curr, adv, mask = _loss_inputs()
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, token_level_loss=False)
    loss, _ = clipped_pg_loss(curr, prev, prev, None, adv, mask, mask.sum(), cfg,
                              global_valid_seqs=torch.tensor(2.0))
    assert loss.item() == pytest.approx(((-1.2 - 1.0) / 2 + 0.8) / 2, abs=1e-6)
    # dual clip: A<0 with a huge ratio is capped at -A * c
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, ratio_clip_c=3.0)
    loss, _ = clipped_pg_loss(torch.tensor([[math.log(10.0)]]), torch.zeros(1, 1), torch.zeros(1, 1),
                              None, torch.tensor([-1.0]), torch.ones(1, 1), 1.0, cfg)
    assert loss.item() == pytest.approx(3.0, abs=1e-5)


def test_token_mult_prob_error():
    prev = torch.zeros(1, 2)
    gen = torch.tensor([[0.1, -0.2]])
    _, m = clipped_pg_loss(prev.clone().requires_grad_(True), prev, gen, None, torch.tensor([1.0]),
                           torch.ones(1, 2), 2.0, ClippedPGLossConfig(reference_policy_kl_penalty=0))
    assert m["token_mult_prob_error"] == pytest.approx((math.exp(0.1) + math.exp(0.2)) / 2, abs=1e-6)


def test_masked_mean():
    v, mk = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 1.0])
    assert masked_mean(v, mk).item() == pytest.approx(2.0, abs=1e-6)
    assert masked_mean(v, mk, global_normalization_factor=4.0).item() == pytest.approx(1.0, abs=1e-6)
