"""RoPE of packed sequences (megappo.models.packed_rope) against Megatron-Core's own function.

Bit for bit (values and the gradient of the input) over packs of one and several sequences, an empty
sequence, the table sized to the pack (Megatron's exact-offset mapping), interleaved rotation, an mscale,
fp32 and bf16; with no device value read on the host (it runs on the meta device, where a read fails;
Megatron's reads the lengths there, and on a GPU each read is a synchronization); and it is what models
built by megappo run.
"""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megappo.models import packed_rope
from megappo.models.packed_rope import thd_rope


class OneRank:  # a context-parallel group of one rank: all either function asks of it
    def size(self):
        return 1

    def rank(self):
        return 0


def freqs_table(rows, dim, seed):
    angles = torch.rand(rows, dim // 2, generator=torch.Generator().manual_seed(seed)) * 6
    return torch.cat([angles, angles], -1).view(rows, 1, 1, dim)  # Megatron's layout: [rows, 1, 1, d]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths, table", [
    ([7], 7),  # one sequence filling the table: Megatron's exact-offset mapping (= positions 0..6)
    ([5, 3, 9], 9),  # several sequences, the table as long as the longest (what GPTModel builds)
    ([4, 0, 6, 2], 16),  # an empty sequence, a longer table
    ([3, 4, 5], 12),  # the table exactly as long as the pack: the exact-offset mapping, positions run on
])
def test_equals_megatron_bit_for_bit(dtype, lengths, table):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens, heads, dim = int(cu[-1]), 3, 8
    gen = torch.Generator().manual_seed(len(lengths))
    freqs = freqs_table(table, dim, seed=tokens)
    for interleaved in (False, True):
        for mscale in (1.0, 1.3):
            kwargs = dict(rotary_interleaved=interleaved, multi_latent_attention=False, mscale=mscale,
                          cp_group=OneRank())
            t = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
            mine, theirs = t.clone().requires_grad_(), t.clone().requires_grad_()
            got = thd_rope(mine, cu, freqs, **kwargs)
            want = packed_rope.megatron_thd()(theirs, cu, freqs, **kwargs)
            assert got.dtype == want.dtype and torch.equal(got, want)
            grad = torch.randn(want.shape, generator=gen).to(dtype)
            got.backward(grad)
            want.backward(grad)
            assert torch.equal(mine.grad, theirs.grad)


def test_reads_nothing_back_from_the_device():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device="meta")
    t, freqs = torch.empty(5, 2, 8, device="meta"), torch.empty(5, 1, 1, 8, device="meta")
    assert thd_rope(t, cu, freqs, cp_group=OneRank()).shape == (5, 2, 8)
    with pytest.raises(NotImplementedError, match="meta"):  # what the replacement saves: Megatron's reads
        packed_rope.megatron_thd()(t, cu, freqs, cp_group=OneRank())


def test_positions():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    assert packed_rope.packed_positions(cu, 5, table=8).tolist() == [0, 1, 2, 0, 1]
    assert packed_rope.packed_positions(cu, 5, table=5).tolist() == [0, 1, 2, 3, 4]


def test_models_built_by_megappo_run_it():
    from megappo.models.builders import build_model  # noqa: F401 - building installs it; importing does not

    packed_rope.install()
    assert rope_utils._apply_rotary_pos_emb_thd is thd_rope
    assert "packed_rope.install()" in open(build_model.__code__.co_filename).read()
