"""From a HuggingFace config to the numbers megappo's models need (no torch.distributed).

`ModelDims` is the architecture-neutral description of a decoder (layers, heads, query
groups, head dim, vocab and its TP padding, RoPE, norms, biases, tying, and for MoE
families the experts, top-k, router normalisation and the per-layer dense/MoE pattern). It is read from
an HF `config.json` (a dict or a transformers config object) for the families in
`SUPPORTED_ARCHS`, and validated against a TP x PP (x EP) layout before any model is built.
A setting that transformers has written under more than one name (`KEY_NAMES`) is read under
each of them, so a config.json saved by an older or a newer transformers reads the same.
`transformer_config(dims, ...)` turns it into a Megatron-Core `TransformerConfig`.

This module does not know about process groups, weights or the name map.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from megappo.errors import ModelConfigError  # noqa: F401 - re-exported: megappo.models.hf_config.ModelConfigError


#: HF architecture name -> family. The family decides biases and name-map details.
SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}

#: families whose MLPs are (some or all) mixtures of experts
MOE_FAMILIES = ("qwen3_moe", "mixtral")


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """Architecture numbers of a Llama/Qwen-style decoder (dense or mixture-of-experts),
    independent of parallelism."""

    arch: str  # HF architecture name, a key of SUPPORTED_ARCHS
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int  # = num_key_value_heads (GQA); == num_heads for MHA
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int  # the tokenizer/HF vocab (rows of embed_tokens)
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    initializer_range: float = 0.02
    rope_scaling_factor: float | None = None  # Llama-3.1 style scaling, None = off
    qk_layernorm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head
    # -- mixture of experts (num_experts == 0: a dense model) --
    num_experts: int = 0  # routed experts per MoE layer (HF num_experts / num_local_experts)
    moe_topk: int = 0  # experts per token (HF num_experts_per_tok)
    moe_ffn_hidden_size: int = 0  # each expert's ffn size (HF moe_intermediate_size; Mixtral: intermediate_size)
    #: True: the top-k probabilities are renormalised to sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob)
    moe_norm_topk_prob: bool = False
    moe_layer_pattern: tuple[int, ...] = ()  # per layer: 1 = MoE MLP, 0 = dense MLP (ffn_hidden_size)
    moe_aux_loss_coef: float = 0.0  # HF router_aux_loss_coef: the load-balancing loss weight

    def __post_init__(self):
        # a tuple whatever it was read from (checkpoint metadata is JSON: a list)
        object.__setattr__(self, "moe_layer_pattern", tuple(self.moe_layer_pattern))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHS[self.arch]

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Vocab rows Megatron allocates: a multiple of divisible_by * tp (zero-padded)."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def check_layout(self, tp: int, pp: int, vpp: int | None = None,
                     names: tuple[str, str] = ("parallel.tp", "parallel.pp"), ep: int = 1,
                     ep_name: str = "parallel.ep") -> None:
        """Raise ModelConfigError when TP/PP (and VPP, EP) do not divide this model; the fix names
        the settings as `names` (the command-line tools: ("--tp", "--pp"))."""
        problems = []
        if ep > 1 and not self.is_moe:
            raise ModelConfigError(f"{ep_name}={ep} needs a mixture-of-experts model; {self.arch} is dense. "
                                   f"Fix: set {ep_name}=1.")
        if self.is_moe and self.num_experts % ep:
            valid_ep = [e for e in range(1, self.num_experts + 1) if self.num_experts % e == 0]
            raise ModelConfigError(f"num_experts={self.num_experts} is not divisible by {ep_name}={ep}. "
                                   f"Fix: choose {ep_name} from {valid_ep}.")
        if self.is_moe and self.moe_ffn_hidden_size % tp:
            problems.append(f"moe_intermediate_size={self.moe_ffn_hidden_size} is not divisible by tp={tp}")
        if self.num_heads % tp:
            problems.append(f"num_attention_heads={self.num_heads} is not divisible by tp={tp}")
        if self.num_query_groups % tp:
            problems.append(
                f"num_key_value_heads={self.num_query_groups} is not divisible by tp={tp}"
            )
        if self.ffn_hidden_size % tp:
            problems.append(f"intermediate_size={self.ffn_hidden_size} is not divisible by tp={tp}")
        chunks = pp * (vpp or 1)
        if self.num_layers % chunks:
            what = f"pp*vpp={pp}*{vpp}" if vpp else f"pp={pp}"
            problems.append(f"num_hidden_layers={self.num_layers} is not divisible by {what}")
        if problems:
            valid_tp = [t for t in range(1, self.num_query_groups + 1)
                        if self.num_query_groups % t == 0 and self.num_heads % t == 0
                        and self.ffn_hidden_size % t == 0]
            valid_pp = [p for p in range(1, self.num_layers + 1) if self.num_layers % p == 0]
            raise ModelConfigError(
                "the parallel layout does not fit the model: " + "; ".join(problems)
                + f". Fix: choose {names[0]} from {valid_tp} and {names[1]} from {valid_pp}."
            )


#: a setting -> every name config.json has held it under, the name in messages first. transformers
#: (5.x) writes the expert count of Qwen3-MoE as `num_local_experts` (its config's attribute_map
#: makes `num_experts` an alias), where the Hub's Qwen3-MoE configs and earlier releases wrote
#: `num_experts`; Mixtral writes `num_local_experts`. (RoPE's `rope_theta` moving into
#: `rope_parameters` is read by `_rope`; `torch_dtype` -> `dtype` by megappo.models.precision.)
KEY_NAMES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "num_local_experts"),
}


def _get(cfg: Mapping[str, Any], key: str, default: Any = None, required: bool = True) -> Any:
    names = KEY_NAMES.get(key, (key,))
    found = {name: cfg[name] for name in names if cfg.get(name) is not None}
    if len(set(map(repr, found.values()))) > 1:
        given = " and ".join(f"{name}={value!r}" for name, value in found.items())
        raise ModelConfigError(f"HF config gives {given}: the same setting under {len(found)} names, with different "
                               f"values. Fix: keep one of them in config.json.")
    if found:
        return next(iter(found.values()))
    if required and default is None:
        also = " (or " + " / ".join(f"'{n}'" for n in names[1:]) + ")" if len(names) > 1 else ""
        raise ModelConfigError(f"HF config is missing '{key}'{also}; it is required for {cfg.get('architectures')}.")
    return default


def _rope(cfg: Mapping[str, Any]) -> tuple[float, float | None]:
    # transformers >= 5 keeps RoPE settings in rope_parameters; older configs at top level.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "llama3":
        # Megatron-Core's rope scaling implements Llama-3.1's with these constants.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if key in merged and float(merged[key]) != value:
                raise ModelConfigError(
                    f"rope scaling {key}={merged[key]} is not supported (Megatron-Core assumes {value})."
                )
        return float(theta), float(merged.get("factor", 8.0))
    raise ModelConfigError(
        f"rope_type '{rope_type}' is not supported; supported: default, llama3."
    )


def dims_from_hf(cfg: Mapping[str, Any] | Any, arch: str | None = None) -> ModelDims:
    """Read ModelDims from an HF config (dict, transformers config, or a directory path)."""
    if isinstance(cfg, (str, os.PathLike)):
        cfg = load_hf_config(cfg)
    if not isinstance(cfg, Mapping):
        cfg = cfg.to_dict()
    archs = cfg.get("architectures") or []
    if arch is None:
        if not archs:
            model_type = cfg.get("model_type")
            guess = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}.get(model_type)
            if guess is None:
                raise ModelConfigError(
                    "HF config names no 'architectures'; set model.arch to one of "
                    f"{sorted(SUPPORTED_ARCHS)}."
                )
            archs = [guess]
        arch = archs[0]
    if arch not in SUPPORTED_ARCHS:
        raise ModelConfigError(
            f"architecture '{arch}' is not in megappo's registry. Fix: use a model of a supported architecture "
            f"{sorted(SUPPORTED_ARCHS)} (or set model.arch if config.json names a compatible one)."
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={cfg['hidden_act']!r} is not supported (SwiGLU/silu only).")
    if cfg.get("mlp_bias"):
        raise ModelConfigError("mlp_bias=True is not supported.")
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    groups = int(_get(cfg, "num_key_value_heads", heads, required=False))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % groups:
        raise ModelConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}.")
    theta, factor = _rope(cfg)
    family = SUPPORTED_ARCHS[arch]
    qkv_bias = True if family == "qwen2" else bool(cfg.get("attention_bias", False))
    if family in ("llama", "qwen3", "qwen3_moe", "mixtral") and cfg.get("attention_bias"):
        # Llama's (and Qwen3's) attention_bias also adds an o_proj bias that Megatron's spec has no slot for.
        raise ModelConfigError(f"{arch} with attention_bias=True is not supported.")
    # transformers >= 5 writes each layer's attention kind (Qwen2/Qwen3: sliding from max_window_layers on)
    other_kinds = sorted(set(cfg.get("layer_types") or ()) - {"full_attention"})
    if other_kinds:
        raise ModelConfigError(f"layer_types names {other_kinds} layers; only full attention is supported (no "
                               "sliding-window attention). Fix: a model whose layer_types are all 'full_attention' "
                               "(use_sliding_window=false).")
    return ModelDims(**_moe_dims(cfg, family, int(_get(cfg, "num_hidden_layers"))),
        arch=arch,
        num_layers=int(_get(cfg, "num_hidden_layers")),
        hidden_size=hidden,
        num_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=int(_get(cfg, "intermediate_size")),
        vocab_size=int(_get(cfg, "vocab_size")),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096, required=False)),
        rope_theta=theta,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6, required=False)),
        qkv_bias=qkv_bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        rope_scaling_factor=factor,
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
    )


def _moe_dims(cfg: Mapping[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of ModelDims (empty for dense families)."""
    if family not in MOE_FAMILIES:
        return {}
    if cfg.get("use_sliding_window") or (family == "mixtral" and cfg.get("sliding_window")):
        raise ModelConfigError(f"sliding-window attention is not supported ({family}). Fix: set sliding_window "
                               "to null (use_sliding_window=false) in config.json.")
    experts = int(_get(cfg, "num_experts"))  # num_experts or num_local_experts (KEY_NAMES)
    if family == "mixtral":
        ffn = int(_get(cfg, "intermediate_size"))
        pattern = (1,) * num_layers
        norm_topk = True  # softmax over the top-k logits
    else:
        ffn = int(_get(cfg, "moe_intermediate_size"))
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        # transformers' Qwen3MoeDecoderLayer: MoE iff not in mlp_only_layers and (i + 1) % step == 0
        pattern = tuple(int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(num_layers))
        norm_topk = bool(cfg.get("norm_topk_prob", False))
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelConfigError("shared experts are not supported yet (shared_expert_intermediate_size).")
    topk = int(_get(cfg, "num_experts_per_tok"))
    if not 0 < topk <= experts:
        raise ModelConfigError(f"num_experts_per_tok={topk} must be in [1, num_experts={experts}].")
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=ffn, moe_norm_topk_prob=norm_topk,
                moe_layer_pattern=pattern, moe_aux_loss_coef=float(cfg.get("router_aux_loss_coef") or 0.0))


def load_hf_config(path: str | os.PathLike) -> dict:
    """Read `config.json` from an HF model directory, with a clear error when absent."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ModelConfigError(f"no config.json in '{path}': not an HF model directory. Fix: point model.path "
                               "(critic.path, reward.model_path) at a directory with config.json and safetensors.")
    with open(file) as f:
        return json.load(f)


def transformer_config(
    dims: ModelDims,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    dtype: str = "float32",
    sequence_parallel: bool = False,
    cpu: bool = True,
    **overrides: Any,
):
    """A Megatron-Core TransformerConfig for `dims` at the given layout and dtype."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    from megappo.models.precision import Precision

    dims.check_layout(tp, pp, vpp, ep=ep)
    kwargs = dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_query_groups,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=dims.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=dims.initializer_range,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel,
        **Precision(dtype).transformer_config_kwargs(),
        use_cpu_initialization=cpu,
        # megappo's losses are normalised by global token/sequence counts already
        # (megappo.ppo.losses); Megatron must not divide again by the micro-batch count.
        calculate_per_token_loss=True,
        # gloo: the batched p2p path is wrong for PP=2 with VPP and needs CUDA syncs.
        batch_p2p_comm=not cpu,
        batch_p2p_sync=not cpu,
    )
    if dims.is_moe:
        kwargs.update(moe_settings(dims, ep=ep))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_settings(dims: ModelDims, *, ep: int = 1) -> dict[str, Any]:
    """Megatron-Core MoE settings that route and weight tokens the way transformers does.

    Router: softmax over all experts then top-k (Qwen3-MoE, norm_topk_prob=False: Megatron's
    pre-softmax), or top-k logits then softmax (Mixtral, and Qwen3-MoE with norm_topk_prob: the
    same as renormalising). No capacity, so no token is dropped and logits equal transformers'.
    Load balancing: the Switch-style aux loss weighted by HF's router_aux_loss_coef.
    """
    aux = dims.moe_aux_loss_coef
    return dict(
        num_moe_experts=dims.num_experts,
        moe_router_topk=dims.moe_topk,
        moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
        moe_layer_freq=list(dims.moe_layer_pattern),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not dims.moe_norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
    )
