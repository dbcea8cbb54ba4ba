"""tools/launch: the scripts parse, refuse bad usage, read the recipe's hardware section for their
defaults, warn when the job does not match it, and hand the recipe and every extra argument to
`megappo train` with the right torchrun / srun options (torchrun, srun and scontrol replaced by
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
    e = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **(env or {})}
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
    assert run(ONE_NODE, "4").returncode == 2  # NPROC and no recipe


def recipe(name):
    return os.path.join(REPO, "recipes", name)


@pytest.mark.parametrize("args,nproc", [
    (["qwen2.5-7b-ppo-8gpu.yaml"], "8"),  # hardware: 1 node x 8
    (["qwen2.5-7b-ppo-8gpu.yaml", "--variant", "4gpu", "run.output_dir=/tmp/x"], "4"),
    (["llama3.1-8b-grpo-8gpu.yaml", "hardware.gpus_per_node=4"], "4"),
    (["demo-cpu.yaml"], "2"),  # the CPU demo's 2 gloo ranks
])
def test_one_node_takes_nproc_from_the_recipes_hardware(tmp_path, args, nproc):
    stub(tmp_path, "torchrun", 'printf "%s\\n" "$@"')
    proc = run(ONE_NODE, recipe(args[0]), *args[1:], path_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[:5] == ["--standalone", "--nnodes", "1", "--nproc-per-node", nproc]
    assert out[5:] == ["-m", "megappo.cli", "train", recipe(args[0]), *args[1:]]


def test_one_node_refuses_a_multi_node_recipe_without_nproc(tmp_path):
    stub(tmp_path, "torchrun", "echo started")
    proc = run(ONE_NODE, recipe("qwen2.5-72b-ppo-64gpu.yaml"), path_dir=tmp_path)
    assert proc.returncode == 2 and "started" not in proc.stdout
    assert "is sized for 8 nodes x 8 GPUs (its hardware section). Fix: launch it with " \
           "tools/launch/slurm_multinode.sbatch, or give NPROC" in proc.stderr
    proc = run(ONE_NODE, recipe("qwen2.5-7b-ppo-8gpu.yaml"), "--variant", "h100", path_dir=tmp_path)
    assert proc.returncode == 2 and "megappo: error: recipe" in proc.stderr and "has no variant 'h100'" in proc.stderr
    assert "Fix: choose one of ['16gpu', '16x40gb', '4gpu', '8x48gb', 'h200']" in proc.stderr


def test_slurm_rendezvous_on_first_node(tmp_path):
    stub(tmp_path, "scontrol", 'echo gpu-node-07; echo gpu-node-08')
    stub(tmp_path, "srun", 'printf "%s\\n" "$@"; '
                           'echo "TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING"')
    env = {"SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "h100:4",
           "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(tmp_path)}
    big = recipe("qwen2.5-7b-ppo-8gpu.yaml")
    proc = run(SLURM, big, "run.output_dir=/shared/r", "rollout.sglang={tp_size: 4}", env=env,
               path_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr  # 2 x 4 GPUs: the recipe's 8, split over two nodes
    out = proc.stdout.splitlines()
    assert "megappo: 2 nodes x 4 GPUs = 8 ranks; rendezvous gpu-node-07:29500" in out[0]
    args = out[1:]
    i = args.index("torchrun")
    assert args[:i] == ["--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    opts = dict(zip(args[i + 1:i + 13:2], args[i + 2:i + 13:2]))
    assert opts == {"--nnodes": "2", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                    "--rdzv-endpoint": "gpu-node-07:29500", "--rdzv-id": "4242", "--max-restarts": "0"}
    assert args[i + 13:] == ["-m", "megappo.cli", "train", big, "run.output_dir=/shared/r",
                             "rollout.sglang={tp_size: 4}", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"]


@pytest.mark.parametrize("gpus", [None, "0"])
def test_slurm_cpu_recipe_takes_its_ranks_per_node_from_the_recipe(tmp_path, gpus):
    """On a cluster without GPUs (`sbatch --gpus-per-node 0`, as tests/e2e/test_slurm.py runs it) the
    CPU demo's gloo ranks per node are its hardware.gpus_per_node, not SLURM's GPU count (0)."""
    stub(tmp_path, "scontrol", "echo n1")
    stub(tmp_path, "srun", 'printf "%s\\n" "$@"')
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    job = {"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(tmp_path),
           **({"SLURM_GPUS_PER_NODE": gpus} if gpus else {})}
    proc = subprocess.run(["bash", SLURM, recipe("demo-cpu.yaml")], capture_output=True, text=True, timeout=60,
                          env={**e, "PYTHONPATH": REPO, "PATH": f"{tmp_path}{os.pathsep}{e['PATH']}", **job})
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    args = proc.stdout.splitlines()
    assert args[0] == "megappo: 1 nodes x 2 GPUs = 2 ranks; rendezvous n1:29500"
    assert args[args.index("--nproc-per-node") + 1] == "2"


def test_slurm_needs_a_recipe():
    proc = run(SLURM)
    assert proc.returncode == 2 and "usage: sbatch" in proc.stderr


@pytest.mark.parametrize("job,variant,warned", [
    ({"SLURM_JOB_NUM_NODES": "8"}, [], False),  # GPUs per node from the recipe: 8 x 8 = its 64
    ({"SLURM_JOB_NUM_NODES": "4", "SLURM_GPUS_PER_NODE": "8"}, ["--variant", "h200"], False),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "h100:4"}, [], True),
])
def test_slurm_checks_the_job_against_the_recipes_hardware(tmp_path, job, variant, warned):
    stub(tmp_path, "scontrol", "echo n1")
    stub(tmp_path, "srun", 'printf "%s\\n" "$@"')
    env = {"SLURM_JOB_NODELIST": "n1", "SLURM_SUBMIT_DIR": str(tmp_path), **job}
    env.pop("SLURM_GPUS_PER_NODE", None) if "SLURM_GPUS_PER_NODE" not in job else None
    big = recipe("qwen2.5-72b-ppo-64gpu.yaml")
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", SLURM, big, *variant], capture_output=True, text=True, timeout=60,
                          env={**e, "PYTHONPATH": REPO, "PATH": f"{tmp_path}{os.pathsep}{e['PATH']}", **env})
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.splitlines()
    nodes, gpus = job["SLURM_JOB_NUM_NODES"], job.get("SLURM_GPUS_PER_NODE", "8").split(":")[-1]
    assert args[0] == f"megappo: {nodes} nodes x {gpus} GPUs = {int(nodes) * int(gpus)} ranks; rendezvous n1:29500"
    assert args[args.index("--nproc-per-node") + 1] == gpus
    if warned:
        assert proc.stderr.startswith(
            f"megappo: warning: {big} is sized for 8 nodes x 8 GPUs = 64 ranks (its hardware section) but this job "
            f"has 2 x 4 = 8; its memory plan does not hold for them. Fix: sbatch --nodes 8 --gpus-per-node 8 "
            f"tools/launch/slurm_multinode.sbatch {big} ..., or pass a --variant of the recipe sized for this job, "
            f"or plan this world first: megappo plan {big} --world-size 8"), proc.stderr
    else:
        assert "warning" not in proc.stderr, proc.stderr


def test_train_warns_when_a_gpu_run_has_another_world_than_its_hardware(capsys, tmp_path, monkeypatch):
    """`megappo train` itself (under any launcher) names the mismatch before anything else; here a
    missing data file then stops it before any rank starts."""
    from megappo import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    demo = recipe("demo-cpu.yaml")
    args = [demo, "parallel.tp=1", "data.builtin=null", f"data.train_files=[{tmp_path}/none.jsonl]",
            f"data.val_files=[{tmp_path}/none.jsonl]"]
    assert cli.main(["train", *args, "hardware.device=gpu", "hardware.gpus_per_node=4", "--world-size", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"megappo: warning: hardware.gpus_per_node=4 sizes this run for 4 GPUs (1 node x 4 GPUs of 2 GiB) "
                      f"but this run has 1 rank; its memory plan does not hold for them. Fix: launch 4 ranks, or plan "
                      f"this world and set it: megappo plan {demo} --world-size 1 (then hardware.nodes / "
                      f"hardware.gpus_per_node, or a --variant of the recipe).")
    assert err[1].startswith("megappo: error:") and "none.jsonl" in err[1]
    assert cli.main(["train", *args, "--world-size", "1"]) == 2  # device=cpu: the rank count changes the speed only
    assert "warning" not in capsys.readouterr().err
