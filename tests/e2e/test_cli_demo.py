"""The CLI as a user runs it: the smoke job, the CPU PPO demo learning its task, and its
trained policy exported and used with plain transformers."""

import json
import os
import sys

import pytest

from megappo.models.precision import COMPARE_TOL
from tests import prefork
from tests.doc_console import check_quoted

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = prefork.run([sys.executable, "-m", "megappo.cli", *args], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    return proc.returncode, out


def test_smoke_runs_and_decodes_like_transformers(tmp_path):
    code, out = cli("smoke", "--output-dir", str(tmp_path))
    assert code == 0, out[-6000:]
    assert "== transformers.generate: True" in out
    assert (tmp_path / "megatron_tp2" / "megappo_model.json").is_file()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo recipe trained once (100 steps), shared by the tests below."""
    run_dir = tmp_path_factory.mktemp("demo")
    code, out = cli("train", "recipes/demo-cpu.yaml", f"run.output_dir={run_dir}", "run.total_steps=100",
                    "logging.progress_bar=false")
    assert code == 0, out[-6000:]
    (run_dir / "console.txt").write_text(out)  # what the user saw, for the docs' quoted lines
    return run_dir


def test_docs_quote_what_the_demo_prints(demo_run):
    """README's quoted console lines (marked blocks, tests/doc_console.py) are this run's."""
    check_quoted((demo_run / "console.txt").read_text(), __file__)


def test_demo_recipe_learns(demo_run):
    """README's main job, shortened: PPO with critic+GAE at TP=2 goes from a random policy
    (~0.03 reward) to >= 0.8 mean reward (the right digit, then EOS), writes metrics and the
    curves plot."""
    tmp_path = demo_run
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
    # without partial rollouts no token of a sync step crosses a weight update: every step's engine log-probs
    # are the trainer's weights' (a token one update old differs by far more), and no token has an age
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)
    assert not any("rollout/token_age/max" in r for r in rows)
    assert val_rows[-1]["val/score/mean"] > val_rows[0]["val/score/mean"]  # greedy validation improves too
    assert (tmp_path / "curves.png").is_file()
    ckpts = tmp_path / "checkpoints"  # trainer checkpoints every 50 steps, the last two kept
    assert (ckpts / "latest").read_text() == "step_00000100"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_00000050", "step_00000100"]
    for role in ("actor", "critic"):
        assert (ckpts / "step_00000100" / role / "megappo_model.json").is_file()


def test_demo_learns_in_bf16(tmp_path):
    """The demo in bfloat16, the dtype of every GPU recipe, 40 steps: the reward passes 0.6 over
    steps 31-40 (measured 0.77; 0.86 over steps 36-40 and 0.99 over steps 91-100 of the full 100), the
    engine's log-probs (float32 compute with the bf16 weights it was sent, fingerprint-verified at
    every sync) stay within bf16 rounding of the trainer's, and the actor checkpoint says bfloat16."""
    code, out = cli("train", "recipes/demo-cpu.yaml", f"run.output_dir={tmp_path}", "model.dtype=bfloat16",
                    "run.total_steps=40", "run.val_every=0", "run.val_before_train=false", "checkpoint.save_every=0",
                    "logging.progress_bar=false")
    assert code == 0, out[-6000:]
    assert "Mismatch dtype" not in out  # norms in the model dtype: torch's fused rms_norm
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "critic/score/mean" in r]
    first = sum(r["critic/score/mean"] for r in rows[:5]) / 5
    last = sum(r["critic/score/mean"] for r in rows[-10:]) / 10
    assert len(rows) == 40 and first <= 0.2 and last >= 0.6, f"bf16 demo: {first:.2f} -> {last:.2f}"
    assert all(r["rollout/logprob_diff_mean"] < COMPARE_TOL["bfloat16"] for r in rows)
    meta = json.loads((tmp_path / "checkpoints" / "step_00000040" / "actor" / "megappo_model.json").read_text())
    assert meta["dtype"] == "bfloat16"


def test_exported_demo_policy_answers_with_plain_transformers(demo_run, tmp_path):
    """`megappo export` writes a directory that transformers alone loads (model and the built-in
    tokenizer); greedy decoding answers each prompt with the next digit and stops (EOS)."""
    code, out = cli("export", str(demo_run), str(tmp_path / "bad"), "--tp", "3")  # the fix names the flag
    assert code == 2 and "Fix: choose --tp from [1, 2]" in out and "Traceback" not in out, out
    out_dir = tmp_path / "hf"
    code, out = cli("export", str(demo_run), str(out_dir))
    assert code == 0, out[-6000:]
    script = f"""
import sys
sys.modules["megappo"] = None  # plain transformers: importing megappo would fail
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(out_dir)!r})
model = AutoModelForCausalLM.from_pretrained({str(out_dir)!r}, dtype=torch.float32)
answers = {{}}
for d in range(10):
    ids = tok(f"{{d}}>", return_tensors="pt").input_ids
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    answers[d] = gen[0, ids.shape[1]:].tolist()
print(json.dumps({{"answers": answers, "eos": tok.eos_token_id, "pad": tok.pad_token_id,
                  "config_eos": model.config.eos_token_id, "gen_eos": model.generation_config.eos_token_id,
                  "text": {{d: tok.decode(a, skip_special_tokens=True) for d, a in answers.items()}}}}))
"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    proc = prefork.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["eos"] == got["config_eos"] == got["gen_eos"] == 1 and got["pad"] == 0
    for d, ids in got["answers"].items():
        assert got["text"][d] == str((int(d) + 1) % 10), got
        assert len(ids) == 2 and ids[1] == got["eos"], f"'{d}>' -> {ids}: not one digit and EOS"


def test_bad_recipe_stops_before_any_rank_starts(tmp_path):
    code, out = cli("train", "recipes/demo-cpu.yaml", "parallel.tpp=2")
    assert code != 0 and "unknown config key 'parallel.tpp'. Did you mean 'parallel.tp'" in out
    assert "torch.distributed" not in out
