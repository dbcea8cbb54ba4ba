"""KL estimators, controllers and the in-reward KL penalty against hand-computed numbers."""

import math

import pytest
import torch

from megappo.ppo.kl import (
    KL_ESTIMATOR_NAMES, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty, make_kl_controller,
)

T = torch.tensor
D = math.log(2)  # log p - log p_ref for p = 1, p_ref = 1/2


@pytest.mark.parametrize("name,expected", [
    ("kl", D), ("k1", D), ("abs", D), ("mse", 0.5 * D * D), ("k2", 0.5 * D * D),
    ("low_var_kl", 0.5 + D - 1), ("k3", 0.5 + D - 1),  # r - log r - 1 with r = p_ref / p = 1/2
])
def test_estimators_by_hand(name, expected):
    lp, ref = T([0.0, math.log(0.5)]), T([math.log(0.5), 0.0])
    out = kl_penalty(lp, ref, name)
    assert out[0].item() == pytest.approx(expected)
    reverse = {"kl": -D, "k1": -D, "abs": D, "mse": 0.5 * D * D, "k2": 0.5 * D * D}.get(name, 2 - D - 1)
    assert out[1].item() == pytest.approx(reverse)  # r = 2: 2 - log 2 - 1


def test_low_var_kl_clamps():
    # log r clamped to 20 -> e^20 - 21, then clamped to 10
    assert kl_penalty(T([0.0]), T([100.0]), "k3").item() == 10.0
    # log r = -100 clamped to -20: e^-20 + 20 - 1 > 10 -> 10
    assert kl_penalty(T([100.0]), T([0.0]), "low_var_kl").item() == 10.0
    assert kl_penalty(T([0.0]), T([-3.0]), "k3").item() == pytest.approx(math.exp(-3) + 3 - 1)


@pytest.mark.parametrize("base", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_straight_through_has_base_value_and_k2_gradient(base):
    lp = T([0.3, -0.4], requires_grad=True)
    ref = T([0.1, 0.2])
    out = kl_penalty(lp, ref, base + "+")
    assert torch.allclose(out, kl_penalty(lp.detach(), ref, base))
    out.sum().backward()
    assert torch.allclose(lp.grad, (lp - ref).detach())  # d/dlp 0.5 (lp - ref)^2


def test_unknown_estimator_lists_valid_names():
    assert "k3+" in KL_ESTIMATOR_NAMES and len(KL_ESTIMATOR_NAMES) == 14
    for bad in ("k4", "full", "kl++", ""):
        with pytest.raises(ValueError, match=r"unknown KL estimator.*'low_var_kl'"):
            kl_penalty(T([0.0]), T([0.0]), bad)


def test_adaptive_controller_clips_error_and_scales_by_steps():
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=1.0, n_steps=10)  # error 9 clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.0, n_steps=50)  # error -1 clipped to -0.2
    assert ctrl.value == pytest.approx(0.1 * (1 - 0.2 * 0.5))
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.11, n_steps=100)  # error 0.1 inside the clip
    assert ctrl.value == pytest.approx(0.1 * 1.1)
    with pytest.raises(ValueError, match="horizon > 0"):
        make_kl_controller("adaptive", kl_coef=0.1, horizon=0)
    with pytest.raises(ValueError, match=r"unknown KL controller 'pid'.*'fixed', 'adaptive'"):
        make_kl_controller("pid", kl_coef=0.1)


def test_apply_kl_penalty_by_hand():
    ctrl = make_kl_controller("fixed", kl_coef=0.5)
    assert isinstance(ctrl, FixedKLController)
    scores = T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    old, ref = T([[0.2, 0.4, 7.0], [1.0, 1.0, 1.0]]), torch.zeros(2, 3)
    mask = T([[1, 1, 0], [0, 0, 0.0]])  # second response empty
    rewards, m = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    assert rewards.tolist() == [pytest.approx([-0.1, 0.8, 0.0]), [0.0, 0.0, 0.0]]  # masked tokens not penalised
    # per-sequence means 0.3 and 0 (empty), averaged over the 2 sequences
    assert m == pytest.approx({"actor/reward_kl_penalty": 0.15, "actor/reward_kl_penalty_coeff": 0.5})
    adaptive = AdaptiveKLController(0.5, target_kl=0.1, horizon=20)
    _, m = apply_kl_penalty(scores, old, ref, mask, adaptive, "kl")
    assert m["actor/reward_kl_penalty_coeff"] == 0.5  # the beta used, before the update
    assert adaptive.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 20))  # n_steps = batch size
