"""`megappo plan`: does a recipe's layout fit the model, and its memory the GPUs? No model is built.

`make_plan(cfg, world_size=None, gpu_mem_gib=None, hf_config=None) -> Plan` checks the layout
(`Config.validate_world` for the batch split over data-parallel replicas, `ModelDims.check_layout`
for TP/PP/VPP against heads, query groups, FFN and layers, the SGLang engine's tp size against
the heads, the rollout replicas' GPUs against the nodes) and estimates the memory of each kind of GPU (a
pipeline stage's, with or without an engine or a staged update), role by role; the plan is the worst
GPU's, with every kind's total beside it; `format_plan(plan)` prints it.
Layout errors raise ConfigError / ModelConfigError naming the fix (the CLI exits 2); a plan that
does not fit exits 1, with the changes that megappo.plan.fixes finds by planning them.

The hardware comes from the recipe's `hardware` section (world size = nodes x gpus_per_node, memory
= gpu_memory_gib) unless `world_size` / `gpu_mem_gib` are given (--world-size, --gpu-mem). With
hardware.device=cpu a "GPU" is one gloo rank: its reserve is CPU_RESERVE_GIB (no CUDA context), and
the `hf` rollout engine's copy of the model counts on rank 0.

The architecture comes from, in order: `--hf-config FILE`, `model.hf_config`, `model.path/config.json`,
or `KNOWN_MODELS[basename(model.path)]` (public config.json numbers of a few well-known models),
so a recipe can be planned on a machine without the weights.

The estimate, per GPU, in bytes (P = parameters this GPU holds, d = data-parallel size):
  trained roles (actor, critic), Megatron's mixed-precision bookkeeping (its distributed-optimizer
  table): weights P x 2 (bf16/fp16) or 4 (fp32); gradients P x 4 (megappo reduces in fp32, a
  main_grad buffer that the distributed optimizer does not shard); fp32 master weights P x 4 (half
  precision only) and Adam moments P x 8, both / d with parallel.use_distributed_optimizer (a MoE
  model's experts / (d / ep), their expert-data-parallel ranks).
  LoRA roles (actor.lora / critic.lora, megappo.models.lora): the frozen base weights P x 2/4 plus
  the adapters (`lora_params`); gradients, master weights and Adam moments for the adapters,
  modules_to_save and a value head only; a reference that is the actor's base holds no weights.
  ref / reward model: weights only. P is the worst pipeline stage's share: layers / pp of each
  layer's matrices / tp (norms replicated; a MoE layer's experts / ep, its router replicated), plus
  the embedding / tp on the first stage and the
  output layer / tp (a value head for critic and reward) on the last.
  activations, per transformer layer and micro-batch of b sequences of s = data.max_prompt_length
  + rollout.max_new_tokens tokens, no recomputation: Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", Sec. 4) count s*b*h*(34 + 5*a*s/h) bytes for a GPT
  layer (16-bit activations, 4h GeLU MLP, dropout). Recounted term by term for a Llama/Qwen2 layer
  (no dropout, GQA with q = heads*head_dim and kv = groups*head_dim, SwiGLU with FFN size f), in
  elements: 4h per token kept on every TP rank unless sequence parallel splits them (the two norm
  inputs, the QKV and FC1 inputs) and q + 2kv + q + 3f per token split over TP (Q, K, V, the
  attention output, the gate and up projections, the SwiGLU output); with h = q = kv and the GeLU
  MLP (4h + 4h, plus the dropout masks) this is the paper's count. Unfused attention
  (layer_spec=local) adds the paper's 5*a*s^2*b bytes of attention probabilities / tp; TE's fused
  attention (te, and auto on a GPU) stores none. A pipeline stage holds L/pp layers for the
  micro-batches in flight: pp - rank with 1F1B, (pp - rank - 1)*2 + (vpp - 1)*pp + 1 model chunks
  of L/(pp*vpp) layers with the interleaved schedule (Megatron's warm-up counts), at most the
  micro-batches of one mini-batch. The last stage of an LM role also holds one micro-batch of
  [b, s, V/tp] logits in the model dtype plus three float32 copies (the vocab-parallel log-prob
  and entropy pass; the copies' margin covers the logits' gradient in training); with the chunked LM
  head (model.lm_head_chunk_tokens = c) the same count for one chunk of [c, V/tp] logits (c at most
  the micro-batch's tokens), plus in training one [V/tp, H] weight-gradient product in the model
  dtype. Forward-only passes (ref, reward) keep one layer and the logits. Phases run
  one after another, so only the largest activation counts towards the peak.
  recomputation (actor.recompute / critic.recompute, megappo.models.recompute): full keeps, per
  model chunk and micro-batch in flight, the input [s, b, h] of each checkpointed group of layers
  (uniform: every group of n; block: the first n layers, the others whole) plus one group's full
  activations rebuilt in backward; selective drops its modules' insides from every layer
  (core_attn: the unfused 5*a*s^2*b term; mlp: the dense 3f; moe: the experts' copies).
  engines (rollout.replicas = R, megappo.rollout.replicas): replica i's engine is led by global rank
  L_i = i * world // R and colocated with the trainer: an SGLang replica spans the GPUs of ranks
  [L_i, L_i + rollout.sglang.tp_size) of L_i's node (its base_gpu_id is L_i's local GPU), the hf engine
  L_i's GPU (or, hardware.device=cpu, L_i's host memory). The spans must be disjoint and each within one
  node (`Placement`). Every GPU of a span carries its engine; a GPU of no span carries none. SGLang (per
  engine GPU): started after the trainer's models are built, it sizes its static pool (weights / tp +
  KV cache) as mem_fraction_static times the memory free when it starts and leaves the rest; Adam
  moments (created at the first optimizer step) and activations must then fit in that rest. The hf
  engine (hardware.device=gpu, rollout.placement=colocated) in the model dtype: its weights (all
  parameters x dtype bytes) stay there, and its preallocated KV cache holds every sample of its chunk of
  a step at once: ceil(data.train_batch_size / R) prompts x rollout.n rows (R equal chunks of whole
  prompts, every prompt at the longest length) of s positions x 2 (K, V) x layers x KV heads x head dim x
  dtype bytes. The KV cache is freed after the generation (rollout.mode=sync), so it counts as one more
  phase (the largest of it and the activations); with one_step_off / async, generation overlaps
  training and both count. `rollout.placement=separate` keeps the hf engine on the host, and
  sync_mode=distributed puts each SGLang replica on rollout.sglang.tp_size GPUs of its own after the
  trainer's on its leader's node (a node holding k leaders needs k x tp_size GPUs more): neither is
  planned on the trainer's GPUs.
  staged update: a leader other than rank 0 gathers each weight update whole from its pipeline
  (megappo.rollout.bridge) and keeps that copy, all parameters x dtype bytes, in host memory until rank
  0's sequence of engine calls reaches the sync and it applies it (docs/engines.md, "Replicas"; rank 0
  streams bucket by bucket instead). A GPU plan does not count it in a GPU's total; it names those ranks
  and the host memory each node needs for them. With hardware.device=cpu a rank's memory is host memory:
  there it is one more phase beside the activations with rollout.mode=sync (the larger counts), and on
  top of them with one_step_off / async, where an update may wait while the trainer runs.
  reserve: RESERVE_GIB per GPU for the CUDA context, NCCL buffers and allocator slack, and
  ENGINE_RESERVE_GIB on engine GPUs for SGLang's CUDA graphs and sampling buffers (outside its pool).

It does not know the allocator's fragmentation, Transformer Engine's workspaces, NCCL's real
buffer sizes, SGLang's internals beyond its pool formula, or a rank order other than node by node
(torchrun's, which it assumes); treat the totals as estimates within a few GiB. It imports neither
torch nor megatron.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import os
import types
from typing import Any, Optional

from megappo.config import Config, lora_saved_modules, lora_targets
from megappo.errors import ConfigError
from megappo.models.hf_config import ModelConfigError, ModelDims, dims_from_hf
from megappo.models.recompute import Recompute
from megappo.rollout.hf.decode_paths import static_unsupported

GIB = float(1 << 30)
RESERVE_GIB = 3.0  # per GPU: CUDA context, NCCL buffers, allocator slack
CPU_RESERVE_GIB = 1.0  # per rank with hardware.device=cpu: the Python process with torch, Megatron and gloo
ENGINE_RESERVE_GIB = 3.0  # per engine GPU, outside SGLang's static pool: CUDA graphs, sampling buffers
SGLANG_DEFAULTS = {"tp_size": 1, "mem_fraction_static": 0.5}  # megappo.rollout.sglang_engine.SGLangEngine
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "rope_theta": 1000000.0, "max_position_embeddings": 32768, "vocab_size": 152064,
          "tie_word_embeddings": False}
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "rope_theta": 500000.0, "max_position_embeddings": 131072, "vocab_size": 128256,
           "tie_word_embeddings": False,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
_QWEN25_7B = {**_QWEN2, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4}
_QWEN25_72B = {**_QWEN2, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
               "num_attention_heads": 64, "num_key_value_heads": 8}
_LLAMA31_8B = {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8}
_LLAMA33_70B = {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8}
_QWEN3 = {"model_type": "qwen3", "hidden_act": "silu", "rope_theta": 1000000.0, "max_position_embeddings": 40960,
          "vocab_size": 151936, "tie_word_embeddings": False, "head_dim": 128, "rms_norm_eps": 1e-6,
          "attention_bias": False}
_QWEN3_8B = {**_QWEN3, "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
             "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8}
_QWEN3_30B_A3B = {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "router_aux_loss_coef": 0.001}
_SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
                 "rope_theta": 100000.0, "max_position_embeddings": 8192}

#: HF model name (the directory's basename, compared case-insensitively) -> the architecture part of
#: its public config.json. Used only when model.path has no config.json (planning without weights).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen2.5-7B": _QWEN25_7B,
    "Qwen2.5-7B-Instruct": _QWEN25_7B,
    "Qwen2.5-72B": _QWEN25_72B,
    "Qwen2.5-72B-Instruct": _QWEN25_72B,
    "Llama-3.1-8B": _LLAMA31_8B,
    "Llama-3.1-8B-Instruct": _LLAMA31_8B,
    "Llama-3.3-70B-Instruct": _LLAMA33_70B,
    "Qwen3-8B": _QWEN3_8B,
    "Qwen3-30B-A3B": _QWEN3_30B_A3B,
    "SmolLM2-135M": _SMOLLM2_135M,
    "SmolLM2-135M-Instruct": _SMOLLM2_135M,
}


# -- where the architecture comes from -----------------------------------------------------------

def _read_config_file(path: str) -> dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            return json.load(f)
    except OSError as e:
        raise ModelConfigError(f"cannot read HF config '{file}': {e.strerror}. Fix: pass --hf-config "
                               f"path/to/config.json (or the model directory).") from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"HF config '{file}' is not valid JSON: {e}. Fix: point --hf-config at the "
                               f"model's config.json.") from None


def resolve_hf_config(path: Optional[str], key: str, *, inline: Optional[dict] = None,
                      override: Optional[str] = None) -> tuple[dict, str]:
    """(HF config dict, where it came from) for the model named by recipe key `key`."""
    if override:
        return _read_config_file(override), f"--hf-config {override}"
    if inline is not None:
        return inline, "model.hf_config"
    assert path is not None  # ModelConfig.check: path or hf_config
    if os.path.isfile(os.path.join(path, "config.json")):
        return _read_config_file(path), os.path.join(path, "config.json")
    name = os.path.basename(os.path.normpath(path))
    known = {k.lower(): (k, v) for k, v in KNOWN_MODELS.items()}
    if name.lower() in known:
        hf_name, cfg = known[name.lower()]
        return cfg, f"built-in dims of {hf_name} (no config.json in {path})"
    raise ModelConfigError(f"{key}={path} has no config.json and '{name}' is not a built-in model "
                           f"({sorted(KNOWN_MODELS)}). Fix: pass --hf-config path/to/config.json, or copy the "
                           f"model's config.json into {path}.")


# -- parameters per GPU ---------------------------------------------------------------------------

def _moe_share(d: ModelDims) -> float:
    """The fraction of layers whose MLP is a mixture of experts (0 for a dense model)."""
    return sum(d.moe_layer_pattern) / d.num_layers if d.is_moe else 0.0


def layer_params(d: ModelDims, tp: int, ep: int = 1, *, active: bool = False) -> float:
    """Parameters of one decoder layer on one TP (x EP) rank, averaged over dense and MoE layers
    (matrices / tp; the two norms, q/k norms and the router replicated). A MoE layer holds
    num_experts / ep experts of 3 * hidden * moe_ffn each; `active`: only the top-k experts
    a token passes through (the parameters that set the FLOPs)."""
    q, kv = d.num_heads * d.head_dim, d.num_query_groups * d.head_dim
    qkv = d.hidden_size * (q + 2 * kv) + ((q + 2 * kv) if d.qkv_bias else 0)
    norms = 2 * d.hidden_size + (2 * d.head_dim if d.qk_layernorm else 0)
    dense_mlp = 3 * d.hidden_size * d.ffn_hidden_size
    share = _moe_share(d)
    experts = d.moe_topk if active else d.num_experts / ep
    moe_mlp = experts * 3 * d.hidden_size * d.moe_ffn_hidden_size
    mlp = (1 - share) * dense_mlp / tp + share * (moe_mlp / tp + d.num_experts * d.hidden_size)
    return (qkv + q * d.hidden_size) / tp + mlp + norms


def total_params(d: ModelDims, *, active: bool = False) -> int:
    """Parameters of the HF model (unpadded vocab; a tied output layer counted once); `active`:
    those one token uses (MoE: top-k experts per layer)."""
    emb = d.vocab_size * d.hidden_size
    return int(d.num_layers * layer_params(d, 1, active=active) + emb * (1 if d.tie_word_embeddings else 2)
               + d.hidden_size)


def stage_params(d: ModelDims, *, tp: int, pp: int, stage: str, value_head: bool, divisible_by: int,
                 ep: int = 1) -> float:
    """Parameters one GPU holds on pipeline `stage` ('all' for pp=1, 'first', 'middle', 'last'); MoE
    layers hold experts / ep."""
    h, vpad = d.hidden_size, d.padded_vocab_size(tp, divisible_by)
    n = d.num_layers // pp * layer_params(d, tp, ep)
    if stage in ("all", "first"):
        n += vpad * h / tp  # word embeddings
    if stage in ("all", "last"):
        n += h  # final norm
        if value_head:
            n += h + 1
        elif not d.tie_word_embeddings or stage == "last":  # tied and pp > 1: the last stage keeps a copy
            n += vpad * h / tp
    return n


def lora_params(d: ModelDims, *, tp: int, pp: int, rank: int, targets: tuple[str, ...], ep: int = 1) -> float:
    """LoRA adapter parameters one GPU holds on a pipeline stage (megappo.models.lora's sharding):
    column-parallel layers (qkv, fc1) hold A [r, in] whole and B [out/tp, r]; row-parallel ones
    (proj, fc2) A [r, in/tp] and B [out, r]. A MoE layer's experts are each adapted (/ ep)."""
    h, q, kv = d.hidden_size, d.num_heads * d.head_dim, d.num_query_groups * d.head_dim
    attn = {"linear_qkv": rank * h + (q + 2 * kv) * rank / tp, "linear_proj": rank * q / tp + h * rank}
    def mlp(f: int) -> float:
        per = {"linear_fc1": rank * h + 2 * f * rank / tp, "linear_fc2": rank * f / tp + h * rank}
        return sum(v for k, v in per.items() if k in targets)
    share = _moe_share(d)
    per_layer = (sum(v for k, v in attn.items() if k in targets) + (1 - share) * mlp(d.ffn_hidden_size)
                 + share * d.num_experts / ep * mlp(d.moe_ffn_hidden_size or 0))
    return d.num_layers // pp * per_layer


# -- activations ----------------------------------------------------------------------------------

def layer_activation_bytes(d: ModelDims, *, seq: int, micro: int, tp: int, sequence_parallel: bool,
                           act_bytes: int, fused_attention: bool, recomputed: tuple[str, ...] = ()) -> float:
    """Activations one TP rank keeps for backward for one layer and one micro-batch (see module doc).
    `recomputed`: selective recomputation's modules, whose insides are not kept (core_attn: the
    unfused attention's [b, a, s, s] terms; mlp: a dense MLP's gate/up and SwiGLU outputs; moe: the
    experts' copies)."""
    h, f = d.hidden_size, d.ffn_hidden_size
    q, kv = d.num_heads * d.head_dim, d.num_query_groups * d.head_dim
    replicated = 4 * h  # two norm inputs, QKV input, FC1 input
    # MoE layers: each token's k expert copies (dispatched input and output, gate+up, SwiGLU output)
    share = _moe_share(d)
    dense = 0 if "mlp" in recomputed else (1 - share) * 3 * f
    experts = 0 if "moe" in recomputed else share * d.moe_topk * (2 * h + 3 * d.moe_ffn_hidden_size)
    split = q + 2 * kv + q + dense + experts  # Q, K, V, attention output, the MLP's
    tokens = seq * micro
    total = act_bytes * tokens * (replicated / (tp if sequence_parallel else 1) + split / tp)
    if not fused_attention and "core_attn" not in recomputed:
        total += 5 * d.num_heads * seq * seq * micro / tp * act_bytes / 2
    return total


def layer_input_bytes(d: ModelDims, *, seq: int, micro: int, tp: int, sequence_parallel: bool,
                      act_bytes: int) -> float:
    """One layer's input [s, b, h] (split over tp with sequence parallelism): what full
    recomputation keeps of a checkpointed group of layers."""
    return act_bytes * seq * micro * d.hidden_size / (tp if sequence_parallel else 1)


def training_activation_bytes(d: ModelDims, *, layers: int, chunks: int, recompute: Recompute, micro: int,
                              **per_layer) -> float:
    """Activations a training pass keeps on one GPU: `chunks` model chunks of `layers` layers in
    flight (micro-batches x virtual stages), each keeping what `recompute` leaves of its layers,
    plus, with full recomputation, the layers rebuilt at once during backward."""
    full = layer_activation_bytes(d, micro=micro, recomputed=recompute.modules, **per_layer)
    inputs, whole = recompute.kept_per_chunk(layers)
    keep = {k: v for k, v in per_layer.items() if k != "fused_attention"}
    per_chunk = inputs * layer_input_bytes(d, micro=micro, **keep) + whole * full
    return chunks * per_chunk + recompute.rebuilt_at_once * full


def logits_bytes(d: ModelDims, *, seq: int, micro: float, tp: int, act_bytes: int, divisible_by: int,
                 chunk_tokens: int = 0, training: bool = False) -> float:
    """The LM head's part of a pass: [tokens, V/tp] logits plus three float32 copies of them, for
    one micro-batch of b x s tokens (today's path, `chunk_tokens` 0) or one chunk of at most
    `chunk_tokens` tokens (the chunked LM head, model.lm_head_chunk_tokens,
    megappo.parallel.chunked_head), which in `training` adds one [V/tp, H] weight-gradient product in
    the model dtype (each chunk's, added to the float32 main_grad that the gradients count)."""
    vocab = d.padded_vocab_size(tp, divisible_by) / tp
    tokens = seq * micro if not chunk_tokens else min(chunk_tokens, seq * micro)
    product = vocab * d.hidden_size * act_bytes if chunk_tokens and training else 0.0
    return tokens * vocab * (act_bytes + 3 * 4) + product


def chunks_in_flight(*, pp: int, vpp: Optional[int], rank: int, micro_batches: int) -> int:
    """Model-chunk micro-batches whose activations pipeline rank `rank` holds at once during training
    (1F1B: pp - rank; interleaved: Megatron's warm-up count), at most those of one mini-batch."""
    v = vpp or 1
    if v == 1:
        chunks = pp - rank
    else:
        chunks = (pp - rank - 1) * 2 + (v - 1) * pp + 1
    return min(chunks, micro_batches * v)


def layers_in_flight(num_layers: int, *, pp: int, vpp: Optional[int], rank: int, micro_batches: int) -> int:
    """Layer-micro-batches whose activations pipeline rank `rank` holds at once during training."""
    return num_layers // (pp * (vpp or 1)) * chunks_in_flight(pp=pp, vpp=vpp, rank=rank, micro_batches=micro_batches)


# -- the plan -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RoleMemory:
    """One role's memory on one GPU, in bytes."""

    role: str
    params: float  # parameters this GPU holds
    weights: float
    grads: float
    master: float  # fp32 master weights (allocated when the optimizer is built)
    adam: float  # Adam moments (allocated at the first optimizer step)
    activations: float
    phase: str  # what the activations are for
    recompute_saving: float = 0.0  # activations full recomputation (uniform, 1 layer) would save; 0 when it is on

    @property
    def optimizer(self) -> float:
        return self.master + self.adam

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """The SGLang engine's share of one of its GPUs, in bytes."""

    tp_size: int
    mem_fraction: float
    weights: float  # engine weights / tp_size
    pool: float  # its static pool: mem_fraction * memory free when it starts
    kv_token_bytes: float  # KV cache bytes per token on one engine GPU

    @property
    def kv_cache(self) -> float:
        return self.pool - self.weights

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_cache // self.kv_token_bytes))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the rollout engines sit on the trainer's ranks (megappo.rollout.replicas): replica i is led by
    global rank i * world // replicas, and its engine holds the GPUs of `width` ranks from there (SGLang:
    rollout.sglang.tp_size; the hf engine: 1; 0 when it holds none of the trainer's GPUs)."""

    world: int
    per_node: int  # ranks (GPUs) of one node; the job's ranks fill node after node
    leaders: tuple[int, ...]
    width: int
    own: int = 0  # GPUs of its own per engine, after the trainer's on its leader's node (sync_mode=distributed)

    @property
    def replicas(self) -> int:
        return len(self.leaders)

    @property
    def spans(self) -> tuple[range, ...]:
        """Each replica's ranks (GPUs), in replica order."""
        return tuple(range(leader, leader + self.width) for leader in self.leaders)

    @functools.cached_property
    def engine_ranks(self) -> frozenset[int]:
        return frozenset(rank for span in self.spans for rank in span)

    @property
    def own_per_node(self) -> int:
        """GPUs a node needs besides its trainer ranks' for the engines of their own it holds at most."""
        nodes = range(self.world // self.per_node)
        return self.own * max(sum(1 for r in self.leaders if r // self.per_node == n) for n in nodes)

    @functools.cached_property
    def stagers(self) -> frozenset[int]:
        """The leaders that stage each update whole before applying it: all but rank 0."""
        return frozenset(self.leaders[1:])

    def kind(self, rank: int) -> str:
        """'leader' (a leader other than rank 0: it stages each update), 'engine' (a GPU of an engine) or
        'trainer' (neither)."""
        return "leader" if rank in self.stagers else "engine" if rank in self.engine_ranks else "trainer"

    @property
    def staged_per_node(self) -> int:
        """Staged updates one node holds at most (its leaders but rank 0)."""
        nodes = range(self.world // self.per_node)
        return max(sum(1 for r in self.stagers if r // self.per_node == n) for n in nodes)

    def replica_of(self, rank: int) -> int:
        """The replica whose leader is `rank`, or whose span holds it (the one led from below it)."""
        return bisect.bisect_right(self.leaders, rank) - 1


def replica_leaders(world_size: int, replicas: int) -> tuple[int, ...]:
    """megappo.rollout.replicas.leaders without importing torch: replica i on rank i * world_size // replicas."""
    return tuple(i * world_size // replicas for i in range(replicas))


def _side_by_side(leaders: tuple[int, ...], per_node: int, width: int) -> bool:
    """Engines of `width` GPUs from each leader are disjoint and each within one node of `per_node` GPUs."""
    return (all(leader % per_node + width <= per_node for leader in leaders)
            and all(b - a >= width for a, b in zip(leaders, leaders[1:])))


def replica_counts(world_size: int, per_node: int, width: int, most: Optional[int] = None) -> list[int]:
    """The rollout.replicas up to `most` (None: the world size) whose engines of `width` GPUs each sit side by
    side (`_side_by_side`; every count when the engines hold no GPU)."""
    return [r for r in range(1, min(world_size, world_size if most is None else most) + 1)
            if _side_by_side(replica_leaders(world_size, r), per_node, width)]


def engine_placement(cfg: Config, world_size: int, per_node: int) -> Placement:
    """The engines' ranks (`Placement`); ConfigError naming the fix when rollout.replicas does not fit the world."""
    r, hw = cfg.rollout, cfg.hardware
    if r.replicas > world_size:
        raise ConfigError(f"rollout.replicas={r.replicas} needs at least as many ranks; the world has {world_size}. "
                          f"Fix: set rollout.replicas between 1 and {world_size}.")
    own = 0
    if r.engine == "sglang":
        width = 0 if r.sync_mode == "distributed" else _engine_args(cfg)[0]
        own = _engine_args(cfg)[0] if r.sync_mode == "distributed" else 0
    else:
        width = 1 if hw.device == "cpu" or r.placement == "colocated" else 0
    placement = Placement(world_size, per_node, replica_leaders(world_size, r.replicas), width, own)
    if not _side_by_side(placement.leaders, per_node, width):
        spans = ", ".join(f"{s.start}-{s.stop - 1}" for s in placement.spans)
        raise ConfigError(
            f"rollout.replicas={r.replicas} with rollout.sglang.tp_size={width}: replica i's engine takes the GPUs of "
            f"ranks [i x {world_size} / {r.replicas}, + {width}) ({spans}), which overlap or cross a node of "
            f"{per_node} GPUs. Fix: choose rollout.replicas from {replica_counts(world_size, per_node, width)}, or a "
            f"smaller rollout.sglang.tp_size.")
    return placement


@dataclasses.dataclass(frozen=True)
class Plan:
    recipe: str
    model: str  # where the architecture came from
    dims: ModelDims
    world_size: int
    tp: int
    pp: int
    vpp: Optional[int]
    padded_vocab: int  # vocabulary rows Megatron allocates at this tp
    dp: int
    seq: int
    dtype: str
    sequence_parallel: bool
    distributed_optimizer: bool
    fused_attention: bool
    stage: str  # the pipeline stage shown (the one with the largest total)
    roles: tuple[RoleMemory, ...]
    engine: Optional[EngineMemory]
    engine_name: str
    gpu_mem: float  # bytes
    reserve: float  # bytes on this GPU outside roles and the engine pool
    hardware: str = ""  # the machines planned and where they came from
    device: str = "gpu"  # hardware.device
    host_engine: float = 0.0  # bytes: the hf engine's model copy on this rank (device=cpu, a replica's leader)
    gpu_engine: float = 0.0  # bytes: the hf engine's weights on this GPU (device=gpu, a replica's leader, colocated)
    gpu_engine_kv: float = 0.0  # bytes: its KV cache during a generation
    #: the hf engine's KV cache is held during the trainer's passes: rollout.mode is not sync (generation
    #: runs during them), or rollout.hf_decode is graphs (auto: for a supported model), whose cache stays
    gen_overlaps: bool = False
    ep: int = 1  # the actor's expert-parallel size (MoE)
    cp: int = 1  # the shared context-parallel size (parallel.cp)
    rank: int = 0  # the global rank of the GPU planned (the first of its kind on its pipeline stage)
    placement: Optional[Placement] = None  # the rollout engines' ranks
    #: bytes: an update staged whole on this rank until its replica applies it (device=cpu, a leader but rank 0)
    staged: float = 0.0
    staged_overlaps: bool = False  # rollout.mode is not sync: a staged update may wait while the trainer runs
    #: every kind of GPU planned: (its ranks, the rank planned, its total in bytes), the worst first
    gpus: tuple[tuple[tuple[int, ...], int, float], ...] = ()

    @property
    def peak_activation(self) -> RoleMemory:
        return max(self.roles, key=lambda r: r.activations)

    @property
    def static(self) -> float:
        """Weights, gradients and optimizer state of every role."""
        return sum(r.weights + r.grads + r.optimizer for r in self.roles)

    @property
    def phases(self) -> float:
        """The largest phase's transient bytes: activations, the hf engine's KV cache, or a staged update
        (the KV cache on top when generation overlaps training; all three when rollout.mode is not sync)."""
        activations = self.peak_activation.activations
        if self.staged_overlaps:
            return activations + self.gpu_engine_kv + self.staged
        if self.gen_overlaps:
            return max(activations, self.staged) + self.gpu_engine_kv
        return max(activations, self.gpu_engine_kv, self.staged)

    @property
    def total(self) -> float:
        engine = self.engine.pool if self.engine else 0.0
        return self.static + self.phases + engine + self.host_engine + self.gpu_engine + self.reserve

    @property
    def fits(self) -> bool:
        """The total within the GPU's memory, and SGLang's KV cache (if any) holding one whole sequence."""
        return self.total <= self.gpu_mem and (self.engine is None or self.engine.kv_tokens >= self.seq)


def _roles_at(cfg: Config, dims: dict[str, ModelDims], world_size: int, stage: str, rank: int) -> list[RoleMemory]:
    """Every role's memory on the GPU that is pipeline stage `stage` (rank `rank`) of the shared
    layout; a role with its own pipeline size is counted at its larger end stage."""
    out = []
    for role in cfg.model_roles:
        if cfg.layout(role)[1] == cfg.parallel.pp:
            out.append(_role_at(cfg, role, dims[role], world_size, stage, rank))
        else:
            pp = cfg.layout(role)[1]
            ends = [("all", 0)] if pp == 1 else [("first", 0), ("last", pp - 1)]
            out.append(max((_role_at(cfg, role, dims[role], world_size, s, r) for s, r in ends),
                           key=lambda r: r.total))
    return out


def fused_attention(cfg: Config) -> bool:
    """TE's fused attention: layer_spec=te, or auto on a GPU (auto on CPU is Megatron's local layers)."""
    return cfg.model.layer_spec == "te" or (cfg.model.layer_spec == "auto" and cfg.hardware.device == "gpu")


def _micro_batch_shape(cfg: Config, role: str) -> tuple[float, int]:
    """(sequences, length) of a role's largest micro-batch in the memory model. Padded:
    micro_batch_size sequences of the longest length. Packed: max_tokens_per_micro_batch tokens,
    as budget / longest sequences of the longest length (its attention is per sequence)."""
    seq = cfg.max_sequence_length
    if not cfg.packs(role):
        return (cfg.ref_micro_batch_size if role == "ref" else getattr(cfg, role).micro_batch_size), seq
    return cfg.max_tokens_per_micro_batch(role) / seq, seq


def _role_at(cfg: Config, role: str, d: ModelDims, world_size: int, stage: str, rank: int) -> RoleMemory:
    p, m = cfg.parallel, cfg.model
    tp, pp, vpp = cfg.layout(role)
    cp = cfg.context_parallel(role)
    dp = world_size // (tp * pp * cp)
    db = DTYPE_BYTES[m.dtype]
    # packed passes attend per sequence without [s, s] scores (TE, or SDPA in the local spec)
    fused = fused_attention(cfg) or cfg.packs(role)
    micro, seq = _micro_batch_shape(cfg, role)
    shard = dp * cp if p.use_distributed_optimizer else 1  # Megatron shards over data parallel x context parallel
    value = role in ("critic", "reward")
    n = stage_params(d, tp=tp, pp=pp, stage=stage, value_head=value, divisible_by=m.make_vocab_size_divisible_by,
                     ep=cfg.expert_parallel(role))
    # context parallelism: a rank's layers hold 1/cp of each micro-batch's tokens, and the whole micro-batch's
    # K/V that attention gathers (megappo.parallel.context), kept for the backward of each layer it keeps
    per_layer = dict(seq=seq / cp, tp=tp, sequence_parallel=p.sequence_parallel, act_bytes=db, fused_attention=fused)
    logits = 0.0 if value or stage in ("first", "middle") else logits_bytes(
        d, seq=seq, micro=micro, tp=tp, act_bytes=db, divisible_by=m.make_vocab_size_divisible_by,
        chunk_tokens=m.lm_head_chunk_tokens, training=role == "actor")
    if role in ("actor", "critic"):
        section = getattr(cfg, role)
        # sequences of the longest length per replica over those per micro-batch (packed: a lower bound)
        micro_batches = max(1, int(section.ppo_mini_batch_size * cfg.rollout.n * cfg.max_sequence_length
                                   // (dp * micro * seq)))
        chunks = 1 if pp == 1 else chunks_in_flight(pp=pp, vpp=vpp, rank=rank, micro_batches=micro_batches)
        recompute = Recompute.of(section.recompute, f"{role}.recompute")
        chunk_layers = d.num_layers // (pp * (vpp or 1))
        kv_layer = 0.0 if cp == 1 else 2 * micro * seq * d.num_query_groups / tp * d.head_dim * db  # one layer's
        full = recompute.granularity == "full"  # full recomputation keeps one layer's gathered K/V, the one redone
        act = training_activation_bytes(d, layers=chunk_layers, chunks=chunks, recompute=recompute, micro=micro,
                                        **per_layer) + logits + kv_layer * (1 if full else chunk_layers * chunks)
        saving = 0.0
        if not full:
            saving = act - logits - kv_layer - training_activation_bytes(
                d, layers=chunk_layers, chunks=chunks, recompute=Recompute("full"), micro=micro, **per_layer)
        # the distributed optimizer shards expert parameters over the expert-data-parallel ranks (dp / ep)
        ep = cfg.expert_parallel(role)
        experts = d.num_layers // pp * _moe_share(d) * d.num_experts / ep * 3 * d.hidden_size * d.moe_ffn_hidden_size / tp
        sharded = (n - experts) / shard + experts / (max(1, dp // ep) if p.use_distributed_optimizer else 1)
        phase = f"{role} update" + (f", {recompute.granularity} recomputation" if recompute.enabled else "")
        if section.lora.rank:  # frozen base weights: gradients and optimizer state for the adapters only
            adapters, trained = _lora_trained(cfg, role, d, tp=tp, pp=pp, stage=stage, ep=ep)
            return RoleMemory(role, n + adapters, weights=(n + adapters) * db, grads=trained * 4,
                              master=trained / shard * 4 if db < 4 else 0.0, adam=trained / shard * 8,
                              activations=act, phase=phase + f", LoRA r={section.lora.rank}",
                              recompute_saving=max(0.0, saving))
        return RoleMemory(role, n, weights=n * db, grads=n * 4, master=sharded * 4 if db < 4 else 0.0,
                          adam=sharded * 8, activations=act, phase=phase, recompute_saving=max(0.0, saving))
    act = layer_activation_bytes(d, micro=micro, **per_layer) + logits
    if role == "ref" and cfg.ref_is_actor_base:  # the actor's weights with its adapters off: nothing of its own
        return RoleMemory(role, 0.0, weights=0.0, grads=0.0, master=0.0, adam=0.0, activations=act,
                          phase="ref forward (the actor's base)")
    return RoleMemory(role, n, weights=n * db, grads=0.0, master=0.0, adam=0.0, activations=act,
                      phase=f"{role} forward")


def _lora_trained(cfg: Config, role: str, d: ModelDims, *, tp: int, pp: int, stage: str,
                  ep: int) -> tuple[float, float]:
    """(adapter parameters, parameters trained) of a LoRA role on one GPU: the adapters, plus
    modules_to_save (lm_head / embed_tokens, vocab / tp on their stages) and a critic's value head,
    which are among the base weights already counted."""
    lora = getattr(cfg, role).lora
    adapters = lora_params(d, tp=tp, pp=pp, rank=lora.rank, targets=lora_targets(lora.target_modules), ep=ep)
    n = adapters
    saved = set(lora_saved_modules(lora.modules_to_save))
    if saved and d.tie_word_embeddings:
        saved = {"lm_head", "embed_tokens"}
    vocab_rows = d.padded_vocab_size(tp, cfg.model.make_vocab_size_divisible_by) * d.hidden_size / tp
    if "embed_tokens" in saved and stage in ("all", "first"):
        n += vocab_rows
    if role == "actor" and "lm_head" in saved and stage in ("all", "last") and not (
            d.tie_word_embeddings and stage == "all"):
        n += vocab_rows
    if role == "critic" and stage in ("all", "last"):
        n += d.hidden_size + 1  # the value head
    return adapters, n


def _engine_args(cfg: Config) -> tuple[int, float]:
    args = {**SGLANG_DEFAULTS, **cfg.rollout.sglang}
    tp_size, frac = args["tp_size"], args["mem_fraction_static"]
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"rollout.sglang.tp_size={tp_size!r} must be an int >= 1. Fix: e.g. "
                          f"rollout.sglang.tp_size=8.")
    if not isinstance(frac, (int, float)) or not 0 < frac < 1:
        raise ConfigError(f"rollout.sglang.mem_fraction_static={frac!r} must be in (0, 1). Fix: e.g. "
                          f"rollout.sglang.mem_fraction_static=0.4.")
    return tp_size, float(frac)


def check_engine_layout(d: ModelDims, tp_size: int, world_size: int | None) -> None:
    """SGLang splits attention heads over its tp size and replicates KV heads when tp > groups.
    `world_size`: the GPUs the engine shares with the trainer; None when it has GPUs of its own."""
    def ok(t: int) -> bool:
        g = d.num_query_groups
        return d.num_heads % t == 0 and (g % t == 0 if t <= g else t % g == 0)

    valid = [t for t in range(1, min(world_size or d.num_heads, d.num_heads) + 1) if ok(t)]
    if not ok(tp_size):
        raise ModelConfigError(f"rollout.sglang.tp_size={tp_size} does not split num_attention_heads="
                               f"{d.num_heads} / num_key_value_heads={d.num_query_groups}. Fix: choose "
                               f"rollout.sglang.tp_size from {valid}.")
    if world_size is not None and tp_size > world_size:
        raise ModelConfigError(f"rollout.sglang.tp_size={tp_size} needs more GPUs than the world size {world_size}. "
                               f"Fix: choose rollout.sglang.tp_size from {valid}.")


def make_plan(cfg: Config, world_size: Optional[int] = None, *, gpu_mem_gib: Optional[float] = None,
              hf_config: Optional[str] = None, recipe: str = "", variant: Optional[str] = None) -> Plan:
    """Check the layout (raises ConfigError / ModelConfigError naming the fix) and estimate the memory of each
    kind of GPU: the plan of the worst, with every kind's total in `gpus`.
    `world_size` / `gpu_mem_gib`: None takes them from the recipe's hardware section, or from the
    recipe's `variant` when `cfg` was loaded with one (its name is then what the plan says they came from)."""
    hw = cfg.hardware
    world_source = "hardware.nodes x hardware.gpus_per_node"
    if world_size is None:
        world_size = cfg.hardware_world_size
    else:
        world_source = "--world-size"
    mem_source = "hardware.gpu_memory_gib" if gpu_mem_gib is None else "--gpu-mem"
    gpu_mem_gib = hw.gpu_memory_gib if gpu_mem_gib is None else gpu_mem_gib
    if gpu_mem_gib <= 0:
        raise ConfigError(f"--gpu-mem {gpu_mem_gib} must be > 0 (GiB per GPU). Fix: e.g. --gpu-mem 80.")
    try:
        cfg.validate_world(world_size)
    except ConfigError as e:
        if world_source == "--world-size":
            raise
        raise ConfigError(f"{e} (world size {world_size} = {world_source}: set hardware.gpus_per_node / hardware.nodes "
                          f"to match, or pass --world-size)") from None
    flags = [flag for flag in (world_source, mem_source) if flag.startswith("--")]
    section = f"the recipe's hardware section with --variant {variant}" if variant else "the recipe's hardware section"
    hardware = hw.describe(world_size, gpu_mem_gib) + (
        f" ({' and '.join(flags)}; the rest from {section})" if flags else f" ({section})")
    p, m = cfg.parallel, cfg.model
    hf, source = resolve_hf_config(m.path, "model.path", inline=m.hf_config, override=hf_config)
    dims = {"actor": dims_from_hf(hf, m.arch)}
    dims["ref"] = dims["actor"]
    dims["critic"] = dims["actor"]
    if cfg.critic.path:
        dims["critic"] = dims_from_hf(resolve_hf_config(cfg.critic.path, "critic.path")[0])
    if cfg.reward.model_path:
        dims["reward"] = dims_from_hf(resolve_hf_config(cfg.reward.model_path, "reward.model_path")[0])
    for role in cfg.model_roles:
        dims[role].check_layout(*cfg.layout(role), ep=cfg.expert_parallel(role))
        if role in ("actor", "critic"):  # recomputation against the layers of one pipeline chunk
            _, rpp, rvpp = cfg.layout(role)
            Recompute.of(getattr(cfg, role).recompute, f"{role}.recompute").check(
                dims[role], pp=rpp, vpp=rvpp, cpu=hw.device == "cpu")
    actor = dims["actor"]
    dp = world_size // (p.tp * p.pp * p.cp)
    seq = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    engine_args = None
    if cfg.rollout.engine == "sglang":
        engine_args = _engine_args(cfg)
        separate = cfg.rollout.sync_mode == "distributed"  # the engine on GPUs of its own, beside the trainer's
        check_engine_layout(actor, engine_args[0], None if separate else world_size)
        if separate:
            engine_args = None
    per_node = world_size // hw.nodes if world_size % hw.nodes == 0 else world_size
    placement = engine_placement(cfg, world_size, per_node)
    common = dict(recipe=recipe, model=source, dims=actor, world_size=world_size, tp=p.tp, pp=p.pp, vpp=p.vpp,
                  ep=cfg.expert_parallel("actor"), cp=p.cp,
                  padded_vocab=actor.padded_vocab_size(p.tp, m.make_vocab_size_divisible_by), dp=dp, seq=seq,
                  dtype=m.dtype, sequence_parallel=p.sequence_parallel,
                  distributed_optimizer=p.use_distributed_optimizer, fused_attention=fused_attention(cfg),
                  engine_name=cfg.rollout.engine, gpu_mem=gpu_mem_gib * GIB, hardware=hardware, device=hw.device,
                  placement=placement, staged_overlaps=cfg.rollout.mode != "sync")
    candidates, kinds_of = [], {}
    for stage, pp_rank, rank in _gpus_to_plan(placement, p.pp, p.tp * dp):
        roles = _roles_at(cfg, dims, world_size, stage, pp_rank)
        candidates.append(_gpu_plan(cfg, actor, hf, roles, engine_args, stage=stage, rank=rank, **common))
        kinds_of.setdefault(placement.kind(rank), []).append(candidates[-1])
    # the worst GPU: one that does not fit, else the largest total; beside it, each kind's worst
    worst = lambda plans: max(plans, key=lambda c: (not c.fits, c.total))  # noqa: E731
    gpus = sorted(((tuple(r for r in range(world_size) if placement.kind(r) == kind), worst(plans).rank,
                    worst(plans).total) for kind, plans in kinds_of.items()), key=lambda g: -g[2])
    return dataclasses.replace(worst(candidates), gpus=tuple(gpus))


def _gpus_to_plan(placement: Placement, pp: int, per_stage: int) -> list[tuple[str, int, int]]:
    """(stage, pipeline rank, global rank) of one GPU of each kind (placement.kind) on each pipeline stage
    (Megatron orders ranks tp, dp, then pp: stage s holds ranks [s * per_stage, (s + 1) * per_stage)); of
    the middle stages only the first holding each kind (a later one holds fewer micro-batches)."""
    out, middles = [], set()
    for s in range(pp):
        stage = "all" if pp == 1 else "first" if s == 0 else "last" if s == pp - 1 else "middle"
        kinds: dict[str, int] = {}
        for rank in range(s * per_stage, (s + 1) * per_stage):
            kinds.setdefault(placement.kind(rank), rank)
        for kind, rank in kinds.items():
            if stage == "middle":
                if kind in middles:
                    continue
                middles.add(kind)
            out.append((stage, s, rank))
    return out


def _gpu_plan(cfg: Config, actor: ModelDims, hf: dict, roles: list[RoleMemory],
              engine_args: Optional[tuple[int, float]], *, stage: str, rank: int, placement: Placement,
              **common) -> Plan:
    """The plan of global rank `rank`'s GPU, pipeline stage `stage`, holding `roles`."""
    hw, r = cfg.hardware, cfg.rollout
    db = DTYPE_BYTES[cfg.model.dtype]
    reserve = (RESERVE_GIB if hw.device == "gpu" else CPU_RESERVE_GIB) * GIB
    holds = rank in placement.engine_ranks
    host_engine = gpu_engine = gpu_engine_kv = 0.0
    if r.engine == "hf" and holds and hw.device == "cpu":  # the leader runs the transformers model
        host_engine = total_params(actor) * db
    elif r.engine == "hf" and holds:  # megappo.rollout.hf.engine.gpu_placement: the model dtype on the leader's GPU
        gpu_engine = total_params(actor) * db
        rows = -(-cfg.data.train_batch_size // placement.replicas) * r.n  # its chunk: whole prompts
        gpu_engine_kv = rows * common["seq"] * 2 * actor.num_layers * actor.num_query_groups * actor.head_dim * db
    # the CUDA-graph decode keeps its KV cache through the trainer's passes (docs/engines.md, "Memory")
    kv_kept = gpu_engine_kv > 0 and (r.hf_decode == "graphs" or (
        r.hf_decode == "auto" and static_unsupported(types.SimpleNamespace(**hf)) is None))
    overlaps = r.mode != "sync" or kv_kept
    # a leader's staged copy of an update is host memory: a rank's own with device=cpu, beside a GPU's otherwise
    staged = total_params(actor) * db if rank in placement.stagers and hw.device == "cpu" else 0.0
    start = sum(x.weights + x.grads + x.master for x in roles) + reserve + host_engine + gpu_engine
    engine = None
    if engine_args and holds:
        tp_size, frac = engine_args
        reserve += ENGINE_RESERVE_GIB * GIB
        kv_heads = max(1, actor.num_query_groups // tp_size)  # SGLang replicates KV heads when tp > groups
        engine = EngineMemory(tp_size=tp_size, mem_fraction=frac, weights=total_params(actor) * db / tp_size,
                              pool=frac * max(0.0, common["gpu_mem"] - start),
                              kv_token_bytes=2 * kv_heads * actor.head_dim * actor.num_layers * db)
    return Plan(stage=stage, roles=tuple(roles), engine=engine, reserve=reserve, host_engine=host_engine,
                gpu_engine=gpu_engine, gpu_engine_kv=gpu_engine_kv, gen_overlaps=overlaps, rank=rank,
                placement=placement, staged=staged, **common)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _ranks_text(ranks) -> str:
    """'0-3, 6, 8-9': runs of consecutive ranks."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _kind_text(kind: str, pl: Placement, unit: str) -> str:
    """What a GPU of `kind` (Placement.kind) holds besides the trainer's roles."""
    if kind == "leader":
        return ("another replica's leader, " + (f"a {unit} of its engine, " if pl.width else "")
                + "with each update staged" + (" in host memory" if unit == "GPU" else ""))
    if kind == "engine":
        return f"a {unit} of an engine" if pl.replicas > 1 else f"a {unit} of the engine"
    return "no engine"


def _rollout_lines(plan: Plan, g) -> list[str]:
    """Where the engines are: a line when any holds the trainer's GPUs or there are several."""
    pl = plan.placement
    if pl is None or (not pl.width and pl.replicas == 1):
        return []
    unit = "GPU" if plan.device == "gpu" else "rank"
    what = f"{plan.engine_name} engine" + (f" of tp {pl.width or pl.own}" if plan.engine_name == "sglang" else "")
    spans = [f"{s.start}-{s.stop - 1}" if len(s) > 1 else f"{s.start}" for s in pl.spans]
    if len(spans) > 8:
        spans = [*spans[:3], "...", spans[-1]]
    ranks = "ranks" if len(pl.engine_ranks) > 1 else "rank"
    where = (f" on {ranks} {' | '.join(spans)} ({len(pl.engine_ranks)} of {pl.world} {unit}s)" if pl.width
             else f" on GPUs of {'their' if pl.replicas > 1 else 'its'} own ({pl.own_per_node} a node at most, after "
                  f"its {pl.per_node} trainer GPUs)" if pl.own and plan.device == "gpu"
             else " on the host" if plan.device == "gpu" else "")
    text = f"rollout: {pl.replicas} " + (f"replicas of an {what}" if pl.replicas > 1 else what) + where
    if pl.stagers:
        staged = total_params(plan.dims) * DTYPE_BYTES[plan.dtype]
        several = len(pl.stagers) > 1
        text += (f"; rank{'s' if several else ''} {_ranks_text(pl.stagers)} stage{'' if several else 's'} each "
                 f"update whole ({g(staged)} GiB{' each' if several else ''}) until "
                 f"{'they apply' if several else 'it applies'} it")
        if plan.device == "gpu":
            text += f", in host memory: {g(pl.staged_per_node * staged)} GiB on a node at most"
    return [text]


def _what_it_holds(plan: Plan) -> str:
    """' (a GPU of the engine)', ' (replica 2's leader: ...)', ' (no engine)', or '' (no engine on any GPU)."""
    pl, unit = plan.placement, "GPU" if plan.device == "gpu" else "rank"
    if pl is None:
        return ""
    i = pl.replica_of(plan.rank)
    holds = plan.rank in pl.engine_ranks
    if plan.staged:
        return f" (replica {i}'s leader: " + (f"a {unit} of its engine, " if holds else "") + "each update staged)"
    if holds:
        return f" (a {unit} of the engine)" if pl.replicas == 1 else f" (a {unit} of replica {i}'s engine)"
    return " (no engine)" if pl.width else ""


def format_plan(plan: Plan) -> str:
    d = plan.dims
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    unit = "GPU" if plan.device == "gpu" else "rank"
    lines = [
        f"hardware: {plan.hardware}",
        f"model: {d.arch}, {_count(total_params(d))} parameters"
        + (f" ({_count(total_params(d, active=True))} active: {d.num_experts} experts, top-{d.moe_topk})"
           if d.is_moe else "") + f", {d.num_layers} layers, hidden {d.hidden_size}, "
        f"{d.num_heads} heads / {d.num_query_groups} KV heads, vocab {d.vocab_size} (padded to {plan.padded_vocab} "
        f"at tp={plan.tp})",
        f"  from {plan.model}",
        f"layout: world {plan.world_size} = tp {plan.tp} x pp {plan.pp}" + (f" (vpp {plan.vpp})" if plan.vpp else "")
        + (f" x cp {plan.cp}" if plan.cp > 1 else "") + f" x dp {plan.dp}" + (f" (experts: ep {plan.ep})" if plan.ep > 1 else "") + f"; {plan.dtype}; sequence parallel {on(plan.sequence_parallel)}; distributed optimizer "
        f"{on(plan.distributed_optimizer)}; attention {'fused (TE)' if plan.fused_attention else 'unfused (local)'}",
        f"sequence length {plan.seq} (data.max_prompt_length + rollout.max_new_tokens)",
        *_rollout_lines(plan, g),
        "",
        f"memory per {unit} (GiB), pipeline stage '{plan.stage}', rank {plan.rank}{_what_it_holds(plan)}"
        + ("" if plan.device == "gpu" else " (hardware.device=cpu: host memory)") + ":",
        f"{'role':<10}{'params':>9}{'weights':>9}{'grads':>8}{'optimizer':>11}{'activations':>13}{'total':>8}",
    ]
    for r in plan.roles:
        lines.append(f"{r.role:<10}{_count(r.params):>9}{g(r.weights):>9}{g(r.grads):>8}{g(r.optimizer):>11}"
                     f"{g(r.activations):>13}{g(r.total):>8}")
    if plan.engine:
        e = plan.engine
        lines.append(f"{'engine':<10}{'':>9}{g(e.weights):>9}{'':>8}{'':>11}{'':>13}{g(e.pool):>8}"
                     f"   sglang tp={e.tp_size}, pool {e.mem_fraction:g} x free; KV cache {g(max(0.0, e.kv_cache))} "
                     f"GiB = {e.kv_tokens} tokens ({e.kv_tokens // plan.seq} sequences of {plan.seq})")
    elif plan.host_engine:
        lines.append(f"{'engine':<10}{'':>9}{g(plan.host_engine):>9}{'':>8}{'':>11}{'':>13}{g(plan.host_engine):>8}"
                     f"   hf engine on rank {plan.rank}: a transformers copy of the model")
    elif plan.gpu_engine:
        lines.append(f"{'engine':<10}{'':>9}{g(plan.gpu_engine):>9}{'':>8}{'':>11}{g(plan.gpu_engine_kv):>13}"
                     f"{g(plan.gpu_engine + plan.gpu_engine_kv):>8}   hf engine on rank {plan.rank}'s GPU; its KV "
                     f"cache "
                     f"(a step's {plan.seq}-token samples) " + ("during training too (rollout.mode, or hf_decode=graphs)" if plan.gen_overlaps
                                                             else "during generation only"))
    elif plan.engine_name == "hf":
        lines.append(f"{'engine':<10}  hf engine: on the host (CPU memory), no GPU memory")
    elif plan.engine_name == "sglang":
        lines.append(f"{'engine':<10}  sglang, sync_mode=distributed: on GPUs of its own beside the trainer's "
                     f"(rollout.sglang.tp_size of them per replica), not planned here")
    if plan.staged:
        lines.append(f"{'staged':<10}{'':>9}{'':>9}{'':>8}{'':>11}{g(plan.staged):>13}{g(plan.staged):>8}   an update "
                     f"whole ({plan.dtype}), from its gather until replica {plan.placement.replica_of(plan.rank)} "
                     f"applies it")
    lines.append(f"{'reserve':<10}{'':>9}{'':>9}{'':>8}{'':>11}{'':>13}{g(plan.reserve):>8}   " + (
        "CUDA context, NCCL, allocator slack" + (", SGLang graphs" if plan.engine else "") if plan.device == "gpu"
        else "the process: Python, torch, Megatron, gloo"))
    if len(plan.gpus) > 1:
        lines += ["", f"every kind of {unit}, planned (the table above is the worst):"]
        lines += [f"  rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)}: "
                  f"{_kind_text(plan.placement.kind(ranks[0]), plan.placement, unit)}: "
                  f"{g(total)} GiB (rank {rank})" for ranks, rank, total in plan.gpus]
    peak = plan.peak_activation
    either = [f"activations {g(peak.activations)} (largest: {peak.phase}; phases run one after another)"]
    both = []
    if plan.gpu_engine_kv:
        (both if plan.gen_overlaps else either).append(f"hf engine KV cache {g(plan.gpu_engine_kv)}")
    if plan.staged:
        (both if plan.staged_overlaps else either).append(f"staged update {g(plan.staged)}")
    lines += [
        "",
        f"per {unit}: weights+grads+optimizer {g(plan.static)} + " + " or ".join(either)
        + (" (the larger counts)" if len(either) > 1 else "") + "".join(f" + {b}" for b in both)
        + (f" + engine {g(plan.engine.pool)}" if plan.engine else "")
        + (f" + hf engine {g(plan.host_engine)}" if plan.host_engine else "")
        + (f" + hf engine weights {g(plan.gpu_engine)}" if plan.gpu_engine else "") + f" + reserve {g(plan.reserve)} = {g(plan.total)} GiB of {g(plan.gpu_mem)} GiB",
    ]
    if plan.fits:
        lines.append(f"fits: {g(plan.gpu_mem - plan.total)} GiB to spare")
    elif plan.total > plan.gpu_mem:
        lines.append(f"does NOT fit: {g(plan.total - plan.gpu_mem)} GiB over")
    else:
        lines.append(f"does NOT fit: SGLang's KV cache holds {plan.engine.kv_tokens} tokens, less than one "
                     f"{plan.seq}-token sequence")
    return "\n".join(lines)
