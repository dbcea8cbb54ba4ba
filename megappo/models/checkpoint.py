"""Megatron-Core distributed checkpoints of one model, with megappo's model metadata.

A model checkpoint directory holds Megatron's dist-checkpoint files (layout-independent:
it loads at any TP/PP), `megappo_model.json` (architecture, dims, role, vocab padding) and
`hf/` (the HF config.json and tokenizer files the model came from), so a checkpoint can
be turned back into an HF directory and a checkpoint of another model is refused before
any tensor is read.

This module does not know about optimizers or trainer state (see the trainer checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch.distributed as dist

from megappo.models.builders import MegatronModel, _unwrap
from megappo.models.hf_config import ModelConfigError, ModelDims

META_FILE = "megappo_model.json"


def read_metadata(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path):
        raise ModelConfigError(
            f"'{ckpt_dir}' is not a megappo model checkpoint (no {META_FILE}); "
            "create one with tools/convert_hf_to_megatron.py."
        )
    with open(path) as f:
        return json.load(f)


def check_compatible(model: MegatronModel, meta: dict, ckpt_dir: str) -> None:
    """Refuse a checkpoint whose architecture or dims differ from the model's."""
    saved = ModelDims(**meta["dims"])
    if saved != model.dims:
        diffs = [f"{f.name}: checkpoint {getattr(saved, f.name)!r} vs model {getattr(model.dims, f.name)!r}"
                 for f in dataclasses.fields(ModelDims) if getattr(saved, f.name) != getattr(model.dims, f.name)]
        raise ModelConfigError(
            f"checkpoint '{ckpt_dir}' is from another model ({'; '.join(diffs)}). "
            "Fix: point at a checkpoint of this model, or change the model config."
        )
    value_saved = meta["role"] in ("critic", "reward")
    if value_saved != model.has_value_head:
        raise ModelConfigError(
            f"checkpoint '{ckpt_dir}' holds a {meta['role']} model, which cannot load into the {model.role} model."
        )


def _sharded_state(model: MegatronModel) -> dict:
    # Sharded tensors carry global keys and offsets, so the nesting below (one entry per
    # virtual stage) does not tie the files to this layout.
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model.chunks)}


def save_model(model: MegatronModel, ckpt_dir: str, hf_config: dict, hf_files: dict[str, bytes] | None = None) -> None:
    """Collective: save this model to `ckpt_dir` (which must not exist or be empty)."""
    from megatron.core import dist_checkpointing

    if model.ps.rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model), ckpt_dir)
    if model.ps.rank == 0:
        meta = {"format": "megappo-model-v1", "role": model.role,
                "dims": dataclasses.asdict(model.dims), "hf_config": hf_config}
        with open(os.path.join(ckpt_dir, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        if hf_files:
            os.makedirs(os.path.join(ckpt_dir, "hf"), exist_ok=True)
            for name, data in hf_files.items():
                with open(os.path.join(ckpt_dir, "hf", name), "wb") as f:
                    f.write(data)
    dist.barrier()


def load_model(model: MegatronModel, ckpt_dir: str) -> dict:
    """Collective: load `ckpt_dir` into the model at its current layout; returns metadata."""
    from megatron.core import dist_checkpointing

    meta = read_metadata(ckpt_dir)
    check_compatible(model, meta, ckpt_dir)
    loaded = dist_checkpointing.load(_sharded_state(model), ckpt_dir)
    for i, chunk in enumerate(model.chunks):
        _unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
    return meta
