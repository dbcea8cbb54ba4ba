"""What `megappo train` shows when a run cannot start or a rank fails in its set-up, through the
real CLI on the CPU demo recipe (2 ranks).

A logging sink whose package is missing is refused before any rank starts: exit 2, one
`megappo: error:` line with its pip command, nothing written. A rank that fails on a bug during
its set-up (rank 0's metrics logger cannot import its sink: tests/e2e/_faults.py
no_tensorboard_rank0) has its own error as the console's last `megappo: error:` line, named by the
launcher, not the other rank's lost connection; nothing of the run is left running.
"""

import os

import psutil

from tests.e2e.test_bad_inputs_cli import REPO, megappo


def test_a_missing_sink_package_is_one_line_before_any_rank_starts(tmp_path):
    """verl's spelling, as the verl user wrote it. wandb is installed with the test extras: this
    process's children see it as not installed (a sitecustomize on their PYTHONPATH drops it from
    the import system, so importlib's find_spec finds nothing, as after `pip uninstall wandb`)."""
    hide = tmp_path / "hide_wandb"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # as if not installed\n")
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    code, out = megappo('trainer.logger=["console","wandb"]', f"run.output_dir={run}", f"checkpoint.dir={ckpt}",
                        pythonpath=f"{hide}{os.pathsep}{REPO}")
    assert code == 2, out[-4000:]
    assert out.strip() == ("megappo: error: logging.sinks=[console,wandb,jsonl] needs the wandb package, which is not "
                           "installed. Fix: pip install wandb (or remove wandb from logging.sinks / trainer.logger).")
    assert not run.exists() and not ckpt.exists()


def test_a_rank_that_fails_in_its_set_up_has_the_last_error_line(tmp_path):
    """Rank 0 fails on a bug (an ImportError, as the issue's wandb one) while rank 1 waits for it: rank
    0's traceback, then the launcher's one line naming rank 0 and repeating its error, last; rank 1
    says nothing of a lost connection; the run ends with rank 0's exit code and leaves no process."""
    run = tmp_path / "run"
    code, out = megappo("logging.sinks=[console,jsonl,tensorboard]", f"run.output_dir={run}",
                        fault="no_tensorboard_rank0")
    assert code == 1, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("megappo: error:")]
    expected = ("megappo: error: rank 0 failed (exited with code 1); the other ranks were stopped. Its error: "
                "ImportError: logging.sinks tensorboard needs the tensorboard package: pip install tensorboard")
    assert errors == [expected] and out.rstrip().splitlines()[-1] == expected, out[-4000:]
    assert "Traceback" in out and "lost its connection" not in out and "rank 1 failed" not in out
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert left == [], left
