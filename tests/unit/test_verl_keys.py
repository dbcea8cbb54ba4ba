"""verl's key names: an override is read as megappo's key, named as unused or refused with the fix; a recipe
file in verl's layout is refused with megappo's name for each key."""

import pathlib

import pytest
import yaml

from megappo.config import ConfigError, verl_keys
from megappo.config.loading import _is_key, config_from_dict, load_config, read_config

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = str(REPO / "recipes/demo-cpu.yaml")

#: a verl override -> what megappo reads it as (dotted key: value in the Config)
READ = {
    "actor_rollout_ref.actor.optim.lr=1e-6": ("actor.optim.lr", 1e-6),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8": ("actor.micro_batch_size", 8),
    "actor_rollout_ref.rollout.n=8": ("rollout.n", 8),
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2": ("actor.parallel.tp", 2),
    "actor_rollout_ref.actor.megatron.context_parallel_size=2": ("actor.parallel.cp", 2),
    "critic.megatron.context_parallel_size=1": ("critic.parallel.cp", 1),
    "trainer.total_epochs=3": ("run.total_epochs", 3),
    "trainer.save_freq=10": ("checkpoint.save_every", 10),
    "trainer.save_freq=-1": ("checkpoint.save_every", -1),  # verl's "never": not even the last step
    "trainer.save_freq=0": ("checkpoint.save_every", -1),
    "trainer.test_freq=-1": ("run.val_every", 0),  # verl's "no validation during training"
    "trainer.test_freq=5": ("run.val_every", 5),
    "trainer.max_actor_ckpt_to_keep=null": ("checkpoint.keep_last", 0),  # verl's default: keep all
    "trainer.max_actor_ckpt_to_keep=3": ("checkpoint.keep_last", 3),
    "data.max_response_length=4": ("rollout.max_new_tokens", 4),
    "critic.model.path=/c": ("critic.path", "/c"),
    "trainer.n_gpus_per_node=2": ("hardware.gpus_per_node", 2),
    "trainer.critic_warmup=2": ("run.critic_warmup", 1),  # verl's N leaves N - 1 critic-only steps
    "trainer.critic_warmup=0": ("run.critic_warmup", 0),
    "trainer.val_before_train=False": ("run.val_before_train", False),
    # verl's switch: the value changes with the key (full recomputation, uniform, 1 layer: megappo's full defaults)
    "actor_rollout_ref.model.enable_gradient_checkpointing=True": ("actor.recompute.granularity", "full"),
    "critic.model.enable_gradient_checkpointing=false": ("critic.recompute.granularity", "none"),
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective": (
        "actor.recompute.granularity", "selective"),
    "data.truncation=left": ("data.long_prompt_policy", "truncate"),
    "data.truncation=error": ("data.long_prompt_policy", "error"),
    "data.filter_overlong_prompts=True": ("data.long_prompt_policy", "skip"),
    "trainer.resume_mode=disable": ("checkpoint.resume", "off"),
    "trainer.resume_mode=resume_path": ("checkpoint.resume", "must"),
    "trainer.rollout_data_dir=/tmp/rollouts": ("logging.rollout_dir", "/tmp/rollouts"),
    "trainer.validation_data_dir=/tmp/val": ("logging.validation_dir", "/tmp/val"),
    "trainer.val_only=True": ("run.val_only", True),
    "actor_rollout_ref.rollout.val_kwargs.top_p=0.7": ("rollout.val_top_p", 0.7),
    "actor_rollout_ref.rollout.val_kwargs.top_k=-1": ("rollout.val_top_k", -1),
    "trainer.logger=['console','wandb']": ("logging.sinks", ["console", "wandb", "jsonl"]),
    "trainer.logger=[console,file]": ("logging.sinks", ["console", "jsonl"]),
    "trainer.logger=[console,mlflow]": ("logging.sinks", ["console", "mlflow", "jsonl"]),
    "actor_rollout_ref.rollout.val_kwargs.do_sample=False": ("rollout.val_temperature", 0.0),
    "data.train_files=/data/train.parquet": ("data.train_files", ["/data/train.parquet"]),
    # DAPO's keys (verl <= 0.8 under reward_model, 0.9.1 under reward; Hydra's '+' adds a key verl's config lacks)
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=1": ("reward.overlong_buffer.len", 1),
    "++reward_model.reward_kwargs.overlong_buffer_cfg.enable=False": ("reward.overlong_buffer.enable", False),
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5": ("reward.overlong_buffer.penalty_factor", 0.5),
    "+reward.reward_kwargs.overlong_buffer_cfg.log=True": ("reward.overlong_buffer.log", True),
    "reward_model.overlong_buffer.len=1": ("reward.overlong_buffer.len", 1),  # recipe/dapo's own spelling
    # keys of verl's current example scripts (examples/**/*.sh at verl 1dda039; tools/verl_examples.py)
    "+actor_rollout_ref.actor.policy_loss.tau_pos=1.2": ("actor.tau_pos", 1.2),  # verl's SAPO reads the actor's
    "+actor_rollout_ref.actor.policy_loss.tau_neg=1.5": ("actor.tau_neg", 1.5),
    "+actor_rollout_ref.actor.megatron.override_transformer_config.sequence_parallel=True": (
        "parallel.sequence_parallel", True),
    "actor_rollout_ref.actor.megatron.router_replay.mode=R3": ("actor.moe_routing", "replay"),
    "actor_rollout_ref.actor.veomni.router_replay.mode=disabled": ("actor.moe_routing", "recompute"),
    "+reward_model.reward_kwargs.max_resp_len=3": ("rollout.max_new_tokens", 3),
    "+run.total_steps=5": ("run.total_steps", 5),  # '+' on a key megappo has: a plain override
    "++actor.clip_ratio_high=0.28": ("actor.clip_ratio_high", 0.28),
    # verl's Megatron backend: expert parallelism, its LoRA section, routing replay (R3: the engine's experts)
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2": ("actor.parallel.ep", 2),
    "actor_rollout_ref.model.lora.rank=8": ("actor.lora.rank", 8),
    "actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_proj]": ("actor.lora.target_modules",
                                                                             ["linear_qkv", "linear_proj"]),
    "actor_rollout_ref.model.target_modules=all-linear": ("actor.lora.target_modules", ["all-linear"]),
    "actor_rollout_ref.actor.router_replay.mode=disabled": ("actor.moe_routing", "recompute"),
    "actor_rollout_ref.actor.router_replay.mode=R3": ("actor.moe_routing", "replay"),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=2048": ("rollout.update_bucket_mb", 2048),
    "actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton": ("rollout.sglang.attention_backend",
                                                                                "triton"),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5": ("rollout.max_turns", 5),
    # verl's reward file (its function: verl's default compute_score), verl <= 0.8 and 0.9.1
    "custom_reward_function.path=my_reward.py": ("reward.functions", ["my_reward.py:compute_score"]),
    "reward.custom_reward_function.path=my_reward.py": ("reward.functions", ["my_reward.py:compute_score"]),
    # verl's SandboxFusion client, verl <= 0.8 and 0.9.1
    "reward_model.sandbox_fusion.url=http://localhost:8080": ("reward.sandbox.url", "http://localhost:8080"),
    "reward_model.sandbox_fusion.max_concurrent=8": ("reward.sandbox.max_concurrent", 8),
    "reward.sandbox_fusion.memory_limit_mb=512": ("reward.sandbox.memory_limit_mb", 512),
}


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("override", list(READ))
def test_verl_override_is_read_as_megappos_key(override):
    cfg, reading = read_config(DEMO, [override])
    key, value = READ[override]
    assert _get(cfg, key) == value
    verl = override.split("=")[0].lstrip("+")
    if not _is_key(verl):  # a verl key: the start-up line names it and megappo's key
        assert len(reading.lines()) == 1 and reading.lines()[0].startswith("verl keys read as megappo's: ")
        assert [ours.split("=")[0] for k, ours in reading.read if k.split("=")[0] == verl] == [key]


#: a verl override megappo has no use for -> words of its reason
UNUSED = {
    "trainer.device=cuda": "uses CUDA when it is there",
    "actor_rollout_ref.model.use_remove_padding=True": "packs sequences",
    "actor_rollout_ref.actor.use_dynamic_bsz=True": "packs sequences",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.5": None,  # read: rollout.sglang.mem_fraction_static
    "actor_rollout_ref.rollout.enable_chunked_prefill=True": "vLLM/SGLang server",
    "actor_rollout_ref.rollout.name=vllm": "no vLLM engine",
    "actor_rollout_ref.rollout.mode=async": "off-policy",
    "ray_init.num_cpus=8": "starts its ranks itself",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True": "not FSDP",
    "critic.model.fsdp_config.fsdp_size=-1": "not FSDP",
    "actor_rollout_ref.actor.megatron.param_offload=True": "no offload",
    "actor_rollout_ref.nccl_timeout=600": "parallel.timeout_minutes",
    "reward_model.reward_manager=dapo": "verl's dapo manager does",
    "reward.reward_manager.name=naive": "verl's naive manager does",
    "trainer.log_val_generations=10": "logging.samples",
    # keys of verl's default trainer config that its scripts pass as they are
    "actor_rollout_ref.rollout.calculate_log_probs=True": "always return the sampled tokens' log-probs",
    "trainer.default_hdfs_dir=null": "checkpoint.dir only",
    "trainer.max_critic_ckpt_to_keep=null": "checkpoint.keep_last",
    "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra']": "exact resume",
    "actor_rollout_ref.hybrid_engine=True": "rollout.engine and rollout.mode",
    "actor_rollout_ref.rollout.multi_turn.enable=False": "rollout.env=single_turn",
    "trainer.resume_from_path=null": "resume_mode=resume_path only",  # verl's default resume_mode=auto
    "data.reward_fn_key=data_source": "data_source",
    "actor_rollout_ref.model.use_liger=True": "Megatron-Core models",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton": "no fused kernel to switch",
    # keys of verl's example scripts (examples/*/*.sh at verl b178a3c)
    "critic.model.use_remove_padding=True": "critic.packing",
    "critic.forward_max_token_len_per_gpu=4096": "the critic's micro-batches",
    "actor_rollout_ref.actor.calculate_sum_pi_squared=True": "optimal_token_baseline",
    "actor_rollout_ref.actor.megatron.use_mbridge=True": "its own bridge",
    "critic.megatron.override_transformer_config.gradient_accumulation_fusion=True": "same math",
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32": "router in model.dtype",
    "actor_rollout_ref.ref.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=13": "evenly",
    "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True": "no offload",
    "actor_rollout_ref.model.trust_remote_code=True": "never runs code",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True": "no vLLM engine",
    "reward_model.rollout.gpu_memory_utilization=0.5": "as a Megatron model",
    "reward_model.use_reward_loop=True": "scores in the trainer",
    "actor_rollout_ref.model.lora.merge=False": "rollout.lora_sync",
    "actor_rollout_ref.rollout.multi_turn.format=hermes": "<tool_call> JSON",
    "custom_reward_function.path=null": "no reward file named",
    "custom_reward_function.name=compute_score": "with custom_reward_function.path only",
    # keys of verl's current example scripts (examples/**/*.sh at verl 1dda039; tools/verl_examples.py)
    "ray_kwargs.ray_init.runtime_env.py_executable=null": "starts its ranks itself",
    "model_engine=megatron": "trains with Megatron-Core",
    "model_engine=veomni": "trains with Megatron-Core",
    "actor_rollout_ref.rollout.ignore_eos=False": "the feature is off",
    "distillation.enabled=False": "the feature is off",
    "distillation.distillation_loss.topk=64": "on-policy distillation, which megappo does not have",
    "actor_rollout_ref.rollout.prompt_length=2048": "data.max_prompt_length",
    "actor_rollout_ref.actor.megatron.use_remove_padding=False": "packs sequences",
    "actor_rollout_ref.actor.checkpoint.strict=False": "its own checkpoints whole",
    "actor_rollout_ref.ref.entropy_checkpointing=True": "no entropy",
    "actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn=True": "same math",
    "actor_rollout_ref.actor.veomni.param_offload=True": "no offload",
    "actor_rollout_ref.ref.veomni.ulysses_parallel_size=2": "VeOmni",
    "actor_rollout_ref.actor.veomni.moe_implementation=fused": "same math",
    "critic.fsdp.param_offload=True": "not FSDP",
    "actor_rollout_ref.actor.model_engine=megatron": "trains with Megatron-Core",
    "actor_rollout_ref.actor.optim.optimizer=AdamW": "decoupled weight decay",
    "hydra.searchpath=[pkg://verl.trainer.config]": "Hydra's own settings",
    "reward_model.enable_resource_pool=True": "on the trainer's ranks",
    "trainer.tensorboard_dir=/tb": "run.output_dir/tensorboard",
}


@pytest.mark.parametrize("override", [o for o, why in UNUSED.items() if why])
def test_verl_override_megappo_has_no_use_for_is_named_with_why(override):
    cfg, reading = read_config(DEMO, [override])
    assert cfg == load_config(DEMO)  # nothing changed
    assert reading.read == [] and len(reading.unused) == 1
    (verl, why), = reading.unused
    assert verl == override.split("=")[0] and UNUSED[override] in why
    assert reading.lines() == [f"verl keys megappo does not use: {verl} ({why})"]


#: a verl override whose omission would change the training -> words of the error's fix
REFUSED = {
    "actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_algo=a2a": "one algorithm",
    "actor_rollout_ref.actor.router_replay.mode=R2": "verl's R2 it does not have",
    "actor_rollout_ref.model.override_config.rope_theta=1000000": "model.path's config.json",
    "critic.model.some_new_knob=1": "megappo has no such key; remove it",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml": "rollout.env_args.tools",
    "reward_model.sandbox_fusion.some_new_knob=1": "reward.sandbox.url, max_concurrent and memory_limit_mb",
    "actor_rollout_ref.actor.megatron.use_dist_checkpointing=True": "dist_checkpointing_path, which is not given",
    "critic.megatron.dist_checkpointing_prefix=module.": "save it again without the prefix",
    "actor_rollout_ref.rollout.over_sample_rate=0.1": "generates every sample to its end",
    "reward_model.reward_manager=prime": "write another manager's scoring as a reward function",
    "data.truncation=middle": "megappo keeps a prompt's end",
    "trainer.logger=[console,swanlab]": "megappo has no ['swanlab'] for it",
    "actor_rollout_ref.model.some_new_knob=1": "megappo has no such key; remove it",
    "actor_rollout_ref.ref.megatron.override_transformer_config.recompute_granularity=full":
        "the reference model only runs forward passes",
    "actor_rollout_ref.rollout.multi_turn.enable=True": "write rollout.env=tools",
    # keys of verl's current example scripts (examples/**/*.sh at verl 1dda039)
    "distillation.enabled=True": "no on-policy distillation",
    "actor_rollout_ref.rollout.ignore_eos=True": "a benchmark setting",
    "model_engine=mindspeed": "trains with Megatron-Core",
    "actor_rollout_ref.actor.optim.optimizer=muon": "AdamW only",
    "actor_rollout_ref.actor.optim.min_lr=1e-7": "actor.optim.min_lr_ratio=MIN_LR/LR",
    "actor@actor_rollout_ref.actor=megatron_lite_actor": "a Hydra config-group choice",
    "async_training.staleness_threshold=0.5": "rollout.mode=one_step_off or async",
    "actor_rollout_ref.actor.megatron.override_transformer_config.fp8=e4m3": "not FP8",
    "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent": "verl's agent loops are environments",
    "actor_rollout_ref.actor.megatron.router_replay.mode=R2": "verl's R2 it does not have",
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01": "router_aux_loss_coef",
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff=0.001": "no router z-loss",
    "actor_rollout_ref.actor.megatron.override_transformer_config.normalization=RMSNorm": "config.json",
    "actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_size=2": "<role>.parallel.cp",
}


@pytest.mark.parametrize("override", list(REFUSED))
def test_verl_override_that_would_change_the_training_is_refused_with_the_fix(override):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override, "run.total_steps=null"])
    assert f"'{override}' is a verl key megappo does not read as written. Fix: " in str(e.value)
    assert REFUSED[override] in str(e.value)


def test_every_override_megappo_cannot_read_is_in_one_error():
    """A verl script's command line gets each refusal and each unknown key at once, each with its fix."""
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_algo=a2a",
                           "actor.optim.lrr=1e-6",
                           "actor_rollout_ref.actor.optim.lr=1e-6", "critic.model.some_new_knob=1",
                           "actor_rollout_ref.model.override_config.rope_theta=1e6"])
    lines = str(e.value).splitlines()
    assert lines[0] == "4 overrides megappo cannot read as written (each line names its fix):"
    assert [line.split("'")[1] for line in lines[1:]] == [  # verl's keys first, then megappo's
        "actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_algo=a2a",
        "critic.model.some_new_knob=1",
        "actor_rollout_ref.model.override_config.rope_theta=1e6", "actor.optim.lrr"]
    assert all(line.startswith("  - ") and "Fix:" in line for line in lines[1:])
    assert "Did you mean 'actor.optim.lr'?" in lines[4]


def test_a_verl_reward_file_is_read_with_its_function_name():
    cfg, reading = read_config(DEMO, ["custom_reward_function.path=my_reward.py",
                                      "custom_reward_function.name=my_score"])
    assert cfg.reward.functions == ["my_reward.py:my_score"]  # the recipe's own functions are replaced, as in verl
    assert reading.read == [("custom_reward_function.path=my_reward.py, custom_reward_function.name=my_score",
                             'reward.functions=["my_reward.py:my_score"]')]
    assert reading.unused == []
    with pytest.raises(ConfigError, match="both set reward.functions"):
        load_config(DEMO, ["custom_reward_function.path=my_reward.py", "reward.functions=[exact_match]"])


def test_verls_megatron_lora_section_brings_its_default_alpha(tmp_path):
    """verl's Megatron LoRA section defaults alpha to 32 (megappo's and verl's FSDP lora_alpha: 16): a script that
    gives its lora.rank without alpha trains at verl's scale; an alpha given anywhere (either spelling, the
    recipe) stands."""
    cfg, reading = read_config(DEMO, ["actor_rollout_ref.model.lora.rank=8"])
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha) == (8, 32.0)
    assert ("actor_rollout_ref.model.lora.alpha (not given)",
            "actor.lora.alpha=32 (verl's default for its Megatron LoRA section)") in reading.read
    for given in (["actor_rollout_ref.model.lora.alpha=64"], ["actor.lora.alpha=64"]):
        assert load_config(DEMO, ["actor_rollout_ref.model.lora.rank=8", *given]).actor.lora.alpha == 64.0
    assert load_config(DEMO, ["actor_rollout_ref.model.lora_rank=8"]).actor.lora.alpha == 16.0  # FSDP's keys: 16
    recipe = yaml.safe_load(open(DEMO))
    recipe["actor"]["lora"] = {"alpha": 64}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert load_config(str(tmp_path / "r.yaml"), ["actor_rollout_ref.model.lora.rank=8"]).actor.lora.alpha == 64.0


def test_a_warmup_ratio_is_counted_when_the_run_knows_its_steps():
    """verl's lr_warmup_steps_ratio: int(ratio x the run's training steps), also when they come from the data
    (verl's PPO examples give no total_training_steps); verl's lr_warmup_steps > 0 wins, its -1 leaves the ratio."""
    cfg, reading = read_config(DEMO, ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05",
                                      "actor_rollout_ref.actor.optim.lr_warmup_steps=-1", "run.total_steps=null"])
    assert (cfg.actor.optim.warmup_steps_ratio, cfg.actor.optim.warmup_steps) == (0.05, 0)
    assert ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "actor.optim.warmup_steps_ratio") in reading.read
    assert cfg.actor.optim.warmup_for(500) == 25  # verl: int(0.05 x 500)
    both = load_config(DEMO, ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05",
                              "actor_rollout_ref.actor.optim.lr_warmup_steps=3"])
    assert both.actor.optim.warmup_for(500) == 3
    with pytest.raises(ConfigError, match=r"actor.optim.warmup_steps_ratio=1.5 must be in \[0, 1\]"):
        load_config(DEMO, ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.5"])


@pytest.mark.parametrize("overrides, names", [
    (["actor_rollout_ref.actor.clip_ratio_high=0.28", "actor.clip_ratio_high=0.3"],
     ("actor_rollout_ref.actor.clip_ratio_high=0.28", "actor.clip_ratio_high=0.3")),
    (["data.max_response_length=4", "+reward_model.reward_kwargs.max_resp_len=8"],
     ("data.max_response_length=4", "reward_model.reward_kwargs.max_resp_len=8")),
    (["actor_rollout_ref.actor.megatron.dtype=bfloat16", "model.dtype=float32"],
     ("actor_rollout_ref.actor.megatron.dtype=bfloat16", "model.dtype=float32")),
])
def test_one_setting_given_differently_in_two_spellings_is_an_error_naming_both(overrides, names):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, overrides)
    assert all(f"'{n}'" in str(e.value) for n in names) and "Fix: give it once: change " in str(e.value)


def test_the_fix_for_two_spellings_names_the_scripts_own_verl_key():
    """A verl script's key and megappo's spelling added after it: the fix changes the script's key; two verl keys:
    either of them."""
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["trainer.total_training_steps=500", "run.total_steps=3"])
    assert str(e.value).endswith("Fix: give it once: change trainer.total_training_steps=500 where the script sets "
                                 "it, and drop run.total_steps=3.")
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["run.total_steps=3", "trainer.total_training_steps=500"])  # either order
    assert "change trainer.total_training_steps=500 where the script sets it, and drop run.total_steps=3" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["data.max_response_length=4", "+reward_model.reward_kwargs.max_resp_len=8"])
    assert str(e.value).endswith("Fix: give it once: change data.max_response_length or "
                                 "reward_model.reward_kwargs.max_resp_len where the script sets them, to one value.")


def test_one_setting_given_alike_in_two_spellings_and_one_spelling_twice_are_fine():
    cfg = load_config(DEMO, ["data.max_response_length=4", "+reward_model.reward_kwargs.max_resp_len=4",
                             "actor.clip_ratio_high=0.3", "actor.clip_ratio_high=0.28"])
    assert (cfg.rollout.max_new_tokens, cfg.actor.clip_ratio_high) == (4, 0.28)


def test_verl_truncation_is_moot_when_verl_filters_long_prompts():
    cfg, reading = read_config(DEMO, ["data.truncation=error", "data.filter_overlong_prompts=true"])
    assert cfg.data.long_prompt_policy == "skip"
    assert [k for k, _ in reading.unused] == ["data.truncation"]


def test_verl_resume_from_path_is_read_in_resume_path_mode_and_moot_otherwise():
    cfg = load_config(DEMO, ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/step_00000040"])
    assert (cfg.checkpoint.resume, cfg.checkpoint.resume_from) == ("must", "/ckpt/step_00000040")
    # verl then ignores the path; without resume_mode too: verl's default is auto (megappo's checkpoint.resume=auto)
    for mode, resume in ((["trainer.resume_mode=auto"], "auto"), (["trainer.resume_mode=disable"], "off"), ([], "auto")):
        cfg, reading = read_config(DEMO, [*mode, "trainer.resume_from_path=/ckpt/step_1"])
        assert (cfg.checkpoint.resume, cfg.checkpoint.resume_from) == (resume, None)
        assert reading.unused == [("trainer.resume_from_path", "verl reads it with trainer.resume_mode=resume_path "
                                                               "only (its default is auto)")]


def test_verls_dist_checkpoint_is_read_with_its_switch_and_moot_without():
    """verl loads a role's dist_checkpointing_path only with its use_dist_checkpointing=True (default False)."""
    roles = {"actor": "actor_rollout_ref.actor.megatron", "ref": "actor_rollout_ref.ref.megatron",
             "critic": "critic.megatron"}
    on = [f"{verl}.{k}" for verl in roles.values() for k in ("use_dist_checkpointing=True", "dist_checkpointing_path=")]
    cfg, reading = read_config(DEMO, [f"{o}/ckpt/{o.split('.')[-2]}" if o.endswith("=") else o for o in on])
    assert (cfg.actor.dist_checkpoint, cfg.ref.dist_checkpoint, cfg.critic.dist_checkpoint) == (
        "/ckpt/megatron", "/ckpt/megatron", "/ckpt/megatron")
    assert sorted(k for k, _ in reading.unused) == sorted(f"{v}.use_dist_checkpointing" for v in roles.values())
    for switch in (["actor_rollout_ref.actor.megatron.use_dist_checkpointing=False"], []):
        cfg, reading = read_config(DEMO, [*switch, "actor_rollout_ref.actor.megatron.dist_checkpointing_path=/c"])
        assert cfg.actor.dist_checkpoint is None and cfg.ref.dist_checkpoint is None
        assert ("actor_rollout_ref.actor.megatron.dist_checkpointing_path",
                "verl reads it with use_dist_checkpointing=True only (its default is False)") in reading.unused
    # verl's reference without its own switch starts from model.path, megappo's from the actor's: refused
    actor_on = ["actor_rollout_ref.actor.megatron.use_dist_checkpointing=True",
                "actor_rollout_ref.actor.megatron.dist_checkpointing_path=/c"]
    for ref in ([], ["actor_rollout_ref.ref.megatron.use_dist_checkpointing=False",
                     "actor_rollout_ref.ref.megatron.dist_checkpointing_path=/c"]):
        with pytest.raises(ConfigError, match="starts verl's actor from that Megatron checkpoint but its reference "
                                              "from model.path .* Fix: give actor_rollout_ref.ref.megatron.use_dist_"
                                              "checkpointing=True actor_rollout_ref.ref.megatron.dist_checkpointing_"
                                              "path=/c as well"):
            load_config(DEMO, [*actor_on, *ref])
    # megappo's reference starts from the actor's checkpoint unless it names its own
    cfg = load_config(DEMO, ["actor.dist_checkpoint=/a"])
    assert (cfg.actor.dist_checkpoint, cfg.ref.dist_checkpoint) == ("/a", None)
    with pytest.raises(ConfigError, match="with actor.lora the reference policy is the actor's own weights"):
        load_config(DEMO, ["actor.dist_checkpoint=/a", "ref.dist_checkpoint=/b", "actor.lora.rank=4",
                           "actor.use_kl_loss=true"])


def test_verls_qat_switch_is_refused_when_on_and_named_when_off():
    for key in ("actor_rollout_ref.actor.fsdp_config.qat.enable", "actor_rollout_ref.actor.megatron.qat.enable",
                "actor_rollout_ref.actor.qat.enable"):
        with pytest.raises(ConfigError, match="megappo has no quantization-aware training"):
            load_config(DEMO, [f"{key}=True"])
        cfg, reading = read_config(DEMO, [f"{key}=False", "actor_rollout_ref.actor.fsdp_config.qat.mode=w4a16"])
        assert cfg == load_config(DEMO) and [k for k, _ in reading.unused] == [
            key, "actor_rollout_ref.actor.fsdp_config.qat.mode"]


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
                                 "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype",
                                 "critic.model.fsdp_config.mixed_precision.param_dtype",
                                 "actor_rollout_ref.actor.megatron.dtype", "critic.megatron.dtype"])
def test_verls_compute_dtype_is_model_dtype(key):
    for verl, ours in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp32", "float32")):
        cfg, reading = read_config(DEMO, [f"{key}={verl}"])
        assert cfg.model.dtype == ours and reading.read[0][1].startswith("model.dtype")
        assert reading.start_up_lines()[-1].startswith(f"this verl command line computes in model.dtype={ours} (set by "
                                                       f"{key}={verl}; verl computes in bf16)")
    with pytest.raises(ConfigError, match="model.dtype=float16 cannot train in megappo"):
        load_config(DEMO, [f"{key}=fp16"])


def test_a_verl_command_line_says_which_dtype_it_computes_in():
    _, reading = read_config(DEMO, ["actor_rollout_ref.actor.optim.lr=1e-6"])
    assert reading.start_up_lines()[-1] == ("this verl command line computes in model.dtype=float32 (megappo's "
                                            "default; verl computes in bf16; write model.dtype=bfloat16 to follow it)")
    gpu = str(REPO / "recipes/qwen2.5-7b-dapo-8gpu.yaml")
    _, reading = read_config(gpu, ["actor_rollout_ref.actor.optim.lr=1e-6"])
    assert reading.start_up_lines()[-1] == (f"this verl command line computes in model.dtype=bfloat16 ({gpu}'s; verl "
                                            "computes in bf16)")
    assert read_config(DEMO, ["actor.optim.lr=1e-6"])[1].start_up_lines() == []  # megappo's keys only: no line


def test_verls_token_budget_counts_ulysses_sequence_parallel_size():
    """verl's ppo_max_token_len_per_gpu is per GPU of a Ulysses group: its micro-batch holds it x sp tokens (the
    reference's sp is the actor's unless given)."""
    cfg, reading = read_config(DEMO, ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
                                      "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=700",
                                      "critic.ppo_max_token_len_per_gpu=800",
                                      "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                      "critic.ulysses_sequence_parallel_size=4"])
    assert (cfg.actor.max_tokens_per_micro_batch, cfg.ref.max_tokens_per_micro_batch,
            cfg.critic.max_tokens_per_micro_batch) == (1200, 1400, 3200)
    assert ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600", "actor.max_tokens_per_micro_batch=1200 (x "
            "ulysses_sequence_parallel_size=2, as verl counts it)") in reading.read
    cfg, _ = read_config(DEMO, ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
                                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"])
    assert cfg.actor.max_tokens_per_micro_batch == 600


def test_verls_unset_micro_batch_size_is_no_conflict():
    cfg, reading = read_config(DEMO, ["actor_rollout_ref.actor.ppo_micro_batch_size=null",
                                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                                      "actor_rollout_ref.ref.log_prob_micro_batch_size=null",
                                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                                      "critic.ppo_micro_batch_size=null", "critic.ppo_micro_batch_size_per_gpu=2"])
    assert (cfg.actor.micro_batch_size, cfg.ref.micro_batch_size, cfg.critic.micro_batch_size) == (8, 4, 2)
    assert [k for k, _ in reading.unused] == ["actor_rollout_ref.actor.ppo_micro_batch_size",
                                              "actor_rollout_ref.ref.log_prob_micro_batch_size",
                                              "critic.ppo_micro_batch_size"]


def test_verls_val_do_sample_is_no_conflict_with_a_temperature():
    """verl's vLLM and SGLang engines validate at val_kwargs.temperature whatever do_sample says; with no
    temperature, do_sample=false is greedy (verl's default val temperature 0)."""
    cfg, reading = read_config(DEMO, ["actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
                                      "actor_rollout_ref.rollout.val_kwargs.do_sample=False"])
    assert cfg.rollout.val_temperature == 0.6
    assert [k for k, _ in reading.unused] == ["actor_rollout_ref.rollout.val_kwargs.do_sample"]
    cfg, reading = read_config(DEMO, ["actor_rollout_ref.rollout.val_kwargs.do_sample=False"])
    assert cfg.rollout.val_temperature == 0.0 and reading.read == [
        ("actor_rollout_ref.rollout.val_kwargs.do_sample=False", "rollout.val_temperature=0")]


def test_misspelled_megappo_key_still_gets_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optim.lrr'. Did you mean 'actor.optim.lr'\?"):
        load_config(DEMO, ["actor.optim.lrr=1e-6"])


def test_verl_recipe_gets_every_translation_in_one_error(tmp_path):
    recipe = yaml.safe_load("""
data: {train_files: [train.parquet], train_batch_size: 256, max_response_length: 1024}
actor_rollout_ref:
  model: {path: Qwen/Qwen2.5-0.5B-Instruct}
  actor: {optim: {lr: 1.0e-6}, ppo_mini_batch_size: 64, use_kl_loss: true}
  rollout: {name: sglang, n: 5}
algorithm: {adv_estimator: grpo}
trainer: {total_epochs: 15, n_gpus_per_node: 8}
""")
    with pytest.raises(ConfigError) as e:
        config_from_dict(recipe)
    lines = str(e.value).splitlines()
    assert lines[0] == "the recipe uses 9 verl key(s) that megappo names differently or does not have:"
    assert lines[1:10] == ["  data.max_response_length -> rollout.max_new_tokens",
                          "  actor_rollout_ref.model.path -> model.path",
                          "  actor_rollout_ref.actor.optim.lr -> actor.optim.lr",
                          "  actor_rollout_ref.actor.ppo_mini_batch_size -> actor.ppo_mini_batch_size",
                          "  actor_rollout_ref.actor.use_kl_loss -> actor.use_kl_loss",
                          "  actor_rollout_ref.rollout.name -> rollout.engine",
                          "  actor_rollout_ref.rollout.n -> rollout.n",
                          "  trainer.total_epochs -> run.total_epochs",
                          "  trainer.n_gpus_per_node -> hardware.gpus_per_node"]
    assert lines[10].startswith("Fix: rename (or remove) them as shown")
    # renamed as the error says, the recipe loads
    fixed = {"model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
             "data": {"train_files": ["train.parquet"], "train_batch_size": 256},
             "rollout": {"max_new_tokens": 1024, "engine": "sglang", "n": 5},
             "actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 64, "use_kl_loss": True},
             "algorithm": {"adv_estimator": "grpo"}, "run": {"total_epochs": 15},
             "hardware": {"gpus_per_node": 8}}
    assert config_from_dict(fixed).rollout.n == 5


def test_every_mapped_key_exists_and_is_documented():
    """The table names only keys megappo has, and docs/config.md lists every verl key it reads, does not use
    or refuses."""
    assert not [ours for ours in verl_keys.RENAMED.values() if not _is_key(ours)]
    for verl, ours in verl_keys.PREFIXES.items():
        assert _is_key(ours.rstrip(".")), ours
    assert not [k for k in verl_keys.RENAMED if _is_key(k)]  # a key megappo has needs no translation
    docs = (REPO / "docs/config.md").read_text()
    section = docs[docs.index("### Coming from verl"):]
    tables = (verl_keys.RENAMED, verl_keys.OTHERWISE, verl_keys.BY_VALUE, verl_keys.VALUES,
              verl_keys.NEVER, verl_keys.MOOT, verl_keys.UNUSED, verl_keys.UNUSED_PATTERNS,
              verl_keys.FEATURE_SWITCHES, verl_keys.DTYPE_KEYS, verl_keys.TIMES_ULYSSES)
    missing = [k for table in tables for k in table if f"`{k}" not in section]
    missing += [f"{k}={v}" for k, values in verl_keys.UNUSED_VALUES.items() for v in values
                if f"`{k}={v}`" not in section]
    assert not missing, f"docs/config.md, 'Coming from verl', does not list {missing}"


def test_verl_recipe_with_gradient_checkpointing_gets_megappos_setting():
    recipe = {"model": {"path": "/m"}, "actor_rollout_ref": {"model": {"enable_gradient_checkpointing": True}},
              "critic": {"model": {"enable_gradient_checkpointing": True}}}
    with pytest.raises(ConfigError) as e:
        config_from_dict(recipe)
    assert "  actor_rollout_ref.model.enable_gradient_checkpointing: write actor.recompute.granularity=full" in str(e.value)
    assert "  critic.model.enable_gradient_checkpointing: write critic.recompute.granularity=full" in str(e.value)
    fixed = config_from_dict({"model": {"path": "/m"}, "actor": {"recompute": {"granularity": "full"}}})
    assert (fixed.actor.recompute.granularity, fixed.critic.recompute.granularity) == ("full", "none")


#: verl 0.9.1's keys of its newer algorithms (issue 36): the policy loss under the actor, rollout correction
#: and GDPO under algorithm (the same path in megappo, so accepted as written)
NEW_ALGORITHM_KEYS = {
    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo": "actor.policy_loss.loss_mode",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001": "actor.policy_loss.clip_cov_ratio",
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb=1.0": "actor.policy_loss.clip_cov_lb",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub=5.0": "actor.policy_loss.clip_cov_ub",
    "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.001": "actor.policy_loss.kl_cov_ratio",
    "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.1": "actor.policy_loss.ppo_kl_coef",
    "actor_rollout_ref.actor.policy_loss.dro_beta=0.1": "actor.policy_loss.dro_beta",
    "actor_rollout_ref.actor.tau_pos=1.0": "actor.tau_pos",
    "actor_rollout_ref.actor.tau_neg=1.05": "actor.tau_neg",
}


@pytest.mark.parametrize("override", list(NEW_ALGORITHM_KEYS))
def test_verls_newer_algorithm_keys_are_read_and_megappos_spelling_is_accepted(override):
    key, value = override.split("=")
    cfg, reading = read_config(DEMO, [override])
    assert reading.read == [(key, NEW_ALGORITHM_KEYS[override])]
    assert cfg == load_config(DEMO, [f"{NEW_ALGORITHM_KEYS[override]}={value}"])


def test_verls_rollout_correction_and_gdpo_keys_are_megappos():
    cfg = load_config(DEMO, [
        "algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true", "algorithm.rollout_correction.rollout_rs=seq_sum_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0", "algorithm.rollout_correction.bypass_mode=false",
        "algorithm.rollout_correction.loss_type=ppo_clip", "algorithm.adv_estimator=gdpo", "rollout.n=2",
        "reward.functions=[digit_successor,exact_match]", "algorithm.gdpo_reward_keys=[digit_successor,exact_match]",
        "algorithm.gdpo_reward_weights=[1.0,0.5]"])
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_is_batch_normalize) == (
        "sequence", "0.5_2.0", "seq_sum_k1", True)



def test_a_check_of_the_built_config_names_the_verl_override_that_set_its_key():
    """'hardware.nodes=16 needs ...' where the script wrote trainer.nnodes=16: the error says so; megappo's own
    spelling needs no note."""
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10"])
    assert "actor.max_tokens_per_micro_batch comes from the command line's " \
           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10. Fix: set actor.max_tokens_per_micro_batch >= " \
           in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["actor.max_tokens_per_micro_batch=10"])
    assert "comes from the command line" not in str(e.value)
