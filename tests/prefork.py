"""Python commands of the tests started as forks of a process that has imported torch, Megatron-Core,
transformers and megappo already, instead of as fresh interpreters that import them again.

A test that runs `python -m megappo.cli train ...` (or a tools/ script, or torchrun on a worker script)
spends most of a short run importing: 8-10 s of torch, Megatron-Core and transformers on the 2-core
machine, per launcher and, under torchrun, per rank. `run` and `popen` take subprocess.run's and Popen's
arguments and, for a command this module can start (`eligible`), have a server process fork it instead:
the server imported those modules once (`preload`, megappo train's own list), and each fork becomes the
command as megappo's launcher makes a forked rank a fresh `python -u TARGET ARGS`
(megappo.parallel.fork.become_rank: argv, sys.path, environment, signals, streams, seeds, threads), runs
TARGET as `__main__` and ends as the interpreter ends (exit_as_interpreter). Under
`-m torch.distributed.run SCRIPT`, the agent in the fork forks its ranks too (megappo.parallel.fork's
forked_ranks), as `megappo train` does. Everything the command does after its imports is the real code.

What differs from a fresh interpreter, and why the tests that see it start fresh ones (subprocess):
- /proc/PID/cmdline is the server's (`ps` shows the server's command; /proc/PID/environ shows the command's
  variables, written over room the server started with, as megappo.parallel.fork does for a rank),
- import-time warnings were shown (or not) once, in the server,
- stdout and stderr are unbuffered (as `python -u`),
- modules are those the server imported: a command whose PYTHONPATH or working directory would import
  megappo from another tree, whose PYTHONPATH holds a sitecustomize, or that sets a PYTHON* variable (hash
  seed, warnings, fault handler), starts fresh (`eligible`),
- start-up takes a fraction of a second: a test that acts during a fresh interpreter's imports starts one.
`MEGAPPO_TEST_FRESH=1` starts every command fresh (what a fresh interpreter finds, with the same tests).
The tests that look at what a fresh interpreter shows (the console, the launcher scripts, install, the
forked ranks against fresh ones) call subprocess themselves.

One server per pytest process (an xdist worker has its own), started at the first eligible command and
stopped when pytest exits; a server that cannot start or cannot fork (`fork_blocker`) leaves every
command fresh. This module does not know about the tests that use it.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the variables a fresh interpreter reads at start-up that a fork cannot take on (PYTHONPATH is handled)
STARTUP_VARS = ("PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "PYTHONDEVMODE", "PYTHONMALLOC",
                "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PYTHONOPTIMIZE", "PYTHONINSPECT",
                "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONSTARTUP", "PYTHONTRACEMALLOC", "PYTHONPROFILEIMPORTTIME",
                "PYTHONBREAKPOINT", "PYTHONWARNDEFAULTENCODING", "PYTHONINTMAXSTRDIGITS")
#: the modules a fresh interpreter runs at start-up from its path (site), which a fork has not run
STARTUP_MODULES = ("sitecustomize", "usercustomize")
#: a variable of the server's environment whose bytes a command overwrites with its own variables, so that
#: /proc/PID/environ (ps, psutil: the tests that find a run's processes by a variable) shows them
PREFORK_ROOM, PREFORK_ROOM_BYTES = "MEGAPPO_TEST_PREFORK_ROOM", 16384
#: the model families whose transformers code the server imports (the tests' tiny models)
MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


# ---------------------------------------------------------------------------------------------- client side

def run(cmd, *, input=None, timeout=None, check=False, capture_output=False, **kwargs):
    """subprocess.run(cmd, ...) for a Python command, started as a fork of the server when `eligible`."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with popen(cmd, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            kill_tree(process.pid)
            e.output, e.stderr = process.communicate()
            raise
        except BaseException:
            kill_tree(process.pid)
            raise
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, cmd, stdout, stderr)
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process it started. A timed-out torchrun's ranks lead sessions of their own and
    outlive their agent, holding the pipes its output is read from: killing the agent alone would leave the
    read waiting for them."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def popen(cmd, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False, start_new_session=False,
          **other):
    """subprocess.Popen(cmd, ...) for a Python command: a `Forked` started by the server when `eligible`, else
    subprocess's own."""
    server = _server() if not other and eligible(cmd, env, cwd) else None
    if server is None:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session, **other)
    return Forked(server, cmd, env, cwd, (stdin, stdout, stderr), text, start_new_session)


class Forked:
    """What subprocess.Popen offers the tests (pid, stdin / stdout / stderr, poll, wait, communicate, signals,
    returncode, a context manager) for a command the server forked; its exit code comes over a socket."""

    def __init__(self, server, cmd, env, cwd, streams, text: bool, start_new_session: bool = False):
        self.args, self.text, self.returncode = cmd, text, None
        ours, theirs = {}, []
        for i, (name, given) in enumerate(zip(("stdin", "stdout", "stderr"), streams)):
            if given == subprocess.PIPE:
                r, w = os.pipe()
                ours[name], child = (w, r) if name == "stdin" else (r, w)
                theirs.append(child)
            elif given == subprocess.STDOUT:
                theirs.append(os.dup(theirs[1]))
            elif given == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_RDWR))
            else:
                theirs.append(os.dup(i if given is None else given if isinstance(given, int) else given.fileno()))
        request = {"argv": list(map(str, cmd[1:])), "env": dict(os.environ if env is None else env),
                   "cwd": os.path.abspath(cwd or os.getcwd()), "new_session": start_new_session}
        try:
            self._sock, self.pid = server.start(request, theirs)
        finally:
            for fd in theirs:
                os.close(fd)
        mode = {"stdin": "wb", "stdout": "rb", "stderr": "rb"}
        for name in ("stdin", "stdout", "stderr"):
            f = None
            if name in ours:
                f = open(ours[name], mode[name], buffering=0 if name == "stdin" else -1)
                if text:
                    f = io.TextIOWrapper(f, write_through=True) if name == "stdin" else io.TextIOWrapper(f)
            setattr(self, name, f)
        self._readers, self._read = [], {}

    def poll(self):
        if self.returncode is None:
            self._sock.setblocking(False)
            try:
                self._finish(self._sock.recv(64))
            except BlockingIOError:
                pass
            finally:
                if self.returncode is None:
                    self._sock.setblocking(True)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self._sock.settimeout(timeout)
            try:
                self._finish(self._sock.recv(64))
            except socket.timeout:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def _finish(self, data: bytes) -> None:
        while not data.endswith(b"\n"):  # the server sends one line, written once: the rest follows at once
            self._sock.settimeout(None)
            chunk = self._sock.recv(64)
            if not chunk:
                raise RuntimeError("tests/prefork.py: the server died while a command ran")
            data += chunk
        self.returncode = int(data)
        self._sock.close()

    def communicate(self, input=None, timeout=None):
        if not self._readers:
            if self.stdin is not None:
                threading.Thread(target=_feed, args=(self.stdin, input), daemon=True).start()
            for name in ("stdout", "stderr"):
                f = getattr(self, name)
                if f is not None:
                    self._read[name] = []
                    self._readers.append(threading.Thread(target=_drain, args=(f, self._read[name]), daemon=True))
                    self._readers[-1].start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        empty = "" if self.text else b""
        return tuple(empty.join(self._read[n]) if n in self._read else None for n in ("stdout", "stderr"))

    def send_signal(self, signum):
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self.wait()


def eligible(cmd, env=None, cwd=None) -> bool:
    """Whether `run` may start `cmd` as a fork of the server: `python [-u] -m MODULE ...` or `python [-u]
    SCRIPT ...` with this interpreter, OMP_NUM_THREADS set (the server's torch runs one thread), no PYTHON*
    start-up variable other than the server's, and megappo found in this checkout first (the server's), as
    the fresh interpreter would find it."""
    if os.environ.get("MEGAPPO_TEST_FRESH") == "1" or not sys.platform.startswith("linux"):
        return False
    cmd = list(map(str, cmd))
    if len(cmd) < 2 or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return False
    rest = cmd[2:] if cmd[1] == "-u" else cmd[1:]
    if not rest or (rest[0].startswith("-") and rest[0] != "-m") or (rest[0] == "-m" and len(rest) < 2):
        return False
    env = os.environ if env is None else env
    if not env.get("OMP_NUM_THREADS", "").isdigit():  # the server's torch has one thread; a fresh one sizes its own
        return False
    if any(env.get(k) != _SERVER_ENV.get(k) for k in STARTUP_VARS):
        return False
    cwd = os.path.abspath(cwd or os.getcwd())
    python_path = [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if any(os.path.exists(os.path.join(p, f"{name}.py")) for p in python_path for name in STARTUP_MODULES):
        return False
    first = cwd if rest[0] == "-m" else os.path.dirname(os.path.realpath(os.path.join(cwd, rest[0])))
    for entry in [first, *python_path]:
        if os.path.isdir(os.path.join(entry, "megappo")):
            return os.path.realpath(entry) == os.path.realpath(REPO)
    return False  # megappo from the installed package: the install may point at another checkout


def _drain(f, chunks: list) -> None:
    while chunk := f.read(65536):
        chunks.append(chunk)


def _feed(f, data) -> None:
    try:
        if data:
            f.write(data)
        f.close()
    except BrokenPipeError:
        pass


#: this process's environment when the module was imported: the server's (STARTUP_VARS are compared with it)
_SERVER_ENV = dict(os.environ, OMP_NUM_THREADS="1")


class _Server:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="megappo-prefork-")
        self.path = os.path.join(self.dir, "sock")
        env = dict(_SERVER_ENV, PYTHONPATH=REPO + os.pathsep + _SERVER_ENV.get("PYTHONPATH", ""))
        from megappo.parallel.fork import ENVIRON_ROOM, ENVIRON_ROOM_BYTES

        env[PREFORK_ROOM] = "." * PREFORK_ROOM_BYTES  # room for a command's own variables (`_become`)
        env[ENVIRON_ROOM] = "." * ENVIRON_ROOM_BYTES  # and then for its forked ranks' (megappo.parallel.fork)
        self.log = os.path.join(self.dir, "server.log")
        with open(self.log, "w") as log:  # the server detaches: a test's process-tree kill (SGLang's) misses it
            starter = subprocess.Popen([sys.executable, "-m", "tests.prefork", self.path, str(os.getpid())], env=env,
                                       cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True)
        self.said = starter.stdout.readline().split()
        starter.stdout.close()
        starter.wait()
        self.pid = int(self.said[1]) if self.said[:1] == ["ready"] else None

    def start(self, request: dict, fds: list[int]) -> tuple[socket.socket, int]:
        """Have the server fork `request` with `fds` as its stdin, stdout and stderr: (the socket its exit code
        comes over, its pid)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.path)
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], fds)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(64)
            if not chunk:
                raise RuntimeError("the test prefork server refused a command")
            data += chunk
        return sock, int(data)

    def alive(self) -> bool:
        return _alive(self.pid)

    def stop(self):
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


_SERVERS: dict[int, _Server | None] = {}


def _server() -> _Server | None:
    """This process's server (started at the first call, again if it died), None when it could not start."""
    pid = os.getpid()
    if pid in _SERVERS and _SERVERS[pid] is not None and not _SERVERS[pid].alive():
        _SERVERS.pop(pid).stop()
    if pid not in _SERVERS:
        server = _Server()
        if server.pid is None:
            with open(server.log) as log:
                why = (" ".join(server.said) + " " + log.read()).strip()[-2000:]
            print(f"tests/prefork.py: the server did not start ({why}); commands start fresh", file=sys.stderr)
            server.stop()
            server = None
        else:
            atexit.register(server.stop)
        _SERVERS[pid] = server
    return _SERVERS[pid]


# ---------------------------------------------------------------------------------------------- server side

def preload() -> None:
    """Import what the commands import: megappo train's rank modules (megappo.cli), the models' families,
    torchrun's agent, the CLI and its tools."""
    import warnings

    from megappo import cli

    for model_type in MODEL_TYPES:
        cli._import_rank_modules(model_type)
    with warnings.catch_warnings(action="ignore"):
        import torch.distributed.run  # noqa: F401

        import megappo.parallel.launch  # noqa: F401
        import megappo.plan.planner  # noqa: F401


def serve(path: str, owner: int) -> None:
    """Accept commands on the Unix socket `path`, fork each, report its exit code; end with the process `owner`
    (the pytest process). The server detaches first (its parent exits, it has a session of its own), so that a
    test killing its own process tree leaves it running."""
    import logging

    from megappo.parallel.fork import fork_blocker, fork_child

    if os.fork():
        os._exit(0)
    os.setsid()
    preload()
    elastic_level = logging.getLogger("torch.distributed.elastic").getEffectiveLevel()
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    blocker = fork_blocker()
    print(f"ready {os.getpid()}" if blocker is None else f"cannot fork: {blocker}", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)  # the pipe to the starter closes; fd 1 stays taken
    os.dup2(devnull, 1)
    os.close(devnull)
    if blocker is not None:
        return
    running: dict[int, socket.socket] = {}
    while _alive(owner):
        ready, _, _ = select.select([listener, *running.values()], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
                while not msg.endswith(b"\n"):
                    msg += conn.recv(1 << 22)
                request = json.loads(msg)

                def command(conn=conn, request=request, fds=fds) -> int:
                    listener.close()
                    for other in (conn, *running.values()):
                        other.close()
                    return _become(request, fds, base_path, elastic_level)

                pid = fork_child(command, new_session=request["new_session"])
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                running[pid] = conn
            else:  # the test closed its end (it ended): its command goes too
                pid = next(p for p, s in running.items() if s is sock)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
    for pid in running:
        os.kill(pid, signal.SIGKILL)


def _become(request: dict, fds: list[int], base_path: list[str], elastic_level: int) -> int:
    """In the fork: become `python -u ARGV...` in the request's directory and environment, run it, return its
    exit code (megappo.parallel.fork.become_rank and run_as_main, as a forked rank of megappo train; fork_child
    ends the process as the interpreter would)."""
    from megappo.parallel.fork import (ENVIRON_ROOM, ENVIRON_ROOM_BYTES, RankFork, become_rank, forked_ranks, run_as_main,
                                      show_environ)

    for target_fd, fd in enumerate(fds):
        os.dup2(fd, target_fd)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    argv, env = request["argv"], request["env"]
    os.chdir(request["cwd"])
    rest = argv[1:] if argv[0] == "-u" else argv
    target = tuple(rest[:2]) if rest[0] == "-m" else (rest[0],)
    python_path = [os.path.join(request["cwd"], p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:] = [*python_path, *base_path]  # sys.path[0]: become_rank's, as the interpreter sets it
    env = dict(env)
    if target == ("-m", "megappo.cli"):  # the launcher finds the room its forked ranks write their variables over
        env[ENVIRON_ROOM] = "." * ENVIRON_ROOM_BYTES
    become_rank(["python", "-u", *rest], env, target, elastic_level, show=False)
    show_environ(request["env"], PREFORK_ROOM)  # ps sees the command's variables; ENVIRON_ROOM stays for its ranks
    sys.orig_argv = [sys.executable, *argv]
    if target[0] == "-m":  # a fresh interpreter imports the module only as __main__ (the server imported megappo.cli)
        sys.modules.pop(target[1], None)
    if target == ("-m", "torch.distributed.run"):  # the agent forks its ranks (a script: torchrun's TARGET)
        script = next((a for a in rest[2:] if not a.startswith("-") and a.endswith(".py")), None)
        if script is not None:
            with forked_ranks(RankFork(preload=lambda: None), (script,), elastic_level):
                return run_as_main(target)
    return run_as_main(target)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is pytest's to handle
    serve(sys.argv[1], int(sys.argv[2]))
