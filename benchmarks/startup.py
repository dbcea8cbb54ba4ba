#!/usr/bin/env python
"""How long a `megappo train` launch takes before and after its steps, on this machine.

    python benchmarks/startup.py [--repeats 3] [--launchers fork,torchrun]

Rows (each the median of `--repeats` fresh processes):
  import Megatron-Core (baseline)   a fresh interpreter imports the Megatron-Core modules a rank uses
                                    (models.gpt, optimizer, dist_checkpointing), as it would without megappo
  ... after `import megappo`        the same after `import megappo`: Megatron's import-time torch.compile
                                    decorations deferred to their first call (megappo.megatron_import)
  megappo train, 1 step             `megappo train recipes/demo-cpu.yaml run.total_steps=1 --launcher L` (2
                                    ranks, the console script) for each L of `--launchers`: fork (the default:
                                    ranks forked from the launcher) and torchrun (fresh interpreters, as before
                                    the fork launcher); seconds to the first step's line, to the `done:` line
                                    (a checkpoint saved between), and to the command's exit. The launchers'
                                    runs alternate, so that a change in the machine's load reaches both

Nothing here is a timed test: it prints a table to compare with benchmarks/RESULTS.md.

This script does not know what a rank does at start-up: it times the commands.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = "megatron.core.models.gpt, megatron.core.optimizer, megatron.core.dist_checkpointing"


def seconds_to_import(prefix: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-W", "ignore", "-c", f"{prefix}import {MODULES}"], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def one_step_launch(launcher: str) -> tuple[float, float, float]:
    """(first step line, done line, exit) in seconds from the command's start."""
    out = tempfile.mkdtemp(prefix="megappo-startup-")
    command = [shutil.which("megappo") or "megappo", "train", "recipes/demo-cpu.yaml", "run.total_steps=1",
               f"run.output_dir={out}", "--launcher", launcher]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = done = None
    for line in proc.stdout:
        now = time.perf_counter() - start
        if first is None and line.startswith("step 1/"):
            first = now
        if line.startswith("done:"):
            done = now
    code = proc.wait()
    total = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    if code != 0 or first is None or done is None:
        raise SystemExit(f"{' '.join(command)} failed (exit {code})")
    return first, done, total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--launchers", default="fork,torchrun",
                   help="comma-separated `megappo train --launcher` values to time (default: fork,torchrun)")
    args = p.parse_args()
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    plain = statistics.median(seconds_to_import("") for _ in range(args.repeats))
    deferred = statistics.median(seconds_to_import("import megappo; ") for _ in range(args.repeats))
    launches = {name: [] for name in launchers}
    for _ in range(args.repeats):
        for name in launchers:
            launches[name].append(one_step_launch(name))
    print(f"{'what':64s}{'seconds':>9s}{'vs baseline':>13s}")
    print(f"{'import Megatron-Core (baseline)':64s}{plain:9.2f}{1.0:12.2f}x")
    print(f"{'import Megatron-Core after `import megappo`':64s}{deferred:9.2f}{deferred / plain:12.2f}x")
    for name in launchers:
        first, done, total = (statistics.median(x) for x in zip(*launches[name]))
        print(f"{f'megappo train --launcher {name}, 1 step: first step line':64s}{first:9.2f}")
        print(f"{f'megappo train --launcher {name}, 1 step: done line (checkpoint saved)':64s}{done:9.2f}")
        print(f"{f'megappo train --launcher {name}, 1 step: exit':64s}{total:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
