#!/usr/bin/env python
"""Reward scoring with reward.num_workers against rank 0 calling the functions itself, in one run.

    python benchmarks/reward_workers.py [--responses 512 --ms 4 --workers 2 --passes-s 1.0]

A reward function of your own that costs `--ms` milliseconds of Python work per response (a stand-in for
a symbolic math checker), on `--responses` responses, scored through `megappo.rewards.score_records` as a
training step does. Rows (each the median of 3 timed calls after one warm-up call, which starts the
workers' functions):
  rank 0 (baseline):       reward.num_workers=0, after the step's passes: passes + scoring
  workers, after passes:   the workers score once the passes are done (validation and dynamic sampling
                           use them so): passes + parallel scoring
  workers, during passes:  a training step: the responses handed over, the passes run, then the wait for
                           what is left (megappo.trainer.step.start_scoring)
The step's model passes are stood in for by `--passes-s` seconds of waiting on rank 0 (on a GPU the host
thread mostly waits for the device). Every row's scores are checked equal to the baseline's. With
`--workers` at the machine's core count, the parallel rows approach 1 / workers of the scoring time.
"""

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SLOW = textwrap.dedent('''
    import time


    def checker(response, ground_truth, extra):
        end = time.perf_counter() + MS / 1000  # busy, as a symbolic checker is
        x = 0
        while time.perf_counter() < end:
            x += 1
        return {"score": float(response.endswith(ground_truth)), "acc": response.endswith(ground_truth)}
''')


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--responses", type=int, default=512)
    p.add_argument("--ms", type=float, default=4.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--passes-s", type=float, default=1.0)
    args = p.parse_args()

    from megappo.rewards.workers import RewardWorkers
    from megappo.rewards import score_records

    path = os.path.join(tempfile.mkdtemp(), "slow_reward.py")
    with open(path, "w") as f:
        f.write(f"MS = {args.ms}\n" + SLOW)
    names = [f"{path}:checker"]
    read = ([f"answer {i % 10}" for i in range(args.responses)], [str(i % 7) for i in range(args.responses)],
            [{} for _ in range(args.responses)], ["bench"] * args.responses)
    workers = RewardWorkers(names, args.workers, timeout_s=60)

    def baseline():
        time.sleep(args.passes_s)
        return score_records(names, None, *read)

    def after():
        time.sleep(args.passes_s)
        return score_records(names, None, *read, outcomes=workers.start(*read).outcomes())

    def during():
        scoring = workers.start(*read)
        time.sleep(args.passes_s)
        return score_records(names, None, *read, outcomes=scoring.outcomes())

    rows, reference = [], None
    try:
        for label, fn in (("rank 0 (baseline)", baseline), ("workers, after passes", after),
                          ("workers, during passes", during)):
            fn()  # warm-up
            times = []
            for _ in range(3):
                start = time.perf_counter()
                got = fn()
                times.append(time.perf_counter() - start)
            reference = reference or got
            assert got == reference, label
            rows.append((label, statistics.median(times)))
    finally:
        workers.close()
    base = rows[0][1]
    print(f"{args.responses} responses x {args.ms:g} ms, {args.workers} workers, passes {args.passes_s:g} s, "
          f"{os.cpu_count()} CPUs")
    print(f"{'':<26}{'step part (s)':>14}{'scoring beyond passes (s)':>28}{'speed-up':>10}")
    for label, t in rows:
        print(f"{label:<26}{t:>14.3f}{t - args.passes_s:>28.3f}{base / t:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
