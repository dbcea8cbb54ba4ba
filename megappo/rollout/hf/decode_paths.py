"""Which decode path the hf engine runs (rollout.hf_decode): the path names, the models the
fixed-shape step supports, and `choose_decode`, the one place the choice is made. Imports no torch,
so that `megappo plan` can ask whether a recipe's engine keeps its KV cache (the CUDA-graph decode).

This module does not know how any path decodes (megappo.rollout.hf.engine, .static_decode).
"""

from __future__ import annotations

#: rollout.hf_decode values: dynamic = the hf engine's decode loop (rows leave, shapes shrink); static =
#: static_decode's fixed-shape steps without capture; graphs = the same, each bucket's step a CUDA graph (CUDA only);
#: auto = graphs on CUDA for a supported model, dynamic elsewhere (graphs ran on an H200 on 2026-11-27:
#: benchmarks/RESULTS.md)
DECODE_PATHS = ("auto", "dynamic", "static", "graphs")

#: model types whose forward the fixed-shape step runs as it is: dense, full attention on every layer,
#: a 4D attention mask taken as given (transformers' masking_utils), the cache through `cache.update`
#: (tests/unit/test_static_decode.py covers each)
STATIC_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})


def static_unsupported(config) -> str | None:
    """Why a model of HF `config` (a transformers config, or any object with its attributes) cannot run
    the fixed-shape step, or None when it can."""
    kind = getattr(config, "model_type", "")
    if kind not in STATIC_MODEL_TYPES:
        return f"model type '{kind}' is not one of {sorted(STATIC_MODEL_TYPES)}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        return "the model has sliding-window layers"
    if getattr(config, "_attn_implementation", "sdpa") != "sdpa":
        return f"attention '{config._attn_implementation}' (the step passes sdpa a 4D mask)"
    return None


def choose_decode(requested: str, device, model) -> tuple[str, str]:
    """(path, why): the decode path the hf engine runs for `requested` (DECODE_PATHS) with its model on
    `device` (a torch.device: only its type is read). `static` and
    `graphs` asked for on a model or device that cannot run them raise ValueError with the fix."""
    if requested not in DECODE_PATHS:
        raise ValueError(f"unknown hf decode path '{requested}'; choose one of {list(DECODE_PATHS)} (rollout.hf_decode)")
    why_not = static_unsupported(model.config)
    if requested == "dynamic":
        return "dynamic", "asked for"
    if requested in ("static", "graphs") and why_not:
        raise ValueError(f"rollout.hf_decode={requested}: {why_not}. Fix: set rollout.hf_decode=dynamic (or auto).")
    if requested == "graphs" and device.type != "cuda":
        raise ValueError(f"rollout.hf_decode=graphs needs CUDA (the engine is on {device}). "
                         "Fix: set rollout.hf_decode=static (the same steps uncaptured) or auto.")
    if requested != "auto":
        return requested, "asked for"
    if device.type != "cuda":
        return "dynamic", f"auto: CUDA graphs need CUDA, the engine is on {device}"
    if why_not:
        return "dynamic", f"auto: {why_not}"
    return "graphs", "auto: CUDA and a supported model"
