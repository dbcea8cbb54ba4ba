"""Start N local ranks for a command-line tool when it was not launched by torchrun.

`ensure_ranks(n)`: inside torchrun (WORLD_SIZE set) it checks the world size and returns;
otherwise, for n > 1, it re-executes the current command under
`python -m torch.distributed.run --standalone --nproc_per_node n` and exits with its code.
One process needs no launcher: init_parallel starts a world of one.

This module does not know about models or configs.
"""

from __future__ import annotations

import os
import subprocess
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
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    # `python -m pkg.mod` must stay a module run so the package is importable in the ranks
    target = ["-m", main_spec.name] if main_spec is not None else [sys.argv[0]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           *target, *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd, env=env))
