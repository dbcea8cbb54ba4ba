"""Recipes: typed loading, overrides, and errors that name the key and the fix."""

import pytest

from megappo.config import Config, ConfigError, config_from_dict, dump_config, load_config

MIN = {"model": {"hf_config": {"architectures": ["LlamaForCausalLM"]}}}


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_round_trip(tmp_path):
    cfg = config_from_dict(MIN)
    assert cfg.parallel.tp == 1 and cfg.algorithm.adv_estimator == "gae" and cfg.use_critic
    dump_config(cfg, str(tmp_path / "c.yaml"))
    assert load_config(str(tmp_path / "c.yaml")) == cfg


def test_overrides_are_typed(tmp_path):
    path = write(tmp_path, "model:\n  path: /m\n")
    cfg = load_config(path, ["parallel.tp=2", "actor.optim.lr=3e-6", "data.train_files=[a.jsonl,b.jsonl]",
                             "model.tokenizer=null", "actor.use_kl_loss=true", "rollout.sglang.chunked_prefill_size=4096"])
    assert cfg.parallel.tp == 2 and cfg.actor.optim.lr == 3e-6 and cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.model.tokenizer is None and cfg.actor.use_kl_loss is True
    assert cfg.rollout.sglang == {"chunked_prefill_size": 4096}
    assert cfg.needs_ref


def test_unknown_keys_list_valid_ones_and_suggest():
    with pytest.raises(ConfigError, match="unknown config key 'paralel'. Did you mean 'parallel'"):
        config_from_dict({**MIN, "paralel": {}})
    with pytest.raises(ConfigError, match="unknown config key 'parallel.tpp'. Did you mean 'parallel.tp'.*'vpp'"):
        config_from_dict({**MIN, "parallel": {"tpp": 2}})
    with pytest.raises(ConfigError, match="unknown config key 'actor.optim.learning_rate'"):
        load_config(None, ["model.path=/m", "actor.optim.learning_rate=1"])


def test_wrong_types_and_choices():
    with pytest.raises(ConfigError, match="parallel.tp: expected an integer, got 'two'"):
        config_from_dict({**MIN, "parallel": {"tp": "two"}})
    with pytest.raises(ConfigError, match="actor.use_kl_loss: expected true/false, got 1"):
        config_from_dict({**MIN, "actor": {"use_kl_loss": 1}})
    with pytest.raises(ConfigError, match="algorithm.adv_estimator: 'ppo' is not one of \\['gae', 'grpo'"):
        config_from_dict({**MIN, "algorithm": {"adv_estimator": "ppo"}})
    with pytest.raises(ConfigError, match="actor.kl_loss_type: unknown KL estimator 'k4'"):
        config_from_dict({**MIN, "actor": {"kl_loss_type": "k4"}})


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "model:\n  path: /m\nparallel:\n  tp: [1,\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line"):
        load_config(path)
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        load_config(None, ["parallel.tp"])


@pytest.mark.parametrize("data,needle", [
    ({"algorithm": {"adv_estimator": "grpo"}}, "set rollout.n >= 2"),
    ({"critic": {"enable": False}}, "gae needs a critic"),
    ({"actor": {"clip_ratio_c": 1.0}}, "clip_ratio_c=1.0 must be > 1"),
    ({"data": {"train_batch_size": 6}, "actor": {"ppo_mini_batch_size": 4}}, "not divisible by actor.ppo_mini_batch_size=4"),
    ({"actor": {"ppo_mini_batch_size": 3, "micro_batch_size": 2}, "data": {"train_batch_size": 3},
      "critic": {"ppo_mini_batch_size": 3, "micro_batch_size": 3}}, "actor: a mini-batch of 3 sequences"),
    ({"parallel": {"vpp": 2}}, "parallel.vpp needs parallel.pp >= 2"),
    ({"algorithm": {"gamma": 1.5}}, "algorithm.gamma=1.5 must be in \\[0, 1\\]"),
])
def test_inconsistent_values(data, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_dict({**MIN, **data})


def test_world_size_checks():
    cfg = config_from_dict({**MIN, "parallel": {"tp": 2, "pp": 2}})
    assert cfg.dp_size(8) == 2
    with pytest.raises(ConfigError, match="world size 6 is not a multiple of parallel.tp\\*parallel.pp = 2\\*2"):
        cfg.validate_world(6)


def test_model_section_required():
    with pytest.raises(ConfigError, match="no 'model' section"):
        config_from_dict({})
    with pytest.raises(ConfigError, match="set model.path"):
        config_from_dict({"model": {}})
