"""The other algorithms and options through the CLI, 2 steps each on the demo task:
critic-free estimators, KL as a loss and in the reward (adaptive), the three old-log-prob
modes, verl 0.9.1's newer policy losses, estimators and rollout correction (decoupled and
bypass), and a reward model next to the rule-based reward. Each case shows that its policy loss and
estimator ran, by a metric only that loss or estimator computes (a case run with the wrong loss fails).

The algorithm cases run in a world of one (`ONE_RANK`: TP1, no launcher): what they check is the
algorithm's wiring and metrics, which no layout changes; the demo's TP2 runs the same passes in
tests/e2e/test_cli_demo.py and the layouts are compared in tests/e2e/test_parallel_invariance.py.
The reward model runs at the demo's TP2. The one-rank tests are marked one_process (tests/conftest.py)."""

import json
import os
import sys

import pytest
import torch

from megappo.models.hf_reference import build_hf_model, save_hf_dir
from tests import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["run.total_steps=2", "logging.progress_bar=false", "run.val_every=0", "run.val_before_train=false"]
CASES = {
    "grpo+kl_loss": ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.use_kl_loss=true",
                     "actor.kl_loss_type=k3+", "actor.entropy_coeff=0.01", "actor.loss_agg_mode=seq-mean-token-mean"],
    "rloo+kl_in_reward+is_correct": ["algorithm.adv_estimator=rloo", "rollout.n=2", "algorithm.use_kl_in_reward=true",
                                     "algorithm.kl_ctrl.type=adaptive", "actor.old_logprob=is_correct"],
    "reinforce++_bypass+reward_kl": ["algorithm.adv_estimator=reinforce_plus_plus", "actor.old_logprob=bypass",
                                      "algorithm.use_kl_in_reward=true"],
    "remax": ["algorithm.adv_estimator=remax", "rollout.n=2"],
    # verl 0.9.1's losses, estimators and rollout correction (docs/ppo-math.md); one_step_off: the correction
    # sees a policy one version behind
    "gspo+seq_is+rs+one_step_off": ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.policy_loss.loss_mode=gspo",
                                    "actor.loss_agg_mode=seq-mean-token-mean", "rollout.mode=one_step_off",
                                    "algorithm.rollout_correction.rollout_is=sequence",
                                    "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                                    "algorithm.rollout_correction.rollout_rs_threshold=0.01"],
    "bypass_reinforce+icepop+rs": ["algorithm.adv_estimator=grpo_passk", "rollout.n=2",
                                   "algorithm.rollout_correction.bypass_mode=true",
                                   "algorithm.rollout_correction.loss_type=reinforce",
                                   "algorithm.rollout_correction.rollout_is=token",
                                   "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
                                   "algorithm.rollout_correction.rollout_rs=token_k1",
                                   "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
                                   "algorithm.rollout_correction.rollout_is_batch_normalize=true"],
    "cispo+gdpo": ["algorithm.adv_estimator=gdpo", "rollout.n=2", "actor.policy_loss.loss_mode=cispo",
                   "reward.functions=[digit_successor,exact_match]", "algorithm.gdpo_reward_weights=[1.0,0.5]"],
    # DAPO without dynamic sampling (docs/dapo.md): clip-higher, token-mean, overlong shaping (a buffer of
    # 1 of the 2 tokens: a digit and EOS are penalised -0.5) and truncated responses out of the loss
    "dapo_overlong+mask_truncated": ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.clip_ratio_low=0.2",
                                     "actor.clip_ratio_high=0.28", "reward.overlong_buffer.enable=true",
                                     "reward.overlong_buffer.len=1", "reward.overlong_buffer.penalty_factor=0.5",
                                     "reward.overlong_buffer.log=true", "algorithm.mask_truncated_completions=true"],
    "otb+token_tis": ["algorithm.adv_estimator=optimal_token_baseline", "rollout.n=2",
                      "algorithm.rollout_correction.rollout_is=token", "actor.policy_loss.loss_mode=sapo"],
    # the covariance losses with selections the demo fills: kl_cov's top 5% of each micro-batch's tokens, clip_cov's
    # draws among the tokens of positive covariance
    "kl_cov": ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.policy_loss.loss_mode=kl_cov",
               "actor.policy_loss.kl_cov_ratio=0.05"],
    "clip_cov": ["algorithm.adv_estimator=grpo", "rollout.n=4", "actor.policy_loss.loss_mode=clip_cov",
                 "actor.policy_loss.clip_cov_ratio=0.05", "actor.policy_loss.clip_cov_lb=0.0"],
}


def setting(case: str, key: str) -> str | None:
    """The value a case's overrides give `key` (None: the recipe's)."""
    return dict(o.split("=", 1) for o in CASES[case]).get(key)


#: a world of one: one process, TP1
ONE_RANK = ["--world-size", "1", "parallel.tp=1"]


def train(tmp_path, overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = prefork.run([sys.executable, "-m", "megappo.cli", "train", "recipes/demo-cpu.yaml",
                           f"run.output_dir={tmp_path}", *COMMON, *overrides],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.one_process
@pytest.mark.parametrize("case", list(CASES))
def test_algorithm_runs(tmp_path, case):
    rows = train(tmp_path, [*ONE_RANK, *CASES[case]])
    assert len(rows) == 2 and all("actor/pg_loss" in r for r in rows)
    last = rows[-1]
    assert "critic/vf_loss" not in last  # no critic without GAE
    if "kl_loss" in case:
        assert "actor/kl_loss" in last
    if "kl_in_reward" in case:
        assert last["actor/reward_kl_penalty_coeff"] != rows[0]["actor/reward_kl_penalty_coeff"]  # adaptive
        assert "rollout/is_weight_mean" in last
    if "bypass" in case:  # old log-probs are the engine's: the first micro-batch sees a tiny mismatch
        assert abs(last["actor/ppo_kl_first_micro_batch"]) < 1e-4
        assert "timing_s/old_log_prob" not in last  # and the actor does not recompute them
    else:
        assert "timing_s/old_log_prob" in last and "rollout/logprob_diff_max" in last
    if "reward_kl" in case:
        assert "actor/reward_kl_penalty" in last  # KL in the reward from the engine's log-probs
    if "bypass_reinforce" in case:  # the loss forms weights and rejection per micro-batch (averaged)
        assert 0 < last["rollout_corr/rollout_is_mean"] <= 5.0
        assert 0 <= last["rollout_corr/rollout_rs_masked_fraction"] <= 1
        assert 0 < last["rollout_corr/rollout_is_batch_norm_factor"] <= 5.0  # the mini-batch's mean weight
    if "seq_is+rs" in case:  # decoupled: once per batch, from the recomputed old log-probs
        for key in ("rollout_corr/rollout_is_seq_mean", "rollout_corr/rollout_rs_seq_mean_k3_masked_fraction",
                    "rollout_corr/kl", "rollout_corr/chi2_seq", "rollout/is_weight_mean"):
            assert key in last, key
        assert last["rollout/staleness"] == 1 and rows[0]["rollout_corr/kl"] == pytest.approx(0, abs=1e-4)
    if "overlong" in case:  # every 2-token response is penalised; 1-token ones (EOS at once) are not
        for r in rows:
            assert 0 <= r["reward/overlong"] <= 1 and r["reward/overlong_reward"] == pytest.approx(-0.5 * r["reward/overlong"])
            assert r["reward/overlong"] == pytest.approx(r["response_length/mean"] - 1)  # lengths are 1 or 2
            assert r["response_length/masked_truncated"] == r["response_length/clip_ratio"]
    if "token_tis" in case:
        assert 0 < last["rollout_corr/rollout_is_mean"] <= 2.0 and "rollout_corr/rollout_is_eff_sample_size" in last
    # each loss and estimator shows it ran: a metric only it computes (docs/metrics.md), within its bounds
    loss, estimator = setting(case, "actor.policy_loss.loss_mode"), setting(case, "algorithm.adv_estimator")
    if loss == "cispo":  # the mean stopped weight clip(r, 1 - 0.2, 1 + 0.2) (the demo's clip ratios)
        assert all(0.8 <= r["actor/cispo_weight"] <= 1.2 for r in rows)
    if loss == "gspo":  # the sequence ratio exp(row mean of d): 1 on a step's first mini-batch, > 0 always
        assert all(r["actor/gspo_seq_ratio"] > 0 for r in rows)
    if loss == "sapo":  # 4 sigmoid(x)(1 - sigmoid(x)): at most 1 (at r = 1)
        assert all(0 < r["actor/sapo_gate"] <= 1 for r in rows)
    if loss == "kl_cov":  # max(1, floor(5% of a micro-batch's tokens)) penalised in each
        assert all(0 < r["actor/kl_cov_penalised_frac"] <= 0.5 for r in rows)
    if loss == "clip_cov":  # some drawn tokens cut; nothing else counts as clipped
        assert all(0 < r["actor/clip_cov_cut_frac"] <= 0.5 for r in rows)
        assert all(r["actor/pg_clipfrac"] == pytest.approx(r["actor/clip_cov_cut_frac"]) for r in rows)
    if estimator == "gdpo":  # the weighted sum whitened over the response tokens: mean 0, std 1, so some |A| near 1 or
        # more; GRPO's groups of 2 give at most 1/sqrt(2)
        for r in rows:
            assert abs(r["critic/advantages/mean"]) < 1e-5 and max(r["critic/advantages/max"], -r["critic/advantages/min"]) > 0.9
    if estimator == "remax":  # A = score - the greedy response's score on every token (gamma 1, the score on the last)
        for r in rows:
            assert 0 <= r["critic/remax_baseline/mean"] <= 1
            assert r["critic/advantages/max"] <= r["critic/score/max"] - r["critic/remax_baseline/min"] + 1e-6
            assert r["critic/advantages/min"] >= r["critic/score/min"] - r["critic/remax_baseline/max"] - 1e-6


def test_reward_model_adds_its_score(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 19, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    rm = build_hf_model(cfg, seed=3, head="token")
    with torch.no_grad():
        rm.score.bias.fill_(10.0)  # every score >= ~10: visible in the reward
    save_hf_dir(str(tmp_path / "rm"), rm.state_dict(), cfg)
    rows = train(tmp_path / "run", [f"reward.model_path={tmp_path / 'rm'}", "reward.model_weight=1.0"])
    assert rows[0]["critic/score/mean"] > 5.0
    assert rows[0]["perf/tflops/reward_model"] > 0


@pytest.fixture(scope="module")
def ppo_one_rank(tmp_path_factory):
    """One PPO run (critic + GAE) in a world of one that the two tests below read: a KL loss (so a reference
    pass), 3 steps, the actor's warmup 2 training steps, the critic's warmup ratio 0.7."""
    return train(tmp_path_factory.mktemp("ppo_one_rank"), [*ONE_RANK, "actor.use_kl_loss=true", "run.total_steps=3",
                                                           "actor.optim.warmup_steps=2",
                                                           "critic.optim.warmup_steps_ratio=0.7"])


@pytest.mark.one_process
@pytest.mark.xdist_group("ppo_one_rank")
def test_flop_rates_are_logged_on_cpu(ppo_one_rank):
    """PPO (critic + GAE) with a KL loss (so a reference pass): every model stage logs its model
    FLOP rate (megappo.models.flops / megappo.metrics.perf); on CPU there is no peak, so no MFU, and no
    CUDA memory metrics."""
    last = ppo_one_rank[-1]
    for name in ("old_log_prob", "ref", "values", "actor", "critic"):
        assert last[f"perf/tflops/{name}"] > 0, name
    assert not [k for k in last if k.startswith(("perf/mfu/", "perf/max_memory_"))]


@pytest.mark.one_process
@pytest.mark.xdist_group("ppo_one_rank")
def test_the_lr_schedule_moves_once_per_training_step(ppo_one_rank):
    """As verl's: the demo's 4 optimizer steps a training step (2 mini-batches x 2 epochs) share one rate, and
    optim.warmup_steps counts training steps (Megatron's linear warmup from 0: 0, lr / 2, lr). Stepped per
    optimizer step, the first step's rates would be 0, 1/2, 1, 1 x lr. The critic's warmup is verl's ratio of the
    run's steps: int(0.7 x 3) = 2."""
    rows = ppo_one_rank
    assert [r["actor/lr"] for r in rows] == pytest.approx([0.0, 5e-4, 1e-3])
    assert [r["critic/lr"] for r in rows] == pytest.approx([0.0, 5e-4, 1e-3])
