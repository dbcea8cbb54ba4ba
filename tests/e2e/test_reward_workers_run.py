"""reward.num_workers through the CLI: the CPU demo trained 2 steps with validation, its reward function
called by 2 worker processes (during the step's model passes), logs the same metrics, bit for bit, as the
run whose rank 0 calls it."""

import subprocess
import sys

from tests.e2e._runs import metrics
from tests.e2e.test_resume import REPO, env

ARGS = ["run.total_steps=2", "run.val_every=2", "rollout.val_n=2", "logging.progress_bar=false",
        "checkpoint.save_every=-1"]


def test_a_run_with_reward_workers_logs_what_one_without_logs(tmp_path):
    for name, extra in (("serial", []), ("workers", ["reward.num_workers=2"])):
        proc = subprocess.run([sys.executable, "-m", "megappo.cli", "train", "recipes/demo-cpu.yaml",
                               f"run.output_dir={tmp_path / name}", *ARGS, *extra], env=env(), cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        assert ("env=single_turn reward_workers=2\n" in proc.stdout) == bool(extra)
    serial, workers = metrics(tmp_path / "serial"), metrics(tmp_path / "workers")
    assert [r["step"] for r in workers] == [0, 1, 2] and "val-core/digit_successor/reward/mean@2" in workers[-1]
    assert workers == serial
