"""The roles' own settings: `actor` (PPO loss, its policy-loss choice in `actor.policy_loss`,
micro-batching, the old log-probs' source), `critic` (value loss), `ref` (the frozen reference
policy's passes), and `<role>.optim` (optimizer and LR schedule of a trained role).

Cross-section rules beside these sections: `check_routing_replay` (MoE routes from the engine),
`check_reference_of_lora_actor` (a LoRA actor's base is the reference), `check_model_roles` (each
model role's layout and packed micro-batch budget) and `check_mini_batches` (batch sizes divide).
They read the root `Config` (megappo.config.root, which imports this module) through its derived
values.

Owns: these sections, their defaults and checks. Does not know about the losses' math
(megappo.ppo) or the workers that train (megappo.trainer.roles); the names of the policy losses come
from megappo.ppo.specs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from megappo.config.model import LoRAConfig, RecomputeConfig, RoleParallelConfig
from megappo.config.schema import _at_least, _default, _require, _Section
from megappo.errors import P
from megappo.ppo.specs import POLICY_LOSS_NAMES

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KLEstimator = Literal[KL_ESTIMATORS + tuple(k + "+" for k in KL_ESTIMATORS)]  # "+": straight-through k2 grad
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]

#: verl 0.9.1's policy losses: the names megappo.ppo.specs declares (megappo.ppo.policy_losses.POLICY_LOSSES)
POLICY_LOSS_MODES = POLICY_LOSS_NAMES


@dataclasses.dataclass(frozen=True)
class OptimConfig(_Section):
    lr: float = 1e-6
    """Peak learning rate (> 0)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas, each in [0, 1)."""
    eps: float = 1e-8
    """Adam epsilon."""
    warmup_steps: int = 0
    """Linear warmup over this many training steps. The rate moves once per step, after its update, and is constant
    over the step's mini-batches and epochs (as verl's)."""
    warmup_steps_ratio: float = 0.0
    """With `warmup_steps` 0: warm up over int(ratio x the run's training steps), counted when the run knows them
    (from the data when `run.total_steps` is null; verl's `lr_warmup_steps_ratio`)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """`constant`, `linear` or `cosine` after warmup, to `run.total_steps`."""
    min_lr_ratio: float = 0.0
    """Decay floor as a fraction of `lr`."""

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


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig(_Section):
    """The actor's policy loss (megappo.ppo.policy_losses; docs/ppo-math.md), verl's actor.policy_loss."""

    loss_mode: Literal[POLICY_LOSS_MODES] = "vanilla"
    """verl's policy losses ([ppo-math.md](ppo-math.md#policy-losses)): `vanilla` (clipped PPO, dual-clip), `gspo`,
    `cispo`, `sapo`, `gpg`, `dppo_tv`, `dppo_kl`, `clip_cov`, `kl_cov`, `geo_mean`, `dro`; bypass:
    `algorithm.rollout_correction.bypass_mode`."""
    clip_cov_ratio: float = 0.0002
    """`clip_cov`: fraction of tokens whose gradient is cut (> 0)."""
    clip_cov_lb: float = 1.0
    """`clip_cov`: lower bound of the covariance of the tokens it may cut."""
    clip_cov_ub: float = 5.0
    """`clip_cov`: upper bound of that covariance."""
    kl_cov_ratio: float = 0.0002
    """`kl_cov`: fraction of tokens (largest covariance) that get the |log ratio| penalty (> 0)."""
    ppo_kl_coef: float = 0.1
    """`kl_cov`: weight of that penalty."""
    dro_beta: Optional[float] = None
    """`dro`: weight of the quadratic log-ratio penalty (required, > 0)."""

    def check(self) -> None:
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            _require(getattr(self, name) > 0, f"{P}{name}={getattr(self, name)} must be > 0. Fix: e.g. {P}{name}=0.0002.")
        _require(self.clip_cov_lb < self.clip_cov_ub, f"{P}clip_cov_lb={self.clip_cov_lb} must be below "
                 f"{P}clip_cov_ub={self.clip_cov_ub}. Fix: e.g. {P}clip_cov_lb=1.0 {P}clip_cov_ub=5.0.")
        _require(self.ppo_kl_coef >= 0, f"{P}ppo_kl_coef={self.ppo_kl_coef} must be >= 0. Fix: e.g. {P}ppo_kl_coef=0.1.")
        _require(self.loss_mode != "dro" or (self.dro_beta is not None and self.dro_beta > 0),
                 f"{P}loss_mode=dro needs {P}dro_beta > 0 (the weight of its quadratic log-ratio penalty), got "
                 f"{self.dro_beta}. Fix: e.g. {P}dro_beta=0.1.")


def _check_trained_role(role: Any) -> None:
    _at_least(role, ppo_mini_batch_size=1, micro_batch_size=1, ppo_epochs=1, max_tokens_per_micro_batch=1)
    _require(role.grad_clip > 0, f"{P}grad_clip={role.grad_clip} must be > 0. Fix: e.g. {P}grad_clip=1.0.")
    _require(role.loss_scale_factor is None or role.loss_scale_factor > 0,
             f"{P}loss_scale_factor={role.loss_scale_factor} must be > 0. Fix: e.g. {P}loss_scale_factor=4096 (the "
             f"response budget, rollout.max_new_tokens), or null for the step's longest response.")


@dataclasses.dataclass(frozen=True)
class ActorConfig(_Section):
    dist_checkpoint: Optional[str] = None
    """A Megatron-Core dist checkpoint the actor starts from instead of `model.path`'s weights (verl's
    `actor.megatron.dist_checkpointing_path`); `model.path` still gives the HF config and tokenizer
    ([models.md](models.md#starting-from-a-megatron-dist-checkpoint))."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (x `rollout.n` sequences)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one data-parallel replica (without packing)."""
    packing: bool = True
    """Pack sequences without padding into micro-batches of `max_tokens_per_micro_batch` tokens (verl's
    `use_remove_padding` + `use_dynamic_bsz`); `false`: pad and split by `micro_batch_size`
    ([training.md](training.md#packing))."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Packing: tokens per micro-batch on one replica (verl's `ppo_max_token_len_per_gpu`), at least
    `data.max_prompt_length + rollout.max_new_tokens`; `null`: `micro_batch_size x` that length."""
    ppo_epochs: int = 1
    """Passes over each step's experience."""
    clip_ratio: float = 0.2
    """PPO clip epsilon: the ratio is clipped to `[1 - clip_ratio_low, 1 + clip_ratio_high]`."""
    clip_ratio_low: Optional[float] = None
    """Lower epsilon; `null`: `clip_ratio`; 1 or more: no lower bound (as CISPO is run: verl's CISPO example sets
    10)."""
    clip_ratio_high: Optional[float] = None
    """Upper epsilon; `null`: `clip_ratio` (e.g. 0.28 for DAPO's clip-higher)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """`token-mean`, `token-sum`, `seq-mean-token-sum`, `seq-mean-token-sum-norm`, `seq-mean-token-mean`."""
    loss_scale_factor: Optional[float] = None
    """`seq-mean-token-sum-norm`: the constant each sequence's token sum is divided by (Dr. GRPO: the response
    budget, e.g. `rollout.max_new_tokens`); `null`: the step's longest response."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (loss -= coeff x entropy)."""
    use_kl_loss: bool = False
    """Add `kl_loss_coef * KL(actor, ref)` to the loss (GRPO style); builds the reference model."""
    kl_loss_coef: float = 0.001
    """Weight of that term (>= 0)."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator: `kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`; a `+` suffix (e.g. `k3+`) uses the k2 gradient
    (straight-through)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (> 0)."""
    old_logprob: Literal["recompute", "bypass", "is_correct"] = "recompute"
    """`recompute` (the trainer's), `bypass` (the engine's), `is_correct` (recompute, weight by the truncated
    importance ratio). `bypass` and `is_correct` are presets of `algorithm.rollout_correction` (`bypass_mode=true`;
    `rollout_is=token rollout_is_threshold=<is_truncate>`); setting both is refused."""
    is_truncate: float = 2.0
    """`is_correct`: truncation of the importance weights (>= 1)."""
    policy_loss: PolicyLossConfig = _default(PolicyLossConfig)
    """Which policy loss (`loss_mode`) and its knobs:"""
    tau_pos: float = 1.0
    """`policy_loss.loss_mode=sapo`: gate temperature of positive advantages."""
    tau_neg: float = 1.05
    """`policy_loss.loss_mode=sapo`: gate temperature of negative advantages."""
    moe_routing: Literal["recompute", "replay"] = "recompute"
    """MoE: `replay` uses the experts the engine routed each token to ([routing-replay.md](routing-replay.md));
    `recompute`: the trainer's routers choose."""
    recompute: RecomputeConfig = _default(RecomputeConfig)
    """Activation recomputation (gradient checkpointing) of the actor's training passes: `actor.recompute` below."""
    lora: LoRAConfig = _default(LoRAConfig)
    """LoRA adapters (the reference is then the actor with adapters off): `actor.lora` below."""
    optim: OptimConfig = _default(OptimConfig)
    """Optimizer and LR schedule (`lr` 1e-6)."""
    parallel: RoleParallelConfig = _default(RoleParallelConfig)
    """This role's own `tp` / `pp` / `vpp` / `ep` / `cp` (see `actor.parallel` above)."""

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
    enable: Optional[bool] = None
    """`null`: on exactly when `algorithm.adv_estimator=gae`; `false` with gae is an error."""
    path: Optional[str] = None
    """HF directory to initialise the trunk from; `null`: `model.path` (the value head is new)."""
    dist_checkpoint: Optional[str] = None
    """A Megatron-Core dist checkpoint (any TP/PP) of a GPT model the trunk starts from instead of its HF weights;
    the value head is new, as verl's (verl's `critic.megatron.dist_checkpointing_path`)."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (x `rollout.n` sequences)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one replica (without packing)."""
    packing: bool = True
    """As `actor.packing`."""
    max_tokens_per_micro_batch: Optional[int] = None
    """As the actor's (verl's `critic.ppo_max_token_len_per_gpu`), with this role's `micro_batch_size`."""
    ppo_epochs: int = 1
    """Passes over each step's experience."""
    cliprange_value: float = 0.5
    """Value clip around the old values (> 0)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    loss_agg_mode: LossAggMode = "token-mean"
    """Reduction of the value loss (same choices as the actor's)."""
    loss_scale_factor: Optional[float] = None
    """As the actor's, for the value loss."""
    recompute: RecomputeConfig = _default(RecomputeConfig)
    """As `actor.recompute`, for the critic's training passes."""
    lora: LoRAConfig = _default(LoRAConfig)
    """As `actor.lora`, on the critic's trunk (its value head trains fully)."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))
    """As `actor.optim`."""
    parallel: RoleParallelConfig = _default(RoleParallelConfig)
    """This role's own `tp` / `pp` / `vpp` / `ep` / `cp` (see `critic.parallel` above)."""

    def check(self) -> None:
        _check_trained_role(self)
        _require(self.cliprange_value > 0, f"{P}cliprange_value={self.cliprange_value} must be > 0. Fix: e.g. 0.5.")


@dataclasses.dataclass(frozen=True)
class RefConfig(_Section):
    #: keys a reader may expect here, and why this section does not take them
    REFUSED_KEYS = {
        "recompute": "the reference model only runs forward passes, which keep no activations for backward, so "
                     "there is nothing to recompute. Fix: remove it (recomputation is for the trained roles: "
                     "actor.recompute, critic.recompute).",
        "lora": "the reference policy is the base model: with actor.lora it is the actor with its adapters off, "
                "without it a frozen copy. Fix: remove it (adapters are set with actor.lora).",
    }

    dist_checkpoint: Optional[str] = None
    """A Megatron-Core dist checkpoint the reference starts from; `null`: the actor's starting weights
    (`actor.dist_checkpoint`, else `model.path`). With `actor.lora` only the actor's (verl's
    `ref.megatron.dist_checkpointing_path`)."""
    micro_batch_size: Optional[int] = None
    """Sequences per forward on one replica; `null`: `actor.micro_batch_size`."""
    packing: Optional[bool] = None
    """As `actor.packing`; `null`: the actor's."""
    max_tokens_per_micro_batch: Optional[int] = None
    """As `actor.max_tokens_per_micro_batch` (verl's `log_prob_max_token_len_per_gpu`); `null`: the actor's."""
    parallel: RoleParallelConfig = _default(RoleParallelConfig)
    """This role's own `tp` / `pp` / `vpp` / `ep` / `cp` (see `ref.parallel` above)."""

    def check(self) -> None:
        _at_least(self, micro_batch_size=1, max_tokens_per_micro_batch=1)


# -- rules across sections ----------------------------------------------------------------------

def check_routing_replay(cfg: "Config") -> None:
    """Routing replay needs single-turn responses and a forward that is not recomputed."""
    _require(cfg.actor.moe_routing != "replay" or cfg.rollout.env == "single_turn",
             f"actor.moe_routing=replay records the engine's routes of single-turn responses; multi-turn "
             f"episodes (rollout.env={cfg.rollout.env}) have no single record yet. Fix: set "
             f"actor.moe_routing=recompute or rollout.env=single_turn.")
    _require(cfg.actor.moe_routing != "replay" or cfg.actor.recompute.granularity == "none",
             f"actor.moe_routing=replay replays the engine's routes in the forward pass only; recomputation "
             f"(actor.recompute.granularity={cfg.actor.recompute.granularity}) would route again in the "
             f"backward with the trainer's own routers. Fix: set actor.recompute.granularity=none, or "
             f"actor.moe_routing=recompute.")


def check_reference_of_lora_actor(cfg: "Config") -> None:
    """With actor.lora the reference is the actor's base: it has no layout or weights of its own."""
    # a verl LoRA script gives the reference the actor's layout (verl, too, runs it as the actor's base)
    actor_layout = dict(zip(("tp", "pp", "vpp"), cfg.layout("actor")), ep=cfg.expert_parallel("actor"),
                        cp=cfg.context_parallel("actor"))
    _require(not cfg.ref_is_actor_base or all(
                 v is None or v == actor_layout[k] for k, v in dataclasses.asdict(cfg.ref.parallel).items()),
             f"with actor.lora the reference policy is the actor with its adapters off (no model of its own), "
             f"so ref.parallel does not apply (it may only repeat the actor's layout, {actor_layout}). Fix: "
             f"remove ref.parallel.")
    _require(not cfg.ref_is_actor_base or cfg.ref.dist_checkpoint in (None, cfg.actor.dist_checkpoint),
             f"with actor.lora the reference policy is the actor's own weights with its adapters off, so it "
             f"starts from actor.dist_checkpoint ({cfg.actor.dist_checkpoint}), not ref.dist_checkpoint="
             f"{cfg.ref.dist_checkpoint}. Fix: remove ref.dist_checkpoint, or give it the actor's.")


def check_model_roles(cfg: "Config") -> None:
    """Every model role: its layout fits (vpp needs a pipeline, sequence parallelism tp > 1) and its packed
    micro-batch budget holds the longest sequence."""
    for role in cfg.model_roles:
        tp, pp, vpp = cfg.layout(role)
        _require(vpp is None or pp > 1, f"{role}.parallel.vpp={vpp} needs a pipeline (pp > 1), but {role}'s pp is "
                 f"{pp}. Fix: set {role}.parallel.vpp=null or raise {role}.parallel.pp.")
        _require(not cfg.parallel.sequence_parallel or tp > 1,
                 f"parallel.sequence_parallel needs tp > 1 for every role, but {role}'s tp is 1. Fix: set "
                 f"{role}.parallel.tp >= 2 or parallel.sequence_parallel=false.")
        # the section whose max_tokens_per_micro_batch applies (ref: its own, else the actor's)
        owner = "actor" if role == "ref" and not cfg.ref.max_tokens_per_micro_batch else role
        own, longest = getattr(cfg, owner).max_tokens_per_micro_batch, cfg.max_sequence_length
        key = f"{owner}.max_tokens_per_micro_batch"
        _require(not cfg.packs(role) or own is None or own >= longest,
                 f"{key}={own} is smaller than the longest sequence, data.max_prompt_length + "
                 f"rollout.max_new_tokens = {longest}: such a sequence would fit no micro-batch. Fix: set "
                 f"{key} >= {longest} (or lower the lengths).")


def check_mini_batches(cfg: "Config") -> None:
    """The trained roles' mini-batches divide the batch, and (without packing) micro-batches the mini-batch."""
    n = cfg.rollout.n
    for role in ("actor", "critic") if cfg.use_critic else ("actor",):
        mini, micro = getattr(cfg, role).ppo_mini_batch_size, getattr(cfg, role).micro_batch_size
        _require(cfg.data.train_batch_size % mini == 0,
                 f"data.train_batch_size={cfg.data.train_batch_size} is not divisible by "
                 f"{role}.ppo_mini_batch_size={mini}. Fix: make {role}.ppo_mini_batch_size a divisor of it.")
        _require(getattr(cfg, role).packing or mini * n % micro == 0,
                 f"{role}: a mini-batch of {mini * n} sequences ({role}.ppo_mini_batch_size={mini} x rollout.n="
                 f"{n}) is not divisible by {role}.micro_batch_size={micro}. Fix: pick a micro_batch_size that "
                 f"divides {mini * n}.")
