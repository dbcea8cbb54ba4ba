"""Log-probs and entropy from vocabulary-sharded logits, without gathering the vocabulary.

Logits [B, T, V/tp] live on the TP ranks of `tp_group`, rank r holding vocabulary ids
[r * V/tp, (r + 1) * V/tp). Only [B, T] statistics cross ranks (max, sum of exp, label
logit, expected logit), so memory and traffic do not grow with V. Both functions are
autograd functions: the backward needs no communication, because every TP rank computes
the same downstream loss and owns the gradient of its own shard.
  log p(label) = s_label - log sum_j exp(s_j),            s = logits - max
  d/ds_j       = 1[j = label] - p_j
  H            = log sum_j exp(s_j) - sum_j p_j s_j
  dH/ds_j      = -p_j (s_j - sum_k p_k s_k)
Logits of -inf (masked vocabulary padding) are allowed.

The full-vocabulary references are `megappo.ppo.losses.log_probs_from_logits` and
`entropy_from_logits`; tests check both agree at TP=2. This module knows nothing of PPO.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _shifted_softmax(logits: torch.Tensor, group):
    """(s = logits - global max, exp(s), global sum of exp(s)) for a [..., V/tp] shard."""
    logits = logits.float()
    m = _all_reduce(logits.max(dim=-1).values.detach().clone(), dist.ReduceOp.MAX, group)
    s = logits - m.unsqueeze(-1)
    e = s.exp()
    z = _all_reduce(e.sum(-1), dist.ReduceOp.SUM, group)
    return s, e, z


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group):
        s, e, z = _shifted_softmax(logits, group)
        v_local = logits.shape[-1]
        rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
        local = labels - rank * v_local
        owned = (local >= 0) & (local < v_local)
        picked = s.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
        label_logit = _all_reduce(torch.where(owned, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(e, z, local, owned)
        ctx.input_dtype = logits.dtype
        return label_logit - z.log()

    @staticmethod
    def backward(ctx, grad_out):
        e, z, local, owned = ctx.saved_tensors
        grad = -(e / z.unsqueeze(-1))
        onehot = torch.zeros_like(grad)
        onehot.scatter_(-1, local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), owned.unsqueeze(-1).to(grad.dtype))
        grad = (grad + onehot) * grad_out.unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group):
        s, e, z = _shifted_softmax(logits, group)
        p = e / z.unsqueeze(-1)
        ps = torch.where(p > 0, p * s, torch.zeros_like(p))  # 0 * -inf is 0 here
        mean_s = _all_reduce(ps.sum(-1), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(p, s, mean_s)
        ctx.input_dtype = logits.dtype
        return z.log() - mean_s

    @staticmethod
    def backward(ctx, grad_out):
        p, s, mean_s = ctx.saved_tensors
        centred = torch.where(p > 0, s - mean_s.unsqueeze(-1), torch.zeros_like(s))
        grad = -p * centred * grad_out.unsqueeze(-1)
        return grad.to(ctx.input_dtype), None


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
    """[B, T, V/tp] shard, [B, T] global label ids -> [B, T] log-probs (float32)."""
    return _VocabParallelLogProb.apply(logits, labels, tp_group)


def vocab_parallel_entropy(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """[B, T, V/tp] shard -> [B, T] entropy of the full softmax (float32)."""
    return _VocabParallelEntropy.apply(logits, tp_group)
