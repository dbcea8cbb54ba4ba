"""DAPO's dynamic sampling (algorithm.filter_groups, docs/dapo.md) through the CLI on the CPU demos
(2 gloo ranks, TP=2), set so that some groups are dropped and some steps need more than one
generation batch or reach max_num_gen_batches (on_limit=fill):

- a run killed after its step-2 checkpoint and resumed ends bit-identical (metrics, exported
  weights) to a straight run, in rollout.mode one_step_off (on 2 engine replicas) and async (max_staleness 2: the
  checkpoint buffers batches generated ahead, their scores and filter metrics with them; with
  run.critic_warmup=2 there, so the run resumes from a checkpoint taken in warmup), and the
  filter's metrics say what it did; sync: the multi-turn demo (environment scores) resumes
  exactly with filtering (tests/e2e/test_multiturn_demo.py);
- on_limit=stop ends the run with one clear error line;
- the demo learns under DAPO (the bar below).
"""

import json

import pytest

from tests import prefork
from tests.e2e._runs import hf_weights, metrics
from tests.e2e.test_async import command
from tests.e2e.test_resume import REPO, env, kill_when, run

FILTER = ["algorithm.filter_groups.enable=true", "rollout.n=4", "data.train_batch_size=16", "data.gen_batch_size=24",
          "algorithm.filter_groups.max_num_gen_batches=3", "actor.ppo_mini_batch_size=16",
          "critic.ppo_mini_batch_size=16"]
#: async also carries run.critic_warmup=2 (the killed run resumes from the step-2 checkpoint, taken in warmup: the
#: actor's optimizer has taken no step) and the staleness bound 2 (the checkpoint buffers the batches generated ahead)
#: one_step_off also generates on 2 engine replicas (rollout.replicas=2, one per rank: docs/engines.md#replicas), so a
#: run with replicas resumes exactly too (the batch generated ahead, split over both, buffered in the checkpoint)
MODES = {"one_step_off": ["rollout.mode=one_step_off", "rollout.replicas=2"],
         "async": ["rollout.mode=async", "rollout.max_staleness=2", "run.critic_warmup=2"]}


@pytest.mark.parametrize("mode", list(MODES))
def test_filtered_run_killed_then_resumed_is_bit_identical(tmp_path, mode):
    args = [*FILTER, *MODES[mode], "run.total_steps=4", "checkpoint.save_every=2", "run.val_every=2",
            "checkpoint.save_hf_at_end=true"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(command(straight, *args))
    log = killed / "metrics.jsonl"
    kill_when(command(killed, *args), lambda: log.is_file() and '"step": 3' in log.read_text(), "step 3 was logged")
    assert (killed / "checkpoints" / "latest").read_text() == "step_00000002"
    assert "resumed from" in run(command(killed, *args))
    rows = metrics(straight)
    assert metrics(killed) == rows
    assert hf_weights(killed / "hf" / "actor").keys() == hf_weights(straight / "hf" / "actor").keys()
    assert all(a.equal(b) for a, b in zip(hf_weights(killed / "hf" / "actor").values(),
                                           hf_weights(straight / "hf" / "actor").values()))
    steps = [r for r in rows if "critic/score/mean" in r]
    assert len(steps) == 4
    if mode == "async":  # batches generated ahead of the trainer, up to the bound
        assert [r["rollout/staleness"] for r in steps] == [0, 1, 2, 2]
    if mode == "async":  # critic warmup: steps 1-2 update the critic alone (no actor metrics, no lr step)
        assert [("actor/pg_loss" in r, "critic/vf_loss" in r, "actor/lr" in r) for r in steps] == \
            [(False, True, False)] * 2 + [(True, True, True)] * 2
        critic = [hf_weights(d / "hf" / "critic") for d in (killed, straight)]
        assert all(a.equal(b) for a, b in zip(critic[0].values(), critic[1].values()))
    for r in steps:  # generated groups = kept + dropped; the batch is train_batch_size groups
        kept, hit = r["filter_groups/kept_groups"], r["filter_groups/hit_limit"]
        assert kept == 16 or (hit == 1 and kept < 16), r
        assert r["filter_groups/generated_groups"] == 24 * r["train/num_gen_batches"]
        passed = r["filter_groups/kept_fraction"] * r["filter_groups/generated_groups"]
        assert round(passed) == kept + r["filter_groups/discarded_surplus_samples"] / 4
        assert r["filter_groups/evicted_samples"] == 4 * (r["filter_groups/generated_groups"] - passed - (16 - kept))
    assert any(r["train/num_gen_batches"] > 1 for r in steps) and any(r["filter_groups/evicted_samples"] for r in steps)
    # validation (not filtered, greedy) before training and every run.val_every=2 steps; the resumed run does not
    # validate again on resuming (its rows equal the straight run's, above)
    assert [r["step"] for r in rows if "val/score/mean" in r] == [0, 2, 4]


def test_on_limit_stop_ends_the_run_with_one_line(tmp_path):
    cmd = command(tmp_path, *FILTER, "algorithm.filter_groups.max_num_gen_batches=1", "data.gen_batch_size=16",
                  "algorithm.filter_groups.on_limit=stop", "run.total_steps=2", "run.val_before_train=false")
    proc = prefork.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    [line] = [x for x in out.splitlines() if x.startswith("megappo: error:")]
    assert "step 1: algorithm.filter_groups kept" in line and "generated too many batches" in line
    assert "Fix: raise algorithm.filter_groups.max_num_gen_batches" in line
    assert not (tmp_path / "metrics.jsonl").is_file() or not any(
        "critic/score/mean" in json.loads(x) for x in open(tmp_path / "metrics.jsonl"))


#: DAPO on the demo task (GRPO, clip-higher, token-mean, dynamic sampling). Measured (2026-11-26, 40 steps):
#: the mean score of everything generated 0.13 / 0.36 / 0.60 / 0.91 over steps 1-10 / 11-20 / 21-30 / 31-40
#: (0.93 over 36-40; plain GRPO with the same settings: 0.10 / 0.33 / 0.73 / 0.95); the kept-group fraction rises
#: to 0.9 by step 11 and falls to 0.07 as groups become all right. Overlong shaping is left out: the demo's
#: right answer (the digit, then EOS) fills its 2-token budget, so any buffer penalises it.
DAPO = ["algorithm.adv_estimator=grpo", "rollout.n=4", "critic.enable=false", "actor.clip_ratio_low=0.2",
        "actor.clip_ratio_high=0.28", "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=3", "data.gen_batch_size=96"]


def test_demo_learns_under_dapo(tmp_path):
    run(command(tmp_path, *DAPO, "run.total_steps=40", "run.val_every=0", "checkpoint.save_every=0"))
    steps = [r for r in metrics(tmp_path) if "critic/score/mean" in r]
    generated = [r["filter_groups/generated_score_mean"] for r in steps]
    first, last = sum(generated[:5]) / 5, sum(generated[-5:]) / 5
    assert len(steps) == 40 and first <= 0.2 and last >= 0.8, (first, last)
    kept = [r["filter_groups/kept_fraction"] for r in steps]
    assert min(kept) < 0.5 < max(kept) and any(r["train/num_gen_batches"] > 1 for r in steps)
