"""The built-in reward function `judge`: an LLM asked to score a response over an OpenAI-compatible
chat-completions endpoint (reward.judge).

    (prompt, response, ground truth) --template--> user message --POST {url}/v1/chat/completions-->
    answer --score_pattern's last match--> float, clipped to [min_score, max_score]

The request is `{"model", "messages": [{"role": "user", "content": ...}], "temperature", "max_tokens"}`; the
answer's `choices[0].message.content` is parsed. A judgement is `ok` (a score), `unparseable` (an answer
without the pattern, or not a finite number) or `failed` (no answer: refused connections, 429 and 5xx past
reward.judge.retries, a timeout, another HTTP error, an answer that is not chat-completions JSON). Neither of
the last two is ever a silent 0: each is counted and follows reward.judge.on_failure:

| on_failure | a failed or unparseable judgement |
|---|---|
| `error` | stops the run (JudgeUnavailable, naming the fix) |
| `skip_group` | scores 0 and is marked (`judge_skip`): the Scorer masks its whole group out of the step's losses |
| `score` | scores reward.judge.failure_score |

Per process (`configure`, called by the Scorer and each reward worker with reward.judge), one `JudgeClient`:
at most max_concurrent requests in flight, requests started no faster than requests_per_s (evenly spaced: a
token bucket holding one token), retries with exponential backoff only where the request cannot have been
answered (connection refused, 429, 5xx). A batch's judgements are asked at once (`prefetch`, called before
the functions run on the batch's responses), and the function on each response waits for its own.

The function returns a dict: `score` and the fields `judge_failed`, `judge_unparseable`, `judge_timeouts`,
`judge_retries`, `judge_latency_s`, `judge_skip`, which `judge_metrics` turns into a step's
`reward/judge/...` metrics. It reads the prompt's text from `extra[PROMPT_KEY]` (the Scorer decodes it).

This module does not know about tokenizers, batches, models or the reward registry around it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

#: the key of a response's `extra` that holds its prompt's decoded text (added by the Scorer for the judge)
PROMPT_KEY = "prompt_text"

#: the user message when reward.judge.template is null; the tags delimit the texts (the stand-in judge of
#: megappo.rollout.judge_server reads them)
DEFAULT_TEMPLATE = """You are grading a response to a task against a reference answer.

<task>
{prompt}
</task>

<reference>
{ground_truth}
</reference>

<response>
{response}
</response>

Is the response's final answer correct according to the reference? Think briefly, then end with a line \
"Score: 1" if it is correct or "Score: 0" if it is not."""


class JudgeUnavailable(RuntimeError):
    """A judgement failed or was unparseable under reward.judge.on_failure=error: never a score."""


@dataclasses.dataclass
class Judgement:
    """What the judge said of one response."""

    status: str  # "ok" | "unparseable" | "failed"
    score: float | None = None  # the parsed, clipped score ("ok" only)
    retries: int = 0  # requests sent again (refused, 429, 5xx)
    latency_s: float = 0.0  # from the first request's start to the answer (or the giving up)
    timed_out: bool = False
    detail: str = ""  # why it failed, or the start of an answer without a score


def parse_score(answer: str, pattern: re.Pattern, min_score: float | None = None,
                max_score: float | None = None) -> float | None:
    """The last match of `pattern`'s group in `answer` as a float, clipped to [min_score, max_score]; None
    when there is no match or it is not a finite number."""
    found = pattern.findall(answer)
    if not found:
        return None
    try:
        value = float(found[-1])
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    if min_score is not None:
        value = max(value, min_score)
    if max_score is not None:
        value = min(value, max_score)
    return value


class RateLimit:
    """Starts spaced at least 1 / `per_s` seconds apart (0: no limit); thread-safe."""

    def __init__(self, per_s: float):
        self.interval = 1.0 / per_s if per_s > 0 else 0.0
        self._next, self._lock = 0.0, threading.Lock()

    def wait(self) -> None:
        if not self.interval:
            return
        with self._lock:  # each caller books the next free slot, then sleeps outside the lock
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + self.interval
        time.sleep(max(0.0, start - now))


def _retryable(error: BaseException) -> bool:
    """A request that was not answered: refused or reset before an answer (a judgement has no side effect, so
    asking again is safe), or answered 429 / 5xx."""
    if isinstance(error, urllib.error.HTTPError):
        return error.code == 429 or error.code >= 500
    if isinstance(error, urllib.error.URLError):
        error = error.reason
    return isinstance(error, (ConnectionRefusedError, ConnectionResetError))


def _timed_out(error: BaseException) -> bool:
    return isinstance(error, TimeoutError) or (isinstance(error, urllib.error.URLError)
                                               and isinstance(error.reason, TimeoutError))


class JudgeClient:
    """Asks the judge at `cfg.url` (a megappo.config.JudgeConfig: reward.judge; module docstring)."""

    def __init__(self, cfg):
        self.cfg = cfg
        base = cfg.url.rstrip("/")
        self.endpoint = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.template = cfg.template if cfg.template is not None else DEFAULT_TEMPLATE
        self.pattern = re.compile(cfg.score_pattern)
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if cfg.api_key_env and not key:
            raise JudgeUnavailable(f"reward.judge.api_key_env={cfg.api_key_env} names an environment variable that "
                                   f"is not set. Fix: export {cfg.api_key_env}=<the key>, or set "
                                   "reward.judge.api_key_env=null for an endpoint without one.")
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.rate = RateLimit(cfg.requests_per_s)
        self.pool = concurrent.futures.ThreadPoolExecutor(cfg.max_concurrent, thread_name_prefix="megappo-judge")
        self._prefetched: dict[tuple, list[concurrent.futures.Future]] = {}
        self._lock = threading.Lock()

    def request(self, prompt: str, response: str, ground_truth: Any) -> dict:
        """The chat-completions request body for one response."""
        content = self.template.format(prompt=prompt, response=response,
                                       ground_truth="" if ground_truth is None else ground_truth)
        return {"model": self.cfg.model, "messages": [{"role": "user", "content": content}],
                "temperature": self.cfg.temperature, "max_tokens": self.cfg.max_tokens}

    def ask(self, prompt: str, response: str, ground_truth: Any) -> Judgement:
        """One judgement, on the calling thread (callers bound the concurrency: `prefetch`, `judgement`)."""
        body = json.dumps(self.request(prompt, response, ground_truth)).encode()
        start, retries = time.monotonic(), 0
        while True:
            self.rate.wait()
            try:
                req = urllib.request.Request(self.endpoint, data=body, headers=self.headers)
                with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as answer:
                    text = json.loads(answer.read())["choices"][0]["message"]["content"] or ""
                break
            except Exception as e:  # each kind is sorted out below; none is lost
                if _retryable(e) and retries < self.cfg.retries:
                    time.sleep(self.cfg.backoff_s * 2 ** retries)
                    retries += 1
                    continue
                return Judgement("failed", retries=retries, latency_s=time.monotonic() - start,
                                 timed_out=_timed_out(e), detail=_describe(e))
        latency = time.monotonic() - start
        score = parse_score(text, self.pattern, self.cfg.min_score, self.cfg.max_score)
        if score is None:
            return Judgement("unparseable", retries=retries, latency_s=latency, detail=text[:200])
        return Judgement("ok", score, retries=retries, latency_s=latency)

    def prefetch(self, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[Any]) -> None:
        """Start a batch's judgements at once (max_concurrent in flight); `judgement` then waits for each.
        What an earlier batch left unclaimed is dropped."""
        with self._lock:
            self._prefetched = {}
            for item in zip(prompts, responses, ground_truths):
                key = _key(*item)
                self._prefetched.setdefault(key, []).append(self.pool.submit(self.ask, *item))

    def judgement(self, prompt: str, response: str, ground_truth: Any) -> Judgement:
        """The judgement of one response: its prefetched one, else asked now (within the concurrency bound)."""
        with self._lock:
            waiting = self._prefetched.get(_key(prompt, response, ground_truth))
            future = waiting.pop(0) if waiting else None
        if future is None:
            future = self.pool.submit(self.ask, prompt, response, ground_truth)
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _key(prompt: str, response: str, ground_truth: Any) -> tuple:
    return prompt, response, repr(ground_truth)


def _describe(error: BaseException) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code}: {error.read()[:200]!r}"
    if isinstance(error, urllib.error.URLError):
        return f"{type(error.reason).__name__}: {error.reason}"
    if isinstance(error, (KeyError, IndexError, TypeError, ValueError)):
        return f"not a chat-completions answer ({type(error).__name__}: {error})"
    return f"{type(error).__name__}: {error}"


# -- one client per process ----------------------------------------------------------------------------

_client: JudgeClient | None = None
_client_lock = threading.Lock()


def configure(judge_cfg) -> None:
    """Ask this process's judgements as `judge_cfg` (a megappo.config.JudgeConfig: reward.judge) says."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
        _client = JudgeClient(judge_cfg)


def close() -> None:
    """Stop this process's client (its requests not yet started are dropped)."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
        _client = None


def _current() -> JudgeClient:
    with _client_lock:
        if _client is None:
            raise JudgeUnavailable("the judge reward function was called in a process whose judge is not configured. "
                                   "Fix: set reward.judge.url (the Scorer and the reward workers configure it).")
        return _client


def prefetch(responses: Sequence[str], ground_truths: Sequence[Any], extras: Sequence[dict]) -> None:
    """Start the judgements of a batch's responses (what `judge` on each of them then reads)."""
    _current().prefetch([e.get(PROMPT_KEY, "") for e in extras], responses, ground_truths)


def judge(response: str, ground_truth: Any, extra: dict) -> dict:
    """The judge's score of the response, or reward.judge.on_failure's (module docstring)."""
    client = _current()
    j = client.judgement(extra.get(PROMPT_KEY, ""), response, ground_truth)
    fields = {"judge_failed": float(j.status == "failed"), "judge_unparseable": float(j.status == "unparseable"),
              "judge_timeouts": float(j.timed_out), "judge_retries": float(j.retries), "judge_latency_s": j.latency_s,
              "judge_skip": 0.0}
    if j.status == "ok":
        return {"score": j.score, **fields}
    policy = client.cfg.on_failure
    if policy == "error":
        what = ("gave no answer" if j.status == "failed" else "answered without a score matching "
                f"reward.judge.score_pattern={client.cfg.score_pattern!r}")
        raise JudgeUnavailable(
            f"the judge at {client.endpoint} {what}: {j.detail!r} (after {j.retries} retries). Fix: "
            + ("check the endpoint (python -m megappo.rollout.judge_server serves one), reward.judge.url and "
               "reward.judge.timeout_s" if j.status == "failed" else
               "adapt reward.judge.template or reward.judge.score_pattern to the judge")
            + ", or set reward.judge.on_failure=skip_group (the group is not trained on) or score "
              "(reward.judge.failure_score).")
    if policy == "skip_group":
        return {"score": 0.0, **fields, "judge_skip": 1.0}
    return {"score": client.cfg.failure_score, **fields}


judge.prefetch = prefetch  # the registry's batch hook: score_records and the reward workers call it first


def judge_metrics(fields: list[dict], prefix: str = "reward/judge") -> dict[str, float]:
    """A step's `reward/judge/...` metrics (validation's: `val/judge/...`) from the fields `judge` returned:
    judgements that failed, were unparseable, timed out, requests retried, and the mean latency of a judgement."""
    mine = [f for f in fields if "judge_failed" in f]
    if not mine:
        return {}
    out = {f"{prefix}/{name}": float(sum(f[f"judge_{name}"] for f in mine))
           for name in ("failed", "unparseable", "timeouts", "retries")}
    out[f"{prefix}/latency_s"] = sum(f["judge_latency_s"] for f in mine) / len(mine)
    return out
