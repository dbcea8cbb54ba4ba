"""GPU-only tests are marked `gpu` and skipped on machines without CUDA. tests/sglang (the
CPU SGLang lane, `make test-sglang`) runs in its own virtualenv; a run without SGLang that meets
the folder (`pytest tests`) does not import it and counts each of its files as one skipped test,
naming the lane.

Threads: OMP_NUM_THREADS=1 unless it is set already, as `make test` exports it, so `pytest` alone
runs as `make test` does. It is set before torch is imported here, and every process a test starts
inherits it (torchrun ranks, the CLI, engine children): 2-4 ranks on a 2-core machine, each with a
pool of threads, would oversubscribe the cores. Tests that compare results between processes
computing with different thread counts state their tolerance (tests/e2e/test_remote_engine.py).

Three runs in `make test`: the tests marked `one_process` (every test of tests/unit, marked here, and the
e2e tests that start at most one process of one rank at a time and time nothing, marked in their files) on
every core (pytest-xdist, `-n auto`, test by test); then the multi-process tests two files at a time
(`-n 2 --dist loadfile`: a file's module-scoped runs stay on one worker; their ranks share the cores, and
each waits on the other's now and then); then the tests marked `alone`, one at a time: those that assert
how long something took or give a rank a deadline of seconds, which a neighbour's load could miss. Tests
that share one run (a module-scoped fixture) carry `xdist_group` so one worker runs it.
"""

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402  (after OMP_NUM_THREADS: torch sizes its thread pool from it)

LANE = Path(__file__).parent / "sglang"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
collect_ignore = [] if HAS_SGLANG else ["sglang"]  # its modules import SGLang; its conftest sets the lane's env


class SglangLaneFile(pytest.File):
    """A test file of the SGLang lane met by a run without SGLang: one item that skips, saying where it runs."""

    def collect(self):
        yield SglangLaneNotHere.from_parent(self, name="sglang_lane")


class SglangLaneNotHere(pytest.Item):
    def runtest(self):
        pytest.skip("SGLang is not installed here: the CPU SGLang lane runs this file in its own virtualenv "
                    "(`make test-sglang`, the end of `make test`)")

    def reportinfo(self):
        return self.path, None, f"{self.path.name}: the SGLang lane"


def lane_files_met(config) -> list[Path]:
    """The lane's test files this run would have collected had SGLang been installed (none when it is)."""
    if HAS_SGLANG:
        return []
    where = Path(config.invocation_params.dir)
    asked = [(where / str(a).split("::")[0]).resolve() for a in config.args]
    if not any(a == LANE or a in LANE.parents for a in asked):
        return []
    return sorted(LANE.glob("test_*.py"))


ONE_PROCESS = ("one_process: starts at most one process of one rank at a time and times nothing: `make test` runs "
               "these on every core (pytest-xdist); every test of tests/unit is one")
UNIT = Path(__file__).parent / "unit"


ALONE = ("alone: asserts how long something took, or gives a rank a deadline of seconds: `make test` runs these "
         "one at a time, after the other multi-process tests (which run two files at a time)")


def pytest_configure(config):
    config.addinivalue_line("markers", ONE_PROCESS)
    config.addinivalue_line("markers", ALONE)


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if UNIT in Path(item.path).parents:
            item.add_marker(pytest.mark.one_process)
    if not any(LANE in Path(item.path).parents for item in items):  # the folder named on the command line: collected
        items.extend(item for path in lane_files_met(config)
                     for item in SglangLaneFile.from_parent(session, path=path).collect())
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (megappo's CPU CI has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
