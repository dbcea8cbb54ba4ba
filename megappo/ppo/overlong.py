"""DAPO's overlong reward shaping (verl 0.9.1's dapo reward manager), as a pure function.

A response of L tokens, generated under a budget of `max_len` tokens, is penalised linearly over
the last `buffer_len` tokens of the budget: 0 up to `max_len - buffer_len` tokens, then down to
`-penalty_factor` at `max_len`. The penalty is added to the sequence score by the caller.

Shapes: [N] one value per sequence. This module does not know where the lengths come from (which
tokens count against the budget is the orchestrator's choice), nor configs or metrics.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """[N] response lengths (tokens) -> [N] float32 penalties <= 0.

    verl: expected = max_resp_len - buffer_len; penalty = min(-(L - expected) / buffer_len * factor, 0).
    """
    assert buffer_len > 0, "the overlong buffer needs at least one token"
    expected = max_len - buffer_len
    exceed = lengths.float() - expected
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


def overlong_metrics(penalty: torch.Tensor) -> dict[str, float]:
    """verl's reward extra infos, averaged: `reward/overlong_reward` (mean penalty) and
    `reward/overlong` (the fraction of responses penalised)."""
    return {"reward/overlong_reward": penalty.mean().item(), "reward/overlong": (penalty < 0).float().mean().item()}
