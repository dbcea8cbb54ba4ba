#!/usr/bin/env python
"""Check that a speed change kept the results: the same recipe trained by two megappo
checkouts must log the same metrics, bit for bit.

    git archive <commit-before> | tar -x -C /tmp/megappo-before
    OMP_NUM_THREADS=1 python benchmarks/same_metrics.py RECIPE.yaml /tmp/megappo-before . \\
        run.total_steps=3 [key.sub=value ...]

Runs `python -m megappo.cli train RECIPE overrides...` once per checkout (each with its own
PYTHONPATH) and compares every metric of every step except timings (`timing_s/*`,
`perf/*`) with ==. Losses, gradient norms, KL, entropy and the engine/trainer log-prob
mismatch of later steps depend on the weights the earlier steps produced, so equal
metrics over a few steps mean equal training. Exit code 1 when anything differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

TIMING = ("timing_s/", "perf/")


def train(recipe: str, repo: str, overrides: list[str]) -> list[dict]:
    out = tempfile.mkdtemp(prefix="same_metrics_")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(repo))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "train", os.path.abspath(recipe),
                           f"run.output_dir={out}", "logging.progress_bar=false", *overrides],
                          env=env, cwd=repo, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"megappo from {repo} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    recipe, before, after, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    rows_before, rows_after = train(recipe, before, overrides), train(recipe, after, overrides)
    if len(rows_before) != len(rows_after):
        print(f"DIFFERENT: {len(rows_before)} vs {len(rows_after)} logged steps")
        return 1
    compared = differ = 0
    for a, b in zip(rows_before, rows_after):
        for key in sorted((set(a) | set(b))):
            if key.startswith(TIMING):
                continue
            compared += 1
            if a.get(key) != b.get(key):
                differ += 1
                print(f"step {a.get('step')}: {key}: {a.get(key)!r} != {b.get(key)!r}")
    verdict = "IDENTICAL" if not differ else "DIFFERENT"
    print(f"{verdict}: {len(rows_after)} steps, {compared} metric values compared, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
