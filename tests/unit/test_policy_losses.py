"""The policy-loss registry (megappo.ppo.policy_losses): every loss against verl 0.9.1's
function written out step by step below (with verl's agg_loss), hand-worked numbers, edge
cases, invariance to micro-batch and DP splits, dtypes, and the dispatcher."""

import dataclasses
import inspect
import math

import pytest
import torch

from megappo.ppo.losses import AGG_MODES, LossInputs, global_counts
from megappo.ppo.policy_losses import (
    OWN_METRICS, POLICY_LOSS_KNOBS, POLICY_LOSSES, compute_policy_loss, get_policy_loss,
)

T = torch.tensor
F64 = torch.float64
VERL_NAMES = ["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
              "cispo"]  # bypass_mode, the registry's twelfth, is tested in test_rollout_correction.py


# -- verl 0.9.1, written out (the references) ------------------------------------------------------

def _vsum(values, mask, axis=None):
    """verl/utils/torch_functional.py::masked_sum"""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def _vmean(values, mask, axis=None):
    """verl/utils/torch_functional.py::masked_mean"""
    return _vsum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    """verl/trainer/ppo/core_algos.py::agg_loss (core_algos.py:1140)"""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = _vsum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        loss = _vsum(loss_mat, loss_mask) * dp_size
    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = _vsum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss /= loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = _vsum(seq_losses, seq_mask) / global_batch_size * dp_size
    else:
        raise ValueError(loss_agg_mode)
    return loss


def ref_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
                clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_vanilla"""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _vmean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = _vmean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = _vmean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": pg_clipfrac_lower}


def _ref_dppo(kind, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
              clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_dppo_tv / compute_policy_loss_dppo_kl"""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _vmean(-negative_approx_kl, response_mask)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob = torch.exp(log_prob)
    old_prob = torch.exp(old_log_prob)
    if kind == "tv":
        valid_positive_mask = (prob - old_prob) <= clip_ratio_high
        valid_negative_mask = (prob - old_prob) >= -clip_ratio_low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_positive_mask = (binary_kl <= clip_ratio_high) | (prob <= old_prob)
        valid_negative_mask = (binary_kl <= clip_ratio_low) | (prob >= old_prob)
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask).detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    pg_clipfrac = _vmean((1.0 - valid_mask).float(), response_mask)
    pg_clipfrac_lower = _vmean((ratio > clip_ratio_c).float() * valid_mask, response_mask)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": pg_clipfrac_lower}


def ref_dppo_tv(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
                clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=20.0):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_dppo_tv"""
    return _ref_dppo("tv", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
                     clip_ratio_low, clip_ratio_high, clip_ratio_c)


def ref_dppo_kl(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
                clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=20.0):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_dppo_kl"""
    return _ref_dppo("kl", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
                     clip_ratio_low, clip_ratio_high, clip_ratio_c)


def ref_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
             clip_ratio_low=0.2, clip_ratio_high=0.2):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_gspo"""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    pg_clipfrac = _vmean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = _vmean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl,
                     "actor/pg_clipfrac_lower": torch.tensor(0.0)}


def ref_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
             tau_pos=1.0, tau_neg=1.05):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_sapo (loss_agg_mode is not used)"""
    tau_pos = torch.as_tensor(tau_pos, dtype=advantages.dtype)
    tau_neg = torch.as_tensor(tau_neg, dtype=advantages.dtype)

    def gate_function(x, tau):
        return torch.sigmoid(tau * (x - 1.0)) * (4.0 / tau)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(condition=advantages > 0, input=tau_pos, other=tau_neg)
    gates = gate_function(ratio, taus)
    pg_losses = -gates * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    ppo_kl = _vmean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/pg_clipfrac": torch.tensor(0.0), "actor/ppo_kl": ppo_kl,
                     "actor/pg_clipfrac_lower": torch.tensor(0.0)}


def ref_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_gpg"""
    pg_losses = -log_prob * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode), {}


def ref_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
                 clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0,
                 generator=None):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_clip_cov, with torch.randperm drawing
    from `generator` (verl: the global RNG)"""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _vmean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - _vmean(advantages, response_mask)) * (
        log_prob - _vmean(log_prob.detach(), response_mask))
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx), generator=generator)
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = _vmean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl}


def ref_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
               kl_cov_ratio=0.0002, ppo_kl_coef=0.1):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_kl_cov"""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = _vmean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            W = advantages.shape[1]
            pg_losses[large_cov_idxs // W, large_cov_idxs % W] = pg_losses_kl[large_cov_idxs // W,
                                                                              large_cov_idxs % W]
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/ppo_kl": ppo_kl_abs}


def ref_geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
                 clip_ratio_low=0.2, clip_ratio_high=0.2):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_geo_mean (loss_agg_mode is not used)"""
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = _vmean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -clip_ratio_low, clip_ratio_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
        pg_losses = pg_losses * seq_is_weights
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = _vmean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = _vmean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": pg_clipfrac_lower}


def ref_dro(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights, dro_beta=None):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_dro"""
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * dro_beta * log_ratio.square())
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/ppo_kl": _vmean(-log_ratio, response_mask)}


def ref_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights,
              clip_ratio_low=0.2, clip_ratio_high=0.2):
    """verl/trainer/ppo/core_algos.py::compute_policy_loss_cispo"""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _vmean(-negative_approx_kl, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = _vmean((ratio != clipped_ratio).float(), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl,
                     "actor/pg_clipfrac_lower": torch.tensor(0.0)}


REFERENCES = {"vanilla": ref_vanilla, "dppo_tv": ref_dppo_tv, "dppo_kl": ref_dppo_kl, "gspo": ref_gspo,
              "sapo": ref_sapo, "gpg": ref_gpg, "clip_cov": ref_clip_cov, "kl_cov": ref_kl_cov,
              "geo_mean": ref_geo_mean, "dro": ref_dro, "cispo": ref_cispo}

# knobs that make every loss do something: clip_cov draws several tokens, kl_cov penalises several
KNOBS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "clip_cov_ratio": 0.1,
         "clip_cov_lb": 0.1, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.1, "ppo_kl_coef": 0.1, "dro_beta": 0.3,
         "tau_pos": 1.0, "tau_neg": 1.05}


def _knobs_for(fn, knobs):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in knobs.items() if k in params}


def _batch(seed, B=8, L=7, dtype=F64, empty_row=True):
    """old / new log-probs, advantages, mask with left / right padding, a masked middle span and
    (optionally) an empty row, rollout IS weights; the advantages of row 3 are exactly 0."""
    gen = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, L, generator=gen, dtype=F64) - 0.05
    spread = torch.full((B, 1), 0.3, dtype=F64)
    spread[-2:] = 1.5  # the last two rows move far: dual-clip, DPPO's masks and truncation
    new = (old + spread * torch.randn(B, L, generator=gen, dtype=F64)).clamp(max=-1e-3)
    adv = 1.5 * torch.randn(B, L, generator=gen, dtype=F64)
    adv[3, :] = 0.0
    mask = (torch.rand(B, L, generator=gen) > 0.2).to(F64)
    mask[0, :3] = 0  # left padding
    mask[1, 4:] = 0  # right padding
    mask[2, 2:5] = 0  # a tool-output span
    mask[2, 0] = 1
    mask[5] = 0 if empty_row else 1
    weights = 0.5 + torch.rand(B, L, generator=gen, dtype=F64)
    return [x.to(dtype) for x in (old, new, adv, mask, weights)]


RECORD_FIELDS = {f.name for f in dataclasses.fields(LossInputs)}


def _call(fn, old, new, adv, mask, **kw):
    """fn(LossInputs(old, new, adv, mask, <kw's record fields>), <kw's knobs>)."""
    record = {k: v for k, v in kw.items() if k in RECORD_FIELDS}
    return fn(LossInputs(old, new, adv, mask, **record), **{k: v for k, v in kw.items() if k not in RECORD_FIELDS})


def _run(fn, old, new, adv, mask, **kw):
    """(loss, gradient w.r.t. log_prob, metrics) of one call."""
    lp = new.clone().requires_grad_()
    loss, metrics = _call(fn, old, lp, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), (torch.zeros_like(new) if grad is None else grad), metrics


def _assert_close(a, b, rtol=1e-6, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=rtol, atol=atol)


def _compare(name, old, new, adv, mask, mode, weights, knobs, seed=0):
    fn, ref = POLICY_LOSSES[name], REFERENCES[name]
    extra = {"generator": torch.Generator().manual_seed(seed)} if name == "clip_cov" else {}
    ref_extra = {"generator": torch.Generator().manual_seed(seed)} if name == "clip_cov" else {}
    loss, grad, metrics = _run(fn, old, new, adv, mask, loss_agg_mode=mode, rollout_is_weights=weights,
                               **_knobs_for(fn, knobs), **extra)
    ref_loss, ref_grad, ref_metrics = _run(lambda x, **kw: ref(x.old_log_prob, x.log_prob, x.advantages,
                                                               x.response_mask, mode, weights, **kw),
                                           old, new, adv, mask, **_knobs_for(ref, knobs), **ref_extra)
    _assert_close(loss, ref_loss)
    _assert_close(grad, ref_grad)
    assert set(metrics) == set(ref_metrics) | set(OWN_METRICS.get(name, ()))  # verl's, plus megappo's own
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad
        if key in ref_metrics:
            _assert_close(value, ref_metrics[key])
    return metrics


# -- against verl ------------------------------------------------------------------------------------

@pytest.mark.parametrize("weighted", [False, True], ids=["no_is", "is_weights"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", VERL_NAMES)
def test_every_loss_matches_verl(name, mode, weighted):
    for seed in range(3):
        # geo_mean: verl's torch.mean counts empty rows, megappo does not; compare without them
        old, new, adv, mask, weights = _batch(seed, empty_row=name != "geo_mean")
        _compare(name, old, new, adv, mask, mode, weights if weighted else None, KNOBS, seed)


def test_the_comparison_exercises_the_covariance_selections():
    old, new, adv, mask, _ = _batch(0)
    m = _compare("clip_cov", old, new, adv, mask, "token-mean", None, KNOBS)
    assert m["actor/pg_clipfrac"] > 0  # some tokens were drawn
    _compare("clip_cov", old, new, adv, mask, "token-mean", None, {})  # verl's defaults: 1 token
    _compare("kl_cov", old, new, adv, mask, "token-mean", None, {})
    # some tokens are clipped by both clip-ratio losses
    assert POLICY_LOSSES["vanilla"](LossInputs(old, new, adv, mask))[1]["actor/pg_clipfrac"] > 0
    assert POLICY_LOSSES["geo_mean"](LossInputs(old, new, adv, mask))[1]["actor/pg_clipfrac_lower"] > 0


def test_geo_mean_divides_by_non_empty_rows_where_verl_averages_all_rows():
    old, new, adv, mask, _ = _batch(1)  # row 5 is empty
    ours = POLICY_LOSSES["geo_mean"](LossInputs(old, new, adv, mask))[0]
    verl = ref_geo_mean(old, new, adv, mask, "token-mean", None)[0]
    _assert_close(ours, verl * 8 / 7)


def test_clip_cov_draws_deterministically_from_its_generator():
    old, new, adv, mask, _ = _batch(0)
    knobs = _knobs_for(POLICY_LOSSES["clip_cov"], KNOBS)
    run = lambda **kw: POLICY_LOSSES["clip_cov"](LossInputs(old, new, adv, mask), **knobs, **kw)[0]
    assert run().item() == run().item()  # no generator: a fixed seed
    assert run(generator=torch.Generator().manual_seed(5)).item() == \
        run(generator=torch.Generator().manual_seed(5)).item()
    draws = {run(generator=torch.Generator().manual_seed(s)).item() for s in range(6)}
    assert len(draws) > 1  # the generator decides which tokens


# -- edge cases --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", VERL_NAMES)
def test_an_all_masked_batch_gives_zero_loss_and_a_finite_gradient(name, mode):
    old, new, adv, _, weights = _batch(0)
    fn = POLICY_LOSSES[name]
    for counts in ({}, {"global_tokens": 0, "global_seqs": 0}):
        loss, grad, metrics = _run(fn, old, new, adv, torch.zeros_like(old), loss_agg_mode=mode,
                                   rollout_is_weights=weights, **_knobs_for(fn, KNOBS), **counts)
        assert loss.item() == 0.0 and torch.isfinite(grad).all()
        assert all(math.isfinite(v.item()) for v in metrics.values())


@pytest.mark.parametrize("name", VERL_NAMES)
def test_zero_advantages(name):
    old, new, _, mask, _ = _batch(2)
    fn = POLICY_LOSSES[name]
    n = mask.sum()
    loss = fn(LossInputs(old, new, torch.zeros_like(old), mask), **_knobs_for(fn, KNOBS))[0]
    if name == "dro":  # only the quadratic penalty is left
        _assert_close(loss, 0.5 * KNOBS["dro_beta"] * ((new - old) ** 2 * mask).sum() / n)
    elif name == "kl_cov":  # every covariance is 0; the top-k tokens keep their |d| penalty
        shifted = old + 0.25
        k = max(1, int(n * KNOBS["kl_cov_ratio"]))
        loss = fn(LossInputs(old, shifted, torch.zeros_like(old), mask), **_knobs_for(fn, KNOBS))[0]
        _assert_close(loss, KNOBS["ppo_kl_coef"] * 0.25 * k / n)
    else:
        assert loss.item() == 0.0


@pytest.mark.parametrize("name", VERL_NAMES)
def test_ratios_exactly_at_the_clip_bounds(name):
    """d = 0 with clip_ratio_low = clip_ratio_high = 0: the ratio 1 sits on both bounds (ties in
    the max / min / clamp and in DPPO's masks); values and gradients as verl's."""
    old, _, adv, mask, weights = _batch(3, empty_row=name != "geo_mean")
    knobs = {**KNOBS, "clip_ratio_low": 0.0, "clip_ratio_high": 0.0}
    for mode in ("token-mean", "seq-mean-token-mean"):
        _compare(name, old, old.clone(), adv, mask, mode, weights, knobs)


@pytest.mark.parametrize("name", VERL_NAMES)
def test_extreme_ratios_and_near_certain_tokens(name):
    """Log ratios beyond verl's clamps (+-20 per token, 10 for GSPO's sequence ratio) and
    tokens of probability 1 - 1e-9 (DPPO-KL's 1e-8 guards), against verl's functions."""
    gen = torch.Generator().manual_seed(7)
    old = -3 * torch.rand(4, 5, generator=gen, dtype=F64)
    old[0], old[1, :3] = -30.0, -1e-9
    new = old + 0.3 * torch.randn(4, 5, generator=gen, dtype=F64)
    new[0] = -5.0  # d = 25 on every token: row 0's sequence ratio exceeds exp(10)
    new[1, :3] = T([-1e-3, -1e-7, -2e-9])
    new[2, 0] = -45.0
    new = new.clamp(max=-1e-12)
    # p_old = 0.975 -> p = 1 - 1e-7: binary KL 0.284 just above clip_ratio_high = 0.28 (0.226 with 1e-6 guards)
    old[1, 3], new[1, 3] = math.log(0.975), -1e-7
    adv = torch.randn(4, 5, generator=gen, dtype=F64)
    adv[0, :2], adv[0, 2:], adv[1, 3] = 1.0, -1.0, 1.0
    for mode in ("token-mean", "seq-mean-token-sum"):
        _compare(name, old, new, adv, torch.ones(4, 5, dtype=F64), mode, None, KNOBS)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_masks_on_a_grid_across_their_bounds(name):
    """p_old in {0.1, 0.5, 0.9} x p on a fine grid, both advantage signs: the divergence crosses
    clip_ratio_low / high at many tokens, so any shift of a bound changes the mask."""
    p = torch.linspace(0.005, 0.995, 60, dtype=F64)
    old = torch.log(T([0.1, 0.5, 0.9], dtype=F64)).repeat_interleave(2).unsqueeze(-1).expand(6, 60)
    new = torch.log(p).expand(6, 60)
    adv = T([1.0, -1.0], dtype=F64).repeat(3).unsqueeze(-1).expand(6, 60)
    metrics = _compare(name, old, new, adv, torch.ones(6, 60, dtype=F64), "token-mean", None, KNOBS)
    assert 0.2 < metrics["actor/pg_clipfrac"] < 0.8


@pytest.mark.parametrize("name", VERL_NAMES)
def test_singletons(name):
    for a in (1.5, -0.7, 0.0):
        _compare(name, T([[-1.2]], dtype=F64), T([[-0.9]], dtype=F64), T([[a]], dtype=F64), T([[1.0]], dtype=F64),
                 "token-mean", None, KNOBS)


# -- hand-worked numbers -----------------------------------------------------------------------------

def test_gspo_by_hand():
    fn, one = POLICY_LOSSES["gspo"], torch.ones(1, 2, dtype=F64)
    old = T([[-1.0, -2.0]], dtype=F64)
    # log ratios 0.1 and 0.3: s = exp(0.2) = 1.2214 > 1.2 on both tokens
    new = old + T([[0.1, 0.3]], dtype=F64)
    loss, grad, m = _run(fn, old, new, T([[1.0, 1.0]], dtype=F64), one)
    assert loss.item() == pytest.approx(-1.2) and grad.abs().max().item() == 0.0  # clipped: no gradient
    assert m["actor/pg_clipfrac"].item() == pytest.approx(1.0) and m["actor/ppo_kl"].item() == pytest.approx(-0.2)
    # negative advantage: -A max(s, 0.8) = s, and each token's gradient -A s / N
    loss, grad, m = _run(fn, old, new, T([[-1.0, -1.0]], dtype=F64), one)
    assert loss.item() == pytest.approx(math.exp(0.2))
    _assert_close(grad, T([[math.exp(0.2) / 2] * 2]))
    assert m["actor/pg_clipfrac"].item() == 0.0
    # the masked token does not enter the sequence ratio: s = exp(0.1) stays inside the clip range
    loss, grad, _ = _run(fn, old, new, T([[2.0, 2.0]], dtype=F64), T([[1.0, 0.0]], dtype=F64))
    assert loss.item() == pytest.approx(-2 * math.exp(0.1))
    _assert_close(grad, T([[-2 * math.exp(0.1), 0.0]]))


def test_cispo_by_hand():
    old, new = T([[-1.5, -1.9]], dtype=F64), T([[-1.0, -2.0]], dtype=F64)  # d = 0.5, -0.1
    adv = T([[2.0, 1.0]], dtype=F64)
    loss, grad, m = _run(POLICY_LOSSES["cispo"], old, new, adv, torch.ones(1, 2, dtype=F64))
    r = [1.2, math.exp(-0.1)]  # e^0.5 = 1.65 is clipped to 1.2; e^-0.1 = 0.905 is inside [0.8, 1.2]
    assert loss.item() == pytest.approx(-(r[0] * 2 * -1.0 + r[1] * 1 * -2.0) / 2)
    _assert_close(grad, T([[-r[0] * 2 / 2, -r[1] * 1 / 2]]))  # -clip(r) A / N: the ratio carries no gradient
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.5) and m["actor/pg_clipfrac_lower"].item() == 0.0


def test_cispo_without_a_lower_bound():
    """verl's CISPO example (examples/cispo_trainer) sets clip_ratio_low=10: 1 - 10 < 0 bounds nothing, so a
    ratio far below 1 keeps its own weight (the paper's CISPO clips the IS weight from above only)."""
    old, new = T([[-1.0, -1.0]], dtype=F64), T([[-4.0, -0.5]], dtype=F64)  # d = -3, 0.5
    adv = T([[1.0, 1.0]], dtype=F64)
    loss, grad, m = _run(POLICY_LOSSES["cispo"], old, new, adv, torch.ones(1, 2, dtype=F64), clip_ratio_low=10.0,
                         clip_ratio_high=0.2)
    w = [math.exp(-3.0), 1.2]  # e^-3 = 0.05 stays; e^0.5 is clipped to 1 + 0.2
    assert loss.item() == pytest.approx(-(w[0] * -4.0 + w[1] * -0.5) / 2)
    _assert_close(grad, T([[-w[0] / 2, -w[1] / 2]]))
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.5)


def test_dro_by_hand():
    loss, grad, m = _run(POLICY_LOSSES["dro"], T([[-1.4]], dtype=F64), T([[-1.0]], dtype=F64), T([[2.0]], dtype=F64),
                         T([[1.0]], dtype=F64), dro_beta=0.5)
    assert loss.item() == pytest.approx(-(-1.0 * 2.0 - 0.25 * 0.16))  # -(A log_prob - beta/2 d^2) = 2.04
    assert grad.item() == pytest.approx(-(2.0 - 0.5 * 0.4))  # -(A - beta d)
    assert set(m) == {"actor/ppo_kl"} and m["actor/ppo_kl"].item() == pytest.approx(-0.4)


# -- split invariance --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", [n for n in VERL_NAMES if n not in ("clip_cov", "kl_cov")])
def test_micro_batch_and_dp_splits_give_the_whole_batch(name, mode):
    old, new, adv, mask, weights = _batch(4)
    fn = POLICY_LOSSES[name]
    kw = dict(loss_agg_mode=mode, rollout_is_weights=None, **_knobs_for(fn, KNOBS))
    whole, whole_grad, whole_metrics = _run(fn, old, new, adv, mask, **kw)
    counts = global_counts(mask)
    ranks = (range(0, 4), range(4, 8))

    def parts(dp_size):
        """(sum of losses, gradient, summed metrics) over 2 DP ranks x 2 micro-batches of 2 rows."""
        lp = new.clone().requires_grad_()
        total, metrics = 0, {}
        for rank in ranks:
            for mb in range(rank.start, rank.stop, 2):
                rows = slice(mb, mb + 2)
                loss, m = _call(fn, old[rows], lp[rows], adv[rows], mask[rows], **kw, **counts, dp_size=dp_size)
                total = total + loss
                metrics = {k: metrics.get(k, 0) + v for k, v in m.items()}
        (grad,) = torch.autograd.grad(total, lp, allow_unused=True)
        return total.detach(), (torch.zeros_like(new) if grad is None else grad), metrics

    total, grad, metrics = parts(dp_size=1)  # (a) gradients summed over DP and micro-batches
    _assert_close(total, whole)
    _assert_close(grad, whole_grad)
    for key, value in whole_metrics.items():
        _assert_close(metrics[key], value)
    total, grad, metrics = parts(dp_size=2)  # (b) the DP reducer averages
    _assert_close(total / 2, whole)
    _assert_close(grad / 2, whole_grad)
    for key, value in whole_metrics.items():  # metrics are not scaled by dp_size
        _assert_close(metrics[key], value)


# -- dtypes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", VERL_NAMES)
def test_float32_agrees_with_float64_and_bf16_runs(name):
    fn = POLICY_LOSSES[name]
    knobs = _knobs_for(fn, KNOBS)
    results = {}
    for dtype in (F64, torch.float32, torch.bfloat16):
        old, new, adv, mask, weights = _batch(5, dtype=dtype)
        loss, grad, metrics = _run(fn, old, new, adv, mask, rollout_is_weights=weights, **knobs)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in metrics.values())
        results[dtype] = loss, grad
    _assert_close(results[torch.float32][0], results[F64][0], rtol=1e-5, atol=1e-6)
    _assert_close(results[torch.float32][1], results[F64][1], rtol=1e-5, atol=1e-6)


# -- the registry and the dispatcher -----------------------------------------------------------------

def test_the_registry_holds_verls_names_and_one_calling_convention():
    assert sorted(POLICY_LOSSES) == sorted(VERL_NAMES + ["bypass_mode"])
    fields = dataclasses.fields(LossInputs)
    assert [f.name for f in fields[:4]] == ["old_log_prob", "log_prob", "advantages", "response_mask"]
    defaults = {f.name: f.default for f in fields[4:]}
    assert defaults == {"loss_agg_mode": "token-mean", "rollout_is_weights": None, "global_tokens": None,
                        "global_seqs": None, "dp_size": 1, "loss_scale_factor": None}
    for name, fn in POLICY_LOSSES.items():
        params = list(inspect.signature(fn).parameters.values())
        assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and params[0].annotation == "LossInputs", name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:]), name


def test_knobs_and_their_verl_defaults():
    expected = {
        "vanilla": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0},
        "dppo_tv": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 20.0},
        "dppo_kl": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 20.0},
        "gspo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
        "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
        "gpg": {},
        "clip_cov": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
                     "clip_cov_ub": 5.0, "generator": None},
        "kl_cov": {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1},
        "geo_mean": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
        "dro": {"dro_beta": None},
        "cispo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
        "bypass_mode": {"loss_type": "ppo_clip", "rollout_is": None, "rollout_is_threshold": 2.0,
                        "rollout_is_batch_normalize": False,
                        "rollout_is_batch_mean": None,  # the trainer's (the mini-batch's mean), not verl's
                        "rollout_rs": None, "rollout_rs_threshold": None,
                        "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0},
    }
    for name, knobs in expected.items():
        params = inspect.signature(get_policy_loss(name)).parameters
        assert POLICY_LOSS_KNOBS[name] == tuple(knobs), name
        assert {k: params[k].default for k in knobs} == knobs, name


def test_unknown_loss_names_the_config_key_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo' \(actor.policy_loss.loss_mode\); "
                                         r"choose from \['bypass_mode', 'cispo', 'clip_cov'"):
        get_policy_loss("ppo")
    old, new, adv, mask, _ = _batch(0)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
        compute_policy_loss("ppo", LossInputs(old, new, adv, mask))


def test_compute_policy_loss_passes_each_loss_the_knobs_it_takes():
    old, new, adv, mask, weights = _batch(6)
    inputs = LossInputs(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                        loss_agg_mode="seq-mean-token-sum", rollout_is_weights=weights, **global_counts(mask),
                        dp_size=1, loss_scale_factor=None)
    every_knob = dict(**KNOBS, generator=torch.Generator().manual_seed(1))
    for name in VERL_NAMES:
        fn = POLICY_LOSSES[name]
        loss, metrics = compute_policy_loss(name, inputs, **every_knob)
        extra = {"generator": torch.Generator().manual_seed(1)} if name == "clip_cov" else {}
        direct, direct_metrics = fn(LossInputs(old, new, adv, mask, loss_agg_mode="seq-mean-token-sum",
                                               rollout_is_weights=weights, **global_counts(mask)),
                                    **_knobs_for(fn, KNOBS), **extra)
        assert loss.item() == direct.item() and metrics.keys() == direct_metrics.keys()
    with pytest.raises(ValueError, match=r"unknown inputs \['clip_ratio'\]"):  # a typo is not silently ignored
        compute_policy_loss("gpg", inputs, **every_knob, clip_ratio=0.2)
    with pytest.raises(ValueError, match=r"needs the tensors \['advantages'\]"):
        compute_policy_loss("gpg", LossInputs(old_log_prob=old, log_prob=new, advantages=None, response_mask=mask))


@pytest.mark.parametrize("name, knobs, message", [
    ("dro", {"dro_beta": None}, "actor.policy_loss.dro_beta must be > 0 for loss_mode=dro, got None"),
    ("dro", {"dro_beta": 0.0}, "actor.policy_loss.dro_beta must be > 0"),
    ("clip_cov", {"clip_cov_ratio": 0.0}, "actor.policy_loss.clip_cov_ratio must be in (0, 1]"),
    ("clip_cov", {"clip_cov_lb": 5.0}, "actor.policy_loss.clip_cov_lb must be < clip_cov_ub (5.0)"),
    ("kl_cov", {"kl_cov_ratio": 1.5}, "actor.policy_loss.kl_cov_ratio must be in (0, 1]"),
    ("kl_cov", {"ppo_kl_coef": -0.1}, "actor.policy_loss.ppo_kl_coef must be >= 0"),
    ("sapo", {"tau_neg": 0.0}, "actor.tau_neg must be > 0 for loss_mode=sapo"),
    ("cispo", {"clip_ratio_low": -0.1}, "actor.clip_ratio_low must be >= 0 for loss_mode=cispo"),
    ("gspo", {"clip_ratio_high": -0.1}, "actor.clip_ratio_high must be >= 0 for loss_mode=gspo"),
    ("geo_mean", {"clip_ratio_low": -0.1}, "actor.clip_ratio_low must be >= 0 for loss_mode=geo_mean"),
    ("dppo_tv", {"clip_ratio_c": 0.0}, "actor.clip_ratio_c must be > 0"),
    ("vanilla", {"clip_ratio_c": 1.0}, "clip_ratio_c must be > 1"),
])
def test_bad_knobs_name_their_config_key(name, knobs, message):
    old, new, adv, mask, _ = _batch(0)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        compute_policy_loss(name, LossInputs(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask),
                            **{**KNOBS, **knobs})


def test_own_metrics_by_hand():
    """megappo's per-loss metrics (OWN_METRICS) on 1 row of 2 valid tokens and a masked one, worked out by hand."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]], dtype=F64))
    new = torch.log(torch.tensor([[0.5, 0.75, 0.9]], dtype=F64))  # r = 1, 1.5 (the masked token: 1.8)
    adv, mask = torch.tensor([[1.0, 1.0, 1.0]], dtype=F64), torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    x = LossInputs(old, new, adv, mask)
    m = POLICY_LOSSES["cispo"](x)[1]  # weights clip(r, 0.8, 1.2) = 1, 1.2
    assert m["actor/cispo_weight"].item() == pytest.approx(1.1)
    m = POLICY_LOSSES["gspo"](x)[1]  # s = exp(mean(0, log 1.5)) = sqrt(1.5) on both tokens
    assert m["actor/gspo_seq_ratio"].item() == pytest.approx(1.5 ** 0.5)
    m = POLICY_LOSSES["sapo"](x, tau_pos=2.0)[1]  # 4 sig(x)(1 - sig(x)), x = 2 (r - 1) = 0, 1
    sig = 1 / (1 + math.exp(-1.0))
    assert m["actor/sapo_gate"].item() == pytest.approx((1.0 + 4 * sig * (1 - sig)) / 2)
    m = POLICY_LOSSES["kl_cov"](x, kl_cov_ratio=0.5)[1]  # max(1, floor(0.5 x 2)) = 1 of 2 tokens
    assert m["actor/kl_cov_penalised_frac"].item() == pytest.approx(0.5)
    adv2 = torch.tensor([[-3.0, 3.0, 0.0]], dtype=F64)  # cov = (A - 0)(lp - mean lp) = 3 x 0.2 on both tokens
    old2 = new.detach().clone()  # r = 1: nothing clipped, both candidates if lb < cov < ub
    m = POLICY_LOSSES["clip_cov"](LossInputs(old2, new, adv2, mask), clip_cov_ratio=0.5, clip_cov_lb=0.0,
                                  clip_cov_ub=10.0)[1]
    assert m["actor/clip_cov_cut_frac"].item() == pytest.approx(0.5) == m["actor/pg_clipfrac"].item()
    assert set(OWN_METRICS) == {"gspo", "sapo", "cispo", "kl_cov", "clip_cov"}
