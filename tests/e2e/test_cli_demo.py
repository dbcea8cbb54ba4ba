"""The CLI as a user runs it: the smoke job, and the CPU PPO demo learning its task."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "megappo.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    return proc.returncode, out


def test_smoke_runs_and_decodes_like_transformers(tmp_path):
    code, out = cli("smoke", "--output-dir", str(tmp_path))
    assert code == 0, out[-6000:]
    assert "== transformers.generate: True" in out
    assert (tmp_path / "megatron_tp2" / "megappo_model.json").is_file()


def test_demo_recipe_learns(tmp_path):
    """`make demo` (README's quickstart), shortened: PPO with critic+GAE at TP=2 goes from a
    random policy (`megappo.data.random_policy_score`) to >= 0.8 mean reward, writes metrics
    and the curves plot."""
    code, out = cli("train", "recipes/demo-cpu.yaml", f"run.output_dir={tmp_path}", "run.total_steps=100",
                    "logging.progress_bar=false")
    assert code == 0, out[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val_rows = [r for r in rows if "val/score/mean" in r]
    rows = [r for r in rows if "critic/score/mean" in r]  # training steps (step 0 is validation only)
    assert len(rows) == 100 and len(val_rows) == 6  # before training and every 20 steps
    first = sum(r["critic/score/mean"] for r in rows[:5]) / 5
    last = sum(r["critic/score/mean"] for r in rows[-10:]) / 10
    assert first <= 0.2, first
    assert last >= 0.8, f"the demo did not learn: mean reward over the last 10 steps {last:.2f}"
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                "critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/advantages/mean",
                "response_length/mean", "timing_s/gen", "timing_s/update_actor", "perf/throughput",
                "rollout/logprob_diff_max"):
        assert key in rows[-1], key
    assert rows[0]["rollout/logprob_diff_max"] < 1e-4  # engine and Megatron agree after the first sync
    assert val_rows[-1]["val/score/mean"] > val_rows[0]["val/score/mean"]  # greedy validation improves too
    assert (tmp_path / "curves.png").is_file()
    ckpts = tmp_path / "checkpoints"  # trainer checkpoints every 50 steps, the last two kept
    assert (ckpts / "latest").read_text() == "step_00000100"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_00000050", "step_00000100"]
    for role in ("actor", "critic"):
        assert (ckpts / "step_00000100" / role / "megappo_model.json").is_file()


def test_bad_recipe_stops_before_any_rank_starts(tmp_path):
    code, out = cli("train", "recipes/demo-cpu.yaml", "parallel.tpp=2")
    assert code != 0 and "unknown config key 'parallel.tpp'. Did you mean 'parallel.tp'" in out
    assert "torch.distributed" not in out
