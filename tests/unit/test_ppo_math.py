"""PPO math against numbers worked out by hand, and invariance to micro-batch / DP splits."""

import math

import pytest
import torch

from megappo.ppo.advantages import (
    compute_gae_advantage_return, compute_grpo_outcome_advantage, compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage, compute_remax_outcome_advantage, compute_rloo_outcome_advantage,
    gae_reference, get_estimator,
)
from megappo.ppo.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty, make_kl_controller
from megappo.ppo.losses import (
    AGG_MODES, agg_loss, entropy_from_logits, global_counts, log_probs_from_logits, policy_loss, value_loss,
)
from megappo.ppo.stats import masked_mean, masked_sum, masked_var, masked_whiten

T = torch.tensor


# -- masked statistics ---------------------------------------------------------------------

def test_masked_stats_ignore_nan_and_empty_masks():
    v = T([[1.0, float("nan"), 3.0]])
    m = T([[1.0, 0.0, 1.0]])
    assert masked_sum(v, m) == 4.0 and masked_mean(v, m) == 2.0
    assert masked_mean(v, torch.zeros_like(m)) == 0.0  # empty mask: 0, not NaN
    assert masked_var(T([[1.0, 2.0, 3.0, 100.0]]), T([[1, 1, 1, 0.0]])) == pytest.approx(1.0)  # unbiased
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        masked_var(v, T([[1.0, 0.0, 0.0]]))
    w = masked_whiten(T([[1.0, 2.0, 3.0]]), torch.ones(1, 3))
    assert torch.allclose(w, T([[-1.0, 0.0, 1.0]]), atol=1e-6)
    assert torch.allclose(masked_whiten(T([[1.0, 2.0, 3.0]]), torch.ones(1, 3), shift_mean=False), T([[1.0, 2.0, 3.0]]),
                          atol=1e-6)


# -- advantages ----------------------------------------------------------------------------

def test_gae_worked_example():
    rewards, values, mask = T([[0, 0, 0, 1.0]]), T([[0.2, 0.3, 0.4, 0.5]]), T([[0, 0, 1, 1.0]])
    raw = gae_reference(rewards, values, mask, gamma=0.99, lam=0.95)
    # t=3: delta = 1 - 0.5 = 0.5; t=2: delta = 0.99*0.5 - 0.4 = 0.095, A = 0.095 + 0.99*0.95*0.5 = 0.56525
    assert raw[0, 3].item() == pytest.approx(0.5) and raw[0, 2].item() == pytest.approx(0.56525)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    assert ret[0, 2:].tolist() == pytest.approx([0.96525, 1.0])  # raw advantages + values
    assert adv[0, 2:].tolist() == pytest.approx([0.7071, -0.7071], abs=1e-3)  # whitened over the 2 tokens


def test_gae_carries_across_masked_positions_multi_turn():
    # [resp, tool-output (masked), resp]: the masked token neither discounts nor resets
    rewards, values, mask = T([[0, 0, 1.0]]), T([[0.1, 9.0, 0.3]]), T([[1, 0, 1.0]])
    raw = gae_reference(rewards, values, mask, gamma=1.0, lam=1.0)
    assert raw[0, 2].item() == pytest.approx(0.7)  # 1 - 0.3
    assert raw[0, 0].item() == pytest.approx(0.3 - 0.1 + 0.7)  # next value is 0.3 (skips the masked 9.0)


def test_grpo_groups_std_and_singletons():
    rewards = torch.zeros(5, 3)
    rewards[:, -1] = T([1.0, 0.0, 1.0, 1.0, 0.5])
    mask = torch.ones(5, 3)
    index = T([0, 0, 0, 1, 2])
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index)
    std = torch.std(T([1.0, 0.0, 1.0]))  # unbiased
    assert adv[0, 0].item() == pytest.approx((1 - 2 / 3) / (std.item() + 1e-6), rel=1e-5)
    assert adv[3].tolist() == pytest.approx([1.0] * 3) and adv[4].tolist() == pytest.approx([0.5] * 3)  # mean 0, std 1
    adv2, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert adv2[1, 0].item() == pytest.approx(-2 / 3) and torch.equal(adv, ret)


def test_rloo_leave_one_out():
    rewards = torch.zeros(4, 2)
    rewards[:, -1] = T([1.0, 0.0, 0.0, 0.7])
    adv, _ = compute_rloo_outcome_advantage(rewards, torch.ones(4, 2), T([0, 0, 0, 1]))
    assert adv[0, 0].item() == pytest.approx(1.0 - 0.0)  # minus the mean of the others
    assert adv[1, 0].item() == pytest.approx(0.0 - 0.5)
    assert adv[3, 0].item() == pytest.approx(0.7)  # a singleton keeps its score


def test_reinforce_plus_plus_returns_reset_after_the_response():
    rewards, mask = T([[0, 1.0, 5.0], [0, 0, 1.0]]), T([[1, 1, 0], [1, 1, 1.0]])
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # row 0: t=2 masked: running = 5 (kept in returns) then reset to 0 -> t=1: 1, t=0: 0.5
    assert ret[0].tolist() == pytest.approx([0.5, 1.0, 5.0]) and ret[1].tolist() == pytest.approx([0.25, 0.5, 1.0])


def test_baseline_and_remax():
    rewards = torch.zeros(3, 2)
    rewards[:, -1] = T([1.0, 0.0, 0.5])
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, torch.ones(3, 2), T([0, 0, 1]))
    assert adv[0, 0] > 0 > adv[1, 0]
    adv, ret = compute_remax_outcome_advantage(rewards, T([0.5, 0.5, 0.5]), torch.ones(3, 2))
    assert adv[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.0]) and ret[0].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        get_estimator("ppo")


# -- KL ------------------------------------------------------------------------------------

def test_kl_estimators_by_hand():
    lp, ref = T([0.0]), T([math.log(0.5)])  # log p - log p_ref = log 2
    d = math.log(2)
    assert kl_penalty(lp, ref, "kl").item() == pytest.approx(d) and kl_penalty(lp, ref, "k1").item() == pytest.approx(d)
    assert kl_penalty(lp, ref, "abs").item() == pytest.approx(d)
    assert kl_penalty(lp, ref, "mse").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.5 + d - 1)  # r - log r - 1, r = 1/2
    assert kl_penalty(T([0.0]), T([100.0]), "k3").item() == 10.0  # clamped
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(lp, ref, "k4")


def test_straight_through_value_of_base_gradient_of_k2():
    lp = T([0.3], requires_grad=True)
    out = kl_penalty(lp, T([0.1]), "k3+")
    assert out.item() == pytest.approx(kl_penalty(T([0.3]), T([0.1]), "k3").item())
    out.backward()
    assert lp.grad.item() == pytest.approx(0.2)  # d/dlp 0.5 (lp - ref)^2


def test_kl_controllers_and_penalty():
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=1.0, n_steps=10)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    fixed = make_kl_controller("fixed", kl_coef=0.5)
    scores = T([[0.0, 1.0]])
    rewards, m = apply_kl_penalty(scores, T([[0.2, 0.4]]), T([[0.0, 0.0]]), torch.ones(1, 2), fixed, "kl")
    assert rewards[0].tolist() == pytest.approx([-0.1, 0.8])
    assert m == pytest.approx({"actor/reward_kl_penalty": 0.3, "actor/reward_kl_penalty_coeff": 0.5})
    assert isinstance(fixed, FixedKLController)


# -- losses --------------------------------------------------------------------------------

def test_policy_loss_worked_examples():
    one = torch.ones(1, 1)
    loss, m = policy_loss(T([[0.0]]), T([[0.5]]), T([[0.5]]), one)  # ratio e^0.5=1.65 clipped to 1.2
    assert loss.item() == pytest.approx(-0.6) and m["actor/pg_clipfrac"].item() == 1.0
    assert m["actor/ppo_kl"].item() == pytest.approx(-0.5)
    # negative advantage, huge ratio: dual-clip bounds the loss at -A * c = 0.5 * 3
    loss, m = policy_loss(T([[0.0]]), T([[5.0]]), T([[-0.5]]), one, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(1.5) and m["actor/pg_clipfrac_lower"].item() == 1.0
    # asymmetric clip: ratio 0.5 with A<0 clipped at 1 - 0.1
    loss, _ = policy_loss(T([[0.0]]), T([[math.log(0.5)]]), T([[-1.0]]), one, clip_ratio_low=0.1, clip_ratio_high=0.3)
    assert loss.item() == pytest.approx(0.9)
    # log-ratio clamp at 20 keeps the loss finite
    loss, _ = policy_loss(T([[0.0]]), T([[1000.0]]), T([[1.0]]), one)
    assert math.isfinite(loss.item())
    # masked tokens and importance weights
    loss, _ = policy_loss(T([[0.0, 0.0]]), T([[0.0, 9.0]]), T([[1.0, 7.0]]), T([[1.0, 0.0]]),
                          rollout_is_weights=T([[0.5, 1.0]]))
    assert loss.item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(T([[0.0]]), T([[0.0]]), T([[1.0]]), one, clip_ratio_c=1.0)


def test_value_loss_clipping():
    loss, clipfrac = value_loss(T([[2.0]]), T([[0.0]]), T([[1.0]]), torch.ones(1, 1), cliprange_value=0.5)
    # unclipped (2-0)^2 = 4, clipped (1.5-0)^2 = 2.25 -> 0.5 * max = 2
    assert loss.item() == pytest.approx(2.0) and clipfrac.item() == 0.0
    loss, clipfrac = value_loss(T([[0.0]]), T([[2.0]]), T([[1.0]]), torch.ones(1, 1), cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * 4.0) and clipfrac.item() == 0.0
    loss, clipfrac = value_loss(T([[1.8]]), T([[2.0]]), T([[1.0]]), torch.ones(1, 1), cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * 0.25) and clipfrac.item() == 1.0


def test_agg_modes_by_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1, 1, 0], [1, 1, 1.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(18 / 5)
    assert agg_loss(loss, mask, "token-sum").item() == pytest.approx(18)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(18 / (2 * 3))
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        agg_loss(loss, mask, "mean")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_and_dp_splits_give_the_whole_batch_loss_and_gradient(mode):
    gen = torch.Generator().manual_seed(0)
    loss_in = torch.randn(8, 5, generator=gen)
    mask = (torch.rand(8, 5, generator=gen) > 0.3).float()
    mask[:, 0] = 1
    mask[3] = 0  # an empty row
    mask[5, 2:] = 0  # left/right padding patterns
    whole_x = loss_in.clone().requires_grad_()
    whole = agg_loss(whole_x, mask, mode)
    whole.backward()
    counts = global_counts(mask)
    x = loss_in.clone().requires_grad_()
    dp_losses = []
    for rank_rows in (slice(0, 4), slice(4, 8)):  # 2 DP replicas
        rank_loss = 0
        for mb in range(rank_rows.start, rank_rows.stop, 2):  # micro-batches of 2
            rank_loss = rank_loss + agg_loss(x[mb:mb + 2], mask[mb:mb + 2], mode, **counts, horizon=5)
        dp_losses.append(rank_loss)
    total = sum(dp_losses)  # megappo's DDP sums gradients over DP
    total.backward()
    assert total.item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(x.grad, whole_x.grad, atol=1e-7)
    # with a DP wrapper that averages gradients, dp_size restores the sum
    avg = sum(agg_loss(loss_in[r], mask[r], mode, **counts, dp_size=2, horizon=5)
              for r in (slice(0, 4), slice(4, 8))) / 2
    assert avg.item() == pytest.approx(whole.item(), rel=1e-6)


def test_full_vocab_log_probs_and_entropy():
    logits = T([[[0.0, math.log(3.0)]]])
    assert log_probs_from_logits(logits, T([[1]])).item() == pytest.approx(math.log(0.75))
    assert entropy_from_logits(logits).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
