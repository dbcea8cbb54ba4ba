"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (SLURM before a time limit, `kill PID`):
this process's handlers for the two signals, the stop they request, and its exit code.

A rank (`install()`): the first signal only records a request; the training loop asks the
ranks whether any of them has one (`agree`, a collective all of them reach once per step,
so no rank is left waiting in another collective) and stops at that step boundary with a
checkpoint (megappo.trainer.setup). Signals within `REPEAT_WINDOW_S` of the first count as the same
request: SLURM signals every process of a job step and the launcher forwards its own copy. A
later signal ends the process at once with one line at most (rank 0's), from a watcher thread
woken by the signal's wakeup byte, so that it works even while the main thread is blocked in
a collective, where Python signal handlers do not run. A SIGTERM that comes after another rank
of the same launcher ended is torchrun stopping the survivors of a failure: it ends the process
at once, as it would without these handlers. A rank started by a launcher asks the kernel for a
SIGTERM when the launcher dies (PR_SET_PDEATHSIG, Linux); with the launcher gone (killed with
SIGKILL: it could not stop anything) the rank ends at once with its process group, i.e. with the
processes it started (the multiprocessing children of a checkpoint save), instead of training
on without it.

The launcher (`Forwarder`): the ranks run in their own sessions, so a terminal's Ctrl-C
reaches only the launcher. The first signal is forwarded to the ranks; a second one kills
them at once (SIGKILL). A signal that comes before any rank was started stops the launcher
(KeyboardInterrupt).

Every stop exits with 128 + the signal number: 130 for SIGINT, 143 for SIGTERM, as a shell
reports a process the signal ended.

This module does not know about models, checkpoints or the training loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: a signal within this many seconds of the first is the same request (two senders), not a second one
REPEAT_WINDOW_S = 1.0


def exit_code(signum: int) -> int:
    return 128 + signum


class Interrupted(Exception):
    """Every rank stopped at a step boundary on a signal; the message says what was saved."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


_lock = threading.RLock()  # the handler may run again inside itself
_request = {"signum": 0, "at": 0.0}
_installed: dict = {}
_launcher = {"pid": 0}  # the launcher that started this rank (install's local_ranks > 1), else 0


@contextlib.contextmanager
def held_during_start_up():
    """SIGINT arriving inside the block is held and raised as KeyboardInterrupt when the block
    ends (in Python code, where it unwinds cleanly). Start-up imports torch and other C++
    extensions: a KeyboardInterrupt raised while C++ code is calling back into Python cannot
    unwind through it, and the process aborts (`terminate called after throwing an instance of
    'pybind11::error_already_set'`, exit -6) or dies by the signal (-2) instead of exiting 130."""
    held: list[int] = []
    try:
        old = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    except ValueError:  # not the main thread: nothing to guard
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if held:
        raise KeyboardInterrupt


def requested() -> int:
    """The signal this process received (0: none)."""
    return _request["signum"]


def _record(signum: int) -> bool:
    """Record a delivery of `signum`; True when it is a second request (stop at once)."""
    with _lock:
        if not _request["signum"]:
            _request.update(signum=signum, at=time.monotonic())
            return False
        return time.monotonic() - _request["at"] > REPEAT_WINDOW_S


def install(announce: bool, local_ranks: int = 1) -> None:
    """Handle SIGINT and SIGTERM in this rank as described above (main thread only).
    `announce`: this rank prints the acknowledgement and the line of an immediate stop (rank 0).
    `local_ranks`: the ranks its launcher started (torchrun's LOCAL_WORLD_SIZE), see _peer_gone."""
    if _installed:
        return
    _launcher["pid"] = os.getppid() if local_ranks > 1 else 0
    if _launcher["pid"]:
        _signal_on_parent_death(signal.SIGTERM)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    # the handler itself only records the first request; it runs when the main thread is free
    for s in SIGNALS:
        signal.signal(s, lambda signum, frame: _record(signum) and None)
    _installed.update(old_fd=old_fd, sockets=(reader, writer))
    threading.Thread(target=_watch, args=(reader, announce, local_ranks), name="megappo-interrupts",
                     daemon=True).start()


def _watch(reader: socket.socket, announce: bool, local_ranks: int) -> None:
    acknowledged = False
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum not in SIGNALS:
                continue
            name = signal.Signals(signum).name
            if signum == signal.SIGTERM and _launcher["pid"] and os.getppid() != _launcher["pid"]:
                _die_with_group()  # the launcher died (PR_SET_PDEATHSIG)
            if signum == signal.SIGTERM and _peer_gone(local_ranks):
                _die_by(signum)
            if _record(signum):
                if announce:
                    _say(f"interrupted again ({name}): stopped at once, without a checkpoint of the step in "
                         "progress; rerun the same command to continue from the latest checkpoint, if any.")
                os._exit(exit_code(_request["signum"]))
            if announce and not acknowledged:
                _say(f"{name} received: stopping after the step in progress, with a checkpoint; send it again "
                     "to stop at once.")
                acknowledged = True


def _peer_gone(local_ranks: int) -> bool:
    """Whether a rank started by the same launcher has ended: then a SIGTERM is torchrun stopping
    the others after that failure (its SIGTERM, 30 s before SIGKILL), not a request to save."""
    if local_ranks <= 1:
        return False
    import psutil

    try:
        peers = psutil.Process(_launcher["pid"]).children()
        return sum(p.status() != psutil.STATUS_ZOMBIE for p in peers) < local_ranks
    except psutil.Error:
        return True  # the launcher itself is gone


def _signal_on_parent_death(signum: int) -> None:
    """Have the kernel send `signum` to this process when its parent (the launcher) ends (Linux)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != _launcher["pid"]:  # it ended before the request
        os.kill(os.getpid(), signum)


def _die_with_group() -> None:
    """End this rank and the processes it started: its process group, when it leads one (torchrun
    starts each rank in its own session), else this process alone."""
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _die_by(signum: int) -> None:
    """End this process by `signum`'s default action, as if no handler were installed (from any
    thread: Python lets only the main thread set handlers, libc does not)."""
    import ctypes

    ctypes.CDLL(None).signal(signum, 0)  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(1)
    os._exit(exit_code(signum))


def _say(line: str) -> None:
    # not print: the main thread may hold sys.stderr's lock; on a terminal, clear the live progress
    # bar's line first (it has no newline), so the message does not run on after it
    start = "\r\x1b[K" if os.isatty(2) else ""
    os.write(2, f"{start}megappo: {line}\n".encode())


def uninstall() -> None:
    """Back to the default handlers (the stop is under way: a later signal just ends the process)."""
    if not _installed:
        return
    for s in SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    signal.set_wakeup_fd(_installed["old_fd"])
    reader, writer = _installed["sockets"]
    reader.shutdown(socket.SHUT_RDWR)  # wakes the watcher, which returns
    reader.close()
    writer.close()
    _installed.clear()


def agree(device) -> int:
    """Collective over the world group: the signal any rank received (0: none; the largest
    number when they differ)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([requested()], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


class Forwarder:
    """The launcher's SIGINT/SIGTERM handlers while its ranks run (a context manager):
    the first signal goes on to the ranks, a second one kills them."""

    def __init__(self):
        self.signals: list[int] = []
        self._old: dict = {}

    def __enter__(self) -> "Forwarder":
        import psutil

        self._me = psutil.Process()
        self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    @property
    def exit_code(self) -> int | None:
        """128 + the first signal, None when there was none."""
        return exit_code(self.signals[0]) if self.signals else None

    @property
    def stopped_at_once(self) -> bool:
        return len(self.signals) > 1

    def _handle(self, signum: int, frame) -> None:
        import psutil

        self.signals.append(signum)
        ranks = self._me.children()
        if not ranks:  # none started yet: nothing to forward to, the launcher stops
            raise KeyboardInterrupt
        for rank in ranks:
            try:
                rank.send_signal(signal.SIGKILL if self.stopped_at_once else signum)
            except psutil.NoSuchProcess:
                pass
