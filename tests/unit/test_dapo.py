"""DAPO's overlong reward shaping (megappo.ppo.overlong) against verl 0.9.1's formula written out by
hand, and how the orchestrator applies it and algorithm.mask_truncated_completions to a batch
(megappo.rewards.scoring.Scorer, megappo.trainer.step.make_experience) on a config of the CPU demo, no models."""

import types

import pytest
import torch

from megappo.trainer import step as trainer_step
from megappo.ppo.overlong import overlong_metrics, overlong_penalty
from megappo.config import load_config
from megappo.rewards.scoring import Scorer
from megappo.types import RolloutBatch

DEMO = "recipes/demo-cpu.yaml"


def verl_penalty(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """verl/workers/reward_manager/dapo.py, line by line."""
    expected_len = max_resp_len - buffer_len
    exceed_len = length - expected_len
    return min(-exceed_len / buffer_len * factor, 0)


@pytest.mark.parametrize("max_len,buffer_len,factor", [(20, 4, 1.0), (20480, 4096, 1.0), (8, 8, 0.5), (5, 1, 2.0)])
def test_penalty_is_verls_at_every_length(max_len, buffer_len, factor):
    lengths = torch.arange(0, max_len + 1)
    got = overlong_penalty(lengths, max_len=max_len, buffer_len=buffer_len, penalty_factor=factor)
    want = torch.tensor([verl_penalty(L, max_len, buffer_len, factor) for L in lengths.tolist()])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)


def test_penalty_at_the_buffer_edges_by_hand():
    # max 20, buffer 4: no penalty up to 16 tokens, -0.25 per token after, -1 (the factor) at 20
    got = overlong_penalty(torch.tensor([0, 15, 16, 17, 18, 20]), max_len=20, buffer_len=4, penalty_factor=1.0)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(torch.tensor([20]), max_len=20, buffer_len=4, penalty_factor=0.5).item() == -0.5
    assert overlong_metrics(got) == {"reward/overlong_reward": pytest.approx(-1.75 / 6), "reward/overlong": 0.5}


def batch_of(lengths, finish, *, width=4):
    n = len(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return RolloutBatch(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                        response_ids=mask.clone(), response_mask=mask, rollout_log_probs=torch.zeros(n, width),
                        finish_reasons=finish, prompt_index=torch.tensor([i // 2 for i in range(n)]))


def fake_run(*overrides):
    cfg = load_config(DEMO, ["rollout.max_new_tokens=4", *overrides])
    return types.SimpleNamespace(cfg=cfg, kl_ctrl=None, scorer=Scorer(cfg.reward, None, cfg.rollout.max_new_tokens))


def test_rewards_add_the_penalty_to_the_score_and_log_it():
    run = fake_run("reward.functions=[]", "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2",
                   "reward.overlong_buffer.log=true")
    batch = batch_of([1, 2, 3, 4], ["stop", "stop", "stop", "length"])
    batch.env_scores = torch.tensor([1.0, 1.0, 0.0, 1.0])  # stands for the functions' scores
    assert run.scorer.totals(batch).tolist() == [1.0, 1.0, -0.5, 0.0]
    assert run.scorer.overlong_metrics(batch) == {"reward/overlong_reward": -0.375, "reward/overlong": 0.5}
    off = fake_run("reward.functions=[]")
    assert off.scorer.totals(batch).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert off.scorer.overlong_metrics(batch) == {}


def test_multi_turn_length_counts_observation_tokens():
    """The budget counts a whole episode (actions and observations): so does the penalty."""
    run = fake_run("reward.functions=[]", "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2")
    batch = batch_of([4, 4], ["stop", "stop"])
    batch.response_attention_mask = batch.response_mask.clone()
    batch.response_mask = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]])  # actions; the rest observations / padding
    batch.response_attention_mask[1, 3] = 0  # the second episode has 3 real tokens
    assert run.scorer.totals(batch).tolist() == [-1.0, -0.5]


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_truncated_responses_leave_the_loss_mask_but_keep_their_advantage(mask_truncated):
    run = fake_run("algorithm.adv_estimator=grpo", "rollout.n=2",
                   f"algorithm.mask_truncated_completions={str(mask_truncated).lower()}")
    batch = batch_of([1, 4, 2, 4], ["stop", "length", "stop", "length"])
    batch.clipped = None
    seqs = trainer_step.to_seqs(batch)
    exp, m = trainer_step.make_experience(run, batch, seqs, torch.tensor([1.0, 0.0, 0.0, 1.0]), None, None, None)
    # GRPO's groups (0, 1) and (2, 3): the truncated samples still count in their group's baseline
    assert exp.advantages[:, 0].tolist() == pytest.approx([0.7071, -0.7071, -0.7071, 0.7071], abs=1e-4)
    kept = exp.seqs.response_mask
    if mask_truncated:
        assert kept.sum(-1).tolist() == [1, 0, 2, 0] and m["response_length/masked_truncated"] == 0.5
    else:
        assert torch.equal(kept, batch.response_mask) and "response_length/masked_truncated" not in m


def test_a_multi_turn_episode_is_truncated_when_it_ran_out_of_the_budget():
    batch = batch_of([1, 4], ["length", "stop"])
    batch.clipped = torch.tensor([False, True])  # an action cut by its turn's budget alone is not truncated
    assert batch.truncated.tolist() == [False, True]
    kept, fraction = trainer_step.mask_truncated(batch, batch.response_mask)
    assert kept.sum(-1).tolist() == [1, 0] and fraction == 0.5
