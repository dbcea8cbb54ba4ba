"""The suite's lanes as a run of `pytest tests` meets them (tests/conftest.py): without SGLang in this
environment, each test file of the SGLang lane (tests/sglang, `make test-sglang`) is one skipped test
that names the lane, not a silent gap; its modules are not imported."""

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LANE = os.path.join(REPO, "tests", "sglang")
pytestmark = pytest.mark.one_process  # one pytest process that collects the lane's stand-ins (tests/conftest.py)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed: the lane runs here")
def test_the_sglang_lane_is_counted_as_skipped_where_sglang_is_absent():
    files = sorted(f for f in os.listdir(LANE) if f.startswith("test_") and f.endswith(".py"))
    others = [f"--ignore=tests/{d}" for d in ("unit", "distributed", "e2e")]  # only the lane's stand-ins collected
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests", *others],
                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"{len(files)} skipped" in out and "passed" not in out, out[-3000:]
    assert f"SKIPPED [{len(files)}]" in out and "(`make test-sglang`" in out, out[-3000:]
