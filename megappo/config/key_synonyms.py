"""Key names users bring from other trainers (HF TrainingArguments, TRL, OpenRLHF, DeepSpeed, vLLM)
and megappo's key for each: `actor.optim.learning_rate` -> `actor.optim.lr`, `max_steps` ->
`run.total_steps`, `num_generations` -> `rollout.n`.

`SYNONYMS` maps a key's last part, as another trainer spells it, to megappo's candidates, tried in
order: a relative one (`lr`, `optim.lr`) under each section of the written key, the deepest first
(`critic.optim.learning_rate` -> `critic.optim.lr`); the last candidate is always a full key
(`actor.optim.lr`), used when no section of the written key has a relative one.
`synonym_of(path, is_key)` finds megappo's key; `synonym_hint` words the one-line error, the way
megappo.config.verl_keys words a verl name. Only keys megappo does not have reach it: a synonym never
shadows a megappo key, nor a verl name megappo reads (megappo.config.loading asks megappo.config.verl_keys first; under
a verl section megappo has no such key for, `trainer.max_steps`, it names the synonym instead).

This module is data and lookups: it imports nothing and does not know the config schema (`is_key`,
from megappo.config.loading, says whether megappo has a key). verl's own names are megappo.config.verl_keys'.
"""

from __future__ import annotations

from typing import Callable, Optional

_LR = ("lr", "optim.lr", "actor.optim.lr")
_WD = ("weight_decay", "optim.weight_decay", "actor.optim.weight_decay")
_EPS = ("eps", "optim.eps", "actor.optim.eps")
_WARMUP = ("warmup_steps", "optim.warmup_steps", "actor.optim.warmup_steps")
_SCHEDULE = ("lr_decay_style", "optim.lr_decay_style", "actor.optim.lr_decay_style")
_GRAD_CLIP = ("grad_clip", "actor.grad_clip")
_STEPS = ("run.total_steps",)
_EPOCHS = ("run.total_epochs",)
_PPO_EPOCHS = ("ppo_epochs", "actor.ppo_epochs")
_PROMPTS_PER_STEP = ("data.train_batch_size",)
_MICRO = ("micro_batch_size", "actor.micro_batch_size")
_MINI = ("ppo_mini_batch_size", "actor.ppo_mini_batch_size")
_NEW_TOKENS = ("rollout.max_new_tokens",)
_PROMPT_LEN = ("data.max_prompt_length",)
_GROUP = ("rollout.n",)
_SEED = ("seed", "run.seed")
_CLIP = ("clip_ratio", "actor.clip_ratio")
_KL_REWARD = ("kl_ctrl.kl_coef", "algorithm.kl_ctrl.kl_coef")
_SAVE_EVERY = ("checkpoint.save_every",)
_KEEP = ("checkpoint.keep_last",)
_VAL_EVERY = ("run.val_every",)
_TP = ("tp", "parallel.tp")
_PP = ("pp", "parallel.pp")

#: another trainer's name for a key (its last part) -> megappo's candidates (see the module docstring)
SYNONYMS: dict[str, tuple[str, ...]] = {
    # optimizer (HF TrainingArguments, DeepSpeed, OpenRLHF)
    "learning_rate": _LR, "learningrate": _LR, "lr_rate": _LR,
    "actor_learning_rate": ("actor.optim.lr",), "actor_lr": ("actor.optim.lr",),
    "critic_learning_rate": ("critic.optim.lr",), "critic_lr": ("critic.optim.lr",),
    "wd": _WD, "weight_decay_rate": _WD, "l2_weight_decay": _WD,
    "adam_epsilon": _EPS, "adam_eps": _EPS, "epsilon_adam": _EPS,
    "warmup": _WARMUP, "num_warmup_steps": _WARMUP, "warmup_iters": _WARMUP,
    "lr_warmup_iters": _WARMUP,
    "lr_scheduler_type": _SCHEDULE, "lr_scheduler": _SCHEDULE, "scheduler": _SCHEDULE, "lr_schedule": _SCHEDULE,
    "max_grad_norm": _GRAD_CLIP, "clip_grad": _GRAD_CLIP, "gradient_clipping": _GRAD_CLIP,
    "grad_norm_clip": _GRAD_CLIP, "clip_grad_norm": _GRAD_CLIP,
    # how long the run is
    "max_steps": _STEPS, "total_training_steps": _STEPS, "num_train_steps": _STEPS, "total_steps": _STEPS,
    "num_steps": _STEPS, "train_steps": _STEPS, "training_steps": _STEPS, "max_train_steps": _STEPS,
    "num_train_epochs": _EPOCHS, "total_epochs": _EPOCHS, "num_epochs": _EPOCHS, "num_episodes": _EPOCHS,
    "num_ppo_epochs": _PPO_EPOCHS, "ppo_epoch": _PPO_EPOCHS,
    # batch sizes
    "batch_size": _PROMPTS_PER_STEP, "train_batch_size": _PROMPTS_PER_STEP, "rollout_batch_size": _PROMPTS_PER_STEP,
    "prompt_batch_size": _PROMPTS_PER_STEP, "global_batch_size": _PROMPTS_PER_STEP,
    "per_device_train_batch_size": _MICRO, "micro_train_batch_size": _MICRO, "micro_batch_size_per_gpu": _MICRO,
    "train_micro_batch_size_per_gpu": _MICRO,
    "mini_batch_size": _MINI, "ppo_mini_batch_size": _MINI, "num_mini_batches": _MINI,
    # generation
    "max_new_tokens": _NEW_TOKENS, "max_response_length": _NEW_TOKENS, "response_length": _NEW_TOKENS,
    "max_completion_length": _NEW_TOKENS, "generate_max_len": _NEW_TOKENS, "max_tokens": _NEW_TOKENS,
    "max_gen_len": _NEW_TOKENS,
    "max_prompt_length": _PROMPT_LEN, "prompt_max_len": _PROMPT_LEN, "max_prompt_len": _PROMPT_LEN,
    "num_generations": _GROUP, "n_samples_per_prompt": _GROUP, "n_samples": _GROUP, "num_samples": _GROUP,
    "group_size": _GROUP, "num_return_sequences": _GROUP, "rollout_n": _GROUP, "samples_per_prompt": _GROUP,
    "temperature": ("rollout.temperature",), "top_p": ("rollout.top_p",), "top_k": ("rollout.top_k",),
    # seeds, losses, checkpoints, validation, layout, model
    "seed": _SEED, "random_seed": _SEED,
    "cliprange": _CLIP, "clip_range": _CLIP, "eps_clip": _CLIP, "clip_eps": _CLIP,
    "epsilon": ("eps", "clip_ratio", "actor.clip_ratio"),  # Adam's under an optim section, else TRL's clip
    "kl_coef": _KL_REWARD, "init_kl_coef": _KL_REWARD,
    "gae_lambda": ("lam", "algorithm.lam"), "lambd": ("lam", "algorithm.lam"), "lmbda": ("lam", "algorithm.lam"),
    "save_steps": _SAVE_EVERY, "save_interval": _SAVE_EVERY, "save_freq": _SAVE_EVERY,
    "save_total_limit": _KEEP, "max_ckpt_to_keep": _KEEP, "keep_checkpoints": _KEEP,
    "eval_steps": _VAL_EVERY, "eval_every": _VAL_EVERY, "eval_interval": _VAL_EVERY, "test_freq": _VAL_EVERY,
    "output_dir": ("run.output_dir",), "save_path": ("run.output_dir",),
    "tensor_parallel_size": _TP, "tensor_model_parallel_size": _TP, "tp_size": _TP,
    "pipeline_parallel_size": _PP, "pipeline_model_parallel_size": _PP, "pp_size": _PP,
    "model_name_or_path": ("path", "model.path"), "pretrain": ("path", "model.path"),
    "model_path": ("path", "model.path"),
    "lora_rank": ("lora.rank", "actor.lora.rank"), "lora_r": ("lora.rank", "actor.lora.rank"),
    "lora_alpha": ("lora.alpha", "actor.lora.alpha"), "lora_dropout": ("lora.dropout", "actor.lora.dropout"),
}


def synonym_of(path: str, is_key: Callable[[str], bool]) -> Optional[str]:
    """megappo's key for the dotted `path` that another trainer names so; None when it is not one."""
    *sections, leaf = path.split(".")
    candidates = SYNONYMS.get(leaf.strip().lower().replace("-", "_"))
    if not candidates:
        return None
    for depth in range(len(sections), -1, -1):  # the written key's own section first, then its parents
        prefix = "".join(f"{s}." for s in sections[:depth])
        for candidate in candidates[:-1]:
            if is_key(prefix + candidate):
                return prefix + candidate
    return candidates[-1] if is_key(candidates[-1]) else None


def synonym_hint(path: str, value: Optional[str], is_key: Callable[[str], bool]) -> Optional[str]:
    """The one-line error for `path` (`value`: an override's, None in a recipe file); None when no synonym fits."""
    key = synonym_of(path, is_key)
    if key is None:
        return None
    fix = f"write {key}={value}" if value is not None else f"rename it to {key}"
    return f"unknown config key '{path}': did you mean '{key}'? Fix: {fix}."
