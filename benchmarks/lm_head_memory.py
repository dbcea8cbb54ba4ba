#!/usr/bin/env python
"""Peak memory of the LM-head part of a loss pass on CPU: today's path against the chunked LM head.

    OMP_NUM_THREADS=2 python benchmarks/lm_head_memory.py [--tokens 16384 --vocab 152064 --hidden 1536
                                                           --chunk 1024 --dtype bfloat16]

The logits part of the actor's loss pass, forward and backward, at one TP rank (the whole
vocabulary: TP=1), from [N, H] hidden states (requires grad) and a [V, H] output weight (a leaf
parameter, as the output layer's):
  today:   logits = h @ W^T ([N, V], the output layer's matmul), then
           megappo.parallel.vocab_parallel_log_probs_and_entropy, backward through both;
  chunked: megappo.parallel.chunked_head_log_probs_and_entropy with --chunk tokens per chunk.
The loss is a weighted sum of the log-probs and the entropy (both outputs carry gradient, as with
an entropy bonus). Temperature 1: today's path then keeps the bf16 logits as they are (a
temperature != 1 adds a float32 copy of them, 3x more memory for today's path, none for the chunked
one). Each path runs in a fresh subprocess; its number is the peak resident set size (ru_maxrss)
during the pass minus the resident set size before it (torch imported, inputs allocated, and the
weight's float32 `main_grad` buffer, which Megatron's DDP holds in both cases): everything the pass
allocates at its worst moment. Today's path gets W's gradient from autograd (a [V, H] tensor in
W's dtype) and a hook adds it to main_grad, as Megatron's DDP does; the chunked head adds each
chunk's product to main_grad itself. Wall time of the pass beside it (on a shared CPU: indicative).
The defaults are Qwen2.5-1.5B's head (vocabulary 152064, hidden 1536) and a 16K-token micro-batch.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def one_pass(path: str, tokens: int, vocab: int, hidden: int, chunk: int, dtype: str) -> dict:
    """Run in a subprocess: the pass's peak memory above what was resident before it."""
    import torch

    from megappo.parallel.chunked_head import chunked_head_log_probs_and_entropy
    from megappo.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    # drawn in their dtype: a float32 draw converted would raise the peak before the pass
    h = torch.empty(tokens, hidden, dtype=dt).normal_(generator=gen).requires_grad_()
    w = torch.nn.Parameter(torch.empty(vocab, hidden, dtype=dt).normal_(std=0.02, generator=gen))
    # the trainer's weight: Megatron DDP's float32 gradient buffer beside it, and its hook moving
    # param.grad into that buffer (today's path); the chunked head adds into it directly
    w.main_grad = torch.zeros(vocab, hidden, dtype=torch.float32)

    def ddp_hook(param):  # as Megatron's DDP hook: autograd may call it without a gradient
        if param.grad is not None:
            param.main_grad.add_(param.grad)
        param.grad = None

    w.register_post_accumulate_grad_hook(ddp_hook)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    w_lp, w_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    before = rss_bytes()
    assert peak_bytes() <= before + (64 << 20), "the inputs' peak is above the pass's baseline"
    start = time.perf_counter()
    if path == "today":
        logits = torch.matmul(h, w.t())[None]  # [1, N, V]
        lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels[None])
        lp, ent = lp[0], ent[0]
        del logits  # autograd keeps it for the backward all the same
    else:
        lp, ent = chunked_head_log_probs_and_entropy(h, w, labels, chunk_tokens=chunk)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    seconds = time.perf_counter() - start
    return {"path": path, "peak_above_baseline": peak_bytes() - before, "seconds": seconds,
            "lp_sum": float(lp.detach().double().sum()), "w_grad_norm": float(w.main_grad.double().norm()),
            "h_grad_norm": float(h.grad.double().norm())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--only", choices=["today", "chunked"], help=argparse.SUPPRESS)  # the subprocess's own run
    args = ap.parse_args()
    if args.only:
        print(json.dumps(one_pass(args.only, args.tokens, args.vocab, args.hidden, args.chunk, args.dtype)))
        return
    rows = []
    for path in ("today", "chunked"):
        cmd = [sys.executable, os.path.abspath(__file__), "--only", path, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk),
               "--dtype", args.dtype]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    gib = 1 << 30
    logits = args.tokens * args.vocab * (2 if args.dtype == "bfloat16" else 4)
    print(f"LM head loss pass (forward + backward), {args.tokens} tokens x vocabulary {args.vocab} x hidden "
          f"{args.hidden}, {args.dtype}, TP=1, chunk {args.chunk} tokens; the [N, V] logits alone: {logits / gib:.2f} GiB")
    print(f"{'path':<10}{'peak above baseline (GiB)':>28}{'time (s)':>12}")
    for r in rows:
        print(f"{r['path']:<10}{r['peak_above_baseline'] / gib:>28.2f}{r['seconds']:>12.1f}")
    today, chunked = rows
    print(f"ratio today / chunked: {today['peak_above_baseline'] / chunked['peak_above_baseline']:.1f}x")
    print("same results: log-prob sum {:.6g} vs {:.6g}, |dW| {:.6g} vs {:.6g}, |dh| {:.6g} vs {:.6g}".format(
        today["lp_sum"], chunked["lp_sum"], today["w_grad_norm"], chunked["w_grad_norm"],
        today["h_grad_norm"], chunked["h_grad_norm"]))


if __name__ == "__main__":
    main()
