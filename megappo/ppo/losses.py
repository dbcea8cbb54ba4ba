"""PPO losses and their aggregation (verl 0.9.1 semantics), pure tensor functions.

Loss aggregation with global counts. A mini-batch is split into micro-batches and DP
replicas; each part computes its loss with the counts of the WHOLE mini-batch
(`global_counts(mask_of_the_mini_batch)`), so the parts' losses add up to the whole
mini-batch's loss and their gradients add up to its gradient (megappo's Megatron DDP sums
gradients over DP). `dp_size` multiplies the loss for a DP wrapper that averages gradients
instead (FSDP/torch DDP, as verl uses); megappo passes 1.

| mode | loss over the mini-batch |
|---|---|
| token-mean | sum(l * m) / global_tokens |
| token-sum | sum(l * m) |
| seq-mean-token-sum | sum_seq(sum_t l * m) / global_seqs |
| seq-mean-token-mean | sum_seq(sum_t l * m / len_seq) / global_seqs |
| seq-mean-token-sum-norm | sum(l * m) / (global_seqs * horizon), horizon = T unless given (Dr. GRPO) |

Metric values (clip fractions, ppo_kl) are token means with the same global normalisation,
so they also add up over parts.

Shape legend: [B, T] = (sequences in this part, response tokens).
This module does not know about configs or process groups.
"""

from __future__ import annotations

import torch

from megappo.ppo.stats import masked_sum

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def global_counts(mask: torch.Tensor) -> dict[str, int]:
    """Counts of a whole mini-batch's [B, T] response mask, for every part's agg_loss."""
    return {"global_tokens": int(mask.sum()), "global_seqs": int(mask.shape[0])}


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, *,
             global_tokens: int | None = None, global_seqs: int | None = None, dp_size: int = 1,
             horizon: int | None = None) -> torch.Tensor:
    """Aggregate a [B, T] loss matrix; counts default to this part's own (whole batch)."""
    mask = loss_mask.to(loss_mat.dtype)
    tokens = global_tokens if global_tokens is not None else int(loss_mask.sum())
    seqs = global_seqs if global_seqs is not None else loss_mask.shape[0]
    if loss_agg_mode == "token-mean":
        loss = masked_sum(loss_mat, mask) / max(tokens, 1)
    elif loss_agg_mode == "token-sum":
        loss = masked_sum(loss_mat, mask)
    elif loss_agg_mode == "seq-mean-token-sum":
        loss = masked_sum(loss_mat, mask, dim=-1).sum() / max(seqs, 1)
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked_sum(loss_mat, mask, dim=-1) / mask.sum(-1).clamp(min=1)
        loss = per_seq.sum() / max(seqs, 1)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        loss = masked_sum(loss_mat, mask) / (max(seqs, 1) * (horizon or loss_mask.shape[-1]))
    else:
        raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; choose from {list(AGG_MODES)}")
    return loss * dp_size


def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                rollout_is_weights: torch.Tensor | None = None, global_tokens: int | None = None,
                global_seqs: int | None = None, dp_size: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with asymmetric clipping and dual-clip for negative advantages.

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)); per token
      l = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high)), and for A < 0 additionally
      l = min(l, -A * clip_ratio_c). Optional rollout importance weights multiply l.
    Returns (loss, {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip, got {clip_ratio_c}")
    neg_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_approx_kl)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(losses1, losses2)
    losses3 = -advantages * clip_ratio_c
    dual = torch.minimum(losses3, clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    counts = dict(global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size)
    loss = agg_loss(losses, response_mask, loss_agg_mode, **counts)
    token_mean = dict(global_tokens=global_tokens, global_seqs=global_seqs)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": agg_loss(torch.gt(losses2, losses1).float(), response_mask, "token-mean", **token_mean),
            "actor/ppo_kl": agg_loss(-neg_approx_kl, response_mask, "token-mean", **token_mean),
            "actor/pg_clipfrac_lower": agg_loss((torch.gt(clipped, losses3) & (advantages < 0)).float(),
                                                response_mask, "token-mean", **token_mean),
        }
    return loss, metrics


def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
               cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean", global_tokens: int | None = None,
               global_seqs: int | None = None, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * agg(max((v - R)^2, (clip(v, V_old +- c) - R)^2)); returns (loss, vf_clipfrac)."""
    clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    losses1 = (vpreds - returns).square()
    losses2 = (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(losses1, losses2), response_mask, loss_agg_mode,
                          global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size)
    with torch.no_grad():
        # verl counts gt(losses2, losses1); where the prediction is inside the clip range the
        # two losses differ only by float rounding, so megappo also requires it to be outside
        # (the same fraction without rounding noise, and the same at every parallel layout)
        clipped_here = torch.gt(losses2, losses1) & ((vpreds - values).abs() > cliprange_value)
        clipfrac = agg_loss(clipped_here.float(), response_mask, "token-mean",
                            global_tokens=global_tokens, global_seqs=global_seqs)
    return loss, clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] entropy of softmax(logits) (full vocabulary)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[..., V], [...] -> [...] log-softmax at the labels (full vocabulary)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
