"""The policy-loss registry: verl 0.9.1's eleven policy losses (actor.policy_loss.loss_mode)
as pure tensor functions, chosen by name from `POLICY_LOSSES`.

Owns: one function per loss, the registry, `get_policy_loss`, `POLICY_LOSS_KNOBS` (each
loss's knobs, read from its signature once at import), `compute_policy_loss` (calls a loss
with the knobs it takes) and the checks of each loss's knobs. `vanilla` is
`megappo.ppo.losses.policy_loss` (with its verl-literal reference `policy_loss_reference`
there); the inputs record `LossInputs` and aggregation (`agg_loss`) are megappo.ppo.losses'.
Does not know about configs, process groups or models: knobs are flat keyword arguments
named after their config keys, cross-rank totals come in the record as `global_tokens`,
`global_seqs`, `dp_size`.

Shape legend: [B, T] = (sequences in this part, response tokens); [B] = one value per
sequence. Every loss is
  fn(x: LossInputs, *, <its knobs, with verl's defaults>) -> (loss, metrics)
where the record x holds the [B, T] tensors old_log_prob, log_prob, advantages,
response_mask, rollout_is_weights (None or detached by the caller: they multiply the
per-token loss before aggregation) and the aggregation settings loss_agg_mode,
global_tokens, global_seqs, dp_size, loss_scale_factor (x.aggregate(per-token losses),
x.token_mean(values)); loss is a 0-dim tensor and metrics {verl's name: 0-dim detached
tensor}: the names verl's function returns plus megappo's own (OWN_METRICS).

Notation: d = log_prob - old_log_prob, r = exp(clamp(d, -20, 20)), r' = exp(d) (no
clamp), p = exp(log_prob), p_old = exp(old_log_prob), sg = stop-gradient, n = valid
tokens of the part, [.] = 0/1 indicator; lo, hi, c = the knobs clip_ratio_low,
clip_ratio_high, clip_ratio_c.

| loss | per-token loss l | knobs | verl (core_algos.py) | differs from verl |
|---|---|---|---|---|
| vanilla | A>=0: -A min(r, 1+hi); A<0: -A min(max(r, 1-lo), c) | lo, hi, c | compute_policy_loss_vanilla | closed form of verl's max/min |
| dppo_tv | -A sg(min(r, c)) log_prob v, v = [p - p_old <= hi] if A>0 else [p - p_old >= -lo] | lo, hi, c | compute_policy_loss_dppo_tv | c's default (below) |
| dppo_kl | as dppo_tv with v = [KL <= hi or p <= p_old] if A>0 else [KL <= lo or p >= p_old] | lo, hi, c | compute_policy_loss_dppo_kl | c's default (below) |
| gspo | max(-A s, -A clip(s, 1-lo, 1+hi)), s = exp(min(sg(row mean of d) + log_prob - sg(log_prob), 10)) | lo, hi | compute_policy_loss_gspo | default loss_agg_mode (below) |
| sapo | -A (4/tau) sigmoid(tau (r - 1)), tau = tau_pos if A>0 else tau_neg; always seq-mean-token-mean | tau_pos, tau_neg | compute_policy_loss_sapo | none |
| gpg | -A log_prob | - | compute_policy_loss_gpg | none |
| clip_cov | max(-A r', -A clip(r', 1-lo, 1+hi)) keep, keep = 0 on drawn tokens (below) | lo, hi, clip_cov_ratio, clip_cov_lb, clip_cov_ub, generator | compute_policy_loss_clip_cov | the RNG (below) |
| kl_cov | -A r' + ppo_kl_coef abs(d) on the max(1, floor(kl_cov_ratio n)) tokens of largest cov, -A r' elsewhere | kl_cov_ratio, ppo_kl_coef | compute_policy_loss_kl_cov | none |
| geo_mean | per row: -mean(A) exp(row mean of sign(A) min(sign(A) d, sign(A) clip(d, -lo, hi))) | lo, hi | compute_policy_loss_geo_mean | the row divisor (below) |
| dro | -(A log_prob - dro_beta/2 d^2) | dro_beta (required) | compute_policy_loss_dro | none |
| cispo | -sg(clip(r, 1-lo, 1+hi)) A log_prob | lo, hi | compute_policy_loss_cispo | none |

KL = binary KL(Bernoulli(p_old) || Bernoulli(p)) with 1e-8 guards. clip_cov draws max(1, floor(clip_cov_ratio n))
tokens at random among the valid ones that the clip did not already cut with
clip_cov_lb < cov < clip_cov_ub. geo_mean multiplies each row by the geometric mean of its
rollout IS weights and aggregates rows (loss_agg_mode is ignored, as in verl; it assumes
sequence-level advantages, as verl does).
cov = (A - mean A) (log_prob - mean log_prob) over the part's valid tokens (log_prob detached).
Metrics: actor/ppo_kl = token mean of -d (clamped where the loss clamps d; kl_cov: of abs(d));
actor/pg_clipfrac / actor/pg_clipfrac_lower as each verl function defines them (0 where verl
returns a constant 0: gspo and cispo lower, sapo both; clip_cov: the fraction of tokens with
keep = 0); gpg returns none.
megappo's own metrics (OWN_METRICS; token means, split-invariant like the others), one per loss whose verl
metrics another loss also emits, so a run shows which loss it trained with: gspo actor/gspo_seq_ratio
(s on every token), sapo actor/sapo_gate (4 sigmoid(x)(1 - sigmoid(x)), x = tau (r - 1): the weight of a
token's ratio gradient, 1 at r = 1, -> 0 away from it), cispo actor/cispo_weight (sg(clip(r, 1-lo, 1+hi))),
kl_cov actor/kl_cov_penalised_frac (the tokens given the |d| penalty), clip_cov actor/clip_cov_cut_frac
(= its actor/pg_clipfrac: the drawn tokens whose gradient is cut).
bypass_mode (rollout correction's two-policy loss, ppo_clip or reinforce) is registered here and lives
in megappo.ppo.rollout_correction.

Split invariance. Every loss keeps the contract of megappo.ppo.losses (its module docstring):
build every micro-batch / DP part's LossInputs with `**global_counts(mask_of_the_mini_batch)`
(and dp_size) and the parts' losses (and gradients) sum to the whole mini-batch's loss, and the
parts' token-mean metrics sum to the mini-batch's metric. Sequence-level quantities (GSPO's
sequence ratio, geo_mean's geometric mean, sapo's and seq-mean modes' row means) are exact
because megappo's micro-batches always hold whole sequences (megappo.parallel.packing).
Exceptions:
  - geo_mean: verl takes torch.mean over the rows of the micro-batch, which depends on the
    split and counts empty rows. megappo sums the rows' losses and divides by global_seqs
    (non-empty rows of the mini-batch; this part's own when None) times dp_size: verl's value
    when the part is the whole batch and no row is empty.
  - clip_cov / kl_cov choose their tokens from the covariance over the tokens of the part they
    are given, exactly as verl does per micro-batch, so the selection (and the loss) depends on
    the micro-batch split; only the aggregation of the chosen per-token losses is split-invariant.

Other differences from verl:
  - metrics are 0-dim tensors (verl: Python floats via .item()), token means over
    global_tokens when given (verl: the part's own masked mean);
  - a part with no valid token gives loss 0 (verl's token-mean gives NaN), and masked
    positions never contribute even when they hold NaN or inf (masked sums throughout);
  - knobs are checked up front with ValueErrors naming the config key (verl asserts a few);
    extra checks: clip_cov_lb < clip_cov_ub, clip_cov_ratio and kl_cov_ratio in (0, 1]
    (verl's kl_cov fails in topk above 1), ppo_kl_coef >= 0, tau_pos / tau_neg > 0;
  - clip_cov draws with torch.randperm(k, generator=generator) on the CPU; with generator
    None a fresh generator seeded with 0 is used, so the draw is still deterministic (the
    same part gives the same tokens). A caller that passes its own generator must save its
    state with the checkpoint for an exact resume. As in verl, the generator is used only
    when there is at least one candidate token.
  - gspo: loss_agg_mode defaults to token-mean like every loss here; verl's signature says
    seq-mean-token-mean, but verl's actor always passes actor.loss_agg_mode (token-mean by default).
  - dppo_tv / dppo_kl: verl reads clip_ratio_c with config.get("clip_ratio_c", 20.0); verl's
    ActorConfig always has clip_ratio_c (default 3.0), so verl's trainer uses 3.0 unless set,
    and megappo's trainer passes actor.clip_ratio_c the same way. The function default here
    is 20.0 (verl's fallback, the DPPO paper's large truncation) for direct calls.
  - kl_cov: ppo_kl_coef defaults to 0.1 (PolicyLossConfig); verl's function falls back to 1.0
    only for a config holding None.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import torch

from megappo.ppo.losses import LossInputs, agg_loss, policy_loss
from megappo.ppo.rollout_correction import bypass_mode_loss
from megappo.ppo.specs import POLICY_LOSS_NAMES
from megappo.ppo.stats import masked_mean, masked_sum

Metrics = dict[str, torch.Tensor]

# -- knob checks ---------------------------------------------------------------------------------


def _require(ok: bool, key: str, rule: str, loss_mode: str, value) -> None:
    if not ok:
        raise ValueError(f"actor.{key} must be {rule} for loss_mode={loss_mode}, got {value}")


def _check_clip_ratios(loss_mode: str, clip_ratio_low: float, clip_ratio_high: float) -> None:
    _require(clip_ratio_low >= 0, "clip_ratio_low", ">= 0", loss_mode, clip_ratio_low)
    _require(clip_ratio_high >= 0, "clip_ratio_high", ">= 0", loss_mode, clip_ratio_high)


def _check_cov_ratio(loss_mode: str, key: str, ratio: float) -> None:
    _require(0 < ratio <= 1, f"policy_loss.{key}", "in (0, 1] (a fraction of the valid tokens)", loss_mode, ratio)


# -- shared steps --------------------------------------------------------------------------------


def _log_ratio(x: LossInputs, clamp: bool) -> torch.Tensor:
    """[B, T] d = log_prob - old_log_prob, clamped to [-20, 20] where the verl loss clamps it."""
    d = x.log_prob - x.old_log_prob
    return torch.clamp(d, min=-20.0, max=20.0) if clamp else d


def _zero(like: torch.Tensor) -> torch.Tensor:
    """A constant-0 metric (verl returns torch.tensor(0.0) for metrics a loss does not have)."""
    return torch.zeros((), dtype=like.dtype, device=like.device)


# -- the losses ----------------------------------------------------------------------------------


def _dppo(loss_mode: str, x: LossInputs, *, clip_ratio_low: float, clip_ratio_high: float,
          clip_ratio_c: float) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV / -KL (https://arxiv.org/abs/2602.04879): a policy gradient with a
    truncated IS weight sg(min(r, c)) on the tokens whose probability moved by less than the
    divergence bound in the direction the advantage pushes (clip_ratio_low/high are the bound)."""
    _check_clip_ratios(loss_mode, clip_ratio_low, clip_ratio_high)
    _require(clip_ratio_c > 0, "clip_ratio_c", "> 0 (the IS truncation)", loss_mode, clip_ratio_c)
    old_log_prob, log_prob = x.old_log_prob, x.log_prob
    d = _log_ratio(x, clamp=True)
    ratio = torch.exp(d)
    with torch.no_grad():
        prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
        if loss_mode == "dppo_tv":
            up = (prob - old_prob) <= clip_ratio_high
            down = (prob - old_prob) >= -clip_ratio_low
        else:
            binary_kl = (old_prob * (old_log_prob - log_prob)
                         + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)))
            up = (binary_kl <= clip_ratio_high) | (prob <= old_prob)
            down = (binary_kl <= clip_ratio_low) | (prob >= old_prob)
        valid = torch.where(x.advantages > 0, up, down).to(log_prob.dtype)
        weight = torch.clamp(ratio, max=clip_ratio_c) * valid
    loss = x.aggregate(-x.advantages * weight * log_prob)
    return loss, {
        "actor/pg_clipfrac": x.token_mean(1.0 - valid),
        "actor/ppo_kl": x.token_mean(-d),
        "actor/pg_clipfrac_lower": x.token_mean((ratio > clip_ratio_c).to(valid.dtype) * valid),
    }


def dppo_tv(x: LossInputs, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
            clip_ratio_c: float = 20.0) -> tuple[torch.Tensor, Metrics]:
    """DPPO with the total-variation bound |p - p_old| (see the table)."""
    return _dppo("dppo_tv", x, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                 clip_ratio_c=clip_ratio_c)


def dppo_kl(x: LossInputs, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
            clip_ratio_c: float = 20.0) -> tuple[torch.Tensor, Metrics]:
    """DPPO with the binary-KL bound KL(Bernoulli(p_old) || Bernoulli(p)) (see the table)."""
    return _dppo("dppo_kl", x, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                 clip_ratio_c=clip_ratio_c)


def gspo(x: LossInputs, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> tuple[torch.Tensor, Metrics]:
    """GSPO (https://arxiv.org/abs/2507.18071): the clipped surrogate with the sequence ratio
    s_i = exp(mean of d over row i's valid tokens) on every token of the row, carrying each
    token's own gradient: s_it = sg(s_i) * p_it / sg(p_it). The [B] row means need whole rows."""
    _check_clip_ratios("gspo", clip_ratio_low, clip_ratio_high)
    log_prob, advantages = x.log_prob, x.advantages
    d = _log_ratio(x, clamp=False)
    row_tokens = x.response_mask.sum(-1).clamp(min=1)
    row_log_ratio = (masked_sum(d, x.response_mask, dim=-1) / row_tokens).detach()  # [B]
    log_s = torch.clamp(log_prob - log_prob.detach() + row_log_ratio.unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    # max(-A s, -A clip(s, 1-lo, 1+hi)) = -A min(s, 1+hi) for A >= 0 and -A max(s, 1-lo) for A < 0
    bounded = torch.where(advantages >= 0, torch.clamp(s, max=1 + clip_ratio_high),
                          torch.clamp(s, min=1 - clip_ratio_low))
    loss = x.aggregate(-advantages * bounded)
    with torch.no_grad():
        a, s = advantages.detach(), s.detach()
        clipped = ((a > 0) & (s > 1 + clip_ratio_high)) | ((a < 0) & (s < 1 - clip_ratio_low))
    return loss, {
        "actor/pg_clipfrac": x.token_mean(clipped.to(s.dtype)),
        "actor/ppo_kl": x.token_mean(-d),
        "actor/pg_clipfrac_lower": _zero(loss),
        "actor/gspo_seq_ratio": x.token_mean(s),
    }


def sapo(x: LossInputs, *, tau_pos: float = 1.0, tau_neg: float = 1.05) -> tuple[torch.Tensor, Metrics]:
    """SAPO (https://arxiv.org/abs/2511.20347): a smooth sigmoid gate of the ratio instead of
    the hard clip. Aggregated with seq-mean-token-mean whatever `loss_agg_mode` says (verl)."""
    _require(tau_pos > 0, "tau_pos", "> 0", "sapo", tau_pos)
    _require(tau_neg > 0, "tau_neg", "> 0", "sapo", tau_neg)
    advantages = x.advantages
    d = _log_ratio(x, clamp=True)
    tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
    sig = torch.sigmoid(tau * (torch.exp(d) - 1.0))
    gate = sig * (4.0 / tau)
    loss = x.aggregate(-gate * advantages, mode="seq-mean-token-mean")
    with torch.no_grad():
        grad_gate = 4.0 * sig * (1.0 - sig)  # d gate / d r
    return loss, {"actor/pg_clipfrac": _zero(loss), "actor/ppo_kl": x.token_mean(-d),
                  "actor/pg_clipfrac_lower": _zero(loss), "actor/sapo_gate": x.token_mean(grad_gate)}


def gpg(x: LossInputs) -> tuple[torch.Tensor, Metrics]:
    """GPG: the plain policy gradient -A log_prob (old_log_prob is unused); no metrics."""
    return x.aggregate(-x.log_prob * x.advantages), {}


def _covariance(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] (A - mean A)(log_prob - mean log_prob), means over the part's valid tokens."""
    with torch.no_grad():
        return ((advantages - masked_mean(advantages, response_mask))
                * (log_prob - masked_mean(log_prob, response_mask)))


def clip_cov(x: LossInputs, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
             clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (https://arxiv.org/abs/2505.22617): the clipped surrogate (no dual clip, no
    clamp of d) with the gradient cut off on max(1, floor(clip_cov_ratio n)) tokens drawn at
    random among the valid, not already clipped ones whose covariance lies in (lb, ub)."""
    _check_clip_ratios("clip_cov", clip_ratio_low, clip_ratio_high)
    _check_cov_ratio("clip_cov", "clip_cov_ratio", clip_cov_ratio)
    _require(clip_cov_lb < clip_cov_ub, "policy_loss.clip_cov_lb", f"< clip_cov_ub ({clip_cov_ub})", "clip_cov",
             clip_cov_lb)
    log_prob, advantages, response_mask = x.log_prob, x.advantages, x.response_mask
    d = _log_ratio(x, clamp=False)
    ratio = torch.exp(d)
    surrogate = -advantages * ratio
    clipped_surrogate = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    with torch.no_grad():
        cov = _covariance(advantages, log_prob, response_mask)
        candidates = ((response_mask > 0) & ~(clipped_surrogate > surrogate)
                      & (cov > clip_cov_lb) & (cov < clip_cov_ub)).nonzero()  # [K, 2] (row, column), row-major
        keep = torch.ones_like(log_prob)
        if len(candidates) > 0:
            draws = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
            rng = generator if generator is not None else torch.Generator().manual_seed(0)
            order = torch.randperm(len(candidates), generator=rng)
            chosen = candidates[order[:draws].to(candidates.device)]
            keep[chosen[:, 0], chosen[:, 1]] = 0
    loss = x.aggregate(torch.maximum(surrogate, clipped_surrogate) * keep)
    cut = x.token_mean(1.0 - keep)
    return loss, {"actor/pg_clipfrac": cut, "actor/ppo_kl": x.token_mean(-d), "actor/clip_cov_cut_frac": cut.clone()}


def kl_cov(x: LossInputs, *, kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 0.1) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (https://arxiv.org/abs/2505.22617): the unclipped surrogate -A r' plus a
    ppo_kl_coef |d| penalty on the max(1, floor(kl_cov_ratio n)) valid tokens with the largest
    covariance (torch.topk; no draw)."""
    _check_cov_ratio("kl_cov", "kl_cov_ratio", kl_cov_ratio)
    _require(ppo_kl_coef >= 0, "policy_loss.ppo_kl_coef", ">= 0", "kl_cov", ppo_kl_coef)
    d = _log_ratio(x, clamp=False)
    with torch.no_grad():
        valid = x.response_mask > 0
        penalised = torch.zeros_like(valid)
        if valid.any():
            # the covariance over the valid tokens only (plain means of the gathered values, as verl)
            adv, logp = x.advantages[valid].detach().cpu(), x.log_prob[valid].detach().cpu()
            cov = (adv - adv.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio))).indices
            flat = penalised.view(-1)
            flat[valid.reshape(-1).nonzero().squeeze(-1)[top.to(flat.device)]] = True
    loss = x.aggregate(-x.advantages * torch.exp(d)
                       + torch.where(penalised, ppo_kl_coef * d.abs(), torch.zeros_like(d)))
    return loss, {"actor/ppo_kl": x.token_mean(d.abs()),
                  "actor/kl_cov_penalised_frac": x.token_mean(penalised.to(d.dtype))}


def geo_mean(x: LossInputs, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
             ) -> tuple[torch.Tensor, Metrics]:
    """GMPO (https://arxiv.org/abs/2507.20673): one loss per row, -mean(A) times the geometric
    mean of the token ratios clipped in log space (each token's d clipped to [-lo, hi] on the
    side its advantage's sign pessimises); [B] row losses summed over the non-empty rows and
    divided by global_seqs times dp_size (sequence-level advantages assumed, as verl).
    `loss_agg_mode` is ignored (verl)."""
    _check_clip_ratios("geo_mean", clip_ratio_low, clip_ratio_high)
    advantages, response_mask = x.advantages, x.response_mask
    d = _log_ratio(x, clamp=False)
    d_clipped = torch.clamp(d, -clip_ratio_low, clip_ratio_high)
    sign = torch.sign(advantages)
    d_pessimistic = sign * torch.minimum(sign * d, sign * d_clipped)
    row_tokens = response_mask.sum(-1) + 1e-8  # [B]
    row_ratio = torch.exp(masked_sum(d_pessimistic, response_mask, dim=-1) / row_tokens)
    row_losses = -masked_sum(advantages, response_mask, dim=-1) / row_tokens * row_ratio  # [B]
    if x.rollout_is_weights is not None:  # the rows' geometric-mean IS weight
        row_losses = row_losses * torch.exp(masked_sum(torch.log(x.rollout_is_weights + 1e-10), response_mask,
                                                       dim=-1) / row_tokens)
    non_empty = (response_mask.sum(-1) > 0).to(row_losses.dtype)
    loss = agg_loss(row_losses.unsqueeze(-1), non_empty.unsqueeze(-1), "seq-mean-token-sum",
                    global_seqs=x.global_seqs, dp_size=x.dp_size)
    with torch.no_grad():
        clipped, a = (d != d_clipped).to(d.dtype), advantages.detach()
    return loss, {
        "actor/pg_clipfrac": x.token_mean(clipped * (a > 0)),
        "actor/ppo_kl": x.token_mean(-d),
        "actor/pg_clipfrac_lower": x.token_mean(clipped * (a < 0)),
    }


def dro(x: LossInputs, *, dro_beta: float | None = None) -> tuple[torch.Tensor, Metrics]:
    """Direct Reward Optimization: -(A log_prob - dro_beta/2 d^2), a policy gradient with a
    quadratic log-ratio penalty. dro_beta has no default (required, > 0)."""
    _require(dro_beta is not None and dro_beta > 0, "policy_loss.dro_beta", "> 0", "dro", dro_beta)
    d = _log_ratio(x, clamp=False)
    loss = x.aggregate(-(x.log_prob * x.advantages - 0.5 * dro_beta * d.square()))
    return loss, {"actor/ppo_kl": x.token_mean(-d)}


def cispo(x: LossInputs, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
          ) -> tuple[torch.Tensor, Metrics]:
    """CISPO (https://arxiv.org/abs/2506.13585): -sg(clip(r, 1-lo, 1+hi)) A log_prob, so every
    token keeps a gradient, weighted by its clipped (stopped) IS ratio."""
    _check_clip_ratios("cispo", clip_ratio_low, clip_ratio_high)
    d = _log_ratio(x, clamp=True)
    with torch.no_grad():
        ratio = torch.exp(d)
        weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = x.aggregate(-weight * x.advantages * x.log_prob)
    return loss, {"actor/pg_clipfrac": x.token_mean((ratio != weight).to(ratio.dtype)),
                  "actor/ppo_kl": x.token_mean(-d),
                  "actor/pg_clipfrac_lower": _zero(loss),
                  "actor/cispo_weight": x.token_mean(weight)}


# -- the registry and the dispatcher -------------------------------------------------------------

PolicyLoss = Callable[..., tuple[torch.Tensor, Metrics]]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "vanilla": policy_loss,
    "dppo_tv": dppo_tv,
    "dppo_kl": dppo_kl,
    "gspo": gspo,
    "sapo": sapo,
    "gpg": gpg,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "geo_mean": geo_mean,
    "dro": dro,
    "cispo": cispo,
    # verl's bypass loss (algorithm.rollout_correction.bypass_mode=true selects it): the clipped loss or, with
    # loss_type=reinforce, rollout_correction.reinforce_loss, against the engine's log-probs
    "bypass_mode": bypass_mode_loss,
}

#: the metrics a loss logs beyond verl's (module docstring): each names its loss, so a run shows which one trained
OWN_METRICS: dict[str, tuple[str, ...]] = {
    "gspo": ("actor/gspo_seq_ratio",), "sapo": ("actor/sapo_gate",), "cispo": ("actor/cispo_weight",),
    "kl_cov": ("actor/kl_cov_penalised_frac",), "clip_cov": ("actor/clip_cov_cut_frac",),
}

if tuple(POLICY_LOSSES) != POLICY_LOSS_NAMES:
    raise RuntimeError(f"policy losses registered here {list(POLICY_LOSSES)} differ from those megappo.ppo.specs "
                       f"declares {list(POLICY_LOSS_NAMES)} (POLICY_LOSS_NAMES)")

#: each loss's knobs: its keyword arguments after the LossInputs record, read from its signature once, here
POLICY_LOSS_KNOBS: dict[str, tuple[str, ...]] = {
    name: tuple(inspect.signature(fn).parameters)[1:] for name, fn in POLICY_LOSSES.items()}
_ALL_KNOBS = frozenset(k for knobs in POLICY_LOSS_KNOBS.values() for k in knobs)


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss '{name}' (actor.policy_loss.loss_mode); "
                         f"choose from {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def compute_policy_loss(name: str, inputs: LossInputs, **knobs) -> tuple[torch.Tensor, Metrics]:
    """The loss `name` of `inputs`, given the knobs it takes (POLICY_LOSS_KNOBS). Knobs only another
    loss takes are ignored, so the trainer can pass every knob; a name no loss takes raises (a typo)."""
    fn = get_policy_loss(name)
    unknown = sorted(set(knobs) - _ALL_KNOBS)
    if unknown:
        raise ValueError(f"compute_policy_loss got unknown inputs {unknown}; knobs are {sorted(_ALL_KNOBS)} "
                         "(the tensors and aggregation settings go in the LossInputs record)")
    return fn(inputs, **{k: v for k, v in knobs.items() if k in POLICY_LOSS_KNOBS[name]})


__all__: Sequence[str] = (
    "OWN_METRICS", "POLICY_LOSSES", "POLICY_LOSS_KNOBS", "cispo", "clip_cov", "compute_policy_loss", "dppo_kl",
    "dppo_tv", "dro", "geo_mean", "get_policy_loss", "gpg", "gspo", "kl_cov", "sapo",
)
