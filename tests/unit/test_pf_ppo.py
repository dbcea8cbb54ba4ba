"""PF-PPO (megappo.ppo.pf_ppo; algorithm.use_pf_ppo): verl's weights worked out by hand and against a
per-sample loop, the draw reproducible from its generator and in proportion to the weights, the
experience resampled row by row, and the config read from verl's keys (GAE only, as verl applies it)."""

import pytest
import torch

from megappo.config import ConfigError, read_config
from megappo.ppo.pf_ppo import resample_indices, weights
from megappo.trainer.roles import Experience, SeqBatch

SCORES = torch.tensor([1.0, -2.0, 0.0, 0.5])


def _loop_weights(scores, method, weight_pow):
    """verl's compute_weights, one sample at a time."""
    top, low = max(scores.tolist()), min(scores.tolist())
    out = []
    for s in scores.tolist():
        w = abs(s) ** weight_pow if method == "pow" else \
            float(s in (top, low)) if method == "max_min" else (0.4 if s == top else 0.1)
        out.append(max(w + 1e-8, 1e-8))
    return torch.tensor(out)


@pytest.mark.parametrize("method,want", [("pow", [1.0, 4.0, 0.0, 0.25]), ("max_min", [1.0, 1.0, 0.0, 0.0]),
                                         ("max_random", [0.4, 0.1, 0.1, 0.1])])
def test_weights_by_hand_and_against_the_loop(method, want):
    got = weights(SCORES, method, 2.0)
    assert torch.allclose(got, torch.tensor(want) + 1e-8, rtol=0, atol=1e-7)
    assert got.min() >= 1e-8  # a zero weight is still drawn now and then, as in verl
    scores = torch.randn(50, generator=torch.Generator().manual_seed(0)).round(decimals=1)
    for p in (0.5, 1.0, 3.0):
        assert torch.allclose(weights(scores, method, p), _loop_weights(scores, method, p))


def test_an_unknown_method_is_an_error():
    with pytest.raises(ValueError, match="is not one of"):
        weights(SCORES, "softmax")


def test_draws_are_reproducible_and_in_proportion_to_the_weights():
    scores = torch.tensor([1.0] * 5000 + [2.0] * 5000)  # pow 2: weights 1 and 4, so 1/5 of draws from the first half
    draw = resample_indices(scores, "pow", 2.0, generator=torch.Generator().manual_seed(3))
    again = resample_indices(scores, "pow", 2.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(draw, again) and draw.shape == (10000,) and draw.dtype == torch.int64
    assert 0.18 < (draw < 5000).float().mean().item() < 0.22
    assert set(resample_indices(SCORES, "max_min", generator=torch.Generator().manual_seed(0)).tolist()) <= {0, 1}


def test_experience_is_resampled_row_by_row():
    n, t, r = 3, 5, 2
    ids = torch.arange(n * t).view(n, t)
    seqs = SeqBatch(input_ids=ids, attention_mask=torch.ones(n, t), response_mask=torch.ones(n, r), prompt_len=3)
    exp = Experience(seqs=seqs, old_log_probs=torch.arange(n * r).float().view(n, r),
                     advantages=-torch.arange(n * r).float().view(n, r), values=torch.zeros(n, r),
                     returns=torch.ones(n, r))
    got = exp.select(torch.tensor([2, 0, 2]))
    assert torch.equal(got.seqs.input_ids, ids[[2, 0, 2]]) and got.seqs.prompt_len == 3
    assert torch.equal(got.advantages, exp.advantages[[2, 0, 2]])
    assert torch.equal(got.old_log_probs[1], exp.old_log_probs[0])
    assert got.ref_log_probs is None and got.rollout_is_weights is None


def test_verls_pf_ppo_keys_are_megappos():
    cfg, reading = read_config(None, ["model.path=/m", "algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=True",
                                      "algorithm.pf_ppo.reweight_method=max_min", "algorithm.pf_ppo.weight_pow=1.5"])
    a = cfg.algorithm
    assert (a.use_pf_ppo, a.pf_ppo.reweight_method, a.pf_ppo.weight_pow) == (True, "max_min", 1.5)
    assert reading.read == [] and reading.unused == []  # the same names: nothing to read as another key
    with pytest.raises(ConfigError, match="verl applies it with algorithm.adv_estimator=gae only and ignores it "
                                          "with grpo. Fix: set algorithm.adv_estimator=gae"):
        read_config(None, ["model.path=/m", "algorithm.adv_estimator=grpo", "rollout.n=2",
                           "algorithm.use_pf_ppo=true"])
    with pytest.raises(ConfigError, match="algorithm.pf_ppo.reweight_method"):
        read_config(None, ["model.path=/m", "algorithm.pf_ppo.reweight_method=softmax"])
