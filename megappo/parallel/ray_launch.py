"""Start the ranks of `megappo train` as Ray actors on an existing Ray cluster (`--launcher ray`).

`launch(argv, world, address, gpu)`: connects to the cluster at `address` (`ray.init`; "auto":
the cluster started on this machine with `ray start --head`), checks that it has the resources,
reserves one bundle per rank in a placement group (PACK: 1 CPU each, and 1 GPU for a GPU
recipe), starts one actor per bundle and has each run megappo's normal entry,
`python -m megappo.cli ARGV`, in a child process with the torchrun environment: RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE (the ranks on its node, in rank order; each node's ranks are
consecutive, bundle 0's node first, so a TP group stays within a node), MASTER_ADDR (rank 0's node)
and MASTER_PORT (a free port there); on a GPU recipe CUDA_VISIBLE_DEVICES lists the node's GPUs
that Ray gave those ranks, in local-rank order, so LOCAL_RANK picks this rank's own. The ranks run
in the driver's working directory with its PYTHONPATH: the recipe, data and run.output_dir must be
at the same paths on every node (a shared file system, as under SLURM).

What comes back to the driver: every output line of every rank (rank 0's as it is, the others'
after `[rank N] `), the exit codes, and the error each rank recorded as the one it ends on (each
child gets its own $TORCHELASTIC_ERROR_FILE, as under torchrun: megappo.parallel.launch.record_error).
The exit code is 0, or that of the rank that failed, picked as megappo.parallel.launch picks it
(the first recorded own error, then 2 for bad input, then a signal, then a rank that gave up
waiting for another), after one line that names it and, where its error is not already the last
on the screen, repeats it (megappo.parallel.launch.final_line; none after an error in the user's
own code, USER_CODE_EXIT, that nobody spoke after: that rank's message stays last); the other ranks are then
stopped (SIGTERM, SIGKILL after STOP_GRACE_S). SIGINT / SIGTERM sent to the driver go on to the
ranks as SIGINT (stop at a step boundary with a checkpoint, megappo.parallel.interrupts) and the driver
exits with 128 + its signal; a second signal kills the ranks at once. A cluster that cannot be
reached, or that has too few CPUs / GPUs for the ranks, is bad input (ConfigError: exit 2, the
message says the fix).

This module does not know about models, recipes or PPO; it knows Ray and torchrun's environment.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from megappo.errors import ConfigError
from megappo.parallel.interrupts import exit_code
from megappo.parallel.launch import ERROR_FILE_ENV, RankError, cause, final_line, rank_error

#: how long the driver tries to reach the head of the cluster it was given
CONNECT_TIMEOUT_S = 10.0
#: how long a placement group may wait for a busy cluster's resources to free up
PLACEMENT_TIMEOUT_S = 300.0
#: the driver's variables every rank gets as well: the run lock's token (megappo.trainer.runlock.TOKEN_ENV),
#: so rank 0 knows the driver holds the run's lock
INHERITED_ENV = ("MEGAPPO_RUN_LOCK",)
#: SIGTERM -> SIGKILL for the ranks left when one failed
STOP_GRACE_S = 10.0
POLL_S = 0.2


class _Rank:
    """One rank: a child process running `python -m megappo.cli ARGV` inside a Ray actor, its
    output lines kept until the driver polls them."""

    def __init__(self):
        self.proc = None
        self.reader = None  # the thread that collects the child's output lines
        self.lines: list[str] = []
        self.error_file = None  # the child's $TORCHELASTIC_ERROR_FILE

    def where(self) -> tuple[str, str, list[str]]:
        """(node IP, node id, the GPU ids Ray gave this actor)."""
        import ray

        ctx = ray.get_runtime_context()
        gpus = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        return ray.util.get_node_ip_address(), ctx.get_node_id(), gpus

    def free_port(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, argv: list[str], env: dict, cwd: str) -> None:
        import subprocess
        import threading

        def as_a_launched_process():  # in the child, before exec
            import ctypes

            libc = ctypes.CDLL(None)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no rank outlives its actor
            # Ray's thread blocks SIGINT/SIGTERM and the mask is inherited: a forwarded signal would wait
            signal.pthread_sigmask(signal.SIG_SETMASK, ())
            for s in (signal.SIGINT, signal.SIGTERM):
                libc.signal(s, 0)  # SIG_DFL (signal.signal works in the main thread only)

        import tempfile

        full_env = dict(os.environ)  # the actor's (Ray's worker), then the rank's (a GPU list overrides Ray's)
        full_env.update(env)
        self.error_file = os.path.join(tempfile.mkdtemp(prefix="megappo-rank-"), "error.json")
        full_env[ERROR_FILE_ENV] = self.error_file
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "megappo.cli", *argv], cwd=cwd, env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                     preexec_fn=as_a_launched_process)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def poll(self) -> tuple[list[str], int | None, RankError | None]:
        """(the output lines since the last poll, the exit code or None while running, the error the
        rank recorded as the one it ends on); the code and the error come only with the last lines."""
        import json
        import shutil

        code, error = self.proc.poll(), None
        if code is not None:
            self.reader.join(timeout=5)
            try:
                with open(self.error_file) as f:
                    error = rank_error(json.load(f))
            except (OSError, ValueError):
                pass
            shutil.rmtree(os.path.dirname(self.error_file), ignore_errors=True)
        lines = self.lines[:]
        del self.lines[:len(lines)]  # the reader may append meanwhile
        return lines, code, error

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)


def _connect(address: str):
    try:
        import ray
    except ImportError:
        raise ConfigError("--launcher ray needs Ray, which is not installed. Fix: pip install -e '.[ray]' "
                          "(or pip install ray), or launch without --launcher ray.") from None
    import logging
    import socket

    fix = ("Fix: start one (`ray start --head` on this machine, then --ray-address auto), or pass the address of a "
           "running cluster's head, e.g. --ray-address HEAD_IP:6379.")
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and "://" not in address:  # Ray itself retries an unreachable head for minutes
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise ConfigError(f"no Ray cluster could be reached at --ray-address {address} ({e}). {fix}") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"no Ray cluster could be reached at --ray-address {address} ({e}). {fix}") from None
    return ray


def _check_resources(ray, world: int, bundle: dict, address: str) -> None:
    have = ray.cluster_resources()
    short = {k: (v * world, have.get(k, 0)) for k, v in bundle.items() if have.get(k, 0) < v * world}
    if short:
        need = ", ".join(f"{n:g} {k} (it has {h:g})" for k, (n, h) in short.items())
        raise ConfigError(f"the Ray cluster at {address} is too small for {world} ranks of {bundle}: they need "
                          f"{need}. Fix: add nodes to the cluster (`ray start --address HEAD:PORT` on each), or "
                          f"launch fewer ranks (--world-size N).")


def _node_order(places: list[tuple]) -> list[int]:
    """The actors (by bundle index) in rank order: each node's together, in bundle order, the nodes in
    the order of their first bundle (bundle 0's node holds rank 0). Ray's PACK may interleave the
    bundles of two nodes; Megatron's TP (then PP) groups are consecutive ranks, so without this a TP
    group could span nodes although each node has a whole number of them."""
    nodes = list(dict.fromkeys(p[1] for p in places))
    return sorted(range(len(places)), key=lambda i: (nodes.index(places[i][1]), i))


def _envs(places: list[tuple], master_port: int, gpu: bool) -> list[dict]:
    """Each rank's torchrun environment from `places` ((node IP, node id, GPU ids) in rank order)."""
    envs = []
    for rank, (_, node, gpus) in enumerate(places):
        local = [r for r, p in enumerate(places) if p[1] == node]
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(places)), "LOCAL_RANK": str(local.index(rank)),
               "LOCAL_WORLD_SIZE": str(len(local)), "MASTER_ADDR": places[0][0], "MASTER_PORT": str(master_port)}
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(places[r][2][0] for r in local)
        envs.append(env)
    return envs


def _rendezvous(ray, actors, gpu: bool) -> tuple[list, list[dict]]:
    """The actors in rank order (_node_order) and each rank's torchrun environment, from where Ray
    placed them."""
    places = ray.get([a.where.remote() for a in actors])
    order = _node_order(places)
    actors, places = [actors[i] for i in order], [places[i] for i in order]
    return actors, _envs(places, ray.get(actors[0].free_port.remote()), gpu)


def launch(argv: list[str], world: int, address: str = "auto", gpu: bool = False) -> int:
    """Run `megappo ARGV` on `world` ranks as Ray actors; the exit code as described above."""
    ray = _connect(address)
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    try:
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpu else {})}
        _check_resources(ray, world, bundle, address)
        pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        if not pg.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
            remove_placement_group(pg)
            raise ConfigError(f"the Ray cluster at {address} did not free {world} x {bundle} for the ranks within "
                              f"{PLACEMENT_TIMEOUT_S:.0f} s (other jobs hold them: `ray status`). Fix: wait for them "
                              f"or add nodes, then rerun.")
        rank_cls = ray.remote(_Rank)
        actors = [rank_cls.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=
                                   PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
                  for i in range(world)]
        actors, envs = _rendezvous(ray, actors, gpu)
        pythonpath = os.environ.get("PYTHONPATH")
        for env in envs:
            env.update({"PYTHONPATH": pythonpath} if pythonpath else {})
            env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
            env.update({k: os.environ[k] for k in INHERITED_ENV if k in os.environ})
        ray.get([a.start.remote(argv, env, os.getcwd()) for a, env in zip(actors, envs)])
        return _supervise(ray, actors)
    finally:
        ray.shutdown()


def _supervise(ray, actors) -> int:
    """Relay the ranks' output until all ended; the exit code (see the module docstring)."""
    signals: list[int] = []

    def forward(signum, frame):
        signals.append(signum)
        for a in actors:  # SIGINT: the ranks stop at a step boundary; a second signal: at once
            a.signal.remote(signal.SIGKILL if len(signals) > 1 else signal.SIGINT)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    codes: dict[int, int] = {}
    failures: dict[int, tuple[int, float, RankError | None]] = {}  # rank: (code, when, its error) of ranks that failed
    stopping_since = None
    try:
        while len(codes) < len(actors):
            polls = ray.get([a.poll.remote() for a in actors])
            for rank, (lines, code, error) in enumerate(polls):
                for line in lines:
                    sys.stdout.write(line if rank == 0 else f"[rank {rank}] {line}")
                if code is not None and rank not in codes:
                    codes[rank] = code
                    if code != 0:  # those stopped after the first too, as torchrun reports them
                        failures[rank] = (code, time.monotonic(), error)
            sys.stdout.flush()
            if failures and not signals and stopping_since is None:  # one failed: stop the others
                stopping_since = time.monotonic()
                for r, a in enumerate(actors):
                    if r not in codes:
                        a.signal.remote(signal.SIGTERM)
            if stopping_since is not None and time.monotonic() - stopping_since > STOP_GRACE_S:
                for r, a in enumerate(actors):
                    if r not in codes:
                        a.signal.remote(signal.SIGKILL)
            time.sleep(POLL_S)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return _exit_code(failures, signals)


def _exit_code(failures: dict[int, tuple[int, float, RankError | None]], signals: list[int]) -> int:
    """The driver's exit code from the failed ranks' (exit code, when, recorded error) and the signals it
    got, after the one line megappo.parallel.launch.final_line words."""
    if signals:
        if len(signals) > 1:
            print("megappo: interrupted again: the ranks were stopped at once, without a checkpoint of the step in "
                  "progress; rerun the same command to continue from the latest checkpoint, if any.",
                  file=sys.stderr, flush=True)
        return exit_code(signals[0])  # rank 0 said what was saved
    if not failures:
        return 0
    rank, code, error = cause(failures)
    line = final_line(rank, code, error, failures)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    return code if code > 0 else 1
