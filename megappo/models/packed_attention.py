"""Core attention for Megatron-Core's local layer spec that also takes packed (THD) sequences.

Megatron-Core's `DotProductAttention` (the local spec, what megappo uses on CPU) refuses
`packed_seq_params`; only Transformer Engine's attention reads the THD format. With this
class in the local spec, a packed micro-batch takes Megatron's own THD path end to end
(`GPTModel` sizes the rotary table by the longest sequence, `Attention` squeezes q/k/v to
[t, heads, d] and applies RoPE per sequence from `cu_seqlens`), and attention runs as
torch's `scaled_dot_product_attention` on each sequence alone (causal, grouped-query heads
shared): compute and memory follow sum(len_i^2), not L^2 of the whole pack, and no mask is
built. Unpacked inputs ([s, b, heads, d] with a mask) go to `DotProductAttention` unchanged.

Shape legend: t packed tokens, np query heads and ng query groups on this TP rank, d head dim.

This module does not know about PPO, micro-batch planning or which rows were packed.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    """DotProductAttention plus THD input: SDPA over each packed sequence."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
        assert attention_bias is None and self.softmax_offset is None, "not supported with packed sequences"
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        assert bounds == packed_seq_params.cu_seqlens_kv.tolist() and bounds[-1] == query.shape[0]
        dropout = self.attention_dropout.p if self.training else 0.0
        gqa = query.shape[1] != key.shape[1]
        outputs = []
        for start, stop in zip(bounds[:-1], bounds[1:]):  # [len, heads, d] -> [heads, len, d]
            q, k, v = (x[start:stop].transpose(0, 1) for x in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, dropout_p=dropout, enable_gqa=gqa)
            outputs.append(out.transpose(0, 1))
        return torch.cat(outputs)  # [t, np, d]; Attention reshapes it to [t, 1, np * d]
