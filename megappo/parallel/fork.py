"""Ranks forked from the launcher instead of started as fresh interpreters (`megappo train` on one machine).

A rank started by torchrun's agent as `python -u TARGET ARGS` spends seconds importing torch,
Megatron-Core and transformers, which the launcher (the `megappo train` process that runs the agent)
has mostly imported already for its own checks. `RankFork` lets that launcher import the rest once
(`preload`) and then have the agent fork each rank from itself (`forked_ranks`: torchrun's
SubprocessContext starts a `ForkedRank` where it would start a Popen), so that a rank starts with
every module in memory and runs TARGET (a script, or `-m` a module: runpy, as the interpreter runs it)
at once. The agent itself is unchanged: the same rendezvous, the same environment per rank, the same
error files, failures, SIGTERM / SIGKILL of survivors and restarts; a forked rank is a child of the
launcher in its own session, as torchrun's ranks are.

What a forked rank gets, against a fresh interpreter (`become_rank`):

| state | fresh `python -u TARGET ARGS` | forked rank |
|---|---|---|
| sys.argv, os.environ | the command, the agent's environment | set to the same |
| sys.path[0] | TARGET's folder (a script), the working directory (`-m`) | set to the same (the rest is the launcher's: PYTHONPATH, site) |
| /proc/PID/cmdline (ps) | `python -u TARGET ARGS` | the launcher's command line |
| /proc/PID/environ (ps, psutil) | that environment | the launcher's, with the rank's own variables written over the room the launcher made for them (`make_environ_room`) |
| stdout / stderr | unbuffered (`-u`) | replaced by unbuffered streams on fds 1 and 2 |
| signal handlers | Python's defaults | the launcher's (Forwarder, the agent's) reset to Python's defaults; no wakeup fd |
| process group | its own session (start_new_session) | its own session (setsid before the launcher goes on) |
| torch threads | OMP_NUM_THREADS | torch.set_num_threads(OMP_NUM_THREADS) |
| torch's default generator, random, numpy.random | seeded from the OS | reseeded from the OS |
| `__main__` | TARGET, run by the interpreter | TARGET, run by runpy (a new `__main__`) |
| other modules | imported as the rank goes | already imported, import-time warnings already shown (or not) |
| str hashes (PYTHONHASHSEED) | a seed of its own | the launcher's (the same in every rank) |
| the launcher's stack, threads | - | never run: the rank ends with os._exit after its threads and atexit handlers (`exit_as_interpreter`; megappo.parallel.launch.exit_rank) |

Forking is safe only from a process that runs no other thread (a lock held by one stays held in
the child: OpenMP's pool, tokenizers' rayon pool, a user's thread) and has not initialised CUDA:
`fork_blocker()` says what stands in the way, and the launcher starts fresh interpreters then. The
threads the launcher itself starts before forking (the agent's rendezvous timer and TCP store
server, megappo.parallel.launch's rank-group watcher) hold nothing a rank uses.

This module does not know about models, configs or the command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import random
import signal
import subprocess
import sys
import threading
from typing import Callable


@dataclasses.dataclass(frozen=True)
class RankFork:
    """How the launcher forks its ranks: `preload()` imports what every rank needs (called once, before the
    agent starts); each rank then runs the launcher's own program (its TARGET) with its arguments."""

    preload: Callable[[], None]


#: the signals make_environ_room holds while the process restarts
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: a variable the launcher starts with (make_environ_room) whose bytes a forked rank overwrites with its own variables
ENVIRON_ROOM = "MEGAPPO_ENVIRON_ROOM"
ENVIRON_ROOM_BYTES = 8192


def make_environ_room(argv: list[str]) -> None:
    """Restart this process (exec, before anything else is done) with ENVIRON_ROOM in its environment, unless it
    is there: what a process shows as its environment (/proc/PID/environ: ps, psutil, the tests that find a rank
    by its RANK) is the block the kernel was given at exec, and a forked rank writes its own variables over this
    room (show_environ). The variable leaves os.environ at once: no rank or child sees it. SIGINT and SIGTERM
    are held (blocked) through the exec until release_signals(). `argv`: this process's command line as it was
    started (sys.orig_argv)."""
    if ENVIRON_ROOM in os.environ:
        del os.environ[ENVIRON_ROOM]
        return
    if not sys.platform.startswith("linux"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)  # pending across the exec, not lost: release_signals
    try:
        os.execve(sys.executable, argv, {**os.environ, ENVIRON_ROOM: "." * ENVIRON_ROOM_BYTES})
    except OSError:
        release_signals()


def release_signals() -> None:
    """Deliver the SIGINT / SIGTERM held across make_environ_room's exec (a Ctrl-C then is not lost): call it
    where the command handles them."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)


def show_environ(env: dict[str, str], room_name: str = ENVIRON_ROOM) -> None:
    """Write the variables of `env` that the process's exec-time environment lacks (or has with another value)
    over the bytes of the variable `room_name` (ENVIRON_ROOM) in that block, so that /proc/PID/environ shows them
    (a later entry wins for a reader); nothing when there is no room or it is too small. What is left of the room
    stays a variable of that name (dots), never a run of NULs: a reader such as psutil stops at an empty entry,
    and the entries after the room (another room, for a fork of this process) stay readable. The other bytes
    stay: a library may hold a pointer to them (getenv)."""
    import ctypes

    try:
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
        with open("/proc/self/stat") as f:
            stat = f.read()
    except OSError:
        return
    start = block.find(f"{room_name}=".encode())
    if start < 0 or (start and block[start - 1] != 0):
        return
    room = block.index(b"\0", start) - start  # the entry's bytes, its NUL kept
    shown = {}
    for entry in block.split(b"\0"):
        key, _, value = entry.decode(errors="replace").partition("=")
        shown[key] = value
    extra = "".join(f"{k}={v}\0" for k, v in env.items() if shown.get(k) != v).encode()
    left = f"{room_name}=".encode()
    if len(extra) + len(left) > room:
        return
    env_start = int(stat[stat.rindex(")") + 2:].split()[47])  # field 50 of proc(5): env_start
    ctypes.memmove(env_start + start, extra + left + b"." * (room - len(extra) - len(left)), room)


def fork_blocker() -> str | None:
    """Why this process cannot fork its ranks (None: it can): another thread runs, or CUDA is initialised."""
    if not sys.platform.startswith("linux"):
        return f"fork-started ranks need Linux, this is {sys.platform}"
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1 or threading.active_count() > 1:
        return f"this process runs {threads} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "this process has initialised CUDA"
    with open("/proc/self/maps") as maps:  # the driver, loaded by any CUDA call (a device count too)
        if any("libcuda.so" in line for line in maps):
            return "this process has loaded the CUDA driver"
    return None


class ForkedRank(subprocess.Popen):
    """A Popen whose child is a fork of this process running `args` in itself (see the module docstring)
    instead of an exec of them: pid, poll, wait and signals are Popen's. `args` is the command a fresh rank
    would run (`python -u TARGET ARGS...`), `env` its whole environment, `target` the TARGET part of it
    (`-m MODULE` or a script)."""

    def __init__(self, args: tuple[str, ...], env: dict[str, str], target: tuple[str, ...], elastic_log_level: int):
        self._rank = (target, elastic_log_level)
        super().__init__(list(args), env=env, start_new_session=True)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *unused):
        def rank() -> int:
            become_rank(list(args), env, *self._rank)
            return run_as_main(self._rank[0])

        self.pid, self._child_created = fork_child(rank), True


def fork_child(body: Callable[[], int | None], new_session: bool = True) -> int:
    """Fork a child that runs `body()` and ends as the interpreter ends, with its return value as the exit code
    (1 when body raises; it never returns into this process's frames); return the child's pid once the child has
    its own session (`new_session`: before this process may signal its group, torchrun's killpg, as Popen's
    start_new_session) or has died."""
    ready_r, ready_w = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        stream.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            if new_session:
                os.setsid()
            os.close(ready_w)
            exit_as_interpreter(body())
        finally:
            os._exit(1)
    os.close(ready_w)
    os.read(ready_r, 1)  # EOF once the child has its session (or has died)
    os.close(ready_r)
    return pid


def become_rank(args: list[str], env: dict[str, str], target: tuple[str, ...], elastic_log_level: int,
                show: bool = True) -> None:
    """This forked process's state as a fresh `python -u TARGET ARGS` would have it (the module's table).
    `show=False`: /proc/PID/environ keeps the exec-time block as it is (its room stays for forks of this
    process)."""
    import logging

    for signum in signal.valid_signals():
        try:
            if callable(signal.getsignal(signum)) and signum != signal.SIGINT:
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    os.environ.clear()
    os.environ.update(env)
    if show:
        show_environ(env)
    start = next(i for i in range(len(args)) if tuple(args[i:i + len(target)]) == target) + len(target)
    sys.argv = [target[-1], *args[start:]]  # runpy sets argv[0] as the interpreter does
    # sys.path[0] as the interpreter sets it: the script's folder, or the working directory under -m
    sys.path[0] = os.getcwd() if target[0] == "-m" else os.path.dirname(os.path.realpath(target[0]))
    for fd, name in ((1, "stdout"), (2, "stderr")):  # python -u
        old = getattr(sys, name)
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                                  write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    logging.getLogger("torch.distributed.elastic").setLevel(elastic_log_level)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # a fresh process's default generator starts from a seed of its own
        if env.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def run_as_main(target: tuple[str, ...]) -> int:
    """The exit code of running `target` (`-m MODULE`, or a script) as `__main__`, as the interpreter runs it:
    0 when it returns, SystemExit's code, an uncaught exception's traceback and 1."""
    import runpy

    try:
        if target[0] == "-m":
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr, flush=True)
        return 1
    except BaseException as e:
        tb = e.__traceback__  # from TARGET's own frames, as the interpreter shows it: not this one's, not runpy's
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        if tb is not None:
            e.__traceback__ = tb
        sys.excepthook(type(e), e, e.__traceback__)
        return 1


def exit_as_interpreter(code: int | None) -> None:
    """End this process as the interpreter ends a program, without its teardown (seconds of it, and nothing a
    fork needs): threading's shutdown (its atexit calls first: a concurrent.futures pool left open ends its
    workers there, then non-daemon threads joined), output flushed, atexit handlers run (multiprocessing's
    among them: a Manager's server process ends with its owner), then os._exit(code)."""
    import atexit

    threading._shutdown()  # what the interpreter calls first at exit (Py_FinalizeEx -> wait_for_thread_shutdown)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


@contextlib.contextmanager
def forked_ranks(fork: RankFork, target: tuple[str, ...], elastic_log_level: int):
    """While entered, torchrun's agent in this process starts its ranks with ForkedRank: `target` is the
    part of a rank's command before its arguments (`-m megappo.cli` or the script), `elastic_log_level` the
    level of torch.distributed.elastic's logger a fresh rank has."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class Handler(SubprocessHandler):
        def _popen(self, args, env):
            return ForkedRank(args, env, target, elastic_log_level)

    def handler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options=None):
        return Handler(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                       local_rank_id=local_rank_id, numa_options=numa_options)

    real = api.get_subprocess_handler
    api.get_subprocess_handler = handler
    try:
        yield
    finally:
        api.get_subprocess_handler = real
