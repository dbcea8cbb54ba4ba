#!/usr/bin/env python
"""Partial rollouts against whole-batch generation on a task with a long tail of response lengths, in one run.

    python benchmarks/partial_rollouts.py [--steps 30] [--seeds 0 1] [--stop 3,4] [--chunk 8] [--over 2]
                                          [--last 5] [KEY=VALUE ...]

The task: the CPU demo (digit successor, GRPO, 16 prompts x 4 samples, 2 gloo ranks) with responses of up to
128 tokens that also end at the tokens `--stop` (ids 3, 4: the digits 0 and 1), besides EOS. The untrained
policy stops with a small chance at each token, so response lengths are geometric: most samples stop
within a few tokens, a few run long, and whole-batch generation waits for the longest (`--stop 3`: a
heavier tail). For each seed, `megappo train` runs the task twice from the same start:
`rollout.partial.enable=false` (every step generates its 16 groups to the end) and `true` (`--over` x 16
groups in generation, the first 16 complete train, the rest are carried; `--chunk` tokens a call). Per run:

  gen s / sample    the steps' generation time (timing_s/gen) over the samples trained
  resp len          the trained responses' mean length (response_length/mean)
  token age         the trained tokens' mean policy-version age (rollout/token_age/mean; 0 without)
  score 1-5, last N the mean score (critic/score/mean) over the first 5 and the last `--last` steps: equal
                    learning means the two runs of a seed end alike
  ratio             partial's gen s / sample over whole-batch generation's (the issue's bar: <= 0.6)

With several seeds a last table gives, per generation, the mean over seeds of the ratio and of the last
scores with their standard error, and the mean of the per-seed score differences (partial - whole batch)
with its standard error: equal learning within noise when that difference is within about 2 standard
errors of 0. KEY=VALUE arguments go to both runs (e.g. actor.old_logprob=is_correct).

Run it on an idle machine. Nothing here is a timed test; compare the table with benchmarks/RESULTS.md.

This script does not know how partial rollouts work: it runs the CLI and reads metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = ["algorithm.adv_estimator=grpo", "rollout.n=4", "rollout.max_new_tokens=128", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
        "actor.micro_batch_size=16", "run.val_before_train=false", "run.val_every=0", "checkpoint.save_every=-1",
        "logging.progress_bar=false"]
PARTIAL = ["rollout.partial.enable=true"]


def train(steps: int, seed: int, extra: list[str]) -> list[dict]:
    out = tempfile.mkdtemp(prefix="partial_bench_")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--world-size", "2", "recipes/demo-cpu.yaml",
           f"run.output_dir={out}", f"run.total_steps={steps}", f"rollout.seed={seed}", f"run.seed={seed}",
           f"data.seed={seed}", *TASK, *extra]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "critic/score/mean" in r]


def summary(rows: list[dict], last: int = 5) -> dict:
    samples = 16 * 4 * len(rows)
    gen = sum(r["timing_s/gen"] for r in rows)
    mean = lambda key, part: sum(r.get(key, 0.0) for r in part) / len(part)
    return {"gen s / sample": gen / samples, "resp len": mean("response_length/mean", rows),
            "token age": mean("rollout/token_age/mean", rows),
            "score 1-5": mean("critic/score/mean", rows[:5]), "last": mean("critic/score/mean", rows[-last:])}


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (0 for one value)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, 0.0
    return m, (sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--stop", default="3,4", help="token ids that also end a response (digits 0, 1: ids 3, 4)")
    parser.add_argument("--chunk", type=int, default=8, help="rollout.partial.chunk_tokens")
    parser.add_argument("--over", type=float, default=2.0, help="rollout.partial.over_sample")
    parser.add_argument("--last", type=int, default=5, help="the last steps whose mean score is compared")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for both runs")
    args = parser.parse_args()
    task = [f"rollout.stop_token_ids=[{args.stop}]", *args.overrides]
    print(f"| seed | generation | gen s / sample | resp len | token age | score 1-5 | last {args.last} | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    per_seed = []
    for seed in args.seeds:
        whole = summary(train(args.steps, seed, task), args.last)
        part = summary(train(args.steps, seed, task + PARTIAL + [f"rollout.partial.chunk_tokens={args.chunk}",
                                                             f"rollout.partial.over_sample={args.over}"]), args.last)
        per_seed.append((whole, part))
        for name, s in (("whole batch", whole), ("partial", part)):
            ratio = s["gen s / sample"] / whole["gen s / sample"]
            print(f"| {seed} | {name} | {s['gen s / sample'] * 1e3:.2f} ms | {s['resp len']:.1f} | "
                  f"{s['token age']:.2f} | {s['score 1-5']:.3f} | {s['last']:.3f} | {ratio:.2f}x |", flush=True)
    if len(per_seed) > 1:
        print(f"\n| over {len(per_seed)} seeds | ratio | last {args.last} score +- s.e. |")
        print("|---|---|---|")
        for i, name in enumerate(("whole batch", "partial")):
            ratio = mean_se([p[i]["gen s / sample"] / p[0]["gen s / sample"] for p in per_seed])
            score = mean_se([p[i]["last"] for p in per_seed])
            print(f"| {name} | {ratio[0]:.2f}x | {score[0]:.3f} +- {score[1]:.3f} |")
        diff = mean_se([p[1]["last"] - p[0]["last"] for p in per_seed])
        print(f"| partial - whole batch, per seed | | {diff[0]:+.3f} +- {diff[1]:.3f} |")


if __name__ == "__main__":
    main()
