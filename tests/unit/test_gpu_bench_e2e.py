"""benchmarks/gpu.py's e2e rows when a run passes `--e2e-timeout`: the run is killed with every process
below it, in its own session too (nothing of it keeps the GPU for the next part) and the row holds the steps it finished, read from its
metrics.jsonl (a line cut by the kill left out); no finished step is an error row. The whole section
runs end to end in tests/e2e/test_gpu_bench_smoke.py."""

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_gpu_bench():
    spec = importlib.util.spec_from_file_location("megappo_gpu_bench", os.path.join(REPO, "benchmarks", "gpu.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu = load_gpu_bench()

GRANDCHILD = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print("started", child.pid, flush=True)
time.sleep(300)
"""


def dead(pid: int) -> bool:
    import psutil  # here, not at the top: `pytest -m gpu tests/unit` collects this file where psutil may be absent

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped by its new parent
    except psutil.NoSuchProcess:
        return True


def test_a_run_past_its_time_is_killed_with_its_children():
    start = time.perf_counter()
    # 10 s: time for the child to start its grandchild and say so, on a loaded CI machine too
    rc, out = gpu.run_until([sys.executable, "-c", GRANDCHILD], dict(os.environ), timeout=10)
    assert rc is None and time.perf_counter() - start < 60 and "started" in out, out
    grandchild = int(out.split("started")[1].split()[0])
    deadline = time.monotonic() + 30
    while not dead(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dead(grandchild)
    assert gpu.run_until([sys.executable, "-c", "print('done')"], dict(os.environ), timeout=60) == (0, "done\n")


def fake_run(records: list[dict], cut: str, timeouts: list | None = None):
    """A stand-in for run_until: the run wrote these metrics lines and a cut one, then was killed."""

    def run(argv, env, timeout):
        (timeouts if timeouts is not None else []).append(timeout)
        run_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("run.output_dir="))
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
            f.write(cut)
        return None, "megappo: step lines\n"

    return run


def bench(tmp_path, time_limit=None, started_s_ago=0.0):
    settings = argparse.Namespace(e2e_steps=6, e2e_timeout=50, e2e_dir=str(tmp_path), time_limit=time_limit)
    return gpu.Bench(settings=settings, device=torch.device("cpu"), dtype=torch.float32,
                     start=time.perf_counter() - started_s_ago)


def test_a_run_stopped_at_the_timeout_keeps_the_steps_it_finished(tmp_path, monkeypatch):
    steps = [{"step": i, "timing_s/step": 1.0 + i, "timing_s/gen": 0.5 + i / 10, "perf/throughput": 100.0 * i}
             for i in (1, 2, 3)]
    monkeypatch.setattr(gpu, "run_until", fake_run(steps, cut='{"step": 4, "timing_s/st'))
    row = gpu.e2e_row(bench(tmp_path), "tiny", str(tmp_path))
    assert row.status == "ok", row
    values = row.values
    assert values["timed_out"] is True and values["steps"] == 3 and values["steady_steps"] == 2
    assert values["step_s"] == 3.5 and values["gen_spread"] == 0.8 / 0.7
    assert (tmp_path / "tiny" / "e2e.log").read_text() == "megappo: step lines\n"


def test_a_run_stopped_before_its_first_step_is_an_error_row(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "run_until", fake_run([], cut=""))
    row = gpu.e2e_row(bench(tmp_path), "tiny", str(tmp_path))
    assert row.status.startswith("error: RuntimeError: megappo train passed its 50 s (--e2e-timeout, --time-limit) "
                                 "before its first step"), row.status


def test_a_run_gets_what_is_left_of_the_time_limit(tmp_path, monkeypatch):
    """gpu_check gives each gpu.py part --time-limit (its own limit less 15 s): a run is killed 10 s before
    it, so the section still writes its rows; with under 20 s a run is not started."""
    timeouts = []
    step = [{"step": 1, "timing_s/step": 1.0}]
    monkeypatch.setattr(gpu, "run_until", fake_run(step, cut="", timeouts=timeouts))
    assert gpu.e2e_row(bench(tmp_path, time_limit=100, started_s_ago=60), "tiny", str(tmp_path)).status == "ok"
    assert gpu.e2e_row(bench(tmp_path, time_limit=1000), "tiny", str(tmp_path)).status == "ok"
    assert 29 < timeouts[0] <= 30 and timeouts[1] == 50  # 100 - 60 - 10; else --e2e-timeout
    row = gpu.e2e_row(bench(tmp_path, time_limit=100, started_s_ago=75), "tiny", str(tmp_path))
    assert row.status.startswith("error: RuntimeError: no time left for a run") and len(timeouts) == 2
