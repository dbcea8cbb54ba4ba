"""Loss aggregation, policy / value / entropy / KL losses: hand-computed numbers, verl's
literal policy loss as the reference, and invariance to micro-batch and DP splits."""

import math

import pytest
import torch

from megappo.ppo.losses import (
    AGG_MODES, LossInputs, agg_loss, entropy_from_logits, entropy_loss, global_counts, kl_loss,
    log_probs_from_logits, policy_loss, policy_loss_reference, value_loss,
)

T = torch.tensor
NAN = float("nan")


# -- aggregation ---------------------------------------------------------------------------------

def test_agg_modes_by_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = T([[1, 1, 0], [1, 1, 1], [0, 0, 0.0]])  # the last row is empty
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(18 / 5)
    assert agg_loss(loss, mask, "token-sum").item() == pytest.approx(18)
    # empty rows are not sequences: mean over 2 rows
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((3 + 15) / 2 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=100).item() == pytest.approx(0.09)
    with pytest.raises(ValueError, match=r"unknown loss_agg_mode 'mean'.*'token-mean'"):
        agg_loss(loss, mask, "mean")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_ignores_nan_at_masked_positions_and_empty_batches_give_zero(mode):
    loss, mask = T([[1.0, NAN], [float("inf"), 3.0]]), T([[1, 0], [0, 1.0]])
    assert math.isfinite(agg_loss(loss, mask, mode).item())
    assert agg_loss(loss, torch.zeros(2, 2), mode).item() == 0.0
    assert agg_loss(loss, torch.zeros(2, 2), mode, global_tokens=0, global_seqs=0).item() == 0.0


def test_dp_size_requires_global_counts():
    for mode in ("token-mean", "seq-mean-token-mean"):
        with pytest.raises(ValueError, match="global counts"):
            agg_loss(torch.ones(1, 2), torch.ones(1, 2), mode, dp_size=2)
    assert agg_loss(torch.ones(1, 2), torch.ones(1, 2), "token-sum", dp_size=2).item() == 4.0


def test_global_counts():
    assert global_counts(T([[1, 1, 0], [0, 0, 0], [1, 0, 0]])) == {"global_tokens": 3, "global_seqs": 2}


def _batch(seed=0, B=8, L=6):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, L, generator=gen) > 0.3).float()
    mask[0, :4] = 0  # left padding
    mask[1, 3:] = 0  # right padding
    mask[2, 2:4] = 0  # a tool-output span
    mask[5] = 0  # an empty response
    return gen, mask


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_and_dp_splits_give_the_whole_batch_loss_and_gradient(mode):
    gen, mask = _batch()
    loss_in = torch.randn(8, 6, generator=gen)
    whole_x = loss_in.clone().requires_grad_()
    whole = agg_loss(whole_x, mask, mode)
    whole.backward()
    counts = global_counts(mask)
    ranks = (slice(0, 4), slice(4, 8))

    # (a) gradients summed over DP ranks and micro-batches (megappo: calculate_per_token_loss)
    x = loss_in.clone().requires_grad_()
    parts = [agg_loss(x[mb:mb + 2], mask[mb:mb + 2], mode, **counts) for r in ranks
             for mb in range(r.start, r.stop, 2)]
    total = sum(parts)
    total.backward()
    assert total.item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(x.grad, whole_x.grad, atol=1e-7)

    # (b) a DP reducer that averages: each rank's micro-batch losses summed, dp_size=2, ranks averaged
    x = loss_in.clone().requires_grad_()
    rank_losses = [sum(agg_loss(x[mb:mb + 2], mask[mb:mb + 2], mode, **counts, dp_size=2)
                       for mb in range(r.start, r.stop, 2)) for r in ranks]
    for rank_loss in rank_losses:
        rank_loss.backward()  # the grads accumulate (sum); the averaging reducer divides by 2
    assert (sum(rank_losses) / 2).item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(x.grad / 2, whole_x.grad, atol=1e-7)


def test_seq_mean_token_sum_norm_needs_a_fixed_scale_when_parts_are_padded_differently():
    gen, mask = _batch(1)
    loss = torch.randn(8, 6, generator=gen)
    whole = agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=6)
    counts = global_counts(mask)
    # micro-batches trimmed to their own longest response (different T per part)
    parts = []
    for mb in range(0, 8, 2):
        width = int(mask[mb:mb + 2].nonzero()[:, 1].max()) + 1 if mask[mb:mb + 2].any() else 1
        parts.append(agg_loss(loss[mb:mb + 2, :width], mask[mb:mb + 2, :width], "seq-mean-token-sum-norm",
                              **counts, loss_scale_factor=6))
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)


# -- policy loss ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [policy_loss, policy_loss_reference])
def test_policy_loss_worked_examples(fn):
    one = torch.ones(1, 1)
    loss, m = fn(LossInputs(T([[0.0]]), T([[0.5]]), T([[0.5]]), one))  # ratio e^0.5 = 1.65 clipped to 1.2
    assert loss.item() == pytest.approx(-0.6)
    assert m["actor/pg_clipfrac"].item() == 1.0 and m["actor/ppo_kl"].item() == pytest.approx(-0.5)
    assert m["actor/pg_clipfrac_lower"].item() == 0.0
    # inside the clip range: -A * ratio
    loss, m = fn(LossInputs(T([[0.0]]), T([[0.1]]), T([[2.0]]), one))
    assert loss.item() == pytest.approx(-2 * math.exp(0.1)) and m["actor/pg_clipfrac"].item() == 0.0
    # negative advantage, huge ratio: dual-clip bounds the loss at -A * c = 0.5 * 3
    loss, m = fn(LossInputs(T([[0.0]]), T([[5.0]]), T([[-0.5]]), one), clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(1.5) and m["actor/pg_clipfrac_lower"].item() == 1.0
    # negative advantage, ratio 2 (< c): the unclipped -A * r is the max
    loss, m = fn(LossInputs(T([[0.0]]), T([[math.log(2.0)]]), T([[-0.5]]), one))
    assert loss.item() == pytest.approx(1.0) and m["actor/pg_clipfrac_lower"].item() == 0.0
    # asymmetric clip: ratio 0.5 with A < 0 is clipped at 1 - 0.1; A > 0 at 1 + 0.3
    loss, m = fn(LossInputs(T([[0.0]]), T([[math.log(0.5)]]), T([[-1.0]]), one), clip_ratio_low=0.1,
                 clip_ratio_high=0.3)
    assert loss.item() == pytest.approx(0.9) and m["actor/pg_clipfrac"].item() == 1.0
    loss, _ = fn(LossInputs(T([[0.0]]), T([[math.log(2.0)]]), T([[1.0]]), one), clip_ratio_low=0.1,
                 clip_ratio_high=0.3)
    assert loss.item() == pytest.approx(-1.3)
    # masked tokens (even NaN ones) and importance weights
    loss, _ = fn(LossInputs(T([[0.0, 0.0]]), T([[0.0, NAN]]), T([[1.0, 7.0]]), T([[1.0, 0.0]]),
                            rollout_is_weights=T([[0.5, 1.0]])))
    assert loss.item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        fn(LossInputs(T([[0.0]]), T([[0.0]]), T([[1.0]]), one), clip_ratio_c=1.0)


def test_policy_loss_log_ratio_clamp_keeps_loss_finite_and_gradient_zero():
    lp = T([[1000.0, -1000.0]], requires_grad=True)
    loss, m = policy_loss(LossInputs(torch.zeros(1, 2), lp, T([[-1.0, 1.0]]), torch.ones(1, 2)))
    loss.backward()
    # token 0: ratio e^20, A < 0: dual-clip at 3; token 1: ratio e^-20, A > 0: -A * e^-20
    assert loss.item() == pytest.approx((3.0 - math.exp(-20)) / 2)
    assert torch.equal(lp.grad, torch.zeros(1, 2))  # clamped log-ratios carry no gradient
    assert m["actor/ppo_kl"].item() == pytest.approx(0.0)  # (-20 + 20) / 2


@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_fast_form_equals_verl_form(mode):
    gen, mask = _batch(2, B=16, L=32)
    old = torch.randn(16, 32, generator=gen) * 0.5
    new = old + torch.randn(16, 32, generator=gen) * 0.6
    adv = torch.randn(16, 32, generator=gen)
    adv[0, :5] = 0.0
    isw = torch.rand(16, 32, generator=gen)
    kw = dict(clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.5)
    x1, x2 = new.clone().requires_grad_(), new.clone().requires_grad_()
    loss1, m1 = policy_loss(LossInputs(old, x1, adv, mask, loss_agg_mode=mode, rollout_is_weights=isw), **kw)
    loss2, m2 = policy_loss_reference(LossInputs(old, x2, adv, mask, loss_agg_mode=mode, rollout_is_weights=isw), **kw)
    loss1.backward()
    loss2.backward()
    assert loss1.item() == pytest.approx(loss2.item(), rel=1e-6)
    assert torch.allclose(x1.grad, x2.grad, atol=1e-7)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert m1[key].item() == pytest.approx(m2[key].item(), abs=1e-7), key
    assert 0 < m1["actor/pg_clipfrac"].item() < 1 and m1["actor/pg_clipfrac_lower"].item() > 0


def test_policy_loss_and_metrics_add_up_over_parts():
    gen, mask = _batch(3)
    old, new, adv = (torch.randn(8, 6, generator=gen) for _ in range(3))
    whole, m_whole = policy_loss(LossInputs(old, new, adv, mask, loss_agg_mode="seq-mean-token-mean"))
    counts = global_counts(mask)
    parts = [policy_loss(LossInputs(old[i:i + 2], new[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                                    loss_agg_mode="seq-mean-token-mean", **counts)) for i in range(0, 8, 2)]
    assert sum(p[0] for p in parts).item() == pytest.approx(whole.item(), rel=1e-6)
    for key, value in m_whole.items():
        assert sum(p[1][key] for p in parts).item() == pytest.approx(value.item(), rel=1e-5, abs=1e-7), key


# -- value, entropy, KL losses -------------------------------------------------------------------

def test_value_loss_clipping_by_hand():
    one = torch.ones(1, 1)
    # unclipped (2 - 0)^2 = 4, clipped (1.5 - 0)^2 = 2.25 -> 0.5 * 4
    loss, clipfrac = value_loss(T([[2.0]]), T([[0.0]]), T([[1.0]]), one, cliprange_value=0.5)
    assert loss.item() == pytest.approx(2.0) and clipfrac.item() == 0.0
    # vpred 1.8 moved past 1.5: clipped error (1.5 - 2)^2 = 0.25 > (1.8 - 2)^2 = 0.04
    loss, clipfrac = value_loss(T([[1.8]]), T([[2.0]]), T([[1.0]]), one, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * 0.25) and clipfrac.item() == 1.0
    loss, clipfrac = value_loss(T([[1.0, 3.0, 9.0]]), T([[0.0, 3.0, 0.0]]), T([[1.0, 3.0, 9.0]]),
                                T([[1, 1, 0.0]]), loss_agg_mode="token-sum")
    assert loss.item() == pytest.approx(0.5) and clipfrac.item() == 0.0
    gen, mask = _batch(4)
    v, r, old = (torch.randn(8, 6, generator=gen) for _ in range(3))
    whole, _ = value_loss(v, r, old, mask)
    parts = sum(value_loss(v[i:i + 4], r[i:i + 4], old[i:i + 4], mask[i:i + 4], **global_counts(mask))[0]
                for i in (0, 4))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_full_vocab_log_probs_and_entropy_by_hand():
    logits = T([[[0.0, math.log(3.0)]]])  # p = [1/4, 3/4]
    assert log_probs_from_logits(logits, T([[1]])).item() == pytest.approx(math.log(0.75))
    assert entropy_from_logits(logits).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    shifted = T([[[0.0, math.log(3.0)]]], dtype=torch.float64) + 1e4
    assert entropy_from_logits(shifted).item() == pytest.approx(0.5623351446, rel=1e-9)  # no cancellation
    assert log_probs_from_logits(logits.bfloat16(), T([[1]])).dtype == torch.float32
    assert log_probs_from_logits(logits.double(), T([[1]])).dtype == torch.float64


def test_padding_logits_of_minus_inf_give_finite_values_and_gradients():
    x = T([[[0.0, math.log(3.0), -math.inf]]], requires_grad=True)
    lp, ent = log_probs_from_logits(x, T([[1]])), entropy_from_logits(x)
    (lp + ent).sum().backward()
    assert lp.item() == pytest.approx(math.log(0.75)) and ent.item() == pytest.approx(0.5623351)
    assert torch.isfinite(x.grad).all() and x.grad[0, 0, 2].item() == 0.0
    ref = T([[[0.0, math.log(3.0)]]], requires_grad=True)
    (log_probs_from_logits(ref, T([[1]])) + entropy_from_logits(ref)).sum().backward()
    assert torch.allclose(x.grad[..., :2], ref.grad)


def test_entropy_and_kl_loss_terms():
    logits = torch.zeros(1, 2, 4)  # uniform over 4: entropy log 4 on each token
    assert entropy_loss(logits, T([[1, 0.0]])).item() == pytest.approx(math.log(4))
    assert entropy_loss(logits, T([[1, 1.0]]), "token-sum").item() == pytest.approx(2 * math.log(4))
    lp, ref = T([[0.0, 0.0]]), T([[math.log(0.5), 5.0]])
    assert kl_loss(lp, ref, T([[1, 0.0]]), kl_loss_type="k1").item() == pytest.approx(math.log(2))
    assert kl_loss(lp, ref, T([[1, 0.0]])).item() == pytest.approx(0.5 + math.log(2) - 1)  # low_var_kl
    assert kl_loss(lp, ref, T([[1, 1.0]]), kl_loss_type="k3", global_tokens=4).item() == pytest.approx(
        (0.5 + math.log(2) - 1 + 10) / 4)  # k3 of log r = 5 is clamped to 10
