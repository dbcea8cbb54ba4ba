"""rollout.mode=one_step_off with real SGLang generating on CPU: `megappo train recipes/demo-cpu.yaml
rollout.engine=sglang rollout.mode=one_step_off`. Step k+1's batch is generated in rank 0's
generation thread while step k trains; weight syncs (verified by fingerprints each step: a
mismatch would end the run) and validation call the engine from the main thread.

SGLang's sampling is not seeded on CPU (docs/engines.md): every run is another draw, so the
checks are what must hold whatever is sampled, not numbers of one run."""

import json

from tests.e2e.test_cli_demo import cli

STEPS = 8


def test_one_step_off_with_sglang(tmp_path):
    code, out = cli("train", "recipes/demo-cpu.yaml", "rollout.engine=sglang", "rollout.mode=one_step_off",
                    "actor.old_logprob=is_correct", "rollout.sglang.max_total_tokens=4096", "model.dtype=float32",
                    f"run.output_dir={tmp_path}", f"run.total_steps={STEPS}", "run.val_every=4",
                    "checkpoint.save_every=0", "logging.progress_bar=false", timeout=900)
    assert code == 0, out[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert len(steps) == STEPS
    # step 1's batch is generated up front by the initial weights; every later one a version behind
    assert [r["rollout/staleness"] for r in steps] == [0] + [1] * (STEPS - 1)
    # step 1: the engine's log-probs and the trainer's old ones come from the same weights (fp32)
    assert steps[0]["rollout/logprob_diff_max"] <= 1e-5, steps[0]["rollout/logprob_diff_max"]
    # later steps: one policy version apart (the engine really samples from the previous weights),
    # corrected by importance weights near 1
    assert any(r["rollout/logprob_diff_max"] > 1e-3 for r in steps[1:]), [r["rollout/logprob_diff_max"] for r in steps]
    assert all(0.5 < r["rollout/is_weight_mean"] <= 2.0 for r in steps), [r["rollout/is_weight_mean"] for r in steps]
    # validation (main thread, between generations) ran at steps 4 and 8 (and before training)
    assert [r["step"] for r in rows if "val/score/mean" in r] == [0, 4, 8]
