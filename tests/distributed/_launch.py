"""Launch a worker script under torchrun (gloo, CPU) and fail the test with its output. The agent and its
ranks are forks of tests/prefork.py's server (torch and Megatron-Core imported once per pytest process)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(REPO, "tests", "distributed", "workers")


def run_torchrun(script: str, nproc: int, *args: str, timeout: int = 300) -> str:
    """Run `script` (a path, or a file name under tests/distributed/workers) on `nproc`
    local ranks; return its combined output, or raise AssertionError with the output."""
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", TORCHELASTIC_ERROR_FILE="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--standalone", path, *map(str, args)]
    try:
        proc = prefork.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"{script} {args} timed out after {timeout}s:\n{out[-6000:]}") from None
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"{script} {args} failed (exit {proc.returncode}):\n{out[-8000:]}")
    return out
