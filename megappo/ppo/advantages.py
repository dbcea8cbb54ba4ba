"""Advantage estimators (verl 0.9.1 semantics), chosen by name from `ESTIMATORS`.

Each returns (advantages [B, T], returns [B, T]) from token-level rewards [B, T] (the
sequence score on the last response token, minus any in-reward KL) and the response mask.

| name | advantages |
|---|---|
| gae | GAE(gamma, lam) with values; returns = raw advantages + values; advantages whitened over the mask |
| grpo | (score - group mean) / (group std + eps) (unbiased std; a singleton group has mean 0, std 1); `norm_adv_by_std_in_grpo=False` only subtracts the mean |
| rloo | score * n/(n-1) - group mean * n/(n-1) (leave-one-out); a singleton keeps its score |
| reinforce_plus_plus | discounted return-to-go (reset after the last response token), whitened |
| reinforce_plus_plus_baseline | score - group mean, broadcast over the response, whitened over the batch |
| remax | return-to-go - the greedy sample's reward (`reward_baselines`) |

Groups are the samples of one prompt (`index` [B], equal values = same prompt).
This module does not know about configs or process groups.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from megappo.ppo.stats import masked_whiten


def gae_reference(token_level_rewards, values, response_mask, gamma: float, lam: float):
    """The plain reverse loop, kept as the obviously-correct reference for the fast path."""
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[1])):
        m = response_mask[:, t].to(values.dtype)
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        new_gae = delta + gamma * lam * last_gae
        # across masked positions carry nextvalue and lastgaelam unchanged
        next_value = values[:, t] * m + (1 - m) * next_value
        last_gae = new_gae * m + (1 - m) * last_gae
        reversed_adv.append(last_gae)
    return torch.stack(reversed_adv[::-1], dim=1)


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma: float = 1.0, lam: float = 1.0):
    with torch.no_grad():
        advantages = gae_reference(token_level_rewards, values, response_mask, gamma, lam)
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def _group_stats(scores: torch.Tensor, index: torch.Tensor):
    groups: dict[int, list[int]] = defaultdict(list)
    for i, key in enumerate(index.tolist()):
        groups[key].append(i)
    mean = torch.zeros_like(scores)
    std = torch.ones_like(scores)
    size = torch.ones_like(scores)
    for rows in groups.values():
        if len(rows) > 1:
            group = scores[rows]
            mean[rows] = group.mean()
            std[rows] = group.std()
            size[rows] = len(rows)
    return mean, std, size


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                   norm_adv_by_std_in_grpo: bool = True):
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean, std, _ = _group_stats(scores, index)
        scores = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
        advantages = scores.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index):
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean, _, n = _group_stats(scores, index)
        loo = torch.where(n > 1, scores * n / (n - 1).clamp(min=1) - mean * n / (n - 1).clamp(min=1), scores)
        advantages = loo.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma: float = 1.0):
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * response_mask[:, t]  # reset after the end of the response
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index):
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean, _, _ = _group_stats(scores, index)
        scores = (scores - mean).unsqueeze(-1) * response_mask
        advantages = masked_whiten(scores, response_mask) * response_mask
    return advantages, advantages


def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask):
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


ESTIMATORS = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
}


def get_estimator(name: str):
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator '{name}'; choose from {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]
