"""HF weights into sharded Megatron models, and full tensors back out of them.

`load_hf_weights(model, source)`: each rank opens the safetensors files and reads only the
HF tensors that its own pipeline stage (and, for MoE, its own experts) needs, converts them
through the name map, keeps its TP shard and copies it into the parameter. Shapes are
checked against the config first, so a checkpoint from another model stops with a clear
message.

`iter_full_params(model, dst)`: a collective over the model's ranks that yields (global Megatron
name, full tensor) on each receiving global rank of `dst`, stage after stage, TP shards gathered on
each stage, and routed experts gathered over the expert-parallel group (a LoRA model's adapted
weights with their update merged in: megappo.models.lora.merged_shard, unless merged=False). A
receiver takes stage s's tensors from stage s of its own pipeline (its tp and dp rank), which
sends them along the pipeline group; only the pipelines of the EP groups that hold a receiver take
part. `iter_hf_tensors` adds the name-map transform (HF names, vocab unpadded, QKV/fc1 unfused).
Nothing here holds more than one full tensor at a time.

Which pipelines take part follows Megatron-Core's rank order tp-cp-ep-dp-pp (expert TP = TP), checked
against this rank's groups on every call:

    global rank = tp_rank + tp * (replica + dp * cp * pp_rank),  replica = cp_rank + cp * dp_rank,
    dp_rank = ep_rank + ep * expert_dp_rank   (context parallelism, cp > 1, only with ep = 1)

(the cp ranks of a data-parallel replica hold the same weights: each is a pipeline of its own here)

so an EP group is `ep` consecutive dp ranks at the same tp rank and stage:

    tp=1 pp=1 dp=4 ep=2:   EP groups  0 1 | 2 3
    receivers {1}:         rank 1 yields, rank 0 gathers only its experts (over EP, for rank 1),
                           ranks 2 and 3 return at once

This module does not know about PPO, engines or checkpoints of the trainer, nor why a rank
receives (one engine per receiving rank, or rank 0 writing a checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Collection, Iterator, Mapping

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


def iter_full_params(model: MegatronModel, dst: int | Collection[int] = 0, only: tuple[str, ...] = (),
                     merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: every rank of the model must run it to the end, with the same `dst`. Yields
    (global Megatron name, full tensor) on each global rank in `dst` (one rank, or a collection of
    ranks: any tp, dp or pp rank), the same names in the same order and the same bits on each;
    other ranks yield nothing. Routed experts are gathered over the expert-parallel group as
    well: each local expert k is followed by expert r * E/ep + k of every other EP rank r, as EP
    rank 0 numbers them. `only`: just the names starting with one of these prefixes.
    `merged=False`: a LoRA model's base weights as they are, without their adapters' update (what
    an engine that applies the adapters itself takes)."""
    entries = [(n, r, p) for n, r, p in model.named_parameters() if r.export and n.startswith(only or "")]
    return _iter_full(model, entries, dst, merged_shard if merged else torch.Tensor.detach)


def iter_adapter_tensors(model: MegatronModel, dst: int | Collection[int] = 0
                         ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Collective, as `iter_full_params`: (HF module name, 'lora_A' | 'lora_B', full tensor) of a
    LoRA model's adapters on each rank in `dst`, in peft's form: one (A, B) per HF projection, so an
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
def _iter_full(model: MegatronModel, entries: list, dst: int | Collection[int], value
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_full_params` over (global name, rule, parameter) `entries`, each gathered as `value(parameter)`.

    Per stage s, the stage-s rank of every taking-part pipeline gathers each tensor over TP (and
    experts over EP); the rank of a pipeline that holds receivers sends it to those at other stages
    and yields it if it receives itself. A dp rank with no receiver whose EP group holds one
    gathers only its experts (its EP peers need them)."""
    ps = model.ps
    receivers = frozenset((dst,) if isinstance(dst, int) else dst)
    assert all(0 <= r < ps.world_size for r in receivers), f"receivers {sorted(receivers)} outside the world"
    _check_rank_order(ps)
    receiving_dp = {_dp_rank(r, ps) for r in receivers}
    mine = _replica(ps)
    if not any(d // ps.ep == mine // ps.ep for d in receiving_dp):
        return  # no receiver among the pipelines of this rank's EP group
    experts_only = mine not in receiving_dp
    local = [(n, r, p) for n, r, p in entries if r.expert or not experts_only]
    pipeline = dist.get_process_group_ranks(ps.pp_group)  # this rank's pipeline, one rank per stage
    for stage, source in enumerate(pipeline):
        targets = [r for r in pipeline if r in receivers and r != source]  # receivers the stage sends to
        meta = None
        if ps.pp_rank == stage and targets:
            meta = [(n, _full_shape(p.shape, r.tp_dim, ps.tp), p.dtype) for n, r, p in local
                    for n in _expert_names(n, r, model)]
        if targets:
            box = [meta]
            dist.broadcast_object_list(box, src=source, group=ps.pp_group)
            meta = box[0]
        if ps.pp_rank == stage:
            for name, rule, param in local:
                full = _gather_tp(value(param), rule, ps)
                fulls = _gather_ep(full, ps) if rule.expert else [full]
                if experts_only:  # gathered for the EP peers' receivers
                    continue
                for global_name, tensor in zip(_expert_names(name, rule, model), fulls):
                    for target in targets:
                        dist.send(tensor.contiguous(), dst=target, group=ps.pp_group)
                    if ps.rank in receivers:
                        yield global_name, tensor
        elif ps.rank in receivers:
            for name, shape, dtype in meta:
                buf = torch.empty(shape, dtype=dtype, device=ps.device)
                dist.recv(buf, src=source, group=ps.pp_group)
                yield name, buf


def _dp_rank(rank: int, ps) -> int:
    """The replica (cp_rank + cp x dp_rank; the dp rank at cp = 1) of global `rank` (module docstring:
    Megatron-Core's rank order)."""
    return rank // ps.tp % (ps.dp * ps.cp)


def _replica(ps) -> int:
    """This rank's replica, as `_dp_rank` numbers them."""
    return ps.cp_rank + ps.cp * ps.dp_rank


def _check_rank_order(ps) -> None:
    """Assert that this rank's groups are laid out as `_dp_rank` reads the order: its pipeline at
    its replica, its DP group over dp ranks 0..dp-1 at its cp rank, its CP group over cp consecutive
    replicas, its EP group over `ep` consecutive dp ranks."""
    pipeline = dist.get_process_group_ranks(ps.pp_group)
    assert [_dp_rank(r, ps) for r in pipeline] == [_replica(ps)] * ps.pp, (pipeline, ps)
    assert [_dp_rank(r, ps) for r in dist.get_process_group_ranks(ps.dp_group)] == [
        ps.cp_rank + ps.cp * d for d in range(ps.dp)], ps
    if ps.cp > 1:
        first = ps.cp * ps.dp_rank
        assert [_dp_rank(r, ps) for r in dist.get_process_group_ranks(ps.cp_group)] == list(
            range(first, first + ps.cp)), ps
    if ps.ep > 1:
        first = ps.dp_rank - ps.ep_rank
        ep_group = dist.get_process_group_ranks(ps.ep_group)
        assert first % ps.ep == 0 and [_dp_rank(r, ps) for r in ep_group] == list(range(first, first + ps.ep)), ps


def _expert_names(name: str, rule, model: MegatronModel) -> list[str]:
    """[name], or for a routed expert (global name on this EP rank) the names of the same local
    expert on every EP rank, in EP-rank order (`_gather_ep`'s order)."""
    ps = model.ps
    if not rule.expert or ps.ep == 1:
        return [name]
    per_rank = model.dims.num_experts // ps.ep
    return [global_param_name(name, 0, (r - ps.ep_rank) * per_rank) for r in range(ps.ep)]


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


def iter_hf_tensors(model: MegatronModel, dst: int | Collection[int] = 0, only: tuple[str, ...] = (),
                    merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_full_params` through the name map: (HF name, tensor) on each rank in `dst`."""
    for name, full in iter_full_params(model, dst, only, merged):
        rule = model.name_map.rule(name)
        yield from zip(rule.hf, rule.to_hf(full))
