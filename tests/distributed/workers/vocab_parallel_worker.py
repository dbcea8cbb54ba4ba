"""torchrun worker (2 ranks, gloo): vocab-parallel log-probs and entropy vs the full vocabulary.

Every rank builds the same full logits [B, T, V] and keeps its slice [B, T, V/2] of the
vocabulary. Values and gradients (of random weighted sums of the outputs) must equal the
full-vocab computation of megappo.ppo.losses within 1e-6 in float32, including -inf logits
for vocabulary padding and a rank whose whole slice is padding. Every case runs twice: in
one block, and in blocks of one token (block_elements = the shard's width), whose per-block
all-reduces must give the same values and gradients bit for bit.
"""

import functools

import torch
import torch.distributed as dist

from megappo.parallel.vocab_parallel import (
    vocab_parallel_entropy, vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy,
)
from megappo.ppo.losses import entropy_from_logits, log_probs_from_logits

TOL = 1e-6


def full_vocab(full, labels, w_lp, w_ent):
    x = full.clone().requires_grad_()
    lp, ent = log_probs_from_logits(x, labels), entropy_from_logits(x)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def check(name, full, labels, group, rank, world, gen, block_elements=None):
    B, T, V = full.shape
    per = V // world
    w_lp, w_ent = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    ref_lp, ref_ent, ref_grad = full_vocab(full, labels, w_lp, w_ent)
    ref_grad = ref_grad[..., rank * per:(rank + 1) * per]
    ref_lp_grad = full_vocab(full, labels, w_lp, torch.zeros_like(w_ent))[2][..., rank * per:(rank + 1) * per]
    ref_ent_grad = full_vocab(full, labels, torch.zeros_like(w_lp), w_ent)[2][..., rank * per:(rank + 1) * per]

    def shard():
        return full[..., rank * per:(rank + 1) * per].clone().requires_grad_()

    def blocks(fn):
        return functools.partial(fn, block_elements=block_elements)

    errors = {}
    x = shard()  # both outputs of one call
    lp, ent = blocks(vocab_parallel_log_probs_and_entropy)(x, labels, group)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    errors["lp"] = (lp - ref_lp).abs().max().item()
    errors["ent"] = (ent - ref_ent).abs().max().item()
    errors["grad"] = (x.grad - ref_grad).abs().max().item()
    x = shard()  # separate calls, each output's gradient alone
    lp = blocks(vocab_parallel_log_probs)(x, labels, group)
    (lp * w_lp).sum().backward()
    errors["lp alone"] = (lp - ref_lp).abs().max().item()
    errors["lp grad"] = (x.grad - ref_lp_grad).abs().max().item()
    x = shard()
    ent = blocks(vocab_parallel_entropy)(x, group)
    (ent * w_ent).sum().backward()
    errors["ent alone"] = (ent - ref_ent).abs().max().item()
    errors["ent grad"] = (x.grad - ref_ent_grad).abs().max().item()
    x = shard()  # only the entropy of a joint call carries gradient
    _, ent = blocks(vocab_parallel_log_probs_and_entropy)(x, labels, group)
    (ent * w_ent).sum().backward()
    errors["joint, ent grad only"] = (x.grad - ref_ent_grad).abs().max().item()

    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"rank {rank} {name}: errors above {TOL}: {bad}"
    print(f"OK rank {rank} {name}: max error {max(errors.values()):.1e}", flush=True)
    return lp.detach(), ent.detach(), x.grad


def check_blocked(name, full, labels, group, rank, world, gen):
    """`check` in one block and in one-token blocks, from the same weights: equal bit for bit."""
    state = gen.get_state()
    whole = check(name, full, labels, group, rank, world, gen)
    gen.set_state(state)
    per_token = check(f"{name}, one-token blocks", full, labels, group, rank, world, gen,
                      block_elements=full.shape[-1] // world)
    assert all(torch.equal(a, b) for a, b in zip(whole, per_token)), f"rank {rank} {name}: blocks changed a bit"


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    tp_group = dist.new_group(list(range(world)))  # an explicit group, as ParallelState hands out
    gen = torch.Generator().manual_seed(0)  # same numbers on every rank
    B, T, V = 3, 7, 16

    full = torch.randn(B, T, V, generator=gen) * 2
    labels = torch.randint(0, V, (B, T), generator=gen)
    check_blocked("random logits, labels on both shards", full, labels, tp_group, rank, world, gen)

    full = torch.randn(B, T, V, generator=gen) * 2
    full[..., -3:] = float("-inf")  # vocabulary padding on the last shard
    labels = torch.randint(0, V - 3, (B, T), generator=gen)
    check_blocked("-inf padding rows", full, labels, tp_group, rank, world, gen)

    full = torch.randn(B, T, V, generator=gen)
    full[..., V // 2:] = float("-inf")  # rank 1's whole slice is padding
    labels = torch.randint(0, V // 2, (B, T), generator=gen)
    check_blocked("a shard of padding only", full, labels, tp_group, rank, world, gen)

    full = torch.randn(B, T, V, generator=gen) * 30  # peaked distributions, large logits
    labels = torch.randint(0, V, (B, T), generator=gen)
    check_blocked("large logits", full, labels, tp_group, rank, world, gen)

    x = full[..., rank * (V // 2):(rank + 1) * (V // 2)].to(torch.bfloat16).requires_grad_()
    lp, ent = vocab_parallel_log_probs_and_entropy(x, labels, tp_group)
    (lp.sum() + ent.sum()).backward()
    assert lp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()
    print(f"OK rank {rank} bf16 shard: float32 outputs, bf16 gradient", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
