"""Advantage estimators with verl 0.9.1 semantics, chosen by name from `ESTIMATORS`.

Owns: GAE (a vectorised fast path and the plain reverse loop it is tested against),
GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, ReMax, the `ESTIMATORS` registry (which also
holds OPO, GPG, GRPO pass@k, GDPO and the optimal token baselines of
`megappo.ppo.advantages_extra`), and `compute_advantage`, which calls an estimator by name
with the inputs it declares. What each estimator needs from the step (a critic, groups, a
greedy baseline, sum pi^2, reward components) is its entry in megappo.ppo.specs.ESTIMATOR_SPECS,
checked against the function's required inputs at import.
Does not know about configs, process groups or where the rewards came from.

Shape legend: [B, T] = (sequences, response tokens); [B] = one value per sequence;
[B, K] = one column per reward component.
Every estimator returns (advantages [B, T], returns [B, T]). Inputs:
  token_level_rewards [B, T]  the sequence score on its last response token, minus any in-reward KL
  response_mask       [B, T]  1 on tokens the policy generated; 0 on padding and on tool /
                              observation tokens of multi-turn rollouts (may sit in the middle)
  values              [B, T]  critic values (gae)
  index               [B]     group id per sequence (a tensor, array or list of hashables):
                              equal ids = samples of the same prompt (verl's `uid`)
  reward_baselines    [B]     reward of the greedy sample (remax)
  reward_components   [B, K]  each sample's score per reward component (gdpo; None: K = 1, the score)
  reward_component_weights    K floats (gdpo, verl's algorithm.gdpo_reward_weights; None: all 1)
  old_log_probs       [B, T]  log pi_old(a_t) from the actor's old-log-prob pass (otb)
  sum_pi_squared      [B, T]  sum over the vocabulary of pi_old(v)^2 at the same positions, from
                              the same (temperature-scaled) distribution as old_log_probs (otb)
  rollout_is_weights  [B, T]  optional truncated IS weights rho; otb scales its weights by rho^2
and scalars gamma, lam, epsilon, norm_adv_by_std_in_grpo, f_norm (gpg), handle_zero_tail (otb).

| name | inputs besides token_level_rewards, response_mask | advantages | returns |
|---|---|---|---|
| gae | values; gamma, lam | GAE(gamma, lam); masked tokens carry nextvalue and lastgaelam unchanged; whitened over the mask | raw advantages + values |
| grpo, grpo_vectorized | index; epsilon, norm_adv_by_std_in_grpo | (score - group mean) / (group std + epsilon), unbiased std; singleton: mean 0, std 1; `norm_adv_by_std_in_grpo=False` only subtracts the mean | = advantages |
| rloo | index | (score - mean of the other samples) = n/(n-1) (score - group mean); a singleton keeps its score | = advantages |
| rloo_vectorized | index | as rloo, but a singleton gets 0 (verl's vectorised form) | = advantages |
| reinforce_plus_plus | gamma | returns whitened over the mask, times the mask | discounted return-to-go; masked tokens carry it without discount and get 0 |
| reinforce_plus_plus_baseline | index | (score - group mean, singleton mean 0) on every response token, whitened over the mask | = advantages |
| remax | reward_baselines | return-to-go - reward_baselines on response tokens | undiscounted return-to-go of rewards * mask |
| opo | index | score - sum(len * score) / sum(len) over the group, len = mask sum; singleton: score | = advantages |
| gpg | index; f_norm | alpha (score - group mean) / f_norm, alpha = B / max(1, #nonzero scores in the batch); singleton mean 0 | = advantages |
| grpo_passk | index; epsilon, norm_adv_by_std_in_grpo | best of the group: (best - second best) / (group std + epsilon); all others 0; groups of >= 2 | = advantages |
| gdpo | index, reward_components?, reward_component_weights?; epsilon, norm_adv_by_std_in_grpo | sum_k w_k grpo(component k), whitened over the mask | = advantages |
| optimal_token_baseline | index, old_log_probs, sum_pi_squared, rollout_is_weights?; handle_zero_tail, epsilon | G_t - B_t, B_t = sum_group G_t W_t / (sum_group W_t + epsilon) per column t, W_t = cumulative sum over action tokens of (1 - 2 pi + sum pi^2) rho^2; singleton B = 0 | undiscounted return-to-go G of rewards * mask |
| tir_optimal_token_baseline | as optimal_token_baseline | the same per action-token rank (observation spans squeezed out, empty trajectories left out of the group) | as optimal_token_baseline |

"score" is token_level_rewards summed over T. Outcome estimators mask their output with
`response_mask`; GAE does not (verl): masked positions hold the carried, whitened value.

What differs from verl 0.9.1 (every estimator is otherwise verl's function, tested against
a transcription of its loop):
  - verl's trainer calls grpo_vectorized and gdpo without norm_adv_by_std_in_grpo (so with
    True); here they take it like grpo does. epsilon is never passed by verl's trainer.
  - grpo_passk takes norm_adv_by_std_in_grpo as an argument (verl reads config).
  - gdpo takes the component scores as a [B, K] tensor, not as non_tensor_batch keys plus the
    attention mask; the numbers are the same (see its docstring).
  - opo: a group whose responses are all empty gets 0 where verl gets NaN (0 / 0 baseline) on
    its masked tokens. gpg does not take verl's `alpha` argument, which verl overwrites.
  - the optimal token baselines drop NaN/inf at masked positions of old_log_probs,
    sum_pi_squared and rollout_is_weights (verl multiplies by the mask: NaN stays NaN).
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Hashable, Sequence

import torch

from megappo.ppo.advantages_extra import (
    compute_gdpo_outcome_advantage, compute_gpg_outcome_advantage, compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage, compute_optimal_token_baseline_advantage,
    compute_tir_optimal_token_baseline_advantage,
)
from megappo.ppo.specs import ESTIMATOR_SPECS, estimator_spec
from megappo.ppo.stats import masked_whiten

# -- GAE and the masked discounted scan ---------------------------------------------------------

# decay**k stays within 1e+-150 inside a chunk, so float64 neither overflows nor underflows
_LOG_RANGE = 150 * math.log(10)


def _by_valid_rank(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T + 1]: column r holds the value at the row's r-th valid position
    (0-based), zero beyond the row's count of valid positions."""
    B, T = values.shape
    m = mask.to(torch.long)
    rank = torch.where(m.bool(), torch.cumsum(m, dim=1) - m, torch.full_like(m, T))
    compact = values.new_zeros(B, T + 1).scatter_(1, rank, values)
    compact[:, T] = 0  # every masked position was scattered here
    return compact


def _valid_counts(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] valid positions before t, [B, T] valid positions up to and including t)."""
    m = mask.to(torch.long)
    inclusive = torch.cumsum(m, dim=1)
    return inclusive - m, inclusive


def masked_discounted_scan(x: torch.Tensor, mask: torch.Tensor, decay: float) -> torch.Tensor:
    """[B, T] -> [B, T] float64: y_t = x_t + decay * y_{t+1} where mask_t = 1, y_t = y_{t+1}
    where mask_t = 0 (carried without decay), y_T = 0. `mask` must be binary, decay >= 0.

    Vectorised. In reversed time s (s = T - 1 - t) the recurrence runs forward and
      y_s = decay^c_s * sum_{j <= s} decay^(-c_j) * m_j * x_j,   c = inclusive valid count,
    i.e. one cumsum. It is evaluated in float64 over chunks short enough that decay^(+-c)
    stays within 1e+-150, with y at the end of one chunk carried into the next (times
    decay^c). Inside the cumsum the largest weight belongs to the latest term, so nothing
    large cancels: the error is float64 rounding relative to |y|. With gamma * lam near 1
    (the usual case) a row of 4096 tokens is one chunk. decay = 0 means y_t = x at the
    first valid position at or after t, which is gathered directly.
    """
    if decay < 0:
        raise ValueError(f"discount factors must be >= 0 (gamma, lam), got decay {decay}")
    x, m = x.double() * mask, mask.double()
    B, T = x.shape
    if decay == 0:
        before, _ = _valid_counts(mask)
        return _by_valid_rank(x, mask).gather(1, before)
    chunk = T if decay == 1 else max(1, min(T, int(_LOG_RANGE / abs(math.log(decay)))))
    xr, mr = x.flip(1), m.flip(1)
    out = torch.empty_like(xr)
    carry = xr.new_zeros(B, 1)
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        scale = torch.pow(decay, torch.cumsum(mr[:, start:end], dim=1))
        y = (torch.cumsum(xr[:, start:end] / scale, dim=1) + carry) * scale
        out[:, start:end] = y
        carry = y[:, -1:]
    return out.flip(1)


def _next_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: values at the first valid position after t (0 if there is none)."""
    _, up_to = _valid_counts(mask)
    return _by_valid_rank(values, mask).gather(1, up_to)


def _is_binary(mask: torch.Tensor) -> bool:
    return mask.dtype == torch.bool or bool(((mask == 0) | (mask == 1)).all())


def gae_reference(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                  gamma: float, lam: float) -> torch.Tensor:
    """[B, T] raw (unwhitened) GAE by the plain reverse loop over T, exactly verl's recursion:
    masked positions carry nextvalue and lastgaelam unchanged. The obviously-correct reference."""
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        new_gae = delta + gamma * lam * last_gae
        next_value = values[:, t] * m + (1 - m) * next_value
        last_gae = new_gae * m + (1 - m) * last_gae
        reversed_adv.append(last_gae)
    return torch.stack(reversed_adv[::-1], dim=1)


def gae_fast(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
             gamma: float, lam: float) -> torch.Tensor:
    """[B, T] raw GAE without a Python loop over T (see `masked_discounted_scan`), in the
    dtype of `values`. Equal to `gae_reference` up to rounding; non-binary masks use it."""
    if not _is_binary(response_mask):
        return gae_reference(token_level_rewards, values, response_mask, gamma, lam)
    v = values.double()
    delta = token_level_rewards.double() + gamma * _next_valid(v, response_mask) - v
    return masked_discounted_scan(delta, response_mask, gamma * lam).to(values.dtype)


def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor,
                                 response_mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0):
    """GAE: returns = raw advantages + values; advantages = raw whitened over the mask."""
    with torch.no_grad():
        raw = gae_fast(token_level_rewards, values, response_mask, gamma, lam)
        returns = raw + values
        advantages = masked_whiten(raw, response_mask)
    return advantages, returns


# -- group (outcome) estimators -----------------------------------------------------------------

def _groups(index) -> list[list[int]]:
    """Row lists per group id, in order of first appearance."""
    keys = index.tolist() if hasattr(index, "tolist") else list(index)
    groups: dict[Hashable, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def _group_mean_std_size(scores: torch.Tensor, index):
    """[B] group mean, unbiased std, size; singleton groups get mean 0, std 1 (verl)."""
    mean, std, size = torch.zeros_like(scores), torch.ones_like(scores), torch.ones_like(scores)
    for rows in _groups(index):
        if len(rows) > 1:
            group = scores[rows]
            mean[rows], std[rows], size[rows] = group.mean(), group.std(), float(len(rows))
    return mean, std, size


def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                   epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True):
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean, std, _ = _group_mean_std_size(scores, index)
        scores = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
        advantages = scores.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index):
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean, _, n = _group_mean_std_size(scores, index)
        scale = n / (n - 1).clamp(min=1)
        scores = torch.where(n > 1, scores * scale - mean * scale, scores)
        advantages = scores.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_rloo_vectorized_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index):
    """verl's rloo_vectorized: rloo, except that a singleton group gets 0, not its score."""
    with torch.no_grad():
        advantages, _ = compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)
        _, _, n = _group_mean_std_size(token_level_rewards.sum(-1), index)
        advantages = advantages * (n > 1).unsqueeze(-1)
    return advantages, advantages


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: torch.Tensor,
                                                           response_mask: torch.Tensor, index):
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean, _, _ = _group_mean_std_size(scores, index)
        scores = (scores - mean).unsqueeze(-1).expand_as(token_level_rewards) * response_mask
        advantages = masked_whiten(scores, response_mask) * response_mask
    return advantages, advantages


def reinforce_plus_plus_returns_reference(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                          gamma: float) -> torch.Tensor:
    """[B, T] REINFORCE++ returns by verl's reverse loop (the reference for the fast path)."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        new_running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = new_running * mask[:, t]
        running = new_running * mask[:, t] + running * (1 - mask[:, t])
    return returns


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  gamma: float = 1.0):
    with torch.no_grad():
        if _is_binary(response_mask):
            scan = masked_discounted_scan(token_level_rewards, response_mask, gamma)
            returns = scan.to(token_level_rewards.dtype) * response_mask
        else:
            returns = reinforce_plus_plus_returns_reference(token_level_rewards, response_mask, gamma)
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor,
                                    response_mask: torch.Tensor):
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


# -- registry --------------------------------------------------------------------------------------

ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "grpo_vectorized": compute_grpo_outcome_advantage,  # verl's vectorised form: the same numbers
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    "gdpo": compute_gdpo_outcome_advantage,
    "optimal_token_baseline": compute_optimal_token_baseline_advantage,
    "tir_optimal_token_baseline": compute_tir_optimal_token_baseline_advantage,
}

# where a caller gets the inputs that not every trainer step has
_INPUT_SOURCES = {
    "values": "critic values: enable the critic",
    "reward_baselines": "the reward of each prompt's greedy sample",
    "old_log_probs": "the actor's old-log-prob pass",
    "sum_pi_squared": "sum over the vocabulary of pi^2 per response token, from the actor's old-log-prob pass",
    "index": "the prompt each sample came from",
}


# each estimator's keyword names and required ones, read from its signature once, here
_PARAMS = {name: inspect.signature(fn).parameters for name, fn in ESTIMATORS.items()}
_REQUIRED = {name: tuple(p.name for p in params.values() if p.default is inspect.Parameter.empty)
             for name, params in _PARAMS.items()}


def _check_specs() -> None:
    """The functions registered here are the estimators megappo.ppo.specs declares, each requiring
    exactly the inputs its spec says (what the config and the orchestrator provide from the spec)."""
    if set(ESTIMATORS) != set(ESTIMATOR_SPECS):
        raise RuntimeError(f"advantage estimators without a spec or a function: "
                           f"{sorted(set(ESTIMATORS) ^ set(ESTIMATOR_SPECS))} (megappo.ppo.specs.ESTIMATOR_SPECS)")
    for name, required in _REQUIRED.items():
        extra = set(required) - {"token_level_rewards", "response_mask"}
        if extra != ESTIMATOR_SPECS[name].inputs:
            raise RuntimeError(f"advantage estimator '{name}' requires {sorted(extra)}, but its spec declares "
                               f"{sorted(ESTIMATOR_SPECS[name].inputs)} (megappo.ppo.specs.ESTIMATOR_SPECS)")


_check_specs()


def get_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    estimator_spec(name)  # a ValueError naming the choices
    return ESTIMATORS[name]


def estimator_inputs(name: str) -> tuple[str, ...]:
    """The inputs an estimator requires, e.g. ('token_level_rewards', 'values', 'response_mask')."""
    get_estimator(name)
    return _REQUIRED[name]


def compute_advantage(name: str, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the estimator `name` with the subset of `inputs` it accepts (keyword names as in
    the module docstring). Inputs it does not
    use are ignored, so a caller can pass everything it has; a missing one raises."""
    fn, params = get_estimator(name), _PARAMS[name]
    missing = [p for p in _REQUIRED[name] if inputs.get(p) is None]
    if missing:
        sources = "; ".join(f"{p}: {_INPUT_SOURCES[p]}" for p in missing if p in _INPUT_SOURCES)
        given = sorted(k for k, v in inputs.items() if v is not None)
        raise ValueError(f"advantage estimator '{name}' needs {missing} but got only {given}"
                         + (f" ({sources})" if sources else ""))
    return fn(**{k: v for k, v in inputs.items() if k in params and v is not None})


__all__: Sequence[str] = (
    "ESTIMATORS", "compute_advantage", "compute_gae_advantage_return", "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage", "compute_rloo_outcome_advantage", "compute_rloo_vectorized_outcome_advantage",
    "estimator_inputs", "gae_fast",
    "gae_reference", "get_estimator", "masked_discounted_scan", "reinforce_plus_plus_returns_reference",
)
