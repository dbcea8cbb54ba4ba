"""The attention dispatch: which kernel computes packed (THD) causal attention, decided in one place.

Megatron-Core's local layer spec runs core attention through
`megappo.models.packed_attention.PackedDotProductAttention`; for a packed micro-batch it calls
`packed_causal_attention` here, which picks a kernel per call from the tensors' device and
dtype, the head dim, the dropout and what this process can import (`available_kernels`):

  varlen      `torch.nn.attention.varlen.varlen_attn` (torch's flash kernel): the whole packed
              micro-batch in one call. CUDA, bf16/fp16, head dim a multiple of 8 up to 256,
              no dropout (the op hard-codes p=0). Grouped-query heads go in as they are where its
              signature has `enable_gqa` (torch 2.13); older torch gets K/V expanded (a view
              expanded and reshaped, for this kernel only). Measured on an H100 (bf16, 137
              sequences of 560-640 tokens, fwd+bwd of one layer): 7.3 ms against 280 ms for
              per-sequence SDPA (docs/gpu.md).
  flash_attn  `flash_attn.flash_attn_varlen_func` from the flash-attn package when it imports:
              the same single call, GQA native, dropout supported. Chosen on CUDA when `varlen`
              cannot take the call (an older torch without it, dropout > 0).
  sdpa        torch's `scaled_dot_product_attention` with `enable_gqa` per sequence, on
              [1, heads, len, d] on CUDA; on CPU once per sequence length, the sequences of that
              length stacked as [n x heads, len, d] (`_sdpa_by_length`: bit for bit the call per
              sequence, forward and backward, tested; a micro-batch of 64 short rollouts makes a
              few calls instead of 64, each of them going through the CPU layer's torch-function
              mode). Every device and dtype. The reference the fused kernels are tested against
              (tests/unit/test_attention_dispatch.py) and the CPU path.

Under context parallelism (megappo.parallel.context) a rank's queries are two chunks of each sequence
and the keys the whole sequence: `causal_attention_at` runs SDPA per sequence with a boolean mask from
the queries' positions, sequences of one shape stacked into one call (every device and dtype; no
fused varlen kernel takes queries at arbitrary positions of their sequence yet).

Transformer Engine's layer spec (`model.layer_spec=te`) does not come here: TE's own
DotProductAttention reads the THD format (cu_seqlens) and picks its fused kernels itself.

Shape legend: t packed tokens, hq query heads and hkv key/value heads (query groups) on this
TP rank, d head dim, n+1 sequence bounds (cu_seqlens; a padding tail is a sequence of its own).

This module does not know about Megatron modules, PPO, micro-batch planning or which rows were
packed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

import torch

BACKENDS = ("varlen", "flash_attn", "sdpa")
FUSED_DTYPES = (torch.bfloat16, torch.float16)
MAX_FUSED_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The fused varlen kernels this process can call (None: not importable)."""

    varlen: Callable | None = None  # torch.nn.attention.varlen.varlen_attn
    varlen_gqa: bool = False  # its signature has enable_gqa (else K/V are expanded for it)
    varlen_window: bool = True  # causal as window_size=(-1, 0) (torch 2.13); else is_causal=True
    flash_attn: Callable | None = None  # flash_attn.flash_attn_varlen_func


@functools.lru_cache(maxsize=1)
def available_kernels() -> Kernels:
    """What this process has, looked up once (imports only; nothing runs)."""
    varlen = flash = None
    gqa = window = False
    try:
        from torch.nn.attention.varlen import varlen_attn as varlen

        params = inspect.signature(varlen).parameters
        gqa, window = "enable_gqa" in params, "window_size" in params
        if "scale" not in params:  # a torch whose varlen_attn cannot take Megatron's softmax scale
            varlen = None
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func as flash
    except Exception:  # not installed, or built for another torch / CUDA
        flash = None
    return Kernels(varlen=varlen, varlen_gqa=gqa, varlen_window=window, flash_attn=flash)


def choose_backend(device_type: str, dtype: torch.dtype, head_dim: int, *, gqa: bool, dropout: float,
                   kernels: Kernels) -> str:
    """The backend for one call (a pure function of its arguments): a fused single-call kernel on
    CUDA in bf16/fp16 when one is available and takes the head dim and dropout, else `sdpa`.
    torch's varlen kernel first (no extra package; measured), unless it would need K/V expanded
    for grouped-query heads and flash-attn, which shares them natively, is there."""
    fused_ok = device_type == "cuda" and dtype in FUSED_DTYPES and head_dim % 8 == 0 and head_dim <= MAX_FUSED_HEAD_DIM
    if not fused_ok:
        return "sdpa"
    expand = gqa and not kernels.varlen_gqa
    if kernels.varlen is not None and dropout == 0.0 and not (expand and kernels.flash_attn is not None):
        return "varlen"
    if kernels.flash_attn is not None:
        return "flash_attn"
    return "sdpa"


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, *, scale: float | None, dropout: float = 0.0,
                            backend: str | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence: q [t, hq, d], k/v [t, hkv, d], cu_seqlens [n+1]
    -> [t, hq, d]. `backend` None: `choose_backend` for these tensors; naming one forces it (tests,
    benchmarks)."""
    backend = backend or choose_backend(query.device.type, query.dtype, query.shape[-1],
                                        gqa=query.shape[1] != key.shape[1], dropout=dropout, kernels=available_kernels())
    if backend == "varlen":
        return _varlen(query, key, value, cu_seqlens, max_seqlen, scale, available_kernels())
    if backend == "flash_attn":
        cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
        return available_kernels().flash_attn(query, key, value, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout,
                                              softmax_scale=scale, causal=True)
    if backend == "sdpa":
        return per_sequence_sdpa(query, key, value, cu_seqlens.tolist(), scale=scale, dropout=dropout)
    raise ValueError(f"unknown attention backend '{backend}'; choose one of {BACKENDS}")


def _varlen(query, key, value, cu_seqlens, max_seqlen, scale, kernels: Kernels) -> torch.Tensor:
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    kwargs = dict(window_size=(-1, 0)) if kernels.varlen_window else dict(is_causal=True)
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and kernels.varlen_gqa:
        kwargs["enable_gqa"] = True
    elif groups > 1:  # [t, hkv, d] -> [t, hkv, groups, d] (a view) -> [t, hq, d]; head h reads group h // groups
        key, value = (x.unsqueeze(2).expand(-1, -1, groups, -1).reshape(query.shape) for x in (key, value))
    return kernels.varlen(query, key, value, cu, cu, max_seqlen, max_seqlen, scale=scale, **kwargs)


def per_sequence_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], *,
                      scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """SDPA on each sequence alone ([t, h, d] slices -> [1, h, len, d] on CUDA, [h, len, d] on CPU;
    causal, GQA heads shared): compute and memory follow sum(len_i^2), not t^2, and no mask is
    built. On CPU without dropout, sequences of one length share a call (`_sdpa_by_length`).
    -> [t, hq, d]."""
    assert bounds[0] == 0 and bounds[-1] == query.shape[0], (bounds, query.shape)
    gqa = query.shape[1] != key.shape[1]
    # CUDA's fused SDPA backends need 4-D inputs; on CPU the 3-D call is the one megappo's results
    # (and the demo's trajectory) were measured with: the 4-D one differs by up to 3.6e-7 in fp32
    batched = query.device.type == "cuda"
    if not batched and dropout == 0.0:  # (with dropout, one call per sequence draws the masks in its order)
        return _sdpa_by_length(query, key, value, bounds, scale=scale, gqa=gqa)
    outputs = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[start:stop].transpose(0, 1) for x in (query, key, value))  # [h, len, d]
        if batched:
            q, k, v = q[None], k[None], v[None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa)
        outputs.append((out[0] if batched else out).transpose(0, 1))
    return torch.cat(outputs)


def _sdpa_by_length(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], *,
                    scale: float | None, gqa: bool) -> torch.Tensor:
    """The CPU per-sequence call, one per distinct length: the n sequences of length len gathered
    into [n x h, len, d] (sequence-major, so query head j of sequence i reads key/value head
    (i x hq + j) // (hq / hkv) = i x hkv + j // (hq / hkv), its own), the outputs put back in
    token order. Each [len, d] slice goes through the same 3-D kernel as alone: equal bit for bit
    to a call per sequence, gradients included (gathers and their scatter-adds onto distinct
    positions add nothing but zeros). -> [t, hq, d]."""
    starts: dict[int, list[int]] = {}
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop > start:
            starts.setdefault(stop - start, []).append(start)
    outputs, order = [], []
    for length, firsts in starts.items():
        n = len(firsts)
        idx = (torch.tensor(firsts)[:, None] + torch.arange(length)).flatten()  # [n x len] token positions
        q, k, v = (x.index_select(0, idx).view(n, length, *x.shape[1:]).transpose(1, 2).reshape(
            n * x.shape[1], length, x.shape[2]) for x in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outputs.append(out.view(n, query.shape[1], length, -1).transpose(1, 2).reshape(n * length, query.shape[1], -1))
        order.append(idx)
    if not outputs:  # no tokens
        return query.new_empty((0, query.shape[1], value.shape[2]))
    if len(outputs) == 1:  # one length: its sequences, in order, are every token in order
        return outputs[0]
    order = torch.cat(order)
    where = torch.empty_like(order)
    where[order] = torch.arange(order.numel())  # token position -> its row of the stacked outputs
    return torch.cat(outputs).index_select(0, where)


def causal_attention_at(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_bounds: list[int],
                        k_bounds: list[int], q_positions: torch.Tensor, k_seen: list[int], *, scale: float | None,
                        dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of queries at given positions of their sequences against the sequences' whole
    keys: q [tq, hq, d] in sequences `q_bounds` [n+1], k/v [tk, hkv, d] in sequences `k_bounds` [n+1],
    `q_positions` [tq] each query's position in its sequence (it sees the keys at positions <= its own),
    `k_seen` [n] how many of its sequence's first keys a sequence's queries reach (the latest query's
    position + 1; given by the caller, so the device is not read). -> [tq, hq, d]. One SDPA call per
    (query count, keys reached) pair: the m sequences that share it stacked as [m, heads, len, d], each
    with its own boolean mask [m, 1, queries, keys] from its queries' positions."""
    gqa = query.shape[1] != key.shape[1]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (qs, qe) in enumerate(zip(q_bounds[:-1], q_bounds[1:])):
        if qe > qs:
            groups.setdefault((qe - qs, k_seen[i]), []).append(i)
    outputs, order = [], []
    for (length, seen), seqs in groups.items():
        m, device = len(seqs), query.device
        q_idx = (torch.tensor([q_bounds[i] for i in seqs])[:, None] + torch.arange(length)).flatten().to(device)
        k_idx = (torch.tensor([k_bounds[i] for i in seqs])[:, None] + torch.arange(seen)).flatten().to(device)
        q = query.index_select(0, q_idx).view(m, length, *query.shape[1:]).transpose(1, 2)  # [m, hq, len, d]
        k, v = (x.index_select(0, k_idx).view(m, seen, *x.shape[1:]).transpose(1, 2) for x in (key, value))
        pos = q_positions.index_select(0, q_idx).view(m, 1, length, 1)
        mask = pos >= torch.arange(seen, device=device)  # [m, 1, len, seen] True: attend
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                               dropout_p=dropout, enable_gqa=gqa)
        outputs.append(out.transpose(1, 2).reshape(m * length, query.shape[1], -1))
        order.append(q_idx)
    if not outputs:
        return query.new_empty((0, query.shape[1], value.shape[2]))
    if len(outputs) == 1 and q_bounds[0] == 0 and q_bounds[-1] == query.shape[0]:
        return outputs[0]  # one shape: its sequences, in order, are every query in order
    order = torch.cat(order)
    where = torch.empty_like(order)
    where[order] = torch.arange(order.numel(), device=order.device)  # query position -> its row of the outputs
    return torch.cat(outputs).index_select(0, where)
