"""Masked statistics over [B, T] tensors (verl 0.9.1 `torch_functional` semantics).

Masked positions never contribute, even when they hold NaN; an empty mask gives 0 for
sums and means instead of NaN. Variance is unbiased and needs at least two valid tokens.

This module does not know about PPO, configs or process groups.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    valid = mask.bool()
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    masked = torch.where(valid, values, zeros)  # NaN at masked positions is dropped
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    count = mask.sum()
    if unbiased and count <= 1:
        raise ValueError(f"masked_var needs at least 2 valid tokens for an unbiased variance, got {int(count)}")
    mean = masked_mean(values, mask)
    var = masked_sum((values - mean) ** 2, mask)
    return var / (count - 1) if unbiased else var / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the mask; shift_mean=False adds the mean back."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
