"""Start N local ranks for a command-line tool when it was not launched by torchrun.

`ensure_ranks(n)`: inside torchrun (WORLD_SIZE set) it checks the world size and returns;
otherwise, for n > 1, it re-executes the current command on n ranks with torchrun
(`--standalone --nproc_per_node n`, run in this process) and exits with the exit code of the
rank that failed (2 when it reported bad input), not torchrun's 1 and its traceback. Which
rank failed is decided by how it ended, not by which exit the operating system reported first:
its own error first, then a signal (a crash, the OOM killer), then a rank that gave up waiting
for another (GAVE_UP_EXIT), then one that torchrun stopped with SIGTERM.
One process needs no launcher: init_parallel starts a world of one.

This module does not know about models or configs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

#: the exit code of a rank whose collective timed out or lost its peer (megappo.cli)
GAVE_UP_EXIT = 3


def ensure_ranks(n: int) -> None:
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != n:
            raise SystemExit(
                f"this command needs {n} ranks (tp*pp) but was launched with WORLD_SIZE={world}; "
                f"use torchrun --nproc_per_node {n}, or run it without torchrun to launch them itself."
            )
        return
    if n == 1:
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    # `python -m pkg.mod` must stay a module run so the package is importable in the ranks
    target = ["-m", main_spec.name] if main_spec is not None else [sys.argv[0]]
    raise SystemExit(torchrun(["--standalone", "--nproc_per_node", str(n), *target, *sys.argv[1:]]))


def torchrun(argv: list[str]) -> int:
    """`torchrun ARGV` in this process; returns 0, or the exit code of the rank that failed (1 when
    a signal ended it), after one line that names that rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's own report of a failure is a traceback of itself; the line below replaces it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = min(e.failures.items(), key=lambda f: (_consequence(f[1].exitcode), f[1].timestamp, f[0]))
        code = failure.exitcode
        how = f"exited with code {code}" if code > 0 else f"was ended by signal {failure.signal_name()}"
        print(f"megappo: rank {rank} failed ({how}); the other ranks were stopped.", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    return 0


def _consequence(exitcode: int) -> int:
    """0 for a rank's own failure, 1 a signal that ended it, 2 a rank that gave up waiting for
    another, 3 a rank torchrun stopped: the lowest is the cause."""
    if exitcode > 0:
        return 2 if exitcode == GAVE_UP_EXIT else 0
    return 3 if -exitcode == signal.SIGTERM else 1
