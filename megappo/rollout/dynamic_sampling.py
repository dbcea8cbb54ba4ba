"""DAPO's dynamic sampling (verl's `algorithm.filter_groups`): one step's generation in rounds.

`fill_batch` asks for `data.gen_batch_size` prompts at a time (`max_inflight_gen_batches` such
generation batches per engine call), has them generated (`rollout.n` samples each) and scored,
drops every group (the samples of one prompt) whose samples all have the same metric value
(`uniform_groups`: such a group has zero advantage under GRPO-style estimators, so it only
dilutes the batch), and goes on until `data.train_batch_size` groups are kept; the surplus of
the last round is discarded, as verl does. `max_num_gen_batches` bounds the generation batches
of a step: at the bound, `on_limit=fill` tops the batch up with the most recently dropped groups
(the batch keeps its configured size) and counts `filter_groups/hit_limit`, warning at the first step
that hits it and, at the run's end, on how many steps it did (`LimitCount`); `stop` raises
`FilterLimitError`, verl's "Generated too many" with the fix.

Seeds: round 0 samples with the step's seed, so a step whose first round fills the batch is the
step without filtering; round r > 0 with `round_seed(seed, r)`. Which prompts, seeds and groups a
step takes depends on (sampler state, step) only: a seeded run is reproducible and resumes exactly.

The batch it returns carries its scores (`RolloutBatch.scores`, `.score_components`: the trainer
does not call the reward functions again) and the step's `filter_groups/...` metrics
(`RolloutBatch.gen_metrics`). `take_groups` joins the round batches and picks the kept groups out of
them (megappo.rollout.batches' `concat` and `take`, re-exported here).

This module does not know how samples are generated or scored (the orchestrator passes `draw`,
`generate` and `score`), nor models, the trainer or when the generation runs (rollout.mode).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, Sequence

import torch

from megappo.data.prompts import DataError
from megappo.errors import ConfigError
from megappo.rewards import CORRECT_SCORE
from megappo.rollout.batches import concat, take
from megappo.types import RolloutBatch

#: generation round r > 0 of a step samples with seed + r * ROUND_SEED_STRIDE (round 0: the step's seed);
#: apart from the step seeds (seed + step) and the multi-turn turn seeds (+ turn * 1_000_003)
ROUND_SEED_STRIDE = 1_000_000_007

#: metric names that mean the sequence score (verl's seq_reward / score)
SCORE_METRICS = ("reward", "seq_reward", "score")


class FilterLimitError(DataError):
    """algorithm.filter_groups.on_limit=stop: max_num_gen_batches generation batches did not keep enough groups."""


@dataclasses.dataclass(frozen=True)
class GroupFilter:
    """What a step's dynamic sampling needs of the config."""

    groups: int  # data.train_batch_size: groups (prompts) the step trains on
    metric: str
    max_gen_batches: int  # 0: no bound
    inflight: int  # generation batches per engine call
    on_limit: str  # fill | stop
    functions: tuple[str, ...] = ()  # reward.functions, named in errors
    gen_batch_size: int = 0  # prompts per generation batch, named in messages

    @classmethod
    def of(cls, cfg) -> GroupFilter:
        fg = cfg.algorithm.filter_groups
        return cls(groups=cfg.data.train_batch_size, metric=fg.metric, max_gen_batches=fg.max_num_gen_batches,
                   inflight=fg.max_inflight_gen_batches, on_limit=fg.on_limit, functions=tuple(cfg.reward.functions),
                   gen_batch_size=cfg.data.gen_batch_size or cfg.data.train_batch_size)

    def next_call(self, done: int) -> int:
        """Generation batches the next engine call asks for, `done` already generated (0: at the bound)."""
        return self.inflight if not self.max_gen_batches else max(0, min(self.inflight, self.max_gen_batches - done))


@dataclasses.dataclass
class LimitCount:
    """on_limit=fill's warning, once a run: the first step that hits max_num_gen_batches prints it in full, later
    ones are counted, and `summary()` (at the run's end) says on how many of the steps dynamic sampling ran."""

    steps: int = 0  # steps that sampled dynamically
    hits: int = 0  # of them, those that hit the bound
    first_hit: int | None = None  # the step of the first hit
    fix: str = ""  # the first hit's fix, repeated in the summary

    def note(self, step: int, hit: bool, warning: str, fix: str) -> None:
        self.steps += 1
        if not hit:
            return
        self.hits += 1
        if self.first_hit is None:
            self.first_hit, self.fix = step, fix
            print(f"megappo: warning: {warning} (said once; the run's end counts the steps that hit the bound). {fix}",
                  file=sys.stderr, flush=True)

    def summary(self, max_gen_batches: int) -> str | None:
        """The run's-end line, or None when no step hit the bound."""
        if not self.hits:
            return None
        return (f"megappo: warning: dynamic sampling hit algorithm.filter_groups.max_num_gen_batches={max_gen_batches} "
                f"on {self.hits} of {self.steps} steps (the first: step {self.first_hit}); those batches were topped up "
                f"with dropped groups (filter_groups/hit_limit=1 in metrics.jsonl). {self.fix}")


def round_seed(seed: int | None, round: int) -> int | None:
    """The sampling seed of generation round `round` of a step whose seed is `seed`."""
    return None if seed is None else seed + round * ROUND_SEED_STRIDE


def uniform_groups(values: torch.Tensor, prompt_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[N] metric values, [N] group of each sample -> [G] True where every sample of the group has the same value."""
    assert values.shape == prompt_index.shape and bool((torch.bincount(prompt_index, minlength=num_groups) > 0).all())
    values = values.double()
    hi = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, prompt_index, values, "amax")
    lo = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, prompt_index, values, "amin")
    return hi == lo


def metric_values(metric: str, scores: torch.Tensor, fields: Sequence[dict[str, Any]],
                  functions: Sequence[str] = ()) -> torch.Tensor:
    """[N] what must differ within a group: the [N] sequence `scores` (metric reward / seq_reward / score),
    or the field `metric` of the dicts the reward functions returned (`fields`, one per sample); `acc`
    that no function returned is `scores >= CORRECT_SCORE`."""
    if metric in SCORE_METRICS:
        return scores
    have = [metric in f for f in fields]
    if not any(have) and metric == "acc":
        return (scores >= CORRECT_SCORE).double()
    if not all(have):
        raise ConfigError(
            f"algorithm.filter_groups.metric={metric}: the reward functions {list(functions)} returned no '{metric}' "
            f"field for {len(have) - sum(have)} of {len(have)} responses (a number, or a dict without it). Fix: have "
            f"your reward function return a dict with '{metric}' for every response (e.g. {{'score': s, '{metric}': "
            "a}), or set algorithm.filter_groups.metric=reward (the sequence score) or acc.")
    try:
        return torch.tensor([float(f[metric]) for f in fields], dtype=torch.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"algorithm.filter_groups.metric={metric}: the reward functions {list(functions)} returned a "
                          f"'{metric}' that is not a number. Fix: return a number (or bool) as '{metric}'.") from None


Scores = tuple[torch.Tensor, "torch.Tensor | None", list]  # [N] scores, [N, K] per function or None, [N] fields


def at_limit(f: GroupFilter, step: int, kept: int, generated: int, gen_batches: int, limits: LimitCount | None) -> None:
    """A step's end: with fewer than `f.groups` groups `kept` (of `generated`), on_limit=stop raises and
    fill warns (the batch is topped up by the caller); `limits` counts the steps (None: this step's alone)."""
    said = fix = ""
    hit_limit = kept < f.groups
    if hit_limit:
        said = (f"step {step}: algorithm.filter_groups kept {kept} of {generated} groups (prompts) "
                f"in {gen_batches} generation batches (max_num_gen_batches={f.max_gen_batches}), fewer than "
                f"data.train_batch_size={f.groups}")
        fix = (f"Fix: raise algorithm.filter_groups.max_num_gen_batches (0: no bound) or data.gen_batch_size "
               f"(now {f.gen_batch_size}), or check that the data is not too easy or too hard for the model (every "
               f"sample of a dropped group has the same {f.metric}).")
        if f.on_limit == "stop":
            raise FilterLimitError(f"{said}: generated too many batches (on_limit=stop, verl's behaviour). {fix}")
        said = f"{said}; topped up with {f.groups - kept} dropped groups (on_limit=fill, filter_groups/hit_limit)"
    (LimitCount() if limits is None else limits).note(step, hit_limit, said, fix)


@dataclasses.dataclass
class DynamicSampling:
    """Dynamic sampling inside partial rollouts (megappo.rollout.partial): each group is scored and judged
    as it completes, a uniform one leaves the pool and new prompts take its place, `f.max_gen_batches`
    bounding the generation batches drawn in a step. `score`: as `fill_batch`'s."""

    f: GroupFilter
    score: Callable[[RolloutBatch], "Scores"]
    limits: LimitCount | None = None
    score_time: float = 0.0  # this step's, so far
    hit_limit: bool = False  # this step's

    def may_draw(self, draws: int) -> bool:
        """Whether a step that drew `draws` generation batches may draw another."""
        return not self.f.max_gen_batches or draws < self.f.max_gen_batches

    def judge(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None, list, list[bool]]:
        """The complete groups of `batch` (prompt-major): their scores, components and fields, and per group
        whether its samples differ (kept)."""
        t = time.perf_counter()
        scores, components, fields = self.score(batch)
        values = metric_values(self.f.metric, scores, fields, self.f.functions)
        uniform = uniform_groups(values, batch.prompt_index, int(batch.prompt_index.max()) + 1)
        self.score_time += time.perf_counter() - t
        return scores, components, fields, [not u for u in uniform.tolist()]

    def top_up(self, step: int, kept: Sequence, judged: Sequence[tuple[Any, bool]], size: int,
               draws: int) -> list:
        """At the step's end with fewer than `size` groups `kept`: the most recently dropped of the step's
        `judged` (group, kept) fill the batch (on_limit=fill) or FilterLimitError (stop)."""
        at_limit(self.f, step, len(kept), len(judged), draws, self.limits)
        self.hit_limit = len(kept) < size
        dropped = [g for g, ok in judged if not ok]
        return dropped[::-1][:max(0, size - len(kept))]

    def metrics(self, judged: Sequence[tuple[Any, bool]], draws: int) -> dict[str, float]:
        """The step's filter_groups/... metrics (`judged`: the groups completed this step, `draws` its
        generation batches)."""
        kept = sum(ok for _, ok in judged)
        out = {"train/num_gen_batches": float(draws), "filter_groups/generated_groups": float(len(judged)),
               "filter_groups/kept_groups": float(kept), "filter_groups/kept_fraction": kept / max(1, len(judged)),
               "filter_groups/hit_limit": float(self.hit_limit), "timing_s/gen_reward": self.score_time}
        self.score_time = 0.0
        return out


def fill_batch(f: GroupFilter, *, step: int, seed: int | None, draw: Callable[[], list],
               generate: Callable[[list, int | None], RolloutBatch], score: Callable[[RolloutBatch], Scores],
               pad_token_id: int, limits: LimitCount | None = None) -> RolloutBatch:
    """`f.groups` groups whose samples differ, from as many generation rounds as it takes (module docstring).
    `draw()`: the next generation batch of prompts; `generate(prompts, seed)`: their samples, prompt-major;
    `score(batch)`: ([N] sequence scores, [N, K] each reward function's or None, [N] their extra fields);
    `limits`: the run's count of steps at the bound (None: this step's alone, so a hit warns)."""
    start, score_time = time.perf_counter(), 0.0
    rounds: list[RolloutBatch] = []
    kept, dropped = [], []  # (round, group) in generation order
    gen_batches = 0
    while len(kept) < f.groups and (k := f.next_call(gen_batches)):
        prompts = [p for _ in range(k) for p in draw()]
        batch = generate(prompts, round_seed(seed, len(rounds)))
        t = time.perf_counter()
        batch.scores, batch.score_components, batch.score_fields = score(batch)
        values = metric_values(f.metric, batch.scores, batch.score_fields, f.functions)
        uniform = uniform_groups(values, batch.prompt_index, len(prompts))
        score_time += time.perf_counter() - t
        for g, same in enumerate(uniform.tolist()):
            (dropped if same else kept).append((len(rounds), g))
        rounds.append(batch)
        gen_batches += k
    hit_limit = len(kept) < f.groups
    at_limit(f, step, len(kept), len(kept) + len(dropped), gen_batches, limits)
    chosen = kept[:f.groups] + dropped[::-1][:max(0, f.groups - len(kept))]  # the most recently dropped fill the rest
    out = take_groups(rounds, chosen, pad_token_id)
    n_samples = [torch.bincount(b.prompt_index) for b in rounds]
    samples = lambda groups: sum(int(n_samples[r][g]) for r, g in groups)  # noqa: E731
    out.gen_metrics = {
        "train/num_gen_batches": float(gen_batches),
        "filter_groups/generated_groups": float(len(kept) + len(dropped)),
        "filter_groups/kept_groups": float(min(len(kept), f.groups)),
        "filter_groups/kept_fraction": len(kept) / (len(kept) + len(dropped)),
        "filter_groups/evicted_samples": float(samples(dropped) - samples(chosen[len(kept[:f.groups]):])),
        "filter_groups/discarded_surplus_samples": float(samples(kept[f.groups:])),
        "filter_groups/hit_limit": float(hit_limit),
        # the score of everything generated (the trained batch's critic/score/mean is of the kept groups,
        # which filtering biases: all-correct groups are dropped)
        "filter_groups/generated_score_mean": torch.cat([b.scores for b in rounds]).float().mean().item(),
        "timing_s/gen_reward": score_time,
        "timing_s/gen_rounds": time.perf_counter() - start,
    }
    return out


def take_groups(rounds: Sequence[RolloutBatch], chosen: Sequence[tuple[int, int]], pad_token_id: int) -> RolloutBatch:
    """One batch of the `chosen` groups [(round, group)] in that order, from the round batches;
    env/... metrics describe every episode generated (all rounds)."""
    whole = concat(rounds, pad_token_id)
    offsets = [0]
    for b in rounds:
        offsets.append(offsets[-1] + int(b.prompt_index.max()) + 1)
    wanted = torch.tensor([offsets[r] + g for r, g in chosen], dtype=torch.long)
    rank = torch.full((offsets[-1],), -1, dtype=torch.long)
    rank[wanted] = torch.arange(len(wanted))
    sample_rank = rank[whole.prompt_index]
    rows = [i for _, i in sorted((int(r), i) for i, r in enumerate(sample_rank.tolist()) if r >= 0)]
    return take(whole, torch.tensor(rows, dtype=torch.long))
