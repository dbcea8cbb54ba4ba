"""Partial rollouts through the CLI (2 gloo ranks, the CPU demo with a long tail of response
lengths: up to 32 tokens, a response also ends at any of 5 digits, so most samples stop within a few
tokens and a few run long): samples are aborted, carried and resumed under later weights in every
rollout mode, and a run killed while saving resumes from the previous checkpoint, carried samples
included, bit-identical to the run that went straight through (metrics and trained weights).
The stage itself, on the hf engine: tests/unit/test_partial_rollouts.py."""

import os
import shutil
import sys

import pytest
import torch

from tests.e2e._runs import hf_weights, metrics
from tests.e2e.test_resume import kill_during_save, run

LONG_TAIL = ["rollout.partial.enable=true", "algorithm.adv_estimator=grpo", "rollout.n=4", "rollout.max_new_tokens=32",
             "rollout.partial.chunk_tokens=4", "rollout.stop_token_ids=[3,4,5,6,7]", "data.train_batch_size=16",
             "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=16", "run.total_steps=4",
             "checkpoint.save_every=2", "checkpoint.save_hf_at_end=true", "logging.progress_bar=false"]
# one_step_off also filters groups (DAPO's dynamic sampling: each group judged as it completes) and async
# takes ReMax's greedy baselines, so each mode's run also carries one of what partial rollouts combine with
MODES = {"sync": [],
         "one_step_off": ["rollout.mode=one_step_off", "actor.old_logprob=is_correct",
                          "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                          "data.gen_batch_size=8"],
         "async": ["rollout.mode=async", "rollout.max_staleness=2", "actor.old_logprob=is_correct",
                   "algorithm.adv_estimator=remax"],
         # the MoE demo at EP=2 with routing replay: the carried samples keep their routes
         "sync-moe-replay": ["actor.moe_routing=replay"],
         # the multi-turn lookup demo: episodes carried between and inside actions (4-token turns, 2-token chunks),
         # in bfloat16 (the GPU recipes' dtype): the carried state and its resume are bitwise in bf16 too
         "sync-multiturn": ["rollout.max_turn_tokens=4", "rollout.partial.chunk_tokens=2", "model.dtype=bfloat16"]}
RECIPES = {"sync-moe-replay": "recipes/demo-moe-cpu.yaml", "sync-multiturn": "recipes/demo-multiturn-cpu.yaml"}


def command(out, mode):
    recipe = RECIPES.get(mode, "recipes/demo-cpu.yaml")
    return [sys.executable, "-m", "megappo.cli", "train", "--world-size", "2", recipe,
            f"run.output_dir={out}", *LONG_TAIL, *MODES[mode]]


@pytest.mark.parametrize("mode", list(MODES))
def test_killed_and_resumed_equals_straight_with_samples_carried(mode, tmp_path):
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    run(command(straight, mode))
    got = [r for r in metrics(straight) if "partial/aborted" in r]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert sum(r["partial/aborted"] for r in got) > 0 and sum(r["partial/resumed"] for r in got) > 0, got
    assert max(r["rollout/token_age/max"] for r in got) >= 1  # trained on tokens of earlier weights
    limit = {"one_step_off": 1, "async": 2}.get(mode, 0) + 2  # the mode's staleness + max_token_staleness
    assert max(r["rollout/token_age/max"] for r in got) <= limit
    if mode == "one_step_off":  # uniform groups were judged out and new prompts took their places
        kept, judged = (sum(r[f"filter_groups/{k}"] for r in got) for k in ("kept_groups", "generated_groups"))
        assert judged > kept >= 4 * 16 and sum(r["train/num_gen_batches"] for r in got) * 8 >= judged
    if mode == "async":
        assert all("critic/remax_baseline/mean" in r for r in got)
    if mode == "sync-multiturn":  # the environments' episodes, carried and resumed
        assert all(r["env/turns_mean"] >= 1 for r in got)
    if "moe" in mode:  # the engine's routes were replayed, the carried samples' from their first calls
        assert all(0 <= r["rollout/moe_routes_differ_frac"] < 1 for r in got)

    ckpts = os.path.join(killed, "checkpoints")
    kill_during_save(command(killed, mode), os.path.join(ckpts, "step_00000004.partial"))
    assert open(os.path.join(ckpts, "latest")).read() == "step_00000002"
    assert os.path.isfile(os.path.join(ckpts, "step_00000002", "partial_rollouts.pt"))
    log = run(command(killed, mode))
    assert "resumed from" in log and "step 2" in log
    assert metrics(killed) == metrics(straight)  # steps 3-4 regenerated from the carried samples: same numbers
    a, b = hf_weights(os.path.join(straight, "hf", "actor")), hf_weights(os.path.join(killed, "hf", "actor"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {t.dtype for t in a.values()} == {torch.bfloat16 if "model.dtype=bfloat16" in MODES[mode] else torch.float32}
    if mode == "sync":  # the carried samples are rank 0's, whatever the layout: a resume at DP=2 continues them
        other = str(tmp_path / "dp2")
        shutil.copytree(killed, other)
        log = run(command(other, mode) + ["parallel.tp=1", "run.total_steps=3", "checkpoint.resume_from=2"])
        assert "resumed from" in log and "step 2" in log
        step3 = [r for r in metrics(other) if r["step"] == 3 and "partial/resumed" in r][-1]
        carried = [r for r in got if r["step"] == 3][0]
        assert step3["partial/resumed"] == carried["partial/resumed"] > 0
        # the engine in a process of its own (rollout.placement=separate) generates the same samples
        separate = str(tmp_path / "separate")
        run(command(separate, mode) + ["rollout.placement=separate"])
        assert metrics(separate) == metrics(straight)

