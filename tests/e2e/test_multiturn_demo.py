"""The multi-turn CPU demo through the CLI (2 gloo ranks, TP=2): the model learns to use the
`lookup` environment, engine and trainer agree on the action tokens' log-probs with observation
tokens in the sequences, and a multi-turn run resumes exactly.

The full claim (mean training reward >= 0.8 within 10 minutes, 300 steps) is measured in
benchmarks/RESULTS.md; here a lower bar at 80 steps keeps the test near 1.5 minutes.
"""

import json
import os
import sys

from megappo.models.precision import COMPARE_TOL
from tests import prefork
from tests.e2e._runs import metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = "recipes/demo-multiturn-cpu.yaml"


def train(out, *args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = prefork.run([sys.executable, "-m", "megappo.cli", "train", RECIPE, f"run.output_dir={out}",
                           "logging.progress_bar=false", *args], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout


def resumes_exactly(tmp_path, *args) -> list[dict]:
    """4 steps straight, and 2 then 2 more resumed from the step-2 checkpoint: steps 3-4 must log the same
    metrics. Returns the straight run's metrics."""
    train(tmp_path / "straight", "run.total_steps=4", *args)
    train(tmp_path / "resumed", "run.total_steps=2", *args)
    train(tmp_path / "resumed", "run.total_steps=4", *args)
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r for r in straight if r["step"] > 2] == [r for r in resumed if r["step"] > 2]
    return straight


def test_demo_learns_to_use_the_environment(tmp_path):
    out = train(tmp_path, "run.total_steps=80", "run.val_every=80", "checkpoint.save_every=0")
    assert "estimator=gae env=lookup" in out  # the start-up line names rollout.env
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    val = [r for r in rows if "val/score/mean" in r]
    assert len(steps) == 80 and len(val) == 2
    first = sum(r["critic/score/mean"] for r in steps[:5]) / 5
    last = sum(r["critic/score/mean"] for r in steps[-10:]) / 10
    assert first <= 0.2, first
    # 0.2 is the lookup alone and 0.08 the best without it: above 0.28 the model looks up, then answers
    # (measured 0.33 over steps 71-80; 0.62 over steps 101-150 and 0.8 by step 182 in the full run)
    assert last >= 0.28, f"the multi-turn demo did not learn: mean reward over steps 71-80 {last:.2f}"
    assert steps[-1]["env/turns_mean"] > 1.5 and steps[-1]["env/lookups"] >= 48  # of 64 episodes
    # observation tokens are in the trainer's sequences, attended to and left out of the check
    assert max(r["rollout/logprob_diff_max"] for r in steps) < 1e-4
    for key in ("env/episode_length_mean", "env/truncated_frac", "env/action_clip_ratio", "critic/vf_explained_var"):
        assert key in steps[-1], key
    # LookupEnv's metric_keys are in every step's record, also before any episode answered right
    assert all("env/correct" in r and "env/lookups" in r for r in steps)
    assert "val/env/turns_mean" in val[-1] and val[-1]["val/score/mean"] > val[0]["val/score/mean"]


def test_multi_turn_run_resumes_exactly(tmp_path):
    """Per-turn seeds: 4 steps straight equal 2 steps, then a resumed run to 4; in bf16, the dtype of
    every GPU recipe (the multi-turn runner's observation masks and per-turn log-probs in bf16). With
    verl's multi-turn estimator (tir_optimal_token_baseline: the action tokens of each episode packed
    across observation spans) and rollout correction (token IS, token_k3 rejection) on those masks.
    With DAPO's dynamic sampling (docs/dapo.md) on the environment's scores: groups dropped, a second
    generation batch drawn, all of it seeded so the resumed steps repeat."""
    args = ["checkpoint.save_every=2", "run.val_every=2", "model.dtype=bfloat16", "rollout.n=4",
            "data.train_batch_size=8", "data.gen_batch_size=16", "actor.ppo_mini_batch_size=8",
            "critic.ppo_mini_batch_size=8", "algorithm.filter_groups.enable=true",
            "algorithm.adv_estimator=tir_optimal_token_baseline",
            "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=1e-6"]
    straight = resumes_exactly(tmp_path, *args)
    assert any("env/turns_mean" in r for r in straight)
    trained = [r for r in straight if "critic/score/mean" in r]
    assert all(r["filter_groups/evicted_samples"] > 0 and "env/turns_mean" in r for r in trained)
    assert all("rollout_corr/rollout_is_mean" in r for r in trained)
    assert any(r["rollout_corr/rollout_rs_masked_fraction"] > 0 for r in trained)  # bf16's mismatch rejects some
    # engine (float32 compute with the bf16 weights) and trainer (bf16) on the action tokens
    assert all(r["rollout/logprob_diff_mean"] < COMPARE_TOL["bfloat16"] for r in straight if "critic/score/mean" in r)
