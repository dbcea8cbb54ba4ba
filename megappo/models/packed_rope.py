"""Rotary embeddings of packed (THD) sequences without reading the device on the host.

Megatron-Core 0.16.1's unfused RoPE for packed sequences (`rope_utils._apply_rotary_pos_emb_thd`, what
megappo's packed passes run: `apply_rope_fusion` is off, and TE's fused kernel is not there without TE)
builds each token's frequencies by splitting the pack by `cu_seqlens(...).tolist()` and compares
`freqs.size(0) == cu_seqlens[-1]` on the host: two device-to-host reads for the queries and two for
the keys, in every layer of every micro-batch, each one waiting for the GPU to drain its queue (the
1B actor update on an H200 on 2026-11-27: 580 synchronizations a call, the GPU idle 30% of it).
`install()` puts `thd_rope` in its place: the same frequencies, gathered by each token's position
computed on the device, then Megatron's own `_apply_rotary_pos_emb_bshd`, so the result is bit for
bit Megatron's (tests/unit/test_packed_rope.py). Under context parallelism (CP > 1, megappo.parallel.context)
each token's row is its position in its padded sequence, from the chunk it belongs to
(`context.local_positions`): Megatron's chunk layout and rows, without its host reads.

This module does not know about packing plans, attention kernels or which models use RoPE.
"""

from __future__ import annotations

import torch

from megappo.parallel.context import local_positions

_MEGATRON_THD = None  # Megatron's function, kept by install() (megatron is imported then, not at import time)


def packed_positions(cu_seqlens: torch.Tensor, tokens: int, table: int) -> torch.Tensor:
    """[tokens] the row of the frequency table each packed token takes, as Megatron's function picks
    it: the token's position within its sequence, or (when the table has exactly `cu_seqlens[-1]`
    rows: Megatron's "exact mapping") its position in the pack. Computed on the device."""
    index = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sequence = torch.searchsorted(cu_seqlens[1:], index, right=True)  # sequence i holds [cu[i], cu[i + 1])
    within = index - cu_seqlens[sequence]
    return torch.where(cu_seqlens[-1] == table, index, within).long()


def thd_rope(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
             multi_latent_attention: bool = False, mscale: float = 1.0, cp_group=None) -> torch.Tensor:
    """`rope_utils._apply_rotary_pos_emb_thd`'s signature and result: `t` [tokens, heads, d] packed by
    `cu_seqlens` [sequences + 1], `freqs` [rows, 1, 1, d]."""
    from megatron.core.models.common.embeddings import rope_utils

    if cp_group is None:  # Megatron's message for a missing group
        return megatron_thd()(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                             multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
    if cp_group.size() > 1:
        cp = cp_group.size()
        within = local_positions(cu_seqlens, cp, cp_group.rank(), t.shape[0])
        # Megatron's "exact mapping" (a table of cu_seqlens[-1] rows) offsets each sequence by its start
        rows = freqs[torch.where(cu_seqlens[-1] == freqs.shape[0], within + _starts(cu_seqlens, within, cp), within)]
    else:
        rows = freqs[packed_positions(cu_seqlens, t.shape[0], freqs.shape[0])]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), rows, rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)


def _starts(cu_seqlens: torch.Tensor, within: torch.Tensor, cp: int) -> torch.Tensor:
    """[tokens] the global start of each local token's sequence (the exact mapping's offset)."""
    local_cu = torch.cumsum((cu_seqlens[1:] - cu_seqlens[:-1]) // cp, 0)
    index = torch.arange(within.shape[0], device=cu_seqlens.device)
    return cu_seqlens[torch.searchsorted(local_cu, index, right=True)].long()


def megatron_thd():
    """Megatron-Core's own `_apply_rotary_pos_emb_thd` (also after install())."""
    global _MEGATRON_THD
    if _MEGATRON_THD is None:
        from megatron.core.models.common.embeddings import rope_utils

        _MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd
    return _MEGATRON_THD


def install() -> None:
    """Megatron's packed RoPE becomes `thd_rope` in this process (idempotent)."""
    from megatron.core.models.common.embeddings import rope_utils

    megatron_thd()
    rope_utils._apply_rotary_pos_emb_thd = thd_rope
