"""The tool-calling environment (megappo/envs/tools.py): Hermes/Qwen tool-call parsing, tools from
import paths with their schemas, timeouts, the calculator, and whole episodes through reset/step."""

import asyncio
import json
import threading
import time

import pytest

from megappo.config import ConfigError
from megappo.envs.base import Action, Episode
from megappo.envs.tools import (MalformedCall, Tool, ToolCall, ToolEnv, calculator, load_tool, main, parse_tool_calls,
                                resolve_tools, run_call, system_prompt, tool)


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# ----------------------------------------------------------------------------------------- parsing

def test_one_call_with_text_around():
    text = "Let me compute.\n" + call("calculator", expression="2+3") + "\nThen I answer."
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2+3"})]


def test_several_calls_in_one_turn_in_order():
    text = call("a", x=1) + " and " + call("b") + '<tool_call>{"name": "c", "arguments": {"y": [1, 2]}}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {}), ToolCall("c", {"y": [1, 2]})]


def test_arguments_as_a_json_string_and_nested_braces():
    nested = {"filter": {"and": [{"k": "v"}, {"deep": {"deeper": {}}}]}, "q": "a } brace"}
    text = '<tool_call>{"name": "search", "arguments": ' + json.dumps(json.dumps(nested)) + "}</tool_call>"
    assert parse_tool_calls(text) == [ToolCall("search", nested)]
    assert parse_tool_calls(call("search", **nested)) == [ToolCall("search", nested)]


def test_closing_tag_inside_a_string_value():
    text = '<tool_call>{"name": "echo", "arguments": {"s": "</tool_call> {"}}</tool_call> after'
    assert parse_tool_calls(text) == [ToolCall("echo", {"s": "</tool_call> {"})]


def test_variants_models_write():
    fenced = '<tool_call>\n```json\n{"name": "f", "arguments": {"a": 1}}\n```\n</tool_call>'
    listed = '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"b": 2}}]</tool_call>'
    no_close = 'ok <tool_call>{"name": "f", "arguments": {"a": 1}}'  # stopped right after the JSON
    assert parse_tool_calls(fenced) == [ToolCall("f", {"a": 1})]
    assert parse_tool_calls(listed) == [ToolCall("f", {}), ToolCall("g", {"b": 2})]
    assert parse_tool_calls(no_close) == [ToolCall("f", {"a": 1})]
    assert parse_tool_calls("no call here, just {\"name\": \"f\"}") == []


@pytest.mark.parametrize("text,why", [
    ("<tool_call>{name: f}</tool_call>", "invalid JSON: Expecting property name enclosed in double quotes"),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "invalid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'the call has no "name"'),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object, got list'),
    ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', '"arguments" is a string that is not JSON'),
    ('<tool_call>"f"</tool_call>', "expected a JSON object"),
    ("<tool_call></tool_call>", "an empty tool call"),
    ('<tool_call>{"name": "f"} extra</tool_call>', "invalid JSON: Extra data"),
    ('<tool_call>{"name": "f", "argum', "no closing </tool_call>, invalid JSON: Unterminated string"),
])
def test_malformed_calls_are_reported_not_raised(text, why):
    (got,) = parse_tool_calls(text)
    assert isinstance(got, MalformedCall) and why in got.error, got
    assert got.error.endswith('write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>')


def test_a_malformed_call_does_not_hide_the_next_one():
    text = "<tool_call>{bad</tool_call>" + call("f", a=1)
    bad, good = parse_tool_calls(text)
    assert isinstance(bad, MalformedCall) and bad.raw == "{bad" and good == ToolCall("f", {"a": 1})


# ---------------------------------------------------------------------------------------- registry

TOOLS_MODULE = '''
from megappo.envs.tools import tool

def lookup(key: str, limit: int = 3, exact: bool = False) -> str:
    """Look a key up in the table.

    Args:
        key: the key to find.
        limit: at most this many
            results.
        exact (bool): match the whole key.

    Returns:
        The values.
    """
    return key * limit

@tool(name="add", timeout_s=0.5)
def add_numbers(a: int, b: float) -> float:
    """Add two numbers."""
    return a + b

async def shout(text: str):
    return text.upper()

TABLE = {"a": 1}
'''


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    pkg = tmp_path / "my_tools_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tools.py").write_text(TOOLS_MODULE)
    (tmp_path / "loose_tools.py").write_text(TOOLS_MODULE)
    (tmp_path / "broken_tools.py").write_text("1 / 0\n")
    monkeypatch.chdir(tmp_path)
    load_tool.cache_clear()
    yield tmp_path
    load_tool.cache_clear()


def test_tools_from_import_paths_with_schemas_from_signature_and_docstring(user_tools):
    tools = resolve_tools(["calculator", "my_tools_pkg.tools:lookup", "loose_tools.py:add_numbers",
                           "my_tools_pkg.tools:shout"])
    assert list(tools) == ["calculator", "lookup", "add", "shout"]
    assert tools["lookup"].schema == {"type": "function", "function": {
        "name": "lookup", "description": "Look a key up in the table.",
        "parameters": {"type": "object", "required": ["key"], "properties": {
            "key": {"type": "string", "description": "the key to find."},
            "limit": {"type": "integer", "description": "at most this many results."},
            "exact": {"type": "boolean", "description": "match the whole key."}}}}}
    add = tools["add"]  # @tool's name and timeout win over the function's
    assert add.timeout_s == 0.5 and add.description == "Add two numbers."
    assert add.parameters["properties"] == {"a": {"type": "integer"}, "b": {"type": "number"}}
    assert tools["calculator"].parameters["required"] == ["expression"]
    prompt = system_prompt(list(tools.values()))
    assert "<tools>\n" + json.dumps(tools["calculator"].schema) + "\n" in prompt and "<tool_call>" in prompt


BAD_TOOLS = {
    "no colon": ("search", "unknown tool 'search' in rollout.env_args.tools. Fix: name tools in "
                           "rollout.env_args.tools as a built-in name (calculator, python), package.module:function, or "
                           "path/to/file.py:function."),
    "no file": ("nope.py:f", "tool 'nope.py:f': file 'nope.py' does not exist (relative paths start at"),
    "no module": ("no_such_module_xyz:f", "tool 'no_such_module_xyz:f': cannot import 'no_such_module_xyz'"),
    "no function": ("my_tools_pkg.tools:serch", "tool 'my_tools_pkg.tools:serch': 'my_tools_pkg.tools' has no "
                                               "function 'serch' (it has ['add_numbers', 'lookup', 'shout', 'tool'])"),
    "not callable": ("loose_tools.py:TABLE", "'loose_tools.py' has no function 'TABLE'"),
    "module raises": ("broken_tools.py:f", "tool 'broken_tools.py:f': importing 'broken_tools.py' raised "
                                          "ZeroDivisionError: division by zero. Fix: correct that file."),
}


@pytest.mark.parametrize("case", sorted(BAD_TOOLS))
def test_bad_tool_paths_name_the_fix(user_tools, case):
    spec, message = BAD_TOOLS[case]
    with pytest.raises(ConfigError) as e:
        resolve_tools([spec])
    assert message in str(e.value)
    assert "Fix:" in str(e.value)


def test_bad_tool_lists(user_tools):
    with pytest.raises(ConfigError, match=r"must be a list of names, got 'calculator'. Example: tools: \[calc"):
        resolve_tools("calculator")
    with pytest.raises(ConfigError, match="is empty: the model has nothing to call"):
        resolve_tools([])
    with pytest.raises(ConfigError, match=r"tool \{'name': 'calculator'\} in rollout.env_args.tools is not a string"):
        resolve_tools([{"name": "calculator"}])
    with pytest.raises(ConfigError, match=r"two tools are named 'add'.*Fix: give one another name with @tool\(name"):
        resolve_tools(["my_tools_pkg.tools:add_numbers", "loose_tools.py:add_numbers"])


# --------------------------------------------------------------------------------------- execution

def run(coro):
    return asyncio.run(coro)


def test_a_hanging_sync_tool_times_out_and_the_episode_goes_on():
    release = threading.Event()

    def hang(seconds: float) -> str:
        release.wait(seconds)
        return "late"

    tools = {"hang": Tool.from_function(hang)}
    start = time.monotonic()
    got = run(run_call(ToolCall("hang", {"seconds": 30}), tools, timeout_s=0.2))
    assert time.monotonic() - start < 5
    assert got.timed_out and got.error == "the call took longer than 0.2 s and was stopped"
    release.set()  # the thread cannot be stopped from outside; let it finish
    assert run(run_call(ToolCall("hang", {"seconds": 0}), tools, timeout_s=5)).result == "late"


def test_an_async_tool_is_cancelled_at_its_timeout():
    state = []

    async def slow(n: int) -> int:
        try:
            await asyncio.sleep(30)
        finally:
            state.append("cancelled")
        return n

    tools = {"slow": Tool.from_function(slow, timeout_s=0.1)}  # the tool's own timeout wins
    got = run(run_call(ToolCall("slow", {"n": 1}), tools, timeout_s=60))
    assert got.timed_out and "0.1 s" in got.error and state == ["cancelled"]


def test_errors_become_results():
    def boom(x: int) -> int:
        raise KeyError("no such row")

    tools = {"boom": Tool.from_function(boom), "calculator": load_tool("calculator")}
    cases = [
        (ToolCall("boom", {"x": 1}), "KeyError: 'no such row'"),
        (ToolCall("nope", {}), "unknown tool 'nope'; the tools are ['boom', 'calculator']"),
        (ToolCall("boom", {}), "tool 'boom' needs the argument 'x'"),
        (ToolCall("boom", {"x": 1, "y": 2}), "tool 'boom' has no argument 'y'; its arguments are ['x']"),
        (ToolCall("boom", {"x": "1"}), "argument 'x' of tool 'boom' must be an integer, got \"1\""),
        (ToolCall("calculator", {"expression": "1/0"}), "ZeroDivisionError: division by zero"),
        (MalformedCall("{", "invalid JSON"), "invalid JSON"),
    ]
    for c, error in cases:
        got = run(run_call(c, tools, timeout_s=5))
        assert got.error == error and not got.timed_out, (c, got)


# -------------------------------------------------------------------------------------- calculator

@pytest.mark.parametrize("expression,value", [
    ("2 + 3", "5"), ("7 - 10", "-3"), ("(3 + 4) * 12 / 5", "84/5"), ("7 / 3 * 3", "7"), ("0.1 + 0.2", "3/10"),
    ("2 ** 100", str(2 ** 100)), ("2^-2", "1/4"), ("-(-4) % 3", "1"), ("17 // 5", "3"), ("1,234 + 1", "1235"),
    ("6 × 7 ÷ 2 − 1", "20"), ("123456789 * 987654321", str(123456789 * 987654321)), ("1/3 + 1/6", "1/2"),
])
def test_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression,error", [
    ("__import__('os').system('true')", "not arithmetic"), ("x + 1", "not arithmetic: 'x'"),
    ("abs(-1)", "not arithmetic"), ("'a' * 3", "not arithmetic"), ("True + 1", "not arithmetic: 'True'"),
    ("[1, 2]", "not arithmetic"), ("1 < 2", "not arithmetic"), ("lambda: 1", "not arithmetic"),
    ("(1).real", "not arithmetic"), ("1 +", "not an arithmetic expression"), ("9 ** 9 ** 9", "more than 4096 bits"),
    ("2 ** 0.5", "exponent must be an integer"), ("1 / 0", "division by zero"), ("1" * 600, "longer than 500"),
])
def test_calculator_refuses_what_is_not_arithmetic(expression, error):
    with pytest.raises((ValueError, ZeroDivisionError), match=error):
        calculator(expression)


# ------------------------------------------------------------------------------------------ episode

EPISODE = Episode(prompt_ids=(1, 2, 3), ground_truth="84/5", extra={}, data_source="test", index=0)


def act(text, turn):
    return Action(text=text, token_ids=(7,) * 3, finish_reason="stop", turn=turn)


def test_a_whole_episode_by_hand():
    env = ToolEnv(tools=["calculator"])
    assert env.observation_role == "tool" and [s["function"]["name"] for s in env.schemas] == ["calculator"]

    async def episode():
        await env.reset(EPISODE)
        first = await env.step(act("I will use the calculator. " + call("calculator", expression="(3 + 4) * 12")
                                   + call("calculator", expression="x") + "<tool_call>{oops</tool_call>", 0))
        second = await env.step(act(call("calculator", expression="84 / 5"), 1))
        last = await env.step(act("The answer is 84/5.", 2))
        await env.close()
        return first, second, last

    first, second, last = run(episode())
    assert not first.done and first.reward == 0.0
    assert first.metrics == {"tool_calls": 3, "tool_errors": 2, "tool_timeouts": 0}
    blocks = first.observation.split("\n")
    assert blocks[0::3] == ["<tool_response>"] * 3 and blocks[2::3] == ["</tool_response>"] * 3
    assert json.loads(blocks[1]) == {"name": "calculator", "result": "84"}
    assert json.loads(blocks[4])["error"].startswith("ValueError: not arithmetic: 'x'")
    assert json.loads(blocks[7]) == {"error": 'invalid JSON: Expecting property name enclosed in double quotes '
                                              '(character 1); write <tool_call>{"name": "<tool>", "arguments": '
                                              '{...}}</tool_call>'}
    assert second.observation == '<tool_response>\n{"name": "calculator", "result": "84/5"}\n</tool_response>'
    assert last.done and last.observation is None and last.reward == 0.0
    assert last.metrics == {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0}


def test_call_limit_and_penalties():
    env = ToolEnv(max_tool_calls=2, call_penalty=0.1, error_penalty=0.5, wrap_responses=False)
    first = run(env.step(act(call("calculator", expression="1+1") * 3, 0)))
    assert first.metrics == {"tool_calls": 3, "tool_errors": 1, "tool_timeouts": 0}
    assert first.reward == pytest.approx(-(0.1 * 3 + 0.5))
    lines = first.observation.split("\n")
    assert [json.loads(x).get("result") for x in lines] == ["2", "2", None]  # not wrapped: one JSON line per call
    assert "limit of 2 tool calls per episode is reached" in json.loads(lines[2])["error"]
    again = run(env.step(act(call("calculator", expression="2+2"), 1)))
    assert again.metrics["tool_errors"] == 1 and not again.done


def test_long_results_are_cut():
    env = ToolEnv(max_result_chars=40, wrap_responses=False)
    got = run(env.step(act(call("calculator", expression="10 ** 100"), 0)))
    assert got.observation == '{"name": "calculator", "result": "100000... [cut at 40 characters]'


@pytest.mark.parametrize("kwargs,message", [
    ({"max_tool_calls": -1}, "rollout.env_args.max_tool_calls=-1 must be an integer >= 0"),
    ({"timeout_s": 0}, "rollout.env_args.timeout_s=0 must be a number > 0 (seconds)"),
    ({"call_penalty": "a"}, "rollout.env_args.call_penalty='a' must be a number >= 0"),
    ({"tools": "calculator"}, "rollout.env_args.tools must be a list of names"),
])
def test_bad_env_args(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ToolEnv(**kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tool'"):
        ToolEnv(tool=["calculator"])


def test_prompt_printer(capsys):
    assert main(["calculator"]) == 0
    assert capsys.readouterr().out.startswith("# Tools\n\nYou may call one or more functions")
    assert main(["calculator", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["function"]["name"] == "calculator"
    assert main(["nope"]) == 2 and "unknown tool 'nope'" in capsys.readouterr().err


def test_the_calculator_recipe_shows_the_model_what_the_environment_does():
    """recipes/smollm2-calculator-cpu.yaml: its system prompt is the tools' own description, and
    its few-shot turns are real episodes: each example call parses, and the tool turn after it is
    exactly what ToolEnv answers; the final answers are what the reward function wants."""
    import pathlib

    from megappo.config import load_config
    from megappo.envs.loading import check_env

    cfg = load_config(str(pathlib.Path(__file__).resolve().parents[2] / "recipes" / "smollm2-calculator-cpu.yaml"))
    env_cls = check_env(cfg.rollout.env, cfg.rollout.env_args)
    assert not cfg.reward.functions and cfg.rollout.env_args["answer_reward"] == "reasoning_gym_exact"
    assert cfg.data.system_prompt.endswith(system_prompt(list(env_cls(**cfg.rollout.env_args).tools.values())))
    shots = cfg.data.few_shot
    assert [m["role"] for m in shots] == ["user", "assistant", "tool", "assistant"] * 2
    for question, action, tool_turn, answer in zip(*(shots[i::4] for i in range(4))):
        (parsed,) = parse_tool_calls(action["content"])
        assert isinstance(parsed, ToolCall)
        env = env_cls(**cfg.rollout.env_args)
        run(env.reset(Episode((), calculator(parsed.arguments["expression"]), {}, "reasoning_gym", 0)))
        result = run(env.step(act(action["content"], 0)))
        assert result.observation == tool_turn["content"] and result.metrics["tool_errors"] == 0
        done = run(env.step(act(answer["content"], 1)))
        assert done.done and done.reward == 1.0


def test_answer_reward_scores_the_final_answer_alone():
    """The tool's result holds the right number; only a final answer that states it earns the reward
    (reward functions in reward.functions read the whole episode, where a last-number rule would
    find the tool's result when the answer has no number)."""
    async def episode(answer):
        env = ToolEnv(answer_reward="reasoning_gym_exact")
        await env.reset(EPISODE)
        first = await env.step(act(call("calculator", expression="(3 + 4) * 12 / 5"), 0))
        last = await env.step(act(answer, 1))
        return first, last

    for answer, reward in [("84/5", 1.0), ("The answer is 84/5.", 1.0), ("I don't know.", 0.0), ("16.8 or 17", 0.0)]:
        first, last = run(episode(answer))
        assert '"result": "84/5"' in first.observation and first.reward == 0.0
        assert last.done and last.reward == reward, answer
    with pytest.raises(ConfigError, match="unknown reward function 'reasoning_gym_exakt'.*Did you mean 'reasoning_gym_"):
        ToolEnv(answer_reward="reasoning_gym_exakt")


def test_bare_tool_decorator_keeps_the_function():
    @tool
    def ping(times: int = 1) -> str:
        """Answer pong."""
        return "pong" * times

    assert ping(2) == "pongpong"  # still the plain function
    assert ping.__megappo_tool__.schema["function"] == {
        "name": "ping", "description": "Answer pong.",
        "parameters": {"type": "object", "properties": {"times": {"type": "integer"}}, "required": []}}
