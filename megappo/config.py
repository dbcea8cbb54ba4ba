"""Typed run configuration: dataclasses, YAML recipes, dotted command-line overrides.

`load_config(path, ["parallel.tp=2", "actor.optim.lr=1e-6"])` reads a recipe, applies
overrides (values parsed as YAML: `2` is an int, `[a,b]` a list, `null` None), builds the
dataclasses field by field with type checks, and validates each section and the sections
together. Unknown keys are rejected with the list of valid ones; every error names the
dotted key and how to fix it. Numbers that depend on the world size are methods
(`dp_size(world)`), never fields filled in later.

This module imports nothing from megappo and no torch: recipes can be checked anywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Literal, Optional, Sequence, Union

import yaml


class ConfigError(ValueError):
    """A recipe or override megappo cannot run; the message names the key and the fix."""


KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_ESTIMATOR_NAMES = KL_ESTIMATORS + tuple(k + "+" for k in KL_ESTIMATORS)
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                      "seq-mean-token-mean"]


def _check_kl_name(path: str, name: str) -> None:
    if name not in KL_ESTIMATOR_NAMES:
        raise ConfigError(f"{path}: unknown KL estimator '{name}'; choose from {list(KL_ESTIMATOR_NAMES)}.")


@dataclasses.dataclass
class ModelConfig:
    path: Optional[str] = None  # HF model directory (config.json + safetensors + tokenizer)
    hf_config: Optional[dict] = None  # inline config.json content: a model built from config (random init)
    tokenizer: Optional[str] = None  # tokenizer directory; defaults to path
    arch: Optional[str] = None  # registry key override; default: config.json `architectures`
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    make_vocab_size_divisible_by: int = 128
    layer_spec: Literal["auto", "te", "local"] = "auto"  # auto: TE on GPU when installed
    seed_init: int = 1234  # seed of a from-config init

    def __post_init__(self):
        if self.path is None and self.hf_config is None:
            raise ConfigError("model: set model.path (an HF directory) or model.hf_config (build from config).")


@dataclasses.dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved schedule)
    sequence_parallel: bool = False
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_minutes: int = 30  # collectives that take longer end the run with a message
    use_distributed_optimizer: bool = False

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1:
            raise ConfigError(f"parallel.tp={self.tp}, parallel.pp={self.pp}: both must be >= 1.")
        if self.vpp is not None and (self.vpp < 1 or self.pp < 2):
            raise ConfigError("parallel.vpp needs parallel.pp >= 2; set parallel.vpp=null to disable it.")
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp >= 2.")


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warmup (optimizer steps); lr * step / warmup_steps
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = 0.0  # decay floor as a fraction of lr

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr} must be > 0.")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas} must be two numbers in [0, 1).")


@dataclasses.dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (x rollout.n sequences), as verl
    micro_batch_size: int = 2  # sequences per micro-batch per DP replica
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # default: clip_ratio
    clip_ratio_high: Optional[float] = None  # default: clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (> 1)
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    old_logprob: Literal["recompute", "bypass", "is_correct"] = "recompute"
    is_truncate: float = 2.0  # truncation of rollout importance weights (is_correct)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)

    def __post_init__(self):
        _check_kl_name("actor.kl_loss_type", self.kl_loss_type)
        if self.clip_ratio_c <= 1.0:
            raise ConfigError(f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound).")
        for name in ("ppo_mini_batch_size", "micro_batch_size", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"actor.{name} must be >= 1.")

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclasses.dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: on exactly when algorithm.adv_estimator needs values (gae)
    path: Optional[str] = None  # default: model.path (the SFT model; the value head is initialised)
    ppo_mini_batch_size: int = 8
    micro_batch_size: int = 2
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
    grad_clip: float = 1.0
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclasses.dataclass
class RefConfig:
    micro_batch_size: Optional[int] = None  # default: actor.micro_batch_size


@dataclasses.dataclass
class RewardConfig:
    functions: list = dataclasses.field(default_factory=list)  # names in megappo.rewards
    function_weights: Optional[list] = None
    model_path: Optional[str] = None  # a reward model (HF dir with a score head)
    model_weight: float = 1.0
    micro_batch_size: int = 2


@dataclasses.dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclasses.dataclass
class AlgorithmConfig:
    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                           "remax"] = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = dataclasses.field(default_factory=KLCtrlConfig)

    def __post_init__(self):
        _check_kl_name("algorithm.kl_penalty", self.kl_penalty)
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"algorithm.{name}={getattr(self, name)} must be in [0, 1].")

    @property
    def needs_critic(self) -> bool:
        return self.adv_estimator == "gae"

    @property
    def grouped(self) -> bool:
        return self.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline")


@dataclasses.dataclass
class RolloutConfig:
    engine: Literal["hf", "sglang"] = "hf"
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    stop_token_ids: list = dataclasses.field(default_factory=list)  # stop ids besides the tokenizer's EOS
    seed: int = 0
    logprob_mode: Literal["tempered", "untempered"] = "tempered"
    update_bucket_mb: int = 512
    verify_every: int = 1  # fingerprint-verify every k-th weight sync; 0 = never
    sync_mode: Literal["tensor", "distributed", "disk"] = "tensor"
    sglang: dict = dataclasses.field(default_factory=dict)  # passed through to sglang.Engine
    val_temperature: float = 0.0
    val_n: int = 1

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ConfigError("rollout.n and rollout.max_new_tokens must be >= 1.")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("rollout.temperature must be >= 0 and rollout.top_p in (0, 1].")


@dataclasses.dataclass
class DataConfig:
    train_files: list = dataclasses.field(default_factory=list)
    val_files: list = dataclasses.field(default_factory=list)
    builtin: Optional[str] = None  # 'digit_successor' or 'reasoning_gym:<task>' instead of files
    builtin_size: int = 1000
    builtin_val_size: int = 64
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    long_prompt_policy: Literal["skip", "truncate", "error"] = "skip"
    train_batch_size: int = 8  # prompts per step
    shuffle: bool = True
    seed: int = 1
    apply_chat_template: bool = True

    def require_training_data(self) -> None:
        if not self.train_files and not self.builtin:
            raise ConfigError("data: set data.train_files (JSONL/Parquet) or data.builtin to train.")


@dataclasses.dataclass
class CheckpointConfig:
    """Trainer checkpoints are not implemented yet: the section is reserved, and asking for
    a save or a resume is refused instead of silently ignored."""

    dir: Optional[str] = None  # default: run.output_dir/checkpoints
    save_every: int = 0  # steps; 0 = never (for now)
    keep_last: int = 2
    resume: Literal["auto", "must", "off"] = "auto"
    save_hf_at_end: bool = False

    def __post_init__(self):
        if self.save_every or self.resume == "must" or self.save_hf_at_end:
            raise ConfigError("checkpoint: trainer checkpoints and resume are not implemented yet; leave "
                              "checkpoint.save_every=0, checkpoint.resume=auto|off, checkpoint.save_hf_at_end=false.")


@dataclasses.dataclass
class LoggingConfig:
    sinks: list = dataclasses.field(default_factory=lambda: ["console", "jsonl"])
    project: str = "megappo"
    run_name: Optional[str] = None
    progress_bar: bool = True

    def __post_init__(self):
        bad = [s for s in self.sinks if s not in ("console", "jsonl", "tensorboard", "wandb")]
        if bad:
            raise ConfigError(f"logging.sinks: unknown {bad}; choose from console, jsonl, tensorboard, wandb.")


@dataclasses.dataclass
class RunConfig:
    output_dir: str = "runs/default"
    seed: int = 42
    total_steps: Optional[int] = None  # default: total_epochs over the dataset
    total_epochs: int = 1
    val_every: int = 0  # steps; 0 = no validation during training
    val_before_train: bool = False
    max_nan_skips: int = 3  # abort after this many steps skipped for non-finite losses/grads


@dataclasses.dataclass
class Config:
    model: ModelConfig
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    ref: RefConfig = dataclasses.field(default_factory=RefConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def __post_init__(self):
        if self.critic.enable is False and self.algorithm.needs_critic:
            raise ConfigError("algorithm.adv_estimator=gae needs a critic; set critic.enable=true or choose grpo/rloo/"
                              "reinforce_plus_plus.")
        if self.algorithm.grouped and self.rollout.n < 2:
            raise ConfigError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} compares samples of the same "
                              f"prompt; set rollout.n >= 2 (now {self.rollout.n}).")
        for role in ("actor", "critic"):
            section = getattr(self, role)
            if self.data.train_batch_size % section.ppo_mini_batch_size:
                raise ConfigError(
                    f"data.train_batch_size={self.data.train_batch_size} is not divisible by {role}."
                    f"ppo_mini_batch_size={section.ppo_mini_batch_size}; make the mini-batch size a divisor.")
            seqs = section.ppo_mini_batch_size * self.rollout.n
            if seqs % section.micro_batch_size:
                raise ConfigError(
                    f"{role}: a mini-batch of {seqs} sequences ({role}.ppo_mini_batch_size x rollout.n) is not "
                    f"divisible by {role}.micro_batch_size={section.micro_batch_size}.")
        if self.algorithm.use_kl_in_reward and self.actor.use_kl_loss:
            pass  # both is allowed (verl allows it); each is applied where it belongs

    @property
    def use_critic(self) -> bool:
        return self.algorithm.needs_critic if self.critic.enable is None else self.critic.enable

    @property
    def needs_ref(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def dp_size(self, world_size: int) -> int:
        self.validate_world(world_size)
        return world_size // (self.parallel.tp * self.parallel.pp)

    def validate_world(self, world_size: int) -> None:
        tp, pp = self.parallel.tp, self.parallel.pp
        if world_size % (tp * pp):
            raise ConfigError(f"world size {world_size} is not a multiple of parallel.tp*parallel.pp = {tp}*{pp}; "
                              f"launch a multiple of {tp * pp} ranks or change parallel.tp/pp.")
        dp = world_size // (tp * pp)
        for role in ("actor", "critic"):
            seqs = getattr(self, role).ppo_mini_batch_size * self.rollout.n
            if seqs % (dp * getattr(self, role).micro_batch_size):
                raise ConfigError(
                    f"{role}: a mini-batch of {seqs} sequences does not split over dp={dp} replicas in micro-batches "
                    f"of {getattr(self, role).micro_batch_size}; change {role}.ppo_mini_batch_size, "
                    f"{role}.micro_batch_size or the world size.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- building dataclasses from plain data -------------------------------------------------

_YAML11_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _convert(path: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(path, value, inner[0]) if len(inner) == 1 else value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{path}: {value!r} is not one of {list(choices)}.")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {_fields(tp)}, got {type(value).__name__}.")
        return _build(tp, value, path + ".")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r} ({type(value).__name__}).")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r} ({type(value).__name__}).")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.match(value):
            return float(value)  # YAML 1.1 reads `3e-6` (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r} ({type(value).__name__}).")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r} ({type(value).__name__}).")
        return value
    if tp in (list, dict):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected a {tp.__name__}, got {value!r} ({type(value).__name__}).")
        return value
    return value


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    valid = _fields(cls)
    unknown = [k for k in data if k not in valid]
    if unknown:
        key = unknown[0]
        guess = difflib.get_close_matches(str(key), valid, n=1)
        hint = f" Did you mean '{prefix}{guess[0]}'?" if guess else ""
        raise ConfigError(f"unknown config key '{prefix}{key}'.{hint} Valid keys{' of ' + prefix[:-1] if prefix else ''}: "
                          f"{valid}.")
    kwargs = {k: _convert(f"{prefix}{k}", v, hints[k]) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:
        raise ConfigError(f"{prefix[:-1] or 'config'}: {e}") from None


def config_from_dict(data: dict) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"a recipe must be a mapping of sections {_fields(Config)}, got {type(data).__name__}.")
    if "model" not in data:
        raise ConfigError("the recipe has no 'model' section; set model.path or model.hf_config.")
    return _build(Config, data)


def apply_override(data: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override '{override}' is not KEY=VALUE (e.g. parallel.tp=2).")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node, cls = data, Config
    for depth, part in enumerate(parts[:-1]):
        hints = typing.get_type_hints(cls) if cls else {}
        if cls is not None and part not in hints:
            _build(cls, {part: None}, ".".join(parts[:depth]) + "." if depth else "")  # raises the unknown-key error
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{override}': '{'.'.join(parts[:depth + 1])}' is not a section.")
        field_type = hints.get(part) if cls else None
        cls = field_type if dataclasses.is_dataclass(field_type) else None  # dict fields take any keys
    node[parts[-1]] = value


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    data: dict = {}
    if path is not None:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"recipe '{path}' does not exist.") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"recipe '{path}' is not valid YAML{where}: {getattr(e, 'problem', e)}.") from None
        if not isinstance(data, dict):
            raise ConfigError(f"recipe '{path}' must be a mapping of sections {_fields(Config)}.")
    for override in overrides:
        apply_override(data, override)
    return config_from_dict(data)


def dump_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
