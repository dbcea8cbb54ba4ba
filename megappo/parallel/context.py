"""Context parallelism (CP) of packed sequences: the split over a CP group, the exchange inside
attention, the gather of the selected outputs back into sequence order.

A packed micro-batch ([1, L] tokens in sequences bounded by cu_seqlens, megappo.parallel.packing)
runs on the `cp` ranks of a context-parallel group (ranks of one data-parallel replica), each
holding 1/cp of every sequence. Megatron's causal load balancing: each sequence is padded at its
end to a multiple of 2 x cp tokens (padding tokens come after the real ones, so causally they
change nothing) and cut into 2 x cp equal chunks; rank i holds chunks i and 2cp-1-i, so every
rank gets about the same share of the causal attention's work. The pack is padded at its end to
one length for every micro-batch of a pass (the pipeline's buffers have one shape), a multiple of
2 x cp x `multiple`:

    a sequence of 6 tokens, cp = 2:  pad to 8, chunks of 2   [a b | c d | e f | _ _]
                                     rank 0: chunks 0 and 3   [a b _ _]
                                     rank 1: chunks 1 and 2   [c d e f]

`ContextSplit` is that split for one micro-batch (computed on the host, the same on every rank of
the group, from cu_seqlens and the selected positions alone): each rank's tokens, the padded
cu_seqlens (global, as Megatron's THD format with CP has them: the model's tokens are 1/cp of
cu_seqlens[-1]), and where each selected output ends up.

Attention: all-gather of K/V (not a ring). Each rank gathers the whole micro-batch's keys and
values once per layer ([Lp, hkv, d] each, its own 1/cp included; `gather_keys_values`), puts them in
sequence order, and megappo.models.packed_attention runs its local queries against them, each
sequence with a causal mask on the queries' own positions
(megappo.models.attention_dispatch.causal_attention_at). Why: one collective per layer, and each
query's softmax is taken over all its keys at once, as at CP=1 (no merging of partial softmaxes), so
the results agree with CP=1 to float rounding; the K/V a rank holds is what it holds at CP=1 (GQA
keeps it small next to the queries and activations, which are split cp ways). Cost per layer:
memory 2 x Lp x hkv x d (the whole K/V, kept for the backward); traffic (cp-1)/cp of that in the
forward and the same again in the backward (the K/V gradients summed back to their owners: a
reduce-scatter on NCCL, an all-reduce on gloo, which has no reduce-scatter). A ring (Megatron-TE's
p2p) overlaps the exchange with compute and holds 2/cp of K/V, at the price of cp steps of partial
softmax; it is what to add when the K/V of a whole micro-batch no longer fits.

Outputs: the LM head (or value head) runs on the rank's own selected positions; `gather_selected`
all-gathers them over the group into the order of the whole micro-batch's selection, so every CP
rank computes the same per-token log-probs, entropy, values, sum p^2 and loss as CP=1 would (so no
loss or token count needs reducing over CP; the gathered [K, V/tp] logits are on every rank, as at
CP=1). Its backward gives each rank only the gradient of its own positions (every rank holds the
same full gradient of the gathered tensor), so each rank's parameter gradients are its own tokens'
part and Megatron's DDP sums them over data parallel x context parallel. A weight used on the
gathered outputs (the chunked LM head's) takes `shared_use`: its gradient divided by cp, so the cp
equal copies sum to one.

Shape legend: L packed length (one micro-batch), Lp its padded length, cp ranks of the group, n
sequences (segments of cu_seqlens, the pack's padding tail included), K selected positions, Kmax
the most any rank of the group holds.

This module does not know about models, losses, PPO or which positions are selected and why.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def padded_bounds(bounds: Sequence[int], cp: int, length: int | None = None) -> list[int]:
    """Sequence bounds [n+1] (cu_seqlens) -> the bounds with every sequence padded at its end to a
    multiple of 2 x cp, and, given `length` (>= that total, a multiple of 2 x cp), a tail sequence
    of padding up to `length`."""
    out = [0]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        out.append(out[-1] + _round_up(stop - start, 2 * cp))
    if length is not None:
        assert length >= out[-1] and length % (2 * cp) == 0, (length, out)
        if length > out[-1]:
            out.append(length)
    return out


def pass_length(all_bounds: Sequence[Sequence[int]], cp: int, multiple: int = 1) -> int:
    """The one padded length Lp of a pass's micro-batches: the longest padded pack, rounded up to a
    multiple of 2 x cp x `multiple` (each rank then holds Lp / cp tokens, a multiple of 2 x `multiple`)."""
    longest = max(padded_bounds(b, cp)[-1] for b in all_bounds)
    return _round_up(max(longest, 1), 2 * cp * multiple)


def rank_tokens(bounds: Sequence[int], cp: int, rank: int) -> list[int]:
    """[Lp/cp] the padded positions `rank` holds: chunks rank and 2cp-1-rank of every sequence of the
    padded `bounds`, sequence after sequence."""
    out: list[int] = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        chunk = (stop - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return out


def local_positions(cu_seqlens: torch.Tensor, cp: int, rank: int, tokens: int) -> torch.Tensor:
    """[tokens] each local token's position within its sequence (the row of the RoPE table it takes),
    computed on the device from the padded global `cu_seqlens` [n+1]: the local sequence j holds
    (cu[j+1] - cu[j]) / cp tokens, its first half chunk `rank`, its second half chunk 2cp-1-rank."""
    local_cu = torch.cat([cu_seqlens.new_zeros(1), torch.cumsum((cu_seqlens[1:] - cu_seqlens[:-1]) // cp, 0)])
    index = torch.arange(tokens, device=cu_seqlens.device, dtype=local_cu.dtype)
    seq = torch.searchsorted(local_cu[1:], index, right=True)
    within = index - local_cu[seq]
    half = (local_cu[seq + 1] - local_cu[seq]) // 2
    second = within >= half
    chunk = torch.where(second, 2 * cp - 1 - rank, rank)
    return (chunk * half + within - second * half).long()


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """One packed micro-batch split over a CP group (every rank of the group computes the same one)."""

    cp: int
    #: [n+1] int32 padded sequence bounds, global (the model's packed_seq_params)
    cu_seqlens: torch.Tensor
    #: the longest padded sequence (the RoPE table's rows)
    longest: int
    #: [cp, Lp/cp] each rank's tokens as positions of the original pack, -1: padding
    tokens: torch.Tensor
    #: [cp, Kmax] each rank's selected positions as indices of its local tokens (0 past its own count)
    select: torch.Tensor
    #: [K] where selected output k is in the gathered [cp x Kmax]: rank x Kmax + its index on that rank
    order: torch.Tensor

    def local_input_ids(self, input_ids: torch.Tensor, rank: int, pad_id: int = 0) -> torch.Tensor:
        """[1, L] the pack's tokens -> [1, Lp/cp] this rank's (padding: `pad_id`)."""
        mine = self.tokens[rank].to(input_ids.device)
        ids = input_ids[0].index_select(0, mine.clamp(min=0))
        return torch.where(mine >= 0, ids, torch.full_like(ids, pad_id))[None]

    def local_select(self, rank: int) -> torch.Tensor:
        """[2, Kmax] this rank's selected (s, b) positions among its local tokens."""
        s = self.select[rank]
        return torch.stack([s, torch.zeros_like(s)])


def split(bounds: Sequence[int], select: torch.Tensor, cp: int, length: int) -> ContextSplit:
    """The split of a pack with sequence `bounds` (its cu_seqlens) and `select` [K] selected positions
    (of the pack) over `cp` ranks, padded to `length` (`pass_length`)."""
    bounds = [int(b) for b in bounds]
    padded = padded_bounds(bounds, cp, length)
    source = torch.full((length,), -1, dtype=torch.long)  # padded position -> position of the pack
    for (start, stop), new in zip(zip(bounds[:-1], bounds[1:]), padded):
        source[new:new + stop - start] = torch.arange(start, stop)
    owned = torch.tensor([rank_tokens(padded, cp, r) for r in range(cp)], dtype=torch.long)  # [cp, Lp/cp]
    owner = torch.empty(length, dtype=torch.long)
    index = torch.empty(length, dtype=torch.long)
    owner[owned.flatten()] = torch.arange(cp).repeat_interleave(owned.shape[1])
    index[owned.flatten()] = torch.arange(owned.shape[1]).repeat(cp)
    where = torch.full((max(bounds[-1], 1),), -1, dtype=torch.long)  # pack position -> padded position
    valid = source >= 0
    where[source[valid]] = torch.arange(length)[valid]
    chosen = where[select.long()]
    who, at = owner[chosen], index[chosen]
    counts = torch.bincount(who, minlength=cp)
    kmax = int(counts.max()) if len(who) else 0
    rank_select = torch.zeros((cp, kmax), dtype=torch.long)
    slot = torch.empty_like(who)  # the index of each selected output among its rank's
    for r in range(cp):
        mine = (who == r).nonzero()[:, 0]
        rank_select[r, :len(mine)] = at[mine]
        slot[mine] = torch.arange(len(mine))
    longest = max((b - a for a, b in zip(padded[:-1], padded[1:])), default=0)
    return ContextSplit(cp=cp, cu_seqlens=torch.tensor(padded, dtype=torch.int32), longest=longest,
                        tokens=torch.where(owned >= 0, source[owned], owned), select=rank_select,
                        order=who * kmax + slot)


class _GatherSelected(torch.autograd.Function):
    """All-gather [1, Kmax, ...] over the group, then pick `order` -> [1, K, ...]; backward: this
    rank's own positions of the (identical on every rank) gradient."""

    @staticmethod
    def forward(ctx, x, order, group):
        cp, rank = group.size(), group.rank()
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.save_for_backward(order)
        ctx.shape, ctx.rank, ctx.cp = x.shape, rank, cp
        return torch.cat(parts, 1).index_select(1, order.to(x.device))

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        b, kmax = ctx.shape[0], ctx.shape[1]
        full = grad.new_zeros((b, ctx.cp * kmax, *ctx.shape[2:]))
        full.index_copy_(1, order.to(grad.device), grad)
        return full[:, ctx.rank * kmax:(ctx.rank + 1) * kmax], None, None


def gather_selected(x: torch.Tensor, split_: ContextSplit, group) -> torch.Tensor:
    """[1, Kmax, ...] this rank's selected outputs -> [1, K, ...] the micro-batch's, in the order of its
    selection, on every rank of the group (differentiable; see the module docstring)."""
    return _GatherSelected.apply(x, split_.order, group)


class _SharedUse(torch.autograd.Function):
    """Identity; the gradient is divided by the group's size."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.cp, None


def shared_use(weight: torch.Tensor, cp: int) -> torch.Tensor:
    """`weight` for a computation every rank of the CP group repeats on the same gathered inputs:
    its gradient is divided by cp, so the cp copies Megatron's DDP sums make one."""
    return weight if cp == 1 else _SharedUse.apply(weight, cp)


class _GatherSequence(torch.autograd.Function):
    """[t, ...] this rank's tokens -> [Lp, ...] every rank's, in padded sequence order; backward: the
    gradients of every rank's use summed onto this rank's tokens."""

    @staticmethod
    def forward(ctx, x, inverse, group):
        cp, rank = group.size(), group.rank()
        gathered = x.new_empty((cp * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
        ctx.save_for_backward(inverse)
        ctx.group, ctx.rank, ctx.t = group, rank, x.shape[0]
        return gathered.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        by_rank = torch.empty_like(grad)
        by_rank.index_copy_(0, inverse, grad)  # back to [cp x t] rank-major
        if dist.get_backend(ctx.group) == "nccl":
            mine = grad.new_empty((ctx.t, *grad.shape[1:]))
            dist.reduce_scatter_tensor(mine, by_rank, group=ctx.group)
            return mine, None, None
        dist.all_reduce(by_rank, group=ctx.group)  # gloo has no reduce-scatter
        return by_rank[ctx.rank * ctx.t:(ctx.rank + 1) * ctx.t], None, None


def sequence_order(cu_seqlens: Sequence[int], cp: int) -> torch.Tensor:
    """[Lp] for each padded position, its row in the rank-major all-gather of every rank's tokens."""
    owned = torch.tensor([rank_tokens(cu_seqlens, cp, r) for r in range(cp)], dtype=torch.long).flatten()
    inverse = torch.empty_like(owned)
    inverse[owned] = torch.arange(owned.numel())
    return inverse


def gather_keys_values(key: torch.Tensor, value: torch.Tensor, bounds: Sequence[int], group
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's k, v [t, hkv, d] -> the whole micro-batch's [Lp, hkv, d] each, in padded sequence
    order (one all-gather of both; differentiable: each rank's gradients summed onto their owner)."""
    cp = group.size()
    inverse = sequence_order(bounds, cp).to(key.device)
    both = _GatherSequence.apply(torch.stack([key, value], 1), inverse, group)  # [Lp, 2, hkv, d]
    return both[:, 0], both[:, 1]


def keys_seen(bounds: Sequence[int], cp: int, rank: int) -> list[int]:
    """[n] how many of each sequence's first keys `rank`'s queries reach: up to the end of its later chunk,
    2cp-1-rank (of the padded global `bounds`)."""
    return [(2 * cp - rank) * ((stop - start) // (2 * cp)) for start, stop in zip(bounds[:-1], bounds[1:])]


def local_bounds(bounds: Sequence[int], cp: int) -> list[int]:
    """Padded global bounds -> this rank's [n+1] bounds of its own tokens (each sequence's 2 chunks)."""
    out = [0]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        out.append(out[-1] + (stop - start) // cp)
    return out
