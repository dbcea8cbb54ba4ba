"""Start N local ranks for a command-line tool when it was not launched by torchrun.

`ensure_ranks(n)`: inside torchrun (WORLD_SIZE set) it checks the world size and returns;
otherwise, for n > 1, it re-executes the current command on n ranks with torchrun
(`--standalone --nproc_per_node n`, run in this process) and exits with the exit code of the
rank that failed first: 2 when a rank reported bad input, not torchrun's 1 and its traceback.
One process needs no launcher: init_parallel starts a world of one.

This module does not know about models or configs.
"""

from __future__ import annotations

import logging
import os
import sys


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
    """`torchrun ARGV` in this process; returns 0, or the exit code of the rank that failed first
    (1 when a signal ended it), after one line that names that rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's own report of a failure is a traceback of itself; the line below replaces it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f"exited with code {code}" if code > 0 else f"was ended by signal {failure.signal_name()}"
        print(f"megappo: rank {rank} {how}, the first to fail; the other ranks were stopped.", file=sys.stderr,
              flush=True)
        return code if code > 0 else 1
    return 0
