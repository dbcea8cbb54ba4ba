#!/usr/bin/env python
"""Activation memory of a training pass per rank at a long sequence: context parallelism (CP=2) against CP=1.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/context_parallel_memory.py [--tokens 8192
        --hidden 512 --layers 4 --heads 8 --kv-heads 2 --vocab 2048 --dtype bfloat16]

Two sequences of --tokens tokens, one per micro-batch (max_tokens_per_micro_batch = --tokens), through
a forward and backward of a tiny Llama (random init, the local layer spec, megappo's packed attention)
at two layouts over the same 2 ranks: CP=1 (DP=2: each rank runs one whole sequence) and CP=2 (DP=1:
each rank holds half of every sequence, K/V all-gathered in attention). The number is what autograd
keeps for the backward at its worst micro-batch: the bytes of the distinct storages the forward saves
(a saved-tensors hook; everything the backward needs: activations, the gathered K/V, the LM head's
input), the same on every rank; the LM head runs on every position. Wall time of the pass beside it
(a shared CPU: indicative only).
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megappo.models.builders import build_model  # noqa: E402
from megappo.models.forward import run_micro_batches  # noqa: E402
from megappo.models.hf_config import dims_from_hf  # noqa: E402
from megappo.parallel.packing import micro_batch_tensors, plan_packed  # noqa: E402
from megappo.parallel.state import add_layout, init_parallel  # noqa: E402


class SavedBytes:
    """Distinct storages saved for backward since the last `take()` (a saved-tensors hook)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, x):
        storage = x.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return x

    def take(self) -> int:
        total, self.storages = sum(self.storages.values()), {}
        return total


def one_layout(ps, dims, dtype, tokens: int) -> tuple[float, float]:
    model = build_model(dims, ps, role="actor", dtype=dtype)
    n = 2
    ids = torch.randint(1, dims.vocab_size, (n, tokens), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(n, tokens, dtype=torch.long)
    plan = plan_packed([tokens] * n, dp=ps.dp, max_tokens=tokens)
    mbs = micro_batch_tensors(plan, ps.dp_rank, ids, attn, prompt_len=1, select="response", per_row={})
    saved = SavedBytes()
    worst = [0]

    def on_output(logits, mb):
        worst[0] = max(worst[0], saved.take())  # the forward of this micro-batch is done; its backward next
        return logits.float().logsumexp(-1).mean(), None

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
        run_micro_batches(model, mbs, on_output, forward_only=False)
    return worst[0] / 2**20, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab,
          "hidden_size": a.hidden, "intermediate_size": 4 * a.hidden, "num_hidden_layers": a.layers,
          "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
          "max_position_embeddings": 2 * a.tokens, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    dims = dims_from_hf(hf)
    base = init_parallel(tp=1, pp=1)
    layouts = {"cp=1 (dp=2)": base, "cp=2 (dp=1)": add_layout(base, 1, 1, cp=2)}
    rows = {name: one_layout(ps, dims, a.dtype, a.tokens) for name, ps in layouts.items()}
    if base.rank == 0:
        print(f"training pass, 2 sequences of {a.tokens} tokens (one per micro-batch), Llama hidden {a.hidden} x "
              f"{a.layers} layers, {a.heads} heads / {a.kv_heads} kv heads, vocabulary {a.vocab}, {a.dtype}, 2 ranks")
        print(f"{'layout':14} {'saved for backward per rank (MiB)':>34} {'time (s)':>10}")
        for name, (mib, secs) in rows.items():
            print(f"{name:14} {mib:34.1f} {secs:10.1f}")
        one, two = rows["cp=1 (dp=2)"][0], rows["cp=2 (dp=1)"][0]
        print(f"ratio cp=1 / cp=2: {one / two:.2f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
