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
| `reasoning_gym` | reasoning-gym's own scorer for the task in `extra["task"]` (entry in `extra["entry"]`) |
| `digit_successor` | the CPU demo task: 1 for the digit (d + 1) mod 10 then EOS; 0.5 for that digit not followed by EOS |

This module does not know about tokenizers, models or process groups.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable, Sequence

from megappo.config import ConfigError

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


def reasoning_gym_score(response: str, ground_truth: Any, extra: dict) -> float:
    from megappo.data import reasoning_gym_scorer

    return float(reasoning_gym_scorer(extra["task"])(response, extra["entry"]))


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
    "digit_successor": digit_successor,
}


def get_reward_fn(name: str) -> RewardFn:
    if name not in REWARD_FUNCTIONS:
        guess = difflib.get_close_matches(name, list(REWARD_FUNCTIONS), n=1)
        hint = f" Did you mean '{guess[0]}'?" if guess else ""
        raise ConfigError(f"unknown reward function '{name}' in reward.functions.{hint} Fix: use names from "
                          f"{sorted(REWARD_FUNCTIONS)}.")
    return REWARD_FUNCTIONS[name]


def score_batch(names: Sequence[str], weights: Sequence[float] | None, responses: Sequence[str],
                ground_truths: Sequence[Any], extras: Sequence[dict]) -> list[float]:
    """Weighted sum of the named functions' scores for each response."""
    fns = [get_reward_fn(n) for n in names]
    weights = list(weights) if weights is not None else [1.0] * len(fns)
    if len(weights) != len(fns):
        raise ValueError(f"reward.function_weights has {len(weights)} entries for {len(fns)} functions")
    return [sum(w * fn(r, gt, ex) for w, fn in zip(weights, fns))
            for r, gt, ex in zip(responses, ground_truths, extras)]
