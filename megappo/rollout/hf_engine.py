"""The `hf` rollout engine: a transformers model with a KV cache (CPU default; GPU for debug).

Batched sampling over left-padded prompts with positions counted from the attention mask
(as transformers' `generate` does), temperature / top-k / top-p, EOS and stop tokens, a
seeded generator, and the log-prob of every sampled token under the tempered or untempered
distribution (`SamplingParams.logprob_mode`). Weights are updated in place from the
bridge's buckets of HF-named tensors; tied embeddings are updated once through
`model.embed_tokens.weight`.

Shape legend: B prompts x n, P prompt length, R new tokens, V vocab.

This module does not know about Megatron or the bridge's gathering.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from megappo.rollout.engine import Bucket, left_pad, tensor_fingerprint
from megappo.types import RolloutBatch, SamplingParams


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


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] float32 logits -> ([B] sampled ids, [B] their log-probs per logprob_mode)."""
    if params.greedy:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    reference = scaled if params.logprob_mode == "tempered" else logits
    return tokens, reference.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


class HFEngine:
    """transformers-backed engine; `model` is an HF *ForCausalLM in eval mode."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, device: str | torch.device = "cpu"):
        self.model = model.to(device).eval()
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.dtype = next(self.model.parameters()).dtype
        self._params = dict(self.model.named_parameters())
        self._params.update({n: b for n, b in self.model.named_buffers() if n in self.model.state_dict()})

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        prompt_ids, prompt_mask = left_pad([list(p) for p in prompts for _ in range(params.n)], self.pad_token_id)
        prompt_index = torch.arange(len(prompts)).repeat_interleave(params.n)
        ids, mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        stop = torch.tensor(sorted(set(params.eos_token_ids) | set(params.stop_token_ids)) or [-1],
                            device=self.device)
        batch = ids.shape[0]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
        next_pos = positions[:, -1:] + 1
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        tokens, logps, alive = [], [], []
        for step in range(params.max_new_tokens):
            tok, lp = sample_tokens(logits, params, gen)
            tok = tok.masked_fill(finished, self.pad_token_id)
            alive.append(~finished)
            tokens.append(tok)
            logps.append(lp.masked_fill(finished, 0.0))
            finished = finished | torch.isin(tok, stop)
            if finished.all() or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                             past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
            next_pos = next_pos + 1
        response_mask = torch.stack(alive, 1).long()
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=torch.stack(tokens, 1).cpu(),
            response_mask=response_mask.cpu(),
            rollout_log_probs=torch.stack(logps, 1).float().cpu(),
            finish_reasons=["stop" if f else "length" for f in finished.tolist()],
            prompt_index=prompt_index,
            logprob_mode="untempered" if params.greedy else params.logprob_mode,
        )

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        for bucket in buckets:
            for name, tensor in bucket:
                target = self._params.get(name)
                if target is None:
                    raise KeyError(f"the hf engine's model has no tensor '{name}'")
                if target.shape != tensor.shape:
                    raise ValueError(f"'{name}': engine shape {tuple(target.shape)} != sent {tuple(tensor.shape)}")
                target.copy_(tensor)

    def fingerprint_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor_fingerprint(tensor.to(self.dtype))

    @torch.no_grad()
    def fingerprints(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {n: tensor_fingerprint(self._params[n]) for n in names if n in self._params}

    def release_memory(self) -> None:  # nothing is cached between calls
        pass

    def resume_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        self.model = None
