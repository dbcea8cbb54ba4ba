"""`megappo train --launcher ray` (megappo.parallel.ray_launch) on a real Ray cluster of two nodes on
this machine: a head (`ray start --head --num-cpus 1`) and a second node (`ray start --address HEAD
--num-cpus 1 --node-ip-address 127.0.0.2`, agent ports of its own), both ended by their process ids.
With one CPU per node, the demo's 2 ranks (TP=2, gloo) run as Ray actors one per node, their output
and exit codes come back to the driver: each rank runs under its own node's raylet with LOCAL_RANK 0
and LOCAL_WORLD_SIZE 1, and both have MASTER_ADDR rank 0's node's address (read from /proc while
they run; Ray may place rank 0 on either node).
Ctrl-C (SIGINT) on the driver stops the ranks on both nodes with a checkpoint; the same command again
resumes and finishes the run. A rank killed with SIGKILL ends the run with a line that names it; an
unreachable or too small cluster is bad input (exit 2, the fix named); these share the module's
cluster.

The resume test is marked `multinode` (pytest -m multinode runs the multi-node tests alone; it runs
in `make test` too). Skipped where Ray is not installed (`pip install -e '.[ray]'`; `make
install-test` installs it)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the second node's own address: another loopback address of this machine, so that "the head's
#: address" and "this node's address" differ
SECOND_NODE_IP = "127.0.0.2"


def _ray_node(log, *args) -> subprocess.Popen:
    return subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--num-cpus", "1",
                             "--disable-usage-stats", "--block", *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(node: subprocess.Popen) -> None:
    os.killpg(node.pid, signal.SIGTERM)  # `ray start --block` ends the processes it started
    try:
        node.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()


@pytest.fixture(scope="module")
def two_node_ray(tmp_path_factory):
    pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make install-test does)")
    port = free_port()
    temp = f"/tmp/ray-megappo2-{os.getpid()}"  # short: Ray's socket paths must fit in 107 characters
    logs = tmp_path_factory.mktemp("ray2")
    head_log, second_log = open(logs / "head.log", "w"), open(logs / "second.log", "w")
    address = f"127.0.0.1:{port}"
    nodes = {"head": _ray_node(head_log, "--head", "--port", str(port), "--include-dashboard=false",
                               "--temp-dir", temp)}
    try:
        end = time.monotonic() + 240
        probe = "import ray, time\nray.init(address='{}')\nassert ray.cluster_resources().get('CPU', 0) >= {}"
        while subprocess.run([sys.executable, "-c", probe.format(address, 1)], capture_output=True).returncode:
            assert nodes["head"].poll() is None and time.monotonic() < end, open(head_log.name).read()[-4000:]
            time.sleep(2)
        ports = [f"--{p}-port={free_port()}" for p in ("dashboard-agent-listen", "dashboard-agent-grpc",
                                                      "runtime-env-agent", "metrics-export")]
        nodes["second"] = _ray_node(second_log, "--address", address, "--node-ip-address", SECOND_NODE_IP, *ports)
        while subprocess.run([sys.executable, "-c", probe.format(address, 2)], capture_output=True).returncode:
            assert nodes["second"].poll() is None and time.monotonic() < end, open(second_log.name).read()[-4000:]
            time.sleep(2)
        yield address, nodes
    finally:
        for node in reversed(list(nodes.values())):
            _stop(node)
        shutil.rmtree(temp, ignore_errors=True)


def _ranks(run_dir, nodes) -> dict:
    """RANK -> (the node whose `ray start` it runs under, its torchrun variables), for the rank
    processes of this run now alive."""
    import psutil

    found = {}
    for p in psutil.process_iter(["cmdline", "environ"]):
        cmd, env = p.info["cmdline"] or [], p.info["environ"] or {}
        if "megappo.cli" in cmd and f"run.output_dir={run_dir}" in cmd and "RANK" in env:
            try:
                above = {a.pid for a in p.parents()}
            except psutil.NoSuchProcess:
                continue
            node = next((name for name, n in nodes.items() if n.pid in above), None)
            found[env["RANK"]] = (node, {k: env.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                                                                 "MASTER_ADDR")})
    return found


def train(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    for key in ("WORLD_SIZE", "RAY_ADDRESS"):
        env.pop(key, None)
    return subprocess.Popen([sys.executable, "-m", "megappo.cli", "train", "recipes/demo-cpu.yaml", *args], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


#: a short run of the demo without validation: stopped after a few steps, resumed to the end. Learning
#: does not depend on the launcher (tests/e2e/test_cli_demo.py: the demo learns; tests/e2e/test_resume.py
#: and test_interrupts.py: an interrupted run resumes bit for bit), so it is not measured here again
STEPS = 8
SHORT = [f"run.total_steps={STEPS}", "run.val_every=0", "run.val_before_train=false"]


def training_rows(run_dir):
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "critic/score/mean" in r]


@pytest.mark.multinode
def test_ray_two_nodes_runs_the_demo_and_resumes_after_ctrl_c(two_node_ray, tmp_path):
    address, nodes = two_node_ray
    run_dir = tmp_path / "run"
    args = ["--launcher", "ray", "--ray-address", address, f"run.output_dir={run_dir}",
            "logging.progress_bar=false", *SHORT]
    driver = train(*args)
    seen = {}
    end = time.monotonic() + 900
    while len(training_rows(run_dir)) < 2 or len(seen) < 2:  # mid-run: steps done, most of the run to go
        assert driver.poll() is None and time.monotonic() < end, (seen, driver.communicate()[0][-6000:])
        for rank, where in _ranks(run_dir, nodes).items():
            seen.setdefault(rank, where)
        time.sleep(0.5)
    driver.send_signal(signal.SIGINT)  # Ctrl-C reaches the driver only: it forwards it to the actors' ranks
    out = driver.communicate(timeout=300)[0]
    assert driver.returncode == 130, out[-6000:]
    assert "megappo: world=2 tp=2 pp=1 dp=1" in out and "Traceback" not in out  # rank 0's lines, relayed
    # one rank per node (Ray places bundle 0 on either): each its node's only rank (LOCAL_RANK 0 of 1), both
    # told rank 0's node's address as MASTER_ADDR, so the other rank's MASTER_ADDR is not its own node's
    assert {seen[r][0] for r in "01"} == {"head", "second"}, seen
    assert [seen[r][1]["LOCAL_RANK"] + "/" + seen[r][1]["LOCAL_WORLD_SIZE"] for r in "01"] == ["0/1", "0/1"], seen
    assert seen["0"][1]["WORLD_SIZE"] == seen["1"][1]["WORLD_SIZE"] == "2", seen
    master = seen["0"][1]["MASTER_ADDR"]
    assert seen["1"][1]["MASTER_ADDR"] == master and (master == SECOND_NODE_IP) == (seen["0"][0] == "second"), seen
    stopped = re.search(r"megappo: interrupted at step (\d+): checkpoint saved", out)
    assert stopped, out[-6000:]
    step = int(stopped.group(1))
    assert 2 <= step < STEPS and (run_dir / "checkpoints" / "latest").read_text() == f"step_{step:08d}"

    driver = train(*args)  # the same command again resumes
    out = driver.communicate(timeout=1200)[0]
    assert driver.returncode == 0, out[-6000:]
    assert f"megappo: resumed from {run_dir}/checkpoints/step_{step:08d} (step {step})" in out, out[-6000:]
    assert "done: " in out and "Traceback" not in out
    assert [r["step"] for r in training_rows(run_dir)] == list(range(1, STEPS + 1))  # each step once
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


def test_ray_launcher_reports_a_killed_rank(two_node_ray, tmp_path):
    ray_address = two_node_ray[0]
    import psutil

    run_dir = tmp_path / "run"
    driver = train("--launcher", "ray", "--ray-address", ray_address, f"run.output_dir={run_dir}",
                   "logging.progress_bar=false", "run.total_steps=100")
    end = time.monotonic() + 600
    while len(training_rows(run_dir)) < 1:
        assert driver.poll() is None and time.monotonic() < end, driver.communicate()[0][-6000:]
        time.sleep(1)
    ranks = [p for p in psutil.process_iter(["cmdline", "environ"])
             if "megappo.cli" in (p.info["cmdline"] or []) and str(run_dir) in " ".join(p.info["cmdline"] or [])
             and (p.info["environ"] or {}).get("RANK") == "1"]
    assert len(ranks) == 1, ranks  # rank 1: a child of its Ray actor, not of the driver
    assert ranks[0].pid not in {c.pid for c in psutil.Process(driver.pid).children(recursive=True)}
    ranks[0].kill()
    out = driver.communicate(timeout=300)[0]
    assert driver.returncode == 1, out[-6000:]
    assert "megappo: rank 1 failed (was ended by signal SIGKILL); the other ranks were stopped." in out, out[-6000:]


def test_ray_launcher_bad_inputs(two_node_ray, tmp_path):
    ray_address = two_node_ray[0]
    driver = train("--launcher", "ray", "--ray-address", ray_address, "--world-size", "4", "parallel.tp=1",
                   "actor.micro_batch_size=8", "critic.micro_batch_size=8", f"run.output_dir={tmp_path}")
    out = driver.communicate(timeout=300)[0]
    assert driver.returncode == 2 and "Traceback" not in out, out[-6000:]
    assert "is too small for 4 ranks" in out and "they need 4 CPU (it has 2)" in out and "Fix: add nodes" in out, out

    driver = train("--launcher", "ray", "--ray-address", f"127.0.0.1:{free_port()}", f"run.output_dir={tmp_path}")
    out = driver.communicate(timeout=300)[0]
    assert driver.returncode == 2 and "Traceback" not in out, out[-6000:]
    assert "no Ray cluster could be reached" in out and "ray start --head" in out, out

    driver = train("--ray-address", ray_address, f"run.output_dir={tmp_path}")
    out = driver.communicate(timeout=120)[0]
    assert driver.returncode == 2 and "Fix: add --launcher ray" in out, out
