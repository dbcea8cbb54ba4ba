"""`megappo train --launcher ray` (megappo.parallel.ray_launch) on a real Ray cluster started on this
machine (`ray start --head --num-cpus 2 --block`, ended by its process id): the demo's 2 ranks run as
Ray actors, their output and exit codes come back to the driver. Ctrl-C (SIGINT) on the driver
stops the ranks with a checkpoint; the same command again resumes and finishes the run. A rank
killed with SIGKILL ends the run with a line that names it; an unreachable or too small cluster is
bad input (exit 2, the fix named). Skipped where Ray is not installed (`pip install -e '.[ray]'`;
`make install-test` installs it)."""

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


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make install-test does)")
    port = free_port()
    temp = f"/tmp/ray-megappo-{os.getpid()}"  # short: Ray's socket paths must fit in 107 characters
    log = open(tmp_path_factory.mktemp("ray") / "ray.log", "w")
    head = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--num-cpus", "2",
                             "--port", str(port), "--include-dashboard=false", "--disable-usage-stats",
                             "--temp-dir", temp, "--block"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        import ray

        end = time.monotonic() + 180
        while True:  # the head answers when a driver can connect
            assert head.poll() is None and time.monotonic() < end, open(log.name).read()[-4000:]
            probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}'); ray.shutdown()"],
                                   capture_output=True, text=True, timeout=120)
            if probe.returncode == 0:
                break
            time.sleep(2)
        del ray
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` ends the processes it started
        try:  # its graceful stop takes about 30 s; what is left after 5 s is killed (the temp dir goes too)
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def train(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    for key in ("WORLD_SIZE", "RAY_ADDRESS"):
        env.pop(key, None)
    return subprocess.Popen([sys.executable, "-m", "megappo.cli", "train", "recipes/demo-cpu.yaml", *args], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


#: a short run of the demo without validation: stopped after a few steps, resumed to the end. Learning
#: does not depend on the launcher (tests/e2e/test_cli_demo.py: the demo learns; tests/e2e/test_resume.py
#: and test_interrupts.py: an interrupted run resumes bit for bit), so it is not measured here again
STEPS = 12
SHORT = [f"run.total_steps={STEPS}", "run.val_every=0", "run.val_before_train=false"]


def training_rows(run_dir):
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "critic/score/mean" in r]


def test_ray_launcher_runs_the_demo_and_resumes_after_ctrl_c(ray_address, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--launcher", "ray", "--ray-address", ray_address, f"run.output_dir={run_dir}",
            "logging.progress_bar=false", *SHORT]
    driver = train(*args)
    end = time.monotonic() + 600
    while len(training_rows(run_dir)) < 3:  # mid-run
        assert driver.poll() is None and time.monotonic() < end, driver.communicate()[0][-6000:]
        time.sleep(1)
    driver.send_signal(signal.SIGINT)  # Ctrl-C reaches the driver only: it forwards it to the actors' ranks
    out = driver.communicate(timeout=300)[0]
    assert driver.returncode == 130, out[-6000:]
    assert "megappo: world=2 tp=2 pp=1 dp=1" in out and "Traceback" not in out  # rank 0's lines, relayed
    stopped = re.search(r"megappo: interrupted at step (\d+): checkpoint saved", out)
    assert stopped, out[-6000:]
    step = int(stopped.group(1))
    assert 3 <= step < STEPS and (run_dir / "checkpoints" / "latest").read_text() == f"step_{step:08d}"

    driver = train(*args)
    out = driver.communicate(timeout=1500)[0]
    assert driver.returncode == 0, out[-6000:]
    assert f"megappo: resumed from {run_dir}/checkpoints/step_{step:08d} (step {step})" in out
    assert "done: " in out and "Traceback" not in out
    rows = training_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))


def test_ray_launcher_reports_a_killed_rank(ray_address, tmp_path):
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


def test_ray_launcher_bad_inputs(ray_address, tmp_path):
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
