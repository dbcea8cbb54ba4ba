"""Two nodes on one machine (docs/launchers.md, "Several nodes"): the torchrun line of
tools/launch/slurm_multinode.sbatch (`--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
--max-restarts 0`) started twice, as two agents, each in its own session (a node that can be
killed as a whole), running the CPU demo over gloo.

- TP2 inside a node x DP2 across the two (4 ranks) with a rollout engine replica on each node
  (rollout.replicas=2: global ranks 0 and 2; rank 0's generation and weight-apply requests reach
  node 1's replica over TCP), and losing a node: SIGKILL of every process of node 1 (as a node
  that goes down, its replica with it; node 0's agent hosts the ranks' store) in the middle of
  step 4's save: the other node's ranks stop at once, one line names the lost node and its
  ranks, no process of the run is left, and a rerun resumes from step 2, the last complete
  checkpoint; the run's metrics (steps 1-2 before the kill, 3-4 after) equal the same layout's
  on one node, bitwise; RANK / LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK per node; the run
  dir's files written once (rank 0's) or once per rank (checkpoint shards), never colliding.
  Losing node 0 (whose agent hosts the ranks' store) in step 3: node 1's ranks name it, and the
  store, in one line.
- SIGTERM to one node only (SLURM preempting it), node 1 or node 0 (whose agent hosts the store):
  every rank stops at a step boundary with a checkpoint on every rank; never a hang (bounded waits).
- PP2 across the nodes (1 rank per node): the same metrics as PP2 on one node, bitwise; with one
  engine on rank 0, and with a rollout replica per node (rollout.replicas=2: ranks 0 and 1, each
  replica's weight gather taking the other stage from the other node).

Marked `multinode` (pytest -m multinode runs them alone). Every process of a node is found by a
marker in its environment (inherited by every child).
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests import prefork
from tests.e2e._runs import metrics

pytestmark = pytest.mark.multinode

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "MEGAPPO_TEST_NODE"  # only this test reads it: "RUN-ID NODE" on every process of a node
TIMEOUT = 600  # generous: the machine is shared; the real times are a few tens of seconds
ARGS = ["checkpoint.save_every=2", "logging.progress_bar=false", "run.val_before_train=false", "run.val_every=0",
        "data.train_batch_size=16",
        *(f"{role}.{key}=16" for role in ("actor", "critic") for key in ("ppo_mini_batch_size", "micro_batch_size"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(mark: str = "") -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        e.pop(key, None)
    if mark:
        e[MARK] = mark
    return e


def sbatch_torchrun(nnodes: int, nproc: int, port: int, rdzv_id: str) -> list[str]:
    """The torchrun line of tools/launch/slurm_multinode.sbatch, the endpoint on loopback."""
    line = [ln for ln in open(os.path.join(REPO, "tools/launch/slurm_multinode.sbatch")) if "--rdzv-backend" in ln]
    assert line and "c10d" in line[0], "the sbatch script's torchrun line changed: update this test"
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
            "--max-restarts", "0", "-m", "megappo.cli", "train"]


class Nodes:
    """Two torchrun agents of one run, each in its own session, output to RUN_DIR.nodeK.log."""

    def __init__(self, out: str, nproc: int, overrides: list[str]):
        self.out, self.run_id, port = out, uuid.uuid4().hex, free_port()
        cmd = [*sbatch_torchrun(2, nproc, port, self.run_id), "recipes/demo-cpu.yaml", f"run.output_dir={out}",
               *ARGS, *overrides]
        self.port, self.agents, self.logs = port, [], []
        for k in range(2):
            log = f"{out}.node{k}.log"
            with open(log, "w") as sink:  # a file, not a pipe: a process left behind would hold a pipe open
                self.agents.append(prefork.popen(cmd, env=env(f"{self.run_id} {k}"), cwd=REPO, stdout=sink,
                                                 stderr=subprocess.STDOUT, start_new_session=True))
            self.logs.append(log)

    def wait(self, timeout: float = TIMEOUT) -> list[int]:
        deadline = time.time() + timeout
        for agent in self.agents:
            agent.wait(timeout=max(1.0, deadline - time.time()))
        return [a.returncode for a in self.agents]

    def output(self, tail: int = 5000) -> str:
        """Both agents' output (the last `tail` characters of each; 0: all)."""
        texts = [open(log).read() for log in self.logs]
        return "".join(f"--- agent {k}\n{text[-tail:] if tail else text}" for k, text in enumerate(texts))

    def processes(self, k: int | None = None) -> list[psutil.Process]:
        """The live processes of agent k (of both: None), found by their marker."""
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                mark = p.environ().get(MARK, "")
                if mark.startswith(self.run_id) and (k is None or mark == f"{self.run_id} {k}") \
                        and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        return found

    def ranks(self, k: int) -> list[dict]:
        """The torchrun variables of agent k's ranks (its children)."""
        keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "WORLD_SIZE")
        children = psutil.Process(self.agents[k].pid).children()
        return sorted(({key: c.environ().get(key) for key in keys} for c in children), key=lambda e: int(e["RANK"]))

    def agent_of_node(self, group_rank: int) -> int:
        """The agent whose ranks the rendezvous made node `group_rank` (their GROUP_RANK)."""
        found = [k for k in range(2) if {r["GROUP_RANK"] for r in self.ranks(k)} == {str(group_rank)}]
        assert len(found) == 1, [self.ranks(k) for k in range(2)]
        return found[0]

    def kill(self) -> None:
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                p.kill()
        for agent in self.agents:
            if agent.poll() is None:
                agent.wait(timeout=30)

    def gone(self, timeout: float = 10) -> list[psutil.Process]:
        """The processes of the run still alive after `timeout` s."""
        deadline = time.time() + timeout
        while self.processes() and time.time() < deadline:
            time.sleep(0.1)
        return self.processes()


def wait_for_checkpoint(nodes: Nodes, step: int) -> None:
    latest = os.path.join(nodes.out, "checkpoints", "latest")
    deadline = time.time() + TIMEOUT
    while not (os.path.isfile(latest) and open(latest).read() == f"step_{step:08d}"):
        assert all(a.poll() is None for a in nodes.agents), f"a node ended before step {step}'s checkpoint:\n" \
                                                            f"{nodes.output()}"
        assert time.time() < deadline, f"no checkpoint of step {step} after {TIMEOUT}s"
        time.sleep(0.02)


def one_node(out: str, world: int, overrides: list[str]) -> str:
    """The same layout on one node (megappo's own launcher); returns its run dir."""
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--world-size", str(world), "recipes/demo-cpu.yaml",
           f"run.output_dir={out}", *ARGS, *overrides]
    proc = prefork.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out


# the recipe's TP=2: a node's 2 ranks are a TP group, DP across the nodes; a rollout replica on each node
# (global ranks 0 and 2), generation requests crossing to node 1
REPLICAS = ["rollout.replicas=2"]
TP2 = ["run.total_steps=4", *REPLICAS]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return one_node(str(tmp_path_factory.mktemp("one-node") / "run"), 4, TP2)


def kill_a_node(nodes: Nodes, node: int, mid_save: bool) -> tuple[str, list[int], float]:
    """SIGKILL every process of node `node` (its agent, ranks and their children) in step 3, or
    (`mid_save`) as soon as step 4's save has begun (its `.partial` directory exists); wait for the
    other node's agent. Returns the other node's output, the killed ranks and how long the other
    node took to end."""
    wait_for_checkpoint(nodes, 2)
    lost = nodes.agent_of_node(node)  # found before the wait below: the kill must land inside step 4's save
    ranks = [int(r["RANK"]) for r in nodes.ranks(lost)]
    if mid_save:
        partial = os.path.join(nodes.out, "checkpoints", "step_00000004.partial")
        deadline = time.time() + TIMEOUT
        while not os.path.isdir(partial):
            assert time.time() < deadline and all(a.poll() is None for a in nodes.agents), nodes.output()
            time.sleep(0.01)
    else:
        time.sleep(0.2)  # into step 3
    start = time.time()
    for p in nodes.processes(lost):
        with contextlib.suppress(psutil.Error):
            p.kill()
    survivor = nodes.agents[1 - lost]
    survivor.wait(timeout=TIMEOUT)
    stopped_in = time.time() - start
    assert survivor.returncode != 0, nodes.output()
    left = nodes.gone()
    assert not left, f"processes of the run left: {[(p.pid, p.cmdline()[:6]) for p in left]}"
    return open(nodes.logs[1 - lost]).read(), ranks, stopped_in


def test_losing_a_node_stops_the_other_and_the_rerun_resumes(straight, tmp_path):
    out = str(tmp_path / "run")
    nodes = Nodes(out, 2, ["run.total_steps=40", *REPLICAS])  # long enough that the kill lands mid-run
    try:
        text, ranks, stopped_in = kill_a_node(nodes, 1, mid_save=True)
    finally:
        nodes.kill()
    checkpoints = os.path.join(out, "checkpoints")  # the kill landed in step 4's save: it stayed partial
    assert open(os.path.join(checkpoints, "latest")).read() == "step_00000002", os.listdir(checkpoints)
    assert not os.path.exists(os.path.join(checkpoints, "step_00000004")), os.listdir(checkpoints)
    named = [line for line in text.splitlines() if line.startswith("megappo: error:")]
    assert len(named) == 1, text[-6000:]
    assert f"lost node 1 (host {socket.gethostname()}): ranks {ranks[0]}, {ranks[1]} in stage" in named[0], named
    assert stopped_in < 120, f"the surviving node took {stopped_in:.0f}s to stop"  # gloo: the peer's socket closes
    # the rerun (both nodes again) resumes from step 2, the last complete checkpoint, and ends with the
    # metrics of the same layout on one node (steps 1-2 trained before the kill, 3-4 by the rerun)
    rerun = Nodes(out, 2, TP2)
    try:
        wait_for_checkpoint(rerun, 4)
        seen = [rerun.ranks(k) for k in range(2)]
        assert rerun.wait() == [0, 0], rerun.output()
    finally:
        rerun.kill()
    assert "(step 2)" in rerun.output(tail=0), rerun.output()
    assert " rollout_replicas=2 (ranks 0, 2)\n" in rerun.output(tail=0), rerun.output()
    assert metrics(out) == metrics(straight)
    # per node: global RANK 0-3 split by node, LOCAL_RANK 0-1 and LOCAL_WORLD_SIZE 2 on each, GROUP_RANK the node
    by_node = sorted(seen, key=lambda ranks: ranks[0]["GROUP_RANK"])
    assert [[(r["GROUP_RANK"], r["RANK"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"], r["WORLD_SIZE"]) for r in ranks]
            for ranks in by_node] == [[("0", "0", "0", "2", "4"), ("0", "1", "1", "2", "4")],
                                      [("1", "2", "0", "2", "4"), ("1", "3", "1", "2", "4")]]

    # one run dir for both nodes: the same files as on one node, rank 0's written once (the lock taken
    # by global rank 0 only, and released), each rank's own checkpoint files under distinct names
    def files(run):
        return sorted(os.path.relpath(os.path.join(d, f), run) for d, _, fs in os.walk(run) for f in fs
                      if ".partial" not in d)
    assert files(out) == files(straight)
    assert "megappo.lock" not in files(out)
    rng = sorted(os.listdir(os.path.join(out, "checkpoints", "step_00000004", "rng")))
    assert len(rng) == 4 and len(set(rng)) == 4, rng
    done = [line for line in rerun.output(tail=0).splitlines() if line.startswith("done: 2 steps")]
    assert len(done) == 1, rerun.output()  # one rank 0 across the nodes


def test_losing_the_node_that_hosts_the_store(tmp_path):
    """Node 0's agent hosts the ranks' store (MASTER_ADDR): it goes with the node, and node 1's
    ranks say so, in one line."""
    nodes = Nodes(str(tmp_path / "run"), 2, ["run.total_steps=40"])
    try:
        text, ranks, stopped_in = kill_a_node(nodes, 0, mid_save=False)
    finally:
        nodes.kill()
    named = [line for line in text.splitlines() if line.startswith("megappo: error:")]
    assert len(named) == 1, text[-6000:]
    assert f"lost node 0 (host {socket.gethostname()}): ranks 0, 1 and the run's store, which that node hosted, " \
           "in stage" in named[0], named
    assert stopped_in < 120, f"the surviving node took {stopped_in:.0f}s to stop"


@pytest.mark.parametrize("node", [1, 0], ids=["node1", "node0-hosting-the-store"])
def test_sigterm_to_one_node_stops_every_rank_with_a_checkpoint(tmp_path, node):
    out = str(tmp_path / "run")
    nodes = Nodes(out, 2, ["run.total_steps=40"])
    try:
        wait_for_checkpoint(nodes, 2)
        time.sleep(0.2)
        preempted = nodes.agent_of_node(node)
        for p in nodes.processes(preempted):  # as SLURM signals every process of the node's job step
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
        nodes.wait()  # bounded: a hang fails here
        left = nodes.gone()
        assert not left, f"processes of the run left: {[(p.pid, p.cmdline()[:6]) for p in left]}"
    finally:
        nodes.kill()
    text = nodes.output(tail=0)
    stopped = [line for line in text.splitlines() if line.startswith("megappo: interrupted at step")]
    assert len(stopped) == 1, text
    step = int(stopped[0].split("interrupted at step ")[1].split(":")[0])
    assert step >= 3 and open(os.path.join(out, "checkpoints", "latest")).read() == f"step_{step:08d}", text
    assert len(os.listdir(os.path.join(out, "checkpoints", f"step_{step:08d}", "rng"))) == 4  # every rank saved
    # (a rerun resumes from the latest checkpoint as after a lost node: the test above)


PP2 = ["parallel.tp=1", "parallel.pp=2", "run.total_steps=2"]


@pytest.mark.parametrize("replicas", [1, 2], ids=["one-engine", "replica-per-node"])
def test_pipeline_across_two_nodes_matches_one_node(tmp_path, replicas):
    """PP2 with one rank per node: every activation and gradient crosses the node boundary. With a
    rollout replica per node (global ranks 0 and 1), each replica's weight gather takes the other
    stage from the other node, and rank 0's generation requests reach node 1's replica over TCP."""
    overrides = [*PP2, f"rollout.replicas={replicas}"]
    nodes = Nodes(str(tmp_path / "run"), 1, overrides)
    try:
        assert nodes.wait() == [0, 0], nodes.output()
    finally:
        nodes.kill()
    said = " rollout_replicas=2 (ranks 0, 1)\n" in nodes.output(tail=0)
    assert said == (replicas == 2), nodes.output()
    assert metrics(str(tmp_path / "run")) == metrics(one_node(str(tmp_path / "one"), 2, overrides))
