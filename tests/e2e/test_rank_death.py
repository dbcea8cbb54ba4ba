"""A rank killed with SIGKILL through the CLI (docs/launchers.md, "When a rank dies"): the CPU
demo (TP=2, every rank writes checkpoint shards) on 2 gloo ranks started by megappo's launcher, rank 1 killed after a checkpoint was saved.

- Without restarts the run ends (exit 1, one line naming rank 1) and leaves no process behind:
  a checkpoint save starts a multiprocessing child in each rank (Megatron's results queue is a
  `multiprocessing.Manager`, spawned, with its resource tracker), which outlived a killed rank
  until the launcher killed each rank's process group. Nor does a SIGKILL of the launcher itself
  (the ranks get SIGTERM from the kernel, PR_SET_PDEATHSIG, and end with their groups).
- With `run.max_restarts=1` the launcher starts every rank again, they resume from the latest
  checkpoint, and the run ends with the metrics and weights of a run that was never killed
  (bitwise on CPU); the restart is logged (one line, and `restarts.jsonl` in the run dir).

Every process of a run is found by a marker in its environment (inherited by every child).
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import torch

from tests import prefork
from tests.e2e._runs import hf_weights, metrics

pytestmark = pytest.mark.alone  # a run's processes are gone within seconds (tests/conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "MEGAPPO_TEST_RUN"  # only this test reads it: a tag on every process of the run
STEPS = 6
ARGS = [f"run.total_steps={STEPS}", "checkpoint.save_every=2", "checkpoint.save_hf_at_end=true",
        "logging.progress_bar=false", "run.val_before_train=false", "run.val_every=0", "data.train_batch_size=16",
        *(f"{role}.{key}=16" for role in ("actor", "critic") for key in ("ppo_mini_batch_size", "micro_batch_size"))]


def command(out, *extra):
    return [sys.executable, "-m", "megappo.cli", "train", "--world-size", "2", "recipes/demo-cpu.yaml",
            f"run.output_dir={out}", *ARGS, *extra]


def env(mark=""):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    e.pop("WORLD_SIZE", None)
    if mark:
        e[MARK] = mark
    return e


def marked(mark: str) -> list[str]:
    """The live processes whose environment carries `mark` (zombies have none), as 'pid cmdline'."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {cmdline[:200]}")
        except OSError:  # gone, or not ours
            continue
    return found


def kill_all(mark: str) -> None:
    for line in marked(mark):
        with contextlib.suppress(OSError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def kill_rank1_after_checkpoint(cmd, out, mark, timeout=400, victim="rank 1"):
    """Start `cmd`, SIGKILL rank 1 (the launcher's child with RANK=1), or the launcher itself
    (`victim="launcher"`), once step 2's checkpoint is complete, in step 3, and wait for the
    launcher. Returns (exit code, output). The output goes to a file, not a pipe: a process left
    behind would hold a pipe open after the launcher ended."""
    log = os.path.join(os.path.dirname(out), os.path.basename(out) + ".log")
    with open(log, "w") as sink:
        proc = prefork.popen(cmd, env=env(mark), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                             start_new_session=True)
    latest = os.path.join(out, "checkpoints", "latest")
    deadline = time.time() + timeout
    try:
        while not (os.path.isfile(latest) and open(latest).read() == "step_00000002"):
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before its first checkpoint:\n" \
                                        f"{open(log).read()[-6000:]}"
            assert time.time() < deadline, f"no checkpoint after {timeout}s"
            time.sleep(0.02)
        time.sleep(0.1)  # into step 3 (a step takes about 0.3 s)
        rank1 = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
        assert len(rank1) == 1, rank1
        (psutil.Process(proc.pid) if victim == "launcher" else rank1[0]).send_signal(signal.SIGKILL)
        proc.wait(timeout=timeout)
        return proc.returncode, open(log).read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_killed_rank_leaves_no_process_of_the_run(tmp_path):
    out, mark = str(tmp_path / "run"), uuid.uuid4().hex
    try:
        code, output = kill_rank1_after_checkpoint(command(out), out, mark)
        assert code == 1, output[-6000:]
        assert "megappo: rank 1 failed (was ended by signal SIGKILL)" in output, output[-6000:]
        deadline = time.time() + 5  # SIGKILLed processes take a moment to disappear
        while marked(mark) and time.time() < deadline:
            time.sleep(0.1)
        assert not marked(mark), "processes of the run left after the launcher exited:\n" + "\n".join(marked(mark))
    finally:
        kill_all(mark)


def test_a_killed_launcher_leaves_no_process_of_the_run(tmp_path):
    """The launcher itself is killed (nothing can clean up after it): its ranks notice (their
    parent-death signal) and end with everything they started, instead of training on alone."""
    out, mark = str(tmp_path / "run"), uuid.uuid4().hex
    try:
        code, output = kill_rank1_after_checkpoint(command(out, "run.total_steps=200"), out, mark, victim="launcher")
        assert code == -signal.SIGKILL, output[-6000:]
        deadline = time.time() + 10
        while marked(mark) and time.time() < deadline:
            time.sleep(0.1)
        assert not marked(mark), "processes of the run left after the launcher was killed:\n" + "\n".join(marked(mark))
    finally:
        kill_all(mark)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("straight"))
    proc = prefork.run(command(out), env=env(), cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out


def test_restart_after_a_killed_rank_resumes_exactly(straight, tmp_path):
    out, mark = str(tmp_path / "run"), uuid.uuid4().hex
    try:
        code, output = kill_rank1_after_checkpoint(command(out, "run.max_restarts=1"), out, mark)
        assert code == 0, output[-6000:]
    finally:
        kill_all(mark)
    restart_lines = [line for line in output.splitlines() if "restart 1 of 1" in line]
    assert len(restart_lines) == 1 and "rank 1 failed (was ended by signal SIGKILL)" in restart_lines[0], output
    assert "resumed from" in output and "(step 2)" in output, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    records = [json.loads(line) for line in open(os.path.join(out, "restarts.jsonl"))]
    assert [(r["restart"], r["max_restarts"], r["rank"], r["signal"]) for r in records] == [(1, 1, 1, "SIGKILL")]
    assert metrics(out) == metrics(straight)  # steps 1-2 kept, 3-4 recomputed after the restart: same numbers
    for role in ("actor", "critic"):
        a, b = hf_weights(os.path.join(straight, "hf", role)), hf_weights(os.path.join(out, "hf", role))
        assert a.keys() == b.keys()
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        assert not unequal, f"{role}: {unequal[:3]}"
