"""Log-probs and entropy from vocabulary-sharded logits, without gathering the vocabulary.

Owns: `vocab_parallel_log_probs`, `vocab_parallel_entropy`, `vocab_parallel_sum_pi_squared` and
`vocab_parallel_log_probs_and_entropy` (one autograd function with a hand-written backward, whose
two halves, `forward_stats` and `logits_grad`, megappo.parallel.chunked_head runs per token chunk).
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

Blocks: both passes walk the logits in blocks of about `block_elements` elements (whole
sequences, or runs of tokens of one sequence), with the all-reduces per block. Only the
[B, T] statistics (max, sum of exp, sum of p * s) are saved; the backward recomputes each
block's softmax from the logits with the same operations, so nothing of the logits' size is
kept besides the logits themselves (a one-pass version keeps p and the centred logits: twice
the logits in float32, four times bf16 logits), and the temporaries are one block's. Every
reduction runs along the vocabulary of one token, so the block size does not change the
results (on CPU not a bit: tests/unit/test_vocab_parallel_blocks.py); there, blocks that stay
in cache (BLOCK_ELEMENTS) made the forward and backward pass about 2x faster at
[8, 512, 8192] (benchmarks/ppo_math.py).

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


# Elements of [.., V/tp] per block (see the module docstring): on CPU a block stays in cache
# (2^20 float32 = 4 MB; 2x faster than one pass over the whole tensor at [8, 512, 8192]);
# on GPUs a block only bounds the temporaries (2^26 float32 = 256 MB), kernel launches stay few.
BLOCK_ELEMENTS = {"cpu": 1 << 20}
BLOCK_ELEMENTS_DEFAULT = 1 << 26


def _blocks(batch: int, tokens: int, shard: int, budget: int):
    """(batch slice, token slice) pairs covering [B, T] in blocks of about `budget` elements of
    [.., V/tp]: whole sequences when one fits, else runs of tokens of one sequence."""
    rows = max(1, budget // max(shard, 1))
    if rows >= tokens:
        per = rows // tokens
        for b in range(0, batch, per):
            yield slice(b, min(batch, b + per)), slice(None)
        return
    for b in range(batch):
        for t in range(0, tokens, rows):
            yield slice(b, b + 1), slice(t, min(tokens, t + rows))


class _VocabParallelStats(torch.autograd.Function):
    """(logits [B, T, V/tp], labels [B, T] or None, group, with_entropy, block elements) ->
    (log-probs [B, T] or empty, entropy [B, T] or empty)."""

    @staticmethod
    def forward(ctx, logits, labels, group, with_entropy: bool, budget: int):
        log_probs, entropy, stats, has_neg_inf = forward_stats(logits, labels, group, with_entropy, budget)
        # the backward recomputes each block's softmax from the logits and these [B, T] stats:
        # nothing of size [B, T, V/tp] is kept besides the logits themselves
        ctx.save_for_backward(logits, labels, stats)
        # an output the loss does not use (e.g. the entropy, logged only) gets None, not a
        # tensor of zeros: its backward pass over the logits is skipped (subtracting zeros
        # would not change a bit)
        ctx.set_materialize_grads(False)
        ctx.group, ctx.with_entropy, ctx.budget, ctx.has_neg_inf = group, with_entropy, budget, has_neg_inf
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels, stats = ctx.saved_tensors
        grad = logits_grad(logits, labels, stats, ctx.has_neg_inf, ctx.group, ctx.with_entropy, ctx.budget,
                           grad_log_probs, grad_entropy)
        return grad, None, None, None, None


def forward_stats(logits: torch.Tensor, labels: torch.Tensor | None, group, with_entropy: bool, budget: int):
    """The forward of the statistics, block by block, outside autograd: ([B, T] log-probs or empty,
    [B, T] entropy or empty, [3, B, T] (max, sum of exp, sum p * s) for `logits_grad`, per-block
    -inf flags for `logits_grad`). Shared with megappo.parallel.chunked_head."""
    B, T, shard = logits.shape
    rank = dist.get_rank(group) if _world(group) > 1 else 0
    stats = logits.new_empty((3, B, T), dtype=_compute_dtype(logits))  # max, sum of exp, sum p * s
    m, z, mean_s = stats
    log_probs = stats.new_empty((B, T)) if labels is not None else stats.new_empty(0)
    entropy = stats.new_empty((B, T)) if with_entropy else stats.new_empty(0)
    has_neg_inf = []  # per block, for the entropy: checked once here, reused by the backward
    for bs, ts in _blocks(B, T, shard, budget):
        x = _block(logits, bs, ts)
        m[bs, ts] = _all_reduce(x.amax(dim=-1), dist.ReduceOp.MAX, group)
        s = x - m[bs, ts].unsqueeze(-1)
        p = s.exp()
        z[bs, ts] = _all_reduce(p.sum(-1), dist.ReduceOp.SUM, group)
        p.div_(z[bs, ts].unsqueeze(-1))  # softmax over the full vocabulary, this rank's slice
        log_z = z[bs, ts].log()
        if labels is not None:
            local, owned = _local_labels(labels[bs, ts], rank, shard)
            picked = s.gather(-1, local.unsqueeze(-1)).squeeze(-1)
            label_s = _all_reduce(torch.where(owned, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
            log_probs[bs, ts] = label_s - log_z
        if with_entropy:
            has_neg_inf.append(bool((x.amin(dim=-1) == float("-inf")).any()))
            mean_s[bs, ts] = _all_reduce((p * _finite(s, p, has_neg_inf[-1])).sum(-1), dist.ReduceOp.SUM, group)
            entropy[bs, ts] = log_z - mean_s[bs, ts]
    return log_probs, entropy, stats, has_neg_inf


def logits_grad(logits: torch.Tensor, labels: torch.Tensor | None, stats: torch.Tensor, has_neg_inf: list[bool],
                group, with_entropy: bool, budget: int, grad_log_probs: torch.Tensor | None,
                grad_entropy: torch.Tensor | None) -> torch.Tensor:
    """[B, T, V/tp] gradient (in the logits' dtype) of the forward's outputs given theirs (None: not
    used by the loss), recomputing each block's softmax from `forward_stats`'s results; no communication."""
    m, z, mean_s = stats
    B, T, shard = logits.shape
    rank = dist.get_rank(group) if _world(group) > 1 else 0
    use_lp = labels is not None and grad_log_probs is not None
    use_ent = with_entropy and grad_entropy is not None
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    for i, (bs, ts) in enumerate(_blocks(B, T, shard, budget)):
        x = _block(logits, bs, ts)
        s = x - m[bs, ts].unsqueeze(-1)
        p = s.exp()
        p.div_(z[bs, ts].unsqueeze(-1))  # the forward's softmax, bit for bit
        g_x = torch.zeros_like(p)
        if use_lp:
            g = grad_log_probs[bs, ts].to(p.dtype)
            g_x -= p * g.unsqueeze(-1)
            local, owned = _local_labels(labels[bs, ts], rank, shard)
            g_x.scatter_add_(-1, local.unsqueeze(-1), (g * owned.to(p.dtype)).unsqueeze(-1))
        if use_ent:
            s_centred = _finite(s, p, has_neg_inf[i]).sub_(mean_s[bs, ts].unsqueeze(-1))
            g_x -= p * s_centred * grad_entropy[bs, ts].to(p.dtype).unsqueeze(-1)
        grad[bs, ts] = g_x  # in the logits' dtype
    return grad


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32


def _block(logits: torch.Tensor, bs: slice, ts: slice) -> torch.Tensor:
    """A block of the logits in the compute dtype, detached (the autograd function owns the graph)."""
    return logits.detach()[bs, ts].to(_compute_dtype(logits))


def _local_labels(labels: torch.Tensor, rank: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids -> (ids within this rank's slice, 0 where not owned; owned mask)."""
    local = labels - rank * shard
    owned = (local >= 0) & (local < shard)
    return torch.where(owned, local, torch.zeros_like(local)), owned


def _finite(s: torch.Tensor, p: torch.Tensor, has_neg_inf: bool) -> torch.Tensor:
    """s with 0 where p = 0, if the block has -inf logits (so p * s is 0, not NaN); else s
    itself: where p = 0 and s is finite, p * s is +-0 either way, the sums do not change."""
    return torch.where(p > 0, s, 0.0) if has_neg_inf else s


def _budget(logits: torch.Tensor, block_elements: int | None) -> int:
    if block_elements is not None:
        if block_elements < 1:
            raise ValueError(f"block_elements must be >= 1, got {block_elements}")
        return block_elements
    return BLOCK_ELEMENTS.get(logits.device.type, BLOCK_ELEMENTS_DEFAULT)


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, tp_group=None, *,
                             block_elements: int | None = None) -> torch.Tensor:
    """[B, T, V/tp] shard, [B, T] global label ids -> [B, T] log-probs of the labels."""
    return _VocabParallelStats.apply(logits, labels, tp_group, False, _budget(logits, block_elements))[0]


def vocab_parallel_entropy(logits: torch.Tensor, tp_group=None, *, block_elements: int | None = None) -> torch.Tensor:
    """[B, T, V/tp] shard -> [B, T] entropy of the softmax over the full vocabulary."""
    return _VocabParallelStats.apply(logits, None, tp_group, True, _budget(logits, block_elements))[1]


def vocab_parallel_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group=None, *,
                                         block_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both at once, sharing the max / sum-of-exp reductions: ([B, T] log-probs, [B, T] entropy)."""
    return _VocabParallelStats.apply(logits, labels, tp_group, True, _budget(logits, block_elements))


@torch.no_grad()
def vocab_parallel_sum_pi_squared(logits: torch.Tensor, tp_group=None, *,
                                  block_elements: int | None = None) -> torch.Tensor:
    """[B, T, V/tp] shard -> [B, T] sum over the full vocabulary of p_j^2, p = softmax(logits)
    (verl's `sum_pi_squared`, which the optimal-token-baseline estimators read). Forward only.
    With s = logits - global max: sum_j p_j^2 = sum_j exp(2 s_j) / Z^2, three all-reduces per block.
    The reference is `(torch.softmax(full_logits, -1) ** 2).sum(-1)`."""
    B, T, shard = logits.shape
    out = logits.new_empty((B, T), dtype=_compute_dtype(logits))
    for bs, ts in _blocks(B, T, shard, _budget(logits, block_elements)):
        x = _block(logits, bs, ts)
        m = _all_reduce(x.amax(dim=-1), dist.ReduceOp.MAX, tp_group)
        e = (x - m.unsqueeze(-1)).exp()
        z = _all_reduce(e.sum(-1), dist.ReduceOp.SUM, tp_group)
        out[bs, ts] = _all_reduce(e.square().sum(-1), dist.ReduceOp.SUM, tp_group) / z.square()
    return out
