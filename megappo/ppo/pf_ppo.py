"""PF-PPO (policy filtration): a step's batch resampled with replacement, each sample drawn with a weight
that grows with its score, so training sees the responses whose reward is most trustworthy more often.

verl 0.9.1's `core_algos.compute_pf_ppo_reweight_data` (after GAE, `algorithm.use_pf_ppo`), weights from a
sample's score s (its summed token-level scores):

  method      weight w(s)                                         knob
  pow         |s| ** weight_pow                                   weight_pow (verl's default 2.0)
  max_min     1 where s is the batch's max or min, else 0          -
  max_random  0.4 where s is the batch's max, else 0.1             -

then w + 1e-8 (at least 1e-8), and N indices drawn from the weights with replacement (N: the batch's
size). `weights` is that formula; `resample_indices` draws, from a generator the caller seeds (verl uses
torch's global one). Shapes: [N] = samples of the step. torch only.
"""

from __future__ import annotations

import torch

METHODS = ("pow", "max_min", "max_random")


def weights(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """[N] sampling weights of [N] sample scores (the table above), each at least 1e-8."""
    scores = scores.float()
    if method == "pow":
        w = scores.abs().pow(weight_pow)
    elif method == "max_min":
        w = ((scores == scores.max()) | (scores == scores.min())).float()
    elif method == "max_random":
        w = torch.where(scores == scores.max(), 0.4, 0.1)
    else:
        raise ValueError(f"PF-PPO reweight_method {method!r} is not one of {METHODS}")
    return torch.clamp(w + 1e-8, min=1e-8)


def resample_indices(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0, *,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """[N] int64 indices into the batch, drawn with replacement in proportion to `weights`."""
    return torch.multinomial(weights(scores, method, weight_pow), scores.shape[0], replacement=True,
                             generator=generator)
