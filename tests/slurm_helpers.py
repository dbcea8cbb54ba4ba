"""A real SLURM cluster of one node (or `nodes=2`: two) on this machine, for the tests: munged,
slurmctld and slurmd started in the foreground from a private directory (their own munge key and
socket, slurm.conf, cgroup.conf, state, spool and logs; free ports), and stopped again. Several
nodes are several slurmds on this host (`slurmd -N NAME`; Debian's slurmd is built with
--enable-multiple-slurmd), each with its own port, pid file, spool and log (slurm.conf's %n); the
first node is this machine's host name, the others NAME-2, ..., all at NodeAddr 127.0.0.1.

`LocalSlurm(root).start()` writes the configuration, starts the three daemons and waits until the
nodes are idle; `env()` is the environment for SLURM's client commands (SLURM_CONF), `sbatch`,
`job` (JobState and ExitCode from `scontrol show job`), `wait_running`, `wait_done` and
`scancel` wrap them; `stop()` cancels what is left and ends the daemons it started (by their
process ids). The node has this machine's CPUs; SLURM's GPU scheduling is not configured, so a job
asks for `--gpus-per-node 0`. Process tracking is proctrack/linuxproc and task/none, so no cgroup
is needed: SLURM signals every process of a job step by walking the process tree.

`install_reason()` is None when SLURM can run here; otherwise why not, naming the fix. This module
installs nothing: `make test` installs PACKAGES first (tools/system_packages.py), so on a root machine
a missing binary means the suite was not started by `make test`, and the tests fail saying so
(`require_installed()`); not root, they skip.

This module does not know about megappo: it starts SLURM and nothing else.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
INSTALL = "apt-get install -y " + " ".join(PACKAGES)
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo")
#: job states after which a job does nothing more
DONE_STATES = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)),
                                      None)


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def not_root() -> bool:
    return os.name != "posix" or os.geteuid() != 0


def install_reason() -> str | None:
    """None when a local SLURM can be started here; else why not, with the fix."""
    if not_root():
        return "a local SLURM needs root (slurmd runs jobs as their user; SlurmUser=root here)"
    missing = missing_binaries()
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing). Fix: run the suite with `make test`, "
                f"which installs it (tools/system_packages.py), or install it yourself: {INSTALL}")
    return None


def require_installed() -> None:
    """For a fixture: skip when not root (SLURM cannot run), fail naming `make test` when a binary is missing."""
    import pytest

    reason = install_reason()
    if reason and not_root():
        pytest.skip(reason)
    if reason:
        pytest.fail(reason, pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    def __init__(self, root: str, cpus: int | None = None, kill_wait_s: int = 60, nodes: int = 1):
        self.root = os.path.abspath(root)
        self.node = socket.gethostname().split(".")[0]
        # the first node is this machine's name (it resolves: the sbatch script's rendezvous is on the
        # job's first node); the others are slurmds of their own on this host (`slurmd -N NAME`, Debian's
        # slurmd is built with --enable-multiple-slurmd), reached at 127.0.0.1 on ports of their own
        self.nodes = [self.node] + [f"{self.node}-{i + 1}" for i in range(1, nodes)]
        self.cpus = cpus or os.cpu_count() or 1
        self.kill_wait_s = kill_wait_s  # SIGTERM -> SIGKILL on scancel: time for the checkpoint
        self.procs: list[subprocess.Popen] = []
        self.conf = os.path.join(self.root, "slurm.conf")

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def env(self, base: dict | None = None) -> dict:
        return dict(base if base is not None else os.environ, SLURM_CONF=self.conf)

    def write_config(self) -> None:
        for d in ("state", "spool", "log"):
            os.makedirs(self.path(d), exist_ok=True)
        ctld_port, d_port = _free_port(), _free_port()
        if len(self.nodes) == 1:
            node_lines = f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN\n"
        else:  # several slurmds on this host: a port and a pid file, spool and log (%n: the node) each
            node_lines = "".join(f"NodeName={n} NodeHostname={self.node} NodeAddr=127.0.0.1 Port={_free_port()} "
                                 f"CPUs={self.cpus} State=UNKNOWN\n" for n in self.nodes)
        tag = "" if len(self.nodes) == 1 else "-%n"
        conf = f"""\
ClusterName=megappo-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.path('munge.sock')}
CryptoType=crypto/munge
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool')}{tag}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path(f'slurmd{tag}.pid')}
SlurmctldLogFile={self.path('log', 'slurmctld.log')}
SlurmdLogFile={self.path('log', f'slurmd{tag}.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=3600
KillWait={self.kill_wait_s}
MpiDefault=none
SlurmdParameters=config_overrides
{node_lines}PartitionName=local Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.conf, "w") as f:
            f.write(conf)
        with open(self.path("cgroup.conf"), "w") as f:  # slurmd reads it even when no cgroup plugin is used
            f.write("CgroupPlugin=autodetect\nIgnoreSystemd=yes\nConstrainCores=no\nConstrainRAMSpace=no\n")

    def _daemon(self, *cmd: str) -> None:
        name = os.path.basename(cmd[0]) + (f"-{cmd[cmd.index('-N') + 1]}" if "-N" in cmd else "")
        log = open(self.path("log", name + ".out"), "w")
        self.procs.append(subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                           start_new_session=True))

    def start(self, timeout: float = 60) -> "LocalSlurm":
        self.write_config()
        key = self.path("munge.key")
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}", "--force"], check=True,
                       capture_output=True)
        os.chmod(key, 0o600)
        self._daemon(_which("munged"), "--foreground", "--force", f"--key-file={key}",
                     f"--socket={self.path('munge.sock')}", f"--pid-file={self.path('munged.pid')}",
                     f"--log-file={self.path('log', 'munged.log')}", f"--seed-file={self.path('munge.seed')}")
        self._wait(lambda: os.path.exists(self.path("munge.sock")), timeout, "munged")
        self._daemon(_which("slurmctld"), "-D", "-i", "-f", self.conf)
        if len(self.nodes) == 1:
            self._daemon(_which("slurmd"), "-D", "-f", self.conf)
        else:
            for n in self.nodes:
                os.makedirs(self.path(f"spool-{n}"), exist_ok=True)
                self._daemon(_which("slurmd"), "-D", "-N", n, "-f", self.conf)
        self._wait(self._node_idle, timeout, "the nodes to be idle")
        return self

    def _node_idle(self) -> bool:
        proc = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return proc.returncode == 0 and proc.stdout.split() == ["idle"] * len(self.nodes)

    def _wait(self, ready, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"local SLURM: gave up waiting for {what} (exited: {dead}); logs:\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, tail: int = 30) -> str:
        out = []
        for name in sorted(os.listdir(self.path("log"))):
            with open(self.path("log", name), errors="replace") as f:
                out.append(f"== {name}\n" + "".join(f.readlines()[-tail:]))
        return "\n".join(out)

    def run(self, *cmd: str, check: bool = True, env: dict | None = None, timeout: float = 60):
        proc = subprocess.run(list(cmd), env=self.env(env), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def sbatch(self, *args: str, env: dict | None = None, cwd: str | None = None) -> str:
        proc = subprocess.run(["sbatch", "--parsable", *args], env=self.env(env), cwd=cwd, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """JobState and ExitCode (and the rest of `scontrol show job -o`) of a job."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_running(self, job_id: str, timeout: float = 120) -> None:
        self._wait(lambda: self.job(job_id)["JobState"] in ("RUNNING", *DONE_STATES), timeout, f"job {job_id} to run")

    def wait_done(self, job_id: str, timeout: float) -> dict:
        self._wait(lambda: self.job(job_id)["JobState"] in DONE_STATES, timeout, f"job {job_id} to end")
        return self.job(job_id)

    def scancel(self, job_id: str) -> None:
        self.run("scancel", job_id)

    def stop(self) -> None:
        if any(p.poll() is None for p in self.procs):
            self.run("scancel", "--user", "root", check=False)
            end = time.monotonic() + self.kill_wait_s + 30
            while time.monotonic() < end and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(1)
        for p in reversed(self.procs):  # slurmd, slurmctld, munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
