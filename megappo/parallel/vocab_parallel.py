"""Log-probs and entropy from vocabulary-sharded logits, without gathering the vocabulary.

Owns: `vocab_parallel_log_probs`, `vocab_parallel_entropy` and
`vocab_parallel_log_probs_and_entropy` (one autograd function with a hand-written backward).
Does not know about PPO, models or Megatron: the TP group comes in as an argument.

Shape legend: [B, T] = (sequences, tokens); [B, T, V/tp] = this rank's slice of the logits.
Rank r of `tp_group` (its rank within the group) holds vocabulary ids [r * V/tp, (r + 1) * V/tp);
`labels` [B, T] are global vocabulary ids. `tp_group=None` (or a group of one) means the
shard is the whole vocabulary. Every rank gets the full [B, T] results.

Only [B, T] statistics cross ranks (max, sum of exp, label logit, expected logit: at most
four all-reduces), so memory and traffic do not grow with V. With s = logits - global max,
p = softmax(s):
  log p(label) = s_label - log Z,   Z = sum_j exp(s_j)     d/ds_j = 1[j = label] - p_j
  H            = log Z - sum_j p_j s_j                       dH/ds_j = -p_j (s_j - sum_k p_k s_k)
The backward needs no communication: every TP rank computes the same downstream loss from
the replicated [B, T] outputs and owns the gradient of its own shard. Logits of -inf
(vocabulary padding) are allowed and get gradient 0. Computation is in float32 (float64
stays float64); the gradient comes back in the logits' dtype.

The full-vocabulary references are `megappo.ppo.losses.log_probs_from_logits` and
`entropy_from_logits`; tests/distributed/test_vocab_parallel.py checks values and gradients
against them at TP=2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if _world(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelStats(torch.autograd.Function):
    """(logits [B, T, V/tp], labels [B, T] or None, group) -> (log-probs [B, T] or empty,
    entropy [B, T] or empty)."""

    @staticmethod
    def forward(ctx, logits, labels, group, with_entropy: bool):
        x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        shard = x.shape[-1]
        m = _all_reduce(x.detach().amax(dim=-1), dist.ReduceOp.MAX, group)
        s = x.detach() - m.unsqueeze(-1)
        p = s.exp()
        z = _all_reduce(p.sum(-1), dist.ReduceOp.SUM, group)
        p.div_(z.unsqueeze(-1))  # softmax over the full vocabulary, this rank's slice
        log_z = z.log()
        empty = x.new_empty(0)

        log_probs, local, owned = empty, empty, empty
        if labels is not None:
            rank = dist.get_rank(group) if _world(group) > 1 else 0
            local = labels - rank * shard
            owned = (local >= 0) & (local < shard)
            local = torch.where(owned, local, torch.zeros_like(local))
            picked = s.gather(-1, local.unsqueeze(-1)).squeeze(-1)
            label_s = _all_reduce(torch.where(owned, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
            log_probs = label_s - log_z

        entropy, s_centred = empty, empty
        if with_entropy:
            s_finite = s  # where p = 0 and s is finite, p * s is +-0 either way: the sums do not change
            if bool((x.detach().amin(dim=-1) == float("-inf")).any()):
                s_finite = torch.where(p > 0, s, 0.0)  # p * s is 0, not NaN, at -inf logits
            mean_s = _all_reduce((p * s_finite).sum(-1), dist.ReduceOp.SUM, group)
            entropy = log_z - mean_s
            s_centred = s_finite.sub_(mean_s.unsqueeze(-1))

        ctx.save_for_backward(p, local, owned, s_centred)
        # an output the loss does not use (e.g. the entropy, logged only) gets None, not a
        # tensor of zeros: its backward pass over the logits is skipped (subtracting zeros
        # would not change a bit)
        ctx.set_materialize_grads(False)
        ctx.has_labels, ctx.with_entropy, ctx.dtype = labels is not None, with_entropy, logits.dtype
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        p, local, owned, s_centred = ctx.saved_tensors
        grad = torch.zeros_like(p)
        if ctx.has_labels and grad_log_probs is not None:
            g = grad_log_probs.to(p.dtype)
            grad -= p * g.unsqueeze(-1)
            grad.scatter_add_(-1, local.unsqueeze(-1), (g * owned.to(p.dtype)).unsqueeze(-1))
        if ctx.with_entropy and grad_entropy is not None:
            grad -= p * s_centred * grad_entropy.to(p.dtype).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
    """[B, T, V/tp] shard, [B, T] global label ids -> [B, T] log-probs of the labels."""
    return _VocabParallelStats.apply(logits, labels, tp_group, False)[0]


def vocab_parallel_entropy(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """[B, T, V/tp] shard -> [B, T] entropy of the softmax over the full vocabulary."""
    return _VocabParallelStats.apply(logits, None, tp_group, True)[1]


def vocab_parallel_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                         tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both at once, sharing the max / sum-of-exp reductions: ([B, T] log-probs, [B, T] entropy)."""
    return _VocabParallelStats.apply(logits, labels, tp_group, True)
