"""Rollout correction (verl 0.9.1 `algorithm.rollout_correction`) as pure tensor functions.

Owns: the importance-sampling (IS) weights and the rejection-sampling (RS) mask that correct
for the gap between the rollout engine's log-probs and the trainer's, their metrics (verl's
names under "rollout_corr/"), verl's presets and the two bypass-mode policy losses
(`reinforce_loss`, `bypass_mode_loss`). The grammar of the settings and their checks are
megappo.ppo.correction_spec's.
Does not know about configs, process groups, the policy-loss registry or the trainer; the
caller chooses the mode, gives whole-batch tensors (decoupled) or a micro-batch with the
mini-batch's global counts (bypass), and averages the "rollout_corr/" metrics of parts.

Shape legend: [B, T] = (sequences, response tokens); [B] = one value per sequence. Every
[B, T] tensor here is aligned with `response_mask` (1 where a token was generated). A log
ratio is log(pi_train / pi_rollout) per token, r = exp(log ratio).

The two modes (`algorithm.rollout_correction.bypass_mode`):

| mode | policies | old log-probs | weights and mask formed | policy loss |
|---|---|---|---|---|
| decoupled (false) | 3: rollout, old, current | recomputed by the trainer | once per batch, `rollout_correction(old, rollout, mask)` on the WHOLE batch | losses.policy_loss(LossInputs(rollout_is_weights=w)) on the returned mask |
| bypass (true) | 2: rollout = old, current | the engine's | per micro-batch inside the loss, from log_prob.detach() vs the engine's (batch normalisation: by the mini-batch's mean, `is_weight_sums`) | `bypass_mode_loss` (ppo_clip or reinforce) |

The options (keys under `algorithm.rollout_correction`; verl functions in
verl/trainer/ppo/rollout_corr_helper.py unless said otherwise):

| key | values | effect | here / verl |
|---|---|---|---|
| rollout_is | null, token, sequence | token: w_t = r_t; sequence: w = prod_t r_t, the same for all of a row's tokens | `is_weights` / compute_rollout_correction_weights |
| rollout_is_threshold | number or "lower_upper" | a number u: TIS, w = min(w, u); "l_u": IcePop, w = 0 outside [l, u] | `parse_is_threshold` / _parse_rollout_is_threshold |
| rollout_is_batch_normalize | bool | divide the weights by their batch mean (tokens, or sequences) | `is_weights` |
| rollout_rs | comma list of `RS_OPTIONS` | mask tokens or whole rows whose divergence is out of bounds; every option must pass | `rejection_mask` / compute_rollout_rejection_mask |
| rollout_rs_threshold | one spec, or one per option | k1 options: "l_u" (or u, meaning 1/u_u); others: an upper bound | `parse_rs_thresholds` / _parse_rollout_rs_thresholds |
| bypass_mode | bool | see the modes above | trainer / apply_bypass_mode |
| loss_type | ppo_clip, reinforce | the loss in bypass mode | `bypass_mode_loss` / core_algos.compute_policy_loss_bypass_mode |

RS options: with log r clamped to +-20, k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r;
token_kX tests each token, seq_sum_kX / seq_mean_kX / seq_max_kX the row's sum / mean /
max of kX over its valid tokens and keep or reject the whole row. k1 options keep
log(l) <= statistic <= log(u): the bounds apply to exp(k1) = pi_rollout / pi_train, the
INVERSE of the IS ratio (as in verl; equal to bounds on r when l = 1/u). Others keep
statistic <= u.

Differences from verl:
  - ESS of all-zero weights (e.g. IcePop rejecting every token) is 0.0 here; verl divides by
    zero (ZeroDivisionError).
  - A k1 RS threshold of 0 raises ValueError naming the key (verl: ZeroDivisionError); NaN
    thresholds and booleans raise (verl accepts NaN; a boolean RS spec fails later).
  - `rollout_is` set with `rollout_is_threshold=None` raises (verl silently skips the weights).
  - Masked tokens never contribute, even holding NaN or inf log-probs (verl multiplies the
    raw token weights by the mask, so a NaN at a masked token would give a NaN weight).
  - Batch normalisation: verl takes a distributed mean when torch.distributed is
    initialised. This module is pure and is given the WHOLE batch (the trainer calls
    `rollout_correction` once, on rank 0, with all rows), so its local mean IS the global
    one. In bypass mode verl forms the weights per micro-batch and divides them by that
    micro-batch's mean (over all ranks), which depends on how the mini-batch is split;
    megappo divides them by the MINI-BATCH's mean (one optimizer step's sequences): the
    trainer sums `is_weight_sums` over the mini-batch in a forward pass of the current policy
    before the update and gives each part `rollout_is_batch_mean` (loss_type=reinforce; with
    ppo_clip the weights are metrics only, and a part's own mean is used).
  - `bypass_mode_loss` on a micro-batch without valid tokens returns the (zero) loss with no
    "rollout_corr/" metrics (verl raises ValueError); `reinforce_loss`'s actor/ppo_kl is a
    part of the global token mean, like losses.policy_loss (verl: a local masked mean).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megappo.ppo.correction_spec import (_IS_FIX, _KEY, IS_LEVELS, parse_is_threshold, parse_rs_options,
                                     parse_rs_thresholds, validate)
from megappo.ppo.losses import LossInputs, policy_loss
from megappo.ppo.stats import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # log ratios are clamped to [-20, 20] before exp: weights in [2e-9, 4.9e8]
PREFIX = "rollout_corr/"


# -- IS weights ----------------------------------------------------------------------------------

def _zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values * mask, with masked positions exactly 0 even where values hold NaN or inf."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)) * mask


def _require_tokens(response_mask: torch.Tensor, what: str) -> None:
    if not response_mask.any():
        raise ValueError(f"{what} needs at least one valid token in response_mask (all {tuple(response_mask.shape)} "
                         "are masked); drop empty batches before rollout correction")


# log ratio [B, T] -> the log ratio each token's weight is formed from: [B, T] or [B, 1]
_IS_LOG_RATIO = {
    "token": lambda log_ratio, mask: log_ratio,
    "sequence": lambda log_ratio, mask: masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1),
}


def is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, *, level: str = "token",
               threshold: float | str = 2.0, batch_normalize: bool = False,
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] log(pi_old / pi_rollout) -> ([B, T] detached IS weights, 0 at masked tokens;
    metrics without the "rollout_corr/" prefix). verl's compute_rollout_correction_weights.

    level "token": w_t = exp(clamp(log r_t, +-20)); "sequence": w = exp(clamp(sum_t log r_t,
    +-20)) for all of the row's tokens. A threshold u truncates (w = min(w, u), TIS); "l_u"
    zeroes weights outside [l, u] (IcePop, adds rollout_is_oob_ratio). batch_normalize divides
    by the mean over valid tokens (token) or non-empty rows (sequence) of the given batch,
    after the metrics are taken (adds rollout_is_batch_norm_factor; see the module docstring)."""
    if level not in IS_LEVELS:
        raise ValueError(f"{_KEY}rollout_is={level!r} is unknown. Fix: choose from {list(IS_LEVELS)}.")
    upper, lower = parse_is_threshold(threshold)
    _require_tokens(response_mask, "rollout IS weights")
    with torch.no_grad():
        log_ratio_for_metrics = _IS_LOG_RATIO[level](log_ratio.detach(), response_mask)  # [B, T] or [B, 1]
        clamped = log_ratio_for_metrics.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
        raw = _zero_masked(torch.exp(clamped).expand_as(log_ratio), response_mask)
        if lower is None:
            weights = raw.clamp(max=upper)
        else:
            weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
        metrics = _is_metrics(weights, raw, log_ratio_for_metrics, response_mask, level, upper, lower)
        if lower is not None:
            metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(),
                                                          response_mask).item()
        if batch_normalize:
            mean = _batch_mean(weights, response_mask, level)
            metrics["rollout_is_batch_norm_factor"] = mean.item() if mean > 1e-8 else 1.0
            weights = weights / mean if mean > 1e-8 else weights
    return weights, metrics


def _batch_mean(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Mean weight over valid tokens (token) or over non-empty rows (sequence), as verl."""
    if level == "token":
        return masked_mean(weights, mask)
    total, rows = _batch_sums(weights, mask, level)
    return total / rows.clamp_min(1e-8)


def _batch_sums(weights: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) whose ratio is `_batch_mean`: over valid tokens (token) or non-empty rows (sequence)."""
    if level == "token":
        return masked_sum(weights, mask), mask.sum()
    row_weights = masked_mean(weights, mask, dim=-1)  # [B]
    non_empty = (mask.sum(-1) > 0).to(weights.dtype)
    return (row_weights * non_empty).sum(), non_empty.sum()


def weights_need_batch_mean(*, loss_type: str = "ppo_clip", rollout_is: str | None = None,
                            rollout_is_batch_normalize: bool = False, **_) -> bool:
    """Whether bypass mode's loss weighs its tokens by batch-normalised IS weights, so each part needs the
    mini-batch's mean (`rollout_is_batch_mean`, from `is_weight_sums`): REINFORCE with weights and batch
    normalisation. With ppo_clip the weights are metrics only (a part's own mean serves)."""
    return loss_type == "reinforce" and rollout_is is not None and rollout_is_batch_normalize


def is_weight_sums(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, *,
                   rollout_is: str, rollout_is_threshold: float | str) -> torch.Tensor:
    """[2] float64 (sum, count) of the IS weights of a part of a mini-batch (all inputs [B, T]; log ratio =
    log_prob - rollout_log_prob), whose totals over the parts give the mini-batch mean that bypass mode's
    batch normalisation divides by (`bypass_mode_loss`'s rollout_is_batch_mean): over valid tokens
    (rollout_is=token) or non-empty rows (sequence), after truncation, as `is_weights`' batch mean.
    (0, 0) for a part without valid tokens."""
    if not response_mask.any():
        return torch.zeros(2, dtype=torch.float64, device=log_prob.device)
    weights, _ = is_weights(log_prob.detach() - rollout_log_prob.detach(), response_mask, level=rollout_is,
                            threshold=rollout_is_threshold)
    total, count = _batch_sums(weights, response_mask.to(weights.dtype), rollout_is)
    return torch.stack([total.double(), count.double()])


def _is_metrics(weights: torch.Tensor, raw: torch.Tensor, log_ratio_for_metrics: torch.Tensor,
                mask: torch.Tensor, level: str, upper: float, lower: float | None) -> dict[str, float]:
    """verl's compute_is_metrics: weights [B, T] (applied), raw [B, T] (before TIS / IcePop),
    log_ratio_for_metrics [B, T] (token) or [B, 1] (sequence, unclamped row sums)."""
    lower = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {}
    valid = mask.bool()
    if level == "sequence":
        log_upper = torch.log(torch.tensor(upper, device=weights.device))
        log_lower = torch.log(torch.tensor(lower, device=weights.device))
        m["rollout_is_max"] = torch.exp(log_ratio_for_metrics.max().clamp(max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        m["rollout_is_mean"] = masked_mean(weights, mask).item()
        # over all rows, empty ones (log ratio 0) included, as verl
        m["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_upper).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_lower).float().mean().item()
    else:
        m["rollout_is_mean"] = masked_mean(weights, mask).item()
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).float(), mask).item()
        m["rollout_is_max"] = weights.masked_fill(~valid, float("-inf")).max().item()
        m["rollout_is_min"] = weights.masked_fill(~valid, float("inf")).min().item()
    bounded = weights.clamp(min=0.0, max=upper)
    bounded_mean = masked_mean(bounded, mask)
    if mask.sum() > 1:
        var = masked_mean(bounded.square(), mask) - bounded_mean.square()
        m["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    second_moment = masked_mean((bounded / (bounded_mean + 1e-8)).square(), mask).item()
    m["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment > 0 else 0.0
    row_mean = masked_mean(weights, mask, dim=-1)  # [B], empty rows give 0, counted as verl does
    m["rollout_is_seq_mean"] = row_mean.mean().item()
    m["rollout_is_seq_std"] = row_mean.std().item() if row_mean.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = row_mean.max().item()
    m["rollout_is_seq_min"] = row_mean.min().item()
    m["rollout_is_seq_max_deviation"] = (row_mean - 1.0).abs().max().item()
    raw_row_mean = masked_mean(raw, mask, dim=-1)
    m["rollout_is_seq_fraction_high"] = (raw_row_mean > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_row_mean < lower).float().mean().item()
    return m


# -- rejection sampling --------------------------------------------------------------------------

def _row_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B] max over valid tokens, 0 for empty rows."""
    top = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(top == float("-inf"), torch.zeros_like(top), top)


# clamped log ratio [B, T] -> per-token divergence [B, T]
_DIVERGENCES = {
    "k1": lambda lr: -lr,
    "k2": lambda lr: 0.5 * lr ** 2,
    "k3": lambda lr: torch.exp(lr) - 1.0 - lr,
}
# per-token divergence [B, T], mask [B, T] -> per-row statistic [B] (None: token level)
_ROW_STATISTICS = {
    "token": None,
    "seq_sum": lambda values, mask: masked_sum(values, mask, dim=-1),
    "seq_mean": lambda values, mask: masked_mean(values, mask, dim=-1),
    "seq_max": _row_max,
}


def rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, *, options: str,
                   threshold: float | str) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] log(pi_old / pi_rollout) -> ([B, T] response_mask with rejected tokens 0, same
    dtype; metrics without the "rollout_corr/" prefix). verl's compute_rollout_rejection_mask:
    `options` is rollout_rs (comma separated, all must pass), `threshold` rollout_rs_threshold."""
    names = parse_rs_options(options)
    bounds = parse_rs_thresholds(names, threshold)
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    _require_tokens(response_mask, "rollout rejection sampling")
    with torch.no_grad():
        clamped = log_ratio.detach().clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
        valid = response_mask.bool()
        non_empty = response_mask.sum(dim=-1) > 0  # [B]
        keep_all = torch.ones_like(response_mask, dtype=clamped.dtype)
        metrics: dict[str, float] = {}
        for name in names:
            level, estimator = name.rsplit("_", 1)
            token_stat = _DIVERGENCES[estimator](clamped)
            row_stat = None if _ROW_STATISTICS[level] is None else _ROW_STATISTICS[level](token_stat, response_mask)
            lower, upper = bounds[name]
            if lower is not None:  # k1: bounds in log space
                lower, upper = math.log(lower), math.log(upper)
            stat = token_stat if row_stat is None else row_stat
            keep = stat <= upper if lower is None else (stat >= lower) & (stat <= upper)
            if row_stat is not None:
                keep, token_stat = keep.unsqueeze(-1).expand_as(valid), row_stat.unsqueeze(-1).expand_as(clamped)
            metrics.update(_rs_metrics(f"rollout_rs_{name}", token_stat, row_stat, response_mask, non_empty,
                                       upper, lower))
            keep_f = keep.to(clamped.dtype)
            keep_all = keep_all * keep_f
            row_kept = (keep | ~valid).all(dim=-1).to(clamped.dtype)
            rows = non_empty.float()
            metrics[f"rollout_rs_{name}_masked_fraction"] = masked_mean(1 - keep_f, response_mask).item()
            metrics[f"rollout_rs_{name}_seq_masked_fraction"] = (((1.0 - row_kept) * rows).sum() / rows.sum()).item()
        metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep_all, response_mask).item()
        # over all rows, empty ones included (verl; the per-option fraction counts non-empty rows)
        rejected_any = (valid & ~(keep_all > 0.5)).any(dim=-1)
        metrics["rollout_rs_seq_masked_fraction"] = rejected_any.float().mean().item()
    return (response_mask * keep_all).to(dtype=response_mask.dtype), metrics


def _rs_metrics(prefix: str, token_stat: torch.Tensor, row_stat: torch.Tensor | None, mask: torch.Tensor,
                non_empty: torch.Tensor, upper: float, lower: float | None) -> dict[str, float]:
    """verl's compute_rs_metrics for one option: token_stat [B, T] (the row statistic repeated
    for sequence options), row_stat [B] or None; `lower` only for k1 options (log space)."""
    rows = (masked_mean(token_stat, mask, dim=-1) if row_stat is None else row_stat)[non_empty]
    m: dict[str, float] = {}
    valid = mask.bool()
    m[f"{prefix}_mean"] = masked_mean(token_stat, mask).item()
    if row_stat is not None:
        m[f"{prefix}_max"], m[f"{prefix}_min"] = rows.max().item(), rows.min().item()
        m[f"{prefix}_fraction_high"] = (rows > upper).float().mean().item()
        m[f"{prefix}_fraction_low"] = (rows < lower).float().mean().item() if lower is not None else 0.0
    else:
        m[f"{prefix}_max"] = token_stat.masked_fill(~valid, float("-inf")).max().item()
        m[f"{prefix}_min"] = token_stat.masked_fill(~valid, float("inf")).min().item()
        m[f"{prefix}_fraction_high"] = masked_mean((token_stat > upper).float(), mask).item()
        m[f"{prefix}_fraction_low"] = (masked_mean((token_stat < lower).float(), mask).item()
                                       if lower is not None else 0.0)
    if mask.sum() > 1:
        bounded = token_stat.clamp(min=0.0 if lower is None else lower, max=upper)
        var = masked_mean(bounded.square(), mask) - masked_mean(bounded, mask).square()
        m[f"{prefix}_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        m[f"{prefix}_std"] = 0.0
    m[f"{prefix}_seq_mean"] = rows.mean().item()
    m[f"{prefix}_seq_std"] = rows.std().item() if rows.numel() > 1 else 0.0
    m[f"{prefix}_seq_max"] = rows.max().item()
    m[f"{prefix}_seq_min"] = rows.min().item()
    m[f"{prefix}_seq_max_deviation"] = rows.abs().max().item()
    m[f"{prefix}_seq_fraction_high"] = (rows > upper).float().mean().item()
    if lower is not None:
        m[f"{prefix}_seq_fraction_low"] = (rows < lower).float().mean().item()
    return m


# -- off-policy diagnostics ----------------------------------------------------------------------

def offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None,
                      response_mask: torch.Tensor) -> dict[str, float]:
    """verl's compute_offpolicy_metrics, all [B, T] in, metrics without the prefix: training_ppl /
    training_log_ppl (and rollout_*) as the mean over rows of exp(-row mean log-prob) / -row mean
    (empty rows count, with 0); kl = mean of rollout - old; k3_kl; log_ppl_diff (mean, abs, max,
    min) and ppl_ratio of row means; chi2_token = E[r^2] - 1; chi2_seq = E_rows[(prod r)^2] - 1,
    both with log ratios clamped to +-20. Only training_* when rollout_log_prob is None."""
    _require_tokens(response_mask, "rollout off-policy metrics")
    with torch.no_grad():
        old = old_log_prob.detach()
        m: dict[str, float] = {}
        old_row = masked_mean(old, response_mask, dim=-1)  # [B]
        m["training_ppl"] = torch.exp(-old_row).mean().item()
        m["training_log_ppl"] = (-old_row).mean().item()
        if rollout_log_prob is None:
            return m
        rollout = rollout_log_prob.detach()
        m["kl"] = masked_mean(rollout - old, response_mask).item()
        log_ratio = old - rollout
        m["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()
        rollout_row = masked_mean(rollout, response_mask, dim=-1)
        m["rollout_ppl"] = torch.exp(-rollout_row).mean().item()
        m["rollout_log_ppl"] = (-rollout_row).mean().item()
        diff = rollout_row - old_row  # [B] log(training ppl / rollout ppl)
        m["log_ppl_diff"] = diff.mean().item()
        m["log_ppl_abs_diff"] = diff.abs().mean().item()
        m["log_ppl_diff_max"] = diff.max().item()
        m["log_ppl_diff_min"] = diff.min().item()
        m["ppl_ratio"] = torch.exp(diff).mean().item()
        clamped = log_ratio.clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
        m["chi2_token"] = (masked_mean(torch.exp(clamped).square(), response_mask) - 1.0).item()
        row_sum = masked_sum(log_ratio, response_mask, dim=-1).clamp(min=-SAFETY_BOUND, max=SAFETY_BOUND)
        m["chi2_seq"] = (torch.exp(2.0 * row_sum).mean() - 1.0).item()
    return m


# -- the whole correction ------------------------------------------------------------------------

def rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, *,
                       rollout_is: str | None = None, rollout_is_threshold: float | str | None = 2.0,
                       rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
                       rollout_rs_threshold: float | str | None = None,
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights, rejection mask and metrics of a batch; verl's
    compute_rollout_correction_and_rejection_mask. All inputs [B, T]; log ratio = old - rollout.

    Returns (IS weights [B, T], detached, 0 at masked tokens, or None when rollout_is is None;
    response_mask [B, T] with the rejected tokens 0, same dtype, a copy; {"rollout_corr/<verl
    name>": float}: the IS metrics (`is_weights`), RS metrics per option (`rejection_mask`) and
    the off-policy metrics (`offpolicy_metrics`, always, over the mask BEFORE rejection)).
    Decoupled mode calls this once with the whole batch, so the batch normalisation's mean is
    the global one. Raises ValueError when no token is valid or the shapes differ."""
    _require_tokens(response_mask, "rollout correction")
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"rollout correction needs [B, T] tensors of one shape: old_log_prob "
                         f"{tuple(old_log_prob.shape)}, rollout_log_prob {tuple(rollout_log_prob.shape)}, "
                         f"response_mask {tuple(response_mask.shape)}")
    log_ratio = old_log_prob.detach() - rollout_log_prob.detach()
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        if rollout_is_threshold is None:
            raise ValueError(f"{_KEY}rollout_is={rollout_is!r} needs {_KEY}rollout_is_threshold. {_IS_FIX}")
        weights, is_metrics = is_weights(log_ratio, response_mask, level=rollout_is, threshold=rollout_is_threshold,
                                         batch_normalize=rollout_is_batch_normalize)
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rollout_rs is not None:
        mask, rs_metrics = rejection_mask(log_ratio, response_mask, options=rollout_rs, threshold=rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {PREFIX + key: value for key, value in metrics.items()}


# -- bypass-mode losses --------------------------------------------------------------------------

def reinforce_loss(x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE with optional IS weights, all inputs [B, T]; verl's compute_policy_loss_reinforce.

    l = -A * log_prob (* w), aggregated by losses.agg_loss with the record's global counts (split
    invariant as losses.policy_loss). old_log_prob (the rollout's) only feeds the metric
    actor/ppo_kl = token mean of old_log_prob - log_prob, a part of the global token mean when
    global_tokens is given (sum it over parts). The weights should be detached."""
    loss = x.aggregate(-x.advantages * x.log_prob)
    return loss, {"actor/ppo_kl": x.token_mean(x.old_log_prob.detach() - x.log_prob.detach())}


def bypass_mode_loss(x: LossInputs, *, loss_type: str = "ppo_clip", rollout_is: str | None = None,
                     rollout_is_threshold: float | str | None = 2.0, rollout_is_batch_normalize: bool = False,
                     rollout_is_batch_mean: float | None = None,
                     rollout_rs: str | None = None, rollout_rs_threshold: float | str | None = None,
                     clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Bypass-mode policy loss of one part (micro-batch), all inputs [B, T]; verl's
    compute_policy_loss_bypass_mode. old_log_prob is the rollout engine's.

    IS weights and the rejection mask come from `rollout_correction(log_prob.detach(),
    old_log_prob, response_mask)`, so they follow the current policy and carry no gradient.
    loss_type "ppo_clip": losses.policy_loss on the rejection-masked mask WITHOUT the IS
    weights (the ratio pi/pi_rollout is already the IS ratio; they are computed for the metrics
    only); "reinforce": `reinforce_loss` with the weights. Give every part the counts of the
    whole mini-batch BEFORE rejection (`LossInputs(..., **global_counts(mini_batch_mask))`, as verl's
    global_batch_info): rejected tokens then contribute 0 and the parts' losses add up as in
    losses.py's contract (a) / (b). (Without counts, agg_loss divides by the tokens / rows the
    part keeps AFTER rejection: another normalisation.) The actor/* metrics are parts of global token means (sum
    them over parts; rejected tokens count as 0); the "rollout_corr/*" metrics are local to the
    part (verl averages them over micro-batches: average them over parts), and absent for a
    part without valid tokens. `x.rollout_is_weights` must be None: this loss forms its own.
    rollout_is_batch_normalize divides the weights by `rollout_is_batch_mean`, the mean of the mini-batch
    this part belongs to (`is_weight_sums` over its parts; the metric rollout_is_batch_norm_factor), or,
    when that is None, by this call's own mean (the whole mini-batch given at once)."""
    validate(rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
             rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
             rollout_rs_threshold=rollout_rs_threshold, bypass_mode=True, loss_type=loss_type)
    given_mean = rollout_is_batch_normalize and rollout_is_batch_mean is not None
    if x.rollout_is_weights is not None:
        raise ValueError("bypass_mode_loss forms its own IS weights from the current log-probs, but precomputed "
                         "rollout_is_weights were given (decoupled mode's, or actor.old_logprob=is_correct). Fix: use "
                         f"one of {_KEY}bypass_mode=true or the precomputed weights, not both.")
    weights, mask, corr_metrics = None, x.response_mask, {}
    if x.response_mask.any():
        weights, mask, corr_metrics = rollout_correction(
            x.log_prob.detach(), x.old_log_prob, x.response_mask, rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold, rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize and not given_mean)
        if given_mean and weights is not None:  # as is_weights' own normalisation: not by a mean of ~0
            weights = weights / rollout_is_batch_mean if rollout_is_batch_mean > 1e-8 else weights
            corr_metrics[PREFIX + "rollout_is_batch_norm_factor"] = (rollout_is_batch_mean if rollout_is_batch_mean > 1e-8
                                                                     else 1.0)
    if loss_type == "reinforce":
        loss, metrics = reinforce_loss(dataclasses.replace(x, response_mask=mask, rollout_is_weights=weights))
    else:
        loss, metrics = policy_loss(dataclasses.replace(x, response_mask=mask), clip_ratio_low=clip_ratio_low,
                                    clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    return loss, {**metrics, **corr_metrics}


# -- presets -------------------------------------------------------------------------------------

def _preset(**keys) -> dict:
    return {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False, "rollout_rs": None,
            "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip", **keys}


_GEO = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}  # geometric-mean RS, +-0.1%
_K3 = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
_BYPASS_PG = {"bypass_mode": True, "loss_type": "reinforce"}
_BYPASS_CLIP = {"bypass_mode": True, "loss_type": "ppo_clip"}

# verl's RolloutCorrectionConfig classmethods with their default arguments (verl/trainer/config/
# algorithm.py), as full settings of algorithm.rollout_correction's keys.
PRESETS: dict[str, dict] = {
    "decoupled_token_is": _preset(rollout_is="token"),
    "decoupled_seq_is": _preset(rollout_is="sequence"),
    "decoupled_token_icepop": _preset(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    "decoupled_seq_is_rs": _preset(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": _preset(**_GEO),
    "decoupled_geo_rs_seq_tis": _preset(rollout_is="sequence", **_GEO),
    "decoupled_geo_rs_token_tis": _preset(rollout_is="token", **_GEO),
    "decoupled_k3_rs": _preset(**_K3),
    "decoupled_k3_rs_seq_tis": _preset(rollout_is="sequence", **_K3),
    "decoupled_k3_rs_token_tis": _preset(rollout_is="token", **_K3),
    "bypass_ppo_clip": _preset(**_BYPASS_CLIP),
    "bypass_ppo_clip_geo_rs": _preset(**_GEO, **_BYPASS_CLIP),
    "bypass_ppo_clip_k3_rs": _preset(**_K3, **_BYPASS_CLIP),
    "bypass_pg_is": _preset(rollout_is="sequence", **_BYPASS_PG),
    "bypass_pg_token_icepop": _preset(rollout_is="token", rollout_is_threshold="0.5_5.0", **_BYPASS_PG),
    "bypass_pg_geo_rs": _preset(**_GEO, **_BYPASS_PG),
    "bypass_pg_geo_rs_seq_tis": _preset(rollout_is="sequence", **_GEO, **_BYPASS_PG),
    "bypass_pg_geo_rs_token_tis": _preset(rollout_is="token", **_GEO, **_BYPASS_PG),
    "disabled": _preset(),
}
