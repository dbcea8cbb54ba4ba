"""Typed records that stages hand each other (layer L0: torch only).

Shape legend: N samples (prompts x n, prompt-major: the n samples of a prompt are
adjacent), P prompt length (left-padded), R response length (right-padded).

This module does not know about models, engines or configs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

LogprobMode = Literal["tempered", "untempered"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What to sample; shared by every rollout engine."""

    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # in addition to the EOS ids
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    #: log-probs of sampled tokens under softmax(logits / temperature) ("tempered", the
    #: distribution the tokens were drawn from before top-k/top-p, and what the trainer
    #: recomputes) or softmax(logits) ("untempered"). Greedy: always untempered.
    logprob_mode: LogprobMode = "tempered"

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError("sampling needs n >= 1 and max_new_tokens >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class RolloutBatch:
    """Generated samples, prompt-major."""

    prompt_ids: torch.Tensor  # [N, P] long, left-padded with pad_token_id
    prompt_mask: torch.Tensor  # [N, P] 1 = token
    response_ids: torch.Tensor  # [N, R] long, right-padded with pad_token_id
    response_mask: torch.Tensor  # [N, R] 1 = generated token (EOS included)
    rollout_log_probs: torch.Tensor  # [N, R] float32, 0 where masked
    finish_reasons: list[str]  # N entries: "stop" (EOS/stop token) or "length"
    prompt_index: torch.Tensor  # [N] long: which input prompt each sample came from
    logprob_mode: LogprobMode = "tempered"
    examples: list | None = None  # the orchestrator's per-sample prompt records (ground truth, ...)
    reward_baselines: torch.Tensor | None = None  # [N] ReMax: reward of the prompt's greedy response
    policy_version: int = 0  # optimizer steps behind the weights that generated it (megappo.rollout.schedule)

    @property
    def num_samples(self) -> int:
        return self.prompt_ids.shape[0]

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, P+R] token ids and attention mask of prompt + response."""
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        return ids, mask
