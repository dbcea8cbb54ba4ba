"""What `megappo` prints and logs, as a user sees it: one compact line per step in a log file
(logging.console=compact, the default), a bar redrawn in place on a terminal (a pseudo-terminal
here; logging.console=full), metrics.jsonl after a restart before the first checkpoint, --version
and the help's pointer to the config reference."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = ["train", "recipes/demo-cpu.yaml", "run.val_every=0", "logging.progress_bar=true"]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    e.pop("WORLD_SIZE", None)
    return e


def cli(*args, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", *args], env=env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def in_terminal(*args, timeout=300) -> tuple[int, str]:
    """`megappo ARGS` with stdout and stderr on a pseudo-terminal (as in an interactive shell)."""
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "megappo.cli", *args], env=env(), cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal closed: every writer has exited
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def step_lines(out: str) -> list[str]:
    return [line for line in out.split("\n") if line.startswith("step ")]


def test_a_log_file_gets_one_line_per_step_and_no_dict(tmp_path):
    # reward.metric_functions: the demo's own reward, logged again under its name
    code, out = cli(*DEMO, "run.total_steps=3", f"run.output_dir={tmp_path}",
                    "reward.metric_functions=[digit_successor]")
    assert code == 0, out[-4000:]
    lines = out.splitlines()
    assert [line.split(":")[0] for line in step_lines(out)] == ["step 0/3", "step 1/3", "step 2/3", "step 3/3"]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    for r in rows:
        kind = "critic" if "critic/score/mean" in r else "val"
        assert r[f"{kind}/score/digit_successor"] == pytest.approx(r[f"{kind}/score/mean"])
        assert r[f"{kind}/score/frac_correct"] <= r[f"{kind}/score/mean"]  # scores are in [0, 1]
    assert [r["step"] for r in rows if "val/score/mean" in r] == [0]
    assert not [line for line in lines if line.startswith("[")], out  # no progress-bar lines besides them
    # compact: the step, the score and the actor's and critic's losses (the demo has no KL term), the rate and the
    # ETA; the rate is the mean step time so far: not start-up, not the validation before step 1
    assert step_lines(out)[0] == f"step 0/3: val={rows[0]['val/score/mean']:.4g}"
    times = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
    for n, line in zip((1, 2, 3), step_lines(out)[1:]):
        r = rows[n]
        assert line.startswith(f"step {n}/3: score={r['critic/score/mean']:.4g} pg_loss={r['actor/pg_loss']:.4g} "
                               f"vf_loss={r['critic/vf_loss']:.4g} | {sum(times[:n]) / n:.1f} s/step  ETA "), (line, r)
        assert len(line) < 100, line
    # the samples of step 1 (compact: step 1 and every 10th), all of them in samples.jsonl
    assert [lines[i - 1].split(":")[0] for i, line in enumerate(lines) if line.startswith("  sample: ")] == ["step 1/3"]
    assert [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")] == [1, 2, 3]
    assert f"done: 3 steps, final critic/score/mean={rows[-1]['critic/score/mean']:.3f}; " in out
    start = next(line for line in lines if line.startswith("megappo: world="))
    assert "{" not in start and "prompts=640 | steps=3 |" in start, start  # no Python dict at start-up


def screen(out: str) -> list[str]:
    """The lines a terminal shows: in each, what the last carriage return left (less erase codes)."""
    return [line.split("\r")[-1].replace("\x1b[K", "") for line in out.split("\n")]


def test_a_terminal_gets_one_bar_redrawn_in_place(tmp_path):
    code, out = in_terminal(*DEMO, "run.total_steps=3", f"run.output_dir={tmp_path}", "logging.console=full")
    assert code == 0, out[-4000:]
    shown = screen(out)
    assert [line.split(":")[0] for line in shown if line.startswith("step ")] == ["step 0", "step 1", "step 2",
                                                                                   "step 3"]
    bars = [i for i, line in enumerate(shown) if "/3 steps" in line]
    assert len(bars) == 1 and shown[bars[0]].startswith("[########################] 3/3 steps"), shown
    assert shown[bars[0] + 1].startswith("saved checkpoint")  # the last bar stays, later output below it
    assert "] 1/3 steps" in out and "] 2/3 steps" in out  # drawn, then rewritten in place
    assert "steps  " not in "".join(line for line in shown if line.startswith("step "))
    # full: today's metrics in each step line, and every step's sample under it
    assert all("critic/score/mean=" in line and "actor/entropy=" in line and "perf/throughput=" in line
               for line in shown if line.startswith("step ") and not line.startswith("step 0:")), shown
    assert len([line for line in shown if line.startswith("  sample: ")]) == 3


def test_restart_before_the_first_checkpoint_logs_each_step_once(tmp_path):
    """Killed after a few steps, before any checkpoint; the rerun starts again at step 0 and the
    log holds each step once, in order (it used to hold the first attempt's steps too)."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "megappo.cli", *DEMO, "parallel.tp=1", f"run.output_dir={run_dir}",
           "run.total_steps=100", "checkpoint.save_every=100"]  # one process: no launcher between
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    try:
        while not (metrics.exists() and '"step": 2' in metrics.read_text()):
            assert proc.poll() is None and time.time() < deadline, "the run did not reach step 2"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (run_dir / "checkpoints" / "latest").exists()
    first = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert first[:3] == [0, 1, 2]
    code, out = cli(*DEMO, "parallel.tp=1", f"run.output_dir={run_dir}", "run.total_steps=3")
    assert code == 0, out[-4000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2, 3]
    code, out = cli("plot", str(run_dir))
    assert code == 0 and (run_dir / "curves.png").is_file(), out


def test_version_and_help_point_to_the_config_reference():
    from megappo import __version__

    code, out = cli("--version")
    assert code == 0 and out.strip() == f"megappo {__version__}"
    for args in (["--help"], ["train", "--help"]):
        code, out = cli(*args)
        assert code == 0 and "docs/config.md" in " ".join(out.split()), out
    assert os.path.isfile(os.path.join(REPO, "docs", "config.md"))
