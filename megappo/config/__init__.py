"""The recipe schema and how recipes are read, by concern:

  schema       the section base, type conversion of plain data, the error helpers
  model        model, parallel, <role>.parallel, <role>.recompute, <role>.lora (+ LoRA / recompute tables)
  roles        actor (+ actor.policy_loss), critic, ref, <role>.optim
  algorithm    algorithm (+ kl_ctrl, pf_ppo, filter_groups, rollout_correction)
  correction   rollout correction's option names and threshold grammar (plain Python)
  rollout      rollout
  data         data (+ custom_cls, sampler)
  reward       reward (+ overlong_buffer)
  trainer      run, checkpoint, logging, hardware (verl's trainer.*)
  root         Config: the sections together, the order of the rules across them, the derived values
  loading      recipes: YAML, dotted overrides, variants, verl keys -> Config; dump_config
  verl_keys    verl's keys and how megappo reads them (plain data)
  key_synonyms other trainers' key names -> megappo's (plain data)
  field_docs   each field's docstring, and docs/config.md's field tables written from them

Each section is a frozen dataclass that converts and checks its fields on construction; the rules
across sections are named functions beside the sections they relate, run by `Config.check` in
`root.RULES`' order. Every error is a `ConfigError` (megappo.errors) naming the dotted key and the
fix. Each field's documentation is its docstring, written once; docs/config.md's field tables are
generated from them (`python -m megappo.config.field_docs`).

This package imports nothing from megappo but megappo.errors and the estimator and policy-loss
names of megappo.ppo.specs: recipes can be checked anywhere, without torch. Everything other code
imports from `megappo.config` is re-exported here.
"""

from megappo.config.algorithm import (ADV_ESTIMATORS, AlgorithmConfig, FilterGroupsConfig, KLCtrlConfig,
                                      PfPpoConfig, RolloutCorrectionConfig)
from megappo.config.data import TEMPLATE_ARGUMENTS_SET_BY_MEGAPPO, CustomClsConfig, DataConfig, SamplerConfig
from megappo.config.loading import apply_override, config_from_dict, dump_config, load_config, read_config
from megappo.config.model import (ALL_LINEAR, HF_TARGETS, RECOMPUTE_MODULES, RECOMPUTE_REFUSED, SAVED_MODULES,
                                  TARGETS, LoRAConfig, ModelConfig, ParallelConfig, RecomputeConfig,
                                  RoleParallelConfig, lora_saved_modules, lora_targets)
from megappo.config.reward import JudgeConfig, OverlongBufferConfig, RewardConfig, SandboxConfig
from megappo.config.roles import (KL_ESTIMATORS, POLICY_LOSS_MODES, ActorConfig, CriticConfig, KLEstimator,
                                  LossAggMode, OptimConfig, PolicyLossConfig, RefConfig)
from megappo.config.rollout import RolloutConfig
from megappo.config.root import Config
from megappo.config.schema import _build, _convert, _hints, _not_here, _options, _plain, _type_name, _unknown_key
from megappo.config.trainer import CheckpointConfig, HardwareConfig, LoggingConfig, RunConfig
from megappo.errors import ConfigError

__all__ = [
    "ADV_ESTIMATORS", "ALL_LINEAR", "HF_TARGETS", "KL_ESTIMATORS", "POLICY_LOSS_MODES", "RECOMPUTE_MODULES",
    "RECOMPUTE_REFUSED", "SAVED_MODULES", "TARGETS", "TEMPLATE_ARGUMENTS_SET_BY_MEGAPPO",
    "ActorConfig", "AlgorithmConfig", "CheckpointConfig", "Config", "ConfigError", "CriticConfig", "CustomClsConfig",
    "DataConfig", "FilterGroupsConfig", "HardwareConfig", "JudgeConfig", "KLCtrlConfig", "KLEstimator", "LoRAConfig",
    "LoggingConfig", "LossAggMode", "ModelConfig", "OptimConfig", "OverlongBufferConfig", "ParallelConfig",
    "PfPpoConfig", "PolicyLossConfig", "RecomputeConfig", "RefConfig", "RewardConfig", "RoleParallelConfig",
    "RolloutConfig", "RolloutCorrectionConfig", "RunConfig", "SamplerConfig", "SandboxConfig",
    "apply_override", "config_from_dict", "dump_config", "load_config", "lora_saved_modules", "lora_targets",
    "read_config",
    "_build", "_convert", "_hints", "_not_here", "_options", "_plain", "_type_name", "_unknown_key",
]
