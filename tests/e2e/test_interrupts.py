"""Ctrl-C and SIGTERM through the CLI (docs/interrupts.md): `megappo train` on the CPU demo
(2 gloo ranks started by megappo's launcher, or a world of one) is signalled as a terminal or
SLURM would signal it.

The first signal stops every rank at the next step boundary with a checkpoint of the last
completed step, one line that says how to resume and exit code 128 + the signal (130 for
SIGINT, 143 for SIGTERM), no traceback; rerunning the same command continues from that step
and ends with the metrics of a run that was never interrupted. A second signal while the
first is being honoured stops at once (tests/e2e/_faults.py holds step 2 in generation).
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests import prefork

pytestmark = pytest.mark.alone  # an interrupted run must end within seconds (tests/conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(REPO, "tests", "e2e", "_faults.py")
STEPS = 8
ARGS = [f"run.total_steps={STEPS}", "checkpoint.save_every=0", "logging.progress_bar=false",
        "run.val_before_train=false", "run.val_every=0", "data.train_batch_size=16",
        *(f"{role}.{key}=16" for role in ("actor", "critic") for key in ("ppo_mini_batch_size", "micro_batch_size"))]


def command(out, *extra, fault=None):
    cli = [FAULTS, fault] if fault else ["-m", "megappo.cli"]
    return [sys.executable, *cli, "train", "recipes/demo-cpu.yaml", f"run.output_dir={out}", *ARGS, *extra]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    e.pop("WORLD_SIZE", None)
    return e


def run(cmd, timeout=400) -> str:
    proc = prefork.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def logged_steps(out) -> list[int]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line)["step"] for line in open(path) if line.endswith("\n")]


def metrics(out) -> list[dict]:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]


def interrupt(cmd, out, signals, *, after_step=2, held=None, to="group", timeout=400):
    """Start `cmd` in its own session, wait until `after_step` is in metrics.jsonl (or, with
    `held`, a path, until the fault `slow_step2` has created that file: step 2 is then held in
    generation, past the step boundary where a first signal would still be honoured), then send
    `signals` (a list of (signal, seconds to wait before it)) to its process group (as a
    terminal does on Ctrl-C; the ranks have their own sessions), to the process alone
    (`to="launcher"`, as `kill PID` does) or to every process it started (`to="all"`, as SLURM
    signals a job step). Returns (exit code, output, seconds from the last signal to the exit)."""
    e = dict(env(), FAULT_HELD_FILE=str(held)) if held else env()
    proc = prefork.popen(cmd, env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    deadline = time.time() + timeout
    waiting_for = f"the fault's file {held}" if held else f"step {after_step}"
    try:
        while not (os.path.exists(held) if held else max(logged_steps(out), default=0) >= after_step):
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {waiting_for}:\n" \
                                        f"{proc.stdout.read()[-6000:]}"
            assert time.time() < deadline, f"no {waiting_for} after {timeout}s"
            time.sleep(0.05)
        for sig, wait in signals:
            time.sleep(wait)
            if to == "group":
                os.killpg(proc.pid, sig)
            else:
                tree = psutil.Process(proc.pid)
                for p in [tree, *(tree.children(recursive=True) if to == "all" else [])]:
                    p.send_signal(sig)
        sent = time.time()
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output, time.time() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def latest_step(out) -> int:
    name = open(os.path.join(out, "checkpoints", "latest")).read().strip()
    assert os.path.isfile(os.path.join(out, "checkpoints", name, "trainer_state.json"))
    return int(name.removeprefix("step_"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run uninterrupted, with no checkpoint asked for (verl's save_freq=-1: none, not the last step's)."""
    out = str(tmp_path_factory.mktemp("straight"))
    run(command(out, "checkpoint.save_every=-1"))
    assert not os.path.exists(os.path.join(out, "checkpoints", "latest"))
    return out


def check_graceful(code, output, out, expected_code):
    assert code == expected_code, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    assert len(output.splitlines()) < 30, output
    step = latest_step(out)  # the checkpoint of the last completed step ...
    assert 2 <= step < STEPS and logged_steps(out)[-1] == step, (step, logged_steps(out))  # ... none lost
    assert f"interrupted at step {step}: checkpoint saved to " in output, output
    assert "rerun the same command to resume" in output, output
    return step


def test_ctrl_c_saves_the_last_step_and_the_rerun_resumes_exactly(straight, tmp_path):
    out = str(tmp_path / "run")
    code, output, _ = interrupt(command(out), out, [(signal.SIGINT, 0)])
    step = check_graceful(code, output, out, 130)

    log = run(command(out))
    assert f"resumed from {os.path.join(out, 'checkpoints', f'step_{step:08d}')} (step {step})" in log, log
    assert logged_steps(out) == list(range(1, STEPS + 1))
    assert metrics(out) == metrics(straight)  # bitwise on CPU: no step lost or changed


def test_sigterm_to_the_launcher_alone(tmp_path):
    """SLURM or `kill PID` may signal only the launcher: it forwards the signal to its ranks. The step
    it stops at is saved even where the run asked for no checkpoints (checkpoint.save_every=-1)."""
    out = str(tmp_path / "run")
    code, output, _ = interrupt(command(out, "checkpoint.save_every=-1"), out, [(signal.SIGTERM, 0)], to="launcher")
    check_graceful(code, output, out, 143)


def test_sigterm_to_every_process_counts_once(tmp_path):
    """SLURM signals every process of a job step: each rank gets SIGTERM from SLURM and again
    from the launcher; the two are one request, not a second signal that stops at once."""
    out = str(tmp_path / "run")
    code, output, _ = interrupt(command(out), out, [(signal.SIGTERM, 0)], to="all")
    check_graceful(code, output, out, 143)


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    """Step 2 hangs in generation (rank 0 sleeps), so the first Ctrl-C waits for a step boundary
    that does not come; the second one ends every rank at once, still without tracebacks."""
    out = str(tmp_path / "run")
    code, output, elapsed = interrupt(command(out, fault="slow_step2"), out, [(signal.SIGINT, 0), (signal.SIGINT, 3)],
                                      held=tmp_path / "held")
    assert code == 130, output[-6000:]
    assert elapsed < 15, elapsed
    assert "Traceback" not in output and len(output.splitlines()) < 30, output
    assert "stopped at once" in output, output
    assert not os.path.exists(os.path.join(out, "checkpoints", "latest"))  # nothing was saved: step 2 never ended


def test_a_second_ctrl_c_stops_a_world_of_one_at_once(tmp_path):
    """Without the launcher (one rank), the rank itself stops at once on the second signal,
    although its main thread is busy."""
    out = str(tmp_path / "run")
    code, output, elapsed = interrupt(command(out, "parallel.tp=1", fault="slow_step2"), out,
                                      [(signal.SIGINT, 0), (signal.SIGINT, 3)], held=tmp_path / "held")
    assert code == 130, output[-6000:]
    assert elapsed < 15, elapsed
    assert "Traceback" not in output and "stopped at once" in output, output


def test_a_signal_before_the_first_step_ended_has_nothing_to_save(tmp_path):
    """Every rank is signalled as its setup ends: the ranks agree before step 1 and stop."""
    out = str(tmp_path / "run")
    proc = prefork.run(command(out, fault="sigint_setup"), env=env(), cwd=REPO, capture_output=True, text=True,
                       timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 130, output[-6000:]
    assert "interrupted before step 1 ended: nothing to save; rerun the same command to start again" in output
    assert "Traceback" not in output and len(output.splitlines()) < 30, output
    assert logged_steps(out) == [] and not os.path.exists(os.path.join(out, "checkpoints"))


def test_ctrl_c_during_start_up(tmp_path):
    """Ctrl-C while the command is still reading the recipe (no rank started): one line, 130. A fresh
    interpreter (its imports are the start-up this interrupts; a fork of tests/prefork.py's server is past
    them at once)."""
    proc = subprocess.Popen(command(str(tmp_path / "run")), env=env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and output == "megappo: interrupted\n", (proc.returncode, output)
