"""KL estimators, KL controllers, and the KL penalty in the reward (verl 0.9.1 semantics).

Estimators of KL(pi || pi_ref) per token from log-probs [B, T]:
  kl / k1      log p - log p_ref
  abs          |log p - log p_ref|
  mse / k2     0.5 (log p - log p_ref)^2
  low_var_kl / k3   r - log r - 1 with log r = log p_ref - log p clamped to +-20, result clamped to +-10
A "+" suffix (e.g. "k3+") gives the base estimator's value with the gradient of k2
(straight-through), an unbiased gradient for the KL loss.

This module does not know about configs or process groups.
"""

from __future__ import annotations

import torch

from megappo.ppo.stats import masked_mean


def _k1(lp, ref):
    return lp - ref


def _abs(lp, ref):
    return (lp - ref).abs()


def _k2(lp, ref):
    return 0.5 * (lp - ref).square()


def _k3(lp, ref):
    log_ratio = torch.clamp(ref - lp, min=-20, max=20)
    return torch.clamp(log_ratio.exp() - log_ratio - 1, min=-10, max=10)


KL_ESTIMATORS = {"kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """[B, T] per-token KL estimate by name (see the module docstring)."""
    straight_through = kl_penalty.endswith("+")
    name = kl_penalty[:-1] if straight_through else kl_penalty
    if name not in KL_ESTIMATORS:
        valid = sorted(KL_ESTIMATORS) + [k + "+" for k in sorted(KL_ESTIMATORS)]
        raise ValueError(f"unknown KL estimator '{kl_penalty}'; choose from {valid}")
    value = KL_ESTIMATORS[name](log_prob, ref_log_prob)
    if not straight_through:
        return value
    k2 = _k2(log_prob, ref_log_prob)
    return k2 - k2.detach() + value.detach()


_kl_estimate = kl_penalty  # apply_kl_penalty's argument shadows the name, as verl's does


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al.: coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def make_kl_controller(kind: str, *, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller '{kind}'; choose 'fixed' or 'adaptive' (algorithm.kl_ctrl.type)")


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, kl_ctrl, kl_penalty: str = "kl"
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = scores - beta * KL per token; updates the controller with the batch KL.

    Returns (token-level rewards [B, T], {"actor/reward_kl_penalty": batch KL,
    "actor/reward_kl_penalty_coeff": the beta used}).
    """
    kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty) * response_mask
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
