"""Scoring a batch of responses: the one entry the trainer calls (`Scorer`, rank 0).

A response's score is the sum of
  - the environment's reward of its episode (multi-turn: `RolloutBatch.env_scores`),
  - the reward functions' weighted scores (reward.functions / function_weights, on the decoded
    text: megappo.rewards.functions), called by the reward workers when there are some
    (megappo.rewards.workers, reward.num_workers), else here,
  - DAPO's overlong penalty (reward.overlong_buffer, megappo.ppo.overlong),
  - and, in a training step, the reward model's score times reward.model_weight.
A group with a failed or unparseable judgement under reward.judge.on_failure=skip_group (megappo.rewards.judge)
is marked in `BatchScores.skip`: the step masks its samples out of every loss.
The first three are a batch's *generation scores*: dynamic sampling scores its rounds with them
(`generation_scores`), and a batch scored so carries them (`RolloutBatch.scores`, `.score_components`,
`.score_fields`) to the step that trains on it, which does not call the functions again.

Owns: `Scorer` (built once per run from the recipe's reward section: its checks of your functions'
values, its reward workers), `BatchScores` (what a scoring gives the step or validation: the [N]
scores and their metrics), `Pending` (a training batch's reward-worker calls, started as soon as the
batch is generated so that they run during the step's model passes: `start`, then `score_step`), and
`score_metrics`. A reward function that fails names the dataset row and its prompt (`naming_prompts`).

Does not know about models, process groups, the PPO math (beyond the overlong penalty) or how
batches are generated.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from megappo.ppo.overlong import overlong_metrics, overlong_penalty
from megappo.rewards import code_reward, judge
from megappo.rewards.code_reward import code_metrics
from megappo.rewards.functions import CORRECT_SCORE, RewardChecks, score_batch, score_records
from megappo.rewards.judge import PROMPT_KEY, JudgeUnavailable, judge_metrics
from megappo.rewards.workers import RewardWorkers, Scoring
from megappo.types import RolloutBatch
from megappo.user_code import UserCodeError

#: the built-in reward functions that run programs on the code executor (reward.sandbox)
RUNS_PROGRAMS = frozenset({"code", "code_expression"})

#: what a reward function reads of each response: (texts, ground truths, extras, data sources, the dataset
#: rows a failing function is named with)
Read = tuple[list[str], list, list[dict], list[str], list]


@dataclasses.dataclass
class BatchScores:
    """What the rewards say of a batch: [N] `scores` (the trained score, or validation's) and `metrics`:
    `<prefix>/frac_correct`, each reward.metric_functions' mean, and in a training step
    `reward/bad_values`, the overlong penalty's metrics (reward.overlong_buffer.log), the `code` function's
    (`reward/code/format_failures`, `case_pass_rate`, `retries`), `code_expression`'s
    (`reward/code_expression/sandbox_runs`, ...) and the `judge` function's (`reward/judge/failed`,
    `unparseable`, `timeouts`, `retries`, `latency_s`, `skipped_groups`). `skip`: [N] bool, the samples of groups
    that a failed judgement skips (reward.judge.on_failure=skip_group), which the step masks out of its losses;
    None when none is."""

    scores: torch.Tensor
    metrics: dict[str, float]
    skip: torch.Tensor | None = None


@dataclasses.dataclass
class Pending:
    """A training batch's responses as the reward functions read them, and the reward workers' calls on them."""

    read: Read
    scoring: Scoring


class Scorer:
    """Rank 0's scoring of batches (module docstring). `reward_cfg`: the recipe's reward section;
    `max_new_tokens`: the response budget the overlong penalty counts against; `python_tool`: the episodes'
    python tool (megappo.envs.tools) runs programs on this process's code executor, configured here too."""

    def __init__(self, reward_cfg, tokenizer, max_new_tokens: int, *, python_tool: bool = False):
        self.cfg, self.tokenizer, self.max_new_tokens = reward_cfg, tokenizer, max_new_tokens
        self.checks = RewardChecks.of(reward_cfg)
        named = {*reward_cfg.functions, *reward_cfg.metric_functions}
        runs_code, self.asks_judge = bool(RUNS_PROGRAMS & named), "judge" in named
        if runs_code or python_tool:  # at start-up: a sandbox missing on this machine stops the run before any step
            code_reward.configure(reward_cfg.sandbox)
        if self.asks_judge:
            judge.configure(reward_cfg.judge)
        self.workers = (RewardWorkers(reward_cfg.functions, reward_cfg.num_workers, reward_cfg.timeout_s,
                                      sandbox=reward_cfg.sandbox if runs_code else None,
                                      judge_cfg=reward_cfg.judge if self.asks_judge else None)
                        if reward_cfg.num_workers and reward_cfg.functions else None)

    def close(self) -> None:
        if self.workers:
            self.workers.close()
        if self.asks_judge:
            judge.close()
        code_reward.close()  # its pool's threads would keep a forked rank from ending

    # -- a training step ------------------------------------------------------------------------

    def start(self, batch: RolloutBatch) -> Pending | None:
        """Hand a training batch's responses to the reward workers, which score them while the step's model
        passes run; None without workers, or for a batch scored at generation (dynamic sampling)."""
        if not self.workers or batch.scores is not None:
            return None
        read = self.responses(batch)
        return Pending(read, self.workers.start(*read[:4]))

    def score_step(self, batch: RolloutBatch, pending: Pending | None = None,
                   reward_model: torch.Tensor | None = None) -> BatchScores:
        """A training batch's scores: its generation scores (computed now, and kept on the batch, unless it
        carries them) plus the reward model's [N] `reward_model` scores times reward.model_weight, with the
        step's reward metrics (`critic/score/...`, `reward/bad_values`, the overlong penalty's)."""
        read = pending.read if pending else self.responses(batch)  # decoded once for rewards and metrics
        bad_before = self.checks.bad_values
        if batch.scores is None:  # each function once, its scores kept for GDPO (dynamic sampling: done)
            batch.scores, batch.score_components, batch.score_fields = self.generation_scores(
                batch, read, pending.scoring if pending else None)
        scores = self.totals(batch, reward_model)
        metrics = {"reward/bad_values": float(self.checks.bad_values - bad_before)}  # scored 0 (bad_value_policy)
        with self.naming_prompts(batch):
            metrics.update(score_metrics("critic/score", scores, self.cfg.metric_functions, *read))
        metrics.update(self.overlong_metrics(batch))
        metrics.update(code_metrics(batch.score_fields or []))
        metrics.update(judge_metrics(batch.score_fields or []))
        skip = skipped_groups(batch)
        if skip is not None:
            metrics["reward/judge/skipped_groups"] = float(batch.prompt_index[skip].unique().numel())
        return BatchScores(scores, metrics, skip)

    def totals(self, batch: RolloutBatch, reward_model: torch.Tensor | None = None) -> torch.Tensor:
        """[N] a batch's generation scores (those it carries, else computed now) plus the reward model's."""
        scores = (batch.scores if batch.scores is not None else self.generation_scores(batch)[0]).clone()
        if reward_model is not None:
            scores += self.cfg.model_weight * reward_model.float()
        return scores

    # -- validation -----------------------------------------------------------------------------

    def score_validation(self, batch: RolloutBatch) -> tuple[BatchScores, Read]:
        """A validation batch's generation scores (its fields kept on the batch) with `val/score/...`
        metrics, and what the functions read of it (its data sources split the metrics)."""
        read = self.responses(batch)
        scores, _, batch.score_fields = self.generation_scores(batch, read)
        with self.naming_prompts(batch):
            metrics = score_metrics("val/score", scores, self.cfg.metric_functions, *read)
        metrics.update(judge_metrics(batch.score_fields, prefix="val/judge"))  # skip_group: nothing to skip here
        return BatchScores(scores, metrics), read

    # -- the parts ------------------------------------------------------------------------------

    def generation_scores(self, batch: RolloutBatch, read: Read | None = None, scoring: Scoring | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None, list[dict]]:
        """([N] sequence scores: the environment's, the functions' and the overlong penalty (verl's
        seq_reward), [N, K] each of reward.functions' scores (None without functions), [N] the other fields
        they returned). With the overlong penalty on, `acc` that no function returned is the unshaped
        score's correctness (verl's acc is the scorer's, before it). `scoring`: the reward workers' calls
        on `read`, started earlier (`start`)."""
        cfg = self.cfg
        scores = torch.zeros(batch.num_samples) if batch.env_scores is None else batch.env_scores.clone()
        values, fields = None, [{} for _ in range(batch.num_samples)]
        if cfg.functions:
            read = read or self.responses(batch)
            if scoring is None and self.workers:
                scoring = self.workers.start(*read[:4])
            with self.naming_prompts(batch):
                record = score_records(cfg.functions, cfg.function_weights, *read, checks=self.checks,
                                       outcomes=scoring.outcomes() if scoring else None)
            scores += torch.tensor(record.totals)
            values, fields = torch.tensor(record.values, dtype=torch.float32), record.fields
        if cfg.overlong_buffer.enable:
            fields = [f if "acc" in f else dict(f, acc=float(s >= CORRECT_SCORE))
                      for f, s in zip(fields, scores.tolist())]
            scores += self.overlong_shaping(batch)
        return scores, values, fields

    def overlong_shaping(self, batch: RolloutBatch) -> torch.Tensor:
        """[N] DAPO's overlong penalty (reward.overlong_buffer, megappo.ppo.overlong) of each response. Its
        length is what counts against rollout.max_new_tokens: every real response token (a multi-turn
        episode's actions and observations, as megappo.rollout.multiturn budgets them)."""
        ob = self.cfg.overlong_buffer
        return overlong_penalty(batch.real_response_mask.sum(-1), max_len=self.max_new_tokens,
                                buffer_len=ob.len, penalty_factor=ob.penalty_factor)

    def overlong_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """`reward/overlong_reward` and `reward/overlong` when reward.overlong_buffer.log (else {})."""
        ob = self.cfg.overlong_buffer
        return overlong_metrics(self.overlong_shaping(batch)) if ob.enable and ob.log else {}

    def responses(self, batch: RolloutBatch) -> Read:
        """What a reward function reads of each response (a whole episode: actions and observations):
        (texts, ground truths, extras, data sources, and the dataset rows a failing function is named with:
        each example's RowOrigin)."""
        texts = self.tokenizer.batch_decode(batch.response_ids * batch.real_response_mask, skip_special_tokens=True)
        extras = [dict(e.extra, finish_reason=why) for e, why in zip(batch.examples, batch.finish_reasons)]
        if self.asks_judge:  # the judge's template shows the prompt
            prompts = self.tokenizer.batch_decode([list(e.prompt_ids) for e in batch.examples], skip_special_tokens=True)
            for extra, prompt in zip(extras, prompts):
                extra[PROMPT_KEY] = prompt
        return (texts, [e.ground_truth for e in batch.examples], extras, [e.data_source for e in batch.examples],
                [e.origin for e in batch.examples])

    @contextlib.contextmanager
    def naming_prompts(self, batch: RolloutBatch):
        """A UserCodeError raised inside (your reward function failed on a response of `batch`) gets its
        row's prompt, decoded only then; the row (file and line, training or validation) it names already."""
        try:
            yield
        except UserCodeError as e:
            example = next((x for x in batch.examples or () if x.origin is not None and x.origin == e.row), None)
            if example is None or e.prompt is not None:
                raise
            prompt = self.tokenizer.decode(list(example.prompt_ids), skip_special_tokens=True)
            raise e.at(prompt=prompt) from e.__cause__


def skipped_groups(batch: RolloutBatch) -> torch.Tensor | None:
    """[N] bool: the samples of the groups (prompt_index) in which a judgement was skipped
    (reward.judge.on_failure=skip_group); None when none was. A step whose every group is skipped has nothing to
    train on: JudgeUnavailable."""
    marked = torch.tensor([bool(f.get("judge_skip")) for f in batch.score_fields or ()], dtype=torch.bool)
    if not marked.any():
        return None
    skip = torch.isin(batch.prompt_index, batch.prompt_index[marked])
    if skip.all():
        raise JudgeUnavailable("the judge failed on (or gave no score for) a response of every group of this step, "
                               "which reward.judge.on_failure=skip_group leaves nothing to train on. Fix: check the "
                               "judge (reward/judge/failed, unparseable), reward.judge.url, template and score_pattern.")
    return skip


def score_metrics(prefix: str, scores: torch.Tensor, metric_functions, texts, ground_truths, extras,
                  data_sources, rows=None) -> dict[str, float]:
    """`<prefix>/frac_correct`: the fraction of the [N] `scores` that are fully correct (>= 1.0);
    `<prefix>/<name>`: the mean score of each function in reward.metric_functions (logged, not
    trained on) on the same responses."""
    out = {f"{prefix}/frac_correct": (scores >= CORRECT_SCORE).float().mean().item()}
    for name in metric_functions:
        values = score_batch([name], None, texts, ground_truths, extras, data_sources, rows)
        out[f"{prefix}/{name}"] = sum(values) / len(values)
    return out
