"""benchmarks/gpu.py --smoke end to end: every section runs and reports positive numbers, and the
e2e section's row is what the `megappo train` run's metrics.jsonl says.

The GPU measurement script is run on a GPU machine only now and then; this keeps it from
rotting in between. On a machine without CUDA the rows that need CUDA and a GPU package
(Transformer Engine, SGLang) must say they were skipped, not fail.
"""

import json
import os
import statistics
import sys

import pytest
import torch

from tests import prefork

pytestmark = pytest.mark.alone  # gpu_check.py gives each part a time budget (tests/conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the number that says a row measured something, per section
KEY_NUMBER = {"mfu": "tflops", "gen": "tokens_per_s", "sync": "gb_per_s", "e2e": "tokens_per_s"}


def test_gpu_bench_smoke(tmp_path):
    """Through benchmarks/gpu_check.py --smoke (make gpu-check's driver): the GPU-marked tests (skipped
    here), then gpu.py --smoke; one JSON and one table gather them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    env.pop("OUT", None)
    proc = prefork.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--smoke",
                           "--out", str(tmp_path), "--wheels", str(tmp_path / "no-wheels")],
                       env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert list(report["parts"]) == ["tests", "bench"] and report["wheels"] == []
    assert all(part["status"] == "ok" and part["seconds"] > 0 for part in report["parts"].values()), report["parts"]
    results = report["parts"]["bench"]["results"]
    assert results == json.loads((tmp_path / "bench.json").read_text())
    table = (tmp_path / "gpu-check.txt").read_text()
    assert table in proc.stdout and "[bench]" in table
    assert results["config"]["settings"]["smoke"] is True
    assert set(results["sections"]) == {"mfu", "gen", "sync", "e2e"}
    e2e = results["sections"].pop("e2e")
    for section, rows in results["sections"].items():
        assert not [r["what"] for r in rows if r["status"].startswith("error")], rows
        measured = [r for r in rows if r["status"] == "ok"]
        assert any(r["baseline"] for r in measured), f"{section}: no baseline row"
        assert len(measured) >= 2, f"{section}: a baseline and at least one megappo row"
        for row in measured:
            assert row["values"][KEY_NUMBER[section]] > 0, row
            assert row["values"]["seconds"] > 0, row
        gpu_only = [r for r in rows if r["gpu_only"]]
        assert gpu_only, f"{section}: expected a TE or SGLang row"
        if not torch.cuda.is_available():
            assert all(r["status"].startswith("skipped: ") for r in gpu_only), gpu_only
    mfu = {r["what"]: r["values"] for r in results["sections"]["mfu"] if r["status"] == "ok"}
    assert any("packed 64 update (PolicyWorker.update" in what for what in mfu)  # the trainer's packed path
    chunked = [what for what in mfu if "LM head in chunks of 16" in what]  # the forward and the update rows
    assert len(chunked) == 2, list(mfu)
    profiled = [v["profile"] for v in mfu.values() if "profile" in v]  # the two update rows, profiled once each
    assert len(profiled) == 2 and all(os.path.isfile(p) and "Self CPU" in open(p).read() for p in profiled), profiled
    assert all(v["mfu_vs_matmul"] > 0 for v in mfu.values())
    assert "== sync" in table and "vs copy_" in table
    # e2e: one megappo train run of benchmarks/gpu_e2e/tiny.yaml, summarised from its metrics.jsonl
    (row,) = e2e
    assert row["status"] == "ok", row
    with open(tmp_path / "e2e" / "tiny" / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    steady = steps[1:]
    values = row["values"]
    assert values["steps"] == len(steps) == results["config"]["settings"]["e2e_steps"]
    assert values["step_s"] == statistics.median(r["timing_s/step"] for r in steady)
    assert values["tokens_per_s"] == statistics.median(r["perf/throughput"] for r in steady) > 0
    assert values["stages_s"]["update_actor"] == statistics.median(r["timing_s/update_actor"] for r in steady)
    assert values["plan_gib"] > 0 and values["wall_s"] > values["step_s"]
    if not torch.cuda.is_available():  # no device memory or peak to read on a CPU
        assert values["peak_mem_gib"] is None and values["mfu_actor"] is None
    assert "== e2e" in table and "plan GiB" in table
