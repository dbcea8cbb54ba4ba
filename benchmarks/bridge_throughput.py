#!/usr/bin/env python
"""Weight-sync bridge throughput and hf-engine generation speed on CPU.

    python benchmarks/bridge_throughput.py [--tp 2 --pp 2] [--hidden 512 --layers 8]

Starts tp*pp gloo ranks itself. Builds a Llama-architecture actor (random weights), then
on global rank 0 measures, in the same run:
  * bridge sync: HF tensors delivered into the hf engine per second (TP gather + PP send +
    name-map unfuse + bucketed load), with and without fingerprint verification;
  * baseline: a plain memcpy (Tensor.copy_) of the same bytes into the same engine tensors;
  * hf engine sampling tokens/s vs transformers' own `generate` with the same settings;
  * with --lora-rank R: the sync of a LoRA actor (rank R on every linear: megappo.models.lora), whose
    bridge merges W + s B A shard by shard before the same gather, and the adapter-only sync
    (rollout.lora_sync=adapters: after the first sync, which sends the base, only the adapters in
    peft's form move) into a second hf engine; its bytes are the bytes it moved.
Prints a table with the ratios.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gen-batch", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=0)
    args = p.parse_args()

    from megappo.parallel.launch import ensure_ranks

    ensure_ranks(args.tp * args.pp)
    import torch
    import torch.distributed as dist

    from megappo.models.builders import build_model
    from megappo.models.hf_config import dims_from_hf
    from megappo.models.hf_reference import build_hf_model
    from megappo.parallel.state import init_parallel
    from megappo.rollout.bridge import WeightBridge
    from megappo.rollout.hf.engine import HFEngine
    from megappo.types import SamplingParams

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab,
           "hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4 // 64 * 64,
           "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 4,
           "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    ps = init_parallel(args.tp, args.pp)
    model = build_model(dims_from_hf(cfg), ps)
    engine = HFEngine(build_hf_model(cfg, seed=0), pad_token_id=0) if ps.rank == 0 else None
    rows = []

    def timed_sync(verify, model=model, engine=engine, lora_sync="merged"):
        bridge = WeightBridge(model, engine, bucket_bytes=args.bucket_mb << 20, verify_every=1 if verify else 0,
                              lora_sync=lora_sync)
        times, nbytes = [], 0
        if lora_sync == "adapters":
            bridge.sync()  # the first sync sends the base weights too; later ones are timed
        for _ in range(args.repeats):
            dist.barrier()
            stats = bridge.sync()
            times.append(stats.seconds)
            nbytes = stats.bytes
        return statistics.median(times), nbytes

    t_sync, nbytes = timed_sync(verify=False)
    t_verify, _ = timed_sync(verify=True)
    if args.lora_rank:
        from megappo.models.lora import LoRA, adapter_parameters

        adapted = build_model(dims_from_hf(cfg), ps, lora=LoRA(rank=args.lora_rank))
        for _, b in adapter_parameters(adapted.chunks):  # non-zero adapters: the merge does real work
            torch.nn.init.normal_(b, std=1e-3)
        t_lora, _ = timed_sync(verify=False, model=adapted)
        adapter_engine = HFEngine(build_hf_model(cfg, seed=0), pad_token_id=0) if ps.rank == 0 else None
        t_adapters, adapters_moved = timed_sync(verify=False, model=adapted, engine=adapter_engine,
                                                lora_sync="adapters")
        t_adapters_verify, _ = timed_sync(verify=True, model=adapted, engine=adapter_engine, lora_sync="adapters")
        local = sum(p.numel() * p.element_size() for _, p in adapter_parameters(adapted.chunks))
        adapter_bytes = torch.tensor([float(local)])
        dist.all_reduce(adapter_bytes)  # TP-replicated halves counted once per rank: an upper bound
    if ps.rank == 0:
        params = dict(engine.model.named_parameters())
        sources = {n: t.detach().clone() for n, t in params.items()}
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            with torch.no_grad():
                for n, t in params.items():
                    t.copy_(sources[n])
            times.append(time.perf_counter() - start)
        t_copy = statistics.median(times)
        gb = nbytes / 1e9
        rows.append(("memcpy of the same bytes (baseline)", nbytes, t_copy, gb / t_copy, 1.0))
        rows.append((f"bridge sync TP{args.tp}xPP{args.pp}", nbytes, t_sync, gb / t_sync, t_copy / t_sync))
        rows.append((f"bridge sync TP{args.tp}xPP{args.pp} + verify", nbytes, t_verify, gb / t_verify,
                     t_copy / t_verify))
        if args.lora_rank:
            rows.append((f"bridge sync, LoRA r={args.lora_rank} merged", nbytes, t_lora, gb / t_lora, t_copy / t_lora))
            agb = adapters_moved / 1e9
            rows.append((f"bridge sync, LoRA r={args.lora_rank} adapters only", adapters_moved, t_adapters,
                         agb / t_adapters, t_copy / t_adapters))
            rows.append(("  ... + verify", adapters_moved, t_adapters_verify, agb / t_adapters_verify,
                         t_copy / t_adapters_verify))

        prompts = [[(7 * i + j) % args.vocab + 1 for j in range(16)] for i in range(args.gen_batch)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=args.gen_tokens, seed=0)
        engine.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))  # warm-up
        start = time.perf_counter()
        batch = engine.generate(prompts, sp)
        t_engine = time.perf_counter() - start
        tokens = int(batch.response_mask.sum())
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.no_grad():
            engine.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                  top_k=0, max_new_tokens=args.gen_tokens, min_new_tokens=args.gen_tokens,
                                  pad_token_id=0)
        t_hf = time.perf_counter() - start
        print(f"\nmodel: hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
              f"({gb * 1e3:.0f} MB of fp32 HF tensors), ranks={ps.world_size}, bucket={args.bucket_mb} MB, "
              f"threads/rank={torch.get_num_threads()}")
        print(f"{'what':44s} {'MB moved':>9s} {'seconds':>9s} {'GB/s':>8s} {'vs memcpy':>10s}")
        for name, moved, t, rate, ratio in rows:
            print(f"{name:44s} {moved / 1e6:9.1f} {t:9.3f} {rate:8.2f} {ratio:9.2f}x")
        if args.lora_rank:
            print(f"LoRA r={args.lora_rank} adapters: {adapter_bytes.item() / 1e6:.1f} MB of parameters summed over "
                  f"ranks ({adapter_bytes.item() / nbytes:.1%} of the merged weights' {nbytes / 1e6:.0f} MB); the "
                  f"adapter-only sync moves {adapters_moved / 1e6:.1f} MB ({adapters_moved / nbytes:.1%}; q/k/v and "
                  f"gate/up each get their shared A) in {t_adapters:.3f} s, {t_sync / t_adapters:.1f}x faster than "
                  f"the plain sync and {t_lora / t_adapters:.1f}x faster than the merged one")
        print(f"\n{'generation (batch ' + str(args.gen_batch) + ', ' + str(args.gen_tokens) + ' new tokens)':44s} "
              f"{'seconds':>9s} {'tokens/s':>9s}")
        print(f"{'hf engine (megappo)':44s} {t_engine:9.3f} {tokens / t_engine:9.1f}")
        hf_tokens = args.gen_batch * args.gen_tokens
        print(f"{'transformers generate (baseline)':44s} {t_hf:9.3f} {hf_tokens / t_hf:9.1f}")
        print(f"ratio megappo/transformers tokens/s: {(tokens / t_engine) / (hf_tokens / t_hf):.2f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
