"""The whole recipe: `Config`, its sections in order, the order in which the rules across
sections run (each rule a named function beside the sections it relates), and every value derived
from more than one section, in one place.

Derived values are properties and methods, never fields filled in later: which models a run
builds (`roles`, `model_roles`, `needs_ref`, `use_critic`, `ref_is_actor_base`), each role's layout
and micro-batches (`layout`, `expert_parallel`, `packs`, `max_tokens_per_micro_batch`), the world
sizes (`min_world_size`, `hardware_world_size`, `launch_world_size`, `dp_size`), the correction
and policy loss the actor trains with, and the sampler's draw. megappo.trainer.setup's `RoleBuild` reads
them from here rather than deciding them again. A value of one section alone is that section's
property (`actor.clip_low`, `algorithm.grouped`, `rollout.staleness_limit`).

Owns: `Config`, the rules' order, the derived values. Does not know how a recipe is read
(megappo.config.loading) or what the sections' fields are (the section modules).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

from megappo.config.algorithm import (AlgorithmConfig, RolloutCorrectionConfig, check_estimator_needs,
                                      check_filter_groups, check_gdpo_components, check_rollout_correction)
from megappo.config.data import DataConfig, require_training_data
from megappo.config.model import ModelConfig, ParallelConfig, check_context_parallel, check_lora_dropout, check_world
from megappo.config.reward import RewardConfig, check_overlong_buffer
from megappo.config.roles import (ActorConfig, CriticConfig, RefConfig, check_mini_batches, check_model_roles,
                                  check_reference_of_lora_actor, check_routing_replay)
from megappo.config.rollout import RolloutConfig, check_lora_sync, check_partial_rollouts, check_rollout_mode
from megappo.config.schema import _default, _plain, _Section
from megappo.config.trainer import (CheckpointConfig, HardwareConfig, LoggingConfig, RunConfig, check_critic_warmup,
                                    check_restarts, check_variants)

#: the rules across sections, in the order they run (the first that fails is the error)
RULES = (check_variants, check_restarts, check_estimator_needs, check_routing_replay, check_reference_of_lora_actor,
         check_model_roles, check_context_parallel, check_gdpo_components, check_filter_groups, check_overlong_buffer,
         check_critic_warmup, check_rollout_correction, check_rollout_mode, check_partial_rollouts, check_lora_sync,
         check_lora_dropout, check_mini_batches)


@dataclasses.dataclass(frozen=True)
class Config(_Section):
    model: ModelConfig
    """The SFT model (actor, ref and default critic init)."""
    parallel: ParallelConfig = _default(ParallelConfig)
    """TP / PP / VPP layout of every role without its own."""
    actor: ActorConfig = _default(ActorConfig)
    """The trained policy: PPO loss and optimizer."""
    critic: CriticConfig = _default(CriticConfig)
    """The value model (GAE)."""
    ref: RefConfig = _default(RefConfig)
    """The frozen reference policy (KL terms)."""
    reward: RewardConfig = _default(RewardConfig)
    """Rule-based reward functions and/or a reward model."""
    algorithm: AlgorithmConfig = _default(AlgorithmConfig)
    """Advantage estimator, discounting, in-reward KL."""
    rollout: RolloutConfig = _default(RolloutConfig)
    """Generation engine, sampling, weight sync."""
    data: DataConfig = _default(DataConfig)
    """Prompts and batch size."""
    checkpoint: CheckpointConfig = _default(CheckpointConfig)
    """Trainer checkpoints and resume."""
    logging: LoggingConfig = _default(LoggingConfig)
    """Metric sinks and console."""
    run: RunConfig = _default(RunConfig)
    """Output directory, seed, length, validation cadence."""
    hardware: HardwareConfig = _default(HardwareConfig)
    """The machines this recipe is sized for (plan, launchers)."""
    variants: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Other hardware: name -> overrides."""

    def check(self) -> None:
        for rule in RULES:
            rule(self)

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
    def routing_replay(self) -> bool:
        """MoE: the actor's and reference's passes replay the experts the engine chose per token."""
        return self.actor.moe_routing == "replay"

    @property
    def lora_roles(self) -> tuple[str, ...]:
        """The trained roles with LoRA adapters."""
        return tuple(role for role in ("actor", "critic") if getattr(self, role).lora.enabled)

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

    def context_parallel(self, role: Literal["actor", "critic", "ref", "reward"]) -> int:
        """A role's context-parallel size: its own `<role>.parallel.cp`, else `parallel.cp`."""
        return self.context_parallel_own(role) or self.parallel.cp

    def context_parallel_own(self, role: Literal["actor", "critic", "ref", "reward"]) -> Optional[int]:
        """A role's own `<role>.parallel.cp` (the actor's for a reference that is the actor's base), or None."""
        role = "actor" if role == "ref" and self.ref_is_actor_base else role
        return getattr(self, role).parallel.cp

    def expert_parallel(self, role: Literal["actor", "critic", "ref", "reward"]) -> int:
        """A role's expert-parallel size: its own `<role>.parallel.ep`, else `parallel.ep`."""
        role = "actor" if role == "ref" and self.ref_is_actor_base else role
        return getattr(self, role).parallel.ep or self.parallel.ep

    @property
    def min_world_size(self) -> int:
        """The fewest ranks every role's layout fits: the lcm of their tp * pp * ep (ep data-parallel
        replicas for expert parallelism, one otherwise)."""
        return math.lcm(*(tp * pp * self.expert_parallel(role) * self.context_parallel(role)
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
        """A role's data-parallel replicas: world_size / (its tp * pp * cp), after `validate_world`."""
        self.validate_world(world_size)
        tp, pp, _ = self.layout(role)
        return world_size // (tp * pp * self.context_parallel(role))


    def validate_world(self, world_size: int) -> None:
        """Checks that need the number of ranks (megappo.config.model.check_world)."""
        check_world(self, world_size)

    def require_training_data(self) -> None:
        """What `megappo train` needs beyond a valid config (megappo.config.data.require_training_data)."""
        require_training_data(self)

    def to_dict(self) -> dict:
        """Plain YAML/JSON data; `megappo.config.config_from_dict(cfg.to_dict()) == cfg`."""
        return _plain(self)
