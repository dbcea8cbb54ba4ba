"""tools/launch/slurm_multinode.sbatch on two SLURM nodes on this machine: tests/slurm_helpers.py
starts slurmctld and two slurmds (`slurmd -N NAME`, each on a port of its own; Debian's slurmd is
built for several daemons on one host), `sbatch --nodes 2` runs the script's srun, one torchrun per
node, and the two torchruns meet at the c10d rendezvous on the job's first node. The CPU demo runs
with one rank per node (DP across the two nodes): 2 steps and a save, then the same sbatch with
run.total_steps=3 resumes from that checkpoint and does step 3. While it runs, each rank's
environment (read from /proc) shows it on its own slurmd with the torchrun variables of a two-node
job: RANK 0 and 1, LOCAL_RANK 0 and GROUP_RANK (the node) 0 and 1.

Marked `multinode` (pytest -m multinode runs the multi-node tests alone). Skipped, with the command
that installs SLURM, where it cannot be installed (tests/e2e/test_slurm.py's rule)."""

import json
import os
import socket
import time

import pytest

from tests.slurm_helpers import LocalSlurm, ensure_installed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.multinode

#: one rank per node, data parallel across the nodes (the recipe's hardware says so: no size warning)
TWO_NODES = ["hardware.nodes=2", "hardware.gpus_per_node=1", "parallel.tp=1", "run.val_every=0",
             "run.val_before_train=false", "logging.progress_bar=false"]


@pytest.fixture(scope="module")
def two_node_slurm(tmp_path_factory):
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    slurm = LocalSlurm(str(tmp_path_factory.mktemp("slurm2")), nodes=2).start()
    try:
        yield slurm
    finally:
        slurm.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _submit(slurm, tmp_path, run_dir, steps, env):
    return slurm.sbatch("--nodes=2", "--gpus-per-node=0", f"--output={tmp_path}/job-%j.out",
                        "tools/launch/slurm_multinode.sbatch", "recipes/demo-cpu.yaml", f"run.output_dir={run_dir}",
                        f"run.total_steps={steps}", *TWO_NODES, env=env, cwd=REPO)


def test_sbatch_two_nodes_trains_saves_and_resumes(two_node_slurm, tmp_path):
    slurm, run_dir = two_node_slurm, tmp_path / "run"
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, RDZV_PORT=str(port))
    env.pop("WORLD_SIZE", None)

    first = _submit(slurm, tmp_path, run_dir, 2, env)
    seen = {}
    end = time.monotonic() + 900
    while slurm.job(first)["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        assert time.monotonic() < end, (slurm.logs(), _out(tmp_path, first))
        for rank, rank_env in _ranks(run_dir).items():
            seen.setdefault(rank, rank_env)
        time.sleep(0.5)
    job, out = slurm.job(first), _out(tmp_path, first)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, out[-6000:], slurm.logs())
    assert f"megappo: 2 nodes x 1 GPUs = 2 ranks; rendezvous {slurm.nodes[0]}:{port}" in out, out[-6000:]
    assert "megappo: warning" not in out and "Traceback" not in out, out[-6000:]  # the job is the recipe's size
    # one rank on each slurmd, each its node's only rank, both told the same master
    assert sorted(seen) == ["0", "1"], (seen, out[-6000:])
    assert {seen[r]["SLURMD_NODENAME"] for r in seen} == set(slurm.nodes), seen
    assert [(seen[r]["LOCAL_RANK"], seen[r]["LOCAL_WORLD_SIZE"], seen[r]["WORLD_SIZE"]) for r in "01"] == \
        [("0", "1", "2")] * 2, seen
    assert sorted(seen[r]["GROUP_RANK"] for r in "01") == ["0", "1"] and seen["0"]["MASTER_ADDR"] == \
        seen["1"]["MASTER_ADDR"], seen
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000002"

    second = _submit(slurm, tmp_path, run_dir, 3, env)  # the same job, one step further: resumes
    job = slurm.wait_done(second, timeout=900)
    out = _out(tmp_path, second)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, out[-6000:])
    assert f"megappo: resumed from {run_dir}/checkpoints/step_00000002 (step 2)" in out, out[-6000:]
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]  # each step once: two from the first job, one from the second
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000003"


def _out(tmp_path, job_id):
    path = tmp_path / f"job-{job_id}.out"
    return path.read_text() if path.exists() else ""
