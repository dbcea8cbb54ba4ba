"""rollout.mode=sync vs one_step_off step time on the CPU demo (docs/async.md).

Runs `megappo train recipes/demo-cpu.yaml` (2 gloo ranks) once per setting for STEPS steps
and prints, over the steps after the first two (start-up), the mean step time, generation
time (`timing_s/gen` in sync mode), the time the step was blocked on generation
(`timing_s/gen_wait`) and the rest of the step (training), then the overlap's share.

    OMP_NUM_THREADS=1 python benchmarks/async_overlap.py [STEPS] [extra overrides...]
"""

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {
    "sync, colocated": [],
    "sync, separate": ["rollout.placement=separate"],
    "one_step_off, separate": ["rollout.mode=one_step_off", "rollout.placement=separate",
                               "actor.old_logprob=is_correct"],
}


def run(out: str, steps: int, extra: list[str]) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "megappo.cli", "train", "recipes/demo-cpu.yaml", f"run.output_dir={out}",
           f"run.total_steps={steps}", "run.val_every=0", "run.val_before_train=false", "checkpoint.save_every=0",
           "logging.progress_bar=false", *extra]
    subprocess.run(cmd, env=env, cwd=REPO, check=True, capture_output=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "timing_s/step" in r][2:]


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    extra = sys.argv[2:]
    print(f"demo-cpu, {steps} steps (means over steps 3-{steps}), overrides {extra or 'none'}")
    print(f"{'setting':<24} {'step s':>8} {'gen s':>8} {'gen_wait s':>11} {'train s':>8}")
    results = {}
    for name, overrides in SETTINGS.items():
        with tempfile.TemporaryDirectory() as out:
            rows = run(out, steps, overrides + extra)
        step, gen, wait = mean(rows, "timing_s/step"), mean(rows, "timing_s/gen"), mean(rows, "timing_s/gen_wait")
        results[name] = (step, gen, wait)
        print(f"{name:<24} {step:8.3f} {gen:8.3f} {wait:11.3f} {step - wait:8.3f}")
    base_step, base_gen, _ = results["sync, separate"]
    step, _, wait = results["one_step_off, separate"]
    print(f"one_step_off vs sync (separate): {base_step / step:.2f}x step time; generation hidden: "
          f"{1 - wait / base_gen:.0%} of {base_gen:.3f} s; ideal with full overlap: "
          f"{base_step / max(base_step - base_gen, base_gen):.2f}x")


if __name__ == "__main__":
    main()
