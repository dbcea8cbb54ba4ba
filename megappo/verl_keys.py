"""verl's config keys and megappo's names for them: the hint an unknown key gets.

megappo keeps verl's names where it has the same knob (`data.train_batch_size`,
`algorithm.adv_estimator`, `actor.ppo_mini_batch_size`, `critic.optim.lr`, ...), so those
need no table. verl nests the policy under `actor_rollout_ref` and the loop under `trainer`;
`verl_hint(path, is_key)` says what megappo calls such a key (`actor_rollout_ref.actor.optim.lr`
-> `actor.optim.lr`), or how megappo does the same thing when it has no such key
(`trainer.device` -> CUDA when present). A verl switch whose values map to another key's values
(`enable_gradient_checkpointing=true` -> `actor.recompute.granularity=full`) is in `BY_VALUE`,
which an override's hint reads first. Explicit entries come first; then the
section prefixes below are swapped for megappo's, and the result is offered when it is a key
megappo has (`is_key`, from megappo.recipe).

This module is data and one lookup: it imports nothing and does not know the config schema.
"""

from __future__ import annotations

from typing import Callable, Optional

#: verl key -> megappo key, where the name differs beyond the section prefix
RENAMED: dict[str, str] = {
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    "actor_rollout_ref.actor.optim.warmup_style": "actor.optim.lr_decay_style",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor.optim.lr_decay_style",
    "actor_rollout_ref.actor.optim.clip_grad": "actor.grad_clip",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor.micro_batch_size",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "actor.parallel.tp",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "actor.parallel.pp",
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": "actor.parallel.vpp",
    "actor_rollout_ref.actor.megatron.sequence_parallel": "parallel.sequence_parallel",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer": "parallel.use_distributed_optimizer",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "ref.micro_batch_size",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": "ref.parallel.tp",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size": "ref.parallel.pp",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "rollout.val_temperature",
    "actor_rollout_ref.rollout.val_kwargs.n": "rollout.val_n",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.sglang.mem_fraction_static",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "ref.max_tokens_per_micro_batch",
    "critic.ppo_max_token_len_per_gpu": "critic.max_tokens_per_micro_batch",
    "critic.model.path": "critic.path",
    "actor_rollout_ref.model.lora_rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora.target_modules",
    "critic.model.lora_rank": "critic.lora.rank",
    "critic.model.lora_alpha": "critic.lora.alpha",
    "critic.model.target_modules": "critic.lora.target_modules",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size",
    "critic.ppo_micro_batch_size": "critic.micro_batch_size",
    "critic.optim.lr_warmup_steps": "critic.optim.warmup_steps",
    "critic.optim.warmup_style": "critic.optim.lr_decay_style",
    "critic.megatron.tensor_model_parallel_size": "critic.parallel.tp",
    "critic.megatron.pipeline_model_parallel_size": "critic.parallel.pp",
    "reward_model.model.path": "reward.model_path",
    "reward_model.micro_batch_size_per_gpu": "reward.micro_batch_size",
    "reward_model.micro_batch_size": "reward.micro_batch_size",
    "data.max_response_length": "rollout.max_new_tokens",
    "trainer.total_training_steps": "run.total_steps",
    "trainer.n_gpus_per_node": "hardware.gpus_per_node",
    "trainer.nnodes": "hardware.nodes",
    "trainer.save_freq": "checkpoint.save_every",
    "trainer.test_freq": "run.val_every",
    "trainer.default_local_dir": "checkpoint.dir",
    "trainer.project_name": "logging.project",
    "trainer.experiment_name": "logging.run_name",
    "trainer.logger": "logging.sinks",
    "trainer.max_actor_ckpt_to_keep": "checkpoint.keep_last",
    # activation recomputation: verl >= 0.5 passes Megatron's fields through override_transformer_config,
    # verl 0.3-0.4 had them under model.gradient_checkpointing_kwargs (megappo.models.recompute)
    **{f"{verl}.{field}": f"{ours}.{mine}"
       for verl, ours in (("actor_rollout_ref.actor.megatron.override_transformer_config", "actor.recompute"),
                          ("critic.megatron.override_transformer_config", "critic.recompute"))
       for field, mine in (("recompute_granularity", "granularity"), ("recompute_method", "method"),
                           ("recompute_num_layers", "num_layers"), ("recompute_modules", "modules"))},
    **{f"{verl}.gradient_checkpointing_kwargs.activations_checkpoint_{field}": f"{ours}.{field}"
       for verl, ours in (("actor_rollout_ref.model", "actor.recompute"), ("critic.model", "critic.recompute"))
       for field in ("granularity", "method", "num_layers")},
}

#: verl switch -> megappo's override for each of its values (YAML spelling, lower case), where the
#: value changes along with the name. verl's Megatron backend (0.3-0.4) turned
#: enable_gradient_checkpointing=true into full recomputation of every layer: Megatron's
#: granularity full, method uniform, 1 layer per checkpoint, megappo's defaults for full.
BY_VALUE: dict[str, dict[str, str]] = {
    "actor_rollout_ref.model.enable_gradient_checkpointing": {"true": "actor.recompute.granularity=full",
                                                              "false": "actor.recompute.granularity=none"},
    "critic.model.enable_gradient_checkpointing": {"true": "critic.recompute.granularity=full",
                                                   "false": "critic.recompute.granularity=none"},
}

#: verl key -> how megappo does it, where there is no one key to rename it to
OTHERWISE: dict[str, str] = {
    "trainer.device": "megappo uses CUDA when it is there, else the CPU (parallel.backend=auto)",
    "reward_model.enable": "megappo uses a reward model when reward.model_path is set",
    "custom_reward_function.path": "write reward.functions=[path/to/file.py:function_name]",
    "custom_reward_function.name": "write reward.functions=[path/to/file.py:function_name]",
    "data.truncation": "write data.long_prompt_policy=truncate (keeps a prompt's end, as verl's 'left'), error, or "
                       "skip",
    "trainer.resume_mode": "write checkpoint.resume=auto, must (a checkpoint is required) or off (verl's 'disable')",
    "trainer.log_val_generations": "logging.samples=N shows N samples of every training step (console and "
                                   "samples.jsonl)",
    "data.val_batch_size": "megappo validates on all data.val_files prompts in one batch",
    "data.filter_overlong_prompts": "write data.long_prompt_policy=skip (megappo's default)",
    "data.return_raw_chat": "megappo renders the chat template itself (data.apply_chat_template)",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "write actor.optim.warmup_steps (a number of steps)",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "pass it to SGLang: rollout.sglang.tp_size",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "write actor.recompute.granularity=full for true (full "
                                                             "recomputation of every layer, as verl's Megatron "
                                                             "backend did) or none for false",
    "critic.model.enable_gradient_checkpointing": "write critic.recompute.granularity=full for true (full recomputation "
                                                  "of every layer, as verl's Megatron backend did) or none for false",
    "actor_rollout_ref.ref.megatron.override_transformer_config.recompute_granularity":
        "the reference model only runs forward passes, so it has nothing to recompute (actor.recompute and "
        "critic.recompute are the trained roles')",
    "actor_rollout_ref.model.use_remove_padding": "megappo packs sequences without padding by default "
                                                  "(actor.packing, critic.packing, ...; false pads them)",
    "actor_rollout_ref.actor.calculate_sum_pi_squared": "megappo computes the sum of squared probabilities in the "
                                                        "old-log-prob pass when algorithm.adv_estimator is "
                                                        "optimal_token_baseline or tir_optimal_token_baseline",
    "actor_rollout_ref.actor.policy_loss.rollout_correction": "write algorithm.rollout_correction.* (verl copies it "
                                                              "there itself in bypass mode)",
    "actor_rollout_ref.actor.use_dynamic_bsz": "with actor.packing (the default) micro-batches are sized by "
                                               "actor.max_tokens_per_micro_batch",
}

#: verl section prefix -> megappo's, tried when the key is in neither table
PREFIXES: dict[str, str] = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.ref.": "ref.",
    "actor_rollout_ref.model.": "model.",
    "critic.model.": "critic.",
    "reward_model.": "reward.",
    "trainer.": "run.",
}

#: sections only verl has: a key under them is verl's even when no table names it
SECTIONS = ("actor_rollout_ref", "trainer", "custom_reward_function", "reward_model")


NO_EQUIVALENT = ("megappo has no such key; remove it (megappo's sections are model, parallel, actor, critic, ref, "
                 "reward, algorithm, rollout, data, checkpoint, logging, run)")


def verl_equivalent(path: str, is_key: Callable[[str], bool]) -> Optional[tuple[Optional[str], str]]:
    """(megappo's key, None) for a renamed verl key `path` (dotted), (None, how megappo does it)
    when it has no such key, or None when `path` is not verl's.

    `is_key(dotted)` says whether megappo has a key; a prefix swap is offered only if it does.
    """
    if path in RENAMED:
        return RENAMED[path], None
    if path in OTHERWISE:
        return None, OTHERWISE[path]
    for verl, ours in PREFIXES.items():
        if path.startswith(verl) and is_key(ours + path[len(verl):]):
            return ours + path[len(verl):], None
    if path.split(".")[0] in SECTIONS:
        return None, NO_EQUIVALENT
    return None


def verl_hint(path: str, value: str, is_key: Callable[[str], bool]) -> Optional[str]:
    """The error for an override `path=value` whose key is verl's; None when it is not."""
    by_value = BY_VALUE.get(path, {}).get(str(value).strip().lower())
    if by_value:
        return (f"unknown config key '{path}': that is verl's switch; megappo's setting is "
                f"'{by_value.partition('=')[0]}'. Fix: write {by_value}.")
    found = verl_equivalent(path, is_key)
    if found is None:
        return None
    key, how = found
    if key:
        return f"unknown config key '{path}': that is verl's name; megappo's is '{key}'. Fix: write {key}={value}."
    return (f"unknown config key '{path}': that is a verl key; {how}. Fix: remove it (docs/config.md, 'Coming from "
            "verl', maps every verl name).")
