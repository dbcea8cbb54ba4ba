"""Start N local ranks for a command-line tool when it was not launched by torchrun.

`ensure_ranks(n)`: inside torchrun (WORLD_SIZE set) it checks the world size and returns;
otherwise, for n > 1, it re-executes the current command on n ranks with torchrun
(`--standalone --nproc_per_node n`, run in this process) and exits with the exit code of the
rank that failed (2 when it reported bad input), not torchrun's 1 and its traceback. Which
rank failed is decided by how it ended, not by which exit the operating system reported first:
its own error first, then a signal (a crash, the OOM killer), then a rank that gave up waiting
for another (GAVE_UP_EXIT), then one that torchrun stopped with SIGTERM.
SIGINT and SIGTERM sent to the launcher go on to the ranks (megappo.interrupts: they stop at a
step boundary with a checkpoint; a second signal kills them) and the launcher exits with
128 + the signal, as do ranks that stopped on a signal sent to them directly, with no line of
its own (rank 0 says what was saved).
One process needs no launcher: init_parallel starts a world of one.

This module does not know about models or configs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys

#: the exit code of a rank whose collective timed out or lost its peer (megappo.cli)
GAVE_UP_EXIT = 3
#: the exit codes of ranks that stopped on SIGINT / SIGTERM (megappo.interrupts)
INTERRUPTED_EXITS = (128 + signal.SIGINT, 128 + signal.SIGTERM)


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
    a signal ended it), after one line that names that rank, or 128 + the signal that stopped
    the ranks (SIGINT, SIGTERM)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import parse_args, run

    from megappo.interrupts import Forwarder, exit_code

    # torchrun's own report of a failure is a traceback of itself; the line below replaces it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # SIGINT / SIGTERM are the Forwarder's, not torchrun's (which would raise them as a traceback;
    # a torch without --signals-to-handle still does, and the SignalException below is caught)
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        argv = ["--signals-to-handle", "SIGHUP,SIGQUIT", *argv]
    args = parse_args(argv)
    with Forwarder() as signals:
        try:
            run(args)
        except ChildFailedError as e:
            return _failed(e, signals)
        except KeyboardInterrupt:  # a signal before any rank was started
            print("megappo: interrupted", file=sys.stderr, flush=True)
            return signals.exit_code or exit_code(signal.SIGINT)
        except SignalException as e:  # torchrun forwarded the signal to the ranks and stopped them
            return exit_code(e.sigval)
    return 0


def _failed(e, signals) -> int:
    """The exit code of ranks that failed or stopped on a signal, after at most one line."""
    rank, failure = min(e.failures.items(), key=lambda f: (_consequence(f[1].exitcode), f[1].timestamp, f[0]))
    code = failure.exitcode
    if signals.stopped_at_once:
        print("megappo: interrupted again: the ranks were stopped at once, without a checkpoint of the step in "
              "progress; rerun the same command to continue from the latest checkpoint, if any.", file=sys.stderr,
              flush=True)
        return signals.exit_code
    if code in INTERRUPTED_EXITS or (signals.exit_code and code < 0):  # rank 0 said what was saved
        return signals.exit_code or code
    how = f"exited with code {code}" if code > 0 else f"was ended by signal {failure.signal_name()}"
    print(f"megappo: rank {rank} failed ({how}); the other ranks were stopped.", file=sys.stderr, flush=True)
    return code if code > 0 else 1


def _consequence(exitcode: int) -> int:
    """0 for a rank's own failure, 1 a signal that ended it, 2 a rank that gave up waiting for
    another or stopped on SIGINT / SIGTERM, 3 a rank torchrun stopped: the lowest is the cause."""
    if exitcode > 0:
        return 2 if exitcode in (GAVE_UP_EXIT, *INTERRUPTED_EXITS) else 0
    return 3 if -exitcode == signal.SIGTERM else 1
