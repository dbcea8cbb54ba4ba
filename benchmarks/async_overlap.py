"""rollout.mode sync vs one_step_off vs async: step time, tokens/s and rewards (docs/async.md).

Runs `megappo train` once per setting on one trainer rank pinned to CPU core 0; the
`separate` settings run the hf engine in its own process pinned to core 1
(`rollout.engine_cores=[1]`), so that generation and training can overlap on a 2-core machine:

    sync colocated     the engine in the trainer's process (core 0): today's default
    sync separate      the engine on core 1, generation and training still take turns
    one_step_off        the engine on core 1 generates step k+1 while step k trains
    async N=2           the engine on core 1 runs up to 2 policy versions ahead

Workloads (--workload):
  demo     recipes/demo-cpu.yaml at TP=1 (a tiny Llama, 64 prompts x 2 new tokens)
  smollm2  recipes/smollm2-arithmetic-cpu.yaml at PP=1 (SmolLM2-135M-Instruct, prepare it once
           with tools/prepare_smollm2.py) with --batch prompts x up to --max-new-tokens tokens

It prints, over the steps after the first --skip (start-up), the mean step time, the
generation time of the sync rows (`timing_s/gen`), the time each step was blocked on
generation (`timing_s/gen_wait`), the weight sync's time in the step (`timing_s/weight_sync`:
in async mode the staging copy only; the engine loads the weights in the generation thread),
processed tokens/s (`perf/total_num_tokens` / step time),
mean reward and staleness, the reward curve in windows, and each overlapped row's speed-up
over `sync separate` against the ideal (G + T) / max(G, T) from the sync row's split.

    OMP_NUM_THREADS=1 python benchmarks/async_overlap.py --workload demo --steps 40
    OMP_NUM_THREADS=1 python benchmarks/async_overlap.py --workload smollm2 --steps 6 --skip 1
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IS = "actor.old_logprob=is_correct"
SETTINGS = {  # every setting uses is_correct, so that only the schedule differs
    "sync colocated": [IS],
    "sync separate": [IS, "rollout.placement=separate", "rollout.engine_cores=[1]"],
    "one_step_off": [IS, "rollout.placement=separate", "rollout.engine_cores=[1]", "rollout.mode=one_step_off"],
    "async N=2": [IS, "rollout.placement=separate", "rollout.engine_cores=[1]", "rollout.mode=async",
                    "rollout.max_staleness=2"],
}


def workload(args) -> tuple[str, list[str]]:
    if args.workload == "demo":
        return "recipes/demo-cpu.yaml", ["parallel.tp=1"]
    return "recipes/smollm2-arithmetic-cpu.yaml", [
        "parallel.pp=1", f"data.train_batch_size={args.batch}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"actor.ppo_mini_batch_size={args.batch}", f"critic.ppo_mini_batch_size={args.batch}",
        "actor.micro_batch_size=4", "critic.micro_batch_size=4"]


def run(out: str, recipe: str, steps: int, extra: list[str]) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--world-size", "1", recipe, f"run.output_dir={out}",
           f"run.total_steps={steps}", "run.val_every=0", "run.val_before_train=false", "checkpoint.save_every=0",
           "logging.progress_bar=false", *extra]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, {0}))  # the trainer on core 0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "timing_s/step" in r]


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=["demo", "smollm2"], default="demo")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=2, help="start-up steps left out of the means")
    parser.add_argument("--batch", type=int, default=8, help="smollm2: prompts per step")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="smollm2: response budget")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of the rows")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 CPU cores (trainer on core 0, engine on core 1)")
    recipe, base = workload(args)
    names = args.settings.split(",")
    print(f"{args.workload}: {recipe} {' '.join(base + args.overrides)}; {args.steps} steps, means over steps "
          f"{args.skip + 1}-{args.steps}; trainer on core 0, separate engine on core 1")
    print(f"{'setting':<18} {'step s':>8} {'gen s':>7} {'gen_wait s':>10} {'sync s':>7} {'tok/s':>8} {'reward':>7} "
          f"{'stale':>6}")
    results, curves = {}, {}
    for name in names:
        with tempfile.TemporaryDirectory() as out:
            rows = run(out, recipe, args.steps, base + SETTINGS[name] + args.overrides)
        timed = rows[args.skip:]
        step, gen, wait = mean(timed, "timing_s/step"), mean(timed, "timing_s/gen"), mean(timed, "timing_s/gen_wait")
        tokens = sum(r["perf/total_num_tokens"] for r in timed) / sum(r["timing_s/step"] for r in timed)
        results[name] = (step, gen, wait)
        window = max(1, len(rows) // 8)
        curves[name] = [round(mean(rows[i:i + window], "critic/score/mean"), 2) for i in range(0, len(rows), window)]
        print(f"{name:<18} {step:8.3f} {gen:7.3f} {wait:10.3f} {mean(timed, 'timing_s/weight_sync'):7.3f} {tokens:8.1f} "
              f"{mean(timed, 'critic/score/mean'):7.3f} {mean(timed, 'rollout/staleness'):6.2f}")
    print(f"reward curve (mean critic/score/mean per window of {max(1, args.steps // 8)} steps):")
    for name, curve in curves.items():
        print(f"  {name:<18} {curve}")
    if "sync separate" in results:
        base_step, base_gen, _ = results["sync separate"]
        ideal = base_step / max(base_step - base_gen, base_gen)
        for name in names:
            if name.startswith(("one_step_off", "async")):
                step, _, wait = results[name]
                print(f"{name} vs sync separate: {base_step / step:.2f}x step time (ideal {ideal:.2f}x: generation "
                      f"{base_gen:.3f} s of {base_step:.3f} s); generation hidden: {1 - wait / base_gen:.0%}")


if __name__ == "__main__":
    main()
