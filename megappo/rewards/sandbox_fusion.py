"""SandboxFusion's `/run_code` interface, as verl calls it: the client megappo's `code` reward uses when
reward.sandbox.url is set, and the answer of a request from a local executor (what
megappo.rewards.sandbox_server serves).

    POST {url}/run_code
      {"code", "language": "python", "compile_timeout", "run_timeout", "memory_limit_MB", "stdin"}
    -> {"status": "Success" | "Failed" | "SandboxError", "message",
        "compile_result": null | {...}, "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
        "return_code", "stdout", "stderr", "execution_time"}}

`SandboxFusionClient.run` has `LocalExecutor.run`'s signature and result. A function call (`call`) is sent as
a driver program: the arguments on stdin, the value printed after a marker line that is new for each
request (the service has only stdout). At most `max_concurrent` requests are in flight per client. Only a
refused connection is retried (the request cannot have run), with backoff, and counted
(`RunResult.retries`); a service that stays down, answers `SandboxError`, an HTTP error or a timeout raises
SandboxUnavailable, never a failed case.

This module does not know about reward functions, test cases or config sections.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.error
import urllib.request

from megappo.rewards.sandbox import Limits, LocalExecutor, RunResult, SandboxUnavailable

_DRIVER = '''import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
_space = {{"__name__": "solution", "__builtins__": __builtins__}}
exec(compile({source!r}, "solution.py", "exec"), _space)
_fn = _space.get({fn!r})
if _fn is None and "Solution" in _space:
    _fn = getattr(_space["Solution"](), {fn!r}, None)
if not callable(_fn):
    _sys.exit("driver: the program defines no function " + {fn!r})
_value = _json.dumps({{"value": _fn(*_args)}})
_sys.stdout.write("\\n" + {mark!r} + _value + "\\n")
'''


class SandboxFusionClient:
    """Runs programs on a SandboxFusion service at `url` (module docstring)."""

    def __init__(self, url: str, max_concurrent: int = 64, memory_limit_mb: int = 1024, run_timeout_s: float = 10.0,
                 compile_timeout_s: float = 10.0, connect_retries: int = 3, backoff_s: float = 0.5,
                 api_key: str | None = None):
        self.url = url.rstrip("/") + "/run_code"
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.memory_limit_mb, self.run_timeout_s, self.compile_timeout_s = memory_limit_mb, run_timeout_s, compile_timeout_s
        self.connect_retries, self.backoff_s = connect_retries, backoff_s
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def run(self, source: str, stdin: str = "", call: str | None = None) -> RunResult:
        """`source` run by the service with `stdin`; with `call`, `stdin` is the JSON list of arguments of the
        program's function `call`, whose value comes back in `RunResult.value`."""
        mark = None
        if call is not None:
            mark = f"@@megappo-value-{secrets.token_hex(8)}@@"
            source = _DRIVER.format(source=source, fn=call, mark=mark)
        request = {"code": source, "language": "python", "compile_timeout": self.compile_timeout_s,
                   "run_timeout": self.run_timeout_s, "memory_limit_MB": self.memory_limit_mb, "stdin": stdin}
        with self._slots:
            answer, retries = self._post(request)
        result = result_of_answer(answer, self.url)
        result.retries = retries
        if mark is not None and result.status == "ok":
            lines = [line for line in result.stdout.split("\n") if line.startswith(mark)]
            try:
                result.value, result.has_value = json.loads(lines[-1][len(mark):])["value"], True
            except (IndexError, ValueError, KeyError, TypeError):
                result.status = "error"
        return result

    def _post(self, request: dict) -> tuple[dict, int]:
        body = json.dumps(request).encode()
        timeout = self.run_timeout_s + self.compile_timeout_s + 30
        for attempt in range(self.connect_retries + 1):
            req = urllib.request.Request(self.url, data=body, headers=self.headers)
            try:
                with urllib.request.urlopen(req, timeout=timeout) as response:
                    return json.loads(response.read()), attempt
            except urllib.error.HTTPError as e:
                raise SandboxUnavailable(f"the sandbox service {self.url} answered HTTP {e.code}: "
                                         f"{e.read()[:200]!r}. Fix: check the service's log.") from None
            except urllib.error.URLError as e:
                if not isinstance(e.reason, ConnectionRefusedError):
                    raise SandboxUnavailable(f"the sandbox service {self.url} failed: {e.reason}. {_FIX}") from None
                if attempt < self.connect_retries:
                    time.sleep(self.backoff_s * 2 ** attempt)  # refused: it never ran, so it may be sent again
            except (TimeoutError, ConnectionError, ValueError) as e:  # no answer (it may have run), or not JSON
                raise SandboxUnavailable(f"the sandbox service {self.url} gave no answer: "
                                         f"{type(e).__name__}: {e}. {_FIX}") from None
        raise SandboxUnavailable(f"the sandbox service {self.url} refused {self.connect_retries + 1} connections. "
                                 f"{_FIX}")


_FIX = ("Fix: start it (python -m megappo.rewards.sandbox_server --port PORT), correct reward.sandbox.url, or set "
        "reward.sandbox.url=null to run programs locally.")


def result_of_answer(answer: dict, url: str) -> RunResult:
    """A service's answer as a RunResult; SandboxUnavailable for a `SandboxError` (the service's own failure)."""
    if answer.get("status") == "SandboxError":
        raise SandboxUnavailable(f"the sandbox service {url} failed: {answer.get('message')}. {_FIX}")
    compiled = answer.get("compile_result") or {}
    if compiled and (compiled.get("status") != "Finished" or compiled.get("return_code")):
        return RunResult("error", compiled.get("return_code"), compiled.get("stdout") or "",
                         compiled.get("stderr") or "", compiled.get("execution_time") or 0.0)
    run = answer.get("run_result") or {}
    code = run.get("return_code")
    status = {"Finished": "ok" if code == 0 else "error", "TimeLimitExceeded": "timeout"}.get(run.get("status"), "error")
    return RunResult(status, code, run.get("stdout") or "", run.get("stderr") or "", run.get("execution_time") or 0.0)


#: how a local run's end reads in SandboxFusion's run_result.status
_RUN_STATUS = {"ok": "Finished", "error": "Finished", "timeout": "TimeLimitExceeded", "output_limit": "Error"}


def answer_request(executor: LocalExecutor, request: dict) -> dict:
    """The `/run_code` answer to `request`, run by the local `executor` under the request's run_timeout and
    memory_limit_MB (what megappo.rewards.sandbox_server serves)."""
    language = request.get("language", "python")
    if language not in ("python", "python3"):
        return {"status": "SandboxError", "message": f"language {language!r} is not supported (python only)",
                "compile_result": None, "run_result": None}
    if not isinstance(request.get("code"), str):
        return {"status": "SandboxError", "message": "the request has no code", "compile_result": None,
                "run_result": None}
    limits = Limits(wall_s=float(request.get("run_timeout") or executor.limits.wall_s),
                    memory_mb=int(request.get("memory_limit_MB") or executor.limits.memory_mb))
    result = executor.run(request["code"], request.get("stdin") or "", limits=limits)
    run = {"status": _RUN_STATUS[result.status], "return_code": result.exit_code, "stdout": result.stdout,
           "stderr": result.stderr, "execution_time": result.wall_s}
    return {"status": "Success" if result.status == "ok" else "Failed", "message": "", "compile_result": None,
            "run_result": run}
