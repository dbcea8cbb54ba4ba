"""torchrun worker (2 ranks): vocab-parallel log-probs and entropy vs the full vocabulary.

The full logits [B, T, V] are the same on both ranks; each rank keeps its half of the
vocabulary. Values and gradients (of a weighted sum of both outputs) must equal the
full-vocab computation, including -inf logits for masked vocabulary padding.
"""

import torch
import torch.distributed as dist

from megappo.parallel.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs
from megappo.ppo.losses import entropy_from_logits, log_probs_from_logits


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    B, T, V = 3, 5, 16
    full = torch.randn(B, T, V, generator=gen) * 3
    full[..., -2:] = float("-inf")  # padded vocabulary rows
    labels = torch.randint(0, V - 2, (B, T), generator=gen)
    w1, w2 = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)

    ref_in = full.clone().requires_grad_()
    ref_lp, ref_ent = log_probs_from_logits(ref_in, labels), entropy_from_logits(ref_in.masked_fill(torch.isinf(ref_in), -1e30))
    ((ref_lp * w1).sum() + (ref_ent * w2).sum()).backward()

    per = V // world
    shard = full[..., rank * per:(rank + 1) * per].clone().requires_grad_()
    group = dist.group.WORLD
    lp, ent = vocab_parallel_log_probs(shard, labels, group), vocab_parallel_entropy(shard, group)
    ((lp * w1).sum() + (ent * w2).sum()).backward()

    assert (lp - ref_lp).abs().max() < 1e-5, (lp - ref_lp).abs().max()
    assert (ent - ref_ent).abs().max() < 1e-5, (ent - ref_ent).abs().max()
    grad_ref = ref_in.grad[..., rank * per:(rank + 1) * per]
    diff = (shard.grad - grad_ref).abs().max().item()
    assert diff < 1e-5, diff
    assert torch.isfinite(shard.grad).all()
    print(f"OK rank {rank} logprob/entropy values and grads match full vocab (grad diff {diff:.1e})", flush=True)


if __name__ == "__main__":
    main()
