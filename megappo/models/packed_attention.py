"""Core attention for Megatron-Core's local layer spec that also takes packed (THD) sequences.

Megatron-Core's `DotProductAttention` (the local spec, what megappo uses on CPU) refuses
`packed_seq_params`; only Transformer Engine's attention reads the THD format. With this
class in the local spec, a packed micro-batch takes Megatron's own THD path end to end
(`GPTModel` sizes the rotary table by the longest sequence, `Attention` squeezes q/k/v to
[t, heads, d] and applies RoPE per sequence from `cu_seqlens`), and attention within each
sequence runs through `megappo.models.attention_dispatch` (one fused varlen call per
micro-batch on CUDA in bf16, per-sequence SDPA on CPU): compute and memory follow
sum(len_i^2), not L^2 of the whole pack, and no mask is built. Unpacked inputs
([s, b, heads, d] with a mask) go to `DotProductAttention` unchanged.

Under context parallelism (cp > 1) the micro-batch's tokens are split over the CP group
(megappo.parallel.context): this rank's keys and values are all-gathered into whole sequences and
its queries, two chunks of each sequence, attend to them (`causal_attention_at` of the dispatch).

Shape legend: t packed tokens, np query heads and ng query groups on this TP rank, d head dim.

This module does not know about PPO, micro-batch planning, which rows were packed or which
kernel runs (the dispatch decides).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megappo.models.attention_dispatch import causal_attention_at, packed_causal_attention
from megappo.parallel import context


class PackedDotProductAttention(DotProductAttention):
    """DotProductAttention plus THD input: causal attention within each packed sequence, whole or split
    over a context-parallel group."""

    def __init__(self, config, *args, pg_collection=None, **kwargs):
        from megatron.core import parallel_state as mps

        cp = config.context_parallel_size
        config.context_parallel_size = 1  # Megatron's class refuses CP (it has no exchange); this one has
        try:
            super().__init__(config, *args, pg_collection=pg_collection, **kwargs)
        finally:
            config.context_parallel_size = cp
        self.cp_group = getattr(pg_collection, "cp", None) if cp > 1 else None
        if cp > 1 and self.cp_group is None:
            self.cp_group = mps.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
        assert attention_bias is None and self.softmax_offset is None, "not supported with packed sequences"
        cu = packed_seq_params.cu_seqlens_q
        assert cu is packed_seq_params.cu_seqlens_kv or torch.equal(cu, packed_seq_params.cu_seqlens_kv)
        longest = packed_seq_params.max_seqlen_q or int((cu[1:] - cu[:-1]).max())
        dropout = self.attention_dropout.p if self.training else 0.0
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, cu, dropout)
        # [t, np, d]; Attention reshapes it to [t, 1, np * d]
        return packed_causal_attention(query, key, value, cu, longest, scale=self.softmax_scale, dropout=dropout)

    def _context_parallel(self, query, key, value, cu, dropout):
        """This rank's queries [t, np, d] against their sequences' whole K/V, gathered over the CP group;
        `cu` the padded global bounds."""
        group = self.cp_group
        cp, rank = group.size(), group.rank()
        bounds = cu.tolist()
        k_all, v_all = context.gather_keys_values(key, value, bounds, group)
        positions = context.local_positions(cu.to(query.device), cp, rank, query.shape[0])
        return causal_attention_at(query, k_all, v_all, context.local_bounds(bounds, cp), bounds, positions,
                                   context.keys_seen(bounds, cp, rank), scale=self.softmax_scale, dropout=dropout)
