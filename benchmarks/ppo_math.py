#!/usr/bin/env python
"""PPO math on CPU: megappo's fast paths against the plain references, in the same run.

    OMP_NUM_THREADS=1 python benchmarks/ppo_math.py [--batch 256 --length 4096 --repeats 5]

Inputs are a realistic [B, T] batch: responses of random length, left padding on some
rows, right padding on the rest, and a masked tool-output span in a quarter of the rows.
Rows measured (median wall time of --repeats runs after one warm-up):
  * GAE raw advantages: `gae_fast` (vectorised masked discounted scan in float64) vs
    `gae_reference` (verl's reverse loop over T with vector ops over B);
  * REINFORCE++ returns: the same scan vs verl's reverse loop;
  * full `compute_gae_advantage_return` (fast scan + whitening) vs loop + whitening;
  * policy loss forward + backward (token-mean, with dual-clip): `policy_loss` (closed
    form) vs `policy_loss_reference` (verl's step-by-step form);
  * log-probs + entropy from logits, forward + backward, at --logits-shape (the actor's
    update at 8 sequences x 512 response tokens x 8192 vocabulary by default):
    `vocab_parallel_log_probs_and_entropy` in cache-sized blocks (the default) vs the same
    function in one block, i.e. one pass over the whole tensor.
Each row also prints the largest difference between the two results. If a fast path is
not faster, the table says so; nothing is tuned for the benchmark.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def make_batch(B: int, L: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, L)
    lengths = torch.randint(L // 8, L + 1, (B,), generator=gen)
    for b in range(B):
        n = int(lengths[b])
        if b % 2:  # left padding
            mask[b, L - n:] = 1
        else:  # right padding
            mask[b, :n] = 1
        if b % 4 == 0 and n > 64:  # a tool-output span inside the response
            mask[b, n // 3:n // 3 + 32] = 0
    rewards = torch.zeros(B, L)
    last = L - 1 - mask.flip(1).argmax(1)
    rewards[torch.arange(B), last] = torch.randn(B, generator=gen)
    values = torch.randn(B, L, generator=gen)
    old = -torch.rand(B, L, generator=gen) * 3
    new = old + torch.randn(B, L, generator=gen) * 0.3
    adv = torch.randn(B, L, generator=gen)
    return mask, rewards, values, old, new, adv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--logits-shape", type=int, nargs=3, default=[8, 512, 8192], metavar=("B", "R", "V"))
    args = p.parse_args()

    import torch

    from megappo.ppo.advantages import (
        compute_gae_advantage_return, gae_fast, gae_reference, masked_discounted_scan,
        reinforce_plus_plus_returns_reference,
    )
    from megappo.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy
    from megappo.ppo.losses import LossInputs, policy_loss, policy_loss_reference
    from megappo.ppo.stats import masked_whiten

    B, L, g, lam = args.batch, args.length, args.gamma, args.lam
    mask, rewards, values, old, new, adv = make_batch(B, L)
    rows = []

    def row(what, fast, ref, diff_fn):
        (t_fast, out_fast), (t_ref, out_ref) = timed(fast, args.repeats), timed(ref, args.repeats)
        rows.append((what, t_fast, t_ref, diff_fn(out_fast, out_ref)))

    def max_diff(a, b):
        return (a - b).abs().max().item()

    row(f"GAE raw advantages (gamma={g}, lam={lam})",
        lambda: gae_fast(rewards, values, mask, g, lam), lambda: gae_reference(rewards, values, mask, g, lam),
        max_diff)
    row(f"REINFORCE++ returns (gamma={g})",
        lambda: masked_discounted_scan(rewards, mask, g).float() * mask,
        lambda: reinforce_plus_plus_returns_reference(rewards, mask, g), max_diff)
    row("GAE advantages + returns (with whitening)",
        lambda: compute_gae_advantage_return(rewards, values, mask, g, lam),
        lambda: (masked_whiten(gae_reference(rewards, values, mask, g, lam), mask), None),
        lambda a, b: max_diff(a[0], b[0]))

    def pg(fn):
        def run():
            x = new.clone().requires_grad_()
            loss, metrics = fn(LossInputs(old, x, adv, mask), clip_ratio_low=0.2, clip_ratio_high=0.28,
                               clip_ratio_c=3.0)
            loss.backward()
            return loss.detach(), x.grad, metrics
        return run

    row("policy loss forward + backward (token-mean)", pg(policy_loss), pg(policy_loss_reference),
        lambda a, b: max(abs(a[0].item() - b[0].item()), max_diff(a[1], b[1]),
                         *(abs(a[2][k].item() - b[2][k].item()) for k in a[2])))

    lb, lr, lv = args.logits_shape
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(lb, lr + 1, lv, generator=gen) * 3  # response positions + the last prompt one
    labels = torch.randint(0, lv, (lb, lr), generator=gen)
    w_lp, w_ent = torch.randn(lb, lr, generator=gen), torch.randn(lb, lr, generator=gen)

    def stats(block_elements):
        def run():
            x = logits.clone().requires_grad_()
            lp, ent = vocab_parallel_log_probs_and_entropy(x[:, :-1], labels, block_elements=block_elements)
            ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
            return lp, ent, x.grad
        return run

    row(f"log-probs+entropy fwd+bwd {lb}x{lr}x{lv}, blocks", stats(None), stats(1 << 62),
        lambda a, b: max(max_diff(u, v) for u, v in zip(a, b)))

    print(f"B={B} T={L} ({int(mask.sum())} valid tokens), torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}, median of {args.repeats} after a warm-up")
    print(f"{'what':46s} {'fast ms':>9s} {'ref ms':>9s} {'speed-up':>9s} {'max |diff|':>11s}")
    for what, t_fast, t_ref, diff in rows:
        print(f"{what:46s} {t_fast * 1e3:9.1f} {t_ref * 1e3:9.1f} {t_ref / t_fast:8.2f}x {diff:11.2e}")
    slower = [what for what, t_fast, t_ref, _ in rows if t_fast >= t_ref]
    if slower:
        print("NOT faster than the reference here: " + "; ".join(slower))


if __name__ == "__main__":
    main()
