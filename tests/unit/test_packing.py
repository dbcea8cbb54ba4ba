"""Token-budget micro-batch plans and packed tensors (megappo.parallel.packing), without models."""

import itertools
import math

import pytest
import torch

from megappo.parallel.packing import (
    MicroBatching, PassCounter, micro_batch_tensors, plan_packed, plan_padded, sequence_lengths,
)


def lengths_of(seed, n=64, low=3, high=60):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=gen).tolist()


@pytest.mark.parametrize("dp,budget,seed", itertools.product((1, 2, 4), (60, 128, 500), (0, 1)))
def test_plan_covers_every_row_once_within_budget_and_balanced(dp, budget, seed):
    lengths = lengths_of(seed)
    plan = plan_packed(lengths, dp=dp, max_tokens=budget)
    rows = [i for rep in plan.replicas for mb in rep for i in mb]
    assert sorted(rows) == list(range(len(lengths)))
    for rep in plan.replicas:
        for mb in rep:
            assert list(mb) == sorted(mb) and sum(lengths[i] for i in mb) <= budget
    counts = [len(rep) for rep in plan.replicas]
    assert max(counts) == min(counts)  # every replica runs the same number of micro-batches
    tokens = [sum(lengths[i] for mb in rep for i in mb) for rep in plan.replicas]
    assert max(tokens) - min(tokens) <= max(lengths)  # LPT: within one sequence of each other
    # few micro-batches: fewer than twice the fewest possible (every packing where no two
    # micro-batches would fit together has that bound; first-fit decreasing does better)
    assert max(counts) <= 2 * math.ceil(max(tokens) / budget) + 1
    assert plan == plan_packed(lengths, dp=dp, max_tokens=budget)  # deterministic


def test_plan_counts_padding_and_rounds_lengths():
    lengths = [5, 9, 3, 7, 2, 6]
    plan = plan_packed(lengths, dp=2, max_tokens=12, multiple=4)
    assert plan.real_tokens == sum(lengths)
    assert all(length % 4 == 0 for length in plan.padded_lengths)
    assert plan.computed_tokens == sum(len(rep) * length for rep, length in zip(plan.replicas, plan.padded_lengths))
    padded = plan_padded(lengths, dp=2, micro_batch_size=3, total_length=16)
    assert padded.computed_tokens == 6 * 16 and padded.num_micro_batches == 2
    counter = PassCounter()
    counter.add(plan)
    counter.add(padded)
    taken = counter.take()
    assert taken.real_tokens == 2 * sum(lengths) and taken.micro_batches == plan.num_micro_batches + 2
    assert counter.real_tokens == counter.computed_tokens == counter.micro_batches == 0


def test_plan_micro_batch_multiple_for_the_interleaved_schedule():
    plan = plan_packed(lengths_of(3, n=40), dp=2, max_tokens=300, micro_batch_multiple=4)
    assert all(len(rep) % 4 == 0 for rep in plan.replicas)


def test_plan_refuses_a_row_longer_than_the_budget():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=10"):
        plan_packed([4, 11, 3], dp=1, max_tokens=10)


def test_sequence_lengths_keep_inner_masked_positions():
    attn = torch.tensor([[0, 1, 1, 1, 1, 0, 0],    # prompt 2, response 2
                         [1, 1, 1, 1, 0, 1, 0],    # prompt 3, response 3 (an observation inside)
                         [0, 0, 1, 0, 0, 0, 0]])   # prompt 1, no response
    p, r = sequence_lengths(attn, prompt_len=3)
    assert p.tolist() == [2, 3, 1] and r.tolist() == [2, 3, 0]


def test_packed_tensors_select_the_positions_before_each_response_token():
    P, R = 3, 3
    ids = torch.tensor([[0, 11, 12, 21, 22, 0],
                        [13, 14, 15, 23, 0, 0],
                        [0, 0, 16, 24, 25, 26]])
    attn = (ids != 0).long()
    resp = attn[:, P:]
    plan = MicroBatching(packed=True, max_tokens=8).plan(attn, P, dp=1)
    mbs = micro_batch_tensors(plan, 0, ids, attn, P, select="response", per_row={"response_mask": resp})
    for mb in mbs:
        flat = mb["input_ids"][0]
        assert len(flat) == plan.padded_lengths[0]
        labels = flat[mb["select"][0] + 1]
        # each selected position predicts the response token at its place
        want = ids[mb["rows"][mb["place"][0]], P + mb["place"][1]]
        assert torch.equal(labels, want)
        # positions restart at 0 in every sequence
        starts = mb["cu_seqlens"][:-1].long()
        assert (mb["position_ids"][0, starts] == 0).all()
    last = micro_batch_tensors(plan, 0, ids, attn, P, select="last", per_row={})
    for mb in last:
        tokens = mb["input_ids"][0, mb["select"][0]]
        rows = mb["rows"]
        want = torch.stack([ids[i][attn[i].bool()][-1] for i in rows.tolist()])
        assert torch.equal(tokens, want)


def test_rope_is_translation_invariant_but_positions_restart_anyway():
    """The claim behind packing without a position reset, checked: rotating q and k by the same
    offset leaves q.k unchanged (to float32 precision for small offsets, drifting for large ones,
    which is why packed passes give every sequence its own positions from 0). RoPE as Llama and
    Megatron-Core's RotaryEmbedding compute it: angles pos * base^(-2i/d), halves rotated."""
    d = 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, d, generator=gen), torch.randn(6, d, generator=gen)

    def rotate(x, positions):
        angles = positions.float()[:, None] * inv_freq[None]
        emb = torch.cat([angles, angles], -1)
        half = torch.cat([-x[:, d // 2:], x[:, :d // 2]], -1)
        return x * emb.cos() + half * emb.sin()

    def scores(offset):
        pos = torch.arange(offset, offset + 6)
        return rotate(q, pos) @ rotate(k, pos).T

    small, large = (scores(7) - scores(0)).abs().max(), (scores(40000) - scores(0)).abs().max()
    assert small < 1e-5
    assert large > 1e-5 and large > 10 * small
