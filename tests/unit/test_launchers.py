"""tools/launch: the scripts parse, refuse bad usage, and hand the recipe and every extra argument
to `megappo train` with the right torchrun / srun options (torchrun, srun and scontrol replaced by
stubs that print their arguments; the real single-node run is tests/e2e/test_launchers.py)."""

import os
import stat
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ONE_NODE = os.path.join(REPO, "tools", "launch", "torchrun_1node.sh")
SLURM = os.path.join(REPO, "tools", "launch", "slurm_multinode.sbatch")


def stub(bin_dir, name, body):
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run(script, *args, env=None, path_dir=None):
    e = dict(os.environ, **(env or {}))
    if path_dir is not None:
        e["PATH"] = f"{path_dir}{os.pathsep}{e['PATH']}"
    return subprocess.run(["bash", script, *args], env=e, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", [ONE_NODE, SLURM], ids=os.path.basename)
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(script, os.X_OK)


def test_one_node_passes_everything_through(tmp_path):
    stub(tmp_path, "torchrun", 'printf "%s\\n" "$@"; echo "OMP=$OMP_NUM_THREADS NCCL=$NCCL_DEBUG"')
    proc = run(ONE_NODE, "4", "recipes/x.yaml", "parallel.tp=2", "data.train_files=[a b.parquet]", "--world-size",
               "4", path_dir=tmp_path, env={"OMP_NUM_THREADS": "3"})
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.splitlines()
    assert args[:6] == ["--standalone", "--nnodes", "1", "--nproc-per-node", "4", "-m"]
    assert args[6:9] == ["megappo.cli", "train", "recipes/x.yaml"]
    assert args[9:13] == ["parallel.tp=2", "data.train_files=[a b.parquet]", "--world-size", "4"]
    assert args[13] == "OMP=3 NCCL=WARN"


def test_one_node_usage_errors():
    assert run(ONE_NODE).returncode == 2
    proc = run(ONE_NODE, "eight", "recipes/x.yaml")
    assert proc.returncode == 2 and "NPROC must be a number" in proc.stderr


def test_slurm_rendezvous_on_first_node(tmp_path):
    stub(tmp_path, "scontrol", 'echo gpu-node-07; echo gpu-node-08')
    stub(tmp_path, "srun", 'printf "%s\\n" "$@"; '
                           'echo "TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING"')
    env = {"SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "h100:4",
           "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(tmp_path)}
    proc = run(SLURM, "recipes/big.yaml", "run.output_dir=/shared/r", "rollout.sglang={tp_size: 4}", env=env,
               path_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert "megappo: 2 nodes x 4 GPUs = 8 ranks; rendezvous gpu-node-07:29500" in out[0]
    args = out[1:]
    i = args.index("torchrun")
    assert args[:i] == ["--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    opts = dict(zip(args[i + 1:i + 13:2], args[i + 2:i + 13:2]))
    assert opts == {"--nnodes": "2", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                    "--rdzv-endpoint": "gpu-node-07:29500", "--rdzv-id": "4242", "--max-restarts": "0"}
    assert args[i + 13:] == ["-m", "megappo.cli", "train", "recipes/big.yaml", "run.output_dir=/shared/r",
                             "rollout.sglang={tp_size: 4}", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"]


def test_slurm_needs_a_recipe():
    proc = run(SLURM)
    assert proc.returncode == 2 and "usage: sbatch" in proc.stderr
