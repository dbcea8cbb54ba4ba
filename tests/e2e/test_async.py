"""Asynchronous rollouts through the CLI (docs/async.md), on the CPU demo (2 gloo ranks, TP=2):

- rollout.placement=separate (the hf engine in a child process of rank 0) trains exactly as
  colocated: same samples, same metrics, bit for bit;
- rollout.mode=one_step_off: a run killed while saving a checkpoint and resumed from the
  previous one (whose buffered batch, generated ahead, it restores) ends bit-identical to a
  run that went straight through;
- the demo learns in one_step_off mode with the separate engine and is_correct (a lower bar
  than test_cli_demo's, at fewer steps).
"""

import json
import os

from tests.e2e._runs import metrics
from tests.e2e.test_resume import REPO, kill_during_save, run

ASYNC = ["rollout.mode=one_step_off", "rollout.placement=separate", "actor.old_logprob=is_correct"]


def command(out, *extra):
    import sys

    return [sys.executable, "-m", "megappo.cli", "train", "--world-size", "2", os.path.join(REPO, "recipes/demo-cpu.yaml"),
            f"run.output_dir={out}", "logging.progress_bar=false", *extra]


def test_separate_placement_trains_like_colocated(tmp_path):
    args = ["run.total_steps=2", "run.val_every=2"]
    run(command(tmp_path / "colocated", *args))
    run(command(tmp_path / "separate", *args, "rollout.placement=separate"))
    assert metrics(tmp_path / "separate") == metrics(tmp_path / "colocated")


def test_one_step_off_kill_during_save_then_resume_is_bit_identical(tmp_path):
    args = [*ASYNC, "run.total_steps=4", "checkpoint.save_every=2", "run.val_every=2"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(command(straight, *args))
    ckpts = killed / "checkpoints"
    kill_during_save(command(killed, *args), str(ckpts / "step_00000004.partial"))
    assert (ckpts / "latest").read_text() == "step_00000002"
    assert (ckpts / "step_00000002" / "rollout_buffer.pt").is_file()  # step 3's batch, generated during step 2

    log = run(command(killed, *args))
    assert "resumed from" in log and "step 2" in log
    rows = metrics(killed)
    assert rows == metrics(straight)
    assert [r["rollout/staleness"] for r in rows if "rollout/staleness" in r] == [0, 1, 1, 1]


def test_demo_learns_in_one_step_off_mode(tmp_path):
    run(command(tmp_path, *ASYNC, "run.total_steps=40", "run.val_every=0", "checkpoint.save_every=0"), timeout=600)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    rows = [r for r in rows if "critic/score/mean" in r]
    assert len(rows) == 40 and all(r["rollout/staleness"] == 1 for r in rows[1:])
    first = sum(r["critic/score/mean"] for r in rows[:5]) / 5
    last = sum(r["critic/score/mean"] for r in rows[-5:]) / 5
    assert first <= 0.2 and last >= 0.5, (first, last)
    assert all(0.5 < r["rollout/is_weight_mean"] <= 2.0 for r in rows)  # the stale-policy correction is applied
