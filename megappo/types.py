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
    #: also return each token's routed experts (MoE models: `RolloutBatch.routes`, routing replay)
    return_routes: bool = False
    #: (first, total): this call is the part of a larger call of `total` samples that starts at
    #: sample `first` (prompt-major, whole prompts: a replica's chunk), and its samples draw what
    #: samples first, first + 1, ... of the whole call draw, so a seeded sample's tokens do not
    #: depend on how the call is split. None: the call is whole. Ignored when greedy, and by
    #: engines that do not honour the seed (sglang).
    sample_window: tuple[int, int] | None = None

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError("sampling needs n >= 1 and max_new_tokens >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if self.sample_window is not None and not (
                len(self.sample_window) == 2 and 0 <= self.sample_window[0] < self.sample_window[1]):
            raise ValueError(f"sample_window={self.sample_window} must be (first, total) with 0 <= first < total: "
                             "the part's first sample in the whole call, and the whole call's samples")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class RolloutBatch:
    """Generated samples, prompt-major."""

    prompt_ids: torch.Tensor  # [N, P] long, left-padded with pad_token_id
    prompt_mask: torch.Tensor  # [N, P] 1 = token
    response_ids: torch.Tensor  # [N, R] long, right-padded with pad_token_id
    #: [N, R] 1 = generated token (EOS included): the tokens with a loss, KL, entropy and advantage;
    #: 0 on padding and on the observation tokens of a multi-turn episode
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor  # [N, R] float32, 0 where masked
    finish_reasons: list[str]  # N entries: "stop" (EOS/stop token) or "length"
    prompt_index: torch.Tensor  # [N] long: which input prompt each sample came from
    logprob_mode: LogprobMode = "tempered"
    examples: list | None = None  # the orchestrator's per-sample prompt records (ground truth, ...)
    reward_baselines: torch.Tensor | None = None  # [N] ReMax: reward of the prompt's greedy response
    #: [N, P+R, L, k] int16 expert ids the engine routed each position to, per decoder layer, -1 where
    #: unknown (megappo.rollout.routes); None unless SamplingParams.return_routes
    routes: torch.Tensor | None = None
    #: [N, R] 1 = a real token of the response (actions and observations), what the models attend
    #: to; None: the same as response_mask (single-turn responses have no observations)
    response_attention_mask: torch.Tensor | None = None
    env_scores: torch.Tensor | None = None  # [N] float32: the sum of each episode's environment rewards
    env_metrics: dict[str, float] | None = None  # `env/...` metrics of the episodes (megappo.rollout.multiturn)
    #: [N] bool: episodes that ran out of the response budget (max_new_tokens); an action cut by its
    #: turn's budget alone is not counted. None: finish_reasons == "length" (single-turn responses)
    clipped: torch.Tensor | None = None
    policy_version: int = 0  # optimizer steps behind the weights that generated it (megappo.rollout.schedule)
    #: [N, R] long: the policy version that generated each response token (partial rollouts, megappo.rollout.partial:
    #: a resumed sample's earlier tokens are older; -1 until the schedule stamps this generation's version, 0 on
    #: padding); None: every token is `policy_version`'s
    token_versions: torch.Tensor | None = None
    #: [N] float32 sequence scores given at generation (environment + rule functions, no reward model):
    #: set by dynamic sampling (megappo.rollout.dynamic_sampling), so the trainer does not call the functions
    #: again; None: scored by the trainer
    scores: torch.Tensor | None = None
    score_components: torch.Tensor | None = None  # [N, K] with `scores`: each of reward.functions' scores, unweighted
    score_fields: list[dict] | None = None  # N dicts with `scores`: the fields reward functions returned ("acc", ...)
    #: metrics of the generation (dynamic sampling's `filter_groups/...`, its timings), logged by the
    #: step that trains on the batch (in one_step_off / async mode the generation ran earlier)
    gen_metrics: dict[str, float] | None = None

    @property
    def num_samples(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def truncated(self) -> torch.Tensor:
        """[N] bool: the responses that ended at the budget max_new_tokens (`clipped`, else finish reason "length")."""
        if self.clipped is not None:
            return self.clipped.bool()
        return torch.tensor([r == "length" for r in self.finish_reasons], dtype=torch.bool)

    @property
    def clip_ratio(self) -> float:
        """The fraction of responses that ended at the budget max_new_tokens (verl's response_length/clip_ratio)."""
        if self.clipped is not None:
            return self.clipped.float().mean().item()
        return sum(r == "length" for r in self.finish_reasons) / self.num_samples

    @property
    def real_response_mask(self) -> torch.Tensor:
        """[N, R] 1 on every real response token (observations included), 0 on padding."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, P+R] token ids and attention mask of prompt + response (observation tokens attended)."""
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.real_response_mask], dim=1)
        return ids, mask
