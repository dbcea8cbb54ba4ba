"""One run per directory: the lock `megappo.lock` in run.output_dir (and checkpoint.dir).

`acquire` is called by the process that owns the whole run, before anything of the run is
written: the `megappo train` that launches the ranks (torchrun in-process launcher, Ray
driver), or global rank 0 when an outside launcher (torchrun, SLURM's srun) started the
ranks. It takes `fcntl.flock` on an open descriptor of the lock file, so the OS releases it
when the process ends in any way (a crash, SIGKILL); `RunLock.release` (normal end, an
exception, an interrupt) removes the file too. The file holds the holder's PID, host, start
time and a token; the token is exported as `MEGAPPO_RUN_LOCK` so the ranks a launcher starts
(and restarts, run.max_restarts) recognise the lock as their own launcher's instead of
refusing. A file whose lock is free was left by a process that died: it is taken, with
one line saying so. flock works on local filesystems and on NFS (Linux emulates it with
POSIX locks there).

This module does not know about models, training or how ranks are launched.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
import uuid

from megappo.errors import ConfigError

LOCK_FILE = "megappo.lock"
#: set by the process that holds the lock, read by the ranks it starts
TOKEN_ENV = "MEGAPPO_RUN_LOCK"


class RunLocked(ConfigError):
    """Another live run holds the directory."""


class RunLock:
    """The locks this process took (none when its launcher holds them). A context manager."""

    def __init__(self, held: list[tuple[str, int]], token: str | None = None, created: list[str] | None = None):
        self.held, self.token, self.created = held, token, created or []

    def release(self) -> None:
        if self.token is not None and os.environ.get(TOKEN_ENV) == self.token:
            del os.environ[TOKEN_ENV]
        while self.held:
            path, fd = self.held.pop()
            try:
                os.unlink(path)  # while still locked: nobody can take a file that is about to vanish
            except FileNotFoundError:
                pass
            os.close(fd)
        for directory in reversed(self.created):  # made for the lock and still empty: a refused run leaves nothing
            try:
                os.rmdir(directory)
            except OSError:
                pass
        self.created = []

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def _describe(holder: dict) -> str:
    return (f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
            f"{holder.get('started', '?')}")


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 1 << 16)
    try:
        return json.loads(data) if data.strip() else {}
    except ValueError:
        return {"pid": "?", "host": "?", "started": "? (unreadable lock file)"}


def _take(path: str) -> int | None:
    """An open descriptor of `path` holding its flock, or None when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:  # the holder may have released and removed it between our open and flock: lock the file that is there
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _holder(path: str) -> dict:
    try:
        with open(path) as f:
            return json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}


def acquire(dirs: list[str], *, what: str = "run.output_dir") -> RunLock:
    """Lock each of `dirs` (created when missing) for this run; raises RunLocked naming the
    holder when a live run holds one. A lock held by the launcher of this process (its token in
    MEGAPPO_RUN_LOCK) counts as this run's."""
    token = os.environ.get(TOKEN_ENV)
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "token": uuid.uuid4().hex}
    held: list[tuple[str, int]] = []
    created: list[str] = []  # directories made here, outermost first
    unique = list(dict.fromkeys(os.path.realpath(d) for d in dirs))
    try:
        for directory in unique:
            created += _missing(directory)
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, LOCK_FILE)
            fd = _take(path)
            if fd is None:
                holder = _holder(path)
                if token and holder.get("token") == token:
                    continue  # our launcher's: this process is one of the ranks it started
                raise RunLocked(f"{directory} is in use by another megappo run ({_describe(holder)}; lock {path}). "
                                f"Fix: wait for that run to end, or choose another {what}.")
            old = _read(fd)
            if old:
                print(f"megappo: {path} was left by a run that is gone ({_describe(old)}): a stale lock, taken.",
                      file=sys.stderr, flush=True)
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(record).encode())
            os.fsync(fd)
            held.append((path, fd))
    except BaseException:
        RunLock(held, created=created).release()
        raise
    if not held:
        return RunLock([])
    os.environ[TOKEN_ENV] = record["token"]  # inherited by the ranks this process launches
    return RunLock(held, record["token"], created)


def _missing(directory: str) -> list[str]:
    """The directories `os.makedirs(directory)` would create, outermost first."""
    missing = []
    while directory and not os.path.exists(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return missing[::-1]
