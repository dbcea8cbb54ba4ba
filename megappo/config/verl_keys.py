"""verl's config keys and how megappo reads them: a verl command line is accepted as written.

megappo keeps verl's names where it has the same knob (`data.train_batch_size`,
`algorithm.adv_estimator`, `actor.ppo_mini_batch_size`, `critic.optim.lr`, ...), so those
need no table. verl nests the policy under `actor_rollout_ref` and the loop under `trainer`;
`verl_reading(path, raw, value, is_key)` says how megappo reads a verl override: as a megappo
override (`RENAMED`, then the section `PREFIXES` swapped for megappo's when that is a key megappo
has; a value respelled by `BY_VALUE`, `VALUES` or `NEVER`), as a
key megappo has no use for (`UNUSED`, `UNUSED_PATTERNS`, `UNUSED_VALUES`, `MOOT`: named with why
at start-up), or as refused, with how megappo does the same thing (`OTHERWISE`, `REFUSED_PATTERNS`, a
`FEATURE_SWITCHES` switch turned on): the keys whose silent omission would change the training. verl's
compute dtypes are megappo's one `model.dtype` (`DTYPE_KEYS`), and its token budgets count Ulysses'
sequence-parallel size in (`TIMES_ULYSSES`). verl's reward file and function name are
read together (`REWARD_FILE`, `reward_file_reading`), and some verl keys bring verl's default of a key the
command line leaves out where it differs from megappo's (`SECTION_DEFAULTS`). `verl_hint` words the error a verl key in a
recipe file or `apply_override` gets. The tables cover verl's own example scripts (tests/data/verl/; every
`main_ppo` command line of a verl checkout's examples: tools/verl_examples.py counts those read).

This module is data and lookups: it imports nothing and does not know the config schema (`is_key`,
from megappo.config.loading, says whether megappo has a key). megappo.config.loading applies the readings, checks two
spellings of one setting against each other and words the start-up lines; docs/config.md, 'Coming from
verl', lists every table (tests/unit/test_verl_keys.py keeps it in sync).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

#: verl key -> megappo key, where the name differs beyond the section prefix
RENAMED: dict[str, str] = {
    "async_training.partial_rollout": "rollout.partial.enable",  # verl-recipe's fully-async trainer
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "actor.optim.warmup_steps_ratio",
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
    "actor_rollout_ref.rollout.val_kwargs.top_p": "rollout.val_top_p",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "rollout.val_top_k",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.sglang.mem_fraction_static",
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
    # verl's SAPO reads the actor's tau_pos / tau_neg (its ActorConfig, where megappo's are too); its current
    # scripts add them under policy_loss with Hydra's '+', at the actor's defaults' values
    "actor_rollout_ref.actor.policy_loss.tau_pos": "actor.tau_pos",
    "actor_rollout_ref.actor.policy_loss.tau_neg": "actor.tau_neg",
    # verl's current scripts also pass Megatron's own fields through override_transformer_config
    "actor_rollout_ref.actor.megatron.override_transformer_config.sequence_parallel": "parallel.sequence_parallel",
    "actor_rollout_ref.ref.megatron.override_transformer_config.sequence_parallel": "parallel.sequence_parallel",
    "actor_rollout_ref.actor.megatron.override_transformer_config.use_distributed_optimizer":
        "parallel.use_distributed_optimizer",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size",
    "critic.ppo_micro_batch_size": "critic.micro_batch_size",
    "critic.optim.lr_warmup_steps": "critic.optim.warmup_steps",
    "critic.optim.lr_warmup_steps_ratio": "critic.optim.warmup_steps_ratio",
    "critic.optim.warmup_style": "critic.optim.lr_decay_style",
    "critic.megatron.tensor_model_parallel_size": "critic.parallel.tp",
    # read only with the role's use_dist_checkpointing=True (MOOT); the reference follows the actor's when unset
    "actor_rollout_ref.actor.megatron.dist_checkpointing_path": "actor.dist_checkpoint",
    "actor_rollout_ref.ref.megatron.dist_checkpointing_path": "ref.dist_checkpoint",
    "critic.megatron.dist_checkpointing_path": "critic.dist_checkpoint",
    "critic.megatron.pipeline_model_parallel_size": "critic.parallel.pp",
    "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size": "ref.parallel.vpp",
    "critic.megatron.virtual_pipeline_model_parallel_size": "critic.parallel.vpp",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": "actor.parallel.ep",
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size": "ref.parallel.ep",
    "critic.megatron.expert_model_parallel_size": "critic.parallel.ep",
    "actor_rollout_ref.actor.megatron.context_parallel_size": "actor.parallel.cp",
    "actor_rollout_ref.ref.megatron.context_parallel_size": "ref.parallel.cp",
    "critic.megatron.context_parallel_size": "critic.parallel.cp",
    # verl's Megatron backend's LoRA section (its FSDP backend's flat lora_rank / lora_alpha / target_modules above)
    **{f"{verl}.lora.{field}": f"{ours}.lora.{field}"
       for verl, ours in (("actor_rollout_ref.model", "actor"), ("critic.model", "critic"))
       for field in ("rank", "alpha", "dropout", "target_modules")},
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": "rollout.update_bucket_mb",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": "rollout.update_bucket_mb",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "rollout.max_turns",
    "reward_model.model.path": "reward.model_path",
    "reward_model.micro_batch_size_per_gpu": "reward.micro_batch_size",
    "reward_model.micro_batch_size": "reward.micro_batch_size",
    "data.max_response_length": "rollout.max_new_tokens",
    "trainer.total_training_steps": "run.total_steps",
    "trainer.n_gpus_per_node": "hardware.gpus_per_node",
    "trainer.nnodes": "hardware.nodes",
    "trainer.save_freq": "checkpoint.save_every",
    "trainer.test_freq": "run.val_every",
    # verl writes its checkpoints there; megappo keeps the run's metrics and logs beside them (<dir>/checkpoints)
    "trainer.default_local_dir": "run.output_dir",
    "trainer.project_name": "logging.project",
    "trainer.experiment_name": "logging.run_name",
    "trainer.logger": "logging.sinks",
    "trainer.max_actor_ckpt_to_keep": "checkpoint.keep_last",
    # verl reads it with resume_mode=resume_path only (MOOT); megappo's step directory, not verl's global_step_N
    "trainer.resume_from_path": "checkpoint.resume_from",
    "trainer.rollout_data_dir": "logging.rollout_dir",
    "trainer.validation_data_dir": "logging.validation_dir",
    # verl validates only when val_before_train is true too (else it trains); megappo's val_only always validates
    "trainer.val_only": "run.val_only",
    # DAPO's reward manager: verl <= 0.8 reads reward_model.reward_kwargs, verl 0.9.1 reward.reward_kwargs; its
    # max_resp_len is the length the overlong penalty counts from, megappo's rollout.max_new_tokens (a different
    # value than data.max_response_length's is refused as a conflict: megappo has one length for both)
    **{f"{section}.reward_kwargs.overlong_buffer_cfg.{field}": f"reward.overlong_buffer.{field}"
       for section in ("reward_model", "reward") for field in ("enable", "len", "penalty_factor", "log")},
    "reward_model.reward_kwargs.max_resp_len": "rollout.max_new_tokens",
    # verl's SandboxFusion client (its code reward): <= 0.8 under reward_model, 0.9.1 under reward
    **{f"{section}.sandbox_fusion.{field}": f"reward.sandbox.{field}"
       for section in ("reward_model", "reward") for field in ("url", "max_concurrent", "memory_limit_mb")},
    "reward.reward_kwargs.max_resp_len": "rollout.max_new_tokens",
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
    # verl truncates a long prompt's start ('left') or stops ('error'); megappo keeps a prompt's end (truncate)
    "data.truncation": {"left": "data.long_prompt_policy=truncate", "error": "data.long_prompt_policy=error"},
    "data.filter_overlong_prompts": {"true": "data.long_prompt_policy=skip"},
    # "off" quoted: YAML 1.1 reads a bare off as false
    "trainer.resume_mode": {"auto": "checkpoint.resume=auto", "disable": 'checkpoint.resume="off"',
                            "resume_path": "checkpoint.resume=must"},
    # verl validates greedily unless do_sample; megappo samples when rollout.val_temperature > 0
    "actor_rollout_ref.rollout.val_kwargs.do_sample": {"false": "rollout.val_temperature=0"},
    # verl's R3 replays the experts the rollout engine chose (megappo's replay); R2 (the routes of the
    # old-log-prob pass) megappo does not have
    "actor_rollout_ref.actor.router_replay.mode": {"r3": "actor.moe_routing=replay",
                                                   "disabled": "actor.moe_routing=recompute"},
    # the same switch in the engine's section (verl's current scripts)
    **{f"actor_rollout_ref.actor.{engine}.router_replay.mode": {"r3": "actor.moe_routing=replay",
                                                                "disabled": "actor.moe_routing=recompute"}
       for engine in ("megatron", "veomni")},
}

#: verl key -> (the other verl key, its values that make it moot ('*': any value), why): verl drops long prompts
#: when it loads the data, so its truncation never sees one; it reads resume_from_path in resume_path mode only
#: (its default resume_mode is auto: MOOT_DEFAULTS); its vLLM and SGLang engines validate at
#: val_kwargs.temperature and read no val_kwargs.do_sample (only its HF rollout does)
MOOT: dict[str, tuple[str, tuple[str, ...], str]] = {
    "data.truncation": ("data.filter_overlong_prompts", ("true",), "verl drops long prompts when it loads the data "
                        "(data.filter_overlong_prompts=true), before truncating; megappo skips them "
                        "(data.long_prompt_policy=skip)"),
    "trainer.resume_from_path": ("trainer.resume_mode", ("auto", "disable"), "verl reads it with "
                                 "trainer.resume_mode=resume_path only (its default is auto)"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": (
        "actor_rollout_ref.rollout.val_kwargs.temperature", ("*",),
        "verl's vLLM and SGLang engines validate at val_kwargs.temperature whatever do_sample says (only its HF "
        "rollout reads do_sample); megappo validates at rollout.val_temperature, greedy at 0"),
    **{f"{role}.dist_checkpointing_path": (f"{role}.use_dist_checkpointing", ("false",), "verl reads it with "
                                           "use_dist_checkpointing=True only (its default is False)")
       for role in ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron")},
    **{f"{role}.use_dist_checkpointing": (f"{role}.dist_checkpointing_path", ("*",), "the switch of "
                                          "dist_checkpointing_path, which says whether megappo reads that")
       for role in ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron")},
}

#: verl's default of a key MOOT consults, where a command line leaves that key out
MOOT_DEFAULTS: dict[str, str] = {"trainer.resume_mode": "auto", **{
    f"{role}.use_dist_checkpointing": "false"
    for role in ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron")}}

#: verl key -> its values' megappo spelling, where they differ (a list value: item by item); a value not listed
#: is refused with the ones that are
VALUES: dict[str, dict[str, str]] = {
    "trainer.logger": {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow",
                       "file": "jsonl"},
}

#: megappo's list keys whose verl key (Hydra's ListConfig or a plain string) also takes one string: a string is
#: read as a one-item list (verl's FSDP backend writes target_modules=all-linear)
ONE_OR_MORE: tuple[str, ...] = ("data.train_files", "data.val_files", "actor.lora.target_modules",
                                "critic.lora.target_modules")

#: verl key (a list) -> items megappo always adds to it, and why
ADDED_ITEMS: dict[str, tuple[list[str], str]] = {
    "trainer.logger": (["jsonl"], "metrics.jsonl is megappo's own record, which the end-of-run curves and "
                                  "`megappo plot` read (verl's 'file' logger)"),
}

#: verl key -> (megappo key, megappo's value) for verl's counts <= 0 or null, which verl reads as "none", "never"
#: or "no limit" (its defaults are -1 and null): no warmup steps of its own (lr_warmup_steps_ratio counts then);
#: no checkpoint at all, not even of the last step (megappo's 0 saves the last one); no validation during
#: training; every checkpoint kept. A count > 0 is read as RENAMED says.
NEVER: dict[str, tuple[str, int]] = {
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("actor.optim.warmup_steps", 0),  # verl's -1: the ratio's
    "critic.optim.lr_warmup_steps": ("critic.optim.warmup_steps", 0),
    "trainer.save_freq": ("checkpoint.save_every", -1),
    "trainer.test_freq": ("run.val_every", 0),
    "trainer.max_actor_ckpt_to_keep": ("checkpoint.keep_last", 0),
}

#: verl key -> (megappo key, what to add to verl's count): verl counts its steps from 1 and trains the actor
#: once `critic_warmup <= global_steps`, so its critic_warmup=N leaves N - 1 critic-only steps (at least 0)
SHIFTED: dict[str, tuple[str, int]] = {
    "trainer.critic_warmup": ("run.critic_warmup", -1),
}

_PACKING = "megappo packs sequences without padding (actor.packing, on by default) into micro-batches of " \
           "actor.max_tokens_per_micro_batch tokens; the loss does not depend on how they are split"
_LOG_PROB_PASS = "megappo's old-log-prob pass uses the actor's micro-batches (actor.micro_batch_size, " \
                 "actor.max_tokens_per_micro_batch)"
_ENGINE_KNOB = "a knob of verl's vLLM/SGLang server; megappo's engine sizes itself (SGLang's own settings go " \
               "through rollout.sglang.*)"
_RM_PACKING = "megappo packs the reward model's sequences without padding (reward.packing, on by default); the " \
              "scores do not depend on how they are split"
_KERNEL = "a Megatron kernel or overlap choice (same math); megappo chooses its kernels per device in one place " \
          "(model.layer_spec; docs/precision.md)"
_NO_OFFLOAD = "megappo keeps the optimizer in GPU memory in fp32 (no offload; docs/precision.md)"
_OWN_BRIDGE = "megappo converts HF <-> Megatron weights with its own bridge (model.path is an HF directory; " \
              "docs/conversion.md)"
_NO_REMOTE_CODE = "megappo builds its models and reads its data itself (docs/models.md) and never runs code a " \
                  "model or dataset directory ships"
_EVEN_PP_SPLIT = "megappo splits the layers evenly over the pipeline stages (megappo plan shows each stage's memory)"
_REWARD_SERVER = "verl serves its reward model with an inference engine; megappo runs it as a Megatron model on the " \
                 "trainer's ranks (reward.model_path), and asks a generative one (a judge) over HTTP " \
                 "(reward.functions=[judge], reward.judge.url: docs/rewards.md)"
_LORA_INIT = "megappo initialises A as peft does (Kaiming-uniform) and B at zero, so training starts from the " \
             "base model, as verl's does"
_TEXT_ONLY = "megappo trains text-only language models and reads no images (a vision model is refused when it is " \
             "built)"
_ROLES_MEGATRON = ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron")

#: verl keys megappo reads but has no use for, and why: named in one start-up line, never silently dropped
UNUSED: dict[str, str] = {
    "trainer.device": "megappo uses CUDA when it is there, else the CPU (parallel.backend=auto)",
    "trainer.log_val_generations": "megappo keeps logging.samples=N samples of every step in samples.jsonl "
                                   "(the console shows them per logging.console); every validation generation: "
                                   "logging.validation_dir=DIR",
    "trainer.balance_batch": "megappo packs sequences into micro-batches by their lengths (actor.packing)",
    "trainer.ray_wait_register_center_timeout": "megappo starts no Ray register center",
    "reward_model.enable": "megappo uses a reward model when reward.model_path is set",
    "reward.reward_model.enable": "megappo uses a reward model when reward.model_path is set",
    "data.val_batch_size": "megappo validates on all data.val_files prompts in one batch",
    "data.return_raw_chat": "megappo renders the chat template itself (data.apply_chat_template)",
    "data.dataloader_num_workers": "megappo reads its prompts in the trainer's process",
    "actor_rollout_ref.model.use_remove_padding": _PACKING,
    "actor_rollout_ref.actor.use_dynamic_bsz": _PACKING,
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": _PACKING,
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": _PACKING,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": _LOG_PROB_PASS,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": _LOG_PROB_PASS,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": _LOG_PROB_PASS,
    "actor_rollout_ref.model.use_fused_kernels": "megappo's log-probs are computed per token chunk in the loss "
                                                 "functions (no fused kernel to switch)",
    "actor_rollout_ref.model.use_liger": "Liger's kernels patch the HF models of verl's FSDP backend; megappo trains "
                                         "Megatron-Core models",
    "actor_rollout_ref.actor.entropy_checkpointing": "a memory saving of verl's entropy pass; megappo's memory "
                                                     "settings are actor.recompute.*",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": "a memory saving of verl's entropy pass; megappo's "
                                                                 "memory settings are actor.recompute.*",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "the engine's tensor parallelism: SGLang's own "
                                                            "rollout.sglang.tp_size",
    "actor_rollout_ref.rollout.mode": "verl's sync/async is how its engine is served; megappo's rollout.mode is "
                                      "off-policy generation (one_step_off, async), which verl's key does not ask for",
    "actor_rollout_ref.rollout.enable_chunked_prefill": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.max_num_batched_tokens": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.max_num_seqs": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.max_model_len": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.enforce_eager": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.free_cache_engine": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.load_format": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.enable_prefix_caching": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.dtype": _ENGINE_KNOB + "; the engine runs in model.dtype",
    "actor_rollout_ref.ref.megatron.param_offload": "megappo keeps the reference model in GPU memory (no offload)",
    "actor_rollout_ref.actor.megatron.param_offload": "megappo keeps the actor in GPU memory (no offload)",
    "actor_rollout_ref.actor.megatron.grad_offload": "megappo keeps the actor in GPU memory (no offload)",
    "actor_rollout_ref.actor.megatron.optimizer_offload": "megappo keeps the actor in GPU memory (no offload)",
    "critic.megatron.param_offload": "megappo keeps the critic in GPU memory (no offload)",
    "critic.megatron.grad_offload": "megappo keeps the critic in GPU memory (no offload)",
    "critic.megatron.optimizer_offload": "megappo keeps the critic in GPU memory (no offload)",
    "actor_rollout_ref.nccl_timeout": "megappo's collective timeout is parallel.timeout_minutes",
    "actor_rollout_ref.actor.nccl_timeout": "megappo's collective timeout is parallel.timeout_minutes",
    "trainer.nccl_timeout": "megappo's collective timeout is parallel.timeout_minutes",
    "actor_rollout_ref.rollout.calculate_log_probs": "megappo's engines always return the sampled tokens' log-probs "
                                                     "(rollout correction and the rollout metrics read them)",
    "trainer.default_hdfs_dir": "megappo writes its checkpoints to checkpoint.dir only",
    "trainer.del_local_ckpt_after_load": "megappo keeps the checkpoint it resumed from (checkpoint.keep_last prunes)",
    "trainer.max_critic_ckpt_to_keep": "megappo keeps its models' checkpoints together, checkpoint.keep_last of them "
                                       "(verl's trainer.max_actor_ckpt_to_keep)",
    **{f"{role}.checkpoint.{what}_contents": "megappo's checkpoints hold all that exact resume needs (models, "
                                             "optimizers, RNG, data cursor); HF weights: checkpoint.save_hf_at_end or "
                                             "megappo export"
       for role in ("actor_rollout_ref.actor", "critic") for what in ("save", "load")},
    "actor_rollout_ref.actor.calculate_sum_pi_squared": "megappo computes the sum of squared probabilities in the "
                                                        "old-log-prob pass when algorithm.adv_estimator is "
                                                        "optimal_token_baseline or tir_optimal_token_baseline, the "
                                                        "estimators that read it (verl asks for the switch with them)",
    "critic.model.use_remove_padding": _PACKING.replace("actor.", "critic."),
    "critic.use_dynamic_bsz": _PACKING.replace("actor.", "critic."),
    "reward_model.model.use_remove_padding": _RM_PACKING,
    "reward_model.use_dynamic_bsz": _RM_PACKING,
    "critic.forward_max_token_len_per_gpu": "megappo's value pass uses the critic's micro-batches "
                                            "(critic.micro_batch_size, critic.max_tokens_per_micro_batch)",
    "critic.forward_micro_batch_size_per_gpu": "megappo's value pass uses the critic's micro-batches "
                                               "(critic.micro_batch_size, critic.max_tokens_per_micro_batch)",
    "actor_rollout_ref.actor.strategy": "megappo trains with Megatron-Core (verl's megatron strategy; the math does "
                                        "not depend on it)",
    "actor_rollout_ref.ref.strategy": "megappo trains with Megatron-Core (verl's megatron strategy; the math does not "
                                      "depend on it)",
    "critic.strategy": "megappo trains with Megatron-Core (verl's megatron strategy; the math does not depend on it)",
    "reward_model.strategy": "megappo trains with Megatron-Core (verl's megatron strategy; the math does not depend "
                             "on it)",
    "trainer.use_legacy_worker_impl": "verl's choice between its two worker implementations",
    "actor_rollout_ref.actor.data_loader_seed": "megappo seeds its shuffles from run.seed",
    "actor_rollout_ref.actor.use_torch_compile": "megappo does not torch.compile its training passes",
    "actor_rollout_ref.ref.use_torch_compile": "megappo does not torch.compile its training passes",
    "actor_rollout_ref.model.trust_remote_code": _NO_REMOTE_CODE,
    "critic.model.trust_remote_code": _NO_REMOTE_CODE,
    "reward_model.model.trust_remote_code": _NO_REMOTE_CODE,
    "data.trust_remote_code": _NO_REMOTE_CODE,
    "data.filter_overlong_prompts_workers": "megappo reads its prompts in the trainer's process",
    "actor_rollout_ref.model.use_shm": "verl's copy of the model to /dev/shm; megappo reads model.path as given",
    "actor_rollout_ref.model.enable_activation_offload": "a memory saving of verl's FSDP backend; megappo's memory "
                                                         "settings are actor.recompute.*",
    "actor_rollout_ref.model.lora.merge": "how verl's adapters reach its engine; megappo's is rollout.lora_sync "
                                          "(merged by default, as verl's merge=true)",
    "actor_rollout_ref.rollout.layered_summon": "verl's gathering of FSDP LoRA weights layer by layer; megappo's "
                                                "weight sync streams buckets (rollout.update_bucket_mb)",
    "actor_rollout_ref.rollout.multi_stage_wake_up": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.disable_log_stats": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.skip_tokenizer_init": _ENGINE_KNOB,
    "actor_rollout_ref.rollout.data_parallel_size": "the engine's data parallelism: SGLang's own rollout.sglang.dp_size",
    "actor_rollout_ref.rollout.expert_parallel_size": "the engine's expert parallelism: SGLang's own "
                                                      "rollout.sglang.ep_size",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": "megappo's engine records the routes exactly when "
                                                               "actor.moe_routing=replay (verl's "
                                                               "actor.router_replay.mode=R3)",
    "actor_rollout_ref.actor.use_prefix_grouper": "a speed-up of verl's (each group's shared prompt computed once); "
                                                  "the loss is the same",
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": "the reference pass computes log-probs only (no "
                                                               "entropy)",
    "actor_rollout_ref.model.torch_dtype": "megappo's compute dtype is model.dtype (docs/precision.md)",
    "actor_rollout_ref.model.lora.lora_A_init_method": _LORA_INIT,
    "actor_rollout_ref.model.lora.lora_B_init_method": _LORA_INIT,
    **{f"actor_rollout_ref.model.mtp.{k}": "a setting of multi-token prediction, which megappo does not have "
                                           "(mtp.enable=true is refused)"
       for k in ("mtp_loss_scaling_factor", "detach_encoder", "enable_rollout", "speculative_algorithm",
                 "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "method",
                 "num_speculative_tokens")},
    "data.image_key": _TEXT_ONLY,
    "actor_rollout_ref.actor.freeze_vision_tower": _TEXT_ONLY,
    "reward_model.use_reward_loop": "verl's reward service; megappo scores in the trainer (reward.functions, "
                                    "reward.model_path)",
    # verl's current scripts (verl 1dda039, examples/)
    "actor_rollout_ref.actor.megatron.use_remove_padding": _PACKING,
    "actor_rollout_ref.actor.checkpoint.strict": "how verl's loader treats a checkpoint's missing keys; megappo "
                                                 "loads its own checkpoints whole",
    "actor_rollout_ref.rollout.prompt_length": "verl's engine's prompt budget (its default: data.max_prompt_length); "
                                               "megappo's engine takes prompts of up to data.max_prompt_length tokens",
    "actor_rollout_ref.ref.entropy_checkpointing": "the reference pass computes log-probs only (no entropy)",
    "trainer.tensorboard_dir": "megappo writes TensorBoard's events to run.output_dir/tensorboard (logging.sinks "
                               "tensorboard)",
    "trainer.rl_logging_board_dir": "megappo keeps every step's metrics in run.output_dir/metrics.jsonl and "
                                    "samples.jsonl (logging.rollout_dir=DIR: every generation)",
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": _ENGINE_KNOB,
    "actor_rollout_ref.actor.optim.override_optimizer_config.offload_fraction": _NO_OFFLOAD,
    "data.image_patch_size": _TEXT_ONLY,
}

#: verl key patterns ('*' is one or more key parts) megappo reads but has no use for, and why
UNUSED_PATTERNS: dict[str, str] = {
    "ray_init.*": "megappo starts its ranks itself (torchrun, or --launcher ray on a running cluster)",
    "*.fsdp_config.*": "megappo trains with Megatron-Core, not FSDP",
    "actor_rollout_ref.model.fused_kernel_options.*": "megappo's log-probs are computed per token chunk in the loss "
                                                      "functions (no fused kernel to switch)",
    "*.ulysses_sequence_parallel_size": "Ulysses sequence parallelism is verl's FSDP backend's; megappo's is "
                                        "Megatron's parallel.sequence_parallel (with tp > 1); a token budget "
                                        "(ppo_max_token_len_per_gpu) is read times it, as verl counts it",
    "*.qat.*": "a setting of quantization-aware training, which megappo does not have (qat.enable=true is refused)",
    "*.profiler.*": "megappo times its stages itself (timing_s/* metrics)",
    "global_profiler.*": "megappo times its stages itself (timing_s/* metrics)",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.*": "a setting of verl's vLLM server; megappo has no vLLM engine",
    "actor_rollout_ref.rollout.engine_kwargs.trtllm.*": "a setting of verl's TensorRT-LLM server; megappo has no "
                                                        "TensorRT-LLM engine",
    "actor_rollout_ref.rollout.trace.*": "verl's rollout tracing; megappo keeps logging.samples=N samples of every "
                                         "step in samples.jsonl",
    "actor_rollout_ref.rollout.prometheus.*": "verl's engine monitoring; megappo logs its rollout/* and timing_s/* "
                                              "metrics",
    "reward_model.rollout.*": _REWARD_SERVER,
    **{f"*.model.override_config.{key}": "a limit, not a change to the model: with rotary positions the model's "
                                         "math does not depend on it (megappo's sequences are "
                                         "data.max_prompt_length + rollout.max_new_tokens long at most)"
       for key in ("max_position_embeddings", "model_config.max_position_embeddings")},
    "*.megatron.use_mbridge": _OWN_BRIDGE,
    "*.megatron.vanilla_mbridge": _OWN_BRIDGE,
    "*.megatron.seed": "megappo seeds every rank from run.seed",
    "*.megatron.expert_tensor_parallel_size": "megappo splits each expert over the role's tensor-parallel ranks "
                                              "(Megatron's default; the math is the same)",
    **{f"*.megatron.override_transformer_config.{key}": _KERNEL for key in (
        "apply_rope_fusion", "bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
        "gradient_accumulation_fusion", "persist_layer_norm", "moe_permute_fusion", "moe_grouped_gemm",
        "deallocate_pipeline_outputs", "moe_shared_expert_overlap", "moe_enable_deepep", "moe_token_dispatcher_type",
        "attention_backend")},
    "*.megatron.override_transformer_config.moe_router_dtype": "megappo computes the router in model.dtype, as the HF "
                                                               "model and the rollout engine do",
    **{f"*.megatron.override_transformer_config.{key}": _EVEN_PP_SPLIT for key in (
        "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")},
    **{f"*.optim.override_optimizer_config.{key}": _NO_OFFLOAD for key in (
        "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d", "optimizer_cpu_offload",
        "use_precision_aware_optimizer")},
    # verl's current scripts (verl 1dda039, examples/)
    "ray_kwargs.*": "megappo starts its ranks itself (torchrun, or --launcher ray on a running cluster)",
    "distillation.*": "a setting of on-policy distillation, which megappo does not have (distillation.enabled=true "
                      "is refused)",
    "critic.fsdp.*": "megappo trains with Megatron-Core, not FSDP",
    **{f"*.megatron.override_transformer_config.{key}": _KERNEL for key in (
        "use_flash_attn", "use_fused_rmsnorm", "use_fused_swiglu", "use_naive_l2norm", "use_triton_gdn",
        "use_ascend_gdn", "use_fused_mhc", "apply_dsa_kernel_fusion")},
    "*.megatron.override_transformer_config.pipeline_model_parallel_layout": _EVEN_PP_SPLIT,
    "*.megatron.override_transformer_config.sequence_packing_scheduler": _PACKING,
    "hydra.*": "Hydra's own settings (its config search path, run directory); megappo reads its recipe and KEY=VALUE "
               "overrides",
    **{f"reward_model.{key}": _REWARD_SERVER for key in ("nnodes", "n_gpus_per_node", "enable_resource_pool")},
    # verl's VeOmni engine (FSDP training): layout, offload and kernel choices, none of which changes the math
    **{f"*.veomni.{key}": why
       for keys, why in (
           (("param_offload", "optimizer_offload", "enable_fsdp_offload"),
            "megappo keeps the models and the optimizer in GPU memory (no offload)"),
           (("enable_full_shard", "fsdp_size", "expert_parallel_size", "ulysses_parallel_size"),
            "a layout of verl's VeOmni (FSDP) engine; megappo trains with Megatron-Core, laid out by "
            "actor.parallel.* (docs/parallelism.md)"),
           (("attn_implementation", "moe_implementation", "cross_entropy_loss_implementation",
             "dsa_attention_implementation", "dsa_indexer_implementation", "mhc_implementation"), _KERNEL))
       for key in keys},
}

#: verl key -> {value: why megappo has no use for it}; its other values are refused (OTHERWISE says how)
UNUSED_VALUES: dict[str, dict[str, str]] = {
    # verl's current scripts choose the training engine at the top level (verl 1dda039)
    **{key: {e: "megappo trains with Megatron-Core (verl's megatron engine; the math does not depend on it)"
             for e in ("megatron", "fsdp", "veomni", "torchtitan", "automodel")}
       for key in ("model_engine", "actor_rollout_ref.actor.model_engine")},
    # Megatron's Adam is AdamW (decoupled weight decay), verl's default optimizer
    **{f"{role}.optim.optimizer": {o: "megappo's optimizer is Megatron's Adam with decoupled weight decay (AdamW, "
                                      "actor.optim.weight_decay), verl's default" for o in ("adam", "adamw", "fusedadam")}
       for role in ("actor_rollout_ref.actor", "critic")},
    # megappo's reward path is verl's naive/dapo manager: scores from reward.functions, summed with the reward
    # model's, DAPO's overlong shaping from reward.overlong_buffer
    "reward_model.reward_manager": {m: f"megappo's reward path does what verl's {m} manager does (reward.functions; "
                                       "overlong shaping: reward.overlong_buffer)" for m in ("naive", "dapo")},
    "reward.reward_manager.name": {m: f"megappo's reward path does what verl's {m} manager does (reward.functions; "
                                      "overlong shaping: reward.overlong_buffer)" for m in ("naive", "dapo")},
    "actor_rollout_ref.rollout.name": {"vllm": "megappo has no vLLM engine; it generates with rollout.engine (hf, "
                                               "or sglang on GPUs: rollout.engine=sglang)"},
    "actor_rollout_ref.rollout.val_kwargs.do_sample": {"true": "megappo samples in validation when "
                                                               "rollout.val_temperature > 0"},
    "data.filter_overlong_prompts": {"false": "verl then truncates or refuses long prompts by data.truncation "
                                              "(megappo: data.long_prompt_policy)"},
    "actor_rollout_ref.hybrid_engine": {"true": "verl's only mode; megappo places its engine by rollout.engine and "
                                                "rollout.mode (docs/engines.md, docs/async.md)"},
    "actor_rollout_ref.rollout.multi_turn.enable": {"false": "single-turn rollouts are megappo's default "
                                                             "(rollout.env=single_turn)"},
    "trainer.resume_from_path": {"null": "no checkpoint named: megappo resumes from checkpoint.dir's newest"},
    "data.reward_fn_key": {"data_source": "megappo's reward functions get each row's data_source, as verl's do"},
    "reward_model.num_workers": {"null": "verl's legacy key, unset (verl 0.9.1: reward.num_workers, megappo's name)"},
    **{f"{role}.use_dist_checkpointing": {"false": "megappo loads model.path's HF weights, as verl then does"}
       for role in _ROLES_MEGATRON},
    **{f"{role}.dist_checkpointing_path": {"null": "no Megatron checkpoint named: megappo loads model.path"}
       for role in _ROLES_MEGATRON},
    **{f"{role}.dist_checkpointing_prefix": {"": "no key prefix: a checkpoint's keys as Megatron's GPTModel names "
                                                 "them, as megappo reads them"} for role in _ROLES_MEGATRON},
    "actor_rollout_ref.model.lora.type": {"lora": "megappo's adapters are LoRA's"},
    "actor_rollout_ref.model.lora.dropout_position": {"pre": "megappo applies the adapters' dropout to their input, "
                                                             "verl's pre"},
    **{key: {"null": "no adapter to start from: megappo's adapters start at B = 0, as verl's"}
       for key in ("actor_rollout_ref.model.lora_adapter_path", "actor_rollout_ref.model.lora.adapter_path")},
    **{key: {"null": "no module excluded", "[]": "no module excluded"}
       for key in ("actor_rollout_ref.model.exclude_modules", "actor_rollout_ref.model.lora.exclude_modules")},
    "actor_rollout_ref.model.mtp.enable": {"false": "no multi-token prediction, as megappo"},
    "actor_rollout_ref.model.mtp.enable_train": {"false": "no multi-token prediction, as megappo"},
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": {"null": "no tools"},
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": {"null": "no interaction"},
    "actor_rollout_ref.rollout.multi_turn.format": {"hermes": "megappo's tools environment reads Hermes/Qwen "
                                                              "<tool_call> JSON, verl's hermes format"},
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": {"null": "verl's no limit; megappo bounds an episode by "
                                                                         "rollout.max_turns (default 8) and "
                                                                         "rollout.max_new_tokens"},
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": {"null": "verl's no limit; megappo's tools environment "
                                                                    "bounds its calls by rollout.env_args.max_tool_calls"},
    "actor_rollout_ref.rollout.over_sample_rate": {"0": "verl's early stop of generation is off; megappo generates "
                                                        "every sample to its end",
                                                   "0.0": "verl's early stop of generation is off; megappo generates "
                                                          "every sample to its end"},
    **{f"{role}.shuffle": {"true": "megappo shuffles each epoch's sequences into mini-batches (seeded by run.seed)"}
       for role in ("actor_rollout_ref.actor", "critic")},
    # verl's null micro-batch sizes are "unset" (its default; the other spelling or dynamic batching sizes them)
    **{f"{verl}{suffix}": {"null": f"verl's unset; megappo's micro-batches: {ours}.micro_batch_size sequences or "
                                   f"{ours}.max_tokens_per_micro_batch tokens"}
       for verl, ours in (("actor_rollout_ref.actor.ppo_micro_batch_size", "actor"),
                          ("actor_rollout_ref.ref.log_prob_micro_batch_size", "ref"),
                          ("critic.ppo_micro_batch_size", "critic"), ("reward_model.micro_batch_size", "reward"))
       for suffix in ("", "_per_gpu")},
}

#: verl's switches of a feature megappo does not have ('*' is one or more key parts) -> (its values that leave the
#: feature off, how megappo does without it): off is named as unused, on is refused, so training never silently
#: differs
FEATURE_SWITCHES: dict[str, tuple[tuple[str, ...], str]] = {
    "*.qat.enable": (("false", "null"), "megappo has no quantization-aware training (verl's QAT trains against "
                                        "fake-quantized weights); remove it to train in model.dtype"),
    "distillation.enabled": (("false", "null"), "megappo has no on-policy distillation (a teacher model's log-probs "
                                                "in the loss); remove distillation.* to train with rewards alone"),
    "actor_rollout_ref.rollout.ignore_eos": (("false", "null"), "megappo's engines end a response at its EOS token, "
                                                               "as verl's default does; generating past it is a "
                                                               "benchmark setting: remove it"),
}

#: verl's compute dtype keys ('*' is one or more key parts), read as megappo's one model.dtype (every role's)
DTYPE_KEYS: tuple[str, ...] = ("*.megatron.dtype", "*.fsdp_config.mixed_precision.param_dtype")
#: their values' megappo spelling (model.dtype refuses float16, with its fix)
DTYPE_VALUES: dict[str, str] = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                                "fp16": "float16", "float16": "float16"}
#: what verl computes in when a command line names no dtype (its Megatron dtype and FSDP param_dtype defaults)
VERL_DTYPE = "bfloat16"

#: verl's token budget per micro-batch -> its Ulysses sequence-parallel sizes (the first given counts; verl's
#: reference takes the actor's): verl's micro-batch holds the budget x sp tokens, split over the sp group's GPUs;
#: megappo's (one rank's, split by tp with parallel.sequence_parallel) holds as many
TIMES_ULYSSES: dict[str, tuple[str, ...]] = {
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": ("actor_rollout_ref.ref.ulysses_sequence_parallel_size",
                                                             "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    "critic.ppo_max_token_len_per_gpu": ("critic.ulysses_sequence_parallel_size",),
}

#: verl key -> how megappo does it, where there is no one key to rename it to
OTHERWISE: dict[str, str] = {
    "reward_model.reward_manager": "megappo's reward path is verl's naive and dapo managers (reward.functions, "
                                   "reward.overlong_buffer); write another manager's scoring as a reward function, "
                                   "reward.functions=[path/to/file.py:function_name]",
    "reward.reward_manager.name": "megappo's reward path is verl's naive and dapo managers (reward.functions, "
                                  "reward.overlong_buffer); write another manager's scoring as a reward function, "
                                  "reward.functions=[path/to/file.py:function_name]",
    "data.truncation": "megappo keeps a prompt's end (verl's 'left'): write data.long_prompt_policy=truncate, error, "
                       "or skip",
    "actor_rollout_ref.rollout.multi_turn.enable": "megappo's multi-turn rollouts and tool calls are environments: "
                                                   "write rollout.env=tools, or rollout.env=my_env.py:MyEnv "
                                                   "(docs/environments.md)",
    "data.filter_overlong_prompts": "write data.long_prompt_policy=skip (megappo's default)",
    "trainer.resume_mode": "write checkpoint.resume=auto, must (a checkpoint is required) or off (verl's 'disable'); "
                           "a checkpoint of your choice: checkpoint.resume_from=PATH or a step number",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "megappo samples in validation when rollout.val_temperature > "
                                                      "0: write rollout.val_temperature",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "write actor.recompute.granularity=full for true (full "
                                                             "recomputation of every layer, as verl's Megatron "
                                                             "backend did) or none for false",
    "critic.model.enable_gradient_checkpointing": "write critic.recompute.granularity=full for true (full recomputation "
                                                  "of every layer, as verl's Megatron backend did) or none for false",
    "actor_rollout_ref.ref.megatron.override_transformer_config.recompute_granularity":
        "the reference model only runs forward passes, so it has nothing to recompute (actor.recompute and "
        "critic.recompute are the trained roles')",
    **{f"{role}.use_dist_checkpointing": f"verl then loads {role}.dist_checkpointing_path, which is not given: "
                                         f"give it (megappo reads it as {ours}.dist_checkpoint)"
       for role, ours in zip(_ROLES_MEGATRON, ("actor", "ref", "critic"))},
    **{f"{role}.dist_checkpointing_prefix": "megappo reads a checkpoint's keys as Megatron's GPTModel names them "
                                            "(verl's default prefix ''): save it again without the prefix"
       for role in _ROLES_MEGATRON},
    "actor_rollout_ref.actor.router_replay.mode": "megappo replays the experts the rollout engine chose (verl's R3: "
                                                  "actor.moe_routing=replay) or lets the trainer's routers choose "
                                                  "(disabled: actor.moe_routing=recompute); verl's R2 it does not have",
    **{f"actor_rollout_ref.actor.{engine}.router_replay.mode": "megappo replays the experts the rollout engine "
                                                               "chose (verl's R3: actor.moe_routing=replay) or lets "
                                                               "the trainer's routers choose (disabled: "
                                                               "actor.moe_routing=recompute); verl's R2 it does not have"
       for engine in ("megatron", "veomni")},
    **{key: "megappo trains with Megatron-Core: remove it"
       for key in ("model_engine", "actor_rollout_ref.actor.model_engine")},
    **{f"{role}.optim.optimizer": "megappo trains with AdamW only (Megatron's Adam): remove it"
       for role in ("actor_rollout_ref.actor", "critic")},
    **{f"{verl}.optim.min_lr": f"megappo's learning-rate floor is a fraction of the rate: write "
                               f"{ours}.optim.min_lr_ratio=MIN_LR/LR (verl's min_lr divided by its optim.lr)"
       for verl, ours in (("actor_rollout_ref.actor", "actor"), ("critic", "critic"))},
    "actor_rollout_ref.model.lora.type": "megappo's adapters are plain LoRA (actor.lora.*; docs/lora.md)",
    "actor_rollout_ref.model.lora.dropout_position": "megappo applies the adapters' dropout to their input (verl's "
                                                     "pre): remove it",
    **{key: "megappo starts its adapters at B = 0: merge the adapter into its base model (peft's merge_and_unload) "
            "and set model.path to the result" for key in ("actor_rollout_ref.model.lora_adapter_path",
                                                            "actor_rollout_ref.model.lora.adapter_path")},
    **{key: "write actor.lora.target_modules=[...] naming the modules to adapt (docs/lora.md)"
       for key in ("actor_rollout_ref.model.exclude_modules", "actor_rollout_ref.model.lora.exclude_modules")},
    **{key: "megappo does not train or decode with multi-token-prediction heads: remove it"
       for key in ("actor_rollout_ref.model.mtp.enable", "actor_rollout_ref.model.mtp.enable_train")},
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "megappo's tools are Python functions: write "
                                                             "rollout.env=tools with rollout.env_args.tools=[...] "
                                                             "(docs/tools.md); verl's tool YAML is not read",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": "a simulated user is an environment in megappo: "
                                                                    "write rollout.env=my_env.py:MyEnv "
                                                                    "(docs/environments.md)",
    "actor_rollout_ref.rollout.multi_turn.format": "megappo's tools environment reads Hermes/Qwen <tool_call> JSON "
                                                   "(verl's hermes) only (docs/tools.md)",
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": "megappo bounds an episode by rollout.max_turns (actions) "
                                                           "and rollout.env_args.max_tool_calls: write those "
                                                           "(docs/tools.md)",
    "actor_rollout_ref.rollout.over_sample_rate": "megappo generates every sample to its end (verl aborts the last "
                                                  "over_sample_rate of the requests): remove it",
    **{f"{role}.shuffle": "megappo always shuffles each epoch's sequences into mini-batches (seeded by run.seed; "
                          "verl's trainer.balance_batch reorders them too): remove it"
       for role in ("actor_rollout_ref.actor", "critic")},
    "actor_rollout_ref.actor.policy_loss.rollout_correction": "write algorithm.rollout_correction.* (verl copies it "
                                                              "there itself in bypass mode)",
}

#: verl's defaults that differ from megappo's, brought by a verl key a command line gives: (that key, megappo's
#: override of verl's default, the keys that set it instead, why). verl's Megatron LoRA section defaults alpha
#: to 32 (its FSDP backend's flat lora_alpha: 16, megappo's default); left out, a script's lora.rank would
#: train at half verl's scale alpha / rank.
SECTION_DEFAULTS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("actor_rollout_ref.model.lora.rank", "actor.lora.alpha=32",
     ("actor_rollout_ref.model.lora.alpha", "actor_rollout_ref.model.lora_alpha", "actor.lora.alpha"),
     "verl's default for its Megatron LoRA section"),
    ("critic.model.lora.rank", "critic.lora.alpha=32",
     ("critic.model.lora.alpha", "critic.model.lora_alpha", "critic.lora.alpha"),
     "verl's default for its Megatron LoRA section"),
)

#: verl's key naming a reward function's file -> its key naming the function (verl <= 0.8 at the top level, 0.9.1
#: under reward): the two are read together as megappo's `reward.functions=[file:function]`, which replaces the
#: recipe's functions as verl's file replaces its default scorer; megappo calls a verl `compute_score` with verl's
#: arguments (megappo.rewards)
REWARD_FILE: dict[str, str] = {
    "custom_reward_function.path": "custom_reward_function.name",
    "reward.custom_reward_function.path": "reward.custom_reward_function.name",
}
VERL_REWARD_NAME = "compute_score"  # verl's default custom_reward_function.name


def reward_file_reading(path: Any, name: Any) -> tuple[str, str]:
    """How megappo reads verl's reward file `path` (parsed; None: verl's default null) and function `name` (None:
    not given): ('read', 'reward.functions=[...]') or ('unused', why)."""
    if path is None or str(path).strip() == "":
        return "unused", "no reward file named: megappo scores with reward.functions"
    return "read", f"reward.functions=[{json_string(f'{path}:{name or VERL_REWARD_NAME}')}]"


#: verl key patterns ('*' is one or more key parts) refused, and how megappo does it
REFUSED_PATTERNS: dict[str, str] = {
    "*.model.override_config.*": "megappo builds the model from model.path's config.json, which its rollout engine "
                                 "reads too: change the value there (or in model.hf_config)",
    "*.sandbox_fusion.*": "megappo's SandboxFusion settings are reward.sandbox.url, max_concurrent and memory_limit_mb "
                          "(docs/rewards.md); score code answers with reward.functions=[code]",
    **{key: "megappo computes in model.dtype (bfloat16 or float32), not FP8 (docs/precision.md): remove it"
       for key in ("*.megatron.override_transformer_config.fp8", "*.megatron.override_transformer_config.fp8_recipe",
                   "*.optim.override_optimizer_config.fp8_recipe")},
    # verl-recipe's (48ea0a7) fully-async trainer and agent loops
    "async_training.*": "megappo's off-policy generation is rollout.mode=one_step_off or async (docs/async.md); "
                        "verl's fully-async trainer's other settings are not read (its partial_rollout is "
                        "rollout.partial.enable): remove them",
    "actor_rollout_ref.rollout.agent.*": "verl's agent loops are environments in megappo: write rollout.env=tools or "
                                         "rollout.env=my_env.py:MyEnv (docs/environments.md)",
    # Megatron fields of verl's current scripts that change the model or its loss
    **{f"*.megatron.override_transformer_config.{key}": "megappo builds the model from model.path's config.json: "
                                                        "change the value there (or in model.hf_config)"
       for key in ("normalization", "swiglu")},
    "*.megatron.override_transformer_config.moe_aux_loss_coeff": "megappo weights the MoE load-balancing loss by the "
                                                                 "model's router_aux_loss_coef: set it in "
                                                                 "model.path's config.json (or model.hf_config)",
    "*.megatron.override_transformer_config.moe_router_load_balancing_type": "megappo uses Megatron's aux_loss when "
                                                                             "the model's router_aux_loss_coef > 0, "
                                                                             "none at 0: set that coefficient",
    **{f"*.megatron.override_transformer_config.{key}": "megappo has no router z-loss or aux-loss-free expert bias "
                                                        "(its routers train with the aux loss only): remove it"
       for key in ("moe_z_loss_coeff", "moe_router_enable_expert_bias", "moe_router_bias_update_rate")},
    "*.megatron.override_transformer_config.context_parallel_size": "give the role's megatron.context_parallel_size "
                                                                    "instead (megappo reads it as <role>.parallel.cp)",
    **{f"*.megatron.override_transformer_config.{key}": "megappo's context parallelism has one algorithm: "
                                                        "Megatron's 2 x cp load-balanced chunks with K/V all-gathered "
                                                        "in attention (docs/parallelism.md#context-parallelism); "
                                                        "remove it"
       for key in ("context_parallel_algo", "cp_partition_mode", "max_seqlen_per_dp_cp_rank")},
}

#: verl section prefix -> megappo's, tried when the key is in neither table
PREFIXES: dict[str, str] = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.ref.": "ref.",
    "actor_rollout_ref.rollout.engine_kwargs.sglang.": "rollout.sglang.",
    "actor_rollout_ref.model.": "model.",
    "critic.model.": "critic.",
    "reward_model.": "reward.",
    "trainer.": "run.",
}

#: sections only verl has (also inside megappo's: critic.model, critic.megatron): a key under them is verl's
#: even when no table names it
SECTIONS = ("actor_rollout_ref", "trainer", "custom_reward_function", "reward_model", "critic.model",
            "critic.megatron")


#: Hydra's GROUP@PACKAGE=OPTION (verl's current scripts: actor@actor_rollout_ref.actor=...)
HYDRA_GROUP = ("a Hydra config-group choice (GROUP@PACKAGE=OPTION) picks one of verl's config files, which megappo "
               "does not have; its defaults are the recipe's (--config-name: verl 0.9.1's): remove it and give the "
               "settings you need as KEY=VALUE")

NO_EQUIVALENT = ("megappo has no such key; remove it (megappo's sections are model, parallel, actor, critic, ref, "
                 "reward, algorithm, rollout, data, checkpoint, logging, run)")


def verl_equivalent(path: str, is_key: Callable[[str], bool]) -> Optional[tuple[Optional[str], str]]:
    """(megappo's key, None) for a renamed verl key `path` (dotted), (None, how megappo does it)
    when it has no such key, or None when `path` is not verl's.

    `is_key(dotted)` says whether megappo has a key; a prefix swap is offered only if it does.
    """
    if path in RENAMED:
        return RENAMED[path], None
    if "@" in path.split(".")[0]:
        return None, HYDRA_GROUP
    how = OTHERWISE.get(path) or _pattern(path, REFUSED_PATTERNS)
    if how:
        return None, how
    for verl, ours in PREFIXES.items():
        if path.startswith(verl) and is_key(ours + path[len(verl):]):
            return ours + path[len(verl):], None
    if any(path.startswith(section + ".") for section in SECTIONS):
        return None, NO_EQUIVALENT
    return None


def _pattern(path: str, patterns: dict[str, Any]) -> Any:
    """The value of the first of `patterns` that dotted `path` matches, or None."""
    parts = path.split(".")
    for pattern, why in patterns.items():
        if _match(pattern.split("."), parts):
            return why
    return None


def _match(want: list[str], parts: list[str]) -> bool:
    """Whether key parts match a pattern's; '*' stands for one or more parts."""
    if not want:
        return not parts
    if want[0] == "*":
        return any(_match(want[1:], parts[i:]) for i in range(1, len(parts) + 1))
    return bool(parts) and parts[0] == want[0] and _match(want[1:], parts[1:])


def spelling(value: Any) -> str:
    """A parsed YAML value as the tables spell it: lower case, `true`/`false`, `[a,b]` for lists."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(spelling(v) for v in value) + "]"
    return "null" if value is None else str(value).strip().lower()


def json_string(text: str) -> str:
    """`text` as a double-quoted YAML (and JSON) string."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def verl_reading(path: str, raw: str, value: Any, is_key: Callable[[str], bool]) -> Optional[tuple]:
    """How megappo reads verl's override `path=raw` (`value`: `raw` parsed as YAML):

    ('read', 'megappo.key=value')   a megappo override (the value respelled where megappo's differs);
    ('unused', why)                 megappo has no use for it, and says why at start-up;
    ('refused', how)                omitting it would change the training: an error that says how;
    None                            not a verl key (megappo's own, or a key neither has).
    """
    if path in ONE_OR_MORE and isinstance(value, str):
        return "read", f"{path}=[{json_string(value)}]"
    if is_key(path):
        return None
    spelled = spelling(value)
    switch = _pattern(path, FEATURE_SWITCHES)
    if switch:
        return ("unused", f"the feature is off ({path}={spelled}), as megappo has it") if spelled in switch[0] \
            else ("refused", switch[1])
    if any(_match(p.split("."), path.split(".")) for p in DTYPE_KEYS):
        if spelled in DTYPE_VALUES:
            return "read", f"model.dtype={DTYPE_VALUES[spelled]}"
        return "refused", f"write model.dtype=bfloat16 or float32 (verl's values megappo reads: {sorted(DTYPE_VALUES)})"
    why = UNUSED.get(path) or _pattern(path, UNUSED_PATTERNS) or UNUSED_VALUES.get(path, {}).get(spelled)
    if why:
        return "unused", why
    by_value = BY_VALUE.get(path, {}).get(spelled)
    if by_value:
        return "read", by_value
    if path in NEVER and (value is None or isinstance(value, int) and not isinstance(value, bool) and value <= 0):
        key, never = NEVER[path]
        return "read", f"{key}={never}"
    if path in SHIFTED and isinstance(value, int) and not isinstance(value, bool):
        key, shift = SHIFTED[path]
        return "read", f"{key}={max(value + shift, 0)}"
    if path in BY_VALUE or path in OTHERWISE:
        return "refused", OTHERWISE.get(path) or f"its values megappo reads are {sorted(BY_VALUE[path])}"
    how = None if path in RENAMED else _pattern(path, REFUSED_PATTERNS)
    if how:
        return "refused", how
    key = verl_equivalent(path, is_key)
    if key is None:
        return None
    if key[0] is None:
        return "refused", key[1]
    if path in VALUES:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        unknown = [v for v in items if spelling(v) not in VALUES[path]]
        if unknown:
            return "refused", (f"megappo has no {unknown} for it (verl's values it reads: {sorted(VALUES[path])}); "
                               f"write {key[0]} with megappo's values")
        mine = [VALUES[path][spelling(v)] for v in items]
        mine += [v for v in ADDED_ITEMS.get(path, ([], ""))[0] if v not in mine]
        return "read", f"{key[0]}=[{','.join(mine)}]" if isinstance(value, (list, tuple)) or path in ADDED_ITEMS \
            else f"{key[0]}={mine[0]}"
    if key[0] in ONE_OR_MORE and isinstance(value, str):
        return "read", f"{key[0]}=[{json_string(value)}]"
    return "read", f"{key[0]}={raw}"


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
