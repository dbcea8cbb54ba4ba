"""Advantage estimators against hand-computed numbers and verl 0.9.1's reverse loops."""

import numpy as np
import pytest
import torch

from megappo.ppo.advantages import (
    ESTIMATORS, compute_advantage, compute_gae_advantage_return, compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage, compute_rloo_outcome_advantage, estimator_inputs, gae_fast, gae_reference,
    get_estimator, masked_discounted_scan, reinforce_plus_plus_returns_reference,
)

T = torch.tensor


# -- GAE -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("gae", [gae_reference, gae_fast])
def test_gae_worked_example(gae):
    # left-padded row: two response tokens at the end
    rewards, values, mask = T([[0, 0, 0, 1.0]]), T([[0.2, 0.3, 0.4, 0.5]]), T([[0, 0, 1, 1.0]])
    raw = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    # t=3: delta = 1 - 0.5 = 0.5; t=2: delta = 0.99 * 0.5 - 0.4 = 0.095, A = 0.095 + 0.99 * 0.95 * 0.5
    assert raw[0, 3].item() == pytest.approx(0.5)
    assert raw[0, 2].item() == pytest.approx(0.56525)
    assert raw[0, :2].tolist() == pytest.approx([0.56525, 0.56525])  # carried over the padding


def test_gae_advantages_whitened_returns_raw_plus_values():
    rewards, values, mask = T([[0, 0, 0, 1.0]]), T([[0.2, 0.3, 0.4, 0.5]]), T([[0, 0, 1, 1.0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    assert ret[0, 2:].tolist() == pytest.approx([0.96525, 1.0])
    # two tokens, mean 0.532625, unbiased std 0.046316: whitened to +-1/sqrt(2)
    assert adv[0, 2:].tolist() == pytest.approx([2 ** -0.5, -(2 ** -0.5)], abs=1e-4)


@pytest.mark.parametrize("gae", [gae_reference, gae_fast])
def test_gae_multi_turn_carries_next_value_and_lastgaelam_over_tool_tokens(gae):
    # [response, tool output (masked), response]: the masked token neither discounts nor resets
    rewards, values, mask = T([[0, 5.0, 1.0]]), T([[0.1, 9.0, 0.3]]), T([[1, 0, 1.0]])
    raw = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert raw[0, 2].item() == pytest.approx(0.7)  # 1 - 0.3
    assert raw[0, 1].item() == pytest.approx(0.7)  # carried; the reward 5 on the tool token is ignored
    # t=0: delta = 0 + 0.5 * 0.3 (next value skips the masked 9.0) - 0.1 = 0.05; A = 0.05 + 0.25 * 0.7
    assert raw[0, 0].item() == pytest.approx(0.225)


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.5, 0.5), (0.0, 0.9), (1.0, 0.0), (0.9, 0.01)])
def test_gae_fast_path_equals_reverse_loop(gamma, lam):
    gen = torch.Generator().manual_seed(1)
    B, L = 6, 700
    rewards, values = torch.randn(B, L, generator=gen, dtype=torch.float64), torch.randn(B, L, generator=gen,
                                                                                         dtype=torch.float64)
    mask = (torch.rand(B, L, generator=gen) > 0.2).double()
    mask[0] = 0  # an empty row
    mask[1, :300] = 0  # left padding
    mask[2, -300:] = 0  # right padding
    mask[3, 100:200] = 0  # a tool-output span in the middle
    ref, fast = gae_reference(rewards, values, mask, gamma, lam), gae_fast(rewards, values, mask, gamma, lam)
    assert torch.allclose(fast, ref, rtol=1e-10, atol=1e-10)
    assert fast.dtype == torch.float64
    ref32 = gae_reference(rewards.float(), values.float(), mask.float(), gamma, lam)
    fast32 = gae_fast(rewards.float(), values.float(), mask.float(), gamma, lam)
    assert fast32.dtype == torch.float32 and torch.allclose(fast32, ref32, rtol=1e-4, atol=1e-4)


def test_masked_scan_chunks_for_small_decay_stay_finite_and_exact():
    gen = torch.Generator().manual_seed(2)
    x, mask = torch.randn(2, 3000, generator=gen, dtype=torch.float64), torch.ones(2, 3000, dtype=torch.float64)
    y = masked_discounted_scan(x, mask, 0.05)  # 0.05^3000 underflows: chunks of ~260 tokens
    ref = reinforce_plus_plus_returns_reference(x, mask, 0.05)
    assert torch.isfinite(y).all() and torch.allclose(y, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=">= 0"):
        masked_discounted_scan(x, mask, -0.5)


def test_gae_non_binary_mask_falls_back_to_the_loop():
    rewards, values, mask = T([[0, 1.0]]), T([[0.2, 0.4]]), T([[0.5, 1.0]])
    assert torch.equal(gae_fast(rewards, values, mask, 0.9, 0.9), gae_reference(rewards, values, mask, 0.9, 0.9))


# -- group estimators ----------------------------------------------------------------------------

def _outcome(scores, length=3):
    rewards = torch.zeros(len(scores), length)
    rewards[:, -1] = T(scores)
    return rewards


def test_grpo_groups_unbiased_std_and_singletons():
    rewards, mask = _outcome([1.0, 0.0, 1.0, 1.0, 0.5]), torch.ones(5, 3)
    mask[1, 2] = 0  # masked tokens get 0 advantage
    index = np.array(["a", "a", "a", "b", "c"], dtype=object)  # verl's string uids
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index)
    std = (1 / 3) ** 0.5  # unbiased std of [1, 0, 1]
    assert adv[0].tolist() == pytest.approx([(1 - 2 / 3) / (std + 1e-6)] * 3, rel=1e-6)
    assert adv[1].tolist() == pytest.approx([-(2 / 3) / (std + 1e-6)] * 2 + [0.0], rel=1e-6)
    assert adv[3].tolist() == pytest.approx([1 / (1 + 1e-6)] * 3)  # singleton: mean 0, std 1
    assert adv[4].tolist() == pytest.approx([0.5 / (1 + 1e-6)] * 3)
    assert torch.equal(adv, ret)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert adv[0, 0].item() == pytest.approx(1 / 3) and adv[4, 0].item() == 0.5
    adv, _ = compute_grpo_outcome_advantage(_outcome([1.0, 1.0]), torch.ones(2, 3), [7, 7], epsilon=0.5)
    assert adv.abs().max().item() == 0.0  # equal scores: std 0, epsilon avoids 0 / 0


def test_rloo_leave_one_out_and_singleton():
    adv, ret = compute_rloo_outcome_advantage(_outcome([1.0, 0.0, 0.0, 0.7], 2), torch.ones(4, 2), T([0, 0, 0, 1]))
    assert adv[:, 0].tolist() == pytest.approx([1.0, -0.5, -0.5, 0.7])  # score - mean of the others
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_carries_return_over_masked_tokens_without_discount():
    rewards = T([[0.0, 3.0, 0.0, 1.0], [0.0, 1.0, 5.0, 0.0]])
    mask = T([[1, 0, 1, 1.0], [1, 1, 0, 0.0]])
    for returns in (reinforce_plus_plus_returns_reference(rewards, mask, 0.5),
                    compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)[1]):
        # row 0: t3: 1; t2: 0 + 0.5 * 1 = 0.5; t1 masked: 0 (its reward 3 is dropped, 0.5 carried); t0: 0.25
        # row 1: the masked tail (reward 5) contributes nothing: t1: 1, t0: 0.5
        assert returns.tolist() == [pytest.approx([0.25, 0.0, 0.5, 1.0]), pytest.approx([0.5, 1.0, 0.0, 0.0])]
    adv, _ = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    valid = T([0.25, 0.5, 1.0, 0.5, 1.0])
    expected = (valid - valid.mean()) / valid.std()
    assert adv[mask.bool()].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert adv[~mask.bool()].tolist() == [0.0, 0.0, 0.0]


def test_reinforce_plus_plus_fast_returns_equal_the_loop():
    gen = torch.Generator().manual_seed(3)
    rewards, mask = torch.randn(5, 400, generator=gen), (torch.rand(5, 400, generator=gen) > 0.3).float()
    _, fast = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.97)
    assert torch.allclose(fast, reinforce_plus_plus_returns_reference(rewards, mask, 0.97), atol=1e-5)


def test_reinforce_plus_plus_baseline_by_hand():
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(
        _outcome([1.0, 0.0, 0.5], 2), T([[1, 1], [1, 0], [1, 1.0]]), ["p", "p", "q"])
    # centred scores 0.5, -0.5, 0.5 (singleton mean 0) on 5 valid tokens: [.5, .5, -.5, .5, .5]
    valid = T([0.5, 0.5, -0.5, 0.5, 0.5])
    expected = ((valid - valid.mean()) / valid.std()).tolist()
    assert [adv[0, 0], adv[0, 1], adv[1, 0], adv[2, 0], adv[2, 1]] == pytest.approx(expected, abs=1e-5)
    assert adv[1, 1].item() == 0.0 and torch.equal(adv, ret)


def test_remax_by_hand():
    rewards = T([[0.0, 1.0, 9.0], [0.5, 0.0, 0.5]])
    mask = T([[1, 1, 0], [1, 1, 1.0]])
    adv, ret = compute_remax_outcome_advantage(rewards, T([0.25, 1.0]), mask)
    assert ret.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.5, 0.5]]
    assert adv.tolist() == [[0.75, 0.75, 0.0], [0.0, -0.5, -0.5]]


# -- registry ------------------------------------------------------------------------------------

def test_registry_and_compute_advantage_by_name():
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"} <= set(ESTIMATORS)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'gae'"):
        get_estimator("ppo")
    assert estimator_inputs("gae") == ("token_level_rewards", "values", "response_mask")
    assert estimator_inputs("grpo") == ("token_level_rewards", "response_mask", "index")
    rewards, mask, values = _outcome([1.0, 0.0]), torch.ones(2, 3), torch.zeros(2, 3)
    everything = dict(token_level_rewards=rewards, response_mask=mask, values=values, index=[0, 0], gamma=1.0,
                      lam=1.0, norm_adv_by_std_in_grpo=True, reward_baselines=None)
    adv, _ = compute_advantage("grpo", **everything)
    assert torch.equal(adv, compute_grpo_outcome_advantage(rewards, mask, [0, 0])[0])
    adv, _ = compute_advantage("gae", **everything)
    assert torch.equal(adv, compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)[0])
    with pytest.raises(ValueError, match=r"'remax' needs \['reward_baselines'\]"):
        compute_advantage("remax", **everything)


def test_each_estimator_requires_what_its_spec_declares(monkeypatch):
    """megappo.ppo.specs declares what an estimator needs from the step (the config and the orchestrator read
    it); the registry's functions are checked against it at import: a spec that leaves out a required input,
    or an estimator without a spec, is refused naming the estimator."""
    from megappo.ppo import advantages
    from megappo.ppo.specs import ESTIMATOR_SPECS, EstimatorSpec, estimator_spec

    assert estimator_spec("gae").critic and estimator_spec("remax").greedy_baseline
    assert estimator_spec("gdpo").components and estimator_spec("optimal_token_baseline").sum_pi_squared
    assert [n for n, s in ESTIMATOR_SPECS.items() if s.grouped] == [
        "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus_baseline", "opo", "gpg",
        "grpo_passk", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"]
    advantages._check_specs()
    monkeypatch.setitem(advantages.ESTIMATOR_SPECS, "gae", EstimatorSpec())
    with pytest.raises(RuntimeError, match=r"estimator 'gae' requires \['values'\], but its spec declares \[\]"):
        advantages._check_specs()
    monkeypatch.setitem(advantages.ESTIMATOR_SPECS, "gae", EstimatorSpec(critic=True))
    monkeypatch.setitem(advantages.ESTIMATOR_SPECS, "new_one", EstimatorSpec())
    with pytest.raises(RuntimeError, match=r"without a spec or a function: \['new_one'\]"):
        advantages._check_specs()
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        estimator_spec("ppo")
