"""Multi-turn rollouts: episodes of an `Environment` driven through a rollout engine, token in, token out.

`run_episodes(generate, examples, params, ...)` plays one episode per sample (the n samples of
a prompt are n episodes, one environment instance each). Every turn it makes ONE batched
engine call, `generate(contexts, params)`, where each context is the episode's exact token ids
so far: prompt + actions + observations. Nothing is decoded and re-encoded; `Action.text` is a
decode for the environment's convenience only. The environments' `reset` / `step` / `close`
of all episodes run concurrently (asyncio.gather on an event loop of the runner's; the engine
is called between them, outside that loop, since SGLang's engine runs a loop of its own). Turn 0 asks the engine for `n` samples of
each prompt with the step's seed, exactly the single-turn call (`sample_window` included); turn
t > 0 asks for one sample per context with seed + t * TURN_SEED_STRIDE and no sample window, so
runs are reproducible.

Budgets: at most `max_turns` actions, each at most `max_turn_tokens` tokens, and the episode's
response (actions + observations) at most `params.max_new_tokens` tokens. An observation is
appended only when the episode goes on and an action token still fits after it, so a response
always ends with an action.

Observation ids (`ObservationEncoder`): with a chat template, the observation turn alone (a
turn of the environment's `observation_role` plus the generation prompt of the next assistant
turn), taken as the difference between two renderings of one conversation, with and without
the observation (so a default system prompt a template inserts is not repeated; a template that
renders the last assistant turn differently, as Qwen3 does, is cut after that turn's closer instead), preceded by
what the template puts after an assistant turn's stop token (Qwen's "\\n" after <|im_end|>; the
whole turn closer when the action was cut by its token budget). Every rendering takes the
template arguments the prompts took (data.apply_chat_template_kwargs: Qwen3's enable_thinking=false
opens the next assistant turn with an empty think block, as the prompt). Without a chat template the
text is encoded as is. Observations are checked first (`observation_ids`): one that is not text
raises a TypeError naming the environment class; one with characters the tokenizer has no
token for (the built-in character tokenizers encode them as <pad>) raises an ObservationError
with the fix under the `error` policy (rollout.bad_observation_policy), or is counted
(env/unknown_char_observations) and warned about once under `warn`.

The result is one `RolloutBatch`: response = actions and observations, `response_mask` 1 on
action tokens only, `response_attention_mask` 1 on every real token, log-probs of action tokens,
`env_scores` (the sum of each episode's step rewards), `env_metrics` (`env/...`, `episode_metrics`)
and `clipped` (episodes that ran out of `max_new_tokens`: response_length/clip_ratio; an action
cut by `max_turn_tokens` alone counts in env/action_clip_ratio only).

What an environment raises (its constructor, `reset`, `step`) ends the rollout with a
`UserCodeError` that names the class and method, the episode's dataset row and prompt, and the turn.

Shape legend: N episodes (prompts x n, prompt-major), P prompt length, R response length.

This module does not know about Megatron, PPO, reward functions or configs.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from megappo.envs.base import Action, Environment, Episode, StepResult
from megappo.rollout.engine import left_pad
from megappo.data.tokenizer import characters_encoded_as, chat_template_ids, unknown_token
from megappo.types import RolloutBatch, SamplingParams
from megappo.user_code import UserCodeError

#: turn t of a step samples with seed + t * TURN_SEED_STRIDE (turn 0: the single-turn seed)
TURN_SEED_STRIDE = 1_000_003

Generate = Callable[[list[list[int]], SamplingParams], RolloutBatch]


def turn_seed(seed: int | None, turn: int) -> int | None:
    return None if seed is None else seed + turn * TURN_SEED_STRIDE


class ObservationError(ValueError):
    """An observation cannot be appended as tokens: the chat template cannot render its turn as a
    continuation of the episode, or the tokenizer has no token for some of its characters."""


class ObservationEncoder:
    """Observation text -> the token ids appended to an episode after an action (module docstring)."""

    def __init__(self, tokenizer, role: str, use_chat_template: bool, bad_observation_policy: str = "error",
                 template_kwargs: dict | None = None):
        if bad_observation_policy not in ("error", "warn"):
            raise ValueError(f"bad_observation_policy={bad_observation_policy!r}: must be 'error' or 'warn'")
        self.tokenizer, self.role, self.policy = tokenizer, role, bad_observation_policy
        self.unk = unknown_token(tokenizer)  # read once: it parses the whole tokenizer.json
        self.warned = False
        self.chat = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
        self.template_kwargs = dict(template_kwargs or {})  # data.apply_chat_template_kwargs, as the prompts'
        self.closer: list[int] = []
        if self.chat:
            user = {"role": "user", "content": "Q"}
            self.base = [user, {"role": "assistant", "content": "A"}]
            self.base_ids = self._render(self.base, False)
            self.user_len = len(self._render([user], False))  # where the assistant turn starts at the latest
            whole = [self._render([user, {"role": "assistant", "content": c}], False) for c in "AB"]
            # the contents start where the two renderings first differ (not where the generation prompt ends:
            # template arguments such as enable_thinking=false put an empty think block in that prompt only)
            start = next((i for i, (a, b) in enumerate(zip(*whole)) if a != b), min(map(len, whole)))
            tails = [w[start:] for w in whole]
            # the common end of two assistant turns, never reaching into their contents' tokens
            room = min(len(t) - len(tokenizer.encode(c, add_special_tokens=False)) for t, c in zip(tails, "AB"))
            k = 0
            while k < room and tails[0][-1 - k] == tails[1][-1 - k]:
                k += 1
            self.closer = tails[0][len(tails[0]) - k:]  # what the template puts after an assistant message

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return chat_template_ids(self.tokenizer, messages, generation_prompt=generation_prompt,
                                 template_kwargs=self.template_kwargs)

    def __call__(self, text: str, action_ids: Sequence[int]) -> list[int]:
        if not self.chat:
            return self.tokenizer.encode(text, add_special_tokens=False)
        full = self._render([*self.base, {"role": self.role, "content": text}], True)
        turn = full[len(self.base_ids):] if full[:len(self.base_ids)] == self.base_ids else self._after_assistant(full)
        if self.closer and action_ids and action_ids[-1] == self.closer[0]:
            return self.closer[1:] + turn  # the action's stop token opened the closer: the rest of it
        return self.closer + turn  # the action was cut by its budget: close the assistant turn

    def check(self, text: str, env: type) -> bool:
        """Whether `text` (an observation of `env`) has characters the tokenizer has no token for:
        raises ObservationError under the `error` policy; under `warn`, True (printed once)."""
        chars = characters_encoded_as(self.tokenizer, self.unk, [text])[0]
        if not chars:
            return False
        what = (f"{env_name(env)}.step returned StepResult.observation={text!r:.60} with "
                f"characters the tokenizer has no token for: {''.join(dict.fromkeys(chars))!r} (encoded as "
                f"{self.unk!r}, so the model reads that instead)")
        fix = ("use a tokenizer that has them (model.tokenizer), or write the environment's observations with "
               "characters the tokenizer has")
        if self.policy == "error":
            raise ObservationError(f"{what}. Fix: {fix}; or set rollout.bad_observation_policy=warn to train on such "
                                   "observations as they are (counted in env/unknown_char_observations).")
        if not self.warned:
            self.warned = True
            print(f"megappo: warning: {what}. Fix: {fix}.\nmegappo: rollout.bad_observation_policy=warn: training on "
                  "such observations as they are; env/unknown_char_observations counts them per step.", flush=True)
        return True

    def _after_assistant(self, full: list[int]) -> list[int]:
        """The observation turn of `full` when the template renders the assistant turn differently
        once it is no longer the last message (Qwen3 drops the empty <think> block): what follows
        the first "A" + turn closer after the user turn."""
        needle = self.tokenizer.encode("A", add_special_tokens=False) + self.closer
        for i in range(self.user_len, len(full) - len(needle) + 1):
            if full[i:i + len(needle)] == needle:
                return full[i + len(needle):]
        raise ObservationError(
            f"the chat template renders a '{self.role}' turn after an assistant turn by changing the turns before it, "
            "so the observation cannot be appended as tokens. Fix: set the environment's observation_role to a "
            "role the template renders as a plain next turn (e.g. 'user' or 'tool').")


def observation_encoder(tokenizer, role: str, use_chat_template: bool, bad_observation_policy: str = "error",
                        template_kwargs: dict | None = None) -> ObservationEncoder:
    """One encoder per (tokenizer, role, template use, policy, template arguments), built on first use."""
    return _observation_encoder(tokenizer, role, use_chat_template, bad_observation_policy,
                                json.dumps(template_kwargs or {}, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _observation_encoder(tokenizer, role: str, use_chat_template: bool, bad_observation_policy: str,
                         template_kwargs: str) -> ObservationEncoder:
    return ObservationEncoder(tokenizer, role, use_chat_template, bad_observation_policy, json.loads(template_kwargs))


def env_name(cls: type) -> str:
    """How a message names an environment class: module:Class, or path/to/file.py:Class for one loaded from a file."""
    code = getattr(getattr(cls, "step", None), "__code__", None)  # a file's module is not in sys.modules
    where = code.co_filename if code is not None and cls.__module__.startswith("megappo_user_") else cls.__module__
    return f"{where}:{cls.__qualname__}"


def observation_ids(env: Environment, result: StepResult, action: Action, encode: ObservationEncoder | Callable
                    ) -> tuple[list[int], bool]:
    """The ids of `result.observation` ([] for None) and whether it had unknown characters
    (`ObservationEncoder.check`); a TypeError naming the environment when it is not text."""
    text = result.observation
    if text is None:
        return [], False
    if not isinstance(text, str):
        raise TypeError(f"{env_name(type(env))}.step returned StepResult.observation={text!r:.60} of "
                        f"type {type(text).__name__}; an observation is text (str) or None. Fix: return the text "
                        f"of the observation turn, e.g. StepResult(observation=str(...)).")
    check = getattr(encode, "check", None)  # a plain callable (fixed ids in tests) has no tokenizer to check with
    unknown = bool(check and check(text, type(env)))
    return encode(text, action.token_ids), unknown


@dataclasses.dataclass
class _Play:
    """One episode in progress."""

    example: Any  # the orchestrator's prompt record (prompt_ids, ground_truth, extra, data_source, index)
    prompt_index: int
    env: Environment
    response: list[int] = dataclasses.field(default_factory=list)
    action_mask: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    actions_cut: int = 0  # actions that ended at a token budget (finish reason "length")
    unknown_observations: int = 0  # observations with characters the tokenizer has no token for
    score: float = 0.0
    metrics: Counter = dataclasses.field(default_factory=Counter)
    finish_reason: str = "stop"
    done: bool = False  # the environment ended it
    clipped: bool = False  # it ran out of the episode's token budget (max_new_tokens)
    over: bool = False

    def context(self) -> list[int]:
        return list(self.example.prompt_ids) + self.response


def episode_of(example) -> Episode:
    return Episode(prompt_ids=tuple(example.prompt_ids), ground_truth=example.ground_truth,
                   extra=dict(example.extra), data_source=example.data_source, index=example.index)


def run_episodes(generate: Generate, examples: Sequence, params: SamplingParams, *,
                 make_env: Callable[[], Environment], tokenizer, encode_observation: ObservationEncoder | Callable,
                 max_turns: int, max_turn_tokens: int | None, pad_token_id: int) -> RolloutBatch:
    """`params.n` episodes of every example, played to the end; see the module docstring."""
    plays = [_Play(example=ex, prompt_index=i, env=_made(make_env, ex, tokenizer)) for i, ex in enumerate(examples)
             for _ in range(params.n)]
    loop = asyncio.new_event_loop()  # the environments' loop; the engine is called outside it (SGLang runs its own)
    try:
        logprob_mode = _play_all(loop, generate, examples, plays, params, tokenizer, encode_observation, max_turns,
                                 max_turn_tokens or params.max_new_tokens)
    finally:
        loop.run_until_complete(_gather([p.env.close() for p in plays], return_exceptions=True))
        loop.close()
    return _batch(plays, pad_token_id, logprob_mode)


async def _gather(coroutines: list, return_exceptions: bool = False) -> list:
    return await asyncio.gather(*coroutines, return_exceptions=return_exceptions)


def _prompt_text(tokenizer, example) -> str:
    return tokenizer.decode(list(example.prompt_ids), skip_special_tokens=True)


def _made(make_env: Callable[[], Environment], example, tokenizer) -> Environment:
    """A new environment; what its constructor raises is a UserCodeError naming the class and the row."""
    try:
        return make_env()
    except Exception as e:
        raise UserCodeError("the constructor of rollout.env", e, row=example.origin,
                            prompt=_prompt_text(tokenizer, example)) from e


async def _called(p: _Play, method: str, call, tokenizer, turn: int | None = None):
    """`await call` of the episode's environment; what it raises is a UserCodeError naming the
    environment's class and method, the episode's dataset row and the turn."""
    try:
        return await call
    except UserCodeError as e:  # code the environment called (a reward function): its own name, our row and turn
        raise e.at(row=p.example.origin, turn=turn, prompt=_prompt_text(tokenizer, p.example)) from e.__cause__
    except Exception as e:
        raise UserCodeError(f"environment {env_name(type(p.env))}.{method}", e, row=p.example.origin, turn=turn,
                            prompt=_prompt_text(tokenizer, p.example)) from e


def _play_all(loop, generate, examples, plays: list[_Play], params, tokenizer, encode_observation, max_turns,
              turn_tokens) -> str:
    def gather(coroutines):
        return loop.run_until_complete(_gather(list(coroutines)))

    budget = params.max_new_tokens
    gather(_called(p, "reset", p.env.reset(episode_of(p.example)), tokenizer) for p in plays)
    active, turn, logprob_mode = plays, 0, params.logprob_mode
    while active:
        limit = min(turn_tokens, max(budget - len(p.response) for p in active))
        # a sample window (this call is one part of a larger one) holds for turn 0 only, which is the
        # single-turn call of these prompts; a later turn has one context per episode still running, and
        # which episodes of the whole call still run is not known here, so there is no window of the whole
        # turn to give: it is dropped (later turns' tokens then depend on the split; a caller that splits
        # across replicas splits each turn's engine call, in `generate`, and windows that call itself)
        turn_params = dataclasses.replace(params, n=params.n if turn == 0 else 1, max_new_tokens=limit,
                                          seed=turn_seed(params.seed, turn),
                                          sample_window=params.sample_window if turn == 0 else None)
        contexts = [list(e.prompt_ids) for e in examples] if turn == 0 else [p.context() for p in active]
        out = generate(contexts, turn_params)
        logprob_mode = out.logprob_mode
        actions = []
        for row, p in enumerate(active):
            length = int(out.response_mask[row].sum())
            room = min(turn_tokens, budget - len(p.response))
            ids = out.response_ids[row, :min(length, room)].tolist()
            reason = "length" if length > room else out.finish_reasons[row]
            p.response += ids
            p.action_mask += [1] * len(ids)
            p.log_probs += out.rollout_log_probs[row, :len(ids)].tolist()
            p.finish_reason = reason
            actions.append(Action(text=tokenizer.decode(ids, skip_special_tokens=True), token_ids=tuple(ids),
                                  finish_reason=reason, turn=turn))
        results: list[StepResult] = gather(_called(p, "step", p.env.step(a), tokenizer, turn)
                                           for p, a in zip(active, actions))
        for p, action, result in zip(active, actions, results):
            _record(p, action, result, encode_observation, max_turns, budget)
        active = [p for p in active if not p.over]
        turn += 1
    return logprob_mode


def _record(p: _Play, action: Action, result: StepResult, encode_observation, max_turns: int, budget: int) -> None:
    """Add a step's reward and counters; end the episode or append its observation."""
    obs = end_turn(p, action, result, encode_observation, max_turns, budget, used=len(p.response))
    p.response += obs
    p.action_mask += [0] * len(obs)
    p.log_probs += [0.0] * len(obs)


def end_turn(p, action: Action, result: StepResult, encode_observation, max_turns: int, budget: int, *,
             used: int) -> list[int]:
    """A finished action's step result on an episode's counters `p` (turns, actions_cut, clipped, score, metrics,
    done, over, finish_reason, unknown_observations; its `env`), `used` response tokens so far (the action's
    included) -> the observation ids to append ([] when the episode is over: `p.over`)."""
    p.turns += 1
    p.actions_cut += action.finish_reason == "length"
    p.clipped = action.finish_reason == "length" and used >= budget
    p.score += float(result.reward)
    p.metrics.update({k: float(v) for k, v in result.metrics.items()})
    p.finish_reason = action.finish_reason
    if result.done:
        p.done = p.over = True
        return []
    room = budget - used
    obs, unknown = observation_ids(p.env, result, action, encode_observation)
    p.unknown_observations += unknown
    if p.turns >= max_turns or len(obs) >= room:
        p.over = True
        if len(obs) >= room:  # no action token fits after the observation: the token budget ran out
            p.finish_reason, p.clipped = "length", True
        return []
    return obs


def _batch(plays: list[_Play], pad_token_id: int, logprob_mode: str) -> RolloutBatch:
    prompt_ids, prompt_mask = left_pad([list(p.example.prompt_ids) for p in plays], pad_token_id)
    n, width = len(plays), max(1, max(len(p.response) for p in plays))
    response = torch.full((n, width), pad_token_id, dtype=torch.long)
    action = torch.zeros((n, width), dtype=torch.long)
    real = torch.zeros((n, width), dtype=torch.long)
    log_probs = torch.zeros((n, width), dtype=torch.float32)
    for i, p in enumerate(plays):
        k = len(p.response)
        response[i, :k] = torch.tensor(p.response, dtype=torch.long)
        action[i, :k] = torch.tensor(p.action_mask, dtype=torch.long)
        real[i, :k] = 1
        log_probs[i, :k] = torch.tensor(p.log_probs, dtype=torch.float32)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response, response_mask=action,
                        rollout_log_probs=log_probs, finish_reasons=[p.finish_reason for p in plays],
                        prompt_index=torch.tensor([p.prompt_index for p in plays], dtype=torch.long),
                        logprob_mode=logprob_mode, response_attention_mask=real,
                        env_scores=torch.tensor([p.score for p in plays], dtype=torch.float32),
                        env_metrics=episode_metrics(plays), clipped=torch.tensor([p.clipped for p in plays]))


def episode_metrics(plays: Sequence, metric_keys: Sequence[str] | None = None) -> dict[str, float]:
    """env/turns_mean, env/episode_length_mean (response tokens, observations included),
    env/truncated_frac (episodes the environment did not end: turn or token budget),
    env/action_clip_ratio (actions that ended at a token budget, of all actions),
    env/unknown_char_observations (observations with characters the tokenizer has no token for),
    and the sum over the episodes of every StepResult.metrics key as env/<key>: each key of the
    environment's `metric_keys` always (0 when no episode reported it), any other when reported. `plays`: the
    episodes (_Play, or anything with their counters and `response`); `metric_keys`: None, the first one's env's."""
    n = len(plays)
    out = {"env/turns_mean": sum(p.turns for p in plays) / n,
           "env/episode_length_mean": sum(len(p.response) for p in plays) / n,
           "env/truncated_frac": sum(not p.done for p in plays) / n,
           "env/action_clip_ratio": sum(p.actions_cut for p in plays) / max(1, sum(p.turns for p in plays)),
           "env/unknown_char_observations": float(sum(p.unknown_observations for p in plays))}
    keys = type(plays[0].env).metric_keys if metric_keys is None else metric_keys
    totals: Counter = Counter({k: 0.0 for k in keys})
    for p in plays:
        totals.update(p.metrics)
    out.update({f"env/{k}": float(v) for k, v in sorted(totals.items())})
    return out


#: episode_metrics' means over episodes (the rest, but the clip ratio, are sums)
_EPISODE_MEANS = ("env/turns_mean", "env/episode_length_mean", "env/truncated_frac")


def merge_episode_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """episode_metrics of several batches of episodes [(metrics, episodes)] as one batch's: the
    means weighed by episodes, the clip ratio by actions (turns), the sums added."""
    episodes = sum(n for _, n in parts)
    turns = [m["env/turns_mean"] * n for m, n in parts]
    out = {}
    for key in dict.fromkeys(k for m, _ in parts for k in m):
        if key in _EPISODE_MEANS:
            out[key] = sum(m[key] * n for m, n in parts) / episodes
        elif key == "env/action_clip_ratio":
            out[key] = sum(m[key] * max(1.0, t) for (m, _), t in zip(parts, turns)) / max(1.0, sum(turns))
        else:
            out[key] = sum(m.get(key, 0.0) for m, _ in parts)
    return out


# -- the random-policy reference score ---------------------------------------------------------

def random_policy_episode_score(examples: Sequence, make_env: Callable[[], Environment], tokenizer,
                                encode_observation: ObservationEncoder, *, vocab_size: int, max_turns: int,
                                max_turn_tokens: int | None, max_new_tokens: int) -> float:
    """The exact mean episode score (the sum of step rewards) of a policy that draws every action
    token uniformly from the vocabulary, stopping at EOS or the turn's budget, under the same
    budgets as `run_episodes`. Enumerates every action of every turn (branching on a deep copy
    of the environment), so only for tiny vocabularies and turn budgets; actions with the same
    text, finish reason and length are taken as one (an environment that reads token ids
    needs more). Distinct examples (prompt, ground truth, extra) are scored once, weighed by
    how often they occur."""
    eos = tokenizer.eos_token_id
    turn_tokens = max_turn_tokens or max_new_tokens

    @functools.cache
    def actions(limit: int) -> list[tuple[list[int], str, float]]:
        """(ids, finish reason, probability) of every distinct action of at most `limit` tokens."""
        groups: dict[tuple, list] = {}
        frontier: list[list[int]] = [[]]
        while frontier:
            ids = frontier.pop()
            if ids and (ids[-1] == eos or len(ids) == limit):
                reason = "stop" if ids[-1] == eos else "length"
                key = (tokenizer.decode(ids, skip_special_tokens=True), reason, len(ids))
                entry = groups.setdefault(key, [ids, reason, 0.0])
                entry[2] += float(vocab_size) ** -len(ids)
            else:
                frontier.extend(ids + [t] for t in range(vocab_size))
        return [tuple(v) for v in groups.values()]

    async def value(env: Environment, used: int, turn: int) -> float:
        room = min(turn_tokens, max_new_tokens - used)
        total = 0.0
        for ids, reason, prob in actions(room):
            branch = copy.deepcopy(env)
            action = Action(text=tokenizer.decode(ids, skip_special_tokens=True), token_ids=tuple(ids),
                            finish_reason=reason, turn=turn)
            result = await branch.step(action)
            score = float(result.reward)
            if not result.done and turn + 1 < max_turns:
                obs = observation_ids(branch, result, action, encode_observation)[0]
                if len(obs) < max_new_tokens - used - len(ids):
                    score += await value(branch, used + len(ids) + len(obs), turn + 1)
            total += prob * score
        return total

    def key(ex) -> str:
        return json.dumps([list(ex.prompt_ids), ex.ground_truth, ex.extra], sort_keys=True, default=str)

    counts = Counter(key(ex) for ex in examples)
    distinct = {key(ex): ex for ex in examples}

    async def score_all() -> float:
        total = 0.0
        for k, ex in distinct.items():
            env = make_env()
            await env.reset(episode_of(ex))
            total += counts[k] * await value(env, 0, 0)
        return total / len(examples)

    return asyncio.run(score_all())
