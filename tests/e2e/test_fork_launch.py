"""`megappo train`'s ranks forked from the launcher (--launcher fork, the default) against fresh interpreters
(--launcher torchrun): the ranks are forks (their command line is the launcher's, not `python -u ...`), and
they train bit for bit as fresh ranks do (every metric but timings, the samples). A forked rank's death and a
forked rank's own error end the run as with fresh ranks: the hygiene tests (test_rank_death.py,
test_first_error.py, test_interrupts.py, test_faults_*.py, test_console.py) run on the default launcher."""

import json
import os
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMING = ("timing_s/", "perf/")


def _train(run_dir, launcher: str) -> list[tuple[list[str], str | None]]:
    """Train 2 steps of the demo with `--launcher launcher`; the launcher's ranks: (command line, the RANK that
    /proc/PID/environ shows)."""
    command = [sys.executable, "-m", "megappo.cli", "train", "recipes/demo-cpu.yaml", "run.total_steps=2",
               "run.val_every=2", f"run.output_dir={run_dir}", "logging.progress_bar=false", "--launcher", launcher]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks: dict[int, tuple[list[str], str | None]] = {}
    launcher_process = psutil.Process(proc.pid)
    while proc.poll() is None and sorted(str(rank) for _, rank in ranks.values()) != ["0", "1"]:
        try:
            ranks.update((c.pid, (c.cmdline(), c.environ().get("RANK"))) for c in launcher_process.children())
        except psutil.Error:
            pass
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    return list(ranks.values())


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_forked_ranks_train_as_fresh_ones(tmp_path):
    forked_ranks = _train(tmp_path / "fork", "fork")
    fresh_ranks = _train(tmp_path / "torchrun", "torchrun")
    launcher = [sys.executable, "-m", "megappo.cli"]
    assert len(forked_ranks) == 2 and all(cmd[:1] == launcher[:1] and "-u" not in cmd for cmd, _ in forked_ranks)
    assert len(fresh_ranks) == 2 and all("-u" in cmd for cmd, _ in fresh_ranks)
    assert sorted(rank for _, rank in forked_ranks) == ["0", "1"]  # ps / psutil see a forked rank's variables
    forked, fresh = _rows(tmp_path / "fork" / "metrics.jsonl"), _rows(tmp_path / "torchrun" / "metrics.jsonl")
    assert len(forked) == len(fresh) >= 2
    for a, b in zip(forked, fresh):
        assert {k: v for k, v in a.items() if not k.startswith(TIMING)} == \
            {k: v for k, v in b.items() if not k.startswith(TIMING)}
    assert (tmp_path / "fork" / "samples.jsonl").read_text() == (tmp_path / "torchrun" / "samples.jsonl").read_text()
