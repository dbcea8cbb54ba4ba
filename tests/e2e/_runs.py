"""What end-to-end tests compare between two runs: metrics without timings, exported HF weights."""

import json
import os

from safetensors.torch import load_file


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
