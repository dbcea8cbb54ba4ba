"""Masked statistics (verl 0.9.1 torch_functional semantics) against hand-computed numbers."""

import pytest
import torch

from megappo.ppo.stats import masked_mean, masked_sum, masked_var, masked_whiten

T = torch.tensor
NAN = float("nan")


def test_masked_sum_and_mean_ignore_nan_and_inf_at_masked_positions():
    v = T([[1.0, NAN, 3.0], [float("inf"), 2.0, 4.0]])
    m = T([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    assert masked_sum(v, m).item() == 10.0
    assert masked_mean(v, m).item() == pytest.approx(2.5)
    assert masked_sum(v, m, dim=-1).tolist() == [4.0, 6.0]
    assert masked_mean(v, m, dim=-1).tolist() == pytest.approx([2.0, 3.0])
    assert masked_mean(v, m.bool()).item() == pytest.approx(2.5)  # bool masks too


def test_empty_mask_gives_zero_not_nan():
    v = T([[1.0, NAN]])
    empty = torch.zeros(1, 2)
    assert masked_sum(v, empty).item() == 0.0 and masked_mean(v, empty).item() == 0.0
    assert masked_mean(T([[1.0, 2.0], [5.0, 7.0]]), T([[0, 0], [1, 1.0]]), dim=-1).tolist() == [0.0, 6.0]


def test_numeric_mask_weights_values_as_in_verl():
    assert masked_sum(T([2.0, 4.0]), T([0.5, 1.0])).item() == 5.0
    assert masked_mean(T([2.0, 4.0]), T([0.5, 1.0])).item() == pytest.approx(5.0 / 1.5)


def test_masked_var_is_unbiased_and_needs_two_tokens():
    v, m = T([[1.0, 2.0, 3.0, 100.0]]), T([[1, 1, 1, 0.0]])
    assert masked_var(v, m).item() == pytest.approx(1.0)  # ((1)^2 + 0 + 1^2) / (3 - 1)
    assert masked_var(v, m, unbiased=False).item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        masked_var(v, T([[1.0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        masked_var(v, torch.zeros(1, 4))
    assert masked_var(v, T([[1.0, 0, 0, 0]]), unbiased=False).item() == 0.0


def test_masked_whiten_and_shift_mean():
    v, m = T([[1.0, 2.0, 3.0, 50.0]]), T([[1, 1, 1, 0.0]])
    w = masked_whiten(v, m)  # mean 2, unbiased var 1
    assert w[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert w[0, 3].item() == pytest.approx(48.0, rel=1e-6)  # masked positions are transformed too
    w = masked_whiten(v, m, shift_mean=False)
    assert w[0, :3].tolist() == pytest.approx([1.0, 2.0, 3.0], abs=1e-6)  # mean added back
