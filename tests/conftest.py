"""GPU-only tests are marked `gpu` and skipped on machines without CUDA. tests/sglang (the
CPU SGLang lane, `make test-sglang`) runs in its own virtualenv and is left out elsewhere.

Threads: OMP_NUM_THREADS=1 unless it is set already, as `make test` exports it, so `pytest` alone
runs as `make test` does. It is set before torch is imported here, and every process a test starts
inherits it (torchrun ranks, the CLI, engine children): 2-4 ranks on a 2-core machine, each with a
pool of threads, would oversubscribe the cores. Tests that compare results between processes
computing with different thread counts state their tolerance (tests/e2e/test_remote_engine.py).
"""

import importlib.util
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402  (after OMP_NUM_THREADS: torch sizes its thread pool from it)

collect_ignore = [] if importlib.util.find_spec("sglang") else ["sglang"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (megappo's CPU CI has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
