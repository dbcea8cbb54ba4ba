"""Rule-based reward functions, chosen by name from an explicit registry.

Every function has the signature `fn(response: str, ground_truth, extra: dict) -> float`
and returns a score in [0, 1] (1 = correct). `response` is the decoded text without special
tokens; `extra` is the row's `extra_info` plus `finish_reason`: "stop" when the response ended
with an EOS / stop token, "length" when it ran into rollout.max_new_tokens. `score_batch(names, weights, ...)` combines
several of them (weighted sum); the reward-model worker's scores are added by the trainer.

| name | what it checks |
|---|---|
| `gsm8k` | the number after the last `#### ` equals the ground truth (commas and `$` ignored), as verl's GSM8K scorer in strict mode |
| `math_boxed` | the content of the last `\\boxed{...}` equals the ground truth after light normalisation |
| `exact_match` | the stripped response equals the stripped ground truth |
| `reasoning_gym` | reasoning-gym's own scorer for the task in `extra["task"]` (entry in `extra["entry"]`): partial credit, 1 for the bare answer, answer length / response length for a response that contains it |
| `reasoning_gym_exact` | exact answer: 1 when the response's final number (or, for an answer that is not a number, its final expression) equals the ground truth, else 0 (`final_answer_matches`) |
| `digit_successor` | the CPU demo task: 1 for the digit (d + 1) mod 10 then EOS; 0.5 for that digit not followed by EOS |
| `code` | the fraction of the ground truth's test cases (stdin/stdout or function calls) the response's last ```python block passes, run in the sandbox (reward.sandbox; megappo.rewards.code_reward); it returns a dict whose fields `code_metrics` sums |
| `judge` | an LLM's score of the response over a chat-completions endpoint (reward.judge; megappo.rewards.judge); it returns a dict whose fields `judge_metrics` sums |
| `code_expression` | the code demo's task: the response is a Python expression; `print(<it>)` runs in the sandbox and 1 when it prints the ground truth then EOS, 0.5 without EOS, 0.1 for another value then EOS (a dict, like `code`) |

A built-in function may carry a batch hook, `fn.prefetch(responses, ground_truths, extras)`, which
`score_records` and the reward workers call with a batch's responses before calling the function on each
(`judge` starts all the batch's requests at once there).

Your own function is named `path/to/file.py:function` (or `package.module:function`, imported
from the working directory and sys.path) in `reward.functions`, like verl's
`custom_reward_function`. It is called with megappo's arguments `(response, ground_truth,
extra)`, or, when it takes `solution_str` (verl's `compute_score(data_source, solution_str,
ground_truth, extra_info)`), with verl's by name, so a verl reward file works unchanged. It
returns a number (or, as verl allows, a dict with a "score" and fields of its own, e.g. "acc":
`score_records` keeps those fields per response, for algorithm.filter_groups.metric); when it
raises or returns anything else, the run ends with a `UserCodeError` that names it and the dataset row
(its file and line or built-in source, training or validation, and its prompt; megappo.user_code).
Its value is checked (`RewardChecks`, built from the recipe's reward section and given to
`score_batch` by the caller): NaN or inf
is refused the same way (`reward.bad_value_policy=error`) or scored 0, warned once per function
and counted (`warn`; `RewardChecks.bad_values`); a magnitude above LARGE_REWARD is warned once per
function; a call that takes longer than `reward.timeout_s` ends the run naming the function, the
row and the limit (`call_with_timeout`). The built-in functions return 0, 0.5 or 1 (`code`: a fraction, in a
dict with its fields; `code_expression`: in a dict) and are not checked; `code` and `code_expression` run
programs under the sandbox's own time limits.

`call_functions` calls the functions on one response and gives each one's outcome (its value, a
timeout, what it raised); `score_records` turns the outcomes into checked scores, calling the
functions itself or reading the outcomes reward workers computed in other processes
(megappo.rewards.workers, reward.num_workers): the same checks and errors either way.

`reads(name)` says which row fields a function needs (`reward_model.ground_truth`, or
`extra_info.task` / `extra_info.entry` for reasoning-gym); the start-up data check
(megappo.trainer.data_check) counts the rows that lack them. A function of your own is taken to read
the ground truth, as verl's reward manager always does.

This module does not know about tokenizers, models or process groups.
"""

from __future__ import annotations

import dataclasses
import difflib
import fractions
import functools
import inspect
import math
import numbers
import os
import re
import signal
import sys
import threading
from typing import Any, Callable, Iterable, Sequence

from megappo.errors import ConfigError
from megappo.rewards.code_reward import code, code_expression
from megappo.rewards.judge import judge
from megappo.user_code import UserCodeError, load_spec

RewardFn = Callable[[str, Any, dict], float]

_GSM8K = re.compile(r"#### (\-?[0-9\.\,\$]+)")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".").strip()


def gsm8k(response: str, ground_truth: Any, extra: dict) -> float:
    found = _GSM8K.findall(response)
    if not found:
        return 0.0
    return 1.0 if _clean_number(found[-1]) == _clean_number(str(ground_truth)) else 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _normalise_math(text: str) -> str:
    text = text.strip().strip("$").replace(" ", "").replace("\\!", "")
    text = re.sub(r"\\text\{(.*?)\}", r"\1", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("dfrac", "frac")
    return text.rstrip(".")


def math_boxed(response: str, ground_truth: Any, extra: dict) -> float:
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    return 1.0 if _normalise_math(answer) == _normalise_math(str(ground_truth)) else 0.0


def exact_match(response: str, ground_truth: Any, extra: dict) -> float:
    return 1.0 if response.strip() == str(ground_truth).strip() else 0.0


def reasoning_gym_scorer(task: str):
    """reasoning-gym's own scoring function of `task` (score_answer(answer, entry) -> float)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym_score(response: str, ground_truth: Any, extra: dict) -> float:
    return float(reasoning_gym_scorer(extra["task"])(response, extra["entry"]))


#: a number in a response: an optional sign (a '-' after a digit or ')' is an operator, not a
#: sign), digits with optional thousands commas, an optional decimal part or '/denominator'
_NUMBER = re.compile(r"(?:(?<![\w)\].])-)?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+|/\d+)?")
#: where a final expression starts: after the last '=', 'answer is' or 'answer:'
_ANSWER_MARK = re.compile(r"=|answer is:?|answer:", re.IGNORECASE)


def _as_number(text: str) -> fractions.Fraction | None:
    try:
        return fractions.Fraction(text.strip().replace(",", "").replace("$", "").rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


def _normalise_answer(text: str) -> str:
    return re.sub(r"\s+", "", text).replace("**", "").strip("$").rstrip(".")


def final_answer_matches(response: str, answer: Any) -> bool:
    """Whether the response's final answer is `answer`, whatever text comes before it.

    A numeric answer is compared with the last number of the response as an exact fraction
    ("5 - 9 = -4" and "The answer is -4." match -4; "-4.0" and "1,000" are numbers; "12-5"
    ends in 5, not -5). Any other answer is compared, spaces ignored, with the whole response,
    the last \\boxed{...}, or the text after the last '=', 'answer is' or 'answer:' (to the end
    of that line, without a final '.')."""
    answer = str(answer).strip()
    want = _as_number(answer)
    if want is not None:
        numbers = _NUMBER.findall(response)
        return bool(numbers) and _as_number(numbers[-1]) == want
    tail = _ANSWER_MARK.split(response)[-1].strip()
    candidates = [response, last_boxed(response) or "", tail.splitlines()[0] if tail else ""]
    return any(_normalise_answer(c) == _normalise_answer(answer) for c in candidates if c.strip())


def reasoning_gym_exact(response: str, ground_truth: Any, extra: dict) -> float:
    """1.0 when the final number or expression of the response is reasoning-gym's answer, else 0.0."""
    return 1.0 if final_answer_matches(response, ground_truth) else 0.0


#: the demo's score for the right digit that is not followed by EOS (as a format score: the
#: answer is there, but a user of the exported model would read junk after it)
DIGIT_NOT_STOPPED = 0.5


def digit_successor(response: str, ground_truth: Any, extra: dict) -> float:
    if not response.startswith(str(ground_truth)):
        return 0.0
    stopped = response == str(ground_truth) and extra.get("finish_reason", "stop") == "stop"
    return 1.0 if stopped else DIGIT_NOT_STOPPED


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "gsm8k": gsm8k,
    "math_boxed": math_boxed,
    "exact_match": exact_match,
    "reasoning_gym": reasoning_gym_score,
    "reasoning_gym_exact": reasoning_gym_exact,
    "digit_successor": digit_successor,
    "code": code,
    "judge": judge,
    "code_expression": code_expression,
}


#: the row fields (dotted, in verl's layout) each built-in function reads
READS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("reward_model.ground_truth",),
    "math_boxed": ("reward_model.ground_truth",),
    "exact_match": ("reward_model.ground_truth",),
    "reasoning_gym": ("extra_info.task", "extra_info.entry"),
    "reasoning_gym_exact": ("reward_model.ground_truth",),
    "digit_successor": ("reward_model.ground_truth",),
    "code": ("reward_model.ground_truth",),
    "judge": (),  # the ground truth when the template names it; an open-ended prompt's judge needs none
    "code_expression": ("reward_model.ground_truth",),
}


def reads(name: str) -> tuple[str, ...]:
    """The row fields function `name` needs; your own functions read the ground truth (as in verl)."""
    return READS.get(name, ("reward_model.ground_truth",))


def get_reward_fn(name: str) -> RewardFn:
    if ":" in name:
        return _custom(name, os.getcwd())  # a relative path means another file in another directory
    if name not in REWARD_FUNCTIONS:
        guess = difflib.get_close_matches(name, list(REWARD_FUNCTIONS), n=1)
        hint = f" Did you mean '{guess[0]}'?" if guess else ""
        raise ConfigError(f"unknown reward function '{name}' in reward.functions.{hint} Fix: use names from "
                          f"{sorted(REWARD_FUNCTIONS)}, or your own function as path/to/file.py:function.")
    return REWARD_FUNCTIONS[name]


@functools.cache
def _custom(name: str, cwd: str) -> RewardFn:
    """`file.py:fn` or `package.module:fn` as a RewardFn (loaded once per working directory `cwd`)."""
    fix = "Fix: write reward.functions=[path/to/file.py:function] (or package.module:function)."
    module, where, attr = load_spec(name, who=f"reward function '{name}'", fix=fix, malformed=(
        f"reward function '{name}' in reward.functions is not FILE.py:FUNCTION. {fix}"))
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(f"reward function '{name}': '{where}' has no function '{attr}' (it has {found}). {fix}")
    params = inspect.signature(fn).parameters
    if "solution_str" in params:  # verl's compute_score(data_source, solution_str, ground_truth, extra_info)
        def call(response, ground_truth, extra, data_source=None):
            kw = dict(solution_str=response, ground_truth=ground_truth, data_source=data_source, extra_info=extra)
            return fn(**{k: v for k, v in kw.items() if k in params})
    else:
        def call(response, ground_truth, extra, data_source=None):
            return fn(response, ground_truth, extra)
    call.custom = name
    return call


#: a reward of larger magnitude is warned about once per function: the critic's squared error and
#: the advantages overflow or swamp everything else (1e30 gave critic/vf_loss=inf)
LARGE_REWARD = 1e6


@dataclasses.dataclass
class RewardChecks:
    """How your functions' values and calls are checked (reward.bad_value_policy, reward.timeout_s),
    what has been warned about, and the responses scored 0 for a non-finite value."""

    bad_value_policy: str = "error"
    timeout_s: float = 60.0
    warned: set = dataclasses.field(default_factory=set)  # (function, what)
    bad_values: int = 0

    @classmethod
    def of(cls, reward_cfg) -> "RewardChecks":
        """The checks the recipe's `reward` section asks for."""
        return cls(bad_value_policy=reward_cfg.bad_value_policy, timeout_s=reward_cfg.timeout_s)


class _TimedOut(BaseException):  # not an Exception: a function's own `except Exception` does not swallow it
    pass


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn(), or _TimedOut after `timeout_s` seconds (0: no limit).

    On the main thread (rank 0's orchestrator) a SIGALRM timer interrupts the call where it is:
    Python code, sleeps and I/O, and C loops that check for signals (`re`), and the function
    stays on the main thread, where reward code that uses signals itself (verl's math scorers)
    works. Elsewhere, or when a timer is already set, the call runs on a daemon thread that is
    given up at the timeout (a daemon: a hung call does not keep the process alive at exit)."""
    if timeout_s <= 0:
        return fn()
    if (threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
            and signal.getitimer(signal.ITIMER_REAL)[0] == 0):
        def alarm(signum, frame):
            raise _TimedOut

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
    result: list = []

    def target():
        try:
            result.append((True, fn()))
        except BaseException as e:  # handed to the caller's thread
            result.append((False, e))

    thread = threading.Thread(target=target, name="megappo-reward-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        raise _TimedOut
    ok, value = result[0]
    if not ok:
        raise value
    return value


def _warn_once(checks: RewardChecks, name: str, what: str, text: str) -> None:
    if (name, what) not in checks.warned:
        checks.warned.add((name, what))
        print(f"megappo: warning: {text}", file=sys.stderr, flush=True)


#: what one call of one function gave: ("ok", its value), ("timeout", None) or ("error", what it raised); from a
#: reward worker also ("unsendable", what it returned), a value that cannot travel between processes
Outcome = tuple[str, Any]


def call_functions(names: Sequence[str], response: str, ground_truth: Any, extra: dict, data_source,
                   timeout_s: float) -> list[Outcome]:
    """Each named function's outcome on one response, your own functions under the time limit (what
    rank 0 runs, or a reward worker: megappo.rewards.workers). A built-in function's error is raised."""
    out = []
    for name in names:
        fn = get_reward_fn(name)
        if not hasattr(fn, "custom"):
            out.append(("ok", fn(response, ground_truth, extra)))
            continue
        try:
            out.append(("ok", call_with_timeout(lambda: fn(response, ground_truth, extra, data_source=data_source),
                                                timeout_s)))
        except _TimedOut:
            out.append(("timeout", None))
        except Exception as e:
            out.append(("error", e))
    return out


def _custom_score(name: str, outcome: Outcome, row, checks: RewardChecks, fields: dict) -> float:
    """Your function's score as a float from its `outcome` (the other entries of a dict it returns go into
    `fields`); what it raised, a result that is not a number, NaN or inf (reward.bad_value_policy=error)
    and a call past reward.timeout_s are a UserCodeError naming the function and the row."""
    code = f"reward function '{name}'"
    kind, value = outcome
    if kind == "timeout":
        raise UserCodeError(code, f"did not return within reward.timeout_s={checks.timeout_s:g} s", row=row,
                            fix="make it return sooner on such responses, or raise reward.timeout_s (0: no "
                                "limit)")
    if kind == "error":
        raise UserCodeError(code, value, row=row) from value
    if kind == "unsendable":
        raise UserCodeError(code, f"returned a {value}, which a reward worker cannot send back", row=row,
                            fix="return a number, or a dict of numbers and strings (or run with reward.num_workers=0)")
    if isinstance(value, dict) and "score" in value:  # verl lets compute_score return {"score": ..., ...}
        fields.update((k, v) for k, v in value.items() if k != "score")
        value = value["score"]
    if not isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        raise UserCodeError(code, f"returned {value!r} ({type(value).__name__}), not a number",
                            row=row, fix="return a float (e.g. 1.0 for a correct response, 0.0 otherwise)")
    value = float(value)
    at = "" if row is None else f" on {row.describe()}"
    if not math.isfinite(value):
        if checks.bad_value_policy == "error":
            raise UserCodeError(code, f"returned {value}, not a finite number", row=row,
                                fix="return a finite float, or set reward.bad_value_policy=warn to score such "
                                    "responses 0")
        checks.bad_values += 1
        _warn_once(checks, name, "non-finite", f"{code} returned {value}{at}; reward.bad_value_policy=warn: such responses "
                                       "are scored 0 (warned once; counted in reward/bad_values).")
        return 0.0
    if abs(value) > LARGE_REWARD:
        _warn_once(checks, name, "large", f"{code} returned {value:g}{at}, beyond |reward| > {LARGE_REWARD:g} (warned once): "
                                  "the critic's loss and the advantages overflow or swamp everything else. Fix: "
                                  "scale its rewards to a few units (e.g. [-1, 1]).")
    return value


def _builtin_score(value: float | dict, fields: dict) -> float:
    """A built-in function's score; `code` returns a dict: its score, and fields that go into `fields`."""
    if isinstance(value, dict):
        fields.update((k, v) for k, v in value.items() if k != "score")
        return value["score"]
    return value


#: a response is fully correct when its score reaches this (1.0: a correct response under every
#: built-in rule function; the tolerance absorbs the rounding of weighted sums)
CORRECT_SCORE = 1.0 - 1e-6


@dataclasses.dataclass
class Scored:
    """What the reward functions said of N responses."""

    totals: list[float]  # [N] the weighted sum of the functions' scores
    values: list[list[float]]  # [N][K] each function's score, unweighted (K: the functions, in order)
    fields: list[dict[str, Any]]  # [N] the other entries of the dicts your functions returned (verl's "acc", ...)


def prefetch(fns: Sequence[RewardFn], responses: Sequence[str], ground_truths: Sequence[Any],
             extras: Sequence[dict]) -> None:
    """Start the batch work of the functions that have a batch hook (module docstring), before each is called."""
    for fn in fns:
        if hasattr(fn, "prefetch"):
            fn.prefetch(responses, ground_truths, extras)


def score_batch(names: Sequence[str], weights: Sequence[float] | None, responses: Sequence[str],
                ground_truths: Sequence[Any], extras: Sequence[dict],
                data_sources: Sequence[str] | None = None, rows: Sequence | None = None, *,
                checks: RewardChecks | None = None) -> list[float]:
    """Weighted sum of the named functions' scores for each response; `rows`: each response's
    dataset row (megappo.data.prompts.RowOrigin: file and line, or built-in source; training or validation),
    named when your own function fails on it (UserCodeError) and in its warnings; `checks`: how your
    functions' values and calls are checked (None: the defaults, error on NaN/inf, 60 s)."""
    return score_records(names, weights, responses, ground_truths, extras, data_sources, rows, checks=checks).totals


def score_records(names: Sequence[str], weights: Sequence[float] | None, responses: Sequence[str],
                  ground_truths: Sequence[Any], extras: Sequence[dict],
                  data_sources: Sequence[str] | None = None, rows: Sequence | None = None, *,
                  checks: RewardChecks | None = None, outcomes: Iterable[list[Outcome]] | None = None) -> Scored:
    """`score_batch` with each function's own score and the extra fields of the dicts they returned
    (when two functions return the same field, the later one's is kept). `outcomes`: the functions'
    outcomes on each response, in order, when reward workers called them (megappo.rewards.workers);
    None: they are called here."""
    checks = RewardChecks() if checks is None else checks
    fns = [get_reward_fn(n) for n in names]
    weights = list(weights) if weights is not None else [1.0] * len(fns)
    if len(weights) != len(fns):
        raise ValueError(f"reward.function_weights has {len(weights)} entries for {len(fns)} functions")
    sources = data_sources if data_sources is not None else [None] * len(responses)
    rows = rows if rows is not None else [None] * len(responses)
    if outcomes is None:  # called here, one response after another (a failing one stops the rest)
        prefetch(fns, responses, ground_truths, extras)
        outcomes = (call_functions(names, r, gt, ex, src, checks.timeout_s)
                    for r, gt, ex, src in zip(responses, ground_truths, extras, sources))
    out = Scored([], [], [])
    for row, called in zip(rows, outcomes):
        total, values, fields = 0.0, [], {}
        for w, fn, name, outcome in zip(weights, fns, names, called, strict=True):
            values.append(_custom_score(name, outcome, row, checks, fields) if hasattr(fn, "custom")
                          else _builtin_score(outcome[1], fields))
            total += w * values[-1]
        out.totals.append(total)
        out.values.append(values)
        out.fields.append(fields)
    return out
