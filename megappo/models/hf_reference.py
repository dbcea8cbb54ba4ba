"""transformers-side helpers: tiny configs, seeded HF models, and saving HF directories.

Used by tests, the CPU demo (a model built from config, no download) and the conversion
tools' `--verify`. HF models here are the reference that Megatron results are compared to.

This module does not know about Megatron or process groups.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

#: HF config.json content for tiny test models (vocab not a multiple of 128: padding is exercised).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "initializer_range": 0.02,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "hidden_act": "silu", "initializer_range": 0.02,
    },
}


def hf_config_object(config: dict[str, Any]):
    """A transformers config object from config.json content."""
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "architectures"},
                                architectures=cfg.get("architectures"))


def build_hf_model(config: dict[str, Any], *, seed: int = 0, head: str = "lm",
                   dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A randomly initialised HF model, the same on every rank for the same seed.

    head: "lm" (CausalLM) or "token" (TokenClassification with one label: a value model).
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cfg = hf_config_object(config)
    cfg.dtype = dtype
    torch.manual_seed(seed)
    if head == "lm":
        model = AutoModelForCausalLM.from_config(cfg)
    elif head == "token":
        cfg.num_labels = 1
        model = AutoModelForTokenClassification.from_config(cfg)
    else:
        raise ValueError(f"head must be 'lm' or 'token', not {head!r}")
    # transformers' _init_weights zeroes no biases for qkv; randomise them so bias bugs show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias") or name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.02)
    return model.to(dtype).eval()


def save_hf_dir(path: str, state: dict[str, torch.Tensor], config: dict[str, Any],
                max_shard_bytes: int = 2 << 30) -> None:
    """Write config.json and safetensors shards (+ index when more than one) to `path`."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
