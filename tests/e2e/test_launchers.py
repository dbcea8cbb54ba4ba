"""tools/launch/torchrun_1node.sh for real: 2 gloo ranks of the CPU demo recipe, laid out as DP=2
(tp=1), so `megappo train` takes its world size from torchrun. No NPROC is given: the script reads
it from the recipe's hardware section (hardware.gpus_per_node: 2)."""

import json
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torchrun_one_node_runs_the_demo_data_parallel(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        ["bash", "tools/launch/torchrun_1node.sh", "recipes/demo-cpu.yaml", "parallel.tp=1",
         "actor.micro_batch_size=16", "critic.micro_batch_size=16", "run.total_steps=2", "run.val_every=0",
         "run.val_before_train=false", f"run.output_dir={tmp_path}", "logging.progress_bar=false"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "world=2 tp=1 pp=1 dp=2" in out and "warning" not in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "critic/score/mean" in r]) == 2
