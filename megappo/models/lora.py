"""LoRA adapters inside Megatron-Core's tensor-parallel linear layers.

`apply_lora(model, LoRA(rank=8, ...))` gives every targeted `ColumnParallelLinear` /
`RowParallelLinear` of a built model two adapter matrices and adds their low-rank update
to the layer's output, y = W x + (alpha / r) * B (A x), then freezes every other parameter
(a critic's value head stays trainable, and so do `modules_to_save`, peft's name for modules
trained fully next to the adapters: lm_head, embed_tokens). The base weights keep their names,
so HF loading, the name map and checkpoints of the base model are unchanged; the adapters are
parameters of the same layer (`<layer>.lora_a`, `<layer>.lora_b`).

Sharding follows the layer's own (legend: r rank, I / O the full input / output size, tp):
  column-parallel (linear_qkv, linear_fc1):  A [r, I] replicated, B [O/tp, r] split on dim 0
      x --(SP: gather)--> A x --copy_to_tp--> B_k (A x)      (backward: all-reduce of d(A x))
  row-parallel (linear_proj, linear_fc2):     A [r, I/tp] split on dim 1, B [O, r] replicated
      x_k --> A_k x_k --all-reduce (SP: reduce-scatter)--> B (A x)
so the local shard of the merged weight is W_k + s * B_k A (column) or W_k + s * B A_k (row)
without communication (`merged_shard`). Experts (SequentialMLP's per-expert linears) are
adapted like dense layers, split over EP with them; their expert TP must be 1.

A is initialised as peft does (Kaiming-uniform, a=sqrt(5)) from a generator seeded by the
layer's global name, so every TP/PP/EP layout starts from the same adapters; B starts at
zero, so a fresh adapter changes nothing. Dropout on the adapter input applies only in
passes that build a graph (training), never in log-prob passes.

`adapters_off(chunks)` / `base_view(model)`: the base model's forward (the reference policy for
free). With full recomputation a frozen embedding's output is marked as requiring grad, or
Megatron's reentrant checkpoints would skip every adapter in backward.

The names users may write (all-linear, q_proj, lm_head, ...) and their checks live in
megappo.config's tables. This module does not know about PPO, checkpoint files or engines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from megappo.config import SAVED_MODULES, TARGETS
from megappo.errors import ModelConfigError


@dataclasses.dataclass(frozen=True)
class LoRA:
    """A role's adapter settings. rank 0: no LoRA."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(TARGETS)  # Megatron linear names
    modules_to_save: tuple[str, ...] = ()  # HF names of modules that train fully (SAVED_MODULES)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def trained_prefixes(self, tied_embeddings: bool) -> tuple[str, ...]:
        """Megatron name prefixes of the fully trained modules (tied embeddings: both or neither)."""
        saved = set(self.modules_to_save)
        if tied_embeddings and saved:
            saved = set(SAVED_MODULES)
        return tuple(f"{SAVED_MODULES[m]}." for m in SAVED_MODULES if m in saved)


NO_LORA = LoRA()


class _Adapted:
    """Mixed into an adapted layer's class (before Megatron's): the forward adds the adapter's
    update; the sharded state dict splits the adapter matrix that is TP-sharded."""

    lora_kind: str  # "column" | "row"

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        if self.lora_on:
            out = out + self.lora_update(input_).to(out.dtype)
        return out, bias

    def lora_update(self, x: torch.Tensor) -> torch.Tensor:
        """s * B (A x) for this layer's input `x` ([S, B, I] or [S/tp, B, I] under SP for a column
        layer; [S, B, I/tp] for a row layer), shaped like the layer's output."""
        from megatron.core.tensor_parallel import mappings

        comm = not getattr(self, "explicit_expert_comm", False)  # experts: the dispatcher moved the tokens
        sp, group = comm and self.sequence_parallel, self.tp_group
        if self.lora_dropout and torch.is_grad_enabled():
            x = F.dropout(x, self.lora_dropout)
        if self.lora_kind == "column":
            if sp:  # every rank's d(x) below is the same full gradient: its backward takes this rank's slice
                x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)
            z = F.linear(x, self.lora_a)
            if comm:
                z = mappings.copy_to_tensor_model_parallel_region(z, group=group)
        else:
            z = F.linear(x, self.lora_a)
            if comm:
                z = (mappings.reduce_scatter_to_sequence_parallel_region(z, group=group) if sp
                     else mappings.reduce_from_tensor_model_parallel_region(z, group=group))
        return F.linear(z, self.lora_b) * self.lora_scale

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        name, axis = ("lora_b", 0) if self.lora_kind == "column" else ("lora_a", 1)
        split = make_sharded_tensors_for_checkpoint({name: getattr(self, name)}, prefix, {name: axis},
                                                    sharded_offsets, tp_group=self.tp_group,
                                                    dp_cp_group=metadata["dp_cp_group"])
        if self.lora_glu:  # fc1's B rows are [gate_k; up_k] per TP rank, as its weight's: split like it
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            split = {k: apply_swiglu_sharded_factory(v, sharded_offsets,
                                                     (metadata or {}).get("singleton_local_shards", False))
                     for k, v in split.items()}
        state.update(split)
        return state


_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (_Adapted, cls), {})
    return _CLASSES[cls]


def _init_a(shape: tuple[int, int], name: str, seed: int) -> torch.Tensor:
    """peft's A init (kaiming_uniform_ with a=sqrt(5): U(-1/sqrt(I), 1/sqrt(I))) of the FULL A,
    from a generator of this layer's global name: the same at every layout."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def _adapt(module: torch.nn.Module, kind: str, lora: LoRA, name: str, seed: int) -> None:
    """Give one Megatron linear (global name `name`, e.g. decoder.layers.3.mlp.linear_fc1) its adapters."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    weight = module.weight
    tp = torch.distributed.get_world_size(module.tp_group) if module.tp_group is not None else 1
    tp_rank = torch.distributed.get_rank(module.tp_group) if tp > 1 else 0
    if getattr(module, "explicit_expert_comm", False) and tp > 1:
        raise ModelConfigError(f"LoRA on '{name}': adapters on experts split by tensor parallelism (expert TP "
                               f"{tp}) are not supported. Fix: leave the MLP out of target_modules, or use tp=1 "
                               "and split the experts with parallel.ep.")
    out_local, in_local = weight.shape
    a_full = _init_a((lora.rank, in_local * (tp if kind == "row" else 1)), name, seed)
    a = a_full.chunk(tp, dim=1)[tp_rank] if kind == "row" else a_full
    b = torch.zeros(out_local, lora.rank)  # column: [O/tp, r]; row: [O, r]
    module.lora_a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    module.lora_b = torch.nn.Parameter(b.to(device=weight.device, dtype=weight.dtype))
    split = module.lora_b if kind == "column" else module.lora_a
    set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
    for p in (module.lora_a, module.lora_b):
        p.lora_adapter = True
        if not getattr(weight, "allreduce", True):  # an expert's: reduced over the expert-data-parallel group
            p.allreduce = False
    if kind == "row" and module.sequence_parallel and not getattr(module, "explicit_expert_comm", False):
        module.lora_b.sequence_parallel = True  # each rank's gradient covers its sequence slice: summed over TP
    module.lora_kind, module.lora_scale, module.lora_dropout, module.lora_on = kind, lora.scale, lora.dropout, True
    module.lora_glu = name.endswith("linear_fc1") and module.config.gated_linear_unit
    module.__class__ = _adapted_class(type(module))
    weight.lora_layer = module  # merged_shard finds the adapters from the base weight


def apply_lora(model, lora: LoRA, *, seed: int = 0, trainable_prefixes: tuple[str, ...] = ()) -> int:
    """Adapt `model`'s targeted linears (a MegatronModel, before make_trainable wraps it) and freeze
    everything else except `lora.modules_to_save` and parameters whose global name starts with one
    of `trainable_prefixes` (a critic's value head: 'output_layer.'). Returns the number of adapted
    layers on this rank."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    kinds = {ColumnParallelLinear: "column", RowParallelLinear: "row"}
    owners = {}
    for chunk in model.chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "weight", None), torch.nn.Parameter):
                owners[id(module.weight)] = module
    adapted = 0
    for name, _, param in list(model.named_parameters()):
        module = owners.get(id(param))
        layer, _, leaf = name.rpartition(".")
        if leaf != "weight" or module is None or layer.rpartition(".")[2] not in lora.targets:
            continue
        kind = next((k for cls, k in kinds.items() if isinstance(module, cls)), None)
        if kind != TARGETS[layer.rpartition(".")[2]]:
            raise ModelConfigError(f"LoRA on '{layer}': the layer is a {type(module).__name__}, not a "
                                   "tensor-parallel linear megappo can adapt (Transformer Engine's fused layers "
                                   "are not). Fix: set model.layer_spec=local, or leave it out of target_modules.")
        _adapt(module, kind, lora, layer, seed)
        adapted += 1
    trained = tuple(trainable_prefixes) + lora.trained_prefixes(model.dims.tie_word_embeddings)
    for name, _, param in model.named_parameters():
        param.requires_grad_(name.startswith(trained) if trained else False)
    for chunk in model.chunks:
        embedding = getattr(chunk, "embedding", None)  # the first pipeline stage's
        if embedding is not None:
            embedding.register_forward_hook(_output_requires_grad)
    model.lora = lora
    return adapted


def _output_requires_grad(module, args, output):
    """A frozen embedding's output made part of the graph: Megatron's full recomputation checkpoints
    each layer with a reentrant autograd Function, which is skipped in backward (and with it every
    adapter inside) when none of its inputs requires grad (what peft's enable_input_require_grads
    does for transformers)."""
    if not output.requires_grad and torch.is_grad_enabled():
        output.requires_grad_(True)
    return output


def adapter_parameters(chunks: Iterable[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(local name, parameter) of every adapter matrix in `chunks`."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if getattr(p, "lora_adapter", False):
                yield name, p


def _adapted_modules(chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, _Adapted)]


@contextlib.contextmanager
def adapters_off(chunks: Iterable[torch.nn.Module]):
    """Within: the adapted layers compute the base model's output only."""
    modules = _adapted_modules(chunks)
    for m in modules:
        m.lora_on = False
    try:
        yield
    finally:
        for m in modules:
            m.lora_on = True


@torch.no_grad()
def merged_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a weight with its adapter's update merged in (W_k + s B_k A or
    W_k + s B A_k, in the weight's dtype); the tensor itself when not adapted. B A is summed over
    the rank one outer product at a time in fp32, in the same order for every element, so each
    merged number is the same at every TP layout (a matmul's blocking depends on the shard's shape,
    and a different fp32 sum can round to another bf16 number)."""
    module = getattr(param, "lora_layer", None)
    if module is None:
        return param.detach()
    a, b = module.lora_a.float(), module.lora_b.float()
    delta = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    for k in range(a.shape[0]):
        delta.addcmul_(b[:, k:k + 1], a[k:k + 1, :])
    return (param.float() + module.lora_scale * delta).to(param.dtype)


class AdaptersOff(torch.nn.Module):
    """A model chunk whose forward runs with its adapters switched off (the reference policy)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        with adapters_off([self.module]):
            return self.module(*args, **kwargs)


def base_view(model, role: str = "ref"):
    """The base model of an adapted MegatronModel, sharing its weights: a MegatronModel whose
    chunks run with the adapters off (no second copy of the weights)."""
    assert model.lora.enabled, "base_view of a model without adapters"
    return dataclasses.replace(model, role=role, chunks=[AdaptersOff(c) for c in model.chunks], lora=NO_LORA)
