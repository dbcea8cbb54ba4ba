"""Masked statistics over [B, T] tensors, with verl 0.9.1 `torch_functional` semantics.

Owns: masked_sum / masked_mean / masked_var / masked_whiten.
Does not know about PPO, configs or process groups.

Shape legend: [B, T] = (sequences, response tokens); `mask` has the shape of `values`,
1 (or True) where a token counts. A numeric mask also weights the values (as in verl).

Semantics (all match verl 0.9.1):
  - masked positions never contribute, even when they hold NaN or inf;
  - masked_mean divides by (mask count + 1e-8), so an empty mask gives 0, not NaN;
  - masked_var is unbiased by default (Bessel's n / (n - 1)) and raises ValueError when the
    mask holds 0 or 1 valid tokens (use a larger mini-batch); `unbiased=False` never raises;
  - masked_whiten(x) = (x - mean) / sqrt(var + 1e-8), with the mean added back when
    `shift_mean=False`. Masked positions are transformed too (callers multiply by the mask).
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of values * mask over `dim` (all elements when None); NaN at masked positions is dropped."""
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (valid * mask).sum() if dim is None else (valid * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """masked_sum / (mask count + 1e-8): 0 for an empty mask."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Scalar variance over the mask; unbiased needs at least 2 valid tokens."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError(
                f"masked_var needs at least 2 valid tokens for an unbiased variance, got {float(count):g}; "
                "whitening advantages needs a larger mini-batch (or responses with more than one token)")
        var = var * (count / (count - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with the masked mean and unbiased variance."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
