"""The same PPO steps at TP1, TP2, PP2, DP2, with per-role layouts (actor TP2 + critic PP2; actor CP2 +
critic DP2: context parallelism, megappo.parallel.context), and at TP2 with the chunked LM head (model.lm_head_chunk_tokens) give the same losses and metrics.

3 steps of the demo recipe (critic + GAE, same seed, same data, fp32, gloo), launched
through the CLI at each layout. Losses are normalised by global counts and DP gradients
are summed, so every layout computes the same numbers up to float rounding (<= 1e-4).
"""

import json
import os
import sys

import pytest

from tests import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("critic/score/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
        "actor/grad_norm", "critic/vf_loss", "critic/vf_clipfrac", "critic/advantages/mean", "critic/values/mean",
        "response_length/mean")
LAYOUTS = {"tp1": (1, ["parallel.tp=1"]), "tp2": (2, ["parallel.tp=2"]), "pp2": (2, ["parallel.tp=1", "parallel.pp=2"]),
           "dp2": (2, ["parallel.tp=1"]),
           # each role its own layout over the same 2 ranks: actor TP=2, critic PP=2
           "per_role": (2, ["parallel.tp=2", "critic.parallel.tp=1", "critic.parallel.pp=2"]),
           # the chunked LM head (megappo.parallel.chunked_head) in the actor's and reference's passes
           "tp2_chunked_head": (2, ["parallel.tp=2", "model.lm_head_chunk_tokens=7"]),
           # the actor's packed sequences split over 2 context-parallel ranks, the critic data-parallel
           "actor_cp2": (2, ["parallel.tp=1", "actor.parallel.cp=2"]),
           # every role's sequences split over the 2 ranks: the critic's values and updates too
           "cp2": (2, ["parallel.tp=1", "parallel.cp=2"])}


def run_layout(tmp_path, name):
    nproc, overrides = LAYOUTS[name]
    out_dir = tmp_path / name
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "megappo.cli", "train", "--world-size", str(nproc), "recipes/demo-cpu.yaml",
           f"run.output_dir={out_dir}", "run.total_steps=3", "logging.progress_bar=false",
           "actor.micro_batch_size=4", "critic.micro_batch_size=4", *overrides]
    proc = prefork.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "critic/score/mean" in r]  # training steps, not the step-0 validation row


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_layout(tmp_path_factory.mktemp("ref"), "tp1")


def test_recompute_first_micro_batch_kl_is_zero(reference):
    assert all(row["actor/ppo_kl_first_micro_batch"] == pytest.approx(0.0, abs=1e-6) for row in reference)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "per_role", "tp2_chunked_head", "actor_cp2", "cp2"])
def test_layout_matches_tp1(tmp_path, reference, layout):
    rows = run_layout(tmp_path, layout)
    assert len(rows) == len(reference) == 3
    for step, (got, ref) in enumerate(zip(rows, reference), 1):
        for key in KEYS:
            assert got[key] == pytest.approx(ref[key], abs=1e-4), f"{layout} step {step} {key}: {got[key]} vs {ref[key]}"
