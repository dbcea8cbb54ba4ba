"""The environment interface for multi-turn rollouts (below rollout/, which runs episodes: torch-free).

A user writes a subclass of `Environment` in their own module and names it in a recipe
(`rollout.env: my_pkg.my_env:MyEnv`, its keyword arguments in `rollout.env_args`). The
multi-turn rollout creates one instance per episode, calls `reset` with the episode's
dataset row, then alternates: the engine generates an action (token ids, continuing from
the exact ids it produced so far), the environment answers with a `StepResult`. The
observation text is rendered as one chat turn of role `observation_role` and appended to
the episode as token ids; the model never sees its own tokens decoded and re-encoded.
An episode ends when `done` is true or when its turn or token budget runs out.

Methods are coroutines so that many episodes (one instance each) run concurrently, and an
environment that waits on I/O (a sandbox, an HTTP tool) does not hold the others up; a
CPU-bound environment may simply compute and return.

This module does not know about engines, tokenizers, Megatron or PPO.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Episode:
    """The dataset row an episode starts from (what reward functions also see)."""

    prompt_ids: tuple[int, ...]  # the rendered prompt, as the engine receives it
    ground_truth: Any  # the row's answer (reward_model.ground_truth in verl's layout), or None
    extra: dict  # the row's other columns (extra_info)
    data_source: str
    index: int  # the row's position among the prompts (0-based; errors name the row by its file and line)


@dataclasses.dataclass(frozen=True)
class Action:
    """What the model produced in one turn."""

    text: str  # decoded for the environment's convenience (special tokens skipped)
    token_ids: tuple[int, ...]  # the exact ids the engine sampled, EOS/stop token included
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (the turn's token budget)
    turn: int  # 0 for the first action of the episode


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The environment's answer to an action."""

    #: text appended as a turn of `observation_role`; None: nothing. Only characters the tokenizer
    #: has a token for (rollout.bad_observation_policy says what happens to the others)
    observation: str | None = None
    reward: float = 0.0  # added to the episode's return (the sequence score)
    done: bool = False  # the episode ends after this action
    #: counters summed into per-step metrics as `env/<key>` (e.g. {"tool_calls": 2, "tool_errors": 1});
    #: list the keys in Environment.metric_keys so that every step logs them
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class Environment:
    """Subclass and override `step` (and `reset` when the episode needs set-up).

    One instance serves one episode. `__init__` receives `rollout.env_args` as keyword
    arguments. The single-turn default (`SingleTurn`) ends every episode after the first
    action with reward 0: the reward functions then score the response as usual.
    """

    #: the chat role observations are rendered as ("tool" for tool results, "user" for
    #: a simulated user); the chat template decides how that role looks
    observation_role: str = "tool"
    #: the StepResult.metrics keys the environment reports: every step's record has each as
    #: `env/<key>`, 0 when no episode of the step reported it (a key not listed here is logged
    #: only in the steps where some episode reports it)
    metric_keys: tuple[str, ...] = ()

    def __init__(self, **kwargs: Any):
        if kwargs:
            raise TypeError(f"{type(self).__name__} takes no arguments, got {sorted(kwargs)} "
                            "(rollout.env_args). Fix: remove them or accept them in __init__.")

    async def reset(self, episode: Episode) -> None:
        """Called once before the first action."""

    async def step(self, action: Action) -> StepResult:
        raise NotImplementedError

    async def close(self) -> None:
        """Called once when the episode ends (release sandboxes, files)."""


class SingleTurn(Environment):
    """Today's behaviour: one response per prompt, scored by the reward functions."""

    async def step(self, action: Action) -> StepResult:
        return StepResult(done=True)
