"""tests/prefork.py: a command forked by the server sees what a fresh interpreter sees (argv, sys.path, working
directory, environment, stdin, signals, threads, exit code, output), runs forked (torch already imported) only
when eligible, and behaves as subprocess's run and Popen do on timeouts and signals; under torchrun the
ranks are forks too."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: what a command can see of how it started; `forked`: torch was imported before the command ran
PROBE = textwrap.dedent('''
    import json, os, signal, sys
    forked = "torch" in sys.modules
    import torch
    state = {
        "forked": forked, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
        "env": {k: os.environ.get(k) for k in ("PROBE_VAR", "OMP_NUM_THREADS", "MEGAPPO_ENVIRON_ROOM")},
        "python_path": [p for p in sys.path if "probe_extra" in p], "stdin": sys.stdin.read(),
        "threads": torch.get_num_threads(), "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    }
    print(json.dumps(state))
    print("to stderr\\r\\nline two", file=sys.stderr)
    sys.exit(3)
''')


@pytest.fixture
def probe(tmp_path):
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE)
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "probe_extra").mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PROBE_VAR="x y",
               PYTHONPATH=os.pathsep.join([REPO, str(tmp_path), str(tmp_path / "probe_extra")]))
    return tmp_path, env


@pytest.mark.parametrize("form", ["script", "module"])
def test_a_forked_command_sees_what_a_fresh_interpreter_sees(probe, form):
    tmp_path, env = probe
    cmd = [sys.executable, str(tmp_path / "probe.py"), "a", "--b"] if form == "script" else \
        [sys.executable, "-m", "probe_pkg.probe", "a", "--b"]
    assert prefork.eligible(cmd, env, tmp_path)
    runs = [f(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, input="fed\n", timeout=120)
            for f in (prefork.run, subprocess.run)]
    (forked, fresh) = [json.loads(r.stdout) for r in runs]
    assert forked.pop("forked") and not fresh.pop("forked")  # the first did run in the server's fork
    assert forked == fresh, (forked, fresh)
    assert fresh["stdin"] == "fed\n" and fresh["env"]["PROBE_VAR"] == "x y" and fresh["sigint"]
    assert [r.returncode for r in runs] == [3, 3]
    assert runs[0].stderr == runs[1].stderr == "to stderr\nline two\n"  # text mode: universal newlines


def test_what_is_not_eligible_starts_fresh(probe):
    tmp_path, env = probe
    script = [sys.executable, str(tmp_path / "probe.py")]
    assert not prefork.eligible(script, dict(env, PYTHONHASHSEED="7"), tmp_path)  # read at interpreter start
    assert not prefork.eligible(script, {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}, tmp_path)
    assert not prefork.eligible([sys.executable, "-c", "pass"], env, tmp_path)
    assert not prefork.eligible(["bash", "-c", "true"], env, tmp_path)
    other = tmp_path / "other_checkout"
    (other / "megappo").mkdir(parents=True)
    assert not prefork.eligible(script, dict(env, PYTHONPATH=str(other)), tmp_path)  # another megappo first
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text("")  # run by a fresh interpreter at start-up
    assert not prefork.eligible(script, dict(env, PYTHONPATH=os.pathsep.join([str(custom), REPO])), tmp_path)
    assert prefork.eligible(script, dict(env, PYTHONPATH=os.pathsep.join([str(tmp_path / "probe_extra"), REPO])),
                            tmp_path)
    proc = prefork.run(script, env=dict(env, PYTHONHASHSEED="7"), cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert not json.loads(proc.stdout)["forked"] and proc.returncode == 3


def test_timeouts_and_signals_as_subprocess(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PREFORK_TEST_MARK="m1")
    (tmp_path / "slow.py").write_text("import sys, time\nprint('started', flush=True)\ntime.sleep(600)\n")
    cmd = [sys.executable, str(tmp_path / "slow.py")]
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        prefork.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=5)
    assert timed_out.value.output == "started\n"  # what it wrote before it was killed
    proc = prefork.popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert isinstance(proc, prefork.Forked)
    assert os.getpgid(proc.pid) == os.getsid(proc.pid) == proc.pid  # its own session when popen returns
    assert proc.stdout.readline() == "started\n" and proc.poll() is None
    with open(f"/proc/{proc.pid}/environ", "rb") as f:  # what ps shows: the command's variables
        assert b"PREFORK_TEST_MARK=m1" in f.read().split(b"\0")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)  # reaped by the server


def test_a_timeout_kills_what_the_command_started(tmp_path):
    """A child in a session of its own holds the command's output pipe (as torchrun's ranks do): the timeout
    kills it too, so reading the output ends."""
    import psutil

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "print(child.pid, flush=True)\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        prefork.run([sys.executable, str(tmp_path / "parent.py")], env=env, cwd=tmp_path, capture_output=True,
                    text=True, timeout=10)
    assert time.monotonic() - start < 60
    child = int(timed_out.value.output.split()[0])
    deadline = time.monotonic() + 30
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the command's child outlived the timeout"
        time.sleep(0.1)


def test_the_server_is_outside_this_process_tree():
    """A test that kills its own process's children (SGLang's engine shutdown does) leaves the server running."""
    import psutil

    server = prefork._server()
    assert server is not None and server.alive()
    assert server.pid not in [p.pid for p in psutil.Process().children(recursive=True)]


def test_torchrun_ranks_are_forks_of_the_agent(tmp_path):
    (tmp_path / "rank.py").write_text(textwrap.dedent('''
        import os, sys
        import psutil
        shown = psutil.Process().environ()  # what ps shows: the rank's variables and the test's, as for a fresh rank
        print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} forked={'torch' in sys.modules} "
              f"path0={sys.path[0] == os.path.dirname(os.path.abspath(__file__))} "
              f"shown={shown.get('RANK') == os.environ['RANK'] and shown.get('PREFORK_TEST_MARK') == 'm2'}")
    '''))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, TORCHELASTIC_ERROR_FILE="", PREFORK_TEST_MARK="m2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(tmp_path / "rank.py")]
    proc = prefork.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == \
        [f"rank {r} of 2 forked=True path0=True shown=True" for r in (0, 1)]
