"""Context parallelism's pure pieces (megappo.parallel.context), in one process: the load-balanced split,
each token's RoPE position against Megatron's CP RoPE, the gather of selected outputs back into the
selection's order, and attention of a rank's chunks against whole sequences against per-sequence SDPA.
The multi-rank passes against CP=1 are tests/distributed/test_context_parallel.py."""

import pytest
import torch

from megappo.models import packed_rope
from megappo.models.attention_dispatch import causal_attention_at, per_sequence_sdpa
from megappo.parallel import context

# sequences of 2 to 11 tokens (shorter than 2 x cp, odd, even), a padding tail of 3
BOUNDS = [0, 2, 8, 18, 25, 36, 39]


def test_the_docstrings_example_rank_i_holds_chunks_i_and_2cp_minus_1_minus_i():
    padded = context.padded_bounds([0, 6], 2)
    assert padded == [0, 8]
    assert context.rank_tokens(padded, 2, 0) == [0, 1, 6, 7]
    assert context.rank_tokens(padded, 2, 1) == [2, 3, 4, 5]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_padded_position_is_on_exactly_one_rank_and_every_sequence_padded_to_2cp(cp):
    length = context.pass_length([BOUNDS], cp, multiple=2)
    padded = context.padded_bounds(BOUNDS, cp, length)
    assert length % (2 * cp * 2) == 0 and padded[-1] == length
    assert all((b - a) % (2 * cp) == 0 and b > a for a, b in zip(padded[:-1], padded[1:]))
    for (a, b), (pa, pb) in zip(zip(BOUNDS[:-1], BOUNDS[1:]), zip(padded[:-1], padded[1:])):
        assert b - a <= pb - pa < b - a + 2 * cp  # each sequence keeps its tokens, padded at its end by < 2cp
    held = [context.rank_tokens(padded, cp, r) for r in range(cp)]
    assert all(len(h) == length // cp for h in held)
    assert sorted(sum(held, [])) == list(range(length))


@pytest.mark.parametrize("cp", [2, 3])
def test_local_positions_are_each_tokens_position_in_its_padded_sequence(cp):
    padded = context.padded_bounds(BOUNDS, cp, context.pass_length([BOUNDS], cp))
    cu = torch.tensor(padded, dtype=torch.int32)
    for rank in range(cp):
        tokens = context.rank_tokens(padded, cp, rank)
        starts = [max(a for a in padded[:-1] if a <= t) for t in tokens]
        want = torch.tensor([t - s for t, s in zip(tokens, starts)])
        assert torch.equal(context.local_positions(cu, cp, rank, len(tokens)), want)


class _Group:
    """What RoPE reads of a CP group: its size and this rank."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("exact_table", [False, True])
def test_cp_rope_equals_megatrons_thd_rope_on_every_rank(exact_table):
    cp = 2
    padded = context.padded_bounds(BOUNDS, cp, context.pass_length([BOUNDS], cp))
    cu = torch.tensor(padded, dtype=torch.int32)
    rows = padded[-1] if exact_table else max(b - a for a, b in zip(padded[:-1], padded[1:]))
    gen = torch.Generator().manual_seed(0)
    freqs = torch.randn(rows, 1, 1, 8, generator=gen)
    for rank in range(cp):
        t = torch.randn(padded[-1] // cp, 3, 8, generator=gen)
        group = _Group(cp, rank)
        ours = packed_rope.thd_rope(t, cu, freqs, cp_group=group)
        megatrons = packed_rope.megatron_thd()(t, cu, freqs, cp_group=group)
        assert torch.equal(ours, megatrons)


def test_split_puts_each_token_on_its_rank_and_gathers_the_selection_back_in_order():
    cp = 2
    ids = torch.arange(100, 100 + BOUNDS[-1])[None]
    select = torch.tensor([1, 3, 4, 5, 6, 7, 17, 30, 0])  # any positions, any order
    length = context.pass_length([BOUNDS], cp)
    split = context.split(BOUNDS, select, cp, length)
    assert torch.equal(split.cu_seqlens, torch.tensor(context.padded_bounds(BOUNDS, cp, length), dtype=torch.int32))
    outputs = []
    for rank in range(cp):
        local = split.local_input_ids(ids, rank, pad_id=-1)[0]
        assert local.shape == (length // cp,)
        mine = local[split.local_select(rank)[0]]  # the "model output" at this rank's selected tokens
        outputs.append(mine)
    real = torch.cat([split.local_input_ids(ids, r, pad_id=-1)[0] for r in range(cp)])
    assert sorted(real[real >= 0].tolist()) == ids[0].tolist()  # every real token once, padding aside
    gathered = torch.cat(outputs).index_select(0, split.order)  # what the all-gather then `order` makes
    assert torch.equal(gathered, ids[0, select])


def test_gathered_gradient_goes_to_each_ranks_own_positions_only():
    """The all-gather's backward in one process: a group of one whose 'rank' holds every position
    gets the whole gradient, in the selection's order."""
    dist = torch.distributed
    created = not dist.is_initialized()  # (another test of this process may have made its world of one)
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        select = torch.tensor([5, 2, 9])
        split = context.split([0, 12], select, 1, context.pass_length([[0, 12]], 1))
        x = torch.randn(1, 3, 4, requires_grad=True)
        out = context.gather_selected(x, split, torch.distributed.group.WORLD)
        assert torch.equal(out, x.index_select(1, split.order))
        grad = torch.randn_like(out)
        out.backward(grad)
        want = torch.zeros_like(x).index_copy(1, split.order, grad)
        assert torch.equal(x.grad, want)
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 3])
def test_a_ranks_chunks_attend_like_their_rows_of_whole_sequence_attention(cp):
    length = context.pass_length([BOUNDS], cp)
    padded = context.padded_bounds(BOUNDS, cp, length)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(length, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(length, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    whole = per_sequence_sdpa(q, k, v, padded, scale=0.3)
    for rank in range(cp):
        tokens = torch.tensor(context.rank_tokens(padded, cp, rank))
        cu = torch.tensor(padded, dtype=torch.int32)
        positions = context.local_positions(cu, cp, rank, len(tokens))
        seen = context.keys_seen(padded, cp, rank)
        assert seen == [max(t - a for t in tokens.tolist() if a <= t < b) + 1 for a, b in zip(padded[:-1], padded[1:])]
        out = causal_attention_at(q[tokens], k, v, context.local_bounds(padded, cp), padded, positions, seen,
                                  scale=0.3)
        torch.testing.assert_close(out, whole[tokens], rtol=1e-12, atol=1e-12)


def test_a_mixture_of_experts_model_with_context_parallelism_is_refused_before_any_rank_starts():
    from megappo.config import config_from_dict
    from megappo.models.hf_config import ModelConfigError
    from megappo.models.hf_reference import TINY_CONFIGS
    from megappo.trainer.preflight import check_models

    cfg = config_from_dict({"model": {"hf_config": TINY_CONFIGS["qwen3_moe"]}, "critic": {"parallel": {"cp": 2}}})
    with pytest.raises(ModelConfigError, match=r"mixture-of-experts model, and critic.parallel.cp=2: context "
                                               r"parallelism with MoE is not supported yet .*Fix: set "
                                               r"critic.parallel.cp=1"):
        check_models(cfg)
    check_models(config_from_dict({"model": {"hf_config": TINY_CONFIGS["llama"]}, "parallel": {"cp": 2}}))


def test_a_micro_batch_with_nothing_selected_splits_to_empty_selections():
    split = context.split(BOUNDS, torch.zeros(0, dtype=torch.long), 2, context.pass_length([BOUNDS], 2))
    assert split.select.shape == (2, 0) and split.order.shape == (0,)
    assert split.local_select(1).shape == (2, 0)
