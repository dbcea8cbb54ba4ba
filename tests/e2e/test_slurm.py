"""tools/launch/slurm_multinode.sbatch under a real SLURM (slurmctld, slurmd and munged started on
this machine by tests/slurm_helpers.py): `sbatch` submits the CPU demo recipe, `scancel` mid-run
stops it with a checkpoint (SLURM sends SIGTERM to every process of the step first; the ranks
stop at a step boundary, megappo.interrupts), and the same sbatch again resumes from that
checkpoint and finishes the run's 12 steps, each step once. The SLURM
daemons are installed with apt-get when missing on a root Debian machine (CI); elsewhere the test
is skipped with the command that installs them."""

import json
import os
import re
import time

import pytest

from tests.slurm_helpers import LocalSlurm, ensure_installed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory):
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    slurm = LocalSlurm(str(tmp_path_factory.mktemp("slurm"))).start()
    try:
        yield slurm
    finally:
        slurm.stop()


#: a short run of the demo without validation: stopped after a few steps, resumed to the end. Learning
#: does not depend on the launcher (tests/e2e/test_cli_demo.py: the demo learns; tests/e2e/test_resume.py
#: and test_interrupts.py: an interrupted run resumes bit for bit), so it is not measured here again
STEPS = 12
SHORT = [f"run.total_steps={STEPS}", "run.val_every=0", "run.val_before_train=false"]


def training_rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in map(json.loads, f.read().splitlines()) if "critic/score/mean" in r]


def test_slurm_sbatch_runs_the_demo_and_resumes_after_scancel(local_slurm, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    submit = ["--nodes=1", "--gpus-per-node=0", f"--output={tmp_path}/job-%j.out",
              "tools/launch/slurm_multinode.sbatch", "recipes/demo-cpu.yaml", f"run.output_dir={run_dir}",
              "logging.progress_bar=false", *SHORT]

    first = local_slurm.sbatch(*submit, env=env, cwd=REPO)
    local_slurm.wait_running(first)
    end = time.monotonic() + 600
    while len(training_rows(run_dir)) < 3:  # mid-run: a few steps done, most of the 12 to go
        state = local_slurm.job(first)["JobState"]
        assert state == "RUNNING" and time.monotonic() < end, (state, local_slurm.logs(), _out(tmp_path, first))
        time.sleep(1)
    local_slurm.scancel(first)
    job = local_slurm.wait_done(first, timeout=local_slurm.kill_wait_s + 60)
    out = _out(tmp_path, first)
    assert job["JobState"] == "CANCELLED", (job, out)
    stopped = re.search(r"megappo: interrupted at step (\d+): checkpoint saved to \S+step_(\d+);", out)
    assert stopped, out[-6000:]  # SIGTERM before the kill: every rank stopped at a step boundary and saved
    step = int(stopped.group(1))
    assert 3 <= step < STEPS and (run_dir / "checkpoints" / "latest").read_text() == f"step_{step:08d}"

    second = local_slurm.sbatch(*submit, env=env, cwd=REPO)  # the same command again resumes
    job = local_slurm.wait_done(second, timeout=1500)
    out = _out(tmp_path, second)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, out[-6000:])
    assert f"megappo: resumed from {run_dir}/checkpoints/step_{step:08d} (step {step})" in out
    rows = training_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once: the first job's, then the rest
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


def _out(tmp_path, job_id):
    path = tmp_path / f"job-{job_id}.out"
    return path.read_text() if path.exists() else ""
