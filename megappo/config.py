"""Typed run configuration: the recipe schema as dataclasses, their checks, and `Config`'s derivations.

Every section type-checks its own fields and checks their consistency on construction
(`__post_init__`); `Config` checks the sections against each other. Unknown keys are rejected with
the valid ones and a "did you mean"; every error is a `ConfigError` (megappo.errors, re-exported
here) that names the dotted key and says how to fix it. Numbers that depend on the world size are
methods (`dp_size(world)`), and derived values are properties, never fields filled in later.

Owns: the recipe schema, defaults, validation, conversion of plain data to typed fields and back
(`Config.to_dict()`). Reading recipes (YAML, dotted overrides, variants, verl keys) is
megappo.recipe's: `load_config`, `config_from_dict`. Knows nothing about torch, models or
processes: imports nothing from megappo but its errors and the rollout-correction grammar
(megappo.correction_spec), so recipes can be checked anywhere.
The reference for every field is docs/config.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from typing import Any, Literal, Optional, Union

from megappo import correction_spec
from megappo.ppo.specs import ESTIMATOR_SPECS, POLICY_LOSS_NAMES, EstimatorSpec
from megappo.errors import P, ConfigError  # noqa: F401 - ConfigError re-exported: megappo.config.ConfigError

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KLEstimator = Literal[KL_ESTIMATORS + tuple(k + "+" for k in KL_ESTIMATORS)]  # "+": straight-through k2 grad
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


def _require(ok: bool, template: str) -> None:
    """Section checks: write keys as f'{P}key' so the error shows the full dotted path."""
    if not ok:
        raise ConfigError(template)


#: the words YAML 1.1 reads as False / True (megappo.recipe parses recipes and overrides as YAML 1.1)
_YAML_BOOLS = {False: ("off", "no", "false", "n"), True: ("on", "yes", "true", "y")}


def _at_least(section: Any, **minimums: int) -> None:
    for name, low in minimums.items():
        value = getattr(section, name)
        _require(value is None or value >= low,
                 f"{P}{name}={value} must be >= {low}. Fix: set {P}{name}={low} or more.")


def _default(section: type) -> Any:
    """A section field whose default is that section's defaults."""
    return dataclasses.field(default_factory=section)


class _Section:
    """Base of every section: converts and type-checks each field, then runs `check()`."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _convert(f.name, getattr(self, f.name), hints[f.name]))
        self.check()

    def check(self) -> None:
        """Consistency of this section's own fields."""


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
    path: Optional[str] = None  # HF model directory (config.json + safetensors [+ tokenizer])
    hf_config: Optional[dict[str, Any]] = None  # inline config.json content: build from config, random init
    tokenizer: Optional[str] = None  # tokenizer directory or 'builtin:<name>'; None: model.path
    arch: Optional[str] = None  # model registry key; None: config.json `architectures[0]`
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter/compute dtype; float16 is refused
    make_vocab_size_divisible_by: int = 128  # Megatron pads the vocabulary to a multiple of this (x tp)
    layer_spec: Literal["auto", "te", "local"] = "auto"  # auto: Transformer Engine on GPU when installed
    seed_init: int = 1234  # seed of the random init of a model built from hf_config
    prepare: Optional[str] = None  # the command that writes model.path (named when model.path has no config.json)
    lm_head_chunk_tokens: int = 0  # > 0: the actor's and reference's log-prob, entropy and loss passes compute the LM head over chunks of this many tokens, never the full-vocabulary logits (megappo.parallel.chunked_head); 0: the output layer builds them

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
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved schedule); needs pp > 1
    sequence_parallel: bool = False  # Megatron sequence parallelism; needs tp > 1
    ep: int = 1  # expert-parallel size (MoE models): the experts are split over ep data-parallel ranks
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with CUDA, gloo on CPU
    timeout_minutes: float = 30.0  # a collective that waits longer ends the run with a message naming rank and stage
    use_distributed_optimizer: bool = False  # shard optimizer state over data-parallel ranks

    def check(self) -> None:
        _at_least(self, tp=1, pp=1, vpp=1, ep=1)
        _require(self.timeout_minutes > 0, f"{P}timeout_minutes={self.timeout_minutes} must be > 0. Fix: e.g. "
                                           f"{P}timeout_minutes=30 (a float: 0.5 is 30 seconds).")
        _require(self.vpp is None or self.pp > 1,
                 f"{P}vpp={self.vpp} needs {P}pp > 1 (now {self.pp}). Fix: set {P}vpp=null or raise {P}pp.")
        _require(not self.sequence_parallel or self.tp > 1,
                 f"{P}sequence_parallel needs {P}tp > 1 (now {self.tp}). Fix: set {P}sequence_parallel=false.")


@dataclasses.dataclass(frozen=True)
class RoleParallelConfig(_Section):
    """One role's own layout over the same ranks; unset fields follow the top-level `parallel`."""

    tp: Optional[int] = None  # tensor-parallel size of this role; None: parallel.tp
    pp: Optional[int] = None  # pipeline-parallel size of this role; None: parallel.pp
    vpp: Optional[int] = None  # virtual stages of this role; None: parallel.vpp when this role's pp is parallel.pp
    ep: Optional[int] = None  # expert-parallel size of this role (MoE models); None: parallel.ep

    def check(self) -> None:
        _at_least(self, tp=1, pp=1, vpp=1, ep=1)


@dataclasses.dataclass(frozen=True)
class OptimConfig(_Section):
    lr: float = 1e-6  # peak learning rate (Adam)
    weight_decay: float = 0.01  # decoupled weight decay (AdamW)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam beta1, beta2
    eps: float = 1e-8  # Adam epsilon
    warmup_steps: int = 0  # linear warmup over this many training steps (the rate moves once per step, as verl's)
    warmup_steps_ratio: float = 0.0  # with warmup_steps 0: warm up over int(ratio x the run's training steps), counted when the run knows them (verl's lr_warmup_steps_ratio)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"  # after warmup
    min_lr_ratio: float = 0.0  # decay floor as a fraction of lr

    def check(self) -> None:
        _require(self.lr > 0, f"{P}lr={self.lr} must be > 0. Fix: set e.g. {P}lr=1e-6.")
        _require(self.weight_decay >= 0, f"{P}weight_decay={self.weight_decay} must be >= 0. Fix: use 0.0 to disable.")
        _require(all(0 <= b < 1 for b in self.betas),
                 f"{P}betas={list(self.betas)} must be in [0, 1). Fix: e.g. {P}betas=[0.9,0.999].")
        _require(self.eps > 0, f"{P}eps={self.eps} must be > 0. Fix: e.g. {P}eps=1e-8.")
        _at_least(self, warmup_steps=0)
        _require(0 <= self.warmup_steps_ratio <= 1, f"{P}warmup_steps_ratio={self.warmup_steps_ratio} must be in "
                                                    f"[0, 1] (a fraction of the run's steps). Fix: e.g. 0.05.")
        _require(0 <= self.min_lr_ratio <= 1, f"{P}min_lr_ratio={self.min_lr_ratio} must be in [0, 1]. Fix: e.g. 0.1.")

    def warmup_for(self, total_steps: int) -> int:
        """Warmup steps of a run of `total_steps` training steps: warmup_steps, or with 0 the ratio's count
        (verl: int(lr_warmup_steps_ratio x total_training_steps))."""
        return self.warmup_steps or int(self.warmup_steps_ratio * total_steps)


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

    granularity: Literal["none", "full", "selective"] = "none"  # full: keep only layer inputs, re-run each layer's forward in backward (~1/3 more compute); selective: re-run only `modules`
    method: Optional[Literal["uniform", "block"]] = None  # full: uniform checkpoints every group of num_layers layers; block only the first num_layers of each pipeline chunk; None: uniform
    num_layers: Optional[int] = None  # full: layers per checkpoint (uniform; must divide the layers per pipeline chunk) or layers recomputed per chunk (block); None: 1
    modules: Optional[list[str]] = None  # selective: core_attn (attention scores), mlp (dense MLP), moe (MoE layers, GPU); None: [core_attn]

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

    rank: int = 0  # adapter rank r; 0: no LoRA, every weight trains (verl: lora_rank)
    alpha: float = 16.0  # the adapters' update is scaled by alpha / rank (verl: lora_alpha)
    dropout: float = 0.0  # dropout on the adapters' input, in training passes only
    modules_to_save: list[str] = dataclasses.field(default_factory=list)  # modules trained fully next to the adapters (peft's name): lm_head, embed_tokens (tied embeddings: both); a model trained from random init needs lm_head, whose frozen random rows cap its logits
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])  # all-linear, Megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2) or HF names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; fused ones are adapted together)

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

#: apply_chat_template's arguments megappo sets in each rendering (data.apply_chat_template_kwargs may not)
TEMPLATE_ARGUMENTS_SET_BY_MEGAPPO = ("conversation", "messages", "add_generation_prompt", "tokenize", "return_dict",
                                     "return_tensors", "continue_final_message")

#: verl 0.9.1's policy losses: the names megappo.ppo.specs declares (megappo.ppo.policy_losses.POLICY_LOSSES)
POLICY_LOSS_MODES = POLICY_LOSS_NAMES
#: verl 0.9.1's advantage estimators: the names megappo.ppo.specs declares (megappo.ppo.advantages.ESTIMATORS)
ADV_ESTIMATORS = tuple(ESTIMATOR_SPECS)


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig(_Section):
    """The actor's policy loss (megappo.ppo.policy_losses; docs/ppo-math.md), verl's actor.policy_loss."""

    loss_mode: Literal[POLICY_LOSS_MODES] = "vanilla"  # vanilla (clipped PPO), gspo, cispo, sapo, gpg, dppo_tv, dppo_kl, clip_cov, kl_cov, geo_mean, dro; bypass_mode goes with algorithm.rollout_correction.bypass_mode=true
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: lower bound of the covariance of the tokens it may cut
    clip_cov_ub: float = 5.0  # clip_cov: upper bound of that covariance
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens (largest covariance) given the |log ratio| penalty
    ppo_kl_coef: float = 0.1  # kl_cov: weight of that penalty
    dro_beta: Optional[float] = None  # dro: weight of the quadratic log-ratio penalty (required, > 0)

    def check(self) -> None:
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            _require(getattr(self, name) > 0, f"{P}{name}={getattr(self, name)} must be > 0. Fix: e.g. {P}{name}=0.0002.")
        _require(self.clip_cov_lb < self.clip_cov_ub, f"{P}clip_cov_lb={self.clip_cov_lb} must be below "
                 f"{P}clip_cov_ub={self.clip_cov_ub}. Fix: e.g. {P}clip_cov_lb=1.0 {P}clip_cov_ub=5.0.")
        _require(self.ppo_kl_coef >= 0, f"{P}ppo_kl_coef={self.ppo_kl_coef} must be >= 0. Fix: e.g. {P}ppo_kl_coef=0.1.")
        _require(self.loss_mode != "dro" or (self.dro_beta is not None and self.dro_beta > 0),
                 f"{P}loss_mode=dro needs {P}dro_beta > 0 (the weight of its quadratic log-ratio penalty), got "
                 f"{self.dro_beta}. Fix: e.g. {P}dro_beta=0.1.")


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig(_Section):
    """Correction of the engine/trainer mismatch (megappo.ppo.rollout_correction; docs/ppo-math.md), verl's
    algorithm.rollout_correction: importance weights and rejection of tokens or sequences, from the
    trainer's and the engine's log-probs."""

    rollout_is: Optional[Literal["token", "sequence"]] = None  # importance weights per token or per sequence; null: none
    rollout_is_threshold: Union[float, str] = 2.0  # a number: truncate the weights there (TIS); "lower_upper" (e.g. "0.5_2.0"): zero the weights outside (IcePop)
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean (decoupled mode)
    rollout_rs: Optional[str] = None  # reject tokens/sequences whose divergence passes the threshold: one or more (comma-separated) of token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3
    rollout_rs_threshold: Union[float, str, None] = None  # one per rollout_rs option (comma-separated) or one for all; k1 options take "lower_upper" ratio bounds (or an upper u: [1/u, u])
    bypass_mode: bool = False  # true: the engine's log-probs are the old policy's (2 policies, no recomputation) and the loss forms the weights from the current ones; false: decoupled (3 policies)
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"  # bypass_mode: the clipped PPO loss against the engine's log-probs, or REINFORCE weighted by the IS weights

    def check(self) -> None:
        try:
            correction_spec.validate(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).replace("algorithm.rollout_correction.", P)) from None
        _require(self.loss_type == "ppo_clip" or self.bypass_mode,
                 f"{P}loss_type={self.loss_type} applies in bypass mode only. Fix: set {P}bypass_mode=true or "
                 f"{P}loss_type=ppo_clip.")

    @property
    def enabled(self) -> bool:
        """Whether anything is corrected or the engine's log-probs replace the recomputed ones."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


def _check_trained_role(role: Any) -> None:
    _at_least(role, ppo_mini_batch_size=1, micro_batch_size=1, ppo_epochs=1, max_tokens_per_micro_batch=1)
    _require(role.grad_clip > 0, f"{P}grad_clip={role.grad_clip} must be > 0. Fix: e.g. {P}grad_clip=1.0.")
    _require(role.loss_scale_factor is None or role.loss_scale_factor > 0,
             f"{P}loss_scale_factor={role.loss_scale_factor} must be > 0. Fix: e.g. {P}loss_scale_factor=4096 (the "
             f"response budget, rollout.max_new_tokens), or null for the step's longest response.")


@dataclasses.dataclass(frozen=True)
class ActorConfig(_Section):
    dist_checkpoint: Optional[str] = None  # a Megatron-Core dist checkpoint (any TP/PP) the actor starts from instead of model.path's weights; model.path still gives the HF config and tokenizer (verl: actor.megatron.dist_checkpointing_path)
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n sequences), as in verl
    micro_batch_size: int = 4  # sequences per forward/backward on one data-parallel replica (without packing)
    packing: bool = True  # pack sequences without padding into token-budget micro-batches (verl: use_remove_padding + use_dynamic_bsz)
    max_tokens_per_micro_batch: Optional[int] = None  # packing: tokens per micro-batch on one replica; None: micro_batch_size x (data.max_prompt_length + rollout.max_new_tokens) (verl: ppo_max_token_len_per_gpu)
    ppo_epochs: int = 1  # passes over each step's experience
    clip_ratio: float = 0.2  # PPO clip epsilon: ratio in [1 - eps_low, 1 + eps_high]
    clip_ratio_low: Optional[float] = None  # eps_low; None: clip_ratio; >= 1: no lower bound (CISPO's setting)
    clip_ratio_high: Optional[float] = None  # eps_high; None: clip_ratio (e.g. 0.28 for clip-higher)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (> 1)
    loss_agg_mode: LossAggMode = "token-mean"  # how token losses are reduced to one number
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm: the constant each sequence's token sum is divided by (Dr. GRPO: the generation budget); None: the step's longest response
    entropy_coeff: float = 0.0  # entropy bonus weight (loss -= coeff * entropy)
    use_kl_loss: bool = False  # add a KL(actor || ref) term to the loss (GRPO style); needs the ref model
    kl_loss_coef: float = 0.001  # weight of that KL term
    kl_loss_type: KLEstimator = "low_var_kl"  # KL estimator of that term
    grad_clip: float = 1.0  # global gradient-norm clip
    old_logprob: Literal["recompute", "bypass", "is_correct"] = "recompute"  # source of old log-probs; bypass and is_correct are presets of algorithm.rollout_correction (bypass_mode=true; rollout_is=token with threshold is_truncate)
    is_truncate: float = 2.0  # is_correct: truncation of rollout importance weights
    policy_loss: PolicyLossConfig = _default(PolicyLossConfig)  # which policy loss (loss_mode) and its knobs
    tau_pos: float = 1.0  # policy_loss.loss_mode=sapo: gate temperature of positive advantages
    tau_neg: float = 1.05  # policy_loss.loss_mode=sapo: gate temperature of negative advantages
    moe_routing: Literal["recompute", "replay"] = "recompute"  # MoE: replay: the actor's and reference's passes use the experts the rollout engine chose per token (routing replay); recompute: their own routers choose
    recompute: RecomputeConfig = _default(RecomputeConfig)  # activation recomputation (gradient checkpointing) of the actor's training passes
    lora: LoRAConfig = _default(LoRAConfig)  # LoRA adapters instead of training every weight; the reference policy is then the actor with its adapters off (no second copy)
    optim: OptimConfig = _default(OptimConfig)  # optimizer and LR schedule
    parallel: RoleParallelConfig = _default(RoleParallelConfig)  # this role's TP/PP, when not the shared parallel.*

    def check(self) -> None:
        _check_trained_role(self)
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"{P}{name}={v} must be > 0. Fix: e.g. {P}{name}=0.2.")
        _require(self.clip_ratio_c > 1, f"{P}clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound). "
                                        f"Fix: e.g. {P}clip_ratio_c=3.0.")
        _require(self.kl_loss_coef >= 0, f"{P}kl_loss_coef={self.kl_loss_coef} must be >= 0. Fix: use 0.0 or "
                                         f"{P}use_kl_loss=false to disable.")
        _require(self.is_truncate >= 1, f"{P}is_truncate={self.is_truncate} must be >= 1. Fix: e.g. 2.0.")
        _require(self.tau_pos > 0 and self.tau_neg > 0, f"{P}tau_pos={self.tau_pos} and {P}tau_neg={self.tau_neg} "
                 f"must be > 0 (SAPO's gate temperatures). Fix: e.g. {P}tau_pos=1.0 {P}tau_neg=1.05.")

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclasses.dataclass(frozen=True)
class CriticConfig(_Section):
    enable: Optional[bool] = None  # None: on exactly when the estimator needs values (gae)
    path: Optional[str] = None  # HF directory to initialise from; None: model.path (value head is new)
    dist_checkpoint: Optional[str] = None  # a Megatron-Core dist checkpoint (any TP/PP) of a GPT model the critic's trunk starts from instead of its HF weights; the value head is new, as verl's (verl: critic.megatron.dist_checkpointing_path)
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n sequences)
    micro_batch_size: int = 4  # sequences per forward/backward on one replica (without packing)
    packing: bool = True  # pack sequences without padding into token-budget micro-batches (verl: use_remove_padding + use_dynamic_bsz)
    max_tokens_per_micro_batch: Optional[int] = None  # packing: tokens per micro-batch on one replica; None: micro_batch_size x (data.max_prompt_length + rollout.max_new_tokens) (verl: ppo_max_token_len_per_gpu)
    ppo_epochs: int = 1  # passes over each step's experience
    cliprange_value: float = 0.5  # value clip around the old values
    grad_clip: float = 1.0  # global gradient-norm clip
    loss_agg_mode: LossAggMode = "token-mean"  # reduction of the value loss
    loss_scale_factor: Optional[float] = None  # as actor.loss_scale_factor, for the value loss
    recompute: RecomputeConfig = _default(RecomputeConfig)  # activation recomputation (gradient checkpointing) of the critic's training passes
    lora: LoRAConfig = _default(LoRAConfig)  # LoRA adapters on the critic's trunk (its value head trains fully)
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))  # optimizer
    parallel: RoleParallelConfig = _default(RoleParallelConfig)  # this role's TP/PP, when not the shared parallel.*

    def check(self) -> None:
        _check_trained_role(self)
        _require(self.cliprange_value > 0, f"{P}cliprange_value={self.cliprange_value} must be > 0. Fix: e.g. 0.5.")


@dataclasses.dataclass(frozen=True)
class RefConfig(_Section):
    dist_checkpoint: Optional[str] = None  # a Megatron-Core dist checkpoint the reference starts from instead of model.path's weights; None: the actor's (actor.dist_checkpoint, else model.path) (verl: ref.megatron.dist_checkpointing_path)
    micro_batch_size: Optional[int] = None  # sequences per forward on one replica; None: actor's
    packing: Optional[bool] = None  # as actor.packing; None: actor's
    max_tokens_per_micro_batch: Optional[int] = None  # as actor.max_tokens_per_micro_batch; None: actor's
    parallel: RoleParallelConfig = _default(RoleParallelConfig)  # this role's TP/PP, when not the shared parallel.*

    def check(self) -> None:
        _at_least(self, micro_batch_size=1, max_tokens_per_micro_batch=1)


@dataclasses.dataclass(frozen=True)
class OverlongBufferConfig(_Section):
    """DAPO's overlong reward shaping (verl's dapo reward manager, `overlong_buffer_cfg`)."""

    enable: bool = False  # add min(0, -(length - (rollout.max_new_tokens - len)) / len * penalty_factor) to each score
    len: int = 0  # the buffer: the last `len` tokens before rollout.max_new_tokens, over which the penalty grows
    penalty_factor: float = 1.0  # the penalty at rollout.max_new_tokens (linear from 0 at the buffer's start)
    log: bool = False  # also log reward/overlong_reward and reward/overlong (fraction penalised)

    def check(self) -> None:
        _require(not self.enable or self.len > 0, f"{P}len={self.len} must be > 0 when {P}enable=true. Fix: e.g. "
                 f"{P}len=128 (tokens), or {P}enable=false.")
        _require(self.penalty_factor >= 0, f"{P}penalty_factor={self.penalty_factor} must be >= 0. Fix: e.g. "
                 f"{P}penalty_factor=1.0.")


@dataclasses.dataclass(frozen=True)
class RewardConfig(_Section):
    functions: list[str] = dataclasses.field(default_factory=list)  # rule-based rewards (megappo.rewards)
    function_weights: Optional[list[float]] = None  # one weight per function; None: all 1.0
    # rule functions logged, not trained on: critic/score/<name> and val/score/<name> are their mean
    # scores (e.g. [reasoning_gym_exact], the exact answer, beside the partial-credit reasoning_gym)
    metric_functions: list[str] = dataclasses.field(default_factory=list)
    # your own function returning NaN or inf: error (end the run, exit 4, naming it and the row) or
    # warn (score 0, warn once per function, count reward/bad_values)
    bad_value_policy: Literal["error", "warn"] = "error"
    timeout_s: float = 60.0  # your own function's limit per call (rank 0); past it the run ends naming it and the row; 0: none
    # processes that call reward.functions on a step's responses, in parallel and while the step's model
    # passes run (megappo.rewards.workers); 0: rank 0 calls them after the passes, one response after another
    num_workers: int = 0
    model_path: Optional[str] = None  # reward model: HF directory with a scalar score head
    model_weight: float = 1.0  # weight of the reward model's score in the sum
    micro_batch_size: int = 4  # reward-model sequences per forward on one replica (without packing)
    packing: bool = True  # pack sequences without padding into token-budget micro-batches (verl: use_remove_padding + use_dynamic_bsz)
    max_tokens_per_micro_batch: Optional[int] = None  # packing: tokens per micro-batch on one replica; None: micro_batch_size x (data.max_prompt_length + rollout.max_new_tokens) (verl: ppo_max_token_len_per_gpu)
    parallel: RoleParallelConfig = _default(RoleParallelConfig)  # this role's TP/PP, when not the shared parallel.*
    overlong_buffer: OverlongBufferConfig = _default(OverlongBufferConfig)  # DAPO's length penalty near rollout.max_new_tokens

    def check(self) -> None:
        _at_least(self, micro_batch_size=1, max_tokens_per_micro_batch=1, num_workers=0)
        _require(self.timeout_s >= 0, f"{P}timeout_s={self.timeout_s} must be >= 0. Fix: e.g. {P}timeout_s=60 "
                 f"(0: no limit).")
        n_w, n_f = len(self.function_weights or ()), len(self.functions)
        _require(self.function_weights is None or n_w == n_f,
                 f"{P}function_weights has {n_w} entries for {n_f} {P}functions. Fix: give one weight per function "
                 f"or set {P}function_weights=null.")


@dataclasses.dataclass(frozen=True)
class KLCtrlConfig(_Section):
    type: Literal["fixed", "adaptive"] = "fixed"  # adaptive: coefficient steered towards target_kl
    kl_coef: float = 0.001  # (initial) coefficient of the in-reward KL penalty
    target_kl: float = 0.1  # adaptive: the KL the controller aims for
    horizon: int = 10000  # adaptive: steps over which the coefficient adapts

    def check(self) -> None:
        _require(self.kl_coef >= 0 and self.target_kl > 0, f"{P}kl_coef={self.kl_coef} must be >= 0 and "
                 f"{P}target_kl={self.target_kl} > 0. Fix: e.g. {P}kl_coef=0.001 {P}target_kl=0.1.")
        _at_least(self, horizon=1)


@dataclasses.dataclass(frozen=True)
class CustomClsConfig(_Section):
    """A dataset class of the user's that turns data files into rows (verl's data.custom_cls): megappo.data.class_rows."""

    path: Optional[str] = None  # a .py file or an importable module
    name: Optional[str] = None  # the class in it: Class(data_files, config), read with len() and [i] (or iterated), rows in verl's layout

    def check(self) -> None:
        _require((self.path is None) == (self.name is None),
                 f"{P}path={self.path} and {P}name={self.name}: a dataset class needs both. Fix: set both (the file "
                 f"and the class in it), or neither.")


@dataclasses.dataclass(frozen=True)
class SamplerConfig(_Section):
    """A sampler class of the user's that orders the prompts each epoch (verl's data.sampler): megappo.data.ClassOrder."""

    class_path: Optional[str] = None  # a .py file or an importable module
    class_name: Optional[str] = None  # the class in it: Class(data_source, data_config), iterated once per epoch for the prompt indices

    def check(self) -> None:
        _require((self.class_path is None) == (self.class_name is None),
                 f"{P}class_path={self.class_path} and {P}class_name={self.class_name}: a sampler class needs both. "
                 f"Fix: set both (the file and the class in it), or neither.")


@dataclasses.dataclass(frozen=True)
class PfPpoConfig(_Section):
    """PF-PPO's resampling of a step's batch by score (verl's algorithm.pf_ppo): megappo.ppo.pf_ppo."""

    reweight_method: Literal["pow", "max_min", "max_random"] = "pow"  # a sample's weight from its score s: |s|^weight_pow; 1 at the batch's max or min score, else 0; 0.4 at its max, else 0.1
    weight_pow: float = 2.0  # pow: the exponent

    def check(self) -> None:
        _require(self.weight_pow >= 0, f"{P}weight_pow={self.weight_pow} must be >= 0. Fix: e.g. {P}weight_pow=2.0.")


@dataclasses.dataclass(frozen=True)
class FilterGroupsConfig(_Section):
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): docs/dapo.md."""

    enable: bool = False  # drop groups whose samples all have the same metric value; generate more prompts until the batch is full
    metric: str = "reward"  # reward (alias seq_reward, score): the sequence score; acc: the reward dict's 'acc' (else score >= 1); or another field your reward function returns
    max_num_gen_batches: int = 0  # generation batches per step at most (data.gen_batch_size prompts each); 0: no bound
    max_inflight_gen_batches: int = 1  # generation batches asked of the engine in one call (more work per call)
    on_limit: Literal["fill", "stop"] = "fill"  # at max_num_gen_batches: fill (top the batch up with dropped groups, warn, count filter_groups/hit_limit) or stop (end the run, as verl)

    def check(self) -> None:
        _at_least(self, max_num_gen_batches=0, max_inflight_gen_batches=1)
        _require(self.metric != "seq_final_reward", f"{P}metric=seq_final_reward is the score after the in-reward KL "
                 f"penalty, which needs the reference pass after generation; megappo filters at generation. Fix: "
                 f"write {P}metric=reward (the score before the penalty).")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig(_Section):
    adv_estimator: Literal[ADV_ESTIMATORS] = "gae"  # advantage estimator (docs/ppo-math.md); gae needs the critic
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group's std (false: Dr. GRPO)
    use_kl_in_reward: bool = False  # subtract kl_coef * KL(actor || ref) from token rewards; needs ref
    kl_penalty: KLEstimator = "kl"  # KL estimator of the in-reward penalty
    kl_ctrl: KLCtrlConfig = _default(KLCtrlConfig)  # its coefficient controller
    gdpo_reward_keys: Optional[list[str]] = None  # gdpo: the reward.functions normalised apart (each one a component); null: every function
    gdpo_reward_weights: Optional[list[float]] = None  # gdpo: one weight per component; null: all 1.0
    rollout_correction: RolloutCorrectionConfig = _default(RolloutCorrectionConfig)  # importance weights / rejection for the engine-trainer mismatch
    filter_groups: FilterGroupsConfig = _default(FilterGroupsConfig)  # DAPO's dynamic sampling
    mask_truncated_completions: bool = False  # samples that ran into rollout.max_new_tokens carry no loss (DAPO's overlong filtering; TRL's name)
    use_pf_ppo: bool = False  # PF-PPO: after GAE, train on the step's samples resampled with replacement, weighted by score (pf_ppo.*)
    pf_ppo: PfPpoConfig = _default(PfPpoConfig)  # its weights

    def check(self) -> None:
        _require(not self.use_pf_ppo or self.adv_estimator == "gae",
                 f"{P}use_pf_ppo=true resamples the batch after GAE; verl applies it with {P}adv_estimator=gae only "
                 f"and ignores it with {self.adv_estimator}. Fix: set {P}adv_estimator=gae, or {P}use_pf_ppo=false.")
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            _require(0 <= v <= 1, f"{P}{name}={v} must be in [0, 1]. Fix: e.g. {P}{name}=1.0.")
        _require(self.use_kl_in_reward or self.kl_ctrl.type == "fixed",
                 f"{P}kl_ctrl.type=adaptive only steers the in-reward KL penalty, which is off. Fix: set "
                 f"{P}use_kl_in_reward=true or {P}kl_ctrl.type=fixed.")

    @property
    def estimator(self) -> EstimatorSpec:
        """What the estimator needs from the step (megappo.ppo.specs)."""
        return ESTIMATOR_SPECS[self.adv_estimator]

    @property
    def needs_critic(self) -> bool:
        return self.estimator.critic

    @property
    def grouped(self) -> bool:
        """Estimators whose baseline is the other samples of the same prompt."""
        return self.estimator.grouped


@dataclasses.dataclass(frozen=True)
class RolloutConfig(_Section):
    engine: Literal["hf", "sglang"] = "hf"  # hf: transformers (CPU default); sglang: SGLang (GPU; CPU too, docs/engines.md)
    hf_decode: Literal["auto", "dynamic", "static", "graphs"] = "auto"  # hf engine's decode loop: dynamic (rows leave, shapes shrink), static (fixed-shape bucketed steps), graphs (static, each bucket's step a CUDA graph; CUDA only); auto: graphs on CUDA for a supported model, else dynamic (docs/engines.md)
    hf_eos_check_every: int = 8  # hf_decode static/graphs: decode steps between the host's checks for finished samples (1: every step)
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # sampling temperature (0: greedy)
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # top-k sampling; -1: off
    max_new_tokens: int = 512  # response length limit
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # stop ids besides the tokenizer's EOS
    seed: int = 0  # sampling seed (step k uses seed + k)
    logprob_mode: Literal["untempered", "tempered"] = "tempered"  # rollout log-probs of logits / temperature
    update_bucket_mb: int = 512  # weight-sync bucket size in MiB
    verify_every: int = 1  # fingerprint-verify the engine weights every k-th sync; 0: never
    sync_mode: Literal["tensor", "distributed", "disk"] = "tensor"  # how weights reach the engine
    lora_sync: Literal["merged", "adapters"] = "merged"  # actor.lora: merged sends W + s B A (any engine); adapters sends the base once, then only the adapters and modules_to_save (hf engine, colocated; docs/lora.md)
    sglang: dict[str, Any] = dataclasses.field(default_factory=dict)  # passed through to sglang.Engine
    val_temperature: float = 0.0  # validation sampling temperature
    val_n: int = 1  # validation samples per prompt
    val_top_p: Optional[float] = None  # validation nucleus sampling; None: top_p (verl's val_kwargs.top_p)
    val_top_k: Optional[int] = None  # validation top-k; None: top_k (verl's val_kwargs.top_k)
    env: str = "single_turn"  # episode environment: single_turn, tools, lookup, or pkg.module:Class / file.py:Class (docs/environments.md)
    env_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # keyword arguments of the environment class
    max_turns: int = 8  # multi-turn: actions per episode at most (max_new_tokens stays the episode's token budget)
    max_turn_tokens: Optional[int] = None  # multi-turn: tokens per action at most; None: max_new_tokens
    bad_observation_policy: Literal["error", "warn"] = "error"  # multi-turn: an observation with characters the tokenizer has no token for: error stops the run; warn trains on it, counted in env/unknown_char_observations
    placement: Literal["colocated", "separate"] = "colocated"  # separate: the hf engine in a child process of rank 0 (docs/async.md)
    engine_cores: list[int] = dataclasses.field(default_factory=list)  # separate: pin the engine's process to these CPU cores; []: no pinning
    replicas: int = 1  # rollout engines across the job's ranks, replica i led by global rank i * world / replicas (on its GPUs; sync_mode=distributed: on GPUs of its own after the trainer's on that node); rank 0 splits each generation's prompts (whole groups) over them, same tokens as one engine; 1: rank 0's engine only (docs/engines.md)
    mode: Literal["sync", "one_step_off", "async"] = "sync"  # one_step_off: generate step k+1's batch while step k trains, one policy version behind; async: a generation thread up to max_staleness versions ahead (docs/async.md)
    max_staleness: Optional[int] = None  # async: policy versions a sample lags the trainer at most; None: 2

    @property
    def staleness_limit(self) -> int:
        """Policy versions a training sample lags the trainer at most (rollout.mode)."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness or 2)

    def check(self) -> None:
        _at_least(self, n=1, max_new_tokens=1, update_bucket_mb=1, verify_every=0, val_n=1, max_turns=1,
                  hf_eos_check_every=1, replicas=1)
        _require(self.replicas == 1 or self.sync_mode != "disk",
                 f"{P}replicas={self.replicas} with {P}sync_mode=disk: the disk fallback is for one engine. Fix: set "
                 f"{P}sync_mode=tensor (replicas on the trainer's GPUs) or distributed (replicas on GPUs of their "
                 f"own), or {P}replicas=1.")
        _require(self.max_turn_tokens is None or self.max_turn_tokens >= 1,
                 f"{P}max_turn_tokens={self.max_turn_tokens} must be >= 1. Fix: set it to null (max_new_tokens) "
                 "or to the longest action you expect.")
        _require(bool(self.env.strip()), f"{P}env is empty. Fix: set {P}env=single_turn or {P}env=pkg.module:Class.")
        _require(self.placement == "colocated" or self.engine == "hf",
                 f"{P}placement={self.placement} needs {P}engine=hf (sglang already runs in its own processes). "
                 f"Fix: set {P}placement=colocated.")
        _require(self.hf_decode in ("auto", "dynamic") or (self.engine == "hf" and self.placement == "colocated"),
                 f"{P}hf_decode={self.hf_decode} applies to the hf engine in the trainer's process (engine=hf, "
                 f"placement=colocated); here engine={self.engine}, placement={self.placement}. Fix: set {P}hf_decode=auto.")
        _require(not self.engine_cores or self.placement == "separate",
                 f"{P}engine_cores={self.engine_cores} pins the engine's own process, which only "
                 f"{P}placement=separate has. Fix: set {P}placement=separate or {P}engine_cores=[].")
        _require(self.max_staleness is None or self.mode == "async",
                 f"{P}max_staleness={self.max_staleness} applies to {P}mode=async only ({self.mode}: staleness "
                 f"{self.staleness_limit}). Fix: set {P}mode=async, or remove {P}max_staleness.")
        _at_least(self, max_staleness=1)
        _require(self.temperature >= 0 and self.val_temperature >= 0,
                 f"{P}temperature / {P}val_temperature must be >= 0. Fix: use 0 for greedy decoding.")
        for key in ("top_p", "val_top_p"):
            value = getattr(self, key)
            _require(value is None or 0 < value <= 1, f"{P}{key}={value} must be in (0, 1]. Fix: use 1.0 to disable.")
        for key in ("top_k", "val_top_k"):
            value = getattr(self, key)
            _require(value is None or value == -1 or value >= 1, f"{P}{key}={value} must be -1 (off) or >= 1.")
        _require(self.engine == "sglang" or self.sync_mode == "tensor",
                 f"{P}sync_mode={self.sync_mode} needs {P}engine=sglang. Fix: set {P}sync_mode=tensor.")
        _require(self.lora_sync == "merged" or self.engine == "hf",
                 f"{P}lora_sync=adapters needs {P}engine=hf: loading LoRA adapters into SGLang is not wired in "
                 f"megappo. Fix: set {P}lora_sync=merged (every engine takes the merged weights).")
        _require(self.lora_sync == "merged" or self.placement == "colocated",
                 f"{P}lora_sync=adapters needs {P}placement=colocated: the separate engine process does not take "
                 f"adapters. Fix: set {P}lora_sync=merged or {P}placement=colocated.")


@dataclasses.dataclass(frozen=True)
class DataConfig(_Section):
    train_files: list[str] = dataclasses.field(default_factory=list)  # JSONL/Parquet files, verl layout
    val_files: list[str] = dataclasses.field(default_factory=list)  # validation files
    builtin: Optional[str] = None  # a generated dataset instead of files, e.g. 'reasoning_gym:basic_arithmetic'
    builtin_size: int = 2048  # prompts generated for training
    builtin_val_size: int = 64  # prompts generated for validation (when val_files is empty), none a training prompt
    builtin_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # passed to the generator (reasoning-gym config)
    prompt_key: str = "prompt"  # column holding the prompt (chat messages or text)
    max_prompt_length: int = 512  # in tokens
    long_prompt_policy: Literal["skip", "truncate", "error"] = "skip"  # for longer prompts
    bad_row_policy: Literal["error", "warn", "skip"] = "error"  # rows with no prompt, unknown characters or no ground truth
    train_batch_size: int = 1024  # prompts per PPO step
    gen_batch_size: Optional[int] = None  # algorithm.filter_groups: prompts per generation batch; None: train_batch_size
    shuffle: bool = True  # reshuffle prompts every epoch
    seed: int = 1  # shuffling / generation seed
    apply_chat_template: bool = True  # render prompts with the tokenizer's chat template
    apply_chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # more keyword arguments of the template in every rendering (prompts, multi-turn turns), e.g. {enable_thinking: false} for Qwen3 (verl's key)
    system_prompt: Optional[str] = None  # a system message put before every prompt that has none (tool descriptions)
    #: example turns put after the system message of every prompt, e.g. a question, the assistant's tool call,
    #: the tool's answer and the final answer: [{role: user, content: ...}, {role: assistant, content: ...}, ...]
    few_shot: list[dict[str, str]] = dataclasses.field(default_factory=list)
    custom_cls: CustomClsConfig = _default(CustomClsConfig)  # rows from a dataset class of yours instead of read from the files (verl's key)
    sampler: SamplerConfig = _default(SamplerConfig)  # the prompts' order per epoch from a sampler class of yours instead of data.shuffle (verl's key)

    def check(self) -> None:
        _require(not (self.custom_cls.path and self.builtin),
                 f"{P}custom_cls reads data.train_files, but {P}builtin={self.builtin} generates the rows. Fix: set "
                 f"{P}builtin=null, or remove {P}custom_cls.")
        _at_least(self, builtin_size=1, builtin_val_size=1, max_prompt_length=1, train_batch_size=1, gen_batch_size=1)
        _require(not (self.builtin and self.train_files),
                 f"{P}builtin and {P}train_files are both set. Fix: set {P}builtin=null or {P}train_files=[].")
        _require(not self.builtin or self.builtin_size >= self.train_batch_size,
                 f"{P}builtin_size={self.builtin_size} is smaller than {P}train_batch_size={self.train_batch_size}: "
                 f"not one full step. Fix: raise {P}builtin_size or lower {P}train_batch_size.")
        for i, m in enumerate(self.few_shot):
            _require(set(m) == {"role", "content"} and m["role"] in ("user", "assistant", "tool"),
                     f"{P}few_shot[{i}]={m} is not a chat message. Fix: write {{role: user, content: ...}} "
                     "(role user, assistant or tool; the system message is data.system_prompt).")
        _require(not self.apply_chat_template_kwargs or self.apply_chat_template,
                 f"{P}apply_chat_template_kwargs={self.apply_chat_template_kwargs} are the chat template's, but "
                 f"{P}apply_chat_template=false renders no template. Fix: set {P}apply_chat_template=true or "
                 f"{P}apply_chat_template_kwargs={{}}.")
        reserved = sorted(set(self.apply_chat_template_kwargs) & set(TEMPLATE_ARGUMENTS_SET_BY_MEGAPPO))
        _require(not reserved, f"{P}apply_chat_template_kwargs sets {reserved}, which megappo sets itself in each "
                               f"rendering. Fix: remove them (the template's own variables, such as enable_thinking, "
                               f"go there).")
        _require(not self.few_shot or self.few_shot[0]["role"] == "user",
                 f"{P}few_shot starts with a turn of role "
                 f"'{self.few_shot[0]['role'] if self.few_shot else ''}'. Fix: start it with the example's question, "
                 "a user turn.")

    def require_training_data(self) -> None:
        """Training needs prompts; a conversion-only config does not (so this is not in check())."""
        _require(bool(self.train_files or self.builtin), "data.train_files and data.builtin are both empty. Fix: "
                 "set data.train_files=[train.jsonl] or data.builtin=<name> to train.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(_Section):
    """Trainer checkpoints (models, optimizers, schedulers, data cursor, RNG): megappo.checkpointing."""

    dir: Optional[str] = None  # None: <run.output_dir>/checkpoints
    save_every: int = 0  # steps between checkpoints; 0: only at the end of training; -1: never (Ctrl-C still saves)
    keep_last: int = 2  # newest checkpoints kept; 0: keep all
    resume: Literal["auto", "must", "off"] = "auto"  # auto: from `latest` if any; must: refuse to start without; off: fresh
    # a checkpoint to go back to instead of `latest`: a step number (or step_NNNNNNNN) of checkpoint.dir, or a step
    # directory's path (any run's); checkpoint.dir's later checkpoints are moved aside, not deleted; the same
    # command run again continues from the newest checkpoint saved after it (docs/checkpoints.md)
    resume_from: Union[int, str, None] = None
    save_hf_at_end: bool = False  # also export the final actor (and critic) as HF directories under <run.output_dir>/hf

    def check(self) -> None:
        _at_least(self, save_every=-1, keep_last=0)
        _require(not (self.resume_from is not None and self.resume == "off"),
                 f"checkpoint.resume_from={self.resume_from} names a checkpoint to resume from, but "
                 "checkpoint.resume=off starts fresh. Fix: drop one of them (checkpoint.resume=auto or must "
                 "resumes from the named checkpoint).")


@dataclasses.dataclass(frozen=True)
class LoggingConfig(_Section):
    sinks: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = dataclasses.field(
        default_factory=lambda: ["console", "jsonl"])  # where metrics go
    project: str = "megappo"  # W&B project / MLflow experiment
    # the mlflow sink's tracking server or store (http://host:5000, sqlite:///path.db, databricks, ...); None:
    # MLflow's own choice (its MLFLOW_TRACKING_URI variable, else its default)
    mlflow_tracking_uri: Optional[str] = None
    run_name: Optional[str] = None  # None: the name of run.output_dir
    progress_bar: bool = True  # a live progress line on the console
    # the console's step line: compact (step, score, pg/vf/kl losses, s/step, ETA; samples of step 1 and every
    # 10th step) or full (the main metrics of every step, with its samples); metrics.jsonl has everything either way
    console: Literal["compact", "full"] = "compact"
    samples: int = 1  # prompt/response/score examples shown per step (console) and kept (samples.jsonl); 0: none
    # every generation of each step, as <dir>/<step>.jsonl (verl's trainer.rollout_data_dir); None: none
    rollout_dir: Optional[str] = None
    validation_dir: Optional[str] = None  # every validation generation, as <dir>/<step>.jsonl (verl's validation_data_dir)

    def check(self) -> None:
        _at_least(self, samples=0)


@dataclasses.dataclass(frozen=True)
class RunConfig(_Section):
    output_dir: str = "runs/default"  # metrics, resolved config, checkpoints
    seed: int = 42  # global seed (init, dropout, mini-batch shuffling)
    total_steps: Optional[int] = None  # PPO steps; None: total_epochs over the prompts
    total_epochs: int = 1  # used when total_steps is None
    val_every: int = 0  # steps between validations, and after the last step (as verl's test_freq); 0: none during training
    val_before_train: bool = False  # validate once before the first step
    max_nan_skips: int = 3  # abort after this many steps skipped for non-finite loss/grads
    # restart every rank from the latest checkpoint, at most this often, after a rank died (kill -9, a crash,
    # the OOM killer) or a collective timed out; never after bad input, a NaN abort or SIGINT/SIGTERM
    # (megappo.parallel.launch; when `megappo train` starts its ranks, not under an outside torchrun)
    max_restarts: int = 0
    critic_warmup: int = 0  # the first N steps train the critic alone (the actor stays frozen; verl's trainer.critic_warmup)
    # validate once and stop (verl's trainer.val_only): model.path's weights, or the checkpoint resumed from (e.g.
    # checkpoint.resume_from=PATH); no training step, no checkpoint; metrics in <run.output_dir>/val_only/
    val_only: bool = False

    def check(self) -> None:
        _at_least(self, total_steps=1, total_epochs=1, val_every=0, max_nan_skips=0, max_restarts=0, critic_warmup=0)


@dataclasses.dataclass(frozen=True)
class HardwareConfig(_Section):
    """The machines a recipe is sized for. `megappo plan RECIPE` plans this world size and memory per
    GPU, the launchers in tools/launch/ start this many ranks by default, and `megappo train` warns
    when a GPU run is launched on another world size. With device=cpu a 'GPU' is one gloo rank and
    its share of the host's memory. Other machines are `variants` of the recipe (docs/planner.md)."""

    device: Literal["gpu", "cpu"] = "gpu"  # gpu: one rank per GPU (NCCL); cpu: gloo ranks on the host's cores
    nodes: int = 1  # machines
    gpus_per_node: Optional[int] = None  # ranks per machine, one per GPU; None: parallel.tp * parallel.pp (one replica)
    gpu_memory_gib: float = 80.0  # memory of one GPU in GiB (device=cpu: host memory per rank)
    # dense peak TFLOP/s of one GPU in model.dtype, the denominator of perf/mfu/*; None: megappo.perf's table by
    # the CUDA device's name (H100, H200, A100), no MFU on other GPUs and on CPU
    peak_tflops: Optional[float] = None

    def check(self) -> None:
        _at_least(self, nodes=1, gpus_per_node=1)
        _require(self.gpu_memory_gib > 0, f"{P}gpu_memory_gib={self.gpu_memory_gib} must be > 0 (GiB per GPU). "
                                          f"Fix: e.g. {P}gpu_memory_gib=80.")
        _require(self.peak_tflops is None or self.peak_tflops > 0,
                 f"{P}peak_tflops={self.peak_tflops} must be > 0 (TFLOP/s of one GPU). Fix: e.g. {P}peak_tflops=989 "
                 f"(H100 SXM, bf16), or leave it unset to read the GPU's name.")
        _require(self.nodes == 1 or self.gpus_per_node is not None,
                 f"{P}nodes={self.nodes} needs {P}gpus_per_node (the ranks of each node). Fix: set "
                 f"{P}gpus_per_node=8 (or your GPUs per node).")

    def describe(self, world_size: int, memory_gib: Optional[float] = None) -> str:
        """'1 node x 8 GPUs of 80 GiB' (cpu: ranks and host memory) for `world_size` ranks in all; a world
        that is not nodes x ranks is '6 GPUs of 80 GiB'."""
        unit = "GPU" if self.device == "gpu" else "rank"
        memory = f"{self.gpu_memory_gib if memory_gib is None else memory_gib:g} GiB" + (
            "" if self.device == "gpu" else " of host memory")
        per_node, split = divmod(world_size, self.nodes)
        if split or self.nodes == 1 and world_size == 1:
            return f"{world_size} {unit}{'s' if world_size > 1 else ''} of {memory}"
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {per_node} {unit}{'s' if per_node > 1 else ''} "
                f"of {memory}")


@dataclasses.dataclass(frozen=True)
class Config(_Section):
    model: ModelConfig  # the SFT model (actor, ref and default critic init)
    parallel: ParallelConfig = _default(ParallelConfig)  # TP / PP / VPP layout of every role without its own
    actor: ActorConfig = _default(ActorConfig)  # the trained policy: PPO loss and optimizer
    critic: CriticConfig = _default(CriticConfig)  # the value model (GAE)
    ref: RefConfig = _default(RefConfig)  # the frozen reference policy (KL terms)
    reward: RewardConfig = _default(RewardConfig)  # rule-based reward functions and/or a reward model
    algorithm: AlgorithmConfig = _default(AlgorithmConfig)  # advantage estimator, discounting, in-reward KL
    rollout: RolloutConfig = _default(RolloutConfig)  # generation engine, sampling, weight sync
    data: DataConfig = _default(DataConfig)  # prompts and batch size
    checkpoint: CheckpointConfig = _default(CheckpointConfig)  # trainer checkpoints and resume
    logging: LoggingConfig = _default(LoggingConfig)  # metric sinks and console
    run: RunConfig = _default(RunConfig)  # output directory, seed, length, validation cadence
    hardware: HardwareConfig = _default(HardwareConfig)  # the machines this recipe is sized for (plan, launchers)
    variants: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # other hardware: name -> overrides

    def check(self) -> None:
        est, n = self.algorithm.adv_estimator, self.rollout.n
        for name, overrides in self.variants.items():
            for override in overrides:
                key = override.partition("=")[0].strip()
                _require("=" in override and bool(key) and not key.startswith("variants"),
                         f"variants.{name}: '{override}' is not a KEY=VALUE override of this recipe. Fix: write "
                         f"it like hardware.gpus_per_node=4 or parallel.tp=2.")
        _require(self.run.max_restarts == 0 or self.checkpoint.save_every >= 0,
                 f"run.max_restarts={self.run.max_restarts} restarts a run from its latest checkpoint, but "
                 "checkpoint.save_every=-1 saves none. Fix: set checkpoint.save_every=N (every N steps) or "
                 "run.max_restarts=0.")
        _require(self.critic.enable is not False or not self.algorithm.needs_critic,
                 "algorithm.adv_estimator=gae needs a critic, but critic.enable=false. Fix: set critic.enable=null "
                 "(auto) or choose an outcome estimator, e.g. algorithm.adv_estimator=grpo.")
        _require(not self.algorithm.grouped or n >= 2,
                 f"algorithm.adv_estimator={est} compares samples of the same prompt, but rollout.n={n}. "
                 f"Fix: set rollout.n >= 2 (e.g. rollout.n=8).")
        _require(self.actor.moe_routing != "replay" or self.rollout.env == "single_turn",
                 f"actor.moe_routing=replay records the engine's routes of single-turn responses; multi-turn "
                 f"episodes (rollout.env={self.rollout.env}) have no single record yet. Fix: set "
                 f"actor.moe_routing=recompute or rollout.env=single_turn.")
        _require(self.actor.moe_routing != "replay" or self.actor.recompute.granularity == "none",
                 f"actor.moe_routing=replay replays the engine's routes in the forward pass only; recomputation "
                 f"(actor.recompute.granularity={self.actor.recompute.granularity}) would route again in the "
                 f"backward with the trainer's own routers. Fix: set actor.recompute.granularity=none, or "
                 f"actor.moe_routing=recompute.")
        # a verl LoRA script gives the reference the actor's layout (verl, too, runs it as the actor's base)
        actor_layout = dict(zip(("tp", "pp", "vpp"), self.layout("actor")), ep=self.expert_parallel("actor"))
        _require(not self.ref_is_actor_base or all(
                     v is None or v == actor_layout[k] for k, v in dataclasses.asdict(self.ref.parallel).items()),
                 f"with actor.lora the reference policy is the actor with its adapters off (no model of its own), "
                 f"so ref.parallel does not apply (it may only repeat the actor's layout, {actor_layout}). Fix: "
                 f"remove ref.parallel.")
        _require(not self.ref_is_actor_base or self.ref.dist_checkpoint in (None, self.actor.dist_checkpoint),
                 f"with actor.lora the reference policy is the actor's own weights with its adapters off, so it "
                 f"starts from actor.dist_checkpoint ({self.actor.dist_checkpoint}), not ref.dist_checkpoint="
                 f"{self.ref.dist_checkpoint}. Fix: remove ref.dist_checkpoint, or give it the actor's.")
        for role in self.model_roles:
            tp, pp, vpp = self.layout(role)
            _require(vpp is None or pp > 1, f"{role}.parallel.vpp={vpp} needs a pipeline (pp > 1), but {role}'s pp is "
                     f"{pp}. Fix: set {role}.parallel.vpp=null or raise {role}.parallel.pp.")
            _require(not self.parallel.sequence_parallel or tp > 1,
                     f"parallel.sequence_parallel needs tp > 1 for every role, but {role}'s tp is 1. Fix: set "
                     f"{role}.parallel.tp >= 2 or parallel.sequence_parallel=false.")
            # the section whose max_tokens_per_micro_batch applies (ref: its own, else the actor's)
            owner = "actor" if role == "ref" and not self.ref.max_tokens_per_micro_batch else role
            own, longest = getattr(self, owner).max_tokens_per_micro_batch, self.max_sequence_length
            key = f"{owner}.max_tokens_per_micro_batch"
            _require(not self.packs(role) or own is None or own >= longest,
                     f"{key}={own} is smaller than the longest sequence, data.max_prompt_length + "
                     f"rollout.max_new_tokens = {longest}: such a sequence would fit no micro-batch. Fix: set "
                     f"{key} >= {longest} (or lower the lengths).")
        keys, weights = self.gdpo_components, self.algorithm.gdpo_reward_weights
        _require(not self.algorithm.estimator.components or bool(keys),
                 f"algorithm.adv_estimator={est} normalises each reward component apart, but reward.functions is empty. "
                 "Fix: list the components in reward.functions (e.g. [format_reward, exact_match]).")
        unknown = [k for k in keys if k not in self.reward.functions]
        _require(not unknown, f"algorithm.gdpo_reward_keys: {unknown} are not in reward.functions "
                              f"{self.reward.functions}. Fix: name functions of reward.functions (each one a component).")
        _require(weights is None or len(weights) == len(keys),
                 f"algorithm.gdpo_reward_weights has {len(weights or ())} entries for {len(keys)} components. Fix: give "
                 "one weight per component of algorithm.gdpo_reward_keys, or null (all 1.0).")
        fg = self.algorithm.filter_groups
        _require(not fg.enable or n >= 2,
                 f"algorithm.filter_groups keeps groups whose samples differ, but rollout.n={n}: a group of one never "
                 "differs, so every group would be dropped. Fix: set rollout.n >= 2 (DAPO uses 8-16).")
        _require(not fg.enable or fg.metric not in ("reward", "seq_reward", "score") or not self.reward.model_path,
                 "algorithm.filter_groups.metric=reward filters at generation on rank 0, before the reward model's "
                 "pass, so the reward model's scores are not known yet. Fix: filter on a rule-based function's field "
                 "(algorithm.filter_groups.metric=acc) or drop reward.model_path.")
        gen_batch = self.data.gen_batch_size or self.data.train_batch_size
        bounded = fg.enable and fg.max_num_gen_batches
        _require(not bounded or fg.max_num_gen_batches * gen_batch >= self.data.train_batch_size,
                 f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} generation batches of "
                 f"data.gen_batch_size={gen_batch} prompts hold fewer than data.train_batch_size="
                 f"{self.data.train_batch_size}: no step could fill its batch. Fix: raise max_num_gen_batches (0: no "
                 "bound) or data.gen_batch_size.")
        ob = self.reward.overlong_buffer
        _require(not ob.enable or ob.len <= self.rollout.max_new_tokens,
                 f"reward.overlong_buffer.len={ob.len} is longer than rollout.max_new_tokens="
                 f"{self.rollout.max_new_tokens}. Fix: set reward.overlong_buffer.len <= {self.rollout.max_new_tokens} "
                 "(DAPO: a quarter of it or less).")
        _require(not self.run.critic_warmup or self.use_critic,
                 f"run.critic_warmup={self.run.critic_warmup} trains the critic alone first, but this run has no critic "
                 f"(algorithm.adv_estimator={est}). Fix: set run.critic_warmup=0, or use algorithm.adv_estimator=gae.")
        rc = self.algorithm.rollout_correction
        _require(self.actor.old_logprob == "recompute" or not rc.enabled,
                 f"actor.old_logprob={self.actor.old_logprob} is a preset of algorithm.rollout_correction, which is set "
                 "as well; megappo will not guess which one you meant. Fix: remove actor.old_logprob and write it with "
                 "algorithm.rollout_correction: is_correct = rollout_is=token rollout_is_threshold=<actor.is_truncate>; "
                 "bypass = bypass_mode=true.")
        mode = self.actor.policy_loss.loss_mode
        bypass = self.bypass_old_logprobs
        _require(mode != "bypass_mode" or bypass,
                 "actor.policy_loss.loss_mode=bypass_mode takes the engine's log-probs as the old policy's, but they are "
                 "recomputed. Fix: set algorithm.rollout_correction.bypass_mode=true (it selects that loss itself).")
        _require(not rc.bypass_mode or mode in ("vanilla", "bypass_mode"),
                 f"algorithm.rollout_correction.bypass_mode=true trains with verl's bypass loss (loss_type="
                 f"{rc.loss_type}), not actor.policy_loss.loss_mode={mode} (verl would replace it silently). Fix: "
                 f"set algorithm.rollout_correction.bypass_mode=false to train with {mode} (decoupled correction), or "
                 "remove actor.policy_loss.loss_mode.")
        _require(not self.algorithm.estimator.sum_pi_squared or not bypass,
                 f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs the trainer's old log-probs and their "
                 "sum of squared probabilities, which bypass mode does not compute. Fix: set actor.old_logprob=recompute "
                 "and algorithm.rollout_correction.bypass_mode=false.")
        _require(self.rollout.mode == "sync" or self.actor.old_logprob in ("recompute", "is_correct"),
                 f"rollout.mode={self.rollout.mode} trains on samples of the previous policy version, but "
                 f"actor.old_logprob={self.actor.old_logprob} would take the stale engine's log-probs as the "
                 "old policy's. Fix: set actor.old_logprob=is_correct (recommended: recomputes them and weights "
                 "each token by the truncated importance ratio) or actor.old_logprob=recompute.")
        _require(self.rollout.lora_sync == "merged" or self.actor.lora.enabled,
                 "rollout.lora_sync=adapters syncs the actor's LoRA adapters, but actor.lora is off (rank 0). Fix: "
                 "set actor.lora.rank (e.g. 8) or rollout.lora_sync=merged.")
        for role in ("actor", "critic"):
            lora, recompute = getattr(self, role).lora, getattr(self, role).recompute
            _require(not (lora.enabled and lora.dropout) or recompute.granularity == "none",
                     f"{role}.lora.dropout={lora.dropout} with {role}.recompute.granularity={recompute.granularity}: "
                     "the recomputed forward would draw other dropout masks than the first, so the gradients would "
                     f"be wrong. Fix: set {role}.lora.dropout=0 (RL with LoRA rarely uses it) or "
                     f"{role}.recompute.granularity=none.")
        for role in ("actor", "critic") if self.use_critic else ("actor",):
            mini, micro = getattr(self, role).ppo_mini_batch_size, getattr(self, role).micro_batch_size
            _require(self.data.train_batch_size % mini == 0,
                     f"data.train_batch_size={self.data.train_batch_size} is not divisible by "
                     f"{role}.ppo_mini_batch_size={mini}. Fix: make {role}.ppo_mini_batch_size a divisor of it.")
            _require(getattr(self, role).packing or mini * n % micro == 0,
                     f"{role}: a mini-batch of {mini * n} sequences ({role}.ppo_mini_batch_size={mini} x rollout.n="
                     f"{n}) is not divisible by {role}.micro_batch_size={micro}. Fix: pick a micro_batch_size that "
                     f"divides {mini * n}.")

    # -- derived values -------------------------------------------------------------------

    @property
    def use_critic(self) -> bool:
        return self.algorithm.needs_critic if self.critic.enable is None else self.critic.enable

    @property
    def rollout_correction(self) -> RolloutCorrectionConfig:
        """The correction this run applies: algorithm.rollout_correction, or what the actor.old_logprob preset
        means (is_correct: token weights truncated at actor.is_truncate; bypass: the engine's log-probs are old)."""
        presets = {"is_correct": dict(rollout_is="token", rollout_is_threshold=self.actor.is_truncate),
                   "bypass": dict(bypass_mode=True)}
        preset = presets.get(self.actor.old_logprob)
        return RolloutCorrectionConfig(**preset) if preset else self.algorithm.rollout_correction

    @property
    def gdpo_components(self) -> list[str]:
        """GDPO's reward components: algorithm.gdpo_reward_keys, else every reward function."""
        keys = self.algorithm.gdpo_reward_keys
        return list(self.reward.functions if keys is None else keys)

    @property
    def bypass_old_logprobs(self) -> bool:
        """The engine's log-probs are the old policy's: the actor does not recompute them."""
        return self.rollout_correction.bypass_mode

    @property
    def policy_loss_mode(self) -> str:
        """The registry entry the actor trains with (bypass mode has its own)."""
        return "bypass_mode" if self.bypass_old_logprobs else self.actor.policy_loss.loss_mode

    @property
    def needs_ref(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def ref_is_actor_base(self) -> bool:
        """The reference log-probs come from the actor with its LoRA adapters off: no reference model."""
        return self.needs_ref and self.actor.lora.enabled

    @property
    def roles(self) -> tuple[str, ...]:
        """The Megatron models this run builds (the reward model aside)."""
        return ("actor",) + (("critic",) if self.use_critic else ()) + (("ref",) if self.needs_ref else ())

    @property
    def ref_micro_batch_size(self) -> int:
        return self.ref.micro_batch_size or self.actor.micro_batch_size

    @property
    def max_sequence_length(self) -> int:
        """The longest prompt + response a pass can see."""
        return self.data.max_prompt_length + self.rollout.max_new_tokens

    def packs(self, role: Literal["actor", "critic", "ref", "reward"]) -> bool:
        """Whether a role's passes pack sequences (megappo.parallel.packing)."""
        if role == "ref":
            return self.actor.packing if self.ref.packing is None else self.ref.packing
        return getattr(self, role).packing

    def max_tokens_per_micro_batch(self, role: Literal["actor", "critic", "ref", "reward"]) -> int:
        """A role's packed micro-batch budget: its own, else (ref) the actor's, else the padded path's
        micro-batch, `micro_batch_size` sequences of the longest length."""
        if role == "ref":
            own = self.ref.max_tokens_per_micro_batch or self.actor.max_tokens_per_micro_batch
            micro = self.ref_micro_batch_size
        else:
            own, micro = getattr(self, role).max_tokens_per_micro_batch, getattr(self, role).micro_batch_size
        return own or micro * self.max_sequence_length

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or f"{self.run.output_dir.rstrip('/')}/checkpoints"

    def layout(self, role: Literal["actor", "critic", "ref", "reward"]) -> tuple[int, int, Optional[int]]:
        """(tp, pp, vpp) of a role: its own `<role>.parallel` fields, else the shared `parallel` (a
        reference that is the actor's base: the actor's)."""
        role = "actor" if role == "ref" and self.ref_is_actor_base else role
        own, shared = getattr(self, role).parallel, self.parallel
        tp = own.tp or shared.tp
        pp = own.pp or shared.pp
        vpp = own.vpp if own.vpp is not None else (shared.vpp if pp == shared.pp else None)
        return tp, pp, vpp

    def expert_parallel(self, role: Literal["actor", "critic", "ref", "reward"]) -> int:
        """A role's expert-parallel size: its own `<role>.parallel.ep`, else `parallel.ep`."""
        role = "actor" if role == "ref" and self.ref_is_actor_base else role
        return getattr(self, role).parallel.ep or self.parallel.ep

    @property
    def min_world_size(self) -> int:
        """The fewest ranks every role's layout fits: the lcm of their tp * pp * ep (ep data-parallel
        replicas for expert parallelism, one otherwise)."""
        return math.lcm(*(tp * pp * self.expert_parallel(role)
                          for role in self.model_roles for tp, pp, _ in [self.layout(role)]))

    @property
    def hardware_world_size(self) -> int:
        """Ranks of the recipe's hardware: nodes x gpus_per_node (gpus_per_node unset: min_world_size)."""
        return self.hardware.nodes * (self.hardware.gpus_per_node or self.min_world_size)

    @property
    def launch_world_size(self) -> int:
        """Ranks `megappo train` starts itself (no torchrun, no --world-size): a GPU recipe's hardware
        world when it names its GPUs, else one data-parallel replica (min_world_size)."""
        named = self.hardware.device == "gpu" and self.hardware.gpus_per_node is not None
        return self.hardware_world_size if named else self.min_world_size

    def hardware_mismatch(self, world_size: int, recipe: str, sized_by: Optional[str] = None) -> Optional[str]:
        """A warning when a GPU run has another world size than its recipe's hardware, naming the fix;
        None when they agree, when the recipe does not say (hardware.gpus_per_node unset), or on CPU
        (there the rank count changes the speed, not what fits). `sized_by`: what set the hardware, when
        not the recipe's section ('trainer.nnodes=16 sizes this run')."""
        expected = self.hardware_world_size
        if self.hardware.device == "cpu" or self.hardware.gpus_per_node is None or world_size == expected:
            return None
        ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
        sized = f"{sized_by} for {expected} GPUs ({self.hardware.describe(expected)})" if sized_by else \
            f"{recipe} is sized for {expected} GPUs ({self.hardware.describe(expected)}: its hardware section)"
        return (f"{sized} but this run has {ranks}; its memory plan does not hold for them. Fix: launch "
                f"{expected} ranks, or plan this world and set it: megappo plan {recipe} --world-size {world_size} "
                f"(then hardware.nodes / hardware.gpus_per_node, or a --variant of the recipe).")

    @property
    def model_roles(self) -> tuple[str, ...]:
        """Every Megatron model this run builds, the reward model included, in build order."""
        return self.roles + (("reward",) if self.reward.model_path else ())

    @property
    def prompts_per_draw(self) -> int:
        """Prompts the sampler hands out per call: data.gen_batch_size with algorithm.filter_groups (a step
        takes one or more such generation batches), else data.train_batch_size (a step takes one)."""
        d = self.data
        return (d.gen_batch_size or d.train_batch_size) if self.algorithm.filter_groups.enable else d.train_batch_size

    @property
    def prompts_per_draw_key(self) -> str:
        """The key that sets `prompts_per_draw`, for messages."""
        fg, d = self.algorithm.filter_groups, self.data
        return "data.gen_batch_size" if fg.enable and d.gen_batch_size else "data.train_batch_size"

    def updates_per_step(self, role: Literal["actor", "critic"]) -> int:
        """Optimizer steps per PPO step: mini-batches per batch x epochs."""
        section = getattr(self, role)
        return self.data.train_batch_size // section.ppo_mini_batch_size * section.ppo_epochs

    def dp_size(self, world_size: int, role: str = "actor") -> int:
        """A role's data-parallel replicas: world_size / (its tp * pp), after `validate_world`."""
        self.validate_world(world_size)
        tp, pp, _ = self.layout(role)
        return world_size // (tp * pp)

    def validate_world(self, world_size: int) -> None:
        """Checks that need the number of ranks: layouts divide it, batches split over data-parallel replicas."""
        tp, pp = self.parallel.tp, self.parallel.pp
        _require(world_size >= 1, f"world size {world_size} must be >= 1. Fix: launch at least one rank.")
        _require(world_size % (tp * pp) == 0, f"world size {world_size} is not a multiple of parallel.tp*parallel.pp = "
                 f"{tp}*{pp}. Fix: launch a multiple of {tp * pp} ranks or change parallel.tp/parallel.pp.")
        for role in self.model_roles:
            rtp, rpp, _ = self.layout(role)
            _require(world_size % (rtp * rpp) == 0,
                     f"world size {world_size} is not a multiple of {role}'s tp*pp = {rtp}*{rpp}. Fix: change "
                     f"{role}.parallel.tp/pp (or parallel.tp/pp) so that their product divides {world_size}.")
            ep = self.expert_parallel(role)
            _require((world_size // (rtp * rpp)) % ep == 0,
                     f"{role}: expert parallelism ep={ep} must divide its data-parallel size world/(tp*pp) = "
                     f"{world_size}/({rtp}*{rpp}) = {world_size // (rtp * rpp)}. Fix: launch a multiple of "
                     f"{rtp * rpp * ep} ranks or change parallel.ep ({role}.parallel.ep).")
        batch = self.data.train_batch_size * self.rollout.n
        splits = [(role, getattr(self, role).micro_batch_size, "a mini-batch",
                   getattr(self, role).ppo_mini_batch_size * self.rollout.n)
                  for role in ("actor", "critic") if role in self.roles]
        splits += [("ref", self.ref_micro_batch_size, "the batch", batch)] if self.needs_ref else []
        splits += [("reward", self.reward.micro_batch_size, "the batch", batch)] if self.reward.model_path else []
        for role, micro, what, seqs in splits:
            rtp, rpp, _ = self.layout(role)
            dp = world_size // (rtp * rpp)
            _require(self.packs(role) or seqs % (dp * micro) == 0,
                     f"{role}: {what} of {seqs} sequences does not split over dp={dp} replicas in micro-batches of "
                     f"{micro}. Fix: make {role}.micro_batch_size x {dp} divide {seqs} (or change the batch sizes or "
                     f"the world size).")

    def require_training_data(self) -> None:
        """What `megappo train` needs beyond a valid config: prompts, a reward, validation prompts if asked for."""
        self.data.require_training_data()
        _require(bool(self.reward.functions or self.reward.model_path or self.rollout.env != "single_turn"),
                 "no reward: reward.functions is empty, reward.model_path is unset and rollout.env=single_turn. Fix: "
                 "set reward.functions=[gsm8k] (names in megappo.rewards), reward.model_path, or a rollout.env whose "
                 "steps give rewards.")
        wants_val = self.run.val_every > 0 or self.run.val_before_train
        _require(not wants_val or bool(self.data.val_files or self.data.builtin),
                 "run.val_every / run.val_before_train ask for validation, but data.val_files is empty. Fix: set "
                 "data.val_files=[val.jsonl] or run.val_every=0 run.val_before_train=false.")
        _require(not self.run.val_only or bool(self.data.val_files or self.data.builtin),
                 "run.val_only=true validates, but data.val_files is empty. Fix: set data.val_files=[val.jsonl].")

    def to_dict(self) -> dict:
        """Plain YAML/JSON data; `megappo.recipe.config_from_dict(cfg.to_dict()) == cfg`."""
        return _plain(self)


# -- conversion of plain data to typed fields -----------------------------------------------

_YAML11_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")  # PyYAML reads `1e-6` (no dot) as a str
_SCALARS = (bool, int, float, str)
_EXAMPLES = {bool: "true", int: "2", float: "0.5", str: "text", list: "[a,b]", tuple: "[0.9,0.999]", dict: "{k: v}"}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _options(tp: Any) -> list[Any]:
    """The non-None members of a Union (`Optional[X]` -> [X]); [tp] for anything else."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is Literal:
        return f"one of {list(args)}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _type_error(key: str, value: Any, tp: Any) -> ConfigError:
    base = _options(tp)[0]
    if base is str and not isinstance(value, str):
        fix = f"quote it: {P}{key}='{value}'"
    else:
        fix = f"write e.g. {P}{key}={_EXAMPLES.get(typing.get_origin(base) or base, '{k: v}')}"
    return ConfigError(f"{P}{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__}). Fix: {fix}.")


def _convert(key: str, value: Any, tp: Any) -> Any:
    """`value` checked against annotation `tp`, containers and sections converted. `key` is section-relative."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = _options(tp)
        if float in options and isinstance(value, float) and not math.isfinite(value):
            return _convert(key, value, float)  # the finiteness error, not "expected float or null"
        if len(options) == 1 and options[0] not in _SCALARS:
            return _convert(key, value, options[0])  # its error is the more specific one
        for option in options:
            with contextlib.suppress(ConfigError):
                return _convert(key, value, option)
        raise _type_error(key, value, tp)
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:  # True == 1, but not a choice of 1
            return value
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on/no/yes as a bool: the choice of that spelling
            spelled = [a for a in args if isinstance(a, str) and a.lower() in _YAML_BOOLS[value]]
            if len(spelled) == 1:
                return spelled[0]
        guess = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" Did you mean '{guess[0]}'?" if guess else ""
        raise ConfigError(f"{P}{key}: {value!r} is not one of {list(args)}.{hint} Fix: set {P}{key} to one of them.")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise _type_error(key, value, tp)
        try:
            return _build(tp, value)
        except ConfigError as e:
            raise e.under(key) from None
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.match(value.strip()):
            value = float(value)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _type_error(key, value, tp)
        if not math.isfinite(value):  # YAML's .nan / .inf: no field means anything by them
            raise ConfigError(f"{P}{key}={value} is not a finite number. Fix: set {P}{key} to a finite value.")
        return float(value)
    if tp in _SCALARS:
        if isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):
            return value
        raise _type_error(key, value, tp)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, value, tp)
        return [_convert(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or (Ellipsis not in args and len(value) != len(args)):
            raise _type_error(key, value, tp)
        items = [args[0]] * len(value) if Ellipsis in args else args
        return tuple(_convert(f"{key}[{i}]", v, t) for i, (v, t) in enumerate(zip(value, items)))
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _type_error(key, value, tp)
        return {k: _convert(f"{key}.{k}", v, args[1]) for k, v in value.items()}
    raise TypeError(f"config annotation {tp!r} of '{key}' is not supported")  # a bug in this module


def _unknown_key(key: Any, valid: list[str]) -> ConfigError:
    guess = difflib.get_close_matches(str(key), valid, n=1)
    hint = (f" Did you mean '{P}{guess[0]}'? Fix: rename it." if guess
            else " Fix: remove it or use one of the valid keys.")
    return ConfigError(f"unknown config key '{P}{key}'.{hint} Valid keys: {valid}.")


#: (section, key) that a reader may expect but the section does not take, and why
_NOT_HERE = {
    (RefConfig, "recompute"): "the reference model only runs forward passes, which keep no activations for backward, "
                              "so there is nothing to recompute. Fix: remove it (recomputation is for the trained "
                              "roles: actor.recompute, critic.recompute).",
    (RewardConfig, "recompute"): "the reward model only runs forward passes, which keep no activations for backward, "
                                 "so there is nothing to recompute. Fix: remove it (recomputation is for the trained "
                                 "roles: actor.recompute, critic.recompute).",
    (RefConfig, "lora"): "the reference policy is the base model: with actor.lora it is the actor with its adapters "
                         "off, without it a frozen copy. Fix: remove it (adapters are set with actor.lora).",
    (RewardConfig, "lora"): "the reward model is not trained, so it has no adapters. Fix: remove it (adapters are "
                            "for the trained roles: actor.lora, critic.lora).",
}


def _not_here(cls: type, key: Any) -> Optional[ConfigError]:
    why = _NOT_HERE.get((cls, key))
    return ConfigError(f"{P}{key}: {why}") if why else None


def _build(cls: type, data: dict) -> Any:
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in valid:
            raise _not_here(cls, key) or _unknown_key(key, valid)
    return cls(**data)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj
