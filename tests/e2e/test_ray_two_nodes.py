"""`megappo train --launcher ray` (megappo.parallel.ray_launch) on a Ray cluster of two nodes on this
machine: a head (`ray start --head --num-cpus 1`) and a second node (`ray start --address HEAD
--num-cpus 1 --node-ip-address 127.0.0.2`, agent ports of its own), both ended by their process ids.
With one CPU per node, the demo's 2 ranks (TP=2, gloo) are placed one per node: rank 1 runs under
the second node's raylet with LOCAL_RANK 0, LOCAL_WORLD_SIZE 1 and MASTER_ADDR the head's address,
not its own (read from /proc while it runs). 2 steps and a save, then the same command with
run.total_steps=3 resumes from that checkpoint and does step 3.

Marked `multinode` (pytest -m multinode runs the multi-node tests alone). Skipped where Ray is not
installed (`pip install -e '.[ray]'`; `make install-test` installs it)."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_ray_launcher import free_port, train, training_rows

pytestmark = pytest.mark.multinode

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


def test_ray_two_nodes_trains_saves_and_resumes(two_node_ray, tmp_path):
    address, nodes = two_node_ray
    run_dir = tmp_path / "run"
    args = ["--launcher", "ray", "--ray-address", address, f"run.output_dir={run_dir}", "logging.progress_bar=false",
            "run.val_every=0", "run.val_before_train=false"]
    driver = train(*args, "run.total_steps=2")
    seen = {}
    end = time.monotonic() + 900
    while driver.poll() is None:
        assert time.monotonic() < end
        for rank, where in _ranks(run_dir, nodes).items():
            seen.setdefault(rank, where)
        time.sleep(0.5)
    out = driver.communicate()[0]
    assert driver.returncode == 0 and "Traceback" not in out, out[-6000:]
    assert "megappo: world=2 tp=2 pp=1 dp=1" in out and "saved checkpoint" in out, out[-6000:]
    # one rank per node: each its node's only rank (LOCAL_RANK 0 of 1), both at rank 0's node
    assert seen["0"][0] == "head" and seen["1"][0] == "second", seen
    assert [seen[r][1]["LOCAL_RANK"] + "/" + seen[r][1]["LOCAL_WORLD_SIZE"] for r in "01"] == ["0/1", "0/1"], seen
    assert seen["0"][1]["WORLD_SIZE"] == seen["1"][1]["WORLD_SIZE"] == "2", seen
    master = seen["0"][1]["MASTER_ADDR"]
    assert seen["1"][1]["MASTER_ADDR"] == master and master != SECOND_NODE_IP, seen
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000002"

    driver = train(*args, "run.total_steps=3")  # the same run, one step further: resumes
    out = driver.communicate(timeout=900)[0]
    assert driver.returncode == 0 and "Traceback" not in out, out[-6000:]
    assert f"megappo: resumed from {run_dir}/checkpoints/step_00000002 (step 2)" in out, out[-6000:]
    assert [r["step"] for r in training_rows(run_dir)] == [1, 2, 3]  # each step once
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000003"
