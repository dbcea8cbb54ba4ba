"""Build Megatron-Core GPT models for the four PPO roles. The only module naming GPTModel.

actor / reference: GPT with its LM head ([B, T, V_pad/tp] logits, vocab-parallel).
critic / reward:   the same trunk with a scalar value head on the last pipeline stage
                   ([B, T] values); initialisable from an HF checkpoint with or without
                   a `score` head.

`build_model(dims, ps, role=...)` returns a `MegatronModel`: the model chunks (one per
virtual pipeline stage on this rank), the TransformerConfig, the name map, and the
layer offsets that turn local parameter names into global ones. Layer spec: Transformer
Engine on GPU when it is installed, Megatron-Core's local spec on CPU.

This module does not know about PPO, data, or the rollout engine.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from megappo.models import packed_rope
from megappo.models.hf_config import ModelConfigError, ModelDims, transformer_config
from megappo.models.lora import NO_LORA, LoRA, apply_lora
from megappo.models.name_map import NameMap, TensorRule, global_param_name, name_map_for
from megappo.models.precision import Precision, precision_of
from megappo.models.recompute import NO_RECOMPUTE, Recompute
from megappo.parallel.state import ParallelState

ROLES = ("actor", "ref", "critic", "reward")
VALUE_ROLES = ("critic", "reward")
TRAINED_ROLES = ("actor", "critic")


class ValueHead(torch.nn.Module):
    """Scalar head that stands in for GPTModel's output layer: [S, B, H] -> [S, B, 1].

    Replicated across TP (every TP rank holds the full hidden state after the final norm),
    so its weight and gradient are identical on all TP ranks without communication.
    Called with the output layer's signature so GPTModel's post-processing is unchanged.

    Under sequence parallelism the final norm's output is split along S over the TP ranks
    ([S/tp, B, H]): the head first gathers it, as the LM head's ColumnParallelLinear does, so
    every TP rank computes the same [S, B, 1]; the gather's backward hands each rank its own
    S/tp slice of that (identical) gradient, so nothing is summed twice. `sequence_parallel` is
    also what GPTModel and megappo.models.forward read to know the input is split.
    """

    def __init__(self, hidden_size: int, *, bias: bool, init_std: float, dtype: torch.dtype, seed: int = 0,
                 sequence_parallel: bool = False, tp_group=None):
        super().__init__()
        # its own generator: the same init on every rank and at every TP/PP layout
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(1, hidden_size, generator=gen).mul_(init_std).to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None
        self.sequence_parallel = sequence_parallel  # read by GPTModel._postprocess and forward._selected_outputs
        self.tp_group = tp_group

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                                 group=self.tp_group)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


@dataclasses.dataclass
class MegatronModel:
    """One role's model on this rank: chunks + how to name their parameters globally."""

    role: str
    dims: ModelDims
    config: object  # megatron.core.transformer.TransformerConfig
    chunks: list[torch.nn.Module]  # GPTModel per virtual stage (DDP-wrapped after setup)
    name_map: NameMap
    ps: ParallelState
    padded_vocab: int
    lora: LoRA = NO_LORA  # the adapters megappo.models.lora.apply_lora added (rank 0: none)

    @property
    def precision(self) -> Precision:
        return precision_of(self.config.params_dtype)

    @property
    def has_value_head(self) -> bool:
        return self.role in VALUE_ROLES

    def named_parameters(self) -> Iterator[tuple[str, TensorRule, torch.nn.Parameter]]:
        """(global Megatron name, rule, local shard) for every parameter of the model's name map on
        this rank (global layer numbers, and global expert numbers: this EP rank's experts are
        ep_rank * E/ep + k); LoRA adapters are not among them (megappo.models.lora)."""
        expert_offset = self.ps.ep_rank * (self.dims.num_experts // self.ps.ep)
        for chunk in self.chunks:
            module = unwrap(chunk)
            # layers of a chunk are contiguous; layer_number is global and 1-based
            offset = module.decoder.layers[0].layer_number - 1 if len(module.decoder.layers) else 0
            for local_name, param in module.named_parameters():
                if getattr(param, "lora_adapter", False):
                    continue
                name = global_param_name(local_name, offset, expert_offset)
                yield name, self.name_map.rule(name), param


def moe_routers(chunk: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(global 0-based layer index, Megatron TopKRouter) of every MoE layer of a model chunk."""
    out = []
    for layer in unwrap(chunk).decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            out.append((layer.layer_number - 1, router))
    return out


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def _layer_spec(kind: str, config, vp_stage: int | None):
    """The layer spec (dense) or this virtual stage's block spec (MoE: dense and MoE layers
    as `config.moe_layer_freq` says) for Megatron's local or Transformer Engine modules."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if kind == "auto":
        kind = "te" if torch.cuda.is_available() and _have_te() else "local"
    moe = bool(config.num_moe_experts)
    if kind == "te":
        if not _have_te():
            raise ModelConfigError(
                "model.layer_spec=te needs transformer-engine; install the gpu extra or set model.layer_spec=local."
            )
        if moe:
            return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    from megappo.models.packed_attention import PackedDotProductAttention

    if moe:
        spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                vp_stage=vp_stage)
        layers = spec.layer_specs
    else:
        spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
        layers = [spec]
    # the local spec's core attention, plus packed (THD) sequences: megappo.models.packed_attention; the
    # kernel it runs is megappo.models.attention_dispatch's choice (TE's spec above does its own THD attention)
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec


def _moe_without_te_fix() -> None:
    """megatron-core 0.16.1's router linear (moe_utils.RouterGatingLinearFunction) reads
    `te_general_gemm`, which is only defined when Transformer Engine imports; without TE it
    raises NameError. Define it as None, the value its code checks for (plain matmul path)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_model(
    dims: ModelDims,
    ps: ParallelState,
    *,
    role: str = "actor",
    dtype: str = "float32",
    layer_spec: str = "auto",
    make_vocab_size_divisible_by: int = 128,
    value_head_bias: bool = True,
    value_head_seed: int = 0,
    recompute: Recompute = NO_RECOMPUTE,
    lora: LoRA = NO_LORA,
    **config_overrides,
) -> MegatronModel:
    """Build this rank's chunks of a role's model (in the layout `ps`). Weights are randomly
    initialised; load real ones with `megappo.models.weights.load_hf_weights`. `recompute`: the
    activation recomputation of a trained role (megappo.models.recompute); `lora`: its LoRA
    adapters (megappo.models.lora; every other weight frozen but a value head)."""
    if lora.enabled and role not in TRAINED_ROLES:
        raise ModelConfigError(f"LoRA adapters are for the trained roles (actor, critic), not the {role} model.")
    if lora.enabled and layer_spec == "auto":
        layer_spec = "local"  # Megatron's tensor-parallel linears, which megappo.models.lora adapts (TE's fused ones not)
    packed_rope.install()  # RoPE of packed sequences without host reads (megappo.models.packed_rope)
    with ps.active():
        model = _build_model(dims, ps, role=role, dtype=dtype, layer_spec=layer_spec,
                             make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                             value_head_bias=value_head_bias, value_head_seed=value_head_seed, recompute=recompute,
                             **config_overrides)
        if lora.enabled:
            apply_lora(model, lora, seed=value_head_seed, trainable_prefixes=("output_layer.",) if role in VALUE_ROLES
                       else ())
    return model


def _context_parallel_spec(dims: ModelDims, cp: int, layer_spec: str) -> str:
    """The layer spec under context parallelism: the local one, whose core attention
    (megappo.models.packed_attention) exchanges K/V over the CP group; what CP does not cover yet is refused."""
    if layer_spec == "te":
        raise ModelConfigError(f"parallel.cp={cp} runs in megappo's own packed attention, which the local layer "
                               "spec uses; Transformer Engine's spec is not wired for it yet. Fix: set "
                               "model.layer_spec=local (or auto), or parallel.cp=1.")
    if dims.is_moe:
        raise ModelConfigError(f"parallel.cp={cp} with a mixture-of-experts model is not supported yet (routing "
                               "records and the router's auxiliary loss are not split over the CP group). Fix: set "
                               "parallel.cp=1 for this model.")
    return "local"


def _build_model(dims, ps, *, role, dtype, layer_spec, make_vocab_size_divisible_by, value_head_bias,
                 value_head_seed, recompute, **config_overrides) -> MegatronModel:
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel

    if role not in ROLES:
        raise ValueError(f"unknown role '{role}'; roles: {ROLES}")
    dims.check_layout(ps.tp, ps.pp, ps.vpp, ep=ps.ep)
    cpu = ps.device.type == "cpu"
    if config_overrides.get("sequence_parallel"):
        if cpu:
            raise ModelConfigError("parallel.sequence_parallel needs Transformer Engine or apex norms (GPU); "
                                   "Megatron-Core's torch norms do not support it. Set it to false on CPU.")
    if dims.is_moe and ps.tp > 1 and not config_overrides.get("sequence_parallel"):
        # Megatron's MoELayer refuses to train with TP > 1 unless sequence parallelism is on.
        raise ModelConfigError(
            f"a mixture-of-experts model with tp={ps.tp} needs parallel.sequence_parallel=true (Megatron-Core "
            "trains MoE layers under tensor parallelism only with sequence parallelism, which needs GPU norms). "
            "Fix: set parallel.sequence_parallel=true on GPU, or use tp=1 and split the experts with parallel.ep."
        )
    if recompute.enabled and role not in TRAINED_ROLES:
        raise ModelConfigError(f"{recompute.key}: the {role} model only runs forward passes, which keep no "
                               "activations for backward, so there is nothing to recompute. Fix: remove it; "
                               "recomputation is for the trained roles (actor.recompute, critic.recompute).")
    recompute.check(dims, pp=ps.pp, vpp=ps.vpp, cpu=cpu)
    if ps.cp > 1:
        layer_spec = _context_parallel_spec(dims, ps.cp, layer_spec)
        config_overrides = {**config_overrides, "context_parallel_size": ps.cp}
    config = transformer_config(dims, tp=ps.tp, pp=ps.pp, vpp=ps.vpp, ep=ps.ep, dtype=dtype, cpu=cpu,
                                **recompute.transformer_config_kwargs(), **config_overrides)
    if dims.is_moe:
        _moe_without_te_fix()
    padded_vocab = dims.padded_vocab_size(ps.tp, make_vocab_size_divisible_by)
    value_head = role in VALUE_ROLES
    chunks = []
    for vp_stage in range(ps.vpp or 1):
        vp = vp_stage if ps.vpp else None
        spec = _layer_spec(layer_spec, config, vp)
        pre = mps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = mps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab,
            max_sequence_length=dims.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=dims.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_base=int(dims.rope_theta) if float(dims.rope_theta).is_integer() else dims.rope_theta,
            rope_scaling=dims.rope_scaling_factor is not None,
            rope_scaling_factor=dims.rope_scaling_factor or 8.0,
            vp_stage=vp,
        )
        if value_head and post:
            model.output_layer = ValueHead(dims.hidden_size, bias=value_head_bias, init_std=dims.initializer_range,
                                           dtype=config.params_dtype, seed=value_head_seed,
                                           sequence_parallel=config.sequence_parallel,
                                           tp_group=mps.get_tensor_model_parallel_group())
        Precision(dtype).cast_(model)  # the norms too, as Megatron's Float16Module does
        if not cpu:
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    name_map = name_map_for(dims, padded_vocab=padded_vocab, value_head=value_head,
                            value_head_bias=value_head_bias)
    return MegatronModel(role=role, dims=dims, config=config, chunks=chunks, name_map=name_map,
                         ps=ps, padded_vocab=padded_vocab)
