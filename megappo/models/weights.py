"""HF weights into sharded Megatron models, and full tensors back out of them.

`load_hf_weights(model, source)`: each rank opens the safetensors files and reads only the
HF tensors that its own pipeline stage (and, for MoE, its own experts) needs, converts them
through the name map, keeps its TP shard and copies it into the parameter. Shapes are
checked against the config first, so a checkpoint from another model stops with a clear
message.

`iter_full_params(model)`: a collective over the model's ranks that yields (global
Megatron name, full tensor) on global rank 0, stage after stage, TP shards gathered on
each stage, and routed experts gathered over the expert-parallel group (a LoRA model's adapted
weights with their update merged in: megappo.models.lora.merged_shard, unless merged=False). `iter_hf_tensors`
adds the name-map transform (HF names, vocab unpadded, QKV/fc1 unfused). Nothing here holds
more than one full tensor at a time.

This module does not know about PPO, engines or checkpoints of the trainer.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from megappo.models.builders import MegatronModel
from megappo.errors import ModelConfigError
from megappo.models.lora import merged_shard
from megappo.models.name_map import global_param_name, merge_tp_shards, shard_for_tp
from megappo.parallel.state import in_layout


class HFWeights:
    """Lazy, name-indexed access to an HF directory's safetensors (or an in-memory dict)."""

    def __init__(self, source: str | Mapping[str, torch.Tensor]):
        self._dict = source if isinstance(source, Mapping) else None
        self._files: dict[str, str] = {}
        if self._dict is None:
            self._files = _index_safetensors(source)

    def names(self) -> set[str]:
        return set(self._dict) if self._dict is not None else set(self._files)

    def get(self, name: str) -> torch.Tensor:
        if self._dict is not None:
            return self._dict[name]
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as f:
            return f.get_tensor(name)


def _index_safetensors(path: str) -> dict[str, str]:
    if not os.path.isdir(path):
        raise ModelConfigError(f"HF weights directory '{path}' does not exist.")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        missing = sorted({f for f in files.values() if not os.path.isfile(f)})
        if missing:
            raise ModelConfigError(f"{index} names weight files that are missing: {missing[:3]}.")
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    if any(n.endswith((".bin", ".pt")) for n in os.listdir(path)):
        raise ModelConfigError(
            f"'{path}' has only pickle weights (.bin/.pt); megappo loads safetensors only. "
            "Fix: re-save the model with save_pretrained(safe_serialization=True)."
        )
    raise ModelConfigError(f"no model.safetensors(.index.json) in '{path}'.")


@torch.no_grad()
@in_layout
def load_hf_weights(model: MegatronModel, source: str | Mapping[str, torch.Tensor]) -> list[str]:
    """Copy HF weights into this rank's shards. Returns the names left at their init
    (only the value head, when the checkpoint has no `score` tensors)."""
    weights = HFWeights(source)
    available = weights.names()
    ps = model.ps
    plan, skipped = [], []
    for name, rule, param in model.named_parameters():
        missing = [n for n in rule.hf if n not in available]
        if missing:
            if model.has_value_head and name.startswith("output_layer."):
                skipped.append(name)
                continue
            raise ModelConfigError(
                f"HF weights lack {missing[0]} (needed for Megatron '{name}'); "
                f"the checkpoint does not match the {model.dims.arch} config."
            )
        plan.append((name, rule, param))
    # check every shape before touching any parameter: nothing half-loaded
    loaded = []
    for name, rule, param in plan:
        full = rule.from_hf(*(weights.get(n) for n in rule.hf))
        shard = shard_for_tp(full, rule, ps.tp_rank, ps.tp)
        if tuple(shard.shape) != tuple(param.shape):
            raise ModelConfigError(
                f"shape mismatch for '{name}': checkpoint gives {tuple(shard.shape)} at tp={ps.tp}, "
                f"the model has {tuple(param.shape)}; the checkpoint is from another model or config."
            )
        loaded.append((param, shard))
    for param, shard in loaded:
        param.copy_(shard.to(param.dtype))
    return skipped


def _full_shape(shape: torch.Size, tp_dim: int | None, tp: int) -> tuple[int, ...]:
    out = list(shape)
    if tp_dim is not None:
        out[tp_dim] *= tp
    return tuple(out)


def iter_full_params(model: MegatronModel, dst: int = 0, only: tuple[str, ...] = (),
                     merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: every rank of the model must run it to the end. Yields (global Megatron
    name, full tensor) on global rank `dst` (which must be the tp0/dp0 rank of stage 0);
    other ranks yield nothing. Routed experts are gathered over the expert-parallel group as
    well (its ranks are data-parallel ranks 0..ep-1): each local expert k of the dp0 rank is
    followed by expert r * E/ep + k of every other EP rank r. `only`: just the names starting
    with one of these prefixes. `merged=False`: a LoRA model's base weights as they are, without
    their adapters' update (what an engine that applies the adapters itself takes)."""
    entries = [(n, r, p) for n, r, p in model.named_parameters() if r.export and n.startswith(only or "")]
    return _iter_full(model, entries, dst, merged_shard if merged else torch.Tensor.detach)


def iter_adapter_tensors(model: MegatronModel, dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective, as `iter_full_params`: (HF module name, 'lora_A' | 'lora_B', full tensor) of a
    LoRA model's adapters on rank `dst`, in peft's form: one (A, B) per HF projection, so an
    adapter of a fused Megatron layer (qkv, gate|up) is split like its weight, B by rows, and
    its A is shared by the projections it fuses (the same update, W_q + s B_q A, ...)."""
    entries = []
    for name, rule, param in model.named_parameters():
        layer = getattr(param, "lora_layer", None)
        if layer is None:
            continue
        for which in ("lora_a", "lora_b"):
            split = (which == "lora_b") == (layer.lora_kind == "column")  # the TP-split one
            tensor_rule = dataclasses.replace(rule, tp_dim=rule.tp_dim if split else None, glu=rule.glu and split)
            entries.append((f"{name}.{which}", tensor_rule, getattr(layer, which)))
    for name, full in _iter_full(model, entries, dst, torch.Tensor.detach):
        weight_name, _, which = name.rpartition(".")
        rule = model.name_map.rule(weight_name)
        hf_names = [n.removesuffix(".weight") for n in rule.hf]
        if which == "lora_a":
            yield from ((n, "lora_A", full) for n in hf_names)
        else:
            yield from ((n, "lora_B", part) for n, part in zip(hf_names, rule.to_hf(full)))


@torch.no_grad()
def _iter_full(model: MegatronModel, entries: list, dst: int, value) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_full_params` over (global name, rule, parameter) `entries`, each gathered as `value(parameter)`."""
    ps = model.ps
    if ps.dp_rank >= ps.ep:  # a replica (data or expert-data parallel) of what ranks below hold
        return
    experts_only = ps.dp_rank != 0  # ep_rank > 0: contributes its experts, nothing else
    local = [(n, r, p) for n, r, p in entries if r.expert or not experts_only]
    pp_ranks = dist.get_process_group_ranks(ps.pp_group)
    for stage in range(ps.pp):
        if experts_only:
            if ps.pp_rank == stage:
                for _, rule, param in local:
                    _gather_ep(_gather_tp(value(param), rule, ps), ps)
            continue
        meta = None
        if ps.pp_rank == stage:
            meta = [(n, _full_shape(p.shape, r.tp_dim, ps.tp), p.dtype) for n, r, p in local
                    for n in _expert_names(n, r, model)]
        if ps.tp_rank == 0 and ps.pp > 1:
            box = [meta]
            dist.broadcast_object_list(box, src=pp_ranks[stage], group=ps.pp_group)
            meta = box[0]
        if ps.pp_rank != stage and ps.rank != dst:
            continue
        if ps.pp_rank == stage:
            for name, rule, param in local:
                full = _gather_tp(value(param), rule, ps)
                fulls = _gather_ep(full, ps) if rule.expert else [full]
                if ps.tp_rank != 0:
                    continue
                for global_name, tensor in zip(_expert_names(name, rule, model), fulls):
                    if ps.rank == dst:
                        yield global_name, tensor
                    else:
                        dist.send(tensor.contiguous(), dst=dst)
        else:
            for name, shape, dtype in meta:
                buf = torch.empty(shape, dtype=dtype, device=ps.device)
                dist.recv(buf, src=pp_ranks[stage])
                yield name, buf


def _expert_names(name: str, rule, model: MegatronModel) -> list[str]:
    """[name], or for a routed expert of EP rank 0 the names of the same local expert on
    every EP rank, in EP-rank order (`_gather_ep`'s order)."""
    if not rule.expert or model.ps.ep == 1:
        return [name]
    per_rank = model.dims.num_experts // model.ps.ep
    return [global_param_name(name, 0, r * per_rank) for r in range(model.ps.ep)]


def _gather_ep(full: torch.Tensor, ps) -> list[torch.Tensor]:
    """One local expert's tensor from every rank of the expert-parallel group, in EP-rank order."""
    if ps.ep == 1:
        return [full]
    parts = [torch.empty_like(full) for _ in range(ps.ep)]
    dist.all_gather(parts, full.contiguous(), group=ps.ep_group)
    return parts


def _gather_tp(shard: torch.Tensor, rule, ps) -> torch.Tensor:
    if rule.tp_dim is None or ps.tp == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(ps.tp)]
    dist.all_gather(parts, shard.contiguous(), group=ps.tp_group)
    return merge_tp_shards(parts, rule)


def iter_hf_tensors(model: MegatronModel, dst: int = 0, only: tuple[str, ...] = (),
                    merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_full_params` through the name map: (HF name, tensor) on rank `dst`."""
    for name, full in iter_full_params(model, dst, only, merged):
        rule = model.name_map.rule(name)
        yield from zip(rule.hf, rule.to_hf(full))
