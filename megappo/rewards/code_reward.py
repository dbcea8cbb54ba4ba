"""The built-in reward function `code`: a response's Python program run on its example's test cases.

    response --last ```python block--> program --each test case, on the runner--> passed / cases

The program is the last ```python (or ```py) fenced block of the response; a response without one scores
0 as a format failure. The test cases are the example's ground truth (a dict, or its JSON text), in the
two shapes code-RL datasets use:

| shape | ground truth | a case passes when |
|---|---|---|
| stdin/stdout (APPS, TACO, CodeContests) | `{"inputs": [stdin, ...], "outputs": [stdout, ...]}` | the program exits 0 and its stdout equals the output, line ends and trailing blank lines ignored (numbers within 1e-6) |
| function call (prime, LiveCodeBench) | `{"fn_name": "f", "inputs": [[arg, ...] or "one JSON arg a line", ...], "outputs": [value or its JSON, ...]}` | `f(*args)` (or `Solution().f(*args)`) returns the value (or, APPS's wrapping, `[value]` is the output) |

The score is the fraction of cases passed (verl's convention), or with reward.sandbox.all_or_nothing 1 when
all pass, else 0. The function returns a dict: `score`, and the fields `code_format_error` (1: no program),
`code_passed`, `code_cases`, `code_retries` (service requests retried) and the cases whose run ended
otherwise (`code_timeouts`, `code_output_limits`, `code_errors`), which `code_metrics` sums into a step's
metrics. Expected outputs stay in this process: the program gets only the inputs.

Where programs run (`configure`, called once per process by the Scorer and by each reward worker with the
recipe's reward.sandbox): the local executor (megappo.rewards.sandbox) under reward.sandbox.isolation, or a
SandboxFusion service at reward.sandbox.url (megappo.rewards.sandbox_fusion). A process that was not
configured uses reward.sandbox's defaults (bwrap, refused where bubblewrap is missing). A response's cases
run at once, at most reward.sandbox.max_concurrent programs per process. An executor or service that cannot
run programs raises SandboxUnavailable: the run stops; it is never a score.

The built-in reward function `code_expression` (the code demo's, recipes/demo-code-cpu.yaml): the response
is a Python expression; the executor runs the program `print(<expression>)` and its stdout is compared with
the ground truth here. 1 when it prints the ground truth and the response ended with EOS, 0.5 when it prints
it but was cut by the token budget, 0.1 for an expression that ran, printed something else and ended with EOS
(a format score: random tokens seldom hit the value, but a short expression then EOS is a step towards it),
else 0. Only a response that is one expression (one line that parses as
a Python expression, at most EXPRESSION_MAX_CHARS characters; parsing runs nothing) becomes a program: any
other text scores 0 as a format failure, and no statement of its own can reach the program. A process runs
each distinct expression once (an LRU of EXPRESSION_CACHE programs): its value is taken to be a function of
its text, so one that draws random numbers keeps its first run's score. Its fields (`expr_*`) become
`reward/code_expression/...` metrics.

`run_program(source)` runs one program on the process's executor, within its bound on concurrent runs: the
`python` tool of multi-turn environments (megappo.envs.tools) runs the model's code through it.

This module does not know about tokenizers, batches, models or the reward registry around it.
"""

from __future__ import annotations

import ast
import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import threading
from typing import Any

from megappo.rewards.sandbox import Limits, LocalExecutor, RunResult, SandboxUnavailable, resolve_isolation
from megappo.rewards.sandbox_fusion import SandboxFusionClient

_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str | None:
    """The last ```python fenced block's text; None when the response has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


@dataclasses.dataclass(frozen=True)
class TestCase:
    """One case: the program's stdin (or, with `fn_name`, the call's arguments as JSON) and what it must give."""

    stdin: str
    expected: Any
    fn_name: str | None = None


def parse_cases(ground_truth: Any) -> list[TestCase]:
    """The test cases of a ground truth (module docstring's table); ValueError naming the fix otherwise."""
    gt = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    fix = ('Fix: give reward_model.ground_truth as {"inputs": [...], "outputs": [...]} (stdin/stdout) or with '
           '"fn_name" (function calls), as a dict or its JSON text.')
    if not isinstance(gt, dict) or not isinstance(gt.get("inputs"), list) or not isinstance(gt.get("outputs"), list):
        raise ValueError(f"the code reward's ground truth has no inputs and outputs lists: {str(gt)[:200]}. {fix}")
    if len(gt["inputs"]) != len(gt["outputs"]) or not gt["inputs"]:
        raise ValueError(f"the code reward's ground truth has {len(gt['inputs'])} inputs and {len(gt['outputs'])} "
                         f"outputs. {fix}")
    fn_name = gt.get("fn_name") or None
    cases = []
    for given, want in zip(gt["inputs"], gt["outputs"]):
        if fn_name is None:
            stdin = "\n".join(map(str, given)) if isinstance(given, list) else str(given)
            cases.append(TestCase(stdin, "\n".join(map(str, want)) if isinstance(want, list) else str(want)))
            continue
        args = given if isinstance(given, list) else [json.loads(line) for line in str(given).split("\n") if line.strip()]
        if isinstance(want, str):
            try:
                want = json.loads(want)
            except ValueError:
                pass  # a plain string value
        cases.append(TestCase(json.dumps(args), want, fn_name))
    return cases


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _same_number(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def stdout_matches(got: str, want: str) -> bool:
    """The program's stdout is the expected output: line ends and trailing blank lines aside, or token by token
    with numbers within 1e-6."""
    if _lines(got) == _lines(want):
        return True
    got_tokens, want_tokens = got.split(), want.split()
    return len(got_tokens) == len(want_tokens) and all(
        g == w or _same_number(g, w) for g, w in zip(got_tokens, want_tokens))


def _same_value(got: Any, want: Any) -> bool:
    if isinstance(got, bool) or isinstance(want, bool):
        return got is want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same_value(g, w) for g, w in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_same_value(got[k], want[k]) for k in got)
    return got == want


def value_matches(got: Any, want: Any) -> bool:
    """A call's (JSON) value is the expected one; APPS wraps it: `[value]`."""
    return _same_value(got, want) or (isinstance(want, list) and len(want) == 1 and _same_value(got, want[0]))


def case_passed(case: TestCase, result: RunResult) -> bool:
    """Whether a run passed its case (decided here, outside the sandbox, against the expected output)."""
    if result.status != "ok":
        return False
    if case.fn_name is not None:
        return result.has_value and value_matches(result.value, case.expected)
    return stdout_matches(result.stdout, case.expected)


# -- where programs run (one per process) ------------------------------------------------------------------

class _Runs:
    """The process's runner (local executor or service client) and its bounded pool of case runs."""

    def __init__(self, sandbox):
        self.settings = sandbox
        if sandbox.url:
            key = os.environ.get(sandbox.api_key_env) if sandbox.api_key_env else None
            if sandbox.api_key_env and not key:
                raise SandboxUnavailable(f"reward.sandbox.api_key_env={sandbox.api_key_env} names an environment "
                                         f"variable that is not set. Fix: export {sandbox.api_key_env}=<the "
                                         f"service's key>, or set reward.sandbox.api_key_env=null for a service "
                                         f"without one.")
            self.runner = SandboxFusionClient(sandbox.url, max_concurrent=sandbox.max_concurrent,
                                              memory_limit_mb=sandbox.memory_limit_mb,
                                              run_timeout_s=sandbox.run_timeout_s, api_key=key)
        else:
            isolation = resolve_isolation(sandbox.isolation, sandbox.allow_weaker)
            self.runner = LocalExecutor(isolation, Limits(wall_s=sandbox.run_timeout_s,
                                                          memory_mb=sandbox.memory_limit_mb))
        self.pool = concurrent.futures.ThreadPoolExecutor(sandbox.max_concurrent, thread_name_prefix="megappo-code")

    def run(self, program: str, case: TestCase) -> RunResult:
        return self.runner.run(program, case.stdin, call=case.fn_name)


_runs: _Runs | None = None
_lock = threading.Lock()


def configure(sandbox) -> None:
    """Run this process's programs as `sandbox` (a megappo.config.SandboxConfig: reward.sandbox) says; raises
    SandboxUnavailable when its isolation is missing here (unless it allows a weaker one)."""
    global _runs
    with _lock:
        if _runs is not None:
            _runs.pool.shutdown(wait=False)
        _runs = _Runs(sandbox)
        _expression_runs.clear()  # another executor may answer otherwise (its limits)


def close() -> None:
    """End this process's runner and its pool threads (the Scorer's close, at the end of a run): a forked rank
    ends by joining its non-daemon threads, which idle pool threads would otherwise keep waiting. A later
    call runs on a fresh runner."""
    global _runs
    with _lock:
        runs, _runs = _runs, None
    if runs is not None:
        runs.pool.shutdown(wait=True, cancel_futures=True)


def _current() -> _Runs:
    global _runs
    with _lock:
        if _runs is None:
            from megappo.config.reward import SandboxConfig

            _runs = _Runs(SandboxConfig())
        return _runs


#: how a case's run ended, other than `ok`, counted per response (`code_<ending>s`) and in a step's metrics
ENDINGS = ("timeout", "output_limit", "error")


def code(response: str, ground_truth: Any, extra: dict) -> dict:
    """The fraction of the ground truth's test cases the response's program passes (module docstring)."""
    cases = parse_cases(ground_truth)
    program = extract_program(response)
    ended = {f"code_{status}s": 0 for status in ENDINGS}
    if program is None:
        return {"score": 0.0, "code_format_error": 1.0, "code_passed": 0, "code_cases": len(cases), "code_retries": 0,
                **ended}
    runs = _current()
    results = list(runs.pool.map(lambda case: runs.run(program, case), cases))
    passed = sum(case_passed(case, result) for case, result in zip(cases, results))
    score = float(passed == len(cases)) if runs.settings.all_or_nothing else passed / len(cases)
    for result in results:
        if result.status in ENDINGS:
            ended[f"code_{result.status}s"] += 1
    return {"score": score, "code_format_error": 0.0, "code_passed": passed, "code_cases": len(cases),
            "code_retries": sum(r.retries for r in results), **ended}



def run_program(source: str, stdin: str = "") -> RunResult:
    """One program on this process's executor (reward.sandbox: local or a service), waiting for a free slot of
    its reward.sandbox.max_concurrent; raises SandboxUnavailable when programs cannot run at all."""
    runs = _current()
    return runs.pool.submit(runs.runner.run, source, stdin).result()


# -- code_expression: the code demo's reward ----------------------------------------------------------------

EXPRESSION_MAX_CHARS = 200
EXPRESSION_CACHE = 4096
#: the score of an expression that prints the ground truth but was cut by the token budget (no EOS)
EXPRESSION_NOT_STOPPED = 0.5
#: the score of an expression that ran and printed something else than the ground truth, then EOS
EXPRESSION_RAN = 0.1

_expression_runs: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()  # text -> (status, stdout)


def as_expression(response: str) -> str | None:
    """The response as one Python expression (stripped), or None when it is not one (module docstring)."""
    text = response.strip()
    if not text or len(text) > EXPRESSION_MAX_CHARS or "\n" in text or "\r" in text:
        return None
    try:
        ast.parse(text, mode="eval")  # parsing only: nothing of the text runs here
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return text


def code_expression(response: str, ground_truth: Any, extra: dict) -> dict:
    """1 when the program `print(<response>)`, run in the sandbox, prints the ground truth and the response
    ended with EOS; 0.5 without the EOS; 0.1 when it ran, printed something else and ended with EOS; else 0
    (module docstring)."""
    fields = {"expr_format_error": 0.0, "expr_runs": 0.0, "expr_cached": 0.0, "expr_timeouts": 0.0,
              "expr_errors": 0.0}
    expression = as_expression(response)
    if expression is None:
        return {"score": 0.0, **dict(fields, expr_format_error=1.0)}
    with _lock:
        known = _expression_runs.get(expression)
        if known is not None:
            _expression_runs.move_to_end(expression)
    if known is None:
        result = run_program(f"print({expression})\n")
        known = (result.status, result.stdout)
        with _lock:
            _expression_runs[expression] = known
            while len(_expression_runs) > EXPRESSION_CACHE:
                _expression_runs.popitem(last=False)
        fields["expr_runs"] = 1.0
    else:
        fields["expr_cached"] = 1.0
    status, stdout = known
    fields["expr_timeouts"] = float(status == "timeout")
    fields["expr_errors"] = float(status in ("error", "output_limit"))
    stopped = extra.get("finish_reason", "stop") == "stop"
    if status != "ok":
        return {"score": 0.0, **fields}
    if stdout.strip() != str(ground_truth).strip():
        return {"score": EXPRESSION_RAN if stopped else 0.0, **fields}
    return {"score": 1.0 if stopped else EXPRESSION_NOT_STOPPED, **fields}


def code_metrics(fields: list[dict]) -> dict[str, float]:
    """A step's `reward/code/...` metrics from the fields `code` returned: responses without a program
    (`format_failures`), the fraction of test cases passed (`case_pass_rate`), service requests retried, and the
    cases whose run was stopped at the time limit (`timeouts`) or the output cap (`output_limits`) or ended
    otherwise than exit 0 (`errors`: an exception, a signal, a memory limit hit); and
    `reward/code_expression/...` from `code_expression`'s: responses that are no expression
    (`format_failures`), programs run in the sandbox (`sandbox_runs`), expressions scored from an earlier run
    (`cached`), runs past the time limit (`timeouts`) and runs that failed (`errors`: an exception, the output
    cap)."""
    out: dict[str, float] = {}
    mine = [f for f in fields if "code_cases" in f]
    if mine:
        cases = sum(f["code_cases"] for f in mine)
        out.update({"reward/code/format_failures": float(sum(f["code_format_error"] for f in mine)),
                    "reward/code/case_pass_rate": sum(f["code_passed"] for f in mine) / max(cases, 1),
                    "reward/code/retries": float(sum(f["code_retries"] for f in mine))})
        out.update({f"reward/code/{ending}s": float(sum(f.get(f"code_{ending}s", 0) for f in mine))
                    for ending in ENDINGS})
    expressions = [f for f in fields if "expr_runs" in f]
    for field, name in (("expr_format_error", "format_failures"), ("expr_runs", "sandbox_runs"),
                        ("expr_cached", "cached"), ("expr_timeouts", "timeouts"), ("expr_errors", "errors")):
        if expressions:
            out[f"reward/code_expression/{name}"] = float(sum(f[field] for f in expressions))
    return out
