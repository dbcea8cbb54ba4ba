"""KL estimators, KL controllers and the KL penalty in the reward, with verl 0.9.1 semantics.

Owns: per-token KL estimators chosen by name from `KL_ESTIMATORS` (algorithm.kl_penalty for
the reward, actor.kl_loss_type for the loss), the fixed and adaptive KL controllers chosen
from `KL_CONTROLLERS` (algorithm.kl_ctrl.type), and `apply_kl_penalty`.
Does not know about configs, process groups or models.

Shape legend: [B, T] = (sequences, response tokens). Estimators of KL(pi || pi_ref) per
token from log-probs log p = `log_prob`, log p_ref = `ref_log_prob`, both [B, T]:

| name | value |
|---|---|
| kl, k1 | log p - log p_ref |
| abs | abs(log p - log p_ref) |
| mse, k2 | 0.5 (log p - log p_ref)^2 |
| low_var_kl, k3 | r - log r - 1, log r = log p_ref - log p clamped to [-20, 20]; result clamped to [-10, 10] |
| any of the above + "+" (e.g. k3+) | value of the base estimator, gradient of k2 (straight-through) |

k1 and k3 are unbiased estimates of the KL value but their gradients are not the KL's
gradient; k2's is, hence the straight-through "+" variants for the KL loss.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from megappo.ppo.stats import masked_mean


def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    log_r = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
    return torch.clamp(log_r.exp() - log_r - 1, min=-10, max=10)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3,
}
KL_ESTIMATOR_NAMES = tuple(KL_ESTIMATORS) + tuple(name + "+" for name in KL_ESTIMATORS)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """[B, T] per-token KL estimate by name (see the module docstring); unknown names raise."""
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    if base not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{kl_penalty}' (algorithm.kl_penalty / actor.kl_loss_type); "
                         f"choose from {list(KL_ESTIMATOR_NAMES)}")
    value = KL_ESTIMATORS[base](log_prob, ref_log_prob)
    if not straight_through:
        return value
    k2 = _k2(log_prob, ref_log_prob)
    return k2 - k2.detach() + value.detach()


_kl_estimate = kl_penalty  # apply_kl_penalty's argument shadows the name, as verl's does


class FixedKLController:
    """beta stays at kl_coef."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019: beta *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"the adaptive KL controller needs horizon > 0 (algorithm.kl_ctrl.horizon), got {horizon}")
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon


KL_CONTROLLERS: dict[str, Callable[..., FixedKLController | AdaptiveKLController]] = {
    "fixed": lambda kl_coef, target_kl, horizon: FixedKLController(kl_coef),
    "adaptive": lambda kl_coef, target_kl, horizon: AdaptiveKLController(kl_coef, target_kl, horizon),
}


def make_kl_controller(kind: str, *, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    """The controller named by algorithm.kl_ctrl.type, from kl_ctrl.kl_coef / target_kl / horizon."""
    if kind not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller '{kind}' (algorithm.kl_ctrl.type); choose from {list(KL_CONTROLLERS)}")
    return KL_CONTROLLERS[kind](kl_coef, target_kl, horizon)


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, kl_ctrl, kl_penalty: str = "kl",
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level rewards [B, T] = scores - beta * KL * mask; updates `kl_ctrl`.

    The batch KL is the mean over sequences of each sequence's masked token mean (an empty
    response counts as 0), and the controller is updated with it and n_steps = B. Returns
    (rewards, {"actor/reward_kl_penalty": batch KL, "actor/reward_kl_penalty_coeff": the
    beta used for these rewards, i.e. before the update}).
    """
    kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty) * response_mask
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean(dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
