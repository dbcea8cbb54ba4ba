"""Start N local ranks for a command-line tool when it was not launched by torchrun.

`ensure_ranks(n)`: inside torchrun (WORLD_SIZE set) it checks the world size and returns;
otherwise, for n > 1, it re-executes the current command on n ranks with torchrun
(`--standalone` semantics on 127.0.0.1: `--nnodes 1 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:0 --local-addr 127.0.0.1 --nproc_per_node n`, run in this process) and exits with the exit code of the
rank that failed (2 when it reported bad input), not torchrun's 1 and its traceback. Which
rank failed is decided by how it ended, not by which exit the operating system reported first:
its own error first, then a signal (a crash, the OOM killer), then a rank that gave up waiting
for another (GAVE_UP_EXIT), then one that torchrun stopped with SIGTERM. A rank that ends on its
own error (megappo.cli: bad input, a failed run, the user's code, a bug's exception) first writes
it, with the time, to the file torchrun gives each rank for that (`record_error`: $TORCHELASTIC_ERROR_FILE,
which torch's own `@record` writes too): of several, the first recorded is the cause, even when
torchrun stopped that rank while it was still ending (a traceback takes seconds) and a survivor,
having lost it, exited first. The launcher's last line then names that rank; it is a
`megappo: error:` line repeating the rank's own message (`final_line`) when that message is not
already the last error on the screen: a bug's (the rank printed a traceback), or one followed by
a survivor's lost-connection or timeout line or another rank's error.
SIGINT and SIGTERM sent to the launcher go on to the ranks (megappo.parallel.interrupts: they stop at a
step boundary with a checkpoint; a second signal kills them) and the launcher exits with
128 + the signal, as do ranks that stopped on a signal sent to them directly, with no line of
its own (rank 0 says what was saved).
One process needs no launcher: init_parallel starts a world of one.
With `fork` (megappo train's default), the agent forks each rank from this process once it has
imported what the ranks need, instead of starting `python -u ...` (megappo.parallel.fork); nothing
else here changes.

A rank ends through `exit_rank(code)` (`megappo.cli.entry`: the `megappo` command and `python -m
megappo.cli`; the convert tools): its non-daemon threads joined, stdout / stderr flushed and the
atexit handlers run (multiprocessing children shut down, logging and sinks flushed), then
`os._exit`: the interpreter's own teardown of torch, Megatron and the models' objects would take
seconds per rank and writes nothing a finished rank still owes.

No process of a run outlives it: torchrun starts each rank in its own session (so its own
process group), and whatever a rank starts stays in that group (the forked writer processes of a
checkpoint save). torchrun reaps the ranks, not their children, so when an attempt ends, for
any reason, the launcher kills the process group of every rank it started (`_RankGroups`).

Restarts (`max_restarts`): an attempt that failed because a rank died (ended by a signal other
than torchrun's SIGTERM: kill -9, a crash, the OOM killer) or because a collective timed out or
lost its peer (GAVE_UP_EXIT) is run again on every rank, at most `max_restarts` times, with
`restart_args` appended to the command (megappo.cli: resume from the latest checkpoint); each
restart prints one line naming the rank and the cause and calls `on_restart`. A rank's own error
(bad input, exit 2; a run that failed on the way, such as non-finite losses, exit 1; an error in
the user's own code, USER_CODE_EXIT, after which the launcher prints nothing, so that the rank's
message stays last; a bug) and a stop on SIGINT / SIGTERM end the run: rerunning would only
repeat them, or undo the stop.

Network: every store this launcher hosts listens on 127.0.0.1 only (megappo.parallel.listen:
torch's own TCPStore listens on every interface, whatever address it is given), and the ranks
use the loopback interface for gloo (GLOO_SOCKET_IFNAME, unless set): a run started this way
opens no port beyond loopback (docs/launchers.md).

This module does not know about models or configs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import uuid
from typing import Callable

from megappo.parallel.fork import RankFork, exit_as_interpreter, fork_blocker, forked_ranks
from megappo.parallel.listen import LOOPBACK, loopback_interface, loopback_rendezvous

#: the exit code of a rank whose collective timed out or lost its peer (megappo.cli)
GAVE_UP_EXIT = 3
#: the exit code of a rank whose run ended on an error in the user's own code (megappo.user_code.UserCodeError):
#: that rank printed the one message, so the launcher adds no line of its own
USER_CODE_EXIT = 4
#: the exit codes of ranks that stopped on SIGINT / SIGTERM (megappo.parallel.interrupts)
INTERRUPTED_EXITS = (128 + signal.SIGINT, 128 + signal.SIGTERM)
#: torchrun's variable naming the file where the rank it started writes the error it ends on (record_error)
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: this process ran torchrun's agent (torchrun): it ends as its ranks do (exit_rank)
_agent_ran = False


@dataclasses.dataclass(frozen=True)
class RankError:
    """The error a rank ended on, as it recorded it for its launcher (record_error)."""

    message: str  # the text after `megappo: error: `, or `ExceptionType: message` for a bug
    exit_code: int  # the code the rank exits with
    shown: bool  # the rank printed it as a `megappo: error:` line (a bug's traceback is not one)
    time: float  # when (time.time())


def record_error(message: str, exit_code: int, shown: bool) -> None:
    """Write the error this rank ends on to $TORCHELASTIC_ERROR_FILE, in the JSON torchrun reads
    (its "message", the time in whole seconds) plus megappo's own RankError; nothing outside
    torchrun (a world of one, SLURM's srun without it) or when the file cannot be written."""
    import json
    import time

    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    now = time.time()
    record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(now))}},
              "megappo": dataclasses.asdict(RankError(message, exit_code, shown, now))}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass


def rank_error(error_file_data) -> RankError | None:
    """The RankError in the data of a rank's error file (torchrun's ProcessFailure.error_file_data), if any."""
    own = error_file_data.get("megappo") if isinstance(error_file_data, dict) else None
    try:
        return RankError(**own) if own else None
    except TypeError:
        return None


def cause(ended: dict[int, tuple[int, float, RankError | None]]) -> tuple[int, int, RankError | None]:
    """(rank, exit code, its RankError or None) of the rank whose failure ended the run, from each failed
    rank's (exit code, when it ended, what it recorded): the first recorded own error (its own exit code,
    even if the rank was then stopped with a signal), else by failure_rank_order, then time, then rank."""
    own = {rank: error for rank, (_, _, error) in ended.items() if error is not None}
    if own:
        rank = min(own, key=lambda r: (own[r].time, r))
        return rank, own[rank].exit_code, own[rank]
    rank, (code, _, _) = min(ended.items(), key=lambda f: (failure_rank_order(f[1][0]), f[1][1], f[0]))
    return rank, code, None


def final_line(rank: int, code: int, error: RankError | None, ended: dict[int, tuple[int, float, RankError | None]]
               ) -> str | None:
    """The launcher's last line for a run that `rank` ended (cause), or None when the rank's own message is
    already the last thing on the screen (an error in the user's code, USER_CODE_EXIT, that nobody spoke after).
    It repeats the rank's error as the last `megappo: error:` line when that is not already so: a bug's
    (a traceback), or one after which another rank spoke (gave up on a collective, or its own error)."""
    failed = f"{_describe(rank, code)}; the other ranks were stopped"
    spoke_after = any(r != rank and (c == GAVE_UP_EXIT or e is not None) for r, (c, _, e) in ended.items())
    if error is not None and (not error.shown or spoke_after):
        return f"megappo: error: {failed}. Its error: {error.message}"
    if code == USER_CODE_EXIT:  # the rank's message (the user's code, the row, the turn) stays the last line
        return None
    return f"megappo: {failed}."


@dataclasses.dataclass(frozen=True)
class Restart:
    """What `on_restart` is told: the restart's number and the failure that caused it."""

    restart: int  # 1 for the first restart
    max_restarts: int
    rank: int  # the rank whose failure ended the attempt
    exitcode: int  # its exit code (> 0), or minus the signal that ended it
    signal: str | None  # that signal's name, None for an exit code
    cause: str  # e.g. "rank 1 failed (was ended by signal SIGKILL)"


def ensure_ranks(n: int, *, max_restarts: int = 0, restart_args: tuple[str, ...] = (),
                 on_restart: Callable[[Restart], None] | None = None, fork: RankFork | None = None) -> None:
    """See the module docstring. `fork`: the ranks are forks of this process after `fork.preload()` (when
    fork_blocker() finds nothing against it) instead of fresh interpreters (megappo.parallel.fork)."""
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
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())  # gloo's sockets: loopback, not the hostname's address
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    # `python -m pkg.mod` must stay a module run so the package is importable in the ranks
    target = ["-m", main_spec.name] if main_spec is not None else [sys.argv[0]]
    if fork is not None:
        fork.preload()
        fork = fork if fork_blocker() is None else None
    raise SystemExit(torchrun([*one_node_args(), "--nproc_per_node", str(n), *target, *sys.argv[1:]],
                              max_restarts=max_restarts, restart_args=restart_args, on_restart=on_restart,
                              fork=(fork, tuple(target)) if fork is not None else None))


def exit_rank(code: int | None) -> None:
    """End this process as a rank ends (the module docstring): threads joined, output flushed,
    atexit handlers run, then os._exit(code) without the interpreter's teardown; the launcher that ran
    torchrun's agent ends so too (its ranks have ended). Elsewhere (no TORCHELASTIC_RUN_ID: a world of
    one, a plain command) it is sys.exit(code)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and not _agent_ran:
        sys.exit(code)
    exit_as_interpreter(code)


def one_node_args() -> list[str]:
    """torchrun's `--standalone` (a c10d rendezvous of one node on a free port), on 127.0.0.1
    instead of `localhost` and the host's name: the ranks' MASTER_ADDR is 127.0.0.1."""
    return ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:0", "--rdzv-id",
            uuid.uuid4().hex, "--local-addr", LOOPBACK]


def torchrun(argv: list[str], *, max_restarts: int = 0, restart_args: tuple[str, ...] = (),
             on_restart: Callable[[Restart], None] | None = None,
             fork: tuple[RankFork, tuple[str, ...]] | None = None) -> int:
    """`torchrun ARGV` in this process; returns 0, or the exit code of the rank that failed (1 when
    a signal ended it), after one line that names that rank, or 128 + the signal that stopped
    the ranks (SIGINT, SIGTERM). A failure that restarts (see the module docstring) runs ARGV +
    `restart_args` again, up to `max_restarts` times. `fork`: (how, the part of ARGV that names the
    rank's program): the ranks are forks of this process (megappo.parallel.fork)."""
    global _agent_ran
    _agent_ran = True
    elastic_log = logging.getLogger("torch.distributed.elastic")
    fresh_level, restarts = elastic_log.level, 0
    while True:
        code, failure = _attempt(argv, fork, fresh_level)
        if failure is None:
            return code
        rank, exitcode = failure
        cause = _describe(rank, exitcode)
        if restarts >= max_restarts:
            after = f" after {restarts} restart{'s' * (restarts != 1)}" if restarts else ""
            print(f"megappo: {cause}; the other ranks were stopped{after}.", file=sys.stderr, flush=True)
            return code
        restarts += 1
        print(f"megappo: {cause}; the other ranks were stopped; restart {restarts} of {max_restarts}: every rank "
              "starts again from the latest checkpoint.", file=sys.stderr, flush=True)
        if on_restart is not None:
            on_restart(Restart(restarts, max_restarts, rank, exitcode,
                               signal.Signals(-exitcode).name if exitcode < 0 else None, cause))
        if restarts == 1:
            argv = [*argv, *restart_args]


def _attempt(argv: list[str], fork: tuple[RankFork, tuple[str, ...]] | None, fresh_level: int
             ) -> tuple[int, tuple[int, int] | None]:
    """One torchrun of ARGV: (exit code, (rank, its exit code) when a rank's death or a timed-out
    collective ended it, so that a restart may help; None otherwise). Every process the ranks
    started is gone when it returns. `fork`: see torchrun; `fresh_level`: the level of torch's elastic
    logger before the launcher silenced it (a forked rank's)."""

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import parse_args, run

    from megappo.parallel.interrupts import Forwarder, exit_code

    # torchrun's own report of a failure is a traceback of itself; the line below replaces it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # SIGINT / SIGTERM are the Forwarder's, not torchrun's (which would raise them as a traceback;
    # a torch without --signals-to-handle still does, and the SignalException below is caught)
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        argv = ["--signals-to-handle", "SIGHUP,SIGQUIT", *argv]
    args = parse_args(argv)
    starting = forked_ranks(fork[0], fork[1], fresh_level) if fork is not None else contextlib.nullcontext()
    with Forwarder() as signals, _RankGroups(), loopback_rendezvous(), _frame_names(), starting:
        try:
            run(args)
        except ChildFailedError as e:
            return _failed(e, signals)
        except KeyboardInterrupt:  # a signal before any rank was started
            print("megappo: interrupted", file=sys.stderr, flush=True)
            return signals.exit_code or exit_code(signal.SIGINT), None
        except SignalException as e:  # torchrun forwarded the signal to the ranks and stopped them
            return exit_code(e.sigval), None
    return 0, None


@contextlib.contextmanager
def _frame_names():
    """While entered, the rendezvous names its events' methods from the frame (sys._getframe) instead of
    `inspect.stack()`, which reads the source of every frame and scans every imported module for each:
    seconds per launch once the ranks' modules are imported here (megappo.parallel.fork)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth=2):
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    real = dynamic_rendezvous.get_method_name
    dynamic_rendezvous.get_method_name = get_method_name
    try:
        yield
    finally:
        dynamic_rendezvous.get_method_name = real


class _RankGroups:
    """While entered, notes the ranks this process starts (its children: torchrun's worker
    processes, each the leader of its own process group); on exit kills those groups, i.e.
    whatever the ranks started and left behind (a rank killed with SIGKILL cannot clean up)."""

    POLL_S = 0.05

    def __enter__(self) -> "_RankGroups":
        import psutil

        self._me, self._groups, self._done = psutil.Process(), set(), threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megappo-rank-groups", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        import psutil

        while not self._done.wait(self.POLL_S):
            for child in self._me.children():
                try:
                    if os.getpgid(child.pid) == child.pid:  # a rank in its own group (torchrun's start_new_session)
                        self._groups.add(child.pid)
                except (ProcessLookupError, psutil.Error):
                    pass

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        for group in self._groups:  # torchrun has reaped its ranks: a group left has only their children
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _failed(e, signals) -> tuple[int, tuple[int, int] | None]:
    """The exit code of ranks that failed or stopped on a signal, and the failure a restart may
    help (see _attempt); prints at most one line, when no restart is possible (torchrun prints
    the failure's)."""
    ended = {r: (f.exitcode, f.timestamp, rank_error(f.error_file_data)) for r, f in e.failures.items()}
    rank, code, error = cause(ended)
    if signals.stopped_at_once:
        print("megappo: interrupted again: the ranks were stopped at once, without a checkpoint of the step in "
              "progress; rerun the same command to continue from the latest checkpoint, if any.", file=sys.stderr,
              flush=True)
        return signals.exit_code, None
    if code in INTERRUPTED_EXITS or (signals.exit_code and code < 0):  # rank 0 said what was saved
        return signals.exit_code or code, None
    if _restartable(code):
        return (code if code > 0 else 1), (rank, code)
    line = final_line(rank, code, error, ended)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    return code if code > 0 else 1, None


def _describe(rank: int, exitcode: int) -> str:
    how = f"exited with code {exitcode}" if exitcode > 0 else f"was ended by signal {signal.Signals(-exitcode).name}"
    return f"rank {rank} failed ({how})"


def _restartable(exitcode: int) -> bool:
    """Whether the failure that ended an attempt may go away on a restart: a rank that died (a
    signal other than torchrun's SIGTERM to the survivors) or gave up on a collective."""
    return exitcode == GAVE_UP_EXIT or (exitcode < 0 and -exitcode != signal.SIGTERM)


def failure_rank_order(exitcode: int) -> int:
    """0 for a rank's own failure, 1 a signal that ended it, 2 a rank that gave up waiting for
    another or stopped on SIGINT / SIGTERM, 3 a rank torchrun stopped: the lowest is the cause."""
    if exitcode > 0:
        return 2 if exitcode in (GAVE_UP_EXIT, *INTERRUPTED_EXITS) else 0
    return 3 if -exitcode == signal.SIGTERM else 1
