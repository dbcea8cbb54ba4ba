"""The CLI trains a tiny Qwen3-MoE (actor and critic) with PPO on 2 gloo ranks at ep=2:
recipes/demo-moe-cpu.yaml learns its task and logs the MoE router metrics."""

import json

import pytest

from megappo.models.precision import COMPARE_TOL
from tests.e2e._runs import train


def test_moe_demo_learns_at_ep2(tmp_path):
    proc = train("recipes/demo-moe-cpu.yaml", f"run.output_dir={tmp_path}", "logging.progress_bar=false")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "critic/score/mean" in r]
    assert len(rows) == 60
    first = sum(r["critic/score/mean"] for r in rows[:5]) / 5
    last = sum(r["critic/score/mean"] for r in rows[-10:]) / 10
    assert first <= 0.2 and last >= 0.7, f"the MoE demo did not learn: {first:.2f} -> {last:.2f}"
    for r in rows:
        assert r["actor/moe_tokens_dropped"] == 0  # no capacity factor: nothing dropped
        assert 0.9 < r["actor/moe_aux_loss"] < 2.0 and r["actor/moe_load_max_over_mean"] >= 1.0
        assert "actor/moe_load_max_over_mean/layer_1" in r
    assert rows[0]["rollout/logprob_diff_max"] < 1e-4  # engine (fused experts) and Megatron (EP=2) agree
    for role in ("actor", "critic"):
        meta = json.loads((tmp_path / "checkpoints" / "step_00000060" / role / "megappo_model.json").read_text())
        assert meta["expert_parallel"] == 2 and meta["dims"]["num_experts"] == 4


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_moe_demo_with_routing_replay(tmp_path, dtype):
    """actor.moe_routing=replay through the CLI in bf16 (every GPU recipe's dtype): the engine's
    routes are recorded and replayed in every actor and reference pass (KL loss on, so the
    reference runs); the trainer's recomputed log-probs of the engine's tokens stay within bf16
    rounding of the engine's float32 compute and the share of routes that replay changed is
    logged. The float32 claim (within 1e-5 where the trainer's own routers would pick other
    experts) is tested at EP2 and PP2 in tests/distributed/test_routing_replay.py."""
    proc = train("recipes/demo-moe-cpu.yaml", f"run.output_dir={tmp_path}", "logging.progress_bar=false",
                 "actor.moe_routing=replay", "actor.use_kl_loss=true", "run.total_steps=6", "run.val_every=0",
                 "run.val_before_train=false", f"model.dtype={dtype}",
                 # rollout correction beside replay: sequence IS weights and token rejection on the replayed passes
                 "algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_rs=token_k2",
                 "algorithm.rollout_correction.rollout_rs_threshold=0.05")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "critic/score/mean" in r]
    assert len(rows) == 6
    for r in rows:
        assert 0 <= r["rollout/moe_routes_differ_frac"] < 0.5
        if dtype == "float32":
            assert r["rollout/logprob_diff_max"] < 1e-5, r["rollout/logprob_diff_max"]
        else:
            assert r["rollout/logprob_diff_mean"] < COMPARE_TOL[dtype], r["rollout/logprob_diff_mean"]
        assert abs(r["actor/ppo_kl_first_micro_batch"]) < 1e-6
        assert 0 < r["rollout_corr/rollout_is_mean"] <= 2.0 and 0 <= r["rollout_corr/rollout_rs_masked_fraction"] < 0.5


@pytest.mark.one_process  # refused by the config check before any rank starts (tests/conftest.py)
def test_routing_replay_needs_an_moe_actor(tmp_path):
    proc = train("recipes/demo-cpu.yaml", f"run.output_dir={tmp_path}", "actor.moe_routing=replay")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "actor.moe_routing=recompute" in out, out[-3000:]
