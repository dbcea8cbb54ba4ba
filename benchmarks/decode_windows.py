#!/usr/bin/env python
"""The hf engine's fixed-shape decode with attention windows against every step attending over the
whole cache, in one run (issue 39: a decode step's memory traffic is the weights plus the KV it reads).

    OMP_NUM_THREADS=1 python benchmarks/decode_windows.py [--batch 64 --prompt 16 --new 496 --hidden 256
                                                            --layers 4 --heads 4 --repeats 2]

One random-weight Llama (multi-head attention, as SmolLM2-1.7B), one batch of `--batch` prompts of
`--prompt` tokens, sampled at temperature 1 with one seed and no stop token (every call runs `--new`
decode steps). Rows, each after a warm-up call, the median of `--repeats` timed calls:
  whole cache (baseline): `rollout.hf_decode=static` with the window step past the capacity, so every
                          step attends over all C = prompt + new (rounded up to 64) columns, as before
                          the windows;
  windows:                the same path as it runs now, each step over the written columns rounded
                          up to the window step (`static_decode.window_step`).
On CUDA the path is `graphs` (CUDA-graph decode); on a CPU, `static` (uncaptured). Both rows must give
the same tokens (checked): the windows change which masked columns a step reads, not the result.
The defaults are a small model whose decode step is dominated by attention over a long cache, where
the windows matter; at 128 x (32 + 512) tokens of a 1.7B MHA model the whole cache is 4x the weights'
bytes (static_decode's docstring).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    for name, default in (("batch", 64), ("prompt", 16), ("new", 496), ("hidden", 256), ("layers", 4),
                          ("heads", 4), ("vocab", 512), ("repeats", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpu import gen_values, timed_runs  # as gpu.py times its gen rows (importing it puts the repo on sys.path)
    from megappo.rollout.hf.engine import HFEngine
    from megappo.rollout.hf.static_decode import WHOLE_CACHE
    from megappo.types import SamplingParams

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = "graphs" if device.type == "cuda" else "static"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=args.prompt + args.new + 64)
    model = LlamaForCausalLM(cfg).eval().to(device=device, dtype=getattr(torch, args.dtype))
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, seed=0)

    rows, tokens = [], {}
    for what, window in (("whole cache (baseline)", WHOLE_CACHE), ("windows", None)):
        engine = HFEngine(model, pad_token_id=0, device=device, decode=path, max_tokens=args.prompt + args.new,
                          log=lambda line: None)
        engine._static.window = window
        engine.generate(prompts, params)  # warm-up (and, on CUDA, the captures)
        last = {}
        times = timed_runs(lambda: last.update(batch=engine.generate(prompts, params)), device, args.repeats)
        tokens[what] = last["batch"].response_ids
        values = gen_values(times, int(last["batch"].response_mask.sum()), args.new)
        rows.append((what, values["seconds"], values["ms_per_step"], values["tokens_per_s"]))
        engine.release_memory()

    same = torch.equal(*tokens.values())
    capacity = -(-(args.prompt + args.new) // 64) * 64
    print(f"hf engine {path} decode, {device.type}, {args.dtype}: {args.batch} x {args.prompt} prompt + {args.new} "
          f"new, cache {capacity} columns; hidden {args.hidden}, {args.layers} layers, {args.heads} heads; "
          f"median of {args.repeats} calls")
    print(f"{'what':<24}{'s/call':>10}{'ms/step':>10}{'tokens/s':>11}{'speed-up':>10}")
    for what, seconds, ms, rate in rows:
        print(f"{what:<24}{seconds:>10.2f}{ms:>10.2f}{rate:>11.0f}{rows[0][1] / seconds:>9.2f}x")
    print(f"same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
