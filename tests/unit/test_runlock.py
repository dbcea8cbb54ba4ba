"""One run per directory (megappo.trainer.runlock): a held lock refuses a second run with its holder's
PID, host and start time; a lock left by a killed process is stale and taken; an exception
releases it; the ranks a launcher starts accept their launcher's lock."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from megappo.trainer.runlock import LOCK_FILE, TOKEN_ENV, RunLocked, acquire

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOLDER = textwrap.dedent("""
    import sys, time
    from megappo.trainer.runlock import acquire
    lock = acquire(sys.argv[1:])
    print("held", flush=True)
    time.sleep(600)
""")


def _holder(*dirs, env=None):
    """A child process that takes the lock on `dirs` and sleeps; returned once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, dirs)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env=env or dict(os.environ, PYTHONPATH=REPO))
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(autouse=True)
def no_inherited_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def test_held_then_released(tmp_path):
    lock = acquire([tmp_path / "run", tmp_path / "run" / "checkpoints"])
    record = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert os.environ[TOKEN_ENV] == record["token"]
    assert (tmp_path / "run" / "checkpoints" / LOCK_FILE).is_file()
    lock.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists() and TOKEN_ENV not in os.environ
    acquire([tmp_path / "run"]).release()  # free again


def test_second_run_is_refused_with_the_holder(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunLocked) as e:
            acquire([tmp_path])
        msg = str(e.value)
        assert f"{tmp_path} is in use by another megappo run (PID {proc.pid} on host {socket.gethostname()}, " \
               "started " in msg
        assert msg.endswith("Fix: wait for that run to end, or choose another run.output_dir.")
        assert "\n" not in msg
    finally:
        proc.kill()
        proc.wait()


def test_checkpoint_dir_held_elsewhere_is_refused_and_nothing_is_kept(tmp_path):
    proc = _holder(tmp_path / "ckpt")
    try:
        with pytest.raises(RunLocked, match="ckpt is in use"):
            acquire([tmp_path / "run", tmp_path / "ckpt"], what="run.output_dir / checkpoint.dir")
        assert not (tmp_path / "run" / LOCK_FILE).exists()  # the first lock was let go
    finally:
        proc.kill()
        proc.wait()


def test_lock_of_a_killed_process_is_stale_and_taken(tmp_path, capsys):
    proc = _holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / LOCK_FILE).is_file()  # left behind, but the OS released the flock
    with acquire([tmp_path]):
        err = capsys.readouterr().err
        assert err == (f"megappo: {tmp_path / LOCK_FILE} was left by a run that is gone (PID {proc.pid} on host "
                       f"{socket.gethostname()}, started {err.split('started ')[1].split(')')[0]}): a stale lock, "
                       "taken.\n")
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_released_when_the_run_raises(tmp_path):
    with pytest.raises(ValueError):
        with acquire([tmp_path]):
            raise ValueError("the run failed")
    assert not (tmp_path / LOCK_FILE).exists()
    acquire([tmp_path]).release()


def test_ranks_of_the_launcher_that_holds_it_go_on(tmp_path):
    """A launcher holds the lock and exports its token; the rank it starts (and restarts) accepts it."""
    with acquire([tmp_path]):
        child = subprocess.run([sys.executable, "-c", "import sys; from megappo.trainer.runlock import acquire; "
                                "acquire(sys.argv[1:]); print('ok')", str(tmp_path)], cwd=REPO, text=True,
                               capture_output=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
        assert child.stdout.strip() == "ok", child.stderr
        stranger = subprocess.run([sys.executable, "-c", "import sys; from megappo.trainer.runlock import acquire; "
                                   "acquire(sys.argv[1:])", str(tmp_path)], cwd=REPO, text=True, capture_output=True,
                                  env={k: v for k, v in dict(os.environ, PYTHONPATH=REPO).items() if k != TOKEN_ENV},
                                  timeout=60)
        assert stranger.returncode != 0 and "is in use by another megappo run" in stranger.stderr
        assert (tmp_path / LOCK_FILE).is_file()  # the rank did not remove its launcher's lock


def test_directories_made_for_the_lock_are_removed_when_empty(tmp_path):
    """A run refused before it wrote anything (e.g. bad data found by the rank) leaves no directory."""
    from megappo.trainer.runlock import acquire

    with acquire([str(tmp_path / "a" / "run")]):
        assert (tmp_path / "a" / "run" / "megappo.lock").exists()
    assert not (tmp_path / "a").exists()
    with acquire([str(tmp_path / "b")]):
        (tmp_path / "b" / "metrics.jsonl").write_text("")
    assert (tmp_path / "b" / "metrics.jsonl").exists() and not (tmp_path / "b" / "megappo.lock").exists()
