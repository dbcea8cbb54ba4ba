"""The model and its layout: `model` (which weights, dtype, layer spec), `parallel` (TP / PP / VPP /
EP shared by every role), a role's own layout (`<role>.parallel`), and what a trained role changes
in its model: activation recomputation (`<role>.recompute`) and LoRA adapters (`<role>.lora`),
with the tables megappo.models.recompute and megappo.models.lora build from.

Cross-section rules beside these sections: `check_lora_dropout` (adapters' dropout vs
recomputation) and `check_world` (the checks that need the number of ranks). They read the root
`Config` (megappo.config.root, which imports this module) through its derived values.

Owns: these sections, their defaults and checks. Does not know about models, processes or the
ranks of a run: a layout here is numbers, split into process groups by megappo.parallel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from megappo.config.schema import _at_least, _require, _Section
from megappo.errors import P


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
    path: Optional[str] = None
    """HF model directory (config.json, safetensors, tokenizer). Set this or `hf_config`."""
    hf_config: Optional[dict[str, Any]] = None
    """Inline config.json content: the model is built from it with random init (tests, the CPU demo)."""
    tokenizer: Optional[str] = None
    """Tokenizer directory or `builtin:<name>` (e.g. `builtin:digits`); `null`: `path`."""
    arch: Optional[str] = None
    """Model registry key; `null`: `architectures[0]` of the HF config."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """`float32` or `bfloat16` (bf16 weights, float32 master weights and Adam moments); `float16` is refused
    ([precision.md](precision.md))."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times tp."""
    layer_spec: Literal["auto", "te", "local"] = "auto"
    """`te` (Transformer Engine), `local` (Megatron-Core's own layers), `auto` (TE on GPU when installed)."""
    seed_init: int = 1234
    """Seed of the random init of a model built from `hf_config`."""
    prepare: Optional[str] = None
    """The command that writes `path` (e.g. `python tools/prepare_smollm2.py`); named in the error when `path` is
    missing."""
    lm_head_chunk_tokens: int = 0
    """`> 0` (e.g. 1024): the actor's and reference's passes compute the LM head in chunks of this many tokens,
    never holding the full `[tokens, vocab/tp]` logits; `0`: off
    ([ppo-math.md](ppo-math.md#the-chunked-lm-head))."""

    def check(self) -> None:
        _require(self.path is not None or self.hf_config is not None,
                 f"{P}path and {P}hf_config are both unset. Fix: set {P}path=/path/to/hf_model "
                 f"(or give {P}hf_config to build a randomly initialised model from config).")
        _require(self.path is None or self.hf_config is None,
                 f"{P}path and {P}hf_config are both set. Fix: set {P}hf_config=null to load {P}path, "
                 f"or {P}path=null to build from config.")
        # megappo.models.precision says why (no loss scaling); docs/precision.md
        _require(self.dtype != "float16",
                 f"{P}dtype=float16 cannot train in megappo: Megatron's fp16 path needs dynamic loss scaling, which "
                 f"megappo does not wire. Fix: set {P}dtype=bfloat16 (float32's range; what every GPU recipe trains "
                 f"in) or float32.")
        _at_least(self, make_vocab_size_divisible_by=1, lm_head_chunk_tokens=0)

    @property
    def tokenizer_path(self) -> Optional[str]:
        return self.tokenizer if self.tokenizer is not None else self.path


@dataclasses.dataclass(frozen=True)
class ParallelConfig(_Section):
    tp: int = 1
    """Tensor-parallel size (>= 1)."""
    pp: int = 1
    """Pipeline-parallel size (>= 1). The data-parallel size is `world_size / (tp*pp)`."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved schedule); needs `pp > 1`."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism; needs `tp > 1`."""
    ep: int = 1
    """Expert-parallel size (MoE): experts split over `ep` data-parallel ranks; divides `world / (tp * pp)` and
    `num_experts` ([parallelism.md](parallelism.md))."""
    cp: int = 1
    """Context-parallel size: each packed sequence split over `cp` ranks (causal load balancing, K/V all-gathered in
    attention); the data-parallel size becomes `world / (tp*pp*cp)`. Needs packing and the local layer spec; not
    with MoE ([parallelism.md](parallelism.md#context-parallelism)). verl's `*.megatron.context_parallel_size`."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """`nccl`, `gloo`, or `auto` (nccl with CUDA, gloo on CPU)."""
    timeout_minutes: float = 30.0
    """A collective waiting longer ends the run, naming the rank and stage (`0.5`: 30 s)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks."""

    def check(self) -> None:
        _at_least(self, tp=1, pp=1, vpp=1, ep=1, cp=1)
        _require(self.timeout_minutes > 0, f"{P}timeout_minutes={self.timeout_minutes} must be > 0. Fix: e.g. "
                                           f"{P}timeout_minutes=30 (a float: 0.5 is 30 seconds).")
        _require(self.vpp is None or self.pp > 1,
                 f"{P}vpp={self.vpp} needs {P}pp > 1 (now {self.pp}). Fix: set {P}vpp=null or raise {P}pp.")
        _require(not self.sequence_parallel or self.tp > 1,
                 f"{P}sequence_parallel needs {P}tp > 1 (now {self.tp}). Fix: set {P}sequence_parallel=false.")


@dataclasses.dataclass(frozen=True)
class RoleParallelConfig(_Section):
    """One role's own layout over the same ranks; unset fields follow the top-level `parallel`."""

    tp: Optional[int] = None
    """This role's tensor-parallel size; `null`: `parallel.tp`."""
    pp: Optional[int] = None
    """This role's pipeline-parallel size; `null`: `parallel.pp`."""
    vpp: Optional[int] = None
    """This role's virtual stages; `null`: `parallel.vpp` if its pp is `parallel.pp`, else none."""
    ep: Optional[int] = None
    """This role's expert-parallel size (MoE); `null`: `parallel.ep`."""
    cp: Optional[int] = None
    """This role's context-parallel size (packed sequences split over `cp` ranks); `null`: `parallel.cp`."""

    def check(self) -> None:
        _at_least(self, tp=1, pp=1, vpp=1, ep=1, cp=1)


#: selective recomputation's modules (megappo.models.recompute uses these tables)
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe")
#: Megatron's other modules and why megappo refuses them
RECOMPUTE_REFUSED = {
    "layernorm": "Megatron-Core 0.16.1 recomputes norms with CheckpointWithoutOutput, which needs Transformer "
                 "Engine (it fails with NameError on the local layer spec)",
    "moe_act": "Megatron recomputes the MoE activation only with grouped-GEMM experts, which megappo does not use",
    "mla_up_proj": "it is for multi-latent attention (DeepSeek), which no megappo model family has",
    "shared_experts": "megappo's MoE families have no shared experts",
}


@dataclasses.dataclass(frozen=True)
class RecomputeConfig(_Section):
    """Activation recomputation of a trained role (megappo.models.recompute; docs/training.md)."""

    granularity: Literal["none", "full", "selective"] = "none"
    """`none`; `full`: keep layer inputs, re-run each layer's forward in backward (about a third more compute);
    `selective`: re-run only `modules`."""
    method: Optional[Literal["uniform", "block"]] = None
    """`full`: `uniform` (`null`, every group of `num_layers` layers) or `block` (the first `num_layers` layers of
    each pipeline chunk)."""
    num_layers: Optional[int] = None
    """`full`; `null`: 1. `uniform`: divides the layers per pipeline chunk; `block`: at most that many. Checked
    against the model."""
    modules: Optional[list[str]] = None
    """`selective`; `null`: `[core_attn]` (the attention scores; little to save with fused attention or packing),
    `mlp`, `moe` (GPU only). Refused with the reason: `layernorm` (needs TE), `moe_act`, `mla_up_proj`,
    `shared_experts`."""

    def check(self) -> None:
        full = self.granularity == "full"
        _require(full or (self.method is None and self.num_layers is None),
                 f"{P}method / {P}num_layers apply to {P}granularity=full (now {self.granularity}). Fix: remove "
                 f"them, or set {P}granularity=full.")
        _at_least(self, num_layers=1)
        _require(self.granularity == "selective" or self.modules is None,
                 f"{P}modules applies to {P}granularity=selective (now {self.granularity}). Fix: remove "
                 f"{P}modules, or set {P}granularity=selective.")
        for m in self.modules or ():
            _require(m not in RECOMPUTE_REFUSED, f"{P}modules: '{m}' is not supported: "
                     f"{RECOMPUTE_REFUSED.get(m)}. Fix: choose from {list(RECOMPUTE_MODULES)}, or set "
                     f"{P}granularity=full.")
            _require(m in RECOMPUTE_MODULES, f"{P}modules: '{m}' is not a module megappo recomputes. Fix: choose "
                     f"from {list(RECOMPUTE_MODULES)}.")
        _require(self.modules is None or len(self.modules) > 0,
                 f"{P}modules=[] recomputes nothing. Fix: set {P}modules=[core_attn], or {P}granularity=none.")


#: LoRA (megappo.models.lora uses these tables): Megatron linear -> its parallel kind; HF projection ->
#: the Megatron linear that fuses it; modules trained fully next to adapters (peft's modules_to_save)
TARGETS = {"linear_qkv": "column", "linear_proj": "row", "linear_fc1": "column", "linear_fc2": "row"}
HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
ALL_LINEAR = "all-linear"
SAVED_MODULES = {"lm_head": "output_layer", "embed_tokens": "embedding"}  # HF name -> Megatron prefix


def lora_targets(names: list[str] | tuple[str, ...], key: str = "target_modules") -> tuple[str, ...]:
    """Megatron linear names from user names: Megatron's, HF's (q_proj, ...), or all-linear. HF
    projections fused in one Megatron layer (q/k/v, gate/up) are adapted together."""
    out = []
    for name in names:
        _require(name == ALL_LINEAR or name in TARGETS or name in HF_TARGETS,
                 f"{key}: '{name}' is not a linear layer megappo adapts. Fix: choose from "
                 f"{[ALL_LINEAR, *TARGETS, *HF_TARGETS]}.")
        out.extend(TARGETS if name == ALL_LINEAR else [HF_TARGETS.get(name, name)])
    return tuple(t for t in TARGETS if t in out)


def lora_saved_modules(names: list[str] | tuple[str, ...], key: str = "modules_to_save") -> tuple[str, ...]:
    """HF names of modules trained fully next to adapters, from HF or Megatron names."""
    megatron = {v: k for k, v in SAVED_MODULES.items()}
    for name in names:
        _require(name in SAVED_MODULES or name in megatron, f"{key}: '{name}' is not a module megappo trains next "
                 f"to adapters. Fix: choose from {list(SAVED_MODULES)}.")
    out = [megatron.get(name, name) for name in names]
    return tuple(m for m in SAVED_MODULES if m in out)


@dataclasses.dataclass(frozen=True)
class LoRAConfig(_Section):
    """LoRA adapters of a trained role (megappo.models.lora; docs/lora.md): the base weights stay frozen."""

    rank: int = 0
    """Adapter rank r (>= 0); 0: no LoRA, every weight trains (verl's `lora_rank`)."""
    alpha: float = 16.0
    """The adapters' update is scaled by alpha / rank (> 0; verl's `lora_alpha`)."""
    dropout: float = 0.0
    """On the adapters' input, training passes only, in [0, 1); refused with `recompute`."""
    modules_to_save: list[str] = dataclasses.field(default_factory=list)
    """Trained fully beside the adapters (peft's name): `lm_head`, `embed_tokens` (or `output_layer`, `embedding`;
    tied embeddings: both). A model trained from random init needs `lm_head`, whose frozen random rows cap its
    logits."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])
    """`all-linear`, Megatron names (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`) or HF names (`q_proj`
    ... `down_proj`; the projections one Megatron layer fuses are adapted together)."""

    def check(self) -> None:
        _at_least(self, rank=0)
        _require(self.alpha > 0, f"{P}alpha={self.alpha} must be > 0. Fix: e.g. {P}alpha=16 (often 2 x rank).")
        _require(0 <= self.dropout < 1, f"{P}dropout={self.dropout} must be in [0, 1). Fix: e.g. {P}dropout=0.0.")
        lora_targets(self.target_modules, f"{P}target_modules")
        lora_saved_modules(self.modules_to_save, f"{P}modules_to_save")
        _require(bool(self.target_modules), f"{P}target_modules=[] adapts nothing. Fix: {P}target_modules=[all-linear].")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


# -- rules across sections ----------------------------------------------------------------------

def check_lora_dropout(cfg: "Config") -> None:
    """A trained role's adapters may drop out only when its forward is not recomputed."""
    for role in ("actor", "critic"):
        lora, recompute = getattr(cfg, role).lora, getattr(cfg, role).recompute
        _require(not (lora.enabled and lora.dropout) or recompute.granularity == "none",
                 f"{role}.lora.dropout={lora.dropout} with {role}.recompute.granularity={recompute.granularity}: "
                 "the recomputed forward would draw other dropout masks than the first, so the gradients would "
                 f"be wrong. Fix: set {role}.lora.dropout=0 (RL with LoRA rarely uses it) or "
                 f"{role}.recompute.granularity=none.")


def check_context_parallel(cfg: "Config") -> None:
    """A role with context parallelism (cp > 1) packs its passes, runs the local layer spec and no experts."""
    for role in cfg.model_roles:
        cp = cfg.context_parallel(role)
        if cp == 1:
            continue
        key = f"{role}.parallel.cp" if cfg.context_parallel_own(role) else "parallel.cp"
        _require(cfg.packs(role), f"{key}={cp} splits packed sequences, but {role}'s passes are padded "
                 f"({role}.packing=false). Fix: set {role}.packing=true, or {key}=1.")
        _require(cfg.model.layer_spec != "te", f"{key}={cp} runs in megappo's packed attention of the local layer "
                 f"spec; model.layer_spec=te (Transformer Engine's attention) is not wired for it yet. Fix: set "
                 f"model.layer_spec=local (or auto), or {key}=1.")
        _require(cfg.expert_parallel(role) == 1, f"{key}={cp} with expert parallelism (ep="
                 f"{cfg.expert_parallel(role)}) is not supported yet. Fix: set {key}=1 or parallel.ep=1.")


def check_world(cfg: "Config", world_size: int) -> None:
    """Checks that need the number of ranks: layouts divide it, batches split over data-parallel replicas."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    _require(world_size >= 1, f"world size {world_size} must be >= 1. Fix: launch at least one rank.")
    _require(world_size % (tp * pp) == 0, f"world size {world_size} is not a multiple of parallel.tp*parallel.pp = "
             f"{tp}*{pp}. Fix: launch a multiple of {tp * pp} ranks or change parallel.tp/parallel.pp.")
    for role in cfg.model_roles:
        rtp, rpp, _ = cfg.layout(role)
        rcp = cfg.context_parallel(role)
        names, sizes, keys = ("tp*pp*cp", f"{rtp}*{rpp}*{rcp}", "tp/pp/cp") if rcp > 1 else ("tp*pp", f"{rtp}*{rpp}",
                                                                                        "tp/pp")
        _require(world_size % (rtp * rpp * rcp) == 0,
                 f"world size {world_size} is not a multiple of {role}'s {names} = {sizes}. Fix: change "
                 f"{role}.parallel.{keys} (or parallel.{keys}) so that their product divides {world_size}.")
        ep = cfg.expert_parallel(role)
        _require((world_size // (rtp * rpp)) % ep == 0,
                 f"{role}: expert parallelism ep={ep} must divide its data-parallel size world/(tp*pp) = "
                 f"{world_size}/({rtp}*{rpp}) = {world_size // (rtp * rpp)}. Fix: launch a multiple of "
                 f"{rtp * rpp * ep} ranks or change parallel.ep ({role}.parallel.ep).")
    batch = cfg.data.train_batch_size * cfg.rollout.n
    splits = [(role, getattr(cfg, role).micro_batch_size, "a mini-batch",
               getattr(cfg, role).ppo_mini_batch_size * cfg.rollout.n)
              for role in ("actor", "critic") if role in cfg.roles]
    splits += [("ref", cfg.ref_micro_batch_size, "the batch", batch)] if cfg.needs_ref else []
    splits += [("reward", cfg.reward.micro_batch_size, "the batch", batch)] if cfg.reward.model_path else []
    for role, micro, what, seqs in splits:
        rtp, rpp, _ = cfg.layout(role)
        dp = world_size // (rtp * rpp * cfg.context_parallel(role))
        _require(cfg.packs(role) or seqs % (dp * micro) == 0,
                 f"{role}: {what} of {seqs} sequences does not split over dp={dp} replicas in micro-batches of "
                 f"{micro}. Fix: make {role}.micro_batch_size x {dp} divide {seqs} (or change the batch sizes or "
                 f"the world size).")

