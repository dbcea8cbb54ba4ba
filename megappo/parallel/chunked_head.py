"""The LM head fused with the log-prob / entropy statistics, over token chunks.

Owns: `chunked_head_log_probs_and_entropy` (one autograd function with a hand-written backward)
and `chunked_head_sum_pi_squared` (forward only). Does not know about Megatron, PPO or models: the
hidden states come in as the output layer's input after its tensor-parallel mapping
(megappo.models.lm_head applies Megatron's), the weight shard and the TP group as arguments.

Shape legend: N tokens, H hidden size, V/tp this rank's vocabulary shard (rank r of `tp_group`
holds ids [r * V/tp, (r + 1) * V/tp)), c tokens per chunk.

Today's path (the reference, kept): the output layer builds the [N, V/tp] logits, `PolicyWorker`
scales them by 1/temperature and masks the vocabulary padding, and
megappo.parallel.vocab_parallel walks them in blocks for float32 softmax statistics. Here the
logits exist one chunk at a time: for each chunk of c tokens,
  logits_c = h_c @ W^T                      [c, V/tp] in the weights' dtype (the output layer's matmul)
  x_c      = logits_c (.float() / T if T != 1), padding rows -inf   (`PolicyWorker._scaled`'s steps)
  stats    = vocab_parallel.forward_stats(x_c)                       (the same blocks, all-reduces)
and only the [N] outputs and [3, N] statistics are kept. The backward walks the chunks again:
it recomputes logits_c from h and W, takes vocab_parallel.logits_grad (the same formulas) for
dL/dx_c, carries it back through the temperature and the mask to dL/dlogits_c in the weights'
dtype, and accumulates
  dL/dh_c = dL/dlogits_c @ W                [c, H]
  dL/dW  += dL/dlogits_c^T @ h_c            [V/tp, H], in float32 (each chunk's product in the
                                             weights' dtype, as the output layer's one product, in
                                             row blocks no larger than the chunk's logits)
so no pass holds more than one chunk's logits and their gradient. Where dL/dW goes: a weight
with a float32 `main_grad` (Megatron DDP's gradient buffer, which megappo's trainer reduces and
steps from) gets the chunks' products added to it directly, as Megatron's gradient-accumulation
fusion does, and autograd gets None for it (no [V/tp, H] gradient tensor at all; Megatron's DDP
hook only moves param.grad into main_grad, and megappo runs it without overlapped reduction, so
nothing waits for the hook; with tied embeddings the embedding's own gradient still arrives
through autograd and the hook, into the same buffer). A weight without one (tests, a frozen
model) gets the float32 sum back through autograd, in its dtype. The backward needs no communication: the
[N] outputs are replicated over TP, every rank owns its shard's dL/dW, and its dL/dh (a partial
sum over the vocabulary) is summed over TP by the mapping before this function, as
ColumnParallelLinear's backward does.

Tolerances against today's path (tests/unit/test_chunked_head.py, tests/distributed/
test_chunked_head.py): float32 within 1e-5 (the statistics are the same operations; a matmul over
fewer rows may round differently); bfloat16 within megappo.models.precision.COMPARE_TOL (the
weight gradient is summed in float32 over chunks, the output layer's is one bf16 product).
"""

from __future__ import annotations

import torch

from megappo.parallel.vocab_parallel import _budget, _compute_dtype, forward_stats, logits_grad


class _ChunkedHead(torch.autograd.Function):
    """(hidden [N, H], weight [V/tp, H], labels [N] or None, group, temperature, vocab_size,
    with_entropy, chunk, block budget) -> (log-probs [N] or empty, entropy [N] or empty)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, group, temperature: float, vocab_size: int, with_entropy: bool,
                chunk: int, budget: int):
        n = hidden.shape[0]
        pad = _padding(weight, group, vocab_size)
        dtype = torch.float32 if temperature != 1.0 else _compute_dtype(weight)
        log_probs = hidden.new_empty(n, dtype=dtype) if labels is not None else hidden.new_empty(0, dtype=dtype)
        entropy = hidden.new_empty(n, dtype=dtype) if with_entropy else hidden.new_empty(0, dtype=dtype)
        stats = hidden.new_empty((3, n), dtype=dtype)
        has_neg_inf = []
        for c in _chunks(n, chunk):
            x = _tempered(hidden.detach()[c], weight.detach(), temperature, pad)
            lp, ent, st, neg = forward_stats(x[None], None if labels is None else labels[c][None], group,
                                             with_entropy, budget)
            if labels is not None:
                log_probs[c] = lp[0]
            if with_entropy:
                entropy[c] = ent[0]
            stats[:, c] = st[:, 0]
            has_neg_inf.append(neg)
        ctx.save_for_backward(hidden, weight, labels, stats)
        ctx.set_materialize_grads(False)
        ctx.group, ctx.temperature, ctx.pad, ctx.with_entropy = group, temperature, pad, with_entropy
        ctx.chunk, ctx.budget, ctx.has_neg_inf = chunk, budget, has_neg_inf
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels, stats = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_log_probs is None and grad_entropy is None or not (want_h or want_w):
            return (None,) * 9
        h, w = hidden.detach(), weight.detach()
        grad_h = torch.empty_like(h) if want_h else None
        # dL/dW summed in float32: into Megatron DDP's float32 buffer when the weight has one (as its
        # gradient-accumulation fusion does; autograd then gets no gradient for W), else a new tensor
        into = getattr(weight, "main_grad", None) if want_w else None
        if into is not None and into.dtype != torch.float32:
            into = None
        grad_w = None
        if want_w and into is None:
            grad_w = torch.zeros(w.shape, dtype=torch.float64 if w.dtype == torch.float64 else torch.float32,
                                 device=w.device)
        for i, c in enumerate(_chunks(h.shape[0], ctx.chunk)):
            x = _tempered(h[c], w, ctx.temperature, ctx.pad)
            g = logits_grad(x[None], None if labels is None else labels[c][None], stats[:, c][:, None],
                            ctx.has_neg_inf[i], ctx.group, ctx.with_entropy, ctx.budget,
                            None if grad_log_probs is None else grad_log_probs[c][None],
                            None if grad_entropy is None else grad_entropy[c][None])[0]
            del x
            # back through _tempered: the mask's gradient is 0 on padding rows, the scaling's 1/T, .float()'s a cast
            if ctx.pad is not None:
                g = g.masked_fill(ctx.pad, 0.0)
            if ctx.temperature != 1.0:
                g = g / ctx.temperature
            g = g.to(w.dtype)
            if want_h:
                grad_h[c] = g @ w
            if want_w:
                # the chunk's [V/tp, H] product in W's dtype, in row blocks no larger than the chunk's
                # logits, each added in float32 without a float32 copy
                target, g_t = into if into is not None else grad_w, g.t()
                rows = max(1, g.numel() // max(1, h.shape[1]))
                for r in range(0, g_t.shape[0], rows):
                    target[r:r + rows].add_(g_t[r:r + rows] @ h[c])
            del g
        if grad_w is not None:
            grad_w = grad_w.to(w.dtype)  # the parameter's dtype (autograd would cast it too)
        return grad_h, grad_w, None, None, None, None, None, None, None


def _chunks(n: int, chunk: int):
    for start in range(0, n, chunk):
        yield slice(start, min(n, start + chunk))


def _padding(weight: torch.Tensor, group, vocab_size: int) -> torch.Tensor | None:
    """[V/tp] True for this shard's rows at or past `vocab_size` (Megatron's vocabulary padding), or None."""
    import torch.distributed as dist

    shard = weight.shape[0]
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    ids = torch.arange(rank * shard, (rank + 1) * shard, device=weight.device)
    pad = ids >= vocab_size
    return pad if bool(pad.any()) else None


def _tempered(h: torch.Tensor, w: torch.Tensor, temperature: float, pad: torch.Tensor | None) -> torch.Tensor:
    """[c, V/tp] logits of one chunk as the log-prob functions read them: the output layer's
    product (torch.matmul, as Megatron's linear), scaled by 1/T in float32 when T != 1, padding
    rows -inf (each step skipped where it changes nothing, as PolicyWorker._scaled)."""
    x = torch.matmul(h, w.t())
    if temperature != 1.0:
        x = x.float() / temperature
    if pad is not None:
        x = x.masked_fill(pad, float("-inf"))
    return x


def _chunk_tokens(chunk_tokens: int) -> int:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return chunk_tokens


def chunked_head_log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                                       tp_group=None, *, temperature: float = 1.0, vocab_size: int | None = None,
                                       with_entropy: bool = True, chunk_tokens: int,
                                       block_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H] hidden states (the output layer's input after its TP mapping), [V/tp, H] weight shard,
    [N] global label ids (or None) -> ([N] log-probs or empty, [N] entropy or empty) of the tempered
    softmax over the first `vocab_size` ids (None: every row is real vocabulary), `chunk_tokens` tokens
    at a time. Differentiable in `hidden` and `weight`."""
    vocab = weight.shape[0] * (1 if tp_group is None else torch.distributed.get_world_size(tp_group))
    budget = _budget(weight, block_elements)
    return _ChunkedHead.apply(hidden, weight, labels, tp_group, float(temperature),
                              vocab if vocab_size is None else vocab_size, with_entropy,
                              _chunk_tokens(chunk_tokens), budget)


@torch.no_grad()
def chunked_head_sum_pi_squared(hidden: torch.Tensor, weight: torch.Tensor, tp_group=None, *,
                                temperature: float = 1.0, vocab_size: int | None = None, chunk_tokens: int,
                                block_elements: int | None = None) -> torch.Tensor:
    """[N, H], [V/tp, H] -> [N] sum over the vocabulary of p^2 of the tempered softmax, chunk by
    chunk (vocab_parallel.vocab_parallel_sum_pi_squared on each chunk's logits). Forward only."""
    from megappo.parallel.vocab_parallel import vocab_parallel_sum_pi_squared

    vocab = weight.shape[0] * (1 if tp_group is None else torch.distributed.get_world_size(tp_group))
    pad = _padding(weight, tp_group, vocab if vocab_size is None else vocab_size)
    chunk = _chunk_tokens(chunk_tokens)
    parts = [vocab_parallel_sum_pi_squared(_tempered(hidden[c], weight, temperature, pad)[None], tp_group,
                                           block_elements=block_elements)[0] for c in _chunks(hidden.shape[0], chunk)]
    return torch.cat(parts) if parts else hidden.new_empty(0, dtype=torch.float32)
