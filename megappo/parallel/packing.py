"""Micro-batches for every model pass: packed by a token budget (the default) or padded.

A pass over N sequences is split among the DP replicas and, on each replica, into the
micro-batches that Megatron's pipeline schedule runs. Two ways, one record (`MicroBatchPlan`):

* packed (`plan_packed`): each sequence keeps only its tokens (the prompt's left padding and
  the response's right padding are dropped) and sequences are concatenated into micro-batches
  of at most `max_tokens` tokens ([1, L]). Sequences go to DP replicas so that replicas get
  about equal token counts, then each replica's sequences go into about equally full
  micro-batches; every replica runs the same number of micro-batches (unless it has fewer
  sequences). The micro-batches of one replica are padded at the end to one length L (the
  pipeline's p2p buffers have one shape per pass), rounded up to `multiple`.
* padded (`plan_padded`): today's layout and the reference the packed one is tested against:
  DP replica r takes rows [r*n/dp, (r+1)*n/dp), micro-batches of `micro_batch_size` rows [b, T].

The plan is computed from the global batch that every rank holds, so every rank computes the
same plan with no communication; rank 0 also knows every replica's micro-batches (metrics).

`micro_batch_tensors(plan, ...)` builds one replica's micro-batches: 'input_ids', the layout
('cu_seqlens' and 'position_ids' packed, 'attention_mask' padded), 'select' [2, K] (the (s, b)
positions of the model input whose output is needed: the state before each response token,
or each sequence's last token) and 'place' [2, K] (where each selected output goes in the
[m, R] or [m, 1] result of the micro-batch's m rows), 'rows' [m] (global row ids) and the
caller's per-row tensors.

Shape legend: N sequences, P prompt length (left-padded), R response length (right-padded),
T = P + R, m rows of a micro-batch, L packed length, K selected positions.

This module does not know about models, losses or configs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Sequence

import torch

Select = Literal["response", "last"]


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    """Which global rows each DP replica runs, grouped into micro-batches, and how."""

    packed: bool
    #: [dp][micro-batch] -> global row ids (ascending within a micro-batch)
    replicas: tuple[tuple[tuple[int, ...], ...], ...]
    #: tokens each row really has (prompt + response), by global row id
    lengths: tuple[int, ...]
    #: per replica: the [*, L] length its micro-batches are padded to (packed) or T (padded)
    padded_lengths: tuple[int, ...]

    def micro_batches(self, dp_rank: int) -> tuple[tuple[int, ...], ...]:
        return self.replicas[dp_rank]

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths[i] for rep in self.replicas for mb in rep for i in mb)

    @property
    def computed_tokens(self) -> int:
        """Token positions the model runs over, padding included, all replicas."""
        if self.packed:
            return sum(len(rep) * length for rep, length in zip(self.replicas, self.padded_lengths))
        return sum(len(mb) * length for rep, length in zip(self.replicas, self.padded_lengths) for mb in rep)

    @property
    def num_micro_batches(self) -> int:
        return sum(len(rep) for rep in self.replicas)


def sequence_lengths(attention_mask: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] mask (left-padded prompt, right-padded response) -> ([N] prompt tokens, [N] response
    positions up to the last real one). A response keeps masked positions inside it (a
    multi-turn observation), not the padding after it."""
    prompt = attention_mask[:, :prompt_len].sum(-1).long()
    resp = attention_mask[:, prompt_len:].bool()
    r = resp.shape[1]
    last = torch.where(resp, torch.arange(1, r + 1).expand_as(resp), torch.zeros_like(resp, dtype=torch.long))
    return prompt, last.amax(-1) if r else torch.zeros_like(prompt)


def _lpt(items: Sequence[int], sizes: Sequence[int], bins: int) -> list[list[int]]:
    """Longest-processing-time-first: items (largest first, then lowest id) each to the bin with
    the fewest tokens so far (then the fewest items, then the lowest index). Deterministic."""
    load = [(0, 0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(items, key=lambda i: (-sizes[i], i)):
        tokens, count, b = min(load)
        out[b].append(i)
        load[b] = (tokens + sizes[i], count + 1, b)
    return [sorted(b) for b in out]


def _ffd(items: Sequence[int], sizes: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: few bins of at most `budget` (at most 11/9 of the fewest possible + 1)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(items, key=lambda i: (-sizes[i], i)):
        b = next((b for b, free in enumerate(room) if free >= sizes[i]), None)
        if b is None:
            bins.append([])
            room.append(budget)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= sizes[i]
    return [sorted(b) for b in bins]


def _split_to(bins: list[list[int]], count: int, sizes: Sequence[int]) -> list[list[int]]:
    """Split the fullest splittable bins in two (LPT) until there are `count` (or none can be split)."""
    bins = list(bins)
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        fullest = max(splittable, key=lambda b: (sum(sizes[i] for i in b), -b[0]))
        bins.remove(fullest)
        bins.extend(_lpt(fullest, sizes, 2))
    return bins


def plan_packed(lengths: Sequence[int], *, dp: int, max_tokens: int, micro_batch_multiple: int = 1,
                multiple: int = 1) -> MicroBatchPlan:
    """Token-budget micro-batches, balanced over `dp` replicas; see the module docstring. The
    number of micro-batches of a replica is a multiple of `micro_batch_multiple` (the interleaved
    schedule needs a multiple of pp) unless the replica has fewer rows.

    Every row must fit the budget alone (the caller checks the configured lengths against it
    and names the fix)."""
    lengths = tuple(int(x) for x in lengths)
    too_long = max(lengths, default=0)
    if too_long > max_tokens:
        raise ValueError(f"a sequence of {too_long} tokens does not fit max_tokens_per_micro_batch={max_tokens}")
    per_replica = _lpt(range(len(lengths)), lengths, dp)
    k = _round_up(max(len(_ffd(rows, lengths, max_tokens)) for rows in per_replica), micro_batch_multiple)
    replicas = []
    for rows in per_replica:
        bins = _lpt(rows, lengths, min(k, max(len(rows), 1)))  # k about equally full micro-batches
        if any(sum(lengths[i] for i in mb) > max_tokens for mb in bins):
            bins = _split_to(_ffd(rows, lengths, max_tokens), k, lengths)  # fewest that fit, then split to k
        replicas.append(bins)
    ordered = tuple(tuple(tuple(mb) for mb in sorted((mb for mb in rep if mb), key=lambda mb: mb[0]))
                    for rep in replicas)
    padded = tuple(_round_up(max((sum(lengths[i] for i in mb) for mb in rep), default=0), multiple)
                   for rep in ordered)
    return MicroBatchPlan(packed=True, replicas=ordered, lengths=lengths, padded_lengths=padded)


def plan_padded(lengths: Sequence[int], *, dp: int, micro_batch_size: int, total_length: int) -> MicroBatchPlan:
    """Contiguous DP shards in micro-batches of `micro_batch_size` rows, each padded to T."""
    n = len(lengths)
    if n % dp:
        raise ValueError(f"a batch of {n} samples does not split over dp={dp} replicas")
    per = n // dp
    if per % micro_batch_size:
        raise ValueError(f"{per} sequences per replica do not split into micro-batches of {micro_batch_size}; "
                         "choose a micro_batch_size that divides the per-replica batch")
    replicas = tuple(tuple(tuple(range(s, s + micro_batch_size)) for s in range(r * per, (r + 1) * per, micro_batch_size))
                     for r in range(dp))
    return MicroBatchPlan(packed=False, replicas=replicas, lengths=tuple(int(x) for x in lengths),
                          padded_lengths=(total_length,) * dp)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def micro_batch_tensors(plan: MicroBatchPlan, dp_rank: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        prompt_len: int, *, select: Select, per_row: dict[str, torch.Tensor | None],
                        pad_id: int = 0, routes: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> list[dict[str, torch.Tensor]]:
    """One replica's micro-batches as model inputs; see the module docstring. `per_row` tensors
    ([N, ...], None skipped) are indexed by each micro-batch's rows. `routes`: ([N, T, L, k] expert
    ids, [N, T, L] known) MoE routing records, laid out as 'routes' [t, L, k] and 'routes_known'
    [t, L] in the order the routers see the micro-batch's t tokens (routing replay)."""
    p_len, r_len = sequence_lengths(attention_mask, prompt_len)
    if plan.packed and bool((p_len[[i for mb in plan.micro_batches(dp_rank) for i in mb]] < 1).any()):
        raise ValueError("a sequence has no prompt token; every prompt needs at least one token")
    out = []
    for rows in plan.micro_batches(dp_rank):
        idx = torch.tensor(rows, dtype=torch.long)
        if plan.packed:
            mb = _packed(input_ids, prompt_len, p_len, r_len, rows, plan.padded_lengths[dp_rank], select, pad_id)
        else:
            mb = _padded(input_ids, attention_mask, prompt_len, p_len, r_len, idx, select)
        mb["rows"] = idx
        mb.update({k: v[idx] for k, v in per_row.items() if v is not None})
        if routes is not None:
            mb["routes"], mb["routes_known"] = _routes(plan, dp_rank, routes, prompt_len, p_len, r_len, rows)
        out.append(mb)
    return out


def _packed(input_ids, prompt_len, p_len, r_len, rows, length, select, pad_id) -> dict[str, torch.Tensor]:
    pieces, positions, starts = [], [], []
    start = 0
    for i in rows:
        p, r = int(p_len[i]), int(r_len[i])
        pieces.append(input_ids[i, prompt_len - p:prompt_len + r])
        positions.append(torch.arange(p + r))
        starts.append(start)
        start += p + r
    pad = length - start
    ids = torch.cat(pieces + [input_ids.new_full((pad,), pad_id)])
    pos = torch.cat(positions + [torch.arange(pad)])
    bounds = starts + [start] + ([length] if pad else [])
    cu = torch.tensor(bounds, dtype=torch.int32)
    s_idx, place = _selection([starts[j] + int(p_len[i]) for j, i in enumerate(rows)],
                              [int(r_len[i]) for i in rows], select)
    return {"input_ids": ids[None], "position_ids": pos[None], "cu_seqlens": cu,
            "select": torch.stack([s_idx, torch.zeros_like(s_idx)]), "place": place}


def _routes(plan, dp_rank, routes, prompt_len, p_len, r_len, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row records -> the router's token order: the packed tokens in order (padding gets
    experts 0..k-1, unknown), or [T, b] flattened s-major for a padded micro-batch."""
    ids, known = routes
    if not plan.packed:
        idx = torch.tensor(rows, dtype=torch.long)
        return (ids[idx].transpose(0, 1).reshape(-1, *ids.shape[2:]),
                known[idx].transpose(0, 1).reshape(-1, *known.shape[2:]))
    spans = [slice(prompt_len - int(p_len[i]), prompt_len + int(r_len[i])) for i in rows]
    pad = plan.padded_lengths[dp_rank] - sum(s.stop - s.start for s in spans)
    filler = torch.arange(ids.shape[-1], dtype=ids.dtype).expand(pad, *ids.shape[2:])
    return (torch.cat([ids[i, s] for i, s in zip(rows, spans)] + [filler]),
            torch.cat([known[i, s] for i, s in zip(rows, spans)] + [known.new_zeros((pad, *known.shape[2:]))]))


def _padded(input_ids, attention_mask, prompt_len, p_len, r_len, idx, select) -> dict[str, torch.Tensor]:
    r_rows = r_len[idx].tolist()
    s_idx, place = _selection([prompt_len] * len(r_rows), r_rows, select)
    return {"input_ids": input_ids[idx], "attention_mask": attention_mask[idx],
            "select": torch.stack([s_idx, place[0]]), "place": place}


def _selection(response_starts: list[int], response_lens: list[int], select: Select
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """([K] sequence positions, [2, K] (row, column) places) of the selected outputs.
    'response': the state before each response token (position start - 1 + j predicts token j);
    'last': each sequence's last token (its last response token)."""
    if select == "last":
        s = torch.tensor([st + r - 1 for st, r in zip(response_starts, response_lens)], dtype=torch.long)
        rows = torch.arange(len(s))
        return s, torch.stack([rows, torch.zeros_like(rows)])
    s = torch.cat([torch.arange(st - 1, st - 1 + r) for st, r in zip(response_starts, response_lens)]
                  + [torch.zeros(0, dtype=torch.long)])
    rows = torch.cat([torch.full((r,), j, dtype=torch.long) for j, r in enumerate(response_lens)]
                     + [torch.zeros(0, dtype=torch.long)])
    cols = torch.cat([torch.arange(r) for r in response_lens] + [torch.zeros(0, dtype=torch.long)])
    return s, torch.stack([rows, cols])


@dataclasses.dataclass(frozen=True)
class MicroBatching:
    """How one role splits a pass into micro-batches: packed by a token budget, or padded."""

    packed: bool = True
    max_tokens: int = 4096  # packed: tokens per micro-batch (one sequence must fit)
    micro_batch_size: int = 4  # padded: sequences per micro-batch
    micro_batch_multiple: int = 1  # packed: micro-batches per replica come in multiples of this (VPP: pp)
    multiple: int = 1  # packed lengths are rounded up to a multiple of this

    def plan(self, attention_mask: torch.Tensor, prompt_len: int, dp: int) -> MicroBatchPlan:
        """[N, T] mask -> the plan for these N sequences over `dp` replicas."""
        p, r = sequence_lengths(attention_mask, prompt_len)
        lengths = (p + r).tolist()
        if self.packed:
            return plan_packed(lengths, dp=dp, max_tokens=self.max_tokens,
                               micro_batch_multiple=self.micro_batch_multiple, multiple=self.multiple)
        return plan_padded(lengths, dp=dp, micro_batch_size=self.micro_batch_size,
                           total_length=attention_mask.shape[1])


@dataclasses.dataclass
class PassCounter:
    """Tokens and micro-batches of the passes since the last `take()` (all replicas)."""

    real_tokens: int = 0
    computed_tokens: int = 0
    micro_batches: int = 0

    def add(self, plan: MicroBatchPlan) -> None:
        self.real_tokens += plan.real_tokens
        self.computed_tokens += plan.computed_tokens
        self.micro_batches += plan.num_micro_batches

    def take(self) -> "PassCounter":
        taken = dataclasses.replace(self)
        self.real_tokens = self.computed_tokens = self.micro_batches = 0
        return taken
