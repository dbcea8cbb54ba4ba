"""What end-to-end tests run and compare: `megappo train` through the test server (`train`), metrics without
timings, exported HF weights."""

import json
import os
import subprocess
import sys

from safetensors.torch import load_file

from tests import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(recipe: str, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m megappo.cli train RECIPE OVERRIDES...` from the repository (2 ranks by the recipe, one thread
    each), forked from tests/prefork.py's server; its output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    return prefork.run([sys.executable, "-m", "megappo.cli", "train", recipe, *overrides],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def metrics(run_dir):
    """RUN_DIR/metrics.jsonl rows without the timing and throughput keys (they differ run to run)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]


def hf_weights(folder):
    """Every tensor of an exported HF directory's safetensors files."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out
