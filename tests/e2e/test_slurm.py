"""tools/launch/slurm_multinode.sbatch under a real SLURM of two nodes on this machine
(tests/slurm_helpers.py starts munged, slurmctld and two slurmds: `slurmd -N NAME`, each on a port
of its own; Debian's slurmd is built for several daemons on one host). `sbatch --nodes 2` runs the
script's srun, one torchrun per node, and the two torchruns meet at the c10d rendezvous on the job's
first node; the CPU demo runs with one rank per node (DP across the two nodes). While it runs, each
rank's environment (read from /proc) shows it on its own slurmd with the torchrun variables of a
two-node job: RANK 0 and 1, LOCAL_RANK 0 and GROUP_RANK (the node) 0 and 1. `scancel` mid-run stops
it with a checkpoint (SLURM sends SIGTERM to every process of the step on both nodes first; the
ranks stop at a step boundary, megappo.parallel.interrupts), and the same sbatch again resumes from that
checkpoint and finishes the run, each step once.

Marked `multinode` (pytest -m multinode runs the multi-node tests alone; it runs in `make test`
too). The SLURM daemons are installed with apt-get when missing on a root Debian machine (CI);
elsewhere the test is skipped with the command that installs them."""

import json
import os
import re
import socket
import time

import pytest

from tests.slurm_helpers import LocalSlurm, require_installed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: a short run of the demo without validation: stopped after a few steps, resumed to the end. Learning
#: does not depend on the launcher (tests/e2e/test_cli_demo.py: the demo learns; tests/e2e/test_resume.py
#: and test_interrupts.py: an interrupted run resumes bit for bit), so it is not measured here again.
#: One rank per node, data parallel across the nodes (the recipe's hardware says so: no size warning)
STEPS = 8
TWO_NODES = [f"run.total_steps={STEPS}", "hardware.nodes=2", "hardware.gpus_per_node=1", "parallel.tp=1",
             "run.val_every=0", "run.val_before_train=false", "logging.progress_bar=false"]


@pytest.fixture(scope="module")
def two_node_slurm(tmp_path_factory):
    require_installed()
    slurm = LocalSlurm(str(tmp_path_factory.mktemp("slurm2")), nodes=2).start()
    try:
        yield slurm
    finally:
        slurm.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def training_rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in map(json.loads, f.read().splitlines()) if "critic/score/mean" in r]


def _ranks(run_dir) -> dict:
    """RANK -> the torchrun / SLURM variables of the rank processes of this run now alive."""
    import psutil

    found = {}
    for p in psutil.process_iter(["cmdline", "environ"]):
        cmd, env = p.info["cmdline"] or [], p.info["environ"] or {}
        if "megappo.cli" in cmd and f"run.output_dir={run_dir}" in cmd and "RANK" in env:
            found[env["RANK"]] = {k: env.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                                          "WORLD_SIZE", "MASTER_ADDR", "SLURMD_NODENAME")}
    return found


@pytest.mark.multinode
def test_sbatch_two_nodes_resumes_after_scancel(two_node_slurm, tmp_path):
    slurm, run_dir = two_node_slurm, tmp_path / "run"
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, RDZV_PORT=str(port))
    env.pop("WORLD_SIZE", None)
    submit = ["--nodes=2", "--gpus-per-node=0", f"--output={tmp_path}/job-%j.out",
              "tools/launch/slurm_multinode.sbatch", "recipes/demo-cpu.yaml", f"run.output_dir={run_dir}", *TWO_NODES]

    first = slurm.sbatch(*submit, env=env, cwd=REPO)
    slurm.wait_running(first)
    seen = {}
    end = time.monotonic() + 900
    while len(training_rows(run_dir)) < 2 or len(seen) < 2:  # mid-run: steps done, most of the run to go
        state = slurm.job(first)["JobState"]
        assert state == "RUNNING" and time.monotonic() < end, (state, seen, slurm.logs(), _out(tmp_path, first))
        for rank, rank_env in _ranks(run_dir).items():
            seen.setdefault(rank, rank_env)
        time.sleep(0.5)
    slurm.scancel(first)
    job = slurm.wait_done(first, timeout=slurm.kill_wait_s + 60)
    out = _out(tmp_path, first)
    assert job["JobState"] == "CANCELLED", (job, out)
    assert f"megappo: 2 nodes x 1 GPUs = 2 ranks; rendezvous {slurm.nodes[0]}:{port}" in out, out[-6000:]
    assert "megappo: warning" not in out, out[-6000:]  # the job is the recipe's size (torchrun's own SIGTERM
    # traceback is expected here: SLURM signals every process of the step, the torchrun agents too)
    # one rank on each slurmd, each its node's only rank, both told the same master
    assert sorted(seen) == ["0", "1"], (seen, out[-6000:])
    assert {seen[r]["SLURMD_NODENAME"] for r in seen} == set(slurm.nodes), seen
    assert [(seen[r]["LOCAL_RANK"], seen[r]["LOCAL_WORLD_SIZE"], seen[r]["WORLD_SIZE"]) for r in "01"] == \
        [("0", "1", "2")] * 2, seen
    assert sorted(seen[r]["GROUP_RANK"] for r in "01") == ["0", "1"] and seen["0"]["MASTER_ADDR"] == \
        seen["1"]["MASTER_ADDR"], seen
    stopped = re.search(r"megappo: interrupted at step (\d+): checkpoint saved to \S+step_(\d+);", out)
    assert stopped, out[-6000:]  # SIGTERM before the kill: every rank on both nodes stopped at a step and saved
    step = int(stopped.group(1))
    assert 2 <= step < STEPS and (run_dir / "checkpoints" / "latest").read_text() == f"step_{step:08d}"

    second = slurm.sbatch(*submit, env=env, cwd=REPO)  # the same command again resumes
    job = slurm.wait_done(second, timeout=1200)
    out = _out(tmp_path, second)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and "Traceback" not in out, (job, out[-6000:])
    assert f"megappo: resumed from {run_dir}/checkpoints/step_{step:08d} (step {step})" in out, out[-6000:]
    rows = training_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once: the first job's, then the rest
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


def _out(tmp_path, job_id):
    path = tmp_path / f"job-{job_id}.out"
    return path.read_text() if path.exists() else ""
