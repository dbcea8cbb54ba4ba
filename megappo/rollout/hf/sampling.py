"""Per-row sampling of the hf engine's decode paths: top-k / top-p filtering, the inverse-CDF draw of
a row's token at its own uniform, and the seeded [R, N] uniforms (one per sample and step), so that
with a seed each sample's tokens are fixed whatever else shares its batch or step shape, and, given
its `SamplingParams.sample_window`, whichever part of a split call (a replica's chunk) it is in.

Shape legend: b rows, V vocab, R new tokens, N samples.

This module does not know about models, caches or engines.
"""

from __future__ import annotations

import torch

from megappo.types import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] -> [B, V] with tokens outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already cover top_p (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, V] float32 logits, [b] uniforms in [0, 1) -> ([b] sampled ids, [b] their log-probs
    per logprob_mode). A sampled token is the inverse CDF of its row's filtered distribution
    at the row's uniform, so a row's token depends on its own logits and uniform only, not
    on which other rows share the batch. Greedy: argmax, `uniforms` unused."""
    if params.greedy:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert uniforms is not None and uniforms.shape == logits.shape[:1]
    scaled = logits / params.temperature
    cdf = filter_logits(scaled, params.top_k, params.top_p).softmax(-1).cumsum(-1)  # [b, V]
    total = cdf[:, -1:]
    # the first token whose CDF exceeds u * total (a zero-probability token never is); the
    # bound keeps u * total below the total when the product rounds up
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    reference = scaled if params.logprob_mode == "tempered" else logits
    return tokens, reference.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


def sampling_uniforms(params: SamplingParams, num_samples: int, device: torch.device) -> torch.Tensor | None:
    """[R, N] uniforms in [0, 1): sample i draws its step-t token with u[t, i]. One draw per
    call from a generator seeded with `params.seed` (the global RNG when None), so a seed
    fixes every sample's tokens whatever the order in which rows finish. With
    `params.sample_window` (first, total) the draw is the whole call's [R, total] and the call
    takes its columns [first, first + N): a seeded sample draws the same uniforms whichever
    part of the call it is generated in. None when greedy."""
    if params.greedy:
        return None
    first, total = params.sample_window or (0, num_samples)
    if first + num_samples > total:
        raise ValueError(f"sample_window={params.sample_window}: {num_samples} samples from sample {first} run past "
                         f"the whole call's {total}. Fix: give each part of a call (first, total) with first its "
                         "first sample's index in the whole call and total the whole call's samples (prompts x n).")
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device=device).manual_seed(params.seed)
    uniforms = torch.rand(params.max_new_tokens, total, generator=gen, device=device)
    return uniforms if (first, total) == (0, num_samples) else uniforms[:, first:first + num_samples]
