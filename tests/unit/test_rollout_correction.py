"""Rollout correction: verl 0.9.1's rollout_corr_helper written out step by step here as the
reference (no verl import) and compared with megappo.ppo.rollout_correction on random padded
batches with extreme log ratios (weights, masks and every metric); numbers worked out by
hand; threshold parsing errors; the bypass-mode losses against losses.policy_loss and
-A * w * log_prob, their gradients and their invariance to row splits."""

import math

import pytest
import torch

from megappo.ppo.losses import AGG_MODES, LossInputs, agg_loss, global_counts, policy_loss, policy_loss_reference
from megappo.ppo.correction_spec import (
    RS_OPTIONS, RsBounds, parse_is_threshold, parse_rs_options, parse_rs_thresholds, validate,
)
from megappo.ppo.rollout_correction import (
    PRESETS, bypass_mode_loss, is_weight_sums, is_weights, offpolicy_metrics, reinforce_loss, rejection_mask,
    rollout_correction, weights_need_batch_mean,
)

T = torch.tensor
BOUND = 20.0


# -- verl, step by step ----------------------------------------------------------------------------

def v_masked_sum(values, mask, axis=None):
    """verl/utils/torch_functional.py::masked_sum"""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def v_masked_mean(values, mask, axis=None):
    """verl/utils/torch_functional.py::masked_mean"""
    return v_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def v_parse_is_threshold(spec):
    """verl/trainer/ppo/rollout_corr_helper.py::_parse_rollout_is_threshold (valid inputs only)"""
    if isinstance(spec, str) and "_" in spec:
        lo, up = spec.split("_", 1)
        return float(up), float(lo)
    return float(spec), None


def v_parse_rs_thresholds(options, spec):
    """verl/trainer/ppo/rollout_corr_helper.py::_parse_rollout_rs_thresholds (valid inputs only)"""
    raw = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(raw) == 1 and len(options) > 1:
        raw = raw * len(options)
    out = {}
    for option, s in zip(options, raw):
        if option.endswith("k1"):
            if "_" in s:
                lo, up = s.split("_", 1)
            else:
                up, lo = s, str(1.0 / float(s))
            out[option] = {"lower": float(lo), "upper": float(up)}
        else:
            out[option] = {"lower": None, "upper": float(s)}
    return out


def v_rs_metrics(option, stat, mask, seq_valid, level, per_seq, upper, lower, apply_lower):
    """verl/trainer/ppo/rollout_corr_helper.py::compute_rs_metrics"""
    m, p, mb = {}, f"rollout_rs_{option}", mask.bool()
    seq_values = per_seq if per_seq is not None else v_masked_mean(stat, mask, axis=-1)
    sv = seq_values[seq_valid]
    m[f"{p}_mean"] = v_masked_mean(stat, mask).item()
    if level == "sequence" and sv.numel() > 0:
        m[f"{p}_max"] = sv.max().item()
        m[f"{p}_min"] = sv.min().item()
        m[f"{p}_fraction_high"] = (sv > upper).float().mean().item()
        m[f"{p}_fraction_low"] = (sv < lower).float().mean().item() if apply_lower else 0.0
    else:
        m[f"{p}_max"] = stat.masked_fill(~mb, float("-inf")).max().item()
        m[f"{p}_min"] = stat.masked_fill(~mb, float("inf")).min().item()
        m[f"{p}_fraction_high"] = v_masked_mean((stat > upper).float(), mask).item()
        m[f"{p}_fraction_low"] = v_masked_mean((stat < lower).float(), mask).item() if apply_lower else 0.0
    if mask.sum() > 1:
        s = stat.clamp(min=lower if apply_lower else 0.0, max=upper)
        mean = v_masked_mean(s, mask)
        var = v_masked_mean(s.square(), mask) - mean.square()
        m[f"{p}_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m[f"{p}_std"] = 0.0
    m[f"{p}_seq_mean"] = sv.mean().item()
    m[f"{p}_seq_std"] = sv.std().item() if sv.numel() > 1 else 0.0
    m[f"{p}_seq_max"] = sv.max().item()
    m[f"{p}_seq_min"] = sv.min().item()
    m[f"{p}_seq_max_deviation"] = (sv - 0.0).abs().max().item()
    m[f"{p}_seq_fraction_high"] = (sv > upper).float().mean().item()
    if apply_lower:
        m[f"{p}_seq_fraction_low"] = (sv < lower).float().mean().item()
    return m


def v_rejection_mask(log_ratio, mask, rollout_rs, threshold):
    """verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_rejection_mask"""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    specs = v_parse_rs_thresholds(options, threshold)
    lr = torch.clamp(log_ratio, min=-BOUND, max=BOUND)
    k = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    mb, seq_valid = mask.bool(), mask.sum(dim=-1) > 0
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    metrics = {}

    def seq_max(values):
        mv = values.masked_fill(~mb, float("-inf")).max(dim=-1).values
        return torch.where(mv == float("-inf"), torch.zeros_like(mv), mv)

    for option in options:
        is_k1 = option.endswith("k1")
        up, lo = specs[option]["upper"], specs[option]["lower"]
        up_log, lo_log = (math.log(up), math.log(lo)) if is_k1 else (None, None)
        token_stat = k[option[-2:]]
        per_seq = None
        if option.startswith("token"):
            stat = token_stat
            keep = (stat >= lo_log) & (stat <= up_log) if is_k1 else stat <= up
        else:
            if option.startswith("seq_sum"):
                seq_stat = v_masked_sum(token_stat, mask, axis=-1)
            elif option.startswith("seq_mean"):
                seq_stat = v_masked_mean(token_stat, mask, axis=-1)
            else:
                seq_stat = seq_max(token_stat)
            seq_keep = (seq_stat >= lo_log) & (seq_stat <= up_log) if is_k1 else seq_stat <= up
            per_seq = seq_stat
            keep = seq_keep.unsqueeze(-1).expand_as(mb)
            stat = seq_stat.unsqueeze(-1).expand_as(mask)
        keep_f = keep.to(dtype=log_ratio.dtype)
        combined = combined * keep_f
        seq_keep_all = (~((~keep) & mb)).all(dim=-1)
        metrics.update(v_rs_metrics(option, stat, mask, seq_valid, "token" if option.startswith("token")
                                    else "sequence", per_seq, up_log if is_k1 else up,
                                    lo_log if is_k1 else 0.0, is_k1))
        metrics[f"rollout_rs_{option}_masked_fraction"] = v_masked_mean(1 - keep_f, mask).item()
        svf = seq_valid.float()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            ((1.0 - seq_keep_all.to(log_ratio.dtype)) * svf).sum() / svf.sum()).item()
    metrics["rollout_rs_masked_fraction"] = v_masked_mean(1 - combined, mask).item()
    final_keep = (combined > 0.5) & mb
    metrics["rollout_rs_seq_masked_fraction"] = (~final_keep & mb).any(dim=-1).float().mean().item()
    return (mask * combined).to(dtype=mask.dtype), metrics


def v_is_metrics(w, raw, lr_m, mask, level, upper, lower=None):
    """verl/trainer/ppo/rollout_corr_helper.py::compute_is_metrics"""
    m = {}
    lower = 1.0 / upper if lower is None else lower
    log_up, log_lo = torch.log(torch.tensor(upper)), torch.log(torch.tensor(lower))
    if level == "sequence":
        m["rollout_is_max"] = torch.exp(torch.clamp(lr_m.max(), max=BOUND)).item()
        m["rollout_is_min"] = torch.exp(lr_m.min()).item()
        m["rollout_is_mean"] = v_masked_mean(w, mask).item()
        m["rollout_is_ratio_fraction_high"] = (lr_m > log_up).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (lr_m < log_lo).float().mean().item()
    else:
        m["rollout_is_mean"] = v_masked_mean(w, mask).item()
        m["rollout_is_ratio_fraction_high"] = v_masked_mean((raw > upper).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = v_masked_mean((raw < lower).float(), mask).item()
        m["rollout_is_max"] = w.masked_fill(~mask.bool(), float("-inf")).max().item()
        m["rollout_is_min"] = w.masked_fill(~mask.bool(), float("inf")).min().item()
    if mask.sum() > 1:
        ws = w.clamp(min=0.0, max=upper)
        mc = v_masked_mean(ws, mask)
        m["rollout_is_std"] = torch.sqrt(torch.clamp(v_masked_mean(ws.square(), mask) - mc.square(), min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    we = w.clamp(min=0.0, max=upper)
    norm = we / (v_masked_mean(we, mask) + 1e-8)
    try:
        m["rollout_is_eff_sample_size"] = 1.0 / v_masked_mean(norm.square(), mask).item()
    except ZeroDivisionError:  # verl stops here when every weight is 0 (IcePop); megappo reports 0.0
        m["rollout_is_eff_sample_size"] = 0.0
    smw = v_masked_mean(w, mask, axis=-1)
    m["rollout_is_seq_mean"] = smw.mean().item()
    m["rollout_is_seq_std"] = smw.std().item() if smw.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = smw.max().item()
    m["rollout_is_seq_min"] = smw.min().item()
    m["rollout_is_seq_max_deviation"] = (smw - 1.0).abs().max().item()
    raw_smw = v_masked_mean(raw, mask, axis=-1)
    m["rollout_is_seq_fraction_high"] = (raw_smw > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_smw < lower).float().mean().item()
    return m


def v_is_weights(log_ratio, mask, rollout_is, threshold, batch_normalize):
    """verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_correction_weights (no torch.distributed)"""
    upper, lower = v_parse_is_threshold(threshold)
    if rollout_is == "token":
        lr_m = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, min=-BOUND, max=BOUND))
    else:
        lr_m = v_masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(lr_m, min=-BOUND, max=BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = v_is_metrics(w, raw, lr_m, mask, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = v_masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    w = w.detach()
    if batch_normalize:
        if rollout_is == "token":
            mean = v_masked_mean(w, mask)
        else:
            sw = v_masked_mean(w, mask, axis=-1)
            sm = (mask.sum(dim=-1) > 0).to(dtype=w.dtype)
            mean = (sw * sm).sum() / sm.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return w, metrics


def v_offpolicy_metrics(old, rollout, mask):
    """verl/trainer/ppo/rollout_corr_helper.py::compute_offpolicy_metrics"""
    m = {}
    mlt = v_masked_mean(old, mask, axis=-1)
    m["training_ppl"] = torch.exp(-mlt).mean().item()
    m["training_log_ppl"] = (-mlt).mean().item()
    m["kl"] = v_masked_mean(rollout - old, mask).item()
    lr = old - rollout
    m["k3_kl"] = v_masked_mean(torch.exp(lr) - lr - 1, mask).item()
    mlr = v_masked_mean(rollout, mask, axis=-1)
    m["rollout_ppl"] = torch.exp(-mlr).mean().item()
    m["rollout_log_ppl"] = (-mlr).mean().item()
    d = mlr - mlt
    m["log_ppl_diff"] = d.mean().item()
    m["log_ppl_abs_diff"] = d.abs().mean().item()
    m["log_ppl_diff_max"] = d.max().item()
    m["log_ppl_diff_min"] = d.min().item()
    m["ppl_ratio"] = torch.exp(d).mean().item()
    m["chi2_token"] = (v_masked_mean(torch.exp(torch.clamp(lr, -BOUND, BOUND)).square(), mask) - 1.0).item()
    s = torch.clamp(v_masked_sum(lr, mask, axis=-1), -BOUND, BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * s).mean() - 1.0).item()
    return m


def v_rollout_correction(old, rollout, mask, rollout_is=None, rollout_is_threshold=2.0,
                         rollout_is_batch_normalize=False, rollout_rs=None, rollout_rs_threshold=None):
    """verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_correction_and_rejection_mask"""
    lr = old - rollout
    metrics, w = {}, None
    if rollout_is is not None and rollout_is_threshold is not None:
        w, m = v_is_weights(lr, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(m)
    new_mask = mask.clone()
    if rollout_rs is not None:
        new_mask, m = v_rejection_mask(lr, mask, rollout_rs, rollout_rs_threshold)
        metrics.update(m)
    metrics.update(v_offpolicy_metrics(old, rollout, mask))
    return w, new_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def v_reinforce(rollout_lp, lp, adv, mask, loss_agg_mode, weights, counts):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_reinforce"""
    losses = -adv * lp * weights if weights is not None else -adv * lp
    loss = agg_loss(losses, mask, loss_agg_mode, **counts)
    return loss, {"actor/ppo_kl": v_masked_mean(-(lp - rollout_lp), mask).item()}


# -- inputs and comparison -------------------------------------------------------------------------

def _batch(seed, B=8, T=12):
    """Padded masks (left, right, a gap, an all-masked row 4) and log ratios with a +25 and a -30."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=gen) > 0.2).float()
    mask[0, :5] = 0
    mask[1, 7:] = 0
    mask[2, 3:6] = 0
    mask[4] = 0
    rollout = -torch.rand(B, T, generator=gen) * 3
    old = rollout + torch.randn(B, T, generator=gen) * 0.3
    mask[3, 2] = mask[6, 4] = 1.0
    old[3, 2] = rollout[3, 2] + 25.0  # beyond the +-20 safety bound
    old[6, 4] = rollout[6, 4] - 30.0
    return gen, old, rollout, mask


def _assert_metrics_equal(ours, ref):
    assert set(ours) == set(ref)
    for key, value in ref.items():
        assert isinstance(ours[key], float), key
        assert ours[key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), key


RS_THRESHOLDS = {"token_k1": "0.7_1.4", "token_k2": 0.05, "token_k3": 0.05, "seq_sum_k1": "0.6_1.5",
                 "seq_sum_k2": 0.3, "seq_sum_k3": "0.3", "seq_mean_k1": "0.9_1.1", "seq_mean_k2": 0.04,
                 "seq_mean_k3": 0.04, "seq_max_k2": 0.2, "seq_max_k3": 0.2}


@pytest.mark.parametrize("option", RS_OPTIONS)
def test_each_rs_option_matches_verl(option):
    rejected = 0.0
    for seed in range(3):
        _, old, rollout, mask = _batch(seed)
        mask_ours, m_ours = rejection_mask(old - rollout, mask, options=option, threshold=RS_THRESHOLDS[option])
        mask_ref, m_ref = v_rejection_mask(old - rollout, mask, option, RS_THRESHOLDS[option])
        assert torch.equal(mask_ours, mask_ref) and mask_ours.dtype == mask.dtype
        _assert_metrics_equal(m_ours, m_ref)
        assert (mask_ours <= mask).all()
        rejected += m_ours["rollout_rs_masked_fraction"]
    assert 0 < rejected < 3  # the thresholds reject some tokens, not all


@pytest.mark.parametrize("options, threshold", [
    ("token_k1,seq_mean_k3", "1.5"),  # one shared threshold; k1's lower is 1/1.5
    ("token_k1, seq_mean_k3", "0.5_2.0, 0.04"),  # one per option
    ("seq_max_k2,seq_sum_k1,token_k3", "0.2,0.6_1.5,0.05"),
    ("token_k2,token_k2", 0.05),  # duplicates collapse
])
def test_chained_rs_options_match_verl(options, threshold):
    for seed in range(3):
        _, old, rollout, mask = _batch(seed)
        mask_ours, m_ours = rejection_mask(old - rollout, mask, options=options, threshold=threshold)
        mask_ref, m_ref = v_rejection_mask(old - rollout, mask, options, threshold)
        assert torch.equal(mask_ours, mask_ref)
        _assert_metrics_equal(m_ours, m_ref)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "1.5", "0.5_5.0", "0.8_1.25"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_match_verl(level, threshold, normalize):
    for seed in range(3):
        _, old, rollout, mask = _batch(seed)
        w, m = is_weights(old - rollout, mask, level=level, threshold=threshold, batch_normalize=normalize)
        w_ref, m_ref = v_is_weights(old - rollout, mask, level, threshold, normalize)
        assert torch.allclose(w, w_ref, rtol=1e-6, atol=0)
        assert torch.equal(w[mask == 0], torch.zeros(int((mask == 0).sum())))
        _assert_metrics_equal(m, m_ref)


def test_offpolicy_metrics_match_verl():
    for seed in range(3):
        _, old, rollout, mask = _batch(seed)
        _assert_metrics_equal(offpolicy_metrics(old, rollout, mask), v_offpolicy_metrics(old, rollout, mask))
    assert set(offpolicy_metrics(old, None, mask)) == {"training_ppl", "training_log_ppl"}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_rollout_correction_matches_verl_for_every_preset(preset):
    keys = {k: v for k, v in PRESETS[preset].items() if k not in ("bypass_mode", "loss_type")}
    for seed in range(2):
        _, old, rollout, mask = _batch(seed)
        w, new_mask, m = rollout_correction(old, rollout, mask, **keys)
        w_ref, mask_ref, m_ref = v_rollout_correction(old, rollout, mask, **keys)
        assert (w is None) == (w_ref is None) == (keys["rollout_is"] is None)
        if w is not None:
            assert torch.allclose(w, w_ref, rtol=1e-6, atol=0)
        assert torch.equal(new_mask, mask_ref) and new_mask is not mask
        _assert_metrics_equal(m, m_ref)
        assert all(k.startswith("rollout_corr/") for k in m) and "rollout_corr/chi2_seq" in m


def test_rollout_correction_with_is_rs_and_normalisation_matches_verl():
    kw = dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True,
              rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2.0,0.2")
    for seed in range(3):
        _, old, rollout, mask = _batch(seed)
        w, new_mask, m = rollout_correction(old, rollout, mask, **kw)
        w_ref, mask_ref, m_ref = v_rollout_correction(old, rollout, mask, **kw)
        assert torch.allclose(w, w_ref, rtol=1e-6, atol=0) and torch.equal(new_mask, mask_ref)
        _assert_metrics_equal(m, m_ref)


# -- by hand ---------------------------------------------------------------------------------------

def test_token_tis_by_hand():
    log_ratio = T([[math.log(0.25), math.log(3.0), 7.0]])
    mask = T([[1.0, 1.0, 0.0]])
    w, m = is_weights(log_ratio, mask, level="token", threshold=2.0)
    assert torch.allclose(w, T([[0.25, 2.0, 0.0]]))  # 3 truncated to 2; masked -> 0
    assert m["rollout_is_mean"] == pytest.approx(1.125)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # raw 3 > 2
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(0.5)  # raw 0.25 < 1/2
    assert m["rollout_is_max"] == pytest.approx(2.0) and m["rollout_is_min"] == pytest.approx(0.25)
    assert m["rollout_is_std"] == pytest.approx(0.875)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1.125 ** 2 / ((0.25 ** 2 + 4) / 2))
    w, m = is_weights(log_ratio, mask, level="token", threshold=2.0, batch_normalize=True)
    assert torch.allclose(w, T([[0.25, 2.0, 0.0]]) / 1.125)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(1.125)


def test_sequence_is_by_hand():
    log_ratio = T([[0.1, 0.2, 5.0], [math.log(4.0), 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    w, m = is_weights(log_ratio, mask, level="sequence", threshold=2.0)
    e = math.exp(0.3)  # the masked 5.0 does not count
    assert torch.allclose(w, T([[e, e, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]))
    assert m["rollout_is_max"] == pytest.approx(4.0)  # the unclamped row ratio
    assert m["rollout_is_min"] == pytest.approx(1.0)  # the empty row (log ratio 0) counts, as verl
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_is_mean"] == pytest.approx((2 * e + 6) / 5)
    # normalised by the mean over the 2 non-empty rows (each row's token mean, n / (n + 1e-8) of its weight)
    w, m = is_weights(log_ratio, mask, level="sequence", threshold=2.0, batch_normalize=True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx((e + 2) / 2)
    assert torch.allclose(w[1], T([2.0, 2.0, 2.0]) / ((e + 2) / 2))


def test_icepop_by_hand():
    log_ratio = T([[math.log(0.4), 0.0, math.log(6.0), 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    w, m = is_weights(log_ratio, mask, level="token", threshold="0.5_5.0")
    assert torch.allclose(w, T([[0.0, 1.0, 0.0, 0.0]]))  # zeroed outside [0.5, 5], not truncated
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 3)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)
    w, m = is_weights(T([[5.0]]), T([[1.0]]), level="token", threshold="0.5_5.0")
    assert w.item() == 0.0 and m["rollout_is_eff_sample_size"] == 0.0  # verl: ZeroDivisionError


def test_seq_mean_k3_rejection_by_hand():
    log_ratio = T([[math.log(2.0), 0.0], [0.1, -0.1]])
    mask = torch.ones(2, 2)
    new_mask, m = rejection_mask(log_ratio, mask, options="seq_mean_k3", threshold=0.1)
    k3_row0 = (2 - 1 - math.log(2)) / 2  # 0.153 > 0.1: the whole row goes
    k3_row1 = (math.exp(0.1) - 1.1 + math.exp(-0.1) - 0.9) / 2  # 0.005
    assert torch.equal(new_mask, T([[0.0, 0.0], [1.0, 1.0]]))
    assert m["rollout_rs_seq_mean_k3_seq_max"] == pytest.approx(k3_row0, rel=1e-5)
    assert m["rollout_rs_seq_mean_k3_seq_min"] == pytest.approx(k3_row1, rel=1e-4)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_rs_seq_mean_k3_fraction_high"] == pytest.approx(0.5)
    assert "rollout_rs_seq_mean_k3_seq_fraction_low" not in m  # k2/k3 have no lower bound


def test_k1_bounds_apply_to_the_inverse_ratio():
    # k1 = -log r; "0.1_1.2" keeps log 0.1 <= -log r <= log 1.2, i.e. r in [1/1.2, 10], as verl
    log_ratio = T([[math.log(5.0), math.log(0.5)]])
    new_mask, _ = rejection_mask(log_ratio, torch.ones(1, 2), options="token_k1", threshold="0.1_1.2")
    assert torch.equal(new_mask, T([[1.0, 0.0]]))


def test_masked_nan_and_inf_do_not_leak():
    old = T([[-1.0, float("nan"), -2.0], [-0.5, float("inf"), float("-inf")]])
    rollout = T([[-1.2, -1.0, float("nan")], [-0.4, -1.0, -3.0]])
    mask = T([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    for level in ("token", "sequence"):
        w, new_mask, m = rollout_correction(old, rollout, mask, rollout_is=level, rollout_rs="seq_max_k3,token_k1",
                                            rollout_rs_threshold="2.0")
        assert torch.isfinite(w).all() and torch.equal(w * (1 - mask), torch.zeros(2, 3))
        assert torch.isfinite(new_mask).all() and all(math.isfinite(v) for v in m.values())


# -- megappo's actor.old_logprob=is_correct --------------------------------------------------------

def test_is_correct_weights_are_token_tis_within_the_safety_bound():
    """megappo/trainer/step.py make_experience forms exp((old - rollout) * mask).clamp(max=is_truncate) * mask.
    rollout_correction(rollout_is="token", rollout_is_threshold=is_truncate) gives bitwise the same
    weights for log ratios in [-20, 20]; below -20 it gives exp(-20) (the safety bound) where
    is_correct gives the exact exp(log ratio): both under 2.1e-9. Above 20 both truncate."""
    gen, old, rollout, mask = _batch(5)
    old[3, 2], old[6, 4] = rollout[3, 2] + 19.5, rollout[6, 4] - 19.5  # inside the bound
    for is_truncate in (1.0, 2.0, 5.0):
        is_correct = torch.exp((old - rollout) * mask).clamp(max=is_truncate) * mask
        w, _, _ = rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=is_truncate)
        assert torch.equal(w, is_correct)
    old[6, 4] = rollout[6, 4] - 30.0
    is_correct = torch.exp((old - rollout) * mask).clamp(max=2.0) * mask
    w, _, _ = rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    differs = w != is_correct
    assert differs.sum() == 1 and differs[6, 4]
    assert w[6, 4].item() == pytest.approx(math.exp(-20)) and is_correct[6, 4].item() == pytest.approx(math.exp(-30))


# -- parsing and validation ------------------------------------------------------------------------

def test_threshold_parsing():
    assert parse_is_threshold(2) == (2.0, None) and parse_is_threshold(" 3.5 ") == (3.5, None)
    assert parse_is_threshold("0.5_5.0") == (5.0, 0.5)
    assert parse_rs_options("seq_mean_k1, token_k3,seq_mean_k1") == ["seq_mean_k1", "token_k3"]
    assert parse_rs_thresholds(["token_k1"], 2.0) == {"token_k1": RsBounds(0.5, 2.0)}
    assert parse_rs_thresholds(["seq_sum_k1", "seq_max_k2"], "2") == {
        "seq_sum_k1": RsBounds(0.5, 2.0), "seq_max_k2": RsBounds(None, 2.0)}  # one shared threshold
    assert parse_rs_thresholds(["seq_sum_k1", "seq_max_k2"], "0.5_2,0.3") == {
        "seq_sum_k1": RsBounds(0.5, 2.0), "seq_max_k2": RsBounds(None, 0.3)}
    for options, spec in ((["token_k1"], "1.5"), (["seq_sum_k1", "token_k2"], "0.5_2.0,0.1"), (["token_k3"], 0.01)):
        ref = v_parse_rs_thresholds(options, spec)
        assert parse_rs_thresholds(options, spec) == {o: RsBounds(b["lower"], b["upper"]) for o, b in ref.items()}


IS_KEY = "algorithm.rollout_correction.rollout_is_threshold"
RS_KEY = "algorithm.rollout_correction.rollout_rs_threshold"


@pytest.mark.parametrize("spec, error", [
    (True, TypeError), (None, TypeError), ([2.0], TypeError), ("", ValueError), ("  ", ValueError),
    ("abc", ValueError), ("0.5_abc", ValueError), ("_2", ValueError), (0, ValueError), (-1.0, ValueError),
    ("0_2", ValueError), ("3_2", ValueError), ("nan", ValueError),
])
def test_is_threshold_errors_name_the_key_and_the_fix(spec, error):
    with pytest.raises(error, match=f"{IS_KEY}.*Fix:"):
        parse_is_threshold(spec)


@pytest.mark.parametrize("options, spec, error", [
    (["token_k1"], None, ValueError), (["token_k1"], True, TypeError), (["token_k1"], [1.0], TypeError),
    (["token_k1"], " , ", ValueError), (["token_k1", "token_k2", "token_k3"], "1,2", ValueError),
    (["token_k1"], "0", ValueError), (["token_k1"], "abc", ValueError), (["token_k1"], "-1_2", ValueError),
    (["token_k1"], "2_1", ValueError), (["token_k2"], "0.1_0.2", ValueError), (["token_k2"], 0, ValueError),
    (["seq_max_k3"], "x", ValueError), (["token_k3"], "nan", ValueError),
])
def test_rs_threshold_errors_name_the_key_and_the_fix(options, spec, error):
    with pytest.raises(error, match=f"{RS_KEY}.*Fix:"):
        parse_rs_thresholds(options, spec)


def test_option_and_setting_errors():
    for bad in ("seq_max_k1", "token_k4", " , ", 3):
        with pytest.raises(ValueError, match=r"algorithm.rollout_correction.rollout_rs.*Fix:"):
            parse_rs_options(bad)
    with pytest.raises(ValueError, match="rollout_is='tokens'.*Fix:"):
        validate(rollout_is="tokens")
    with pytest.raises(ValueError, match="needs algorithm.rollout_correction.rollout_is_threshold"):
        validate(rollout_is="token", rollout_is_threshold=None)
    with pytest.raises(ValueError, match="loss_type='ppo'.*Fix:.*reinforce"):
        validate(loss_type="ppo")
    with pytest.raises(ValueError, match=f"{RS_KEY} is required"):
        validate(rollout_rs="token_k2")
    validate(rollout_is="token", rollout_is_batch_normalize=True, bypass_mode=True)  # fine in both modes
    validate(rollout_is="token", rollout_is_batch_normalize=True)
    _, old, rollout, mask = _batch(0)
    with pytest.raises(ValueError, match="at least one valid token"):
        rollout_correction(old, rollout, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="one shape"):
        rollout_correction(old, rollout[:, :-1], mask)
    with pytest.raises(ValueError, match="needs algorithm.rollout_correction.rollout_is_threshold"):
        rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=None)


def test_presets_are_verls():
    assert sorted(PRESETS) == sorted([
        "decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop", "decoupled_seq_is_rs", "decoupled_geo_rs",
        "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis", "decoupled_k3_rs", "decoupled_k3_rs_seq_tis",
        "decoupled_k3_rs_token_tis", "bypass_ppo_clip", "bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs",
        "bypass_pg_is", "bypass_pg_token_icepop", "bypass_pg_geo_rs", "bypass_pg_geo_rs_seq_tis",
        "bypass_pg_geo_rs_token_tis", "disabled"])
    for name, preset in PRESETS.items():
        validate(**preset)
        assert preset["bypass_mode"] == name.startswith("bypass")
        assert preset["loss_type"] == ("reinforce" if name.startswith("bypass_pg") else "ppo_clip")
    assert PRESETS["decoupled_seq_is_rs"] == {
        "rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
        "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0", "bypass_mode": False, "loss_type": "ppo_clip"}
    assert PRESETS["bypass_pg_token_icepop"]["rollout_is_threshold"] == "0.5_5.0"
    assert PRESETS["bypass_ppo_clip_k3_rs"]["rollout_rs"] == "seq_mean_k3"


# -- bypass-mode losses ----------------------------------------------------------------------------

def _loss_batch(seed):
    gen, old, rollout, mask = _batch(seed)
    adv = torch.randn(*mask.shape, generator=gen)
    return rollout, old, adv, mask  # the engine's log-probs, the current policy's, A, mask


def test_bypass_loss_without_correction_settings_is_the_clipped_loss_on_the_engines_log_probs():
    """ppo-math.md's difference 9: verl's bypass loss raises without a rollout_correction section; here its
    settings default to verl's (ppo_clip, no IS weights, no rejection), which is policy_loss against the engine."""
    engine, current, adv, mask = _loss_batch(2)
    loss, m = bypass_mode_loss(LossInputs(engine, current, adv, mask))
    expected, m_expected = policy_loss(LossInputs(engine, current, adv, mask))
    assert torch.equal(loss, expected) and float(m["actor/ppo_kl"]) == float(m_expected["actor/ppo_kl"])
    assert not [k for k in m if k.startswith("rollout_corr/rollout_is_") or k.startswith("rollout_corr/rollout_rs_")]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_bypass_ppo_clip_is_policy_loss_on_the_rejection_masked_mask(mode):
    engine, current, adv, mask = _loss_batch(1)
    rc = dict(rollout_is="token", rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.7_1.4,0.04")
    x = current.clone().requires_grad_()
    loss, m = bypass_mode_loss(LossInputs(engine, x, adv, mask, loss_agg_mode=mode), loss_type="ppo_clip",
                               clip_ratio_low=0.15, clip_ratio_high=0.28, **rc)
    loss.backward()
    w, rs_mask, m_corr = rollout_correction(current, engine, mask, **rc)
    assert 0 < rs_mask.sum() < mask.sum()
    y = current.clone().requires_grad_()
    expected, m_expected = policy_loss(LossInputs(engine, y, adv, rs_mask, loss_agg_mode=mode), clip_ratio_low=0.15,
                                       clip_ratio_high=0.28)  # no IS weights: the ratio is the IS ratio
    expected.backward()
    assert torch.equal(loss, expected) and torch.equal(x.grad, y.grad)
    z = current.clone().requires_grad_()
    verl_mask = v_rollout_correction(current, engine, mask, **rc)[1]
    verl_loss, _ = policy_loss_reference(LossInputs(engine, z, adv, verl_mask, loss_agg_mode=mode),
                                         clip_ratio_low=0.15, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(verl_loss.item(), rel=1e-6)
    assert {k: v.item() for k, v in m_expected.items()} == {k: m[k].item() for k in m_expected}
    assert {k: m[k] for k in m_corr} == m_corr and set(m) == set(m_expected) | set(m_corr)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_bypass_reinforce_is_minus_a_w_log_prob(mode):
    engine, current, adv, mask = _loss_batch(2)
    rc = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_max_k2", rollout_rs_threshold=0.2)
    x = current.clone().requires_grad_()
    loss, m = bypass_mode_loss(LossInputs(engine, x, adv, mask, loss_agg_mode=mode), loss_type="reinforce", **rc)
    loss.backward()
    w, rs_mask, _ = rollout_correction(current, engine, mask, **rc)
    assert 0 < rs_mask.sum() < mask.sum()
    y = current.clone().requires_grad_()
    expected = agg_loss(-adv * w * y, rs_mask, mode)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(x.grad, y.grad, rtol=1e-6, atol=1e-9)  # the weights carry no gradient
    if mode == "token-mean":  # d loss / d log_prob = -A * w / N over the kept tokens
        assert torch.allclose(x.grad, -adv * w * rs_mask / rs_mask.sum(), rtol=1e-6, atol=1e-9)
    ref_loss, ref_m = v_reinforce(engine, current, adv, rs_mask, mode, w, {})
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert m["actor/ppo_kl"].item() == pytest.approx(ref_m["actor/ppo_kl"], rel=1e-6)


def test_reinforce_loss_without_weights_and_its_gradient():
    lp = T([[-1.0, -2.0, -3.0]], requires_grad=True)
    loss, m = reinforce_loss(LossInputs(T([[-1.5, -2.0, 0.0]]), lp, T([[2.0, -1.0, 5.0]]), T([[1.0, 1.0, 0.0]])))
    assert loss.item() == pytest.approx((2.0 * 1.0 + -1.0 * 2.0) / 2)  # -A * log_prob, token mean
    loss.backward()
    assert torch.allclose(lp.grad, T([[-1.0, 0.5, 0.0]]))
    assert m["actor/ppo_kl"].item() == pytest.approx((-0.5 + 0.0) / 2)


def test_is_weights_carry_no_gradient():
    old = torch.randn(3, 4, requires_grad=True)
    rollout = torch.randn(3, 4)
    for level in ("token", "sequence"):
        w, mask, _ = rollout_correction(old, rollout, torch.ones(3, 4), rollout_is=level, rollout_rs="token_k2",
                                        rollout_rs_threshold=0.5)
        assert not w.requires_grad and not mask.requires_grad


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_bypass_loss_adds_up_over_row_parts_with_global_counts(loss_type, mode):
    """Contract (a) of losses.py: every part gets the mini-batch's counts BEFORE rejection."""
    engine, current, adv, mask = _loss_batch(3)
    rc = dict(rollout_is="token", rollout_is_threshold="0.5_5.0", rollout_rs="token_k2,seq_mean_k1",
              rollout_rs_threshold="0.05,0.9_1.1")
    counts = global_counts(mask)
    x = current.clone().requires_grad_()
    whole, m_whole = bypass_mode_loss(LossInputs(engine, x, adv, mask, loss_agg_mode=mode, loss_scale_factor=12,
                                                 **counts), loss_type=loss_type, **rc)
    whole.backward()
    # without counts agg_loss counts the tokens / rows kept after rejection: a different normalisation
    kept_only, _ = bypass_mode_loss(LossInputs(engine, current, adv, mask, loss_agg_mode=mode, loss_scale_factor=12),
                                    loss_type=loss_type, **rc)
    assert kept_only.item() != pytest.approx(whole.item(), rel=1e-3)
    y = current.clone().requires_grad_()
    parts = [bypass_mode_loss(LossInputs(engine[i:i + 2], y[i:i + 2], adv[i:i + 2], mask[i:i + 2], loss_agg_mode=mode,
                                         loss_scale_factor=12, **counts), loss_type=loss_type, **rc)
             for i in range(0, 8, 2)]
    total = sum(p[0] for p in parts)
    total.backward()
    assert total.item() == pytest.approx(whole.item(), rel=1e-5)
    assert torch.allclose(y.grad, x.grad, rtol=1e-5, atol=1e-8)
    assert sum(p[1]["actor/ppo_kl"] for p in parts).item() == pytest.approx(m_whole["actor/ppo_kl"].item(),
                                                                           rel=1e-5, abs=1e-7)
    # row 4 (empty) shares a part with row 5; a part with no valid token has no rollout_corr/ metrics
    empty, m_empty = bypass_mode_loss(LossInputs(engine[4:5], current[4:5], adv[4:5], mask[4:5], loss_agg_mode=mode,
                                                 **counts), loss_type=loss_type, **rc)
    assert empty.item() == 0.0 and not any(k.startswith("rollout_corr/") for k in m_empty)


@pytest.mark.parametrize("level, threshold", [("token", 2.0), ("sequence", "0.5_5.0")])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_bypass_batch_normalisation_divides_by_the_mini_batch_mean_in_every_part(level, threshold, mode):
    """verl's run_with_rollout_corr.sh: bypass, REINFORCE, batch-normalised IS weights. The parts of a
    mini-batch, each given the mean that is_weight_sums adds up over the parts, sum to the loss of the whole
    mini-batch normalised at once; verl's per-part normalisation (no mean given) does not."""
    engine, current, adv, mask = _loss_batch(4)
    rc = dict(loss_type="reinforce", rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=True)
    assert weights_need_batch_mean(**rc)  # the trainer gives this loss the mini-batch's mean
    assert not weights_need_batch_mean(**{**rc, "loss_type": "ppo_clip"})  # its weights are metrics only
    counts = global_counts(mask)
    x = current.clone().requires_grad_()
    whole, m_whole = bypass_mode_loss(LossInputs(engine, x, adv, mask, loss_agg_mode=mode, **counts), **rc)
    whole.backward()
    w, _, m_w = rollout_correction(current, engine, mask, rollout_is=level, rollout_is_threshold=threshold,
                                   rollout_is_batch_normalize=True)  # the whole batch's normalised weights
    assert whole.item() == pytest.approx(agg_loss(-adv * w * current, mask, mode).item(), rel=1e-6)
    sums = sum(is_weight_sums(current[i:i + 2], engine[i:i + 2], mask[i:i + 2], rollout_is=level,
                              rollout_is_threshold=threshold) for i in range(0, 8, 2))
    mean = float(sums[0] / sums[1])
    assert mean == pytest.approx(m_w["rollout_corr/rollout_is_batch_norm_factor"], rel=1e-6) and mean != 1.0
    y = current.clone().requires_grad_()
    parts = [bypass_mode_loss(LossInputs(engine[i:i + 2], y[i:i + 2], adv[i:i + 2], mask[i:i + 2], loss_agg_mode=mode,
                                         **counts), rollout_is_batch_mean=mean, **rc) for i in range(0, 8, 2)]
    total = sum(p[0] for p in parts)
    total.backward()
    assert total.item() == pytest.approx(whole.item(), rel=1e-5)  # float32: the two means' roundings
    assert torch.allclose(y.grad, x.grad, rtol=1e-5, atol=1e-8)
    assert all(p[1]["rollout_corr/rollout_is_batch_norm_factor"] == mean for p in parts if p[1])
    own = sum(bypass_mode_loss(LossInputs(engine[i:i + 2], current[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                                          loss_agg_mode=mode, **counts), **rc)[0]
              for i in range(0, 8, 2))  # each part by its own mean
    assert own.item() != pytest.approx(whole.item(), rel=1e-3)
    assert is_weight_sums(current[4:5], engine[4:5], mask[4:5], rollout_is=level,  # an empty row: nothing
                          rollout_is_threshold=threshold).tolist() == [0.0, 0.0]


def test_bypass_loss_refuses_precomputed_weights_and_an_unknown_loss_type():
    engine, current, adv, mask = _loss_batch(0)
    with pytest.raises(ValueError, match="precomputed"):
        bypass_mode_loss(LossInputs(engine, current, adv, mask, rollout_is_weights=torch.ones_like(mask)))
    with pytest.raises(ValueError, match="loss_type"):
        bypass_mode_loss(LossInputs(engine, current, adv, mask), loss_type="vanilla")
