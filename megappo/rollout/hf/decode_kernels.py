"""What a fixed-shape decode step (megappo.rollout.hf.static_decode) runs in place of transformers' eager
pieces: a CUDA graph replays every kernel of the step, a few microseconds each at a decode step's sizes,
and transformers' eager Llama layer runs about 40, so the step's time follows its kernel count as much as
its bytes (benchmarks/RESULTS.md, "Issue 39 on one H200, second run").

What it owns (`StepKernels`, entered around each step's forward; the prefill and the model outside a
step keep transformers' own):
- attention of the step's one query token (`grouped_decode_attention`, set as the model's attention
  function): the query heads that share a KV head are that KV head's rows, so each KV head's cache columns
  are read once. transformers' SDPA function (5.17; later versions pack the heads the same way) copies K and V
  out to every query head (`repeat_kv`) whenever a mask is given: g copies of the window written and read
  again, at every layer and step (g query heads per KV head: 4 in Llama-3.2-1B).
- the RMSNorm layers (RMS_NORMS) as torch's `rms_norm`: on CUDA one fused kernel (`_fused_rms_norm`) where
  transformers' forward runs eight (upcast, square, mean, add, rsqrt, product, downcast, weight). On the CPU
  torch composes it of the same ops in the same order, so in float32 it equals transformers' bit for bit
  there (on CUDA the fused kernel's sum may round differently); in bf16 the weight multiplies before the one
  rounding to bf16 rather than after it (one bf16 rounding apart), which is what the trainer's norm computes
  (Megatron-Core's local spec runs torch.nn.RMSNorm).
- RoPE (`rope`, in place of the modeling module's `apply_rotary_pos_emb`): bit for bit transformers'
  function in 6 kernels where it runs 10: queries and keys rotated as one tensor, and rotate_half(x) * sin
  written as roll(x) * (sign * sin) ((-a) * b and a * (-b) are the same number).

This module does not know about caches, buckets, graphs or sampling (static_decode), nor which models
may run the step (megappo.rollout.hf.decode_paths).
"""

from __future__ import annotations

import functools
import sys
import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GROUPED_DECODE = "megappo_grouped_decode"  # the name the step's attention function is registered under

#: transformers' RMSNorm classes of the supported models (decode_paths.STATIC_MODEL_TYPES), each written as
#: LlamaRMSNorm is: weight * (x in float32 / rms(x)) cast back to x's dtype before the product
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
#: their attention classes, whose forward calls its modeling module's `apply_rotary_pos_emb(q, k, cos, sin)`
ROPE_ATTENTIONS = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention"})


def grouped_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for one query token: query [b, H, 1, d] viewed as [b, H_kv, g, d]
    (query head j uses KV head j // g, as `repeat_kv` pairs them), so SDPA reads key / value [b, H_kv, W, d]
    as they are; the mask [b, 1, 1, W] is shared by a row's heads. Returns ([b, 1, H, d], None) as
    transformers' own functions do. Anything else (more query tokens, no grouping, a training module)
    goes to transformers' SDPA function unchanged."""
    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, dim = query.shape
    if q_len != 1 or groups == 1 or dropout or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, heads // groups, groups, dim), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)


def rms_norm(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """An RMS_NORMS layer's forward as torch's rms_norm."""
    return torch.nn.functional.rms_norm(hidden, hidden.shape[-1:], module.weight, module.variance_epsilon)


_SIGNS: dict[tuple, torch.Tensor] = {}  # (dim, dtype, device) -> [-1] * dim/2 + [1] * dim/2, made once


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb bit for bit: q [b, H, s, d], k [b, H_kv, s, d], cos / sin [b, s, d]
    -> (q, k) rotated, views of one [b, H + H_kv, s, d] tensor (heads at dim `unsqueeze_dim`, as there)."""
    heads, dim = q.shape[unsqueeze_dim], q.shape[-1]
    key = (dim, sin.dtype, sin.device)
    if key not in _SIGNS:  # made in a step's eager warm-up, before any capture, and kept: graphs read it
        _SIGNS[key] = torch.cat([torch.full((dim // 2,), -1.0), torch.ones(dim - dim // 2)]).to(sin.dtype).to(sin.device)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    both = torch.cat((q, k), dim=unsqueeze_dim)
    # rotate_half(x) = cat(-x2, x1) = roll(x, d/2) * sign, and (-a) * b == a * (-b) exactly
    out = both * cos + torch.roll(both, dim // 2, dims=-1) * (sin * _SIGNS[key])
    return out.narrow(unsqueeze_dim, 0, heads), out.narrow(unsqueeze_dim, heads, out.shape[unsqueeze_dim] - heads)


_STEP = threading.Lock()  # one step's replacements in place at a time, whichever engine or thread runs it


class StepKernels:
    """`with kernels:` around a step's forward: the model's attention function is `grouped_decode_attention`,
    its RMS_NORMS layers run `rms_norm`, and its ROPE_ATTENTIONS' modeling modules call `rope`; all undone on
    exit. The modeling modules' `apply_rotary_pos_emb` is module state, so steps that run eagerly (a warm-up,
    a capture, the uncaptured path) take one lock: engines in several threads run them one at a time (graph
    replays take no lock). Another thread running a model of the same family outside any step meanwhile gets
    `rope` too: bit for bit the same function."""

    def __init__(self, model: torch.nn.Module):
        self.config = model.config
        self.norms = [m for m in model.modules() if type(m).__name__ in RMS_NORMS]
        modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__ in ROPE_ATTENTIONS}
        self.modeling = sorted((m for m in modules if hasattr(m, "apply_rotary_pos_emb")), key=lambda m: m.__name__)
        self._saved: tuple | None = None

    def __enter__(self) -> None:
        _STEP.acquire()
        self._saved = (self.config._attn_implementation, [m.apply_rotary_pos_emb for m in self.modeling])
        self.config._attn_implementation = GROUPED_DECODE
        for module in self.norms:  # an instance attribute: nn.Module.__call__ finds it before the class's
            module.forward = functools.partial(rms_norm, module)
        for modeling in self.modeling:
            modeling.apply_rotary_pos_emb = rope

    def __exit__(self, *exc) -> None:
        try:
            attention, ropes = self._saved
            self.config._attn_implementation = attention
            for module in self.norms:
                del module.forward
            for modeling, original in zip(self.modeling, ropes):
                modeling.apply_rotary_pos_emb = original
        finally:
            _STEP.release()
