"""PPO losses and their aggregation, with verl 0.9.1 semantics, as pure tensor functions.

Owns: loss aggregation (`agg_loss`, `global_counts`), `LossInputs` (the record every policy
loss takes: a part's [B, T] tensors and how its losses are aggregated), the clipped policy
loss (fast form and verl's literal form as its reference), the clipped value loss,
full-vocabulary log-probs / entropy from logits, the entropy loss and the KL loss term.
Does not know about configs, process groups or models; cross-rank totals come in as
arguments (`global_tokens`, `global_seqs`, `dp_size`).

Shape legend: [B, T] = (sequences in this part, response tokens); [B, T, V] = logits over
the full vocabulary (the vocabulary-sharded version is megappo.parallel.vocab_parallel).

Aggregation (`loss_agg_mode`, verl's actor.loss_agg_mode / critic.loss_agg_mode), with l
the [B, T] loss matrix, m the mask, "non-empty" = rows with at least one valid token:

| mode | loss of a part |
|---|---|
| token-mean | sum(l * m) / N_tok * dp_size |
| token-sum | sum(l * m) * dp_size |
| seq-mean-token-sum | sum over non-empty rows of sum_t(l * m) / N_seq * dp_size |
| seq-mean-token-sum-norm | the same, divided by loss_scale_factor (default: T of this part; Dr. GRPO) |
| seq-mean-token-mean | sum over non-empty rows of sum_t(l * m) / (n_row + 1e-8) / N_seq * dp_size |

N_tok = `global_tokens`, N_seq = `global_seqs`; when None they are this part's own counts
(valid tokens; non-empty rows), which is the whole-batch loss when the part is the batch.

Split invariance (the contract with the training loop). Split a mini-batch into D data
parallel ranks and each rank's share into micro-batches; give every part the counts of
the WHOLE mini-batch, `**global_counts(mask_of_the_mini_batch)`. Then, for every mode,
  (a) dp_size=1:  sum over all parts of agg_loss(part)              == agg_loss(mini-batch)
  (b) dp_size=D:  (1/D) * sum over all parts of agg_loss(part)      == agg_loss(mini-batch)
and the same holds for gradients, since each part's loss is linear in its loss matrix.
Use (a) when gradients are SUMMED over DP and over micro-batches (megappo's Megatron setup:
`calculate_per_token_loss=True`), (b) when the DP reducer AVERAGES gradients (torch DDP,
FSDP, Megatron DDP's default; what verl's `dp_size` is for). With seq-mean-token-sum-norm,
give a fixed `loss_scale_factor` when parts are padded to different T. Metrics (clip
fractions, ppo_kl) are token means over N_tok, so summing them over all parts (every rank,
every micro-batch) gives the whole mini-batch's token mean; dp_size does not scale them.
"""

from __future__ import annotations

import dataclasses

import torch

from megappo.ppo.kl import kl_penalty
from megappo.ppo.stats import masked_mean, masked_sum

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def global_counts(mask: torch.Tensor) -> dict[str, int]:
    """{"global_tokens", "global_seqs"} of a whole mini-batch's [B, T] response mask, to be
    passed to agg_loss / LossInputs / value_loss of each of its parts. Sequences are the
    non-empty rows, as agg_loss counts them by default."""
    return {"global_tokens": int(mask.sum()), "global_seqs": int((mask.sum(-1) > 0).sum())}


def _divide(numerator: torch.Tensor, count) -> torch.Tensor:
    """numerator / count, with 0 (not NaN) when the count is 0 (then the numerator is 0 too)."""
    if isinstance(count, torch.Tensor):
        return numerator / torch.where(count > 0, count, torch.ones_like(count))
    return numerator / (count if count > 0 else 1)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, *,
             global_tokens: int | None = None, global_seqs: int | None = None, dp_size: int = 1,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Scalar loss of a [B, T] loss matrix over `loss_mask` (see the module docstring)."""
    if dp_size > 1 and (global_tokens is None if loss_agg_mode == "token-mean" else
                        global_seqs is None and loss_agg_mode.startswith("seq-")):
        raise ValueError(f"agg_loss with dp_size={dp_size} needs the global counts of the mini-batch; "
                         "pass **global_counts(mini_batch_mask)")
    if loss_agg_mode == "token-mean":
        tokens = loss_mask.sum() if global_tokens is None else global_tokens
        return _divide(masked_sum(loss_mat, loss_mask), tokens) * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        row_tokens = loss_mask.sum(-1)
        row_loss = masked_sum(loss_mat, loss_mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            row_loss = row_loss / (row_tokens + 1e-8)
        non_empty = (row_tokens > 0).to(row_loss.dtype)
        seqs = non_empty.sum() if global_seqs is None else global_seqs
        loss = _divide(masked_sum(row_loss, non_empty), seqs) * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}' (actor.loss_agg_mode / critic.loss_agg_mode); "
                     f"choose from {list(AGG_MODES)}")


def _token_mean(values: torch.Tensor, mask: torch.Tensor, global_tokens: int | None) -> torch.Tensor:
    """Metric mean: verl's local masked_mean, or a part of the global token mean."""
    with torch.no_grad():
        return masked_mean(values, mask) if global_tokens is None else _divide(masked_sum(values, mask),
                                                                                global_tokens)


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What every policy loss reads: a part's four [B, T] tensors and how its per-token losses are
    aggregated (agg_loss's mode and the whole mini-batch's counts; None = this part's own)."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    loss_agg_mode: str = "token-mean"
    rollout_is_weights: torch.Tensor | None = None  # [B, T], detached by the caller; multiply the per-token loss
    global_tokens: int | None = None
    global_seqs: int | None = None
    dp_size: int = 1
    loss_scale_factor: float | None = None

    def __post_init__(self):
        missing = [k for k in ("old_log_prob", "log_prob", "advantages", "response_mask") if getattr(self, k) is None]
        if missing:
            raise ValueError(f"a policy loss needs the tensors {missing}")

    def aggregate(self, losses: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """agg_loss of the [B, T] per-token losses times the rollout IS weights (when given), over
        response_mask with this part's counts; `mode` overrides loss_agg_mode (sapo's fixed mode)."""
        if self.rollout_is_weights is not None:
            losses = losses * self.rollout_is_weights
        return agg_loss(losses, self.response_mask, self.loss_agg_mode if mode is None else mode,
                        global_tokens=self.global_tokens, global_seqs=self.global_seqs, dp_size=self.dp_size,
                        loss_scale_factor=self.loss_scale_factor)

    def token_mean(self, values: torch.Tensor) -> torch.Tensor:
        """A metric: the token mean of [B, T] `values` over response_mask (a part of the global one)."""
        return _token_mean(values, self.response_mask, self.global_tokens)


def _check_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO (actor.clip_ratio_c), got {clip_ratio_c}")
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0 (actor.clip_ratio_low / clip_ratio_high), "
                         f"got {clip_ratio_low}, {clip_ratio_high}")


def policy_loss(x: LossInputs, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                clip_ratio_c: float = 3.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with asymmetric clip and dual-clip; all inputs [B, T].

    ratio r = exp(clamp(log_prob - old_log_prob, -20, 20)). Per token, as in verl,
      l = max(-A r, -A clip(r, 1 - low, 1 + high)), and where A < 0, l = min(l, -A c),
    which is computed here in the equivalent closed form (fewer temporaries):
      A >= 0: l = -A min(r, 1 + high);   A < 0: l = -A min(max(r, 1 - low), c).
    Rollout importance weights [B, T] (detached by the caller) multiply l. Returns
    (aggregated loss, {"actor/pg_clipfrac": tokens where the clip bound was taken,
    "actor/ppo_kl": mean of old_log_prob - log_prob (clamped), "actor/pg_clipfrac_lower":
    tokens where the dual-clip bound was taken}). `policy_loss_reference` is verl's form.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    log_ratio = torch.clamp(x.log_prob - x.old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    positive = x.advantages >= 0
    bounded = torch.where(positive, torch.clamp(ratio, max=1 + clip_ratio_high),
                          torch.clamp(ratio, min=1 - clip_ratio_low, max=clip_ratio_c))
    loss = x.aggregate(-x.advantages * bounded)
    with torch.no_grad():
        r, a = ratio.detach(), x.advantages.detach()
        clipped = ((a > 0) & (r > 1 + clip_ratio_high)) | ((a < 0) & (r < 1 - clip_ratio_low))
        metrics = {
            "actor/pg_clipfrac": x.token_mean(clipped.to(r.dtype)),
            "actor/ppo_kl": x.token_mean(-log_ratio.detach()),
            "actor/pg_clipfrac_lower": x.token_mean(((a < 0) & (r > clip_ratio_c)).to(r.dtype)),
        }
    return loss, metrics


def policy_loss_reference(x: LossInputs, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                          clip_ratio_c: float = 3.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl 0.9.1's `compute_policy_loss_vanilla`, step by step; the reference for `policy_loss`."""
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    old_log_prob, log_prob, advantages, response_mask = x.old_log_prob, x.log_prob, x.advantages, x.response_mask
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    loss = x.aggregate(pg_losses)  # times rollout_is_weights, then agg_loss
    metrics = {
        "actor/pg_clipfrac": x.token_mean(torch.gt(pg_losses2, pg_losses1).float()),
        "actor/ppo_kl": x.token_mean(-log_ratio),
        "actor/pg_clipfrac_lower": x.token_mean(torch.gt(clip_pg_losses1, pg_losses3).float()
                                                * (advantages < 0).float()),
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
               cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean", global_tokens: int | None = None,
               global_seqs: int | None = None, dp_size: int = 1, loss_scale_factor: float | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss, all inputs [B, T] (vpreds: new, values: old, returns: targets):
    0.5 * agg(max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2)).
    Returns (loss, critic/vf_clipfrac: tokens where the clipped error was larger)."""
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    losses1 = (vpreds - returns) ** 2
    losses2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(losses1, losses2), response_mask, loss_agg_mode,
                          global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size,
                          loss_scale_factor=loss_scale_factor)
    return loss, _token_mean(torch.gt(losses2, losses1).float(), response_mask, global_tokens)


def _compute_dtype(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[..., V] logits, [...] label ids -> [...] log-softmax at the labels (full vocabulary).
    Half-precision logits are upcast to float32; -inf logits (vocabulary padding) are fine."""
    return torch.log_softmax(_compute_dtype(logits), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] entropy logsumexp(z) - sum(softmax(z) * z) of the full vocabulary,
    with z = logits - max (verl uses the raw logits: same value, more rounding for large
    logits). Entries with probability 0 (e.g. -inf padding logits) contribute 0, in value
    and gradient."""
    z = _compute_dtype(logits)
    z = z - z.detach().amax(dim=-1, keepdim=True)  # H is shift-invariant; shifting avoids cancellation
    p = torch.softmax(z, dim=-1)
    z_finite = torch.where(p > 0, z, torch.zeros_like(z))
    return torch.logsumexp(z, dim=-1) - (p * z_finite).sum(-1)


def entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                 **counts) -> torch.Tensor:
    """agg of the [B, T] entropy of [B, T, V] logits (verl's compute_entropy_loss). The actor
    subtracts actor.entropy_coeff times this; `counts` are agg_loss's keyword arguments."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, **counts)


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor, *,
            kl_loss_type: str = "low_var_kl", loss_agg_mode: str = "token-mean", **counts) -> torch.Tensor:
    """agg of the per-token KL estimate (actor.kl_loss_type) between the policy and the
    reference, all [B, T]; the actor adds actor.kl_loss_coef times this."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode, **counts)
