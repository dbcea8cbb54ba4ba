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
    # head_dim 32 != hidden / heads = 16: exercises kv_channels; q/k norms over head_dim
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "head_dim": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "hidden_act": "silu", "initializer_range": 0.02, "attention_bias": False,
    },
    # 4 experts, top-2, softmax then top-k without renormalising; layer 1 is dense (mlp_only_layers)
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], "router_aux_loss_coef": 0.001, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02, "attention_bias": False,
    },
    # every layer MoE, top-2 renormalised (softmax over the top-k logits)
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "num_local_experts": 4,
        "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02, "sliding_window": None,
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


def save_pretrained(path: str, config: dict[str, Any], *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded model of `config` (build_hf_model) saved by transformers itself: its config goes
    through the family's own config class (AutoConfig), and `save_pretrained` writes config.json
    with the keys and names the installed release uses, and the safetensors. Returns the tensors
    written, under their checkpoint names."""
    from safetensors.torch import load_file

    build_hf_model(config, seed=seed).save_pretrained(path)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    return state


class ShardedSafetensorsWriter:
    """Write HF tensors one at a time into size-bounded safetensors shards.

    Holds at most one shard in memory. `close()` renames shards to HF's
    model-0000i-of-0000n names (or model.safetensors when there is one) and writes the
    index. Files go straight into `path`, so callers write into a temporary directory.
    """

    def __init__(self, path: str, max_shard_bytes: int = 2 << 30):
        os.makedirs(path, exist_ok=True)
        self.path, self.max_shard_bytes = path, max_shard_bytes
        self._current: dict[str, torch.Tensor] = {}
        self._size = 0
        self._written: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._current and self._size + nbytes > self.max_shard_bytes:
            self._flush()
        self._current[name] = tensor.detach().contiguous().cpu()
        self._size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self._current, os.path.join(self.path, f"part-{len(self._written)}.safetensors"),
                  metadata={"format": "pt"})
        self._written.append(list(self._current))
        self._current, self._size = {}, 0

    def close(self) -> None:
        if self._current or not self._written:
            self._flush()
        n = len(self._written)
        if n == 1:
            os.replace(os.path.join(self.path, "part-0.safetensors"), os.path.join(self.path, "model.safetensors"))
            return
        weight_map = {}
        for i, names in enumerate(self._written):
            file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.path, f"part-{i}.safetensors"), os.path.join(self.path, file))
            weight_map.update({name: file for name in names})
        with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def save_hf_dir(path: str, state: dict[str, torch.Tensor], config: dict[str, Any],
                max_shard_bytes: int = 2 << 30) -> None:
    """Write config.json and safetensors shards (+ index when more than one) to `path`."""
    writer = ShardedSafetensorsWriter(path, max_shard_bytes)
    for name, tensor in state.items():
        writer.add(name, tensor)
    writer.close()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
