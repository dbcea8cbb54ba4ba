"""OPO, GPG, GRPO pass@k, GDPO, the optimal token baselines and the *_vectorized names against
step-by-step transcriptions of verl 0.9.1's loops (written out here, verl is never imported)
and against numbers worked out by hand."""

from collections import defaultdict

import numpy as np
import pytest
import torch

from megappo.trainer.step import last_action_token
from megappo.ppo.advantages import (
    ESTIMATORS, compute_advantage, compute_grpo_outcome_advantage, compute_rloo_outcome_advantage, estimator_inputs,
)
from megappo.ppo.advantages_extra import (
    compute_gdpo_outcome_advantage, compute_gpg_outcome_advantage, compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage, compute_optimal_token_baseline_advantage,
    compute_tir_optimal_token_baseline_advantage,
)
from megappo.ppo.stats import masked_whiten

T = torch.tensor
SEEDS = [0, 1, 2, 3]


# -- verl's loops, transcribed ------------------------------------------------------------------------

def ref_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl/trainer/ppo/core_algos.py::compute_grpo_outcome_advantage (the loop form)."""
    scores = token_level_rewards.sum(-1).clone()
    by_id = defaultdict(list)
    for i in range(len(scores)):
        by_id[index[i]].append(scores[i])
    mean, std = {}, {}
    for key, group in by_id.items():
        if len(group) == 1:
            mean[key], std[key] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean[key], std[key] = torch.stack(group).mean(), torch.stack(group).std()
    for i in range(len(scores)):
        centred = scores[i] - mean[index[i]]
        scores[i] = centred / (std[index[i]] + epsilon) if norm_adv_by_std_in_grpo else centred
    adv = scores.unsqueeze(-1) * response_mask
    return adv, adv


def ref_grpo_vectorized(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl/trainer/ppo/core_algos.py::compute_grpo_vectorized_outcome_advantage with
    verl/utils/groupwise.py::group_mean_std(eps=0.0): index_add sums, singletons mean 0 std 1."""
    scores = token_level_rewards.sum(-1)
    _, g = np.unique(np.asarray(index), return_inverse=True)
    g = torch.from_numpy(g)
    G = int(g.max()) + 1
    count = torch.zeros(G).index_add_(0, g, torch.ones_like(scores))
    mean = torch.zeros(G).index_add_(0, g, scores) / count.clamp_min(1.0)
    var = torch.zeros(G).index_add_(0, g, (scores - mean[g]) ** 2) / (count - 1).clamp_min(1.0)
    std = var.clamp(min=0.0).sqrt()
    mean[count <= 1], std[count <= 1] = 0.0, 1.0
    scalars = (scores - mean[g]) / (std[g] + epsilon) if norm_adv_by_std_in_grpo else scores - mean[g]
    adv = scalars.unsqueeze(-1) * response_mask
    return adv, adv


def ref_rloo_vectorized(token_level_rewards, response_mask, index):
    """verl/trainer/ppo/core_algos.py::compute_rloo_vectorized_outcome_advantage."""
    scores = token_level_rewards.sum(-1)
    inv = torch.from_numpy(np.unique(np.asarray(index), return_inverse=True)[1])
    c = torch.bincount(inv)[inv].to(scores.dtype)
    adv = ((c * scores - torch.bincount(inv, weights=scores)[inv]) / (c - 1).clamp_min(1)) * (c > 1)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def ref_opo(token_level_rewards, response_mask, index):
    """verl/trainer/ppo/core_algos.py::compute_opo_outcome_advantage."""
    lengths, scores = response_mask.sum(-1), token_level_rewards.sum(-1).clone()
    score_by_id, len_by_id, baseline = defaultdict(list), defaultdict(list), {}
    for i in range(len(scores)):
        score_by_id[index[i]].append(scores[i])
        len_by_id[index[i]].append(lengths[i])
    for key in score_by_id:
        if len(score_by_id[key]) == 1:
            baseline[key] = torch.tensor(0.0)
        else:
            s, n = torch.stack(score_by_id[key]), torch.stack(len_by_id[key])
            baseline[key] = (n * s).sum() / n.sum()
    for i in range(len(scores)):
        scores[i] = scores[i] - baseline[index[i]]
    adv = scores.unsqueeze(-1) * response_mask
    return adv, adv


def ref_gpg(token_level_rewards, response_mask, index, f_norm=1.0):
    """verl/trainer/ppo/core_algos.py::compute_gpg_outcome_advantage."""
    scores = token_level_rewards.sum(-1).clone()
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    by_id, mean = defaultdict(list), {}
    for i in range(len(scores)):
        by_id[index[i]].append(scores[i])
    for key, group in by_id.items():
        mean[key] = torch.tensor(0.0) if len(group) == 1 else torch.stack(group).mean()
    for i in range(len(scores)):
        scores[i] = alpha * (scores[i] - mean[index[i]]) / f_norm
    adv = scores.unsqueeze(-1) * response_mask
    return adv, adv


def ref_grpo_passk(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl/trainer/ppo/core_algos.py::compute_grpo_passk_outcome_advantage (config's
    norm_adv_by_std_in_grpo as an argument)."""
    scores = token_level_rewards.sum(-1)
    advantages = torch.zeros_like(scores)
    score_by_id, rows_by_id = defaultdict(list), defaultdict(list)
    for i in range(len(scores)):
        score_by_id[index[i]].append(scores[i])
        rows_by_id[index[i]].append(i)
    for key in score_by_id:
        rewards = torch.stack(score_by_id[key])
        if rewards.numel() < 2:
            raise ValueError("Pass@k requires at least 2 samples per group")
        top, top_at = torch.topk(rewards, 2)
        gap = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            gap = gap / (torch.std(rewards) + epsilon)
        advantages[rows_by_id[key][top_at[0].item()]] = gap
    adv = advantages.unsqueeze(-1) * response_mask
    return adv, adv


def ref_gdpo(token_level_rewards, response_mask, index, components=None, weights=None, epsilon=1e-6,
             norm_adv_by_std_in_grpo=True):
    """verl/trainer/ppo/core_algos.py::compute_gdpo_outcome_advantage: each component score goes
    onto one token of a zero [B, T] tensor (verl: the last valid token; here megappo's last action
    token), is GRPO-normalised, weighted, summed, whitened over the mask."""
    if components is None:
        score_list = [token_level_rewards]
    else:
        last = last_action_token(response_mask)
        score_list = []
        for k in range(components.shape[1]):
            placed = torch.zeros_like(response_mask, dtype=torch.float32)
            placed[torch.arange(len(last)), last] = components[:, k].float()
            score_list.append(placed)
    w = torch.ones(len(score_list)) if weights is None else torch.tensor(weights, dtype=torch.float32)
    total = None
    for k, scores in enumerate(score_list):
        normalised, _ = ref_grpo(scores, response_mask, index, epsilon, norm_adv_by_std_in_grpo)
        total = w[k] * normalised if total is None else total + w[k] * normalised
    adv = masked_whiten(total, response_mask) * response_mask
    return adv, adv


def _ref_otb_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights):
    returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights ** 2
    return returns, (w * response_mask).cumsum(-1)


def _ref_zero_tail(baselines, lengths, group_rows):
    ordered, _ = torch.sort(lengths)
    longest, second = int(ordered[-1].item()), int(ordered[-2].item())
    at_longest = (lengths == longest).nonzero(as_tuple=True)[0]
    if at_longest.numel() == 1 and longest > second:
        baselines[group_rows[int(at_longest[0])], second:] = 0.0


def ref_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None,
            handle_zero_tail=True, epsilon=1e-8):
    """verl/trainer/ppo/core_algos.py::compute_optimal_token_baseline_advantage."""
    returns, W = _ref_otb_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                 rollout_is_weights)
    groups = defaultdict(list)
    for i in range(len(returns)):
        groups[index[i]].append(i)
    baselines = torch.zeros_like(returns)
    for rows in groups.values():
        if len(rows) == 1:
            continue
        r, w, m = returns[rows], W[rows], response_mask[rows]
        baselines[rows] = ((r * w * m).sum(0) / ((w * m).sum(0) + epsilon)).unsqueeze(0).expand(len(rows), -1)
        if handle_zero_tail:
            _ref_zero_tail(baselines, m.sum(-1), rows)
    return (returns - baselines) * response_mask, returns


def ref_tir_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None,
                handle_zero_tail=True, epsilon=1e-8):
    """verl/trainer/ppo/core_algos.py::compute_multi_turn_optimal_token_baseline_advantage."""
    returns, W = _ref_otb_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                 rollout_is_weights)
    lengths = response_mask.sum(-1).long()
    L = int(lengths.max()) if lengths.numel() else 0
    packed_w, packed_r = W.new_zeros(len(lengths), L), W.new_zeros(len(lengths), L)
    for i in range(len(lengths)):
        if lengths[i] > 0:
            valid = response_mask[i].bool()
            packed_w[i, :lengths[i]], packed_r[i, :lengths[i]] = W[i, valid], returns[i, valid]
    groups = defaultdict(list)
    for i in range(len(lengths)):
        if lengths[i] > 0:
            groups[index[i]].append(i)
    baselines = torch.zeros_like(packed_r)
    for rows in groups.values():
        if len(rows) == 1:
            continue
        r, w = packed_r[rows], packed_w[rows]
        baselines[rows] = ((r * w).sum(0) / (w.sum(0) + epsilon)).to(baselines.dtype)
        if handle_zero_tail:
            _ref_zero_tail(baselines, lengths[rows], rows)
    packed_adv = packed_r - baselines
    adv = torch.zeros_like(returns)
    for i in range(len(lengths)):
        if lengths[i] > 0:
            adv[i, response_mask[i].bool()] = packed_adv[i, :lengths[i]]
    return adv * response_mask, returns


# -- random batches with every edge case --------------------------------------------------------------

def _batch(seed, T_len=12, dtype=torch.float32, singletons=True, empty_rows=True):
    """Groups of 1-5 samples (interleaved, string uids), right padding, masked middle spans,
    empty rows, tied and all-equal scores, dense per-token rewards on some rows."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [3, 2, 4, 5, 2] + ([1, 1] if singletons else [])
    B = sum(sizes)
    index = np.array([f"uid{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    index = index[torch.randperm(B, generator=gen).numpy()]
    lengths = torch.randint(1, T_len + 1, (B,), generator=gen)
    mask = (torch.arange(T_len) < lengths.unsqueeze(-1)).to(dtype)
    for row in range(0, B, 3):  # observation spans in the middle of some episodes
        start = int(torch.randint(0, T_len - 2, (1,), generator=gen))
        mask[row, start:start + 2] = 0
    if empty_rows:
        mask[1] = 0
        mask[B - 2] = 0
    scores = torch.randint(0, 3, (B,), generator=gen).to(dtype) / 2  # {0, 0.5, 1}: ties everywhere
    scores[index == "uid1"] = 0.5  # a group whose scores are all equal: std 0
    rewards = torch.zeros(B, T_len, dtype=dtype)
    rewards[torch.arange(B), last_action_token(mask)] = scores
    rewards[::4] += 0.1 * torch.randn(rewards[::4].shape, generator=gen, dtype=dtype)  # in-reward KL
    pi = torch.rand(B, T_len, generator=gen, dtype=dtype) * 0.95 + 0.05
    old_log_probs = pi.log() * mask  # megappo holds 0 on masked positions
    sum_pi_squared = pi ** 2 + (1 - pi) ** 2 * torch.rand(B, T_len, generator=gen, dtype=dtype)
    is_weights = (torch.rand(B, T_len, generator=gen, dtype=dtype) * 1.5 + 0.5) * mask
    components = torch.randint(0, 2, (B, 3), generator=gen).to(dtype)
    return dict(token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=old_log_probs,
                sum_pi_squared=sum_pi_squared, rollout_is_weights=is_weights, reward_components=components)


def _close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# -- against verl's loops ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_vectorized_is_grpo_and_equals_both_verl_forms(seed):
    b = _batch(seed)
    assert ESTIMATORS["grpo_vectorized"] is compute_grpo_outcome_advantage
    args = b["token_level_rewards"], b["response_mask"], b["index"]
    for norm in (True, False):
        ours = ESTIMATORS["grpo_vectorized"](*args, norm_adv_by_std_in_grpo=norm)
        for ref in (ref_grpo, ref_grpo_vectorized):
            expected = ref(*args, norm_adv_by_std_in_grpo=norm)
            _close(ours[0], expected[0]), _close(ours[1], expected[1])


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_vectorized_equals_verl_and_differs_from_rloo_only_on_singletons(seed):
    b = _batch(seed)
    args = b["token_level_rewards"], b["response_mask"], b["index"]
    ours, _ = ESTIMATORS["rloo_vectorized"](*args)
    _close(ours, ref_rloo_vectorized(*args)[0])
    loop, _ = compute_rloo_outcome_advantage(*args)
    singleton = torch.from_numpy(np.array([(b["index"] == key).sum() == 1 for key in b["index"]]))
    _close(ours[~singleton], loop[~singleton])
    assert ours[singleton].abs().max() == 0 and loop[singleton].abs().max() > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_opo_equals_verl(seed):
    b = _batch(seed)
    args = b["token_level_rewards"], b["response_mask"], b["index"]
    for ours, expected in zip(compute_opo_outcome_advantage(*args), ref_opo(*args)):
        _close(ours, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_gpg_equals_verl(seed):
    b = _batch(seed)
    args = b["token_level_rewards"], b["response_mask"], b["index"]
    for f_norm in (1.0, 2.5):
        for ours, expected in zip(compute_gpg_outcome_advantage(*args, f_norm=f_norm), ref_gpg(*args, f_norm=f_norm)):
            _close(ours, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_passk_equals_verl(seed):
    b = _batch(seed, singletons=False)
    args = b["token_level_rewards"], b["response_mask"], b["index"]
    for norm in (True, False):
        for eps in (1e-6, 0.1):
            ours = compute_grpo_passk_outcome_advantage(*args, epsilon=eps, norm_adv_by_std_in_grpo=norm)
            expected = ref_grpo_passk(*args, epsilon=eps, norm_adv_by_std_in_grpo=norm)
            _close(ours[0], expected[0]), _close(ours[1], expected[1])


@pytest.mark.parametrize("seed", SEEDS)
def test_gdpo_equals_verl(seed):
    b = _batch(seed)
    args = b["token_level_rewards"], b["response_mask"], b["index"]
    comps = b["reward_components"]
    cases = [(None, None), (comps, None), (comps, [1.0, 0.5, 2.0]), (comps[:, :1], [3.0])]
    for norm in (True, False):
        for components, weights in cases:
            ours = compute_gdpo_outcome_advantage(*args, reward_components=components,
                                                  reward_component_weights=weights, norm_adv_by_std_in_grpo=norm)
            expected = ref_gdpo(*args, components, weights, norm_adv_by_std_in_grpo=norm)
            _close(ours[0], expected[0], 2e-6), _close(ours[1], expected[1], 2e-6)


def _otb_args(b, with_is):
    return dict(token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"], index=b["index"],
                old_log_probs=b["old_log_probs"], sum_pi_squared=b["sum_pi_squared"],
                rollout_is_weights=b["rollout_is_weights"] if with_is else None)


@pytest.mark.parametrize("ours_fn,ref", [(compute_optimal_token_baseline_advantage, ref_otb),
                                         (compute_tir_optimal_token_baseline_advantage, ref_tir_otb)])
@pytest.mark.parametrize("seed", SEEDS)
def test_optimal_token_baselines_equal_verl(ours_fn, ref, seed):
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        b = _batch(seed, dtype=dtype)
        for with_is in (False, True):
            for zero_tail in (True, False):
                kwargs = dict(_otb_args(b, with_is), handle_zero_tail=zero_tail)
                ours, expected = ours_fn(**kwargs), ref(**kwargs)
                assert ours[0].dtype == dtype
                _close(ours[0], expected[0], tol), _close(ours[1], expected[1], tol)


# -- by hand ---------------------------------------------------------------------------------------------

def _outcome(scores, mask):
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(scores)), last_action_token(mask)] = T(scores)
    return rewards


def test_opo_by_hand():
    mask = T([[1, 1, 0.0], [1, 1, 1], [1, 0, 0]])
    adv, ret = compute_opo_outcome_advantage(_outcome([1.0, 0.0, 0.5], mask), mask, ["a", "a", "b"])
    # group a: lengths 2, 3 -> baseline (2 * 1 + 3 * 0) / 5 = 0.4; singleton b keeps its 0.5
    assert adv.tolist() == [pytest.approx([0.6, 0.6, 0.0]), pytest.approx([-0.4] * 3), [0.5, 0.0, 0.0]]
    assert torch.equal(adv, ret)


def test_opo_group_of_empty_responses_gets_zero_where_verl_gets_nan():
    mask = T([[1, 1.0], [0, 0], [0, 0]])
    args = _outcome([1.0, 0.0, 0.0], mask), mask, [0, 1, 1]
    adv, _ = compute_opo_outcome_advantage(*args)
    assert adv.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert ref_opo(*args)[0][1:].isnan().all()  # verl: 0 / 0 baseline, NaN * mask 0


def test_gpg_by_hand():
    mask = torch.ones(5, 2)
    adv, _ = compute_gpg_outcome_advantage(_outcome([1.0, 0.0, 1.0, 0.0, 0.5], mask), mask, [0, 0, 1, 1, 2])
    # 3 of 5 scores nonzero: alpha = 5 / 3; groups 0 and 1 have mean 0.5: 5/3 * +-0.5;
    # singleton 2: mean 0 -> 5/3 * 0.5
    assert adv[:, 0].tolist() == pytest.approx([5 / 6, -5 / 6, 5 / 6, -5 / 6, 5 / 6])
    adv, _ = compute_gpg_outcome_advantage(torch.zeros(2, 2), mask[:2], [0, 0], f_norm=2.0)
    assert adv.abs().max() == 0  # no nonzero score: alpha = 2 / max(0, 1)


def test_grpo_passk_by_hand():
    mask = T([[1, 1.0], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    rewards = _outcome([1.0, 0.0, 0.5, 1.0, 1.0, 0.0], mask)
    index = ["a", "a", "a", "b", "b", "b"]
    adv, ret = compute_grpo_passk_outcome_advantage(rewards, mask, index)
    # group a: best 1 (row 0), second 0.5, unbiased std of [1, 0, 0.5] = 0.5 -> 0.5 / (0.5 + 1e-6)
    # group b: rows 3 and 4 tie for the best: 1 - 1 = 0 for everyone
    assert adv[0].tolist() == pytest.approx([0.5 / (0.5 + 1e-6)] * 2)
    assert adv[1:].abs().max() == 0 and torch.equal(adv, ret)
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert adv[0].tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="at least 2 samples per group.*rollout.n"):
        compute_grpo_passk_outcome_advantage(rewards, mask, ["a", "a", "a", "b", "b", "c"])


def test_gdpo_by_hand():
    mask = torch.ones(2, 2)
    components = T([[1.0, 0.0], [0.0, 1.0]])
    adv, ret = compute_gdpo_outcome_advantage(torch.zeros(2, 2), mask, [0, 0], reward_components=components,
                                              reward_component_weights=[1.0, 2.0])
    # each component [1, 0] / [0, 1]: mean 0.5, std 1/sqrt(2) -> +-1 (up to epsilon);
    # weighted sum: row 0: 1 - 2 = -1, row 1: -1 + 2 = 1 on both tokens: [-1, -1, 1, 1]
    # whitened: mean 0, unbiased var 4/3 -> +-sqrt(3)/2
    assert adv.tolist() == [pytest.approx([-(3 ** 0.5) / 2] * 2, abs=1e-5), pytest.approx([3 ** 0.5 / 2] * 2, abs=1e-5)]
    assert torch.equal(adv, ret)
    with pytest.raises(ValueError, match="2 reward component.*3 weights"):
        compute_gdpo_outcome_advantage(torch.zeros(2, 2), mask, [0, 0], reward_components=components,
                                       reward_component_weights=[1.0, 2.0, 3.0])


def test_gdpo_without_components_is_whitened_grpo():
    mask = torch.ones(4, 3)
    rewards, index = _outcome([1.0, 0.0, 0.5, 0.2], mask), [0, 0, 1, 1]
    adv, _ = compute_gdpo_outcome_advantage(rewards, mask, index)
    _close(adv, masked_whiten(compute_grpo_outcome_advantage(rewards, mask, index)[0], mask))


def _pi_half(mask):
    # pi = 0.5 and sum pi^2 = 0.5 everywhere: w = 1 - 2 * 0.5 + 0.5 = 0.5 per action token
    return dict(old_log_probs=torch.full_like(mask, 0.5).log(), sum_pi_squared=torch.full_like(mask, 0.5))


def test_optimal_token_baseline_by_hand():
    mask = T([[1, 1, 1.0], [1, 1, 0]])
    rewards = _outcome([1.0, 0.0], mask)
    adv, ret = compute_optimal_token_baseline_advantage(rewards, mask, [0, 0], **_pi_half(mask))
    # returns: row 0 [1, 1, 1], row 1 [0, 0, 0]; W: row 0 [0.5, 1, 1.5], row 1 [0.5, 1, -]
    # baseline: col 0 (1 * 0.5) / 1 = 0.5, col 1 (1 * 1) / 2 = 0.5, col 2 (row 0 alone) 1.5 / 1.5 = 1,
    # but row 0 is the unique longest (3 > 2): its baseline is 0 from column 2 on
    assert ret.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert adv.tolist() == [pytest.approx([0.5, 0.5, 1.0]), pytest.approx([-0.5, -0.5, 0.0])]
    adv, _ = compute_optimal_token_baseline_advantage(rewards, mask, [0, 0], handle_zero_tail=False, **_pi_half(mask))
    assert adv[0].tolist() == pytest.approx([0.5, 0.5, 0.0], abs=1e-7)
    # a deterministic row (pi = 1, sum pi^2 = 1: w = 0) carries no weight: the baseline is row 0's return
    lp, sp = torch.zeros(2, 2), torch.ones(2, 2)
    lp[0], sp[0] = 0.5 ** 0.5, 0.5  # any row-0 weight > 0
    lp[0] = lp[0].log()
    adv, _ = compute_optimal_token_baseline_advantage(_outcome([1.0, 0.0], torch.ones(2, 2)), torch.ones(2, 2),
                                                      [0, 0], old_log_probs=lp, sum_pi_squared=sp)
    assert adv.tolist() == [pytest.approx([0.0, 0.0], abs=1e-6), pytest.approx([-1.0, -1.0], abs=1e-6)]


def test_tir_optimal_token_baseline_aligns_action_tokens_across_observations():
    # row 0: action, observation, action, action; row 1: action, action, padding
    mask = T([[1, 0, 1, 1.0], [1, 1, 0, 0]])
    rewards = _outcome([1.0, 0.0], mask)
    adv, ret = compute_tir_optimal_token_baseline_advantage(rewards, mask, [0, 0], **_pi_half(mask))
    # packed: row 0 returns [1, 1, 1], W [0.5, 1, 1.5]; row 1 returns [0, 0], W [0.5, 1]
    # baseline by action rank: 0.5, 0.5, then 0 (row 0 is the unique longest, 3 > 2)
    assert adv.tolist() == [pytest.approx([0.5, 0.0, 0.5, 1.0]), pytest.approx([-0.5, -0.5, 0.0, 0.0])]
    assert ret.tolist() == [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    # column by column instead, row 0's second action (column 2) meets row 1's padding
    adv, _ = compute_optimal_token_baseline_advantage(rewards, mask, [0, 0], handle_zero_tail=False,
                                                      **_pi_half(mask))
    assert adv[0].tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0], abs=1e-7)


def test_tir_drops_empty_trajectories_from_their_group():
    mask = T([[1, 1.0], [0, 0], [1, 1]])
    rewards = _outcome([1.0, 0.0, 0.0], mask)
    adv, _ = compute_tir_optimal_token_baseline_advantage(rewards, mask, [0, 0, 1], **_pi_half(mask))
    assert adv.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]  # row 0 is alone in group 0: no baseline
    adv, _ = compute_tir_optimal_token_baseline_advantage(torch.zeros(2, 0), torch.zeros(2, 0), [0, 0],
                                                          **_pi_half(torch.zeros(2, 0)))
    assert adv.shape == (2, 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_both_optimal_token_baselines_agree_on_right_padded_single_turn_responses(seed):
    b = _batch(seed)
    lengths = b["response_mask"].sum(-1, keepdim=True)
    b["response_mask"] = (torch.arange(b["response_mask"].shape[1]) < lengths).float()  # no observation spans
    args = _otb_args(b, with_is=True)
    _close(compute_tir_optimal_token_baseline_advantage(**args)[0], compute_optimal_token_baseline_advantage(**args)[0])


def test_optimal_token_baseline_ignores_nan_on_masked_tokens():
    mask = T([[1, 1, 0.0], [1, 1, 1]])
    inputs = dict(token_level_rewards=_outcome([1.0, 0.0], mask), response_mask=mask, index=[0, 0], **_pi_half(mask))
    clean = compute_optimal_token_baseline_advantage(**inputs)[0]
    inputs["sum_pi_squared"][0, 2] = float("nan")
    assert torch.equal(compute_optimal_token_baseline_advantage(**inputs)[0], clean)


# -- registry and dispatcher ------------------------------------------------------------------------------

def test_registry_inputs_and_missing_input_errors():
    assert {"opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline",
            "grpo_vectorized", "rloo_vectorized"} <= set(ESTIMATORS)
    outcome = ("token_level_rewards", "response_mask", "index")
    for name in ("opo", "gpg", "grpo_passk", "gdpo", "grpo_vectorized", "rloo_vectorized"):
        assert estimator_inputs(name) == outcome
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        assert estimator_inputs(name) == outcome + ("old_log_probs", "sum_pi_squared")
    b = _batch(0)
    given = dict(token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"], index=b["index"],
                 old_log_probs=b["old_log_probs"], values=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True)
    with pytest.raises(ValueError, match=r"'optimal_token_baseline' needs \['sum_pi_squared'\].*old-log-prob pass"):
        compute_advantage("optimal_token_baseline", **given)
    adv, _ = compute_advantage("tir_optimal_token_baseline", sum_pi_squared=b["sum_pi_squared"], **given)
    _close(adv, ref_tir_otb(**_otb_args(b, with_is=False))[0])
    adv, _ = compute_advantage("gdpo", reward_components=b["reward_components"], reward_component_weights=None,
                               **given)
    _close(adv, ref_gdpo(*(given[k] for k in outcome), b["reward_components"])[0])
