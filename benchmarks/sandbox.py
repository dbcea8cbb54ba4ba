#!/usr/bin/env python
"""How fast the code executor checks programs, on this machine.

    python benchmarks/sandbox.py [--checks 64] [--isolation bwrap]

Rows:
  bare subprocess.run               `python -I -c PROGRAM` with its stdin, no sandbox, no limits (the floor)
  one check, 1 in flight            LocalExecutor.run of the same program: the harness, rlimits, the
                                    namespaces, a temp dir, capped reading, the wait for the namespace's end
  checks per second, N in flight    `--checks` runs from N threads at once (N = 1, 2, 8), as the `code`
                                    reward runs a response's test cases

One table, one run; nothing here is a timed test. The machine's other load changes every row: say what
else ran when you copy it to benchmarks/RESULTS.md.

This script does not know about reward functions or test cases: it times the executor.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megappo.rewards.sandbox import ISOLATIONS, LocalExecutor, resolve_isolation  # noqa: E402

PROGRAM = "n = int(input())\nprint(sum(i * i for i in range(n)))"
STDIN = "1000\n"


def per_run(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checks", type=int, default=64, help="runs per row of checks per second")
    p.add_argument("--isolation", choices=ISOLATIONS, default="bwrap")
    args = p.parse_args()
    executor = LocalExecutor(resolve_isolation(args.isolation))
    assert executor.run(PROGRAM, STDIN).stdout == "332833500\n"

    bare = per_run(lambda: subprocess.run([sys.executable, "-I", "-c", PROGRAM], input=STDIN.encode(),
                                          capture_output=True, check=True), args.checks // 4)
    one = per_run(lambda: executor.run(PROGRAM, STDIN), args.checks // 4)
    print(f"code executor, isolation={args.isolation}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    print(f"    {'what':44s} {'value':>10s}")
    print(f"    {'bare subprocess.run, ms per run':44s} {bare * 1e3:10.1f}")
    print(f"    {'one check, ms (1 in flight)':44s} {one * 1e3:10.1f}")
    print(f"    {'overhead of a check over the bare run, ms':44s} {(one - bare) * 1e3:10.1f}")
    for in_flight in (1, 2, 8):
        with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
            start = time.perf_counter()
            results = list(pool.map(lambda _: executor.run(PROGRAM, STDIN), range(args.checks)))
            took = time.perf_counter() - start
        assert all(r.status == "ok" for r in results)
        print(f"    {f'checks per second, {in_flight} in flight':44s} {args.checks / took:10.1f}")


if __name__ == "__main__":
    main()
