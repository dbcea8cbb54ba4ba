"""Partial rollouts (rollout.partial), a stage of the rollout side: a step's batch is the first
`data.train_batch_size` groups to finish among more groups in generation; the unfinished samples
keep what they generated and resume in a later step.

A step (`PartialRollouts.next_batch`):

  1. the carried groups are checked for age: a sample whose oldest token is more than
     `max_token_staleness` policy versions behind the trainer is generated again from its prompt
     (`on_stale=restart`) or its whole group is dropped (`drop`);
  2. new prompts are drawn (`draw()`, one sampler batch at a time) until `over_sample` x the batch
     size groups are in generation, the carried ones (oldest first) before the new;
  3. every unfinished sample generates `chunk_tokens` more tokens from its prompt + its tokens so
     far, all of them in one engine call (`generate(prompt_ids, params)`, one sample per prompt:
     a resumed sample is a prompt of its own), under the weights the engine holds now; after each
     call, once the batch size's worth of groups is complete, the rest is stopped (aborted);
  4. the batch is the complete groups, oldest first; the other groups, complete or not, are
     carried to the next step.

A multi-turn episode generates in the same chunks; where an action ends, `episodes` steps its
environment and appends the observation (masked) before the next call.

With dynamic sampling (`DynamicSampling`, megappo.rollout.dynamic_sampling) each group is scored as it
completes: a group whose samples do not differ leaves the pool and new prompts take its place (step 2
again), and only groups that passed count towards the batch, which carries their scores.

Every token keeps the engine's log-prob and the policy version that generated it (`token_versions`:
-1 for this step's tokens until the schedule stamps the batch with its version, which this module
then reads back for the tokens it carries). The trainer's rollout correction weighs each token by
its own behaviour log-prob, so a sample generated under two versions is corrected token by token.

Sampling is seeded per step and per call (`params.seed`, the call's index), so a resumed run that
restores the carried groups (`state_dict` / `load_state_dict`, in the checkpoint) generates what
the straight run generates.

Shape legend: N samples, P prompt length, R response length (megappo.types).

This module does not know the engines, the trainer, the schedule's threads, nor how prompts are
drawn or scored; a multi-turn sample's episode is `episodes`' (megappo.rollout.partial_episodes). MoE routes (routing replay) are kept per
position from the call that first fed it: a resumed sample's prompt and earlier tokens keep the routes of
their first call, its last token before the abort takes the resuming call's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch

from megappo.errors import CheckpointError
from megappo.rollout.dynamic_sampling import DynamicSampling
from megappo.rollout.engine import left_pad
from megappo.rollout.partial_episodes import EpisodeState, Episodes
from megappo.rollout.routes import UNKNOWN
from megappo.types import RolloutBatch, SamplingParams

PENDING = -1  # the version of a token generated in the step being generated, until the batch is stamped


@dataclasses.dataclass
class Sample:
    """One response in the making: its tokens, their engine log-probs and policy versions."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None  # "stop" / "length"; None: unfinished
    segments: int = 0  # engine calls that generated its tokens
    #: routing replay: [F, L, k] int16 expert ids of the first F positions of prompt + tokens, those an engine
    #: call has fed, each from the call that first fed it; None without routes
    routes: torch.Tensor | None = None
    mask: list[int] | None = None  # multi-turn: 1 on action tokens, 0 on observations; None: all actions
    episode: EpisodeState | None = None  # multi-turn: the episode's counters (megappo.rollout.partial_episodes)

    def restart(self) -> None:
        """Back to no tokens (a stale sample generated again from its prompt)."""
        self.tokens, self.log_probs, self.versions, self.finish, self.segments = [], [], [], None, 0
        self.routes, self.mask, self.episode = None, None, None

    def state(self) -> dict:
        """Plain data for the checkpoint."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "tokens": list(self.tokens), "log_probs": list(self.log_probs),
                "versions": list(self.versions), "mask": None if self.mask is None else list(self.mask),
                "episode": None if self.episode is None else self.episode.state()}

    @classmethod
    def from_state(cls, state: dict) -> Sample:
        episode = state.get("episode")
        return cls(**{**state, "episode": None if episode is None else EpisodeState.from_state(episode)})


@dataclasses.dataclass
class Group:
    """The `n` samples of one prompt; `key` orders groups oldest first."""

    key: int
    example: Any  # the prompt record (megappo.data.prompts.PromptExample)
    samples: list[Sample]
    #: dynamic sampling: once complete, its samples' scores {"scores": [n], "components": [n, K] or None,
    #: "fields": n dicts} (the trainer does not score them again); None: not judged
    scored: dict | None = None

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)


class PartialRollouts:
    """The carried groups and the rule that fills a step's batch from them (module docstring)."""

    def __init__(self, *, batch_size: int, n: int, over_sample: float, chunk_tokens: int, max_new_tokens: int,
                 max_token_staleness: int, on_stale: str, pad_token_id: int, episodes: Episodes | None = None):
        assert max_new_tokens % chunk_tokens == 0, (max_new_tokens, chunk_tokens)
        self.episodes = episodes  # rollout.env's environments (megappo.rollout.partial_episodes); None: single-turn
        self._replay = False  # resumed from a checkpoint: the unfinished episodes' environments to rebuild
        self.batch_size, self.n, self.pad_token_id = batch_size, n, pad_token_id
        self.in_flight = max(batch_size, math.ceil(over_sample * batch_size))
        self.chunk_tokens, self.max_new_tokens = chunk_tokens, max_new_tokens
        self.max_token_staleness, self.on_stale = max_token_staleness, on_stale
        self.groups: list[Group] = []  # carried to the next step, oldest first
        self.next_key = 0
        self._last: RolloutBatch | None = None  # the last batch returned: its version stamps the carried tokens

    # ---- one step -------------------------------------------------------------------------------
    def next_batch(self, step: int, params: SamplingParams, *, draw: Callable[[], list],
                   generate: Callable[[list[list[int]], SamplingParams], RolloutBatch],
                   dynamic: DynamicSampling | None = None) -> RolloutBatch:
        """Step `step`'s batch of `batch_size` complete groups (its `gen_metrics` count what happened).
        `dynamic`: algorithm.filter_groups, each group judged as it completes (`DynamicSampling`)."""
        self._stamp_carried()
        m = self._age_out(step)
        resumed = sum(1 for g in self.groups for s in g.samples if s.finish is None and s.tokens)
        calls, draws, judged = 0, 0, []
        kept = lambda: [g for g in self.groups if g.complete and (dynamic is None or g.scored)]  # noqa: E731
        while len(kept()) < self.batch_size:
            draws = self._fill(params.n, draw, draws, dynamic)
            running = [(g, s) for g in self.groups for s in g.samples if s.finish is None]
            if not running:
                assert dynamic is not None, "every group complete but fewer than the batch size"
                break  # dynamic sampling at max_num_gen_batches: too few groups kept
            self._generate_chunk(running, dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed * 1009 + calls), generate)
            calls += 1
            if dynamic is not None:
                judged += self._judge(dynamic, [g for g in self.groups if g.complete and not g.scored])
        done = kept()[:self.batch_size]
        if dynamic is not None:
            done += dynamic.top_up(step, done, judged, self.batch_size, draws)
        self.groups = [g for g in self.groups if g not in done]
        batch = self._batch(done)
        aborted = sum(1 for g in self.groups for s in g.samples if s.finish is None and s.tokens)
        batch.gen_metrics = {**m, "partial/resumed": float(resumed), "partial/aborted": float(aborted),
                             "partial/carried_groups": float(len(self.groups)), "partial/engine_calls": float(calls),
                             "partial/segments_mean": sum(s.segments for g in done for s in g.samples)
                             / max(1, sum(len(g.samples) for g in done))}
        if dynamic is not None:
            batch.scores = torch.cat([g.scored["scores"] for g in done])
            components = [g.scored["components"] for g in done]
            batch.score_components = None if components[0] is None else torch.cat(components)
            batch.score_fields = [f for g in done for f in g.scored["fields"]]
            batch.gen_metrics.update(dynamic.metrics(judged, draws))
        self._last = batch
        return batch

    def _age_out(self, step: int) -> dict[str, float]:
        """Step 1 of the module docstring (and, after a resume, the episodes' environments rebuilt): the
        counts of samples restarted and groups dropped."""
        m = {"partial/restarted": 0.0, "partial/dropped_groups": 0.0}
        eps = self.episodes
        if eps and self._replay:  # after a resume: environments stepped through their recorded actions again
            self._replay = False
            for s in eps.replay([(g.example, s) for g in self.groups for s in g.samples if s.finish is None]):
                s.restart()
                m["partial/restarted"] += 1
        for group in list(self.groups):
            stale = [s for s in group.samples if s.versions and (step - 1) - min(s.versions) > self.max_token_staleness]
            if stale and self.on_stale == "drop":
                self.groups.remove(group)
                if eps:
                    eps.close(group.samples)
                m["partial/dropped_groups"] += 1
                continue
            if eps:
                eps.close(stale)
            for s in stale:
                s.restart()
                m["partial/restarted"] += 1
        return m

    def _fill(self, n: int, draw: Callable[[], list], draws: int, dynamic: DynamicSampling | None) -> int:
        """Step 2: new groups of `n` samples until `in_flight` are in generation (dynamic sampling: while its
        bound allows another draw), and an environment for each new or restarted episode; -> the step's
        draws so far (`draws` before)."""
        while len(self.groups) < self.in_flight and (dynamic is None or dynamic.may_draw(draws)):
            for example in draw():
                self.groups.append(Group(self.next_key, example, [Sample() for _ in range(n)]))
                self.next_key += 1
            draws += 1
        if self.episodes:
            self.episodes.start([(g.example, s) for g in self.groups for s in g.samples
                                 if s.finish is None and not s.episode])
        return draws

    def _generate_chunk(self, running: list[tuple[Group, Sample]], params: SamplingParams,
                        generate: Callable[[list[list[int]], SamplingParams], RolloutBatch]) -> None:
        """Step 3, one engine call: every running sample's next tokens (at most `chunk_tokens`, and what its
        episode's budgets leave), appended; finished samples marked, ended actions stepped in their
        environments."""
        eps = self.episodes
        rooms = [eps.room(s) if eps else self.chunk_tokens for _, s in running]
        part = generate([list(g.example.prompt_ids) + s.tokens for g, s in running],
                        dataclasses.replace(params, max_new_tokens=min(self.chunk_tokens, max(rooms)),
                                            sample_window=None))
        ended = []
        for row, ((g, s), room) in enumerate(zip(running, rooms)):
            generated = int(part.response_mask[row].sum())
            length = min(generated, room)
            if part.routes is not None:
                s.routes = _fed_routes(s.routes, part.routes[row], part.prompt_ids.shape[1],
                                       len(g.example.prompt_ids) + len(s.tokens), length)
            s.tokens += part.response_ids[row, :length].tolist()
            s.log_probs += part.rollout_log_probs[row, :length].tolist()
            s.versions += [PENDING] * length
            s.segments += 1
            if eps:
                s.mask += [1] * length
                reason = eps.action_end(s, part.finish_reasons[row], cut=generated > room)
                if reason:
                    ended.append((g.example, s, reason))
            elif part.finish_reasons[row] == "stop":
                s.finish = "stop"
            elif len(s.tokens) >= self.max_new_tokens:
                s.finish = "length"
        if ended:
            eps.end_actions(ended)

    def _judge(self, dynamic: DynamicSampling, groups: list[Group]) -> list[tuple[Group, bool]]:
        """Score the newly complete `groups`; a group whose samples all have the same metric value leaves
        the pool (it is not trained on, unless the batch is topped up with it); -> (group, kept) each."""
        if not groups:
            return []
        scores, components, fields, keep = dynamic.judge(self._batch(groups))
        n = self.n
        out = []
        for i, (g, ok) in enumerate(zip(groups, keep)):
            g.scored = {"scores": scores[i * n:(i + 1) * n].clone(),
                        "components": None if components is None else components[i * n:(i + 1) * n].clone(),
                        "fields": list(fields[i * n:(i + 1) * n])}
            if not ok:
                self.groups.remove(g)
            out.append((g, ok))
        return out

    def _batch(self, groups: Sequence[Group]) -> RolloutBatch:
        """The groups' samples, prompt-major ([N, P] left-padded prompts, [N, R] right-padded responses)."""
        samples = [(i, g, s) for i, g in enumerate(groups) for s in g.samples]
        prompt_ids, prompt_mask = left_pad([list(g.example.prompt_ids) for _, g, _ in samples], self.pad_token_id)
        width = max(1, max(len(s.tokens) for _, _, s in samples))
        response_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((len(samples), width), dtype=torch.long)
        log_probs = torch.zeros((len(samples), width), dtype=torch.float32)
        versions = torch.zeros((len(samples), width), dtype=torch.long)
        for row, (_, _, s) in enumerate(samples):
            k = len(s.tokens)
            response_ids[row, :k] = torch.tensor(s.tokens, dtype=torch.long)
            response_mask[row, :k] = 1
            log_probs[row, :k] = torch.tensor(s.log_probs, dtype=torch.float32)
            versions[row, :k] = torch.tensor(s.versions, dtype=torch.long)
        episodes = self.episodes.batch_fields([s for _, _, s in samples], width) if self.episodes else {}
        return RolloutBatch(**{"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                               "response_mask": response_mask, "rollout_log_probs": log_probs,
                               "finish_reasons": [s.finish for _, _, s in samples],
                               "prompt_index": torch.tensor([i for i, _, _ in samples], dtype=torch.long),
                               "examples": [g.example for _, g, _ in samples], "token_versions": versions,
                               "routes": _batch_routes([(len(g.example.prompt_ids), s) for _, g, s in samples],
                                                       prompt_ids.shape[1], width),
                               **episodes})

    def _stamp_carried(self) -> None:
        """The carried tokens of the last generation take the version the schedule stamped its batch with."""
        if self._last is None:
            return
        version = self._last.policy_version
        for g in self.groups:
            for s in g.samples:
                s.versions = [version if v == PENDING else v for v in s.versions]
        self._last = None

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data (what torch.load(weights_only=True) reads): the carried groups, their prompts by index."""
        self._stamp_carried()
        return {"next_key": self.next_key, "groups": [
            {"key": g.key, "example": g.example.index, "scored": g.scored,
             "samples": [s.state() for s in g.samples]} for g in self.groups]}

    def load_state_dict(self, state: dict, examples: Sequence) -> None:
        """A checkpoint's carried groups; `examples`: the run's training prompts, by index. A state this run
        cannot carry on (another dataset, rollout.n or multi-turn setting, or a file not written by
        `state_dict`) raises CheckpointError naming what differs and the fix."""
        problem = state_problem(state, len(examples), self.n, multi_turn=self.episodes is not None)
        if problem:
            raise CheckpointError(
                f"the checkpoint's {STATE_FILE} (rollout.partial's carried samples) cannot be resumed: {problem}. "
                f"Fix: resume with the settings it was saved with (data.train_files, rollout.n, rollout.env), or "
                f"with rollout.partial.enable=false, which drops the carried samples (their prompts are then not "
                f"trained on until the next epoch)")
        self.next_key = state["next_key"]
        self.groups = [Group(g["key"], examples[g["example"]], [Sample.from_state(s) for s in g["samples"]],
                             g.get("scored")) for g in state["groups"]]
        self._last = None
        self._replay = self.episodes is not None


#: the file a checkpoint keeps `PartialRollouts.state_dict` in (megappo.trainer.checkpointing)
STATE_FILE = "partial_rollouts.pt"


def state_problem(state, num_examples: int, n: int, *, multi_turn: bool) -> str | None:
    """What keeps a saved `state_dict` from being resumed by a run with `num_examples` training prompts,
    `n` samples a prompt and multi-turn episodes or not; None: nothing."""
    if not isinstance(state, dict) or not isinstance(state.get("next_key"), int) \
            or not isinstance(state.get("groups"), list):
        return "it is not a carried-samples state (a dict with an int next_key and a list of groups)"
    fields = {f.name for f in dataclasses.fields(Sample)}
    for g in state["groups"]:
        if not isinstance(g, dict) or not {"key", "example", "samples"} <= set(g):
            return "a group without its key, prompt index and samples"
        if not isinstance(g["example"], int) or not 0 <= g["example"] < num_examples:
            return (f"a carried group's prompt is row {g['example']} of the training data, which has "
                    f"{num_examples} rows here")
        if not isinstance(g["samples"], list) or len(g["samples"]) != n:
            got = len(g["samples"]) if isinstance(g["samples"], list) else "no list of"
            return f"a carried group has {got} samples, rollout.n is {n} here"
        for sample in g["samples"]:
            if not isinstance(sample, dict) or set(sample) != fields:
                return f"a sample whose fields are not {sorted(fields)}"
            length = len(sample["tokens"])
            if any(len(sample[k]) != length for k in ("log_probs", "versions")) \
                    or sample["mask"] is not None and len(sample["mask"]) != length:
                return "a sample whose tokens, log-probs, versions and mask differ in length"
            if sample["episode"] is not None and not multi_turn:
                return "a sample of a multi-turn episode, and this run has no rollout.env"
            if multi_turn and length and sample["episode"] is None:
                return "a sample with tokens but no episode, and this run's rollout.env is multi-turn"
    return None


def _fed_routes(kept: torch.Tensor | None, call: torch.Tensor, call_prompt: int, context: int, new: int
               ) -> torch.Tensor:
    """A sample's routes after an engine call: `kept` [F, L, k] (the positions fed before; None: none), `call`
    [P' + R', L, k] the call's row (its `context` positions left-padded to `call_prompt`, then the response),
    `new` the tokens kept of the call. -> the routes of every position fed so far: the context's (those fed
    before keep theirs) and the new tokens' but the last, which no call has fed."""
    start = call_prompt - context
    out = torch.cat([call[start:call_prompt], call[call_prompt:call_prompt + max(0, new - 1)]])
    if kept is not None:
        out[:len(kept)] = kept
    return out.clone()


def _batch_routes(samples: Sequence[tuple[int, Sample]], prompt_width: int, width: int) -> torch.Tensor | None:
    """[N, P + R, L, k] from each (prompt length, sample)'s routes [prompt + tokens, L, k], its prompt
    left-padded to `prompt_width` positions and its response right-padded to `width`; None without routes."""
    if samples[0][1].routes is None:
        return None
    shape = tuple(samples[0][1].routes.shape[1:])
    out = torch.full((len(samples), prompt_width + width) + shape, UNKNOWN, dtype=samples[0][1].routes.dtype)
    for row, (prompt, s) in enumerate(samples):
        out[row, prompt_width - prompt:prompt_width - prompt + len(s.routes)] = s.routes
    return out


def token_age_metrics(batch: RolloutBatch, trainer_version: int) -> dict[str, float]:
    """`rollout/token_age/{mean,max}`: policy versions each response token is behind the trainer's
    `trainer_version` ({} without per-token versions)."""
    if batch.token_versions is None:
        return {}
    mask = batch.response_mask.bool()
    if not mask.any():
        return {}
    ages = (trainer_version - batch.token_versions)[mask].float()
    return {"rollout/token_age/mean": ages.mean().item(), "rollout/token_age/max": ages.max().item()}
