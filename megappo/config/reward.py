"""Scoring: `reward` (rule-based functions, their weights, limits and workers; a reward model and
its passes), DAPO's overlong shaping `reward.overlong_buffer`, the code sandbox `reward.sandbox` and the
LLM judge `reward.judge`.

Cross-section rule beside these sections: `check_overlong_buffer` (the buffer fits the response
budget), which reads the root `Config` (megappo.config.root, which imports this module).

Owns: these sections, their defaults and checks. Does not know the reward functions
(megappo.rewards): they are names here, resolved at start-up.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, Optional

from megappo.config.model import RoleParallelConfig
from megappo.config.schema import _at_least, _default, _require, _Section
from megappo.errors import P


@dataclasses.dataclass(frozen=True)
class OverlongBufferConfig(_Section):
    """DAPO's overlong reward shaping (verl's dapo reward manager, `overlong_buffer_cfg`)."""

    enable: bool = False
    """DAPO's overlong shaping ([dapo.md](dapo.md)): a response of L tokens gets `min(0, -(L -
    (rollout.max_new_tokens - len)) / len * penalty_factor)`."""
    len: int = 0
    """Tokens before `rollout.max_new_tokens` over which the penalty grows (> 0 when enabled)."""
    penalty_factor: float = 1.0
    """The penalty of a response that reaches `rollout.max_new_tokens` (linear from 0 at the buffer's start)."""
    log: bool = False
    """Also log `reward/overlong_reward` and `reward/overlong` (fraction penalised)."""

    def check(self) -> None:
        _require(not self.enable or self.len > 0, f"{P}len={self.len} must be > 0 when {P}enable=true. Fix: e.g. "
                 f"{P}len=128 (tokens), or {P}enable=false.")
        _require(self.penalty_factor >= 0, f"{P}penalty_factor={self.penalty_factor} must be >= 0. Fix: e.g. "
                 f"{P}penalty_factor=1.0.")


@dataclasses.dataclass(frozen=True)
class SandboxConfig(_Section):
    """Where the `code` reward function runs generated programs (verl's `reward_model.sandbox_fusion`)."""

    url: Optional[str] = None
    """A SandboxFusion service (`http://host:port`, its `/run_code`; `python -m megappo.rewards.sandbox_server`
    serves one); `null`: megappo's local executor ([rewards.md](rewards.md#the-code-reward))."""
    api_key_env: Optional[str] = None
    """The name of an environment variable holding the service's key, sent as `Authorization: Bearer` (a
    `sandbox_server --api-key-env` service); `null`: none."""
    max_concurrent: int = 64
    """Programs run at once per process (local runs, or requests to the service), as verl's."""
    memory_limit_mb: int = 1024
    """Address space of one program (MiB), as verl's."""
    run_timeout_s: float = 10.0
    """Wall-clock limit of one test case's program; past it the case fails."""
    isolation: Literal["bwrap", "unshare", "none"] = "bwrap"
    """The local executor's sandbox: `bwrap` (bubblewrap: namespaces, a read-only view of /usr and Python
    only), `unshare` (namespaces, the host's files visible but read-only), `none` (limits only; trusted programs only)."""
    allow_weaker: bool = False
    """Where `isolation` is unavailable, use the next weaker one with a warning instead of refusing to start."""
    all_or_nothing: bool = False
    """Score 1 only when every test case passes (else 0); `false`: the fraction passed, as verl."""

    def check(self) -> None:
        _at_least(self, max_concurrent=1, memory_limit_mb=64)
        _require(self.run_timeout_s > 0, f"{P}run_timeout_s={self.run_timeout_s} must be > 0. Fix: e.g. "
                 f"{P}run_timeout_s=10.")
        _require(self.url is None or self.url.startswith(("http://", "https://")),
                 f"{P}url={self.url!r} is not an http(s) URL. Fix: e.g. {P}url=http://localhost:8080, or null for "
                 "the local executor.")


#: the judge's score: the last `Score: x` (or `score = x`) of its answer
DEFAULT_SCORE_PATTERN = r"(?i)score\s*[:=]\s*\**\s*([-+]?\d*\.?\d+)"


@dataclasses.dataclass(frozen=True)
class JudgeConfig(_Section):
    """The `judge` reward function: an LLM asked over an OpenAI-compatible chat-completions endpoint."""

    url: Optional[str] = None
    """The endpoint's base (`http://host:port`; requests go to `{url}/v1/chat/completions`, a trailing `/v1`
    is taken as given); `python -m megappo.rollout.judge_server` serves one ([rewards.md](rewards.md#llm-judge))."""
    model: str = "judge"
    """The request's `model` (the served model's name; megappo's judge server takes any)."""
    api_key_env: Optional[str] = None
    """The name of an environment variable holding the API key, sent as `Authorization: Bearer`; `null`: none."""
    template: Optional[str] = None
    """The user message, a Python format string with `{prompt}`, `{response}`, `{ground_truth}` (literal braces
    doubled); `null`: megappo's, which asks for `Score: 1` (correct) or `Score: 0`."""
    score_pattern: str = DEFAULT_SCORE_PATTERN
    """A regex with one group: its last match in the answer is the score (a number); no match: unparseable."""
    min_score: Optional[float] = None
    """Scores below it are raised to it; `null`: no lower bound."""
    max_score: Optional[float] = None
    """Scores above it are lowered to it; `null`: no upper bound."""
    max_concurrent: int = 8
    """Requests in flight at once per process."""
    timeout_s: float = 60.0
    """One request's time limit; past it the judgement failed (counted, `on_failure`)."""
    retries: int = 3
    """Retries of a request the endpoint refused, or answered 429 or 5xx, with exponential backoff (counted)."""
    backoff_s: float = 1.0
    """The first retry's wait; each next one waits twice as long."""
    requests_per_s: float = 0.0
    """At most this many requests start per second per process (external APIs' rate limits); `0`: no limit."""
    on_failure: Literal["error", "skip_group", "score"] = "error"
    """A judgement that failed (no answer after the retries) or is unparseable: `error` stops the run; `skip_group`:
    its group is not trained on this step; `score`: it scores `failure_score`. Each is counted."""
    failure_score: float = 0.0
    """The score of a failed or unparseable judgement under `on_failure=score`."""
    temperature: float = 0.0
    """The request's sampling temperature (0: greedy)."""
    max_tokens: int = 512
    """The request's `max_tokens`: the judge's answer budget."""

    def check(self) -> None:
        _at_least(self, max_concurrent=1, retries=0, max_tokens=1)
        _require(self.url is None or self.url.startswith(("http://", "https://")),
                 f"{P}url={self.url!r} is not an http(s) URL. Fix: e.g. {P}url=http://127.0.0.1:8000.")
        _require(self.timeout_s > 0, f"{P}timeout_s={self.timeout_s} must be > 0. Fix: e.g. {P}timeout_s=60.")
        _require(self.backoff_s >= 0 and self.requests_per_s >= 0,
                 f"{P}backoff_s={self.backoff_s} and {P}requests_per_s={self.requests_per_s} must be >= 0. Fix: e.g. "
                 f"{P}backoff_s=1, {P}requests_per_s=0 (no limit).")
        _require(self.min_score is None or self.max_score is None or self.min_score <= self.max_score,
                 f"{P}min_score={self.min_score} is above {P}max_score={self.max_score}. Fix: swap them.")
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as e:
            groups = f"an invalid regex ({e})"
        _require(groups == 1, f"{P}score_pattern={self.score_pattern!r} has {groups} groups, not one. Fix: one group "
                 r"around the number, e.g. 'Score: ([0-9.]+)'.")
        if self.template is not None:
            try:
                self.template.format(prompt="", response="", ground_truth="")
            except (KeyError, IndexError, ValueError) as e:
                _require(False, f"{P}template does not format with {{prompt}}, {{response}}, {{ground_truth}}: "
                         f"{type(e).__name__}: {e}. Fix: name only those fields, and double literal braces ({{{{ }}}}).")


@dataclasses.dataclass(frozen=True)
class RewardConfig(_Section):
    #: keys a reader may expect here, and why this section does not take them
    REFUSED_KEYS = {
        "recompute": "the reward model only runs forward passes, which keep no activations for backward, so there "
                     "is nothing to recompute. Fix: remove it (recomputation is for the trained roles: "
                     "actor.recompute, critic.recompute).",
        "lora": "the reward model is not trained, so it has no adapters. Fix: remove it (adapters are for the "
                "trained roles: actor.lora, critic.lora).",
    }

    functions: list[str] = dataclasses.field(default_factory=list)
    """Built-in rule rewards (`gsm8k`, `math_boxed`, `exact_match`, `reasoning_gym` (partial credit),
    `reasoning_gym_exact`, `digit_successor`, `code` (test cases run in `reward.sandbox`), `code_expression` (the
    code demo's: an expression evaluated in `reward.sandbox`), `judge` (an LLM asked, `reward.judge`)) or your
    own `path/to/file.py:function` / `package.module:function`:
    `fn(response, ground_truth, extra)` or verl's `compute_score(data_source, solution_str, ground_truth,
    extra_info)`, returning a number or a dict with a `score` ([own-data.md](own-data.md))."""
    function_weights: Optional[list[float]] = None
    """One weight per function; `null`: all 1.0."""
    metric_functions: list[str] = dataclasses.field(default_factory=list)
    """Rule functions logged only, as `critic/score/<name>` and `val/score/<name>`, e.g. `[reasoning_gym_exact]`
    ([training.md](training.md#data-and-rewards))."""
    bad_value_policy: Literal["error", "warn"] = "error"
    """Your function returned NaN or inf: `error` ends the run (exit 4); `warn` scores it 0, warns once, counts
    `reward/bad_values` ([bad-inputs.md](bad-inputs.md#your-reward-functions-values))."""
    timeout_s: float = 60.0
    """Your function's time limit per call; past it the run ends (exit 4) naming function and row; `0`: none."""
    num_workers: int = 0
    """Processes that call `reward.functions` on a step's responses, in parallel and while the step's old-log-prob,
    reference and value passes run (verl's `reward.num_workers`, default 8 there). Same scores, checks and errors as
    `0`, where rank 0 calls them one response after another after the passes
    ([training.md](training.md#reward-workers))."""
    model_path: Optional[str] = None
    """A reward model: HF directory with a scalar score head."""
    model_weight: float = 1.0
    """Weight of the reward model's score."""
    micro_batch_size: int = 4
    """Reward-model sequences per forward on one replica (without packing)."""
    packing: bool = True
    """As `actor.packing`."""
    max_tokens_per_micro_batch: Optional[int] = None
    """As the actor's, with this role's `micro_batch_size`."""
    parallel: RoleParallelConfig = _default(RoleParallelConfig)
    """This role's own `tp` / `pp` / `vpp` / `ep` / `cp` (see `reward.parallel` above)."""
    overlong_buffer: OverlongBufferConfig = _default(OverlongBufferConfig)
    """DAPO's length penalty near `rollout.max_new_tokens`:"""
    sandbox: SandboxConfig = _default(SandboxConfig)
    """Where the `code` function runs programs:"""
    judge: JudgeConfig = _default(JudgeConfig)
    """The `judge` function's endpoint, prompt, parsing and failure policy:"""

    def check(self) -> None:
        _at_least(self, micro_batch_size=1, max_tokens_per_micro_batch=1, num_workers=0)
        _require(self.timeout_s >= 0, f"{P}timeout_s={self.timeout_s} must be >= 0. Fix: e.g. {P}timeout_s=60 "
                 f"(0: no limit).")
        n_w, n_f = len(self.function_weights or ()), len(self.functions)
        _require(self.function_weights is None or n_w == n_f,
                 f"{P}function_weights has {n_w} entries for {n_f} {P}functions. Fix: give one weight per function "
                 f"or set {P}function_weights=null.")
        _require(self.judge.url is not None or "judge" not in (*self.functions, *self.metric_functions),
                 f"{P}functions names `judge` but {P}judge.url is not set. Fix: set {P}judge.url to an OpenAI-compatible "
                 "endpoint (python -m megappo.rollout.judge_server --model DIR --port 8000 serves one: "
                 f"{P}judge.url=http://127.0.0.1:8000).")


# -- rules across sections ----------------------------------------------------------------------

def check_overlong_buffer(cfg: "Config") -> None:
    """The overlong buffer lies within the response budget."""
    ob = cfg.reward.overlong_buffer
    _require(not ob.enable or ob.len <= cfg.rollout.max_new_tokens,
             f"reward.overlong_buffer.len={ob.len} is longer than rollout.max_new_tokens="
             f"{cfg.rollout.max_new_tokens}. Fix: set reward.overlong_buffer.len <= {cfg.rollout.max_new_tokens} "
             "(DAPO: a quarter of it or less).")
