"""verl 0.9.1's other outcome estimators: OPO, GPG, GRPO pass@k, GDPO and the optimal token
baseline (plain and tool-integrated), vectorised over groups.

Owns these estimator functions; `megappo.ppo.advantages` registers them in `ESTIMATORS`
(its docstring table says what each computes) and owns the dispatcher.
Does not know about configs, process groups, reward functions or the actor: per-component
scores, sum_pi_squared and old log-probs come in as tensors.

Shape legend: [B, T] = (sequences, response tokens); [B] = one value per sequence;
[B, K] = one column per reward component; [G] = one value per group (prompt).
Inputs as in `megappo.ppo.advantages`; `index` [B] holds group ids (tensor, array or list of
hashables), and "score" is token_level_rewards summed over T. Every function returns
(advantages [B, T], returns [B, T]) and is tested against a step-by-step transcription of
verl's loop in tests/unit/test_ppo_advantages_extra.py.

Multi-turn masks (the optimal token baselines). In a megappo episode `response_mask` is 1 on the
model's action tokens of every turn and 0 on the observation tokens between turns and on the
right padding, which is what verl's agent loop puts in its `response_mask`. Both baselines use
only the action tokens: returns and the cumulative weight W are sums over action tokens.
`optimal_token_baseline` compares the trajectories of a group column by column (position t of
the response, observations included), as verl does. `tir_optimal_token_baseline` compares them
action token by action token: the r-th action token of one trajectory is baselined against the
r-th action tokens of the others, wherever observations pushed them, and trajectories without
any action token leave their group. For right-padded responses without observation spans the
two give the same numbers, except (with handle_zero_tail=False) in a group where all responses
but one are empty: `optimal_token_baseline` baselines that response against itself (advantage
~0), the TIR variant leaves it alone in its group (advantage = return).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from megappo.ppo.stats import masked_whiten


# -- vectorised group statistics --------------------------------------------------------------------

def _keys(index) -> list[Hashable]:
    return index.tolist() if hasattr(index, "tolist") else list(index)


def _group_index(index, device: torch.device) -> tuple[torch.Tensor, int]:
    """([B] long group number 0..G-1 in order of first appearance, G)."""
    keys = _keys(index)
    numbers: dict[Hashable, int] = {}
    gid = [numbers.setdefault(key, len(numbers)) for key in keys]
    return torch.tensor(gid, dtype=torch.long, device=device), len(numbers)


def _group_sum(values: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[B, ...] -> [G, ...] sums over the rows of each group."""
    return values.new_zeros((num_groups,) + values.shape[1:]).index_add_(0, gid, values)


def _group_mean_std(scores: torch.Tensor, gid: torch.Tensor, num_groups: int):
    """[B] or [B, K] scores -> per-row (group mean, unbiased group std, group size);
    singleton groups get mean 0, std 1 (verl's GRPO)."""
    size = _group_sum(torch.ones_like(scores[:, :1] if scores.dim() > 1 else scores), gid, num_groups)
    mean = _group_sum(scores, gid, num_groups) / size
    var = _group_sum((scores - mean[gid]) ** 2, gid, num_groups) / (size - 1).clamp(min=1)
    single = (size == 1)[gid]
    size = size[gid]
    return torch.where(single, 0.0, mean[gid]), torch.where(single, 1.0, var.sqrt()[gid]), size


def _grpo_normalised(scores: torch.Tensor, gid: torch.Tensor, num_groups: int, epsilon: float,
                     norm_adv_by_std_in_grpo: bool) -> torch.Tensor:
    mean, std, _ = _group_mean_std(scores, gid, num_groups)
    return (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean


# -- outcome estimators ---------------------------------------------------------------------------------

def compute_opo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index):
    """OPO (https://arxiv.org/abs/2505.23585): score - length-weighted group mean score,
    sum(len_i * score_i) / sum(len_i) with len = response_mask summed over T; a singleton
    keeps its score. A group whose responses are all empty gets 0 (verl: NaN on its masked tokens)."""
    with torch.no_grad():
        scores, length = token_level_rewards.sum(-1), response_mask.sum(-1).to(token_level_rewards.dtype)
        gid, G = _group_index(index, scores.device)
        num, den = _group_sum(length * scores, gid, G), _group_sum(length, gid, G)
        size = _group_sum(torch.ones_like(scores), gid, G)
        baseline = torch.where((size > 1) & (den > 0), num / den.clamp(min=torch.finfo(den.dtype).tiny), 0.0)
        advantages = (scores - baseline[gid]).unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_gpg_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                  f_norm: float = 1.0):
    """GPG (https://arxiv.org/abs/2504.02546): alpha * (score - group mean) / f_norm with
    alpha = B / (number of nonzero scores in the batch, at least 1); a singleton keeps its score
    (times alpha). verl's `alpha` argument is overwritten by that ratio, so it is not taken here."""
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        gid, G = _group_index(index, scores.device)
        mean, _, _ = _group_mean_std(scores, gid, G)
        advantages = (alpha * (scores - mean) / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_grpo_passk_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                         epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True):
    """GRPO pass@k (https://arxiv.org/abs/2503.19595): only the best response of each group
    gets an advantage, (best score - second best) / (group std + epsilon) (no division when
    `norm_adv_by_std_in_grpo=False`); every other response gets 0. A tie for the best gives 0 to
    everyone, whichever of the tied rows verl's topk picks. Groups need at least 2 samples."""
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        gid, G = _group_index(index, scores.device)
        mean, std, size = _group_mean_std(scores, gid, G)
        if bool((size < 2).any()):
            lonely = _keys(index)[int(torch.nonzero(size < 2)[0])]
            raise ValueError(f"advantage estimator 'grpo_passk' needs at least 2 samples per group, but group "
                             f"{lonely!r} has 1; set rollout.n >= 2")
        rows = torch.arange(scores.shape[0], device=scores.device)
        best = scores.new_full((G,), -torch.inf).scatter_reduce(0, gid, scores, "amax")
        is_best = scores == best[gid]
        first_best = torch.full((G,), scores.shape[0], device=scores.device).scatter_reduce(
            0, gid[is_best], rows[is_best], "amin")
        top = rows == first_best[gid]
        second = scores.new_full((G,), -torch.inf).scatter_reduce(0, gid[~top], scores[~top], "amax")
        gap = best[gid] - second[gid]
        if norm_adv_by_std_in_grpo:
            gap = gap / (std + epsilon)
        advantages = torch.where(top, gap, 0.0).unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_gdpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                   reward_components: torch.Tensor | None = None,
                                   reward_component_weights: Sequence[float] | None = None,
                                   epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True):
    """GDPO (https://arxiv.org/abs/2601.05242): GRPO-normalise each reward component within its
    group, sum them with `reward_component_weights` (default all 1), whiten the sum over the
    response mask. `reward_components` [B, K] holds each sample's score per component; None means
    one component, the score (token_level_rewards summed over T), as verl's fallback.

    verl writes each component score onto the last valid token of a zero [B, T] tensor and then
    sums it over T again, so where it sits never matters: the column is used as it is.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(-1, keepdim=True) if reward_components is None else reward_components
        if scores.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
            raise ValueError(f"reward_components must be [B, K] with B = {response_mask.shape[0]} rows, "
                             f"got shape {tuple(scores.shape)}")
        K = scores.shape[1]
        weights = [1.0] * K if reward_component_weights is None else list(reward_component_weights)
        if len(weights) != K:
            raise ValueError(f"gdpo has {K} reward component(s) but {len(weights)} weights "
                             f"(algorithm.gdpo_reward_weights): give one weight per component")
        gid, G = _group_index(index, scores.device)
        if reward_components is not None:
            scores = scores.float()  # verl reads the components as float32
        normalised = _grpo_normalised(scores, gid, G, epsilon, norm_adv_by_std_in_grpo)  # [B, K]
        w = torch.tensor(weights, dtype=torch.float32, device=scores.device)
        combined = (normalised * w).sum(-1, keepdim=True) * response_mask
        advantages = masked_whiten(combined, response_mask) * response_mask
    return advantages, advantages


# -- optimal token baselines -----------------------------------------------------------------------------

def _path_weights(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights):
    """[B, T] W_t = sum over action tokens j <= t of (1 - 2 pi_j + sum_v pi_v^2) (* rho_j^2):
    ||grad log pi(a_j)||^2 proxy; masked tokens add nothing, even when they hold NaN."""
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights ** 2
    return torch.where(response_mask.bool(), w * response_mask, 0.0).cumsum(-1)


def _group_baseline(returns, weights, gid, G, epsilon):
    """[B, L] per-position sum(G_t W_t) / (sum(W_t) + epsilon) over each group; 0 for singletons."""
    num, den = _group_sum(returns * weights, gid, G), _group_sum(weights, gid, G)
    size = _group_sum(torch.ones_like(returns[:, 0]), gid, G)
    return ((num / (den + epsilon)) * (size > 1).unsqueeze(-1).to(num.dtype))[gid]


def _zero_tail(baselines: torch.Tensor, lengths: torch.Tensor, gid: torch.Tensor, G: int) -> torch.Tensor:
    """verl's handle_zero_tail: in a group of >= 2 whose longest trajectory is unique, that
    trajectory's baseline is 0 from column (second-longest length) on."""
    lengths = lengths.floor()
    longest = lengths.new_full((G,), -torch.inf).scatter_reduce(0, gid, lengths, "amax")
    at_longest = lengths == longest[gid]
    n_longest = _group_sum(at_longest.to(lengths.dtype), gid, G)
    others = ~at_longest
    second = lengths.new_full((G,), -torch.inf).scatter_reduce(0, gid[others], lengths[others], "amax")
    unique = at_longest & (n_longest[gid] == 1) & (second[gid] > -torch.inf)
    cols = torch.arange(baselines.shape[1], device=baselines.device)
    tail = unique.unsqueeze(-1) & (cols >= second[gid].unsqueeze(-1))
    return baselines.masked_fill(tail, 0.0)


def compute_optimal_token_baseline_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                             old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                             rollout_is_weights: torch.Tensor | None = None,
                                             handle_zero_tail: bool = True, epsilon: float = 1e-8):
    """Optimal token baseline: returns G_t = reward-to-go over action tokens; advantage
    G_t - B_t with the per-column group baseline B_t = sum_i G_t W_t / (sum_i W_t + epsilon)
    over the group's trajectories valid at column t, W_t the cumulative path weight
    (`_path_weights`, times rollout_is_weights^2 when given). Singletons: B = 0.
    `old_log_probs` [B, T] (pi_t = exp of it) and `sum_pi_squared` [B, T] come from the same
    distribution: the actor's old-log-prob pass. Columns are compared as they are (see the
    module docstring); handle_zero_tail counts lengths as mask sums but cuts at a column index,
    as verl does (exact for right-padded single-turn responses)."""
    with torch.no_grad():
        mask = response_mask
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
        weights = _path_weights(mask, old_log_probs, sum_pi_squared, rollout_is_weights)
        gid, G = _group_index(index, returns.device)
        baselines = _group_baseline(returns, weights * mask, gid, G, epsilon)
        if handle_zero_tail:
            baselines = _zero_tail(baselines, mask.sum(-1).to(returns.dtype), gid, G)
        advantages = (returns - baselines) * mask
    return advantages, returns


def compute_tir_optimal_token_baseline_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                 index, old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                                 rollout_is_weights: torch.Tensor | None = None,
                                                 handle_zero_tail: bool = True, epsilon: float = 1e-8):
    """Tool-integrated (multi-turn) optimal token baseline: as `optimal_token_baseline`, but each
    trajectory's action tokens (response_mask = 1) are first packed to the left, so the baseline
    at action token r averages the group's r-th action tokens and observation spans do not
    misalign turns. Trajectories with no action token are dropped from their group (a group left
    with one trajectory has no baseline). handle_zero_tail cuts at the second-longest action count.
    Advantages go back to the action tokens; returns are the unpacked reward-to-go [B, T]."""
    with torch.no_grad():
        mask = response_mask
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
        weights = _path_weights(mask, old_log_probs, sum_pi_squared, rollout_is_weights)
        valid = mask.bool()
        lengths = valid.sum(-1)
        B, L = returns.shape[0], int(lengths.max()) if lengths.numel() else 0
        rows = torch.arange(B, device=returns.device).unsqueeze(-1).expand_as(valid)[valid]
        rank = (valid.cumsum(-1) - 1)[valid]
        packed_returns, packed_weights = returns.new_zeros(B, L), returns.new_zeros(B, L)
        packed_returns[rows, rank], packed_weights[rows, rank] = returns[valid], weights[valid]
        kept = torch.nonzero(lengths > 0).squeeze(-1)
        baselines = returns.new_zeros(B, L)
        if kept.numel():
            keys = _keys(index)
            gid, G = _group_index([keys[i] for i in kept.tolist()], returns.device)
            kept_baselines = _group_baseline(packed_returns[kept], packed_weights[kept], gid, G, epsilon)
            if handle_zero_tail:
                kept_baselines = _zero_tail(kept_baselines, lengths[kept].to(returns.dtype), gid, G)
            baselines[kept] = kept_baselines.to(returns.dtype)
        advantages = torch.zeros_like(returns)
        advantages[valid] = (packed_returns - baselines)[rows, rank]
        advantages = advantages * mask
    return advantages, returns


__all__: Sequence[str] = (
    "compute_gdpo_outcome_advantage", "compute_gpg_outcome_advantage", "compute_grpo_passk_outcome_advantage",
    "compute_opo_outcome_advantage", "compute_optimal_token_baseline_advantage",
    "compute_tir_optimal_token_baseline_advantage",
)
