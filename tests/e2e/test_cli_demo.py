"""README's main job: `megappo demo` on 2 gloo ranks, as a user runs it."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_runs_and_decodes_like_transformers(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "demo", "--output-dir", str(tmp_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "== transformers.generate: True" in out
    assert (tmp_path / "megatron_tp2" / "megappo_model.json").is_file()
    assert (tmp_path / "hf_roundtrip" / "config.json").is_file()
