"""Multi-turn episodes inside partial rollouts (rollout.partial with a rollout.env): an episode generates
in chunks like a single-turn sample, an action may span chunks and steps, and the environment is
stepped when an action ends, between two engine calls.

`Episodes` owns the environments of the episodes in flight and the event loop their coroutines run on
(one for the run: an episode's environment lives across steps). Per sample (`megappo.rollout.partial.Sample`)
it keeps an `EpisodeState`: the episode's counters (turns, score, metrics, ...), where its current action
starts among its tokens, and the (start, end, finish reason) of every action it finished, which is what
rebuilds the environment after a resume: a checkpoint holds the tokens and these counters, not the
environment object, so `replay` makes a new environment, resets it and steps it through the recorded
actions again, checking that each observation is the recorded one. An environment that answers otherwise
(a non-deterministic tool) cannot continue the episode: the sample is generated again from its prompt.

Budgets are `megappo.rollout.multiturn`'s: at most `max_turns` actions of at most `max_turn_tokens` tokens,
the response (actions and observations) at most `max_new_tokens`; `room` is what a sample may generate in
the next call, and an action that reaches it ends with finish reason "length".

This module does not know the engines, the trainer, checkpoints' files, nor how groups are chosen.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any, Sequence

import torch

from megappo.envs.base import Action, Environment
from megappo.rollout.multiturn import _called, _made, end_turn, episode_metrics, episode_of, observation_ids


@dataclasses.dataclass
class EpisodeState:
    """One episode's counters (multiturn's `_Play` fields that `end_turn` and `episode_metrics` read)."""

    turns: int = 0
    actions_cut: int = 0
    unknown_observations: int = 0
    score: float = 0.0
    metrics: Counter = dataclasses.field(default_factory=Counter)
    finish_reason: str = "stop"
    done: bool = False
    clipped: bool = False
    over: bool = False
    action_start: int = 0  # the index among the sample's tokens where its current action starts
    actions: list = dataclasses.field(default_factory=list)  # [start, end, finish reason] of each finished action
    env: Environment | None = None  # None: not made yet, closed, or to be replayed after a resume

    def state(self) -> dict:
        """Plain data for the checkpoint (the environment object is not saved: `Episodes.replay`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "env"}
        return {**out, "metrics": dict(self.metrics), "actions": [list(a) for a in self.actions]}

    @classmethod
    def from_state(cls, state: dict) -> EpisodeState:
        return cls(**{**state, "metrics": Counter(state["metrics"]), "actions": [list(a) for a in state["actions"]]})


class Episodes:
    """The environments of rollout.env for partial rollouts (module docstring)."""

    def __init__(self, env: type[Environment], env_args: dict, *, tokenizer, encode_observation, max_turns: int,
                 max_turn_tokens: int | None, max_new_tokens: int):
        self.env_cls, self.env_args, self.tokenizer = env, dict(env_args), tokenizer
        self.encode, self.max_turns, self.budget = encode_observation, max_turns, max_new_tokens
        self.turn_tokens = max_turn_tokens or max_new_tokens
        self.loop = asyncio.new_event_loop()

    def _gather(self, coroutines) -> list:
        async def all_of(cs):
            return await asyncio.gather(*cs)

        return self.loop.run_until_complete(all_of(list(coroutines)))

    # ---- an episode's start and end -------------------------------------------------------------
    def start(self, items: Sequence[tuple[Any, Any]]) -> None:
        """New episodes for (example, sample) pairs: an environment each, reset with the example."""
        for example, s in items:
            s.mask, s.episode = [], EpisodeState(env=_made(lambda: self.env_cls(**self.env_args), example,
                                                           self.tokenizer))
        self._gather(_called(self._play(ex, s), "reset", s.episode.env.reset(episode_of(ex)), self.tokenizer)
                     for ex, s in items)

    def close(self, samples: Sequence) -> None:
        """Close the environments of `samples` that hold one (what close raises is ignored, as multiturn's)."""
        envs = [s.episode.env for s in samples if s.episode is not None and s.episode.env is not None]
        for s in samples:
            if s.episode is not None:
                s.episode.env = None

        async def all_closed():
            await asyncio.gather(*(e.close() for e in envs), return_exceptions=True)

        if envs:
            self.loop.run_until_complete(all_closed())

    # ---- generation -----------------------------------------------------------------------------
    def room(self, s) -> int:
        """Tokens the sample's current action may still take (its turn's and the episode's budget)."""
        return min(self.turn_tokens - (len(s.tokens) - s.episode.action_start), self.budget - len(s.tokens))

    def action_end(self, s, engine_reason: str, cut: bool) -> str | None:
        """The finish reason of the sample's current action after a call that gave it tokens ("stop": the
        engine stopped it; "length": a budget), None while it goes on; `cut`: the call's tokens were cut
        at the room."""
        if engine_reason == "stop" and not cut:
            return "stop"
        if self.room(s) <= 0:
            return "length"
        return None

    def end_actions(self, ended: Sequence[tuple[Any, Any, str]]) -> None:
        """Step the environments with the actions that ended [(example, sample, finish reason)]: counters,
        observations appended (masked), the episode finished (`sample.finish`) and closed when over."""
        actions = []
        for example, s, reason in ended:
            ids = s.tokens[s.episode.action_start:]
            actions.append(Action(text=self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=tuple(ids),
                                  finish_reason=reason, turn=s.episode.turns))
        results = self._gather(_called(self._play(ex, s), "step", s.episode.env.step(a), self.tokenizer, a.turn)
                               for (ex, s, _), a in zip(ended, actions))
        over = []
        for (example, s, _), action, result in zip(ended, actions, results):
            ep = s.episode
            ep.actions.append([ep.action_start, len(s.tokens), action.finish_reason])
            obs = end_turn(ep, action, result, self.encode, self.max_turns, self.budget, used=len(s.tokens))
            s.tokens += obs
            s.mask += [0] * len(obs)
            s.log_probs += [0.0] * len(obs)
            s.versions += [s.versions[-1] if s.versions else 0] * len(obs)  # an observation: its action's version
            ep.action_start = len(s.tokens)
            if ep.over:
                s.finish = ep.finish_reason
                over.append(s)
        self.close(over)

    # ---- after a resume -------------------------------------------------------------------------
    def replay(self, items: Sequence[tuple[Any, Any]]) -> list:
        """Environments for resumed unfinished episodes [(example, sample)], stepped through their recorded
        actions; -> the samples whose environment answered an action otherwise than recorded (to restart)."""
        fresh = [(ex, dataclasses.replace(s, episode=None)) for ex, s in items]
        self.start(fresh)
        for (_, s), (_, f) in zip(items, fresh):
            s.episode.env = f.episode.env
        differ = []
        for example, s in items:
            ep = s.episode
            for turn, (start, end, reason) in enumerate(ep.actions):
                action = Action(text=self.tokenizer.decode(s.tokens[start:end], skip_special_tokens=True),
                                token_ids=tuple(s.tokens[start:end]), finish_reason=reason, turn=turn)
                result = self._gather([_called(self._play(example, s), "step", ep.env.step(action), self.tokenizer,
                                               turn)])[0]
                following = ep.actions[turn + 1][0] if turn + 1 < len(ep.actions) else ep.action_start
                if observation_ids(ep.env, result, action, self.encode)[0] != s.tokens[end:following] or result.done:
                    differ.append(s)
                    break
        self.close(differ)
        return differ

    # ---- the batch --------------------------------------------------------------------------------
    def batch_fields(self, samples: Sequence, width: int) -> dict:
        """RolloutBatch's multi-turn fields of finished episodes: response_mask (actions), response_attention_mask
        (every real token), env_scores, env_metrics and clipped."""
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        real = torch.zeros((len(samples), width), dtype=torch.long)
        for row, s in enumerate(samples):
            mask[row, :len(s.mask)] = torch.tensor(s.mask, dtype=torch.long)
            real[row, :len(s.tokens)] = 1
        views = [_EpisodeView(s) for s in samples]
        return {"response_mask": mask, "response_attention_mask": real,
                "env_scores": torch.tensor([s.episode.score for s in samples], dtype=torch.float32),
                "env_metrics": episode_metrics(views, self.env_cls.metric_keys),
                "clipped": torch.tensor([s.episode.clipped for s in samples])}

    @staticmethod
    def _play(example, s):
        """What `_called` reads of an episode to name it in errors."""
        return _EpisodeView(s, example)


class _EpisodeView:
    """A sample's episode as multiturn's functions read a `_Play` (counters, response, env, example)."""

    def __init__(self, s, example=None):
        self._ep, self.response, self.example = s.episode, s.tokens, example

    def __getattr__(self, name):
        return getattr(self._ep, name)
