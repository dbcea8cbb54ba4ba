"""The tool-calling environment (`rollout.env: tools`): parse tool calls, run Python tools, answer.

Owns, in reading order:
  * `parse_tool_calls(text)`: the Qwen/Hermes format, `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`, several per turn, arguments as an object or as a JSON string; what cannot be
    read becomes a `MalformedCall` (an error observation for the model, never an exception);
  * `Tool` / `@tool` / `resolve_tools`: plain Python callables (sync or async) named by a built-in
    name (`calculator`) or an import path (`my_pkg.tools:search`, `path/to/file.py:search`), each
    with a JSON schema derived from its signature and docstring, in the OpenAI/HF `tools=` layout
    that Qwen/Hermes chat templates accept; `system_prompt(tools)` renders them as text for
    templates that have no `tools=` (SmolLM2);
  * `run_call`: one call under a timeout; whatever goes wrong (unknown tool, bad arguments, an
    exception, the timeout) becomes an error result, except an InfrastructureError (a code executor
    that cannot run programs), which stops the run;
  * `ToolEnv`: the Environment that ties them together, and the built-in tools: `calculator`, and
    `python`, which runs the model's program on the sandboxed code executor (reward.sandbox,
    megappo.rewards.code_reward.run_program; never in this process) and answers with its stdout and
    stderr, cut, and how it ended; a tool may return a `ToolOutput` whose counters become `env/...`
    metrics (`python_runs`, `python_timeouts`, `python_errors`).

Timeouts, honestly: an `async def` tool is cancelled at its next `await` when its time is up. A
plain function runs in a daemon thread of its own; at the timeout the episode stops waiting and
gets an error, but Python cannot stop a thread: the function runs on in the background until it
returns (the process exits without waiting for it), and a CPU-bound one holds the GIL share it
takes. So a tool that can really hang (network, subprocess) should be `async` or enforce its own
deadline (a socket timeout, `subprocess.run(timeout=...)`); `tool_timeouts` counts the calls cut off.

This module does not know about engines, tokenizers, chat templates, reward functions or PPO:
the runner renders the observation as a turn of role "tool" and the reward functions score the
final answer (the action with no tool call, which ends the episode).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import fractions
import functools
import inspect
import json
import operator
import re
import sys
import threading
import typing
from typing import Any, Callable, Sequence

from megappo.errors import ConfigError, InfrastructureError
from megappo.user_code import load_spec
from megappo.envs.base import Action, Environment, Episode, StepResult

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


# --------------------------------------------------------------------------------------- parsing

@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the tool's name and its arguments."""

    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    """A `<tool_call>` block that is not a call; `error` says why, for the model to read."""

    raw: str
    error: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every `<tool_call>` block of `text`, in order; text around the blocks is ignored.

    The JSON inside a block is read with a JSON decoder (not a regex), so nested braces and a
    `</tool_call>` inside a string value are fine. Accepted inside a block: one object
    `{"name": str, "arguments": object | JSON string of an object}` ("parameters" is read as
    "arguments"; missing arguments are `{}`), or a list of such objects, optionally in a
    ```json fence. A complete object with no closing tag at the very end of the text counts (the
    turn stopped right after it); an unclosed block that is cut off is a `MalformedCall`.
    """
    calls: list[ToolCall | MalformedCall] = []
    pos = text.find(OPEN)
    while pos != -1:
        start = pos + len(OPEN)
        end = text.find(CLOSE, start)
        decoded = _decode_block(text, start)
        if decoded is not None:  # a JSON value, then (whitespace and) the closing tag or the end
            value, after = decoded
            rest = text[after:].lstrip()
            if rest.startswith(CLOSE) or not rest or rest.startswith(OPEN):
                calls.extend(_calls_from(value, text[start:after].strip()))
                pos = text.find(OPEN, after)
                continue
        body = text[start:end if end != -1 else len(text)].strip()
        calls.append(_malformed(body, end == -1))
        pos = text.find(OPEN, end + len(CLOSE)) if end != -1 else -1
    return calls


def _decode_block(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value starting at `start` (after whitespace or a ```json fence) and where it ends."""
    i = len(text) - len(text[start:].lstrip())
    fence = re.match(r"```(?:json)?\s*", text[i:])
    if fence:
        i += fence.end()
    try:
        value, after = json.JSONDecoder().raw_decode(text, i)
    except json.JSONDecodeError:
        return None
    if fence:
        close = re.match(r"\s*```", text[after:])
        if not close:
            return None
        after += close.end()
    return value, after


def _malformed(body: str, unclosed: bool) -> MalformedCall:
    if not body:
        why = "an empty tool call"
    else:
        try:
            json.loads(_FENCE.sub(r"\1", body))
            why = "text after the JSON object"
        except json.JSONDecodeError as e:
            why = f"invalid JSON: {e.msg} (character {e.pos})"
    if unclosed:
        why = f"no closing {CLOSE}, {why}"
    return _bad(body, why)


def _bad(raw: str, why: str) -> MalformedCall:
    return MalformedCall(raw=raw, error=why + '; write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>')


def _calls_from(value: Any, raw: str) -> list[ToolCall | MalformedCall]:
    if isinstance(value, list) and value:
        return [c for v in value for c in _calls_from(v, json.dumps(v))]
    if not isinstance(value, dict):
        return [_bad(raw, f"expected a JSON object with \"name\" and \"arguments\", got {type(value).__name__}")]
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return [_bad(raw, 'the call has no "name" (a string)')]
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON-encoded string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return [_bad(raw, f'"arguments" is a string that is not JSON: {e.msg} (character {e.pos})')]
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return [_bad(raw, f'"arguments" must be a JSON object, got {type(args).__name__}')]
    return [ToolCall(name=name, arguments=args)]


# ------------------------------------------------------------------------------------ registry

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               tuple: "array"}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the model may call, with the schema shown to it."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict  # JSON schema of the arguments: {"type": "object", "properties": ..., "required": ...}
    timeout_s: float | None = None  # None: the environment's timeout_s

    @property
    def schema(self) -> dict:
        """The OpenAI / HF chat-template layout (`tokenizer.apply_chat_template(..., tools=[...])`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    @classmethod
    def from_function(cls, fn: Callable, name: str | None = None, description: str | None = None,
                      timeout_s: float | None = None) -> "Tool":
        """Name, description and parameter schema from `fn`'s name, signature, type hints and docstring
        (first paragraph; parameter lines from a Google-style `Args:` section)."""
        summary, arg_docs = _docstring(inspect.getdoc(fn) or "")
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # unresolvable annotations: no types, the names still work
            hints = {}
        props, required = {}, []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            prop = _json_type(hints.get(p.name))
            if p.name in arg_docs:
                prop["description"] = arg_docs[p.name]
            props[p.name] = prop
            if p.default is p.empty:
                required.append(p.name)
        return cls(name=name or getattr(fn, "__name__", type(fn).__name__), fn=fn, description=description or summary,
                   parameters={"type": "object", "properties": props, "required": required}, timeout_s=timeout_s)


def _json_type(hint: Any) -> dict:
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _JSON_TYPES:
        return {"type": _JSON_TYPES[origin]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if args and type(None) in args:  # Optional[X]
        rest = [a for a in args if a is not type(None)]
        return _json_type(rest[0]) if len(rest) == 1 else {}
    return {}


def _docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {argument: description}) of a docstring with an optional Google-style `Args:`."""
    summary = " ".join(doc.split("\n\n", 1)[0].split())
    lines = doc.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:")), len(lines))
    args: dict[str, str] = {}
    current, indent = None, None
    for line in lines[start:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:  # the next section
            break
        m = re.match(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line.strip())
        if depth == indent and m:
            current = m.group(1)
            args[current] = m.group(2)
        elif current:
            args[current] += " " + line.strip()
    return summary, args


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
         timeout_s: float | None = None):
    """Mark a function as a tool (optional: any plain callable works): `@tool` or
    `@tool(name="search", timeout_s=10)`. Name it in `rollout.env_args.tools` by its import path."""
    def mark(f: Callable) -> Callable:
        f.__megappo_tool__ = Tool.from_function(f, name=name, description=description, timeout_s=timeout_s)
        return f
    return mark(fn) if fn is not None else mark


#: tools named by a short name in `rollout.env_args.tools`
BUILTIN: dict[str, str] = {"calculator": "megappo.envs.tools:calculator", "python": "megappo.envs.tools:python"}

_FIX = ("Fix: name tools in rollout.env_args.tools as a built-in name (" + ", ".join(sorted(BUILTIN)) +
        "), package.module:function, or path/to/file.py:function.")


def resolve_tools(specs: Sequence[str]) -> dict[str, Tool]:
    """{tool name: Tool} from built-in names and import paths; a ConfigError names the fix."""
    if isinstance(specs, str) or not isinstance(specs, (list, tuple)):
        raise ConfigError(f"rollout.env_args.tools must be a list of names, got {specs!r}. "
                          f"Example: tools: [calculator, my_pkg.tools:search]. {_FIX}")
    if not specs:
        raise ConfigError(f"rollout.env_args.tools is empty: the model has nothing to call. {_FIX}")
    out: dict[str, Tool] = {}
    for spec in specs:
        if not isinstance(spec, str):
            raise ConfigError(f"tool {spec!r} in rollout.env_args.tools is not a string. {_FIX}")
        t = load_tool(spec)
        if t.name in out:
            raise ConfigError(f"two tools are named '{t.name}' in rollout.env_args.tools ({list(specs)}). Fix: "
                              "give one another name with @tool(name=...).")
        out[t.name] = t
    return out


@functools.cache
def load_tool(spec: str) -> Tool:
    """One tool from a built-in name, `package.module:function` or `path/to/file.py:function`."""
    module, where, attr = load_spec(BUILTIN.get(spec, spec), who=f"tool '{spec}'", fix=_FIX,
                                    malformed=f"unknown tool '{spec}' in rollout.env_args.tools. {_FIX}")
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_") and not inspect.isclass(v))
        raise ConfigError(f"tool '{spec}': '{where}' has no function '{attr}' (it has {found}). {_FIX}")
    marked = getattr(fn, "__megappo_tool__", None)
    return marked if isinstance(marked, Tool) else Tool.from_function(fn)


def system_prompt(tools: Sequence[Tool], preamble: str = "") -> str:
    """The tools as system-prompt text in the Qwen2.5/Hermes wording, for chat templates without
    `tools=` (SmolLM2's). `python -m megappo.envs.tools calculator ...` prints it."""
    lines = [preamble.rstrip() + "\n\n" if preamble else "", "# Tools\n\nYou may call one or more functions to "
             "assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
             "tags:\n<tools>"]
    lines += [json.dumps(t.schema) for t in tools]
    lines.append("</tools>\n\nFor each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}\n</tool_call>")
    return lines[0] + "\n".join(lines[1:])


# ------------------------------------------------------------------------------------ execution

@dataclasses.dataclass(frozen=True)
class ToolOutput:
    """What a tool may return instead of a plain value: the `result` the model reads, and counters summed
    into the step's metrics as `env/<key>` (the python tool's `python_timeouts`)."""

    result: Any
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CallResult:
    name: str
    result: Any = None  # the tool's return value (when ok)
    error: str | None = None  # why there is no result
    timed_out: bool = False
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # a ToolOutput's counters

    @property
    def ok(self) -> bool:
        return self.error is None


async def run_call(call: ToolCall | MalformedCall, tools: dict[str, Tool], timeout_s: float) -> CallResult:
    """Run one call under its timeout (the tool's own `timeout_s`, else `timeout_s`); never raises."""
    if isinstance(call, MalformedCall):
        return CallResult(name="", error=call.error)
    t = tools.get(call.name)
    if t is None:
        return CallResult(call.name, error=f"unknown tool '{call.name}'; the tools are {sorted(tools)}")
    bad = _check_arguments(t, call.arguments)
    if bad:
        return CallResult(call.name, error=bad)
    limit = t.timeout_s if t.timeout_s is not None else timeout_s
    try:
        if inspect.iscoroutinefunction(t.fn):
            result = await asyncio.wait_for(t.fn(**call.arguments), limit)
        else:
            result = await asyncio.wait_for(_in_thread(t.fn, call.arguments), limit)
    except asyncio.TimeoutError:
        return CallResult(call.name, error=f"the call took longer than {limit:g} s and was stopped", timed_out=True)
    except InfrastructureError:  # not the model's doing: the run stops (a sandbox missing, a service down)
        raise
    except Exception as e:  # the tool's own failure is the model's observation
        return CallResult(call.name, error=f"{type(e).__name__}: {e}")
    if isinstance(result, ToolOutput):
        return CallResult(call.name, result=result.result, metrics=dict(result.metrics))
    return CallResult(call.name, result=result)


def _check_arguments(t: Tool, args: dict) -> str | None:
    props, required = t.parameters.get("properties", {}), t.parameters.get("required", [])
    takes_any = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(t.fn).parameters.values())
    unknown = sorted(set(args) - set(props))
    if unknown and not takes_any:
        return f"tool '{t.name}' has no argument {unknown[0]!r}; its arguments are {sorted(props)}"
    missing = [k for k in required if k not in args]
    if missing:
        return f"tool '{t.name}' needs the argument {missing[0]!r}"
    for k, v in args.items():
        want = props.get(k, {}).get("type")
        if want and not _is_json_type(v, want):
            return f"argument {k!r} of tool '{t.name}' must be {'an' if want[0] in 'aeiou' else 'a'} {want}, got {json.dumps(v)}"
    return None


def _is_json_type(value: Any, want: str) -> bool:
    if want == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if want == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "array": list, "object": dict}[want])


def _in_thread(fn: Callable, kwargs: dict) -> asyncio.Future:
    """`fn(**kwargs)` in a daemon thread of its own: a hung call cannot hold a pool's worker or
    keep the process alive; it cannot be stopped either (see the module docstring)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():  # the waiter may have timed out and gone
            (future.set_result if ok else future.set_exception)(value)

    def work() -> None:
        try:
            value, ok = fn(**kwargs), True
        except BaseException as e:  # handed to the awaiting episode
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed while the call ran
            pass

    threading.Thread(target=work, name=f"megappo-tool-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


# ---------------------------------------------------------------------------------- environment

class ToolEnv(Environment):
    """Each action is parsed for tool calls; calls are run and their results are the observation
    (role "tool", one block per call, in the order written); an action without a tool call ends
    the episode and is the final answer for the reward functions.

    StepResult.metrics per action: tool_calls (blocks written, malformed included), tool_errors
    (calls without a result: malformed, unknown tool, bad arguments, raised, timed out, over the
    limit), tool_timeouts, and the counters of tools that return a ToolOutput (the python tool's
    python_runs, python_timeouts, python_errors; logged in the steps where some episode called it).
    The reward is 0 unless call_penalty / error_penalty are set.
    """

    observation_role = "tool"
    metric_keys = ("tool_calls", "tool_errors", "tool_timeouts")

    def __init__(self, tools: Sequence[str] = ("calculator",), max_tool_calls: int = 8, timeout_s: float = 5.0,
                 call_penalty: float = 0.0, error_penalty: float = 0.0, wrap_responses: bool = True,
                 max_result_chars: int = 2000, answer_reward: str | None = None):
        """
        Args:
            tools: built-in names (calculator) or import paths (my_pkg.tools:search, path/to/file.py:fn).
            max_tool_calls: calls run per episode; later ones get an error block and are not run.
            timeout_s: per call, for tools that do not set their own (@tool(timeout_s=...)).
            call_penalty: subtracted from the episode's reward per call written.
            error_penalty: subtracted per call without a result.
            wrap_responses: each block inside <tool_response></tool_response> (Hermes); set false for
                chat templates that wrap a tool turn themselves (Qwen2.5 and Qwen3 do).
            max_result_chars: longer results are cut to this many characters (and say so).
            answer_reward: a reward function (a name or file.py:function, as in reward.functions)
                that scores the final answer ALONE, the action that ends the episode, as this
                environment's reward. The reward functions of reward.functions read the whole
                episode, tool results included, where the right number may stand.
        """
        self.tools = resolve_tools(list(tools) if isinstance(tools, tuple) else tools)
        for key, value, low in (("max_tool_calls", max_tool_calls, 0), ("max_result_chars", max_result_chars, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"rollout.env_args.{key}={value!r} must be an integer >= {low}.")
        for key, value in (("timeout_s", timeout_s), ("call_penalty", call_penalty), ("error_penalty", error_penalty)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
                    key == "timeout_s" and value == 0):
                raise ConfigError(f"rollout.env_args.{key}={value!r} must be a number "
                                  f"{'> 0 (seconds)' if key == 'timeout_s' else '>= 0 (subtracted from the reward)'}.")
        self.max_tool_calls, self.timeout_s = max_tool_calls, float(timeout_s)
        self.call_penalty, self.error_penalty = float(call_penalty), float(error_penalty)
        self.wrap_responses, self.max_result_chars = bool(wrap_responses), max_result_chars
        self.calls_made = 0
        self.episode: Episode | None = None
        self.answer_reward = None
        if answer_reward is not None:
            # the registry of scoring functions (rewards/ sits below envs/), looked up by the name the
            # user gave, as reward.functions does; imported here, when an environment scores answers
            from megappo.rewards import get_reward_fn, score_batch

            if not isinstance(answer_reward, str):
                raise ConfigError(f"rollout.env_args.answer_reward={answer_reward!r} must be the name of a reward "
                                  "function (e.g. reasoning_gym_exact) or file.py:function.")
            get_reward_fn(answer_reward)  # an unknown name fails here, at start-up
            self.answer_reward = functools.partial(score_batch, [answer_reward], None)

    async def reset(self, episode: Episode) -> None:
        self.episode = episode

    def _score_answer(self, action: Action) -> float:
        if self.answer_reward is None:
            return 0.0
        assert self.episode is not None, "reset() comes before step()"
        extra = dict(self.episode.extra, finish_reason=action.finish_reason)  # as the reward functions see it
        (score,) = self.answer_reward([action.text], [self.episode.ground_truth], [extra], [self.episode.data_source])
        return score

    @property
    def schemas(self) -> list[dict]:
        """The tools for `tokenizer.apply_chat_template(messages, tools=env.schemas)`."""
        return [t.schema for t in self.tools.values()]

    async def step(self, action: Action) -> StepResult:
        calls = parse_tool_calls(action.text)
        if not calls:
            return StepResult(done=True, reward=self._score_answer(action),
                              metrics={"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0})
        allowed = max(0, self.max_tool_calls - self.calls_made)
        results = list(await asyncio.gather(*(run_call(c, self.tools, self.timeout_s) for c in calls[:allowed])))
        results += [CallResult(c.name if isinstance(c, ToolCall) else "", error=f"the limit of {self.max_tool_calls} "
                               "tool calls per episode is reached; this call was not run. Answer without tools.")
                    for c in calls[allowed:]]
        self.calls_made += len(calls)
        errors = sum(not r.ok for r in results)
        metrics = {"tool_calls": len(calls), "tool_errors": errors, "tool_timeouts": sum(r.timed_out for r in results)}
        for r in results:
            for key, value in r.metrics.items():
                metrics[key] = metrics.get(key, 0) + value
        return StepResult(
            observation="\n".join(self._block(r) for r in results),
            reward=-(self.call_penalty * len(calls) + self.error_penalty * errors), metrics=metrics)

    def _block(self, r: CallResult) -> str:
        body: dict[str, Any] = {"name": r.name} if r.name else {}
        if r.ok:
            body["result"] = r.result if _jsonable(r.result) else str(r.result)
        else:
            body["error"] = r.error
        text = json.dumps(body, ensure_ascii=False)
        if len(text) > self.max_result_chars:
            text = text[:self.max_result_chars] + f"... [cut at {self.max_result_chars} characters]"
        return f"<tool_response>\n{text}\n</tool_response>" if self.wrap_responses else text


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# --------------------------------------------------------------------------------------- python

#: of stdout and of stderr each, in the python tool's answer (ToolEnv's max_result_chars cuts the whole block)
PYTHON_MAX_CHARS = 1000
#: the python tool's own bound, beyond the sandbox's wall limit (reward.sandbox.run_timeout_s, which kills the
#: program and is reported); reached only when every executor slot stays busy
PYTHON_TIMEOUT_S = 60.0


def _cut(text: str, limit: int = PYTHON_MAX_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [cut: {len(text)} characters]"


@tool(name="python", timeout_s=PYTHON_TIMEOUT_S)
def python(code: str) -> ToolOutput:
    """Run a Python program and see what it prints: its stdout and stderr (cut), and whether it failed or timed out.

    Args:
        code: the program's source; print what you need to see. No network, no files of the host.
    """
    # rewards/ sits below envs/: the code executor of this process, as reward.sandbox configured it
    from megappo.rewards.code_reward import run_program

    if not isinstance(code, str):
        raise ValueError("code must be a string holding a Python program")
    result = run_program(code)
    parts = [f"stdout:\n{_cut(result.stdout)}"] if result.stdout else []
    if result.stderr:
        parts.append(f"stderr:\n{_cut(result.stderr)}")
    ended = {"ok": None, "error": f"exit code {result.exit_code}",
             "timeout": f"stopped: past the time limit ({result.wall_s:.1f} s)",
             "output_limit": "stopped: it printed more than the output limit"}[result.status]
    if ended:
        parts.append(ended)
    return ToolOutput("\n".join(parts) or "(no output)",
                      {"python_runs": 1.0, "python_timeouts": float(result.status == "timeout"),
                       "python_errors": float(result.status in ("error", "output_limit"))})


def runs_python(env: str, env_args: dict) -> bool:
    """Whether rollout.env / env_args use the python tool (the trainer configures the code executor for it)."""
    tools = env_args.get("tools", ("calculator",))
    return env == "tools" and isinstance(tools, (list, tuple)) and any(
        BUILTIN.get(t, t) == BUILTIN["python"] for t in tools if isinstance(t, str))


# ----------------------------------------------------------------------------------- calculator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.BitXor: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION_CHARS = 500
_MAX_BITS = 4096  # of a numerator or denominator: keeps 9**9**9 from eating the CPU


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "(3 + 4) * 12 / 5".

    Args:
        expression: numbers with + - * / // % ** (or ^) and parentheses; the result is an integer or a fraction such as 7/3.
    """
    if not isinstance(expression, str):
        raise ValueError("expression must be a string such as \"12 * (3 + 4)\"")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,234
    if len(text) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _evaluate(node: ast.AST) -> fractions.Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return fractions.Fraction(str(node.value)) if isinstance(node.value, float) else fractions.Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        op = type(node.op)
        if op in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
            raise ZeroDivisionError("division by zero")
        if op in (ast.Pow, ast.BitXor):
            if right.denominator != 1:
                raise ValueError("only whole-number powers are exact; the exponent must be an integer")
            if left == 0 and right < 0:
                raise ZeroDivisionError("0 to a negative power")
            size = max(left.numerator.bit_length(), left.denominator.bit_length())
            if size * abs(right.numerator) > _MAX_BITS:
                raise ValueError(f"the result would have more than {_MAX_BITS} bits")
        result = fractions.Fraction(_BINARY[op](left, right))
        if max(result.numerator.bit_length(), result.denominator.bit_length()) > _MAX_BITS:
            raise ValueError(f"the result would have more than {_MAX_BITS} bits")
        return result
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses only)")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m megappo.envs.tools calculator my_pkg.tools:search [--json]`: the system prompt
    (or the `tools=` JSON) for these tools, to paste into a recipe or a dataset's system message."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    names = [a for a in argv if a != "--json"] or ["calculator"]
    try:
        tools = resolve_tools(names)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps([t.schema for t in tools.values()], indent=2) if as_json else system_prompt(list(tools.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
