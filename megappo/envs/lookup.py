"""The `lookup` environment: a procedural task a model can only solve with the environment's help.

Each row (`megappo.data.prompts.lookup_rows`) hides a value (a digit, the row's ground truth) behind a
key named in the prompt ("3?": what is stored under key 3?). The value is drawn per row, so
the prompt says nothing about it: a policy that answers at once is right one time in ten. The
model looks the key up by starting an action with "=", the environment answers with the
value as an observation ("7>"), and the model answers it: "7" then EOS.

Rewards (the episode's score is their sum): `lookup_reward` for the first lookup; for the
answer (any action that is not a lookup; it ends the episode) `answer_reward` when it is the
value followed by EOS, half of it when the value is followed by more tokens, 0 otherwise.
The CPU demo recipe (recipes/demo-multiturn-cpu.yaml) trains a tiny model on it.

This module does not know about tokenizers, engines or PPO.
"""

from __future__ import annotations

from megappo.envs.base import Action, Environment, Episode, StepResult


class LookupEnv(Environment):
    observation_role = "tool"
    metric_keys = ("lookups", "correct")

    def __init__(self, lookup_reward: float = 0.2, answer_reward: float = 0.8):
        if not (0 <= lookup_reward and 0 < answer_reward):
            raise ValueError(f"lookup_reward={lookup_reward} must be >= 0 and answer_reward={answer_reward} > 0")
        self.lookup_reward, self.answer_reward = float(lookup_reward), float(answer_reward)
        self.value, self.looked_up = "", False

    async def reset(self, episode: Episode) -> None:
        self.value, self.looked_up = str(episode.ground_truth), False

    async def step(self, action: Action) -> StepResult:
        if action.text.startswith("="):
            first, self.looked_up = not self.looked_up, True
            return StepResult(observation=f"{self.value}>", reward=self.lookup_reward if first else 0.0,
                              metrics={"lookups": 1.0})
        if not action.text.startswith(self.value):
            return StepResult(done=True)
        stopped = action.text == self.value and action.finish_reason == "stop"
        return StepResult(reward=self.answer_reward * (1.0 if stopped else 0.5), done=True,
                          metrics={"correct": float(stopped)})
