"""verl's key names: an override or recipe that uses one is refused with megappo's name for it."""

import pathlib

import pytest
import yaml

from megappo import verl_keys
from megappo.config import ConfigError
from megappo.recipe import _is_key, config_from_dict, load_config

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = str(REPO / "recipes/demo-cpu.yaml")

OVERRIDES = {  # a verl override -> the start of megappo's error
    "actor_rollout_ref.actor.optim.lr=1e-6": "that is verl's name; megappo's is 'actor.optim.lr'. Fix: write "
                                            "actor.optim.lr=1e-6.",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8": "megappo's is 'actor.micro_batch_size'. Fix: write "
                                                              "actor.micro_batch_size=8.",
    "actor_rollout_ref.rollout.n=8": "megappo's is 'rollout.n'. Fix: write rollout.n=8.",
    "actor_rollout_ref.model.path=/m": "megappo's is 'model.path'",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4": "megappo's is 'actor.parallel.tp'",
    "trainer.total_epochs=3": "megappo's is 'run.total_epochs'. Fix: write run.total_epochs=3.",
    "trainer.save_freq=10": "megappo's is 'checkpoint.save_every'",
    "data.max_response_length=512": "megappo's is 'rollout.max_new_tokens'",
    "critic.model.path=/c": "megappo's is 'critic.path'",
    "trainer.n_gpus_per_node=8": "megappo's is 'hardware.gpus_per_node'. Fix: write hardware.gpus_per_node=8.",
    "custom_reward_function.path=r.py": "write reward.functions=[path/to/file.py:function_name]",
    "actor_rollout_ref.model.use_fused_kernels=true": "that is a verl key; megappo has no such key; remove it",
    # verl's switch: the value changes with the key (full recomputation, uniform, 1 layer: megappo's full defaults)
    "actor_rollout_ref.model.enable_gradient_checkpointing=True": "that is verl's switch; megappo's setting is "
                                                                  "'actor.recompute.granularity'. Fix: write "
                                                                  "actor.recompute.granularity=full.",
    "critic.model.enable_gradient_checkpointing=false": "Fix: write critic.recompute.granularity=none.",
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=block":
        "megappo's is 'actor.recompute.method'. Fix: write actor.recompute.method=block.",
    "critic.megatron.override_transformer_config.recompute_num_layers=2": "megappo's is 'critic.recompute.num_layers'",
    "actor_rollout_ref.ref.megatron.override_transformer_config.recompute_granularity=full":
        "the reference model only runs forward passes",
}


@pytest.mark.parametrize("override", list(OVERRIDES))
def test_verl_override_names_megappos_key(override):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override])
    key = override.split("=")[0]
    assert str(e.value).startswith(f"unknown config key '{key}': ") and OVERRIDES[override] in str(e.value)
    assert "Fix:" in str(e.value)


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
    """The table names only keys megappo has, and docs/config.md lists every verl key it maps."""
    assert not [ours for ours in verl_keys.RENAMED.values() if not _is_key(ours)]
    for verl, ours in verl_keys.PREFIXES.items():
        assert _is_key(ours.rstrip(".")), ours
    assert not [k for k in verl_keys.RENAMED if _is_key(k)]  # a key megappo has needs no translation
    docs = (REPO / "docs/config.md").read_text()
    section = docs[docs.index("### Coming from verl"):]
    missing = [k for k in (*verl_keys.RENAMED, *verl_keys.OTHERWISE) if f"`{k}`" not in section]
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
def test_verls_newer_algorithm_keys_are_named_and_megappos_spelling_is_accepted(override):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=f"megappo's is '{NEW_ALGORITHM_KEYS[override]}'"):
        load_config(DEMO, [override])
    load_config(DEMO, [f"{NEW_ALGORITHM_KEYS[override]}={value}"])


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
