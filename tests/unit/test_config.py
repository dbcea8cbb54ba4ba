"""Recipes: typed loading, overrides, and errors that name the key and the fix."""

import dataclasses
import pathlib
import re
import sys

import pytest

from megappo import config as config_module
from megappo.config import field_docs
from megappo.config import (ActorConfig, Config, ConfigError, OptimConfig, ParallelConfig, config_from_dict, dump_config,
                            load_config)

MIN = {"model": {"hf_config": {"architectures": ["LlamaForCausalLM"]}}}
REPO = pathlib.Path(__file__).resolve().parents[2]


def build(**sections):
    return config_from_dict({**MIN, **sections})


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_load():
    cfg = build()
    assert cfg.parallel.tp == 1 and cfg.parallel.pp == 1 and cfg.parallel.vpp is None
    assert cfg.actor.ppo_mini_batch_size == 256 and cfg.data.train_batch_size == 1024
    assert cfg.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5 and cfg.actor.optim.betas == (0.9, 0.999)
    assert cfg.algorithm.adv_estimator == "gae" and cfg.use_critic and not cfg.needs_ref
    assert cfg.roles == ("actor", "critic") and cfg.logging.sinks == ["console", "jsonl"]
    assert cfg.actor.clip_low == cfg.actor.clip_high == 0.2
    assert cfg.ref_micro_batch_size == 4 and cfg.checkpoint_dir == "runs/default/checkpoints"
    assert cfg.updates_per_step("actor") == 4 and not cfg.checkpoint.save_hf_at_end
    assert load_config(None, ["model.path=/m"]).model.tokenizer_path == "/m"


def test_yaml_round_trip(tmp_path):
    overrides = ["actor.optim.betas=[0.8,0.99]", "rollout.stop_token_ids=[7,8]"]
    cfg = load_config(str(REPO / "recipes/demo-cpu.yaml"), overrides)
    path = str(tmp_path / "resolved.yaml")
    dump_config(cfg, path)
    again = load_config(path)
    assert again == cfg and again.actor.optim.betas == (0.8, 0.99) and again.to_dict() == cfg.to_dict()
    assert config_from_dict(cfg.to_dict()) == cfg


def test_overrides_are_typed(tmp_path):
    path = write(tmp_path, "model:\n  path: /m\n  tokenizer: /tok\n")
    cfg = load_config(path, ["parallel.tp=2", "actor.optim.lr=3e-6", "actor.clip_ratio_c=4",
                             "data.train_files=[a.jsonl,b.jsonl]", "model.tokenizer=null", "actor.use_kl_loss=true",
                             "rollout.sglang.chunked_prefill_size=4096", "run.output_dir=runs/x"])
    assert cfg.parallel.tp == 2 and type(cfg.parallel.tp) is int
    assert cfg.actor.optim.lr == 3e-6 and cfg.actor.clip_ratio_c == 4.0 and type(cfg.actor.clip_ratio_c) is float
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"] and cfg.model.tokenizer is None
    assert cfg.actor.use_kl_loss is True and cfg.needs_ref and cfg.roles == ("actor", "critic", "ref")
    assert cfg.rollout.sglang == {"chunked_prefill_size": 4096} and cfg.run.output_dir == "runs/x"
    # YAML 1.1 reads a bare off as false: a choice spelled 'off' is still what was meant
    assert load_config(path, ["checkpoint.resume=off"]).checkpoint.resume == "off"
    with pytest.raises(ConfigError, match="False is not one of"):
        load_config(path, ["rollout.engine=off"])
    nested = load_config(None, [*(f"model.{kv}" for kv in ("hf_config.rope_scaling.factor=2.0", "hf_config.a=1"))])
    assert nested.model.hf_config == {"rope_scaling": {"factor": 2.0}, "a": 1}


def test_sections_are_frozen_and_validated_on_construction():
    with pytest.raises(dataclasses.FrozenInstanceError):
        build().parallel.tp = 2
    with pytest.raises(ConfigError, match="tp: expected int, got 'two'"):
        ParallelConfig(tp="two")
    with pytest.raises(ConfigError, match="lr=0.0 must be > 0"):
        OptimConfig(lr=0)
    assert ActorConfig(optim={"lr": 2e-6}).optim == OptimConfig(lr=2e-6)


def test_unknown_keys_list_valid_ones_and_suggest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'paralel'. Did you mean 'parallel'\?.*'rollout'"):
        build(paralel={})
    with pytest.raises(ConfigError, match=r"unknown config key 'parallel.tpp'. Did you mean 'parallel.tp'\?.*'vpp'"):
        build(parallel={"tpp": 2})
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optim.lrr'. Did you mean 'actor.optim.lr'.*Valid "
                                          r"keys: \['lr'"):
        load_config(None, ["model.path=/m", "actor.optim.lrr=1"])
    with pytest.raises(ConfigError, match="unknown config key 'zzz'. Fix: remove it or use one of the valid keys"):
        load_config(write(tmp_path, "model: {path: /m}\nzzz: 1\n"))
    with pytest.raises(ConfigError, match="'parallel.tp' is a single value \\(int\\), not a section"):
        load_config(None, ["model.path=/m", "parallel.tp.x=1"])


@pytest.mark.parametrize("sections,needle", [
    ({"parallel": {"tp": "two"}}, r"parallel.tp: expected int, got 'two' \(str\). Fix: write e.g. parallel.tp=2"),
    ({"parallel": {"tp": 2.0}}, r"parallel.tp: expected int, got 2.0 \(float\)"),
    ({"actor": {"use_kl_loss": 1}}, r"actor.use_kl_loss: expected bool, got 1 \(int\)"),
    ({"actor": {"use_kl_loss": "true"}}, r"actor.use_kl_loss: expected bool, got 'true' \(str\)"),
    ({"actor": {"optim": {"lr": "fast"}}}, r"actor.optim.lr: expected float, got 'fast'"),
    ({"actor": {"optim": {"betas": [0.9]}}}, r"actor.optim.betas: expected tuple\[float, float\]"),
    ({"run": {"output_dir": 7}}, r"run.output_dir: expected str, got 7 \(int\). Fix: quote it: run.output_dir='7'"),
    ({"run": {"total_steps": "ten"}}, r"run.total_steps: expected int or null"),
    ({"data": {"train_files": "a.jsonl"}},
     r"data.train_files: expected list\[str\], got 'a.jsonl' \(str\). Fix: write e.g. data.train_files=\[a,b\]"),
    ({"reward": {"function_weights": [1, "x"]}}, r"reward.function_weights\[1\]: expected float"),
    ({"rollout": {"sglang": [1]}}, r"rollout.sglang: expected dict\[str, Any\]"),
    ({"critic": 3}, r"critic: expected a mapping, got 3"),
])
def test_wrong_types_name_the_path(sections, needle):
    with pytest.raises(ConfigError, match=needle):
        build(**sections)


def test_literal_errors_list_the_choices():
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator: 'grpoo' is not one of \['gae', 'grpo', "
                                          r"'grpo_vectorized', 'rloo'.*"
                                          r"Did you mean 'grpo'\?"):
        build(algorithm={"adv_estimator": "grpoo"})
    with pytest.raises(ConfigError, match=r"actor.kl_loss_type: 'k4' is not one of \['kl', 'k1'.*'low_var_kl\+'"):
        build(actor={"kl_loss_type": "k4"})
    with pytest.raises(ConfigError, match=r"logging.sinks\[1\]: 'tb' is not one of \['console', 'jsonl'"):
        build(logging={"sinks": ["console", "tb"]})
    assert build(actor={"kl_loss_type": "k3+"}).actor.kl_loss_type == "k3+"


def test_recipe_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe '.*bad.yaml' is not valid YAML at line 5, column 6: mapping "
                                          r"values are not allowed here. Fix: correct the YAML there"):
        load_config(write(tmp_path, "model:\n  path: /m\nparallel:\n  tp: 2\n   pp: 3\n", "bad.yaml"))
    with pytest.raises(ConfigError, match=r"bad.yaml' is not valid YAML at line 5, column 1"):  # an unclosed '['
        load_config(write(tmp_path, "model:\n  path: /m\nparallel:\n  tp: [1,\n", "bad.yaml"))
    with pytest.raises(ConfigError, match="must be a mapping of sections .* got a list"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="cannot read recipe '/nonexistent.yaml'"):
        load_config("/nonexistent.yaml")
    with pytest.raises(ConfigError, match="no 'model' section"):
        load_config(write(tmp_path, ""))


@pytest.mark.parametrize("override,needle", [
    ("parallel.tp", "override 'parallel.tp' is not KEY=VALUE. Fix: write it like parallel.tp=2"),
    ("=2", "is not KEY=VALUE"),
    ("parallel..tp=2", "is not KEY=VALUE"),
    ("model.path=", "has no value. Fix: write model.path=null"),
])
def test_bad_overrides(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, ["model.path=/m", override])


def test_validate_world():
    cfg = build(parallel={"tp": 2, "pp": 2}, data={"train_batch_size": 16},
                actor={"ppo_mini_batch_size": 8, "micro_batch_size": 2, "packing": False},
                critic={"ppo_mini_batch_size": 8, "micro_batch_size": 1, "packing": False})
    assert cfg.dp_size(8) == 2 and cfg.dp_size(16) == 4
    with pytest.raises(ConfigError, match=r"world size 6 is not a multiple of parallel.tp\*parallel.pp = 2\*2. "
                                          r"Fix: launch a multiple of 4 ranks"):
        cfg.validate_world(6)
    with pytest.raises(ConfigError, match=r"actor: a mini-batch of 8 sequences does not split over dp=8 replicas "
                                          r"in micro-batches of 2. Fix: make actor.micro_batch_size x 8 divide 8"):
        cfg.validate_world(32)
    # packed micro-batches are sized by tokens: any split over replicas is fine
    config_from_dict({**cfg.to_dict(), "actor": {**cfg.to_dict()["actor"], "packing": True},
                      "critic": {**cfg.to_dict()["critic"], "packing": True}}).validate_world(32)
    with pytest.raises(ConfigError, match="world size 0 must be >= 1"):
        cfg.validate_world(0)
    forward_only = build(data={"train_batch_size": 8}, actor={"ppo_mini_batch_size": 8, "micro_batch_size": 2,
                                                              "use_kl_loss": True},
                         critic={"ppo_mini_batch_size": 8}, ref={"micro_batch_size": 8, "packing": False},
                         reward={"model_path": "/rm", "micro_batch_size": 8, "packing": False})
    forward_only.validate_world(1)
    with pytest.raises(ConfigError, match="ref: the batch of 8 sequences does not split over dp=2 replicas"):
        forward_only.validate_world(2)
    with pytest.raises(ConfigError, match="reward: the batch of 8 sequences does not split over dp=2 replicas"):
        config_from_dict({**forward_only.to_dict(), "ref": {"packing": False}}).validate_world(2)


def test_training_requirements_are_a_method():
    cfg = build()  # valid for conversion: no prompts, no reward
    with pytest.raises(ConfigError, match="data.train_files and data.builtin are both empty"):
        cfg.require_training_data()
    with pytest.raises(ConfigError, match="no reward: reward.functions is empty"):
        build(data={"train_files": ["t.jsonl"]}).require_training_data()
    with pytest.raises(ConfigError, match="ask for validation, but data.val_files is empty"):
        build(data={"train_files": ["t.jsonl"]}, reward={"functions": ["gsm8k"]},
              run={"val_every": 5}).require_training_data()
    build(data={"builtin": "digit_successor"}, reward={"functions": ["digit_successor"]},
          run={"val_before_train": True}).require_training_data()
    with pytest.raises(ConfigError, match=r"run.val_only=true validates, but data.val_files is empty\. Fix: set "
                                          r"data.val_files=\[val.jsonl\]"):
        build(data={"train_files": ["t.jsonl"]}, reward={"functions": ["gsm8k"]},
              run={"val_only": True}).require_training_data()


GRPO = {"algorithm": {"adv_estimator": "grpo"}, "rollout": {"n": 4}}


@pytest.mark.parametrize("sections,needle", [
    ({"model": {}}, "model.path and model.hf_config are both unset. Fix: set model.path="),
    ({"model": {"path": "/m", "hf_config": {}}}, "model.path and model.hf_config are both set"),
    ({"parallel": {"tp": 0}}, "parallel.tp=0 must be >= 1. Fix: set parallel.tp=1 or more"),
    ({"parallel": {"vpp": 2}}, "parallel.vpp=2 needs parallel.pp > 1 .* Fix: set parallel.vpp=null"),
    ({"parallel": {"sequence_parallel": True}}, "parallel.sequence_parallel needs parallel.tp > 1"),
    ({"actor": {"clip_ratio_c": 1.0}}, "actor.clip_ratio_c=1.0 must be > 1 .* Fix: e.g. actor.clip_ratio_c=3.0"),
    ({"actor": {"clip_ratio_low": -1}}, "actor.clip_ratio_low=-1.0 must be > 0"),
    ({"actor": {"clip_ratio_high": 0}}, "actor.clip_ratio_high=0.0 must be > 0"),
    ({"actor": {"optim": {"lr": 0}}}, "actor.optim.lr=0.0 must be > 0"),
    ({"critic": {"optim": {"betas": [0.9, 1.0]}}}, r"critic.optim.betas=\[0.9, 1.0\] must be in \[0, 1\)"),
    ({"critic": {"cliprange_value": -1}}, "critic.cliprange_value=-1.0 must be > 0"),
    ({"ref": {"micro_batch_size": 0}}, "ref.micro_batch_size=0 must be >= 1"),
    ({"reward": {"functions": ["gsm8k"], "function_weights": [1, 2]}},
     "reward.function_weights has 2 entries for 1 reward.functions"),
    ({"algorithm": {"gamma": 1.5}}, r"algorithm.gamma=1.5 must be in \[0, 1\]"),
    ({"algorithm": {"lam": -0.1}}, r"algorithm.lam=-0.1 must be in \[0, 1\]"),
    ({"algorithm": {"kl_ctrl": {"type": "adaptive"}}}, "Fix: set algorithm.use_kl_in_reward=true or "
                                                       "algorithm.kl_ctrl.type=fixed"),
    ({"algorithm": {"kl_ctrl": {"horizon": 0}}}, "algorithm.kl_ctrl.horizon=0 must be >= 1"),
    ({"rollout": {"top_p": 0}}, r"rollout.top_p=0.0 must be in \(0, 1\]"),
    ({"rollout": {"top_k": 0}}, "rollout.top_k=0 must be -1 .off. or >= 1"),
    ({"rollout": {"val_top_p": 1.5}}, r"rollout.val_top_p=1.5 must be in \(0, 1\]"),
    ({"rollout": {"val_top_k": 0}}, "rollout.val_top_k=0 must be -1 .off. or >= 1"),
    ({"checkpoint": {"resume_from": 250, "resume": "off"}}, r"checkpoint.resume_from=250 names a checkpoint to "
                                                            r"resume from, but checkpoint.resume=off starts fresh\. Fix:"),
    ({"reward": {"num_workers": -1}}, "reward.num_workers=-1 must be >= 0"),
    ({"rollout": {"sync_mode": "disk"}}, "rollout.sync_mode=disk needs rollout.engine=sglang"),
    ({"data": {"builtin": "x", "train_files": ["a"]}}, "data.builtin and data.train_files are both set"),
    ({"data": {"builtin": "x", "builtin_size": 10}}, "data.builtin_size=10 is smaller than data.train_batch_size=1024"),
    ({"data": {"apply_chat_template": False, "apply_chat_template_kwargs": {"enable_thinking": False}}},
     r"data.apply_chat_template_kwargs=\{'enable_thinking': False\} are the chat template's, but "
     r"data.apply_chat_template=false renders no template"),
    ({"data": {"apply_chat_template_kwargs": {"tokenize": False}}},
     r"data.apply_chat_template_kwargs sets \['tokenize'\], which megappo sets itself"),
    ({"algorithm": {"adv_estimator": "grpo"}}, "compares samples of the same prompt, but rollout.n=1. Fix: set "
                                               "rollout.n >= 2"),
    ({"algorithm": {"adv_estimator": "rloo"}}, "rollout.n >= 2"),
    ({"critic": {"enable": False}}, "gae needs a critic, but critic.enable=false. Fix: set critic.enable=null"),
    ({"data": {"train_batch_size": 6}, "actor": {"ppo_mini_batch_size": 4}},
     "data.train_batch_size=6 is not divisible by actor.ppo_mini_batch_size=4"),
    ({"data": {"train_batch_size": 8}, "actor": {"ppo_mini_batch_size": 8}, "critic": {"ppo_mini_batch_size": 3}},
     "not divisible by critic.ppo_mini_batch_size=3"),
    ({**GRPO, "actor": {"ppo_mini_batch_size": 256, "micro_batch_size": 3, "packing": False}},
     r"actor: a mini-batch of 1024 sequences \(actor.ppo_mini_batch_size=256 x rollout.n=4\) is not divisible by "
     r"actor.micro_batch_size=3"),
    ({"checkpoint": {"save_every": -2}}, "checkpoint.save_every=-2 must be >= -1"),
    ({"checkpoint": {"save_every": -1}, "run": {"max_restarts": 2}},
     "run.max_restarts=2 restarts a run from its latest checkpoint, but checkpoint.save_every=-1 saves none. Fix: "),
    ({"run": {"total_steps": 0}}, "run.total_steps=0 must be >= 1"),
    ({"actor": {"moe_routing": "replay", "recompute": {"granularity": "full"}}},
     "would route again in the backward with the trainer's own routers. Fix: set actor.recompute.granularity=none"),
    ({"actor": {"moe_routing": "replay"}, "rollout": {"env": "lookup"}},
     "multi-turn episodes .rollout.env=lookup. have no single record yet. Fix: set actor.moe_routing=recompute"),
])
def test_inconsistent_values(sections, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_dict({**MIN, **sections})


def test_context_parallel_per_role_and_its_refusals():
    cfg = build(parallel={"cp": 2}, critic={"parallel": {"cp": 4}}, actor={"use_kl_loss": True})
    assert [cfg.context_parallel(r) for r in ("actor", "critic", "ref")] == [2, 4, 2]
    assert cfg.dp_size(8, "actor") == 4 and cfg.dp_size(8, "critic") == 2 and cfg.min_world_size == 4
    with pytest.raises(ConfigError, match=r"world size 6 is not a multiple of critic's tp\*pp\*cp = 1\*1\*4"):
        cfg.validate_world(6)
    with pytest.raises(ConfigError, match=r"actor.parallel.cp=2 splits packed sequences, but actor's passes are padded "
                                          r"\(actor.packing=false\). Fix: set actor.packing=true"):
        build(actor={"parallel": {"cp": 2}, "packing": False})
    with pytest.raises(ConfigError, match=r"parallel.cp=2 runs in megappo's packed attention.*Fix: set "
                                          r"model.layer_spec=local"):
        build(parallel={"cp": 2}, model={**MIN["model"], "layer_spec": "te"})
    with pytest.raises(ConfigError, match=r"parallel.cp=2 with expert parallelism \(ep=2\) is not supported yet. Fix:"):
        build(parallel={"cp": 2, "ep": 2})
    with pytest.raises(ConfigError, match=r"cp"):
        build(parallel={"cp": 0})


def test_per_role_layouts():
    cfg = build(parallel={"tp": 2, "pp": 2, "vpp": 2}, critic={"parallel": {"pp": 1}}, ref={"parallel": {"tp": 1}},
                actor={"use_kl_loss": True})
    assert cfg.layout("actor") == (2, 2, 2)  # the shared layout
    assert cfg.layout("critic") == (2, 1, None)  # own pp: the shared vpp does not apply
    assert cfg.layout("ref") == (1, 2, 2)  # own tp, shared pp and vpp
    assert cfg.model_roles == ("actor", "critic", "ref") and cfg.dp_size(8, "critic") == 4
    assert cfg.min_world_size == 4 and build(parallel={"tp": 2}, critic={"parallel": {"pp": 3}}).min_world_size == 6
    with pytest.raises(ConfigError, match=r"world size 4 is not a multiple of critic's tp\*pp = 8\*1. Fix: change "
                                          r"critic.parallel.tp/pp"):
        build(parallel={"tp": 2}, critic={"parallel": {"tp": 8}}).validate_world(4)
    with pytest.raises(ConfigError, match=r"critic.parallel.vpp=2 needs a pipeline \(pp > 1\), but critic's pp is 1"):
        build(critic={"parallel": {"vpp": 2}})
    with pytest.raises(ConfigError, match="sequence_parallel needs tp > 1 for every role, but critic's tp is 1"):
        build(parallel={"tp": 2, "sequence_parallel": True}, critic={"parallel": {"tp": 1}})
    # each role's batch split uses its own data-parallel size
    small = dict(data={"train_batch_size": 8}, actor={"ppo_mini_batch_size": 8, "micro_batch_size": 4, "packing": False},
                 critic={"ppo_mini_batch_size": 8, "micro_batch_size": 4, "packing": False})
    build(parallel={"tp": 2}, **small).validate_world(4)  # dp=2: 8 = 2 x 4
    with pytest.raises(ConfigError, match="critic: a mini-batch of 8 sequences does not split over dp=4 replicas"):
        build(parallel={"tp": 2}, **{**small, "critic": {**small["critic"], "parallel": {"tp": 1}}}).validate_world(4)


def test_consistent_variants_pass():
    cfg = build(**GRPO, critic={"ppo_mini_batch_size": 3})  # the critic is off for grpo: its sizes are not checked
    assert not cfg.use_critic and cfg.roles == ("actor",) and cfg.algorithm.grouped
    assert build(algorithm={"use_kl_in_reward": True, "kl_ctrl": {"type": "adaptive"}}).needs_ref
    assert build(parallel={"tp": 2, "pp": 2, "vpp": 2, "sequence_parallel": True}).parallel.vpp == 2


def _sections(cls=Config):
    """Every section class reachable from `cls`, `cls` included."""
    found = [cls]
    for f in dataclasses.fields(cls):
        hint = config_module._options(config_module._hints(cls)[f.name])[0]
        if dataclasses.is_dataclass(hint):
            found += [c for c in _sections(hint) if c not in found]
    return found


def test_every_field_has_a_docstring():
    """A field's documentation is the docstring under it, written once (docs/config.md's rows come from it)."""
    missing = [f"{cls.__name__}.{f.name}" for cls in _sections() for f in dataclasses.fields(cls)
               if not field_docs.field_docs(cls).get(f.name, "").strip()]
    assert not missing, f"fields without a docstring: {missing}. Fix: write one under each field"


def test_docs_field_tables_are_the_docstrings():
    """docs/config.md is the field reference: a table for every section (its class's, for the shared
    <role>.optim, .parallel, .recompute, .lora), each written from the fields' docstrings and defaults."""
    page = (REPO / "docs/config.md").read_text()
    assert field_docs.render(page) == page, (f"docs/config.md's field tables differ from the fields' docstrings in "
                                             f"megappo/config/. Fix: run {field_docs.COMMAND}")
    with_tables = {field_docs.section_at(path) for path in field_docs.tables(page)}
    sections = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(
        config_module._options(config_module._hints(Config)[f.name])[0])]
    assert not [s for s in sections if field_docs.section_at(s) not in with_tables], "a section has no table"
    rows = re.findall(r"^\| `([\w.]+)` \|", page, flags=re.M)
    for cls in _sections():  # every field of every section is a row (`name`, or `section.name` when flattened)
        missing = [f.name for f in dataclasses.fields(cls) if not any(r.split(".")[-1] == f.name for r in rows)]
        assert cls is Config or not missing, f"docs/config.md has no row for {cls.__name__}'s {missing}"


def test_field_docs_command_reports_a_stale_page(tmp_path, capsys):
    page = (REPO / "docs/config.md").read_text()
    stale = tmp_path / "config.md"
    stale.write_text(page.replace("| `tp` | `1` |", "| `tp` | `2` |", 1))
    assert field_docs.main(["--check", "--page", str(stale)]) == 1
    assert field_docs.COMMAND in capsys.readouterr().out
    assert field_docs.main(["--page", str(stale)]) == 0 and stale.read_text() == page


def test_expert_parallel_per_role():
    cfg = build(parallel={"ep": 2}, critic={"parallel": {"ep": 1}})
    assert cfg.expert_parallel("actor") == 2 and cfg.expert_parallel("critic") == 1 and cfg.expert_parallel("ref") == 2
    assert cfg.min_world_size == 2
    cfg.validate_world(2)
    with pytest.raises(ConfigError, match=r"actor: expert parallelism ep=2 must divide its data-parallel size "
                                          r"world/\(tp\*pp\) = 2/\(2\*1\) = 1. Fix: launch a multiple of 4 ranks"):
        build(parallel={"ep": 2, "tp": 2}).validate_world(2)
    with pytest.raises(ConfigError, match="parallel.ep"):
        build(parallel={"ep": 0})


def test_lora_settings_and_their_refusals():
    """actor.lora / critic.lora: names mapped to Megatron's layers; the reference becomes the actor's base
    (its layout the actor's); wrong names, ref.lora, reward.lora and ref.parallel with it are refused, and so is
    rollout.lora_sync=adapters without actor.lora, with SGLang, with placement=separate or for a MoE model."""
    from megappo.trainer.setup import lora_of

    kl = {"algorithm": {"adv_estimator": "grpo"}, "rollout": {"n": 2}, "actor": {"use_kl_loss": True,
          "parallel": {"tp": 2}, "lora": {"rank": 8, "target_modules": ["q_proj", "down_proj"],
                                          "modules_to_save": ["lm_head"]}}}
    cfg = build(**kl)
    lora = lora_of(cfg, "actor")
    assert lora.targets == ("linear_qkv", "linear_fc2") and lora.scale == 2.0 and lora.modules_to_save == ("lm_head",)
    assert cfg.ref_is_actor_base and cfg.layout("ref") == cfg.layout("actor") == (2, 1, None)
    assert not lora_of(cfg, "critic").enabled and not lora_of(cfg, "ref").enabled
    assert not build().ref_is_actor_base and not lora_of(build(), "actor").enabled
    for sections, message in [
        ({"actor": {"lora": {"rank": 8, "target_modules": ["qkv"]}}},
         r"actor\.lora\.target_modules: 'qkv' is not a linear layer megappo adapts\. Fix: choose from"),
        ({"actor": {"lora": {"rank": 8, "modules_to_save": ["norm"]}}}, r"actor\.lora\.modules_to_save: 'norm'"),
        ({"actor": {"lora": {"rank": -1}}}, r"actor\.lora\.rank"),
        ({"critic": {"lora": {"rank": 4, "alpha": 0}}}, r"critic\.lora\.alpha=0.* must be > 0"),
        ({"ref": {"lora": {"rank": 4}}}, r"ref\.lora: the reference policy is the base model"),
        ({"reward": {"lora": {"rank": 4}}}, r"reward\.lora: the reward model is not trained"),
        ({**kl, "ref": {"parallel": {"tp": 1}}}, r"ref\.parallel does not apply \(it may only repeat the actor's "
                                                 r"layout, \{'tp': 2, 'pp': 1, 'vpp': None, 'ep': 1, 'cp': 1\}\)\. Fix: remove "
                                                 r"ref\.parallel"),
        ({"critic": {"lora": {"rank": 4, "dropout": 0.1}, "recompute": {"granularity": "full"}}},
         r"critic\.lora\.dropout=0\.1 with critic\.recompute\.granularity=full.*Fix: set critic\.lora\.dropout=0"),
        ({"rollout": {"lora_sync": "adapters"}}, r"rollout\.lora_sync=adapters .* actor\.lora is off.*Fix: set "
                                                 r"actor\.lora\.rank"),
        ({"actor": {"lora": {"rank": 8}}, "rollout": {"lora_sync": "adapters", "engine": "sglang"}},
         r"rollout\.lora_sync=adapters needs rollout\.engine=hf: loading LoRA adapters into SGLang is not wired"
         r".*Fix: set rollout\.lora_sync=merged"),
        ({"actor": {"lora": {"rank": 8}}, "rollout": {"lora_sync": "adapters", "placement": "separate"}},
         r"rollout\.lora_sync=adapters needs rollout\.placement=colocated.*Fix: set rollout\.lora_sync=merged"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build(**sections)
    assert build(actor={"lora": {"rank": 8}}, rollout={"lora_sync": "adapters"}).rollout.lora_sync == "adapters"
    # a verl LoRA script gives the reference the actor's layout: the same layout, so nothing to refuse
    assert build(**kl, ref={"parallel": {"tp": 2, "pp": 1}}).layout("ref") == (2, 1, None)
    from megappo.models.hf_reference import TINY_CONFIGS
    from megappo.trainer.preflight import ModelConfigError, check_models

    moe = build(model={"hf_config": TINY_CONFIGS["qwen3_moe"]}, actor={"lora": {"rank": 8}},
                rollout={"lora_sync": "adapters"})
    with pytest.raises(ModelConfigError, match=r"rollout\.lora_sync=adapters: .* Mixture-of-Experts .*Fix: set "
                                               r"rollout\.lora_sync=merged"):
        check_models(moe)


def test_policy_losses_rollout_correction_and_estimators_and_their_refusals():
    """actor.policy_loss / algorithm.rollout_correction (verl's keys): the presets actor.old_logprob=is_correct and
    bypass mean the correction they stand for; combinations that verl would resolve silently are refused with the
    fix named; the config's lists of losses and estimators are the registries' (megappo.ppo)."""
    from megappo.ppo.advantages import ESTIMATORS
    from megappo.ppo.policy_losses import POLICY_LOSSES

    assert set(config_module.POLICY_LOSS_MODES) == set(POLICY_LOSSES)
    assert set(config_module.ADV_ESTIMATORS) == set(ESTIMATORS)
    grpo = {"algorithm": {"adv_estimator": "grpo"}, "rollout": {"n": 2}}
    is_correct = build(actor={"old_logprob": "is_correct", "is_truncate": 3.0})
    assert (is_correct.rollout_correction.rollout_is, is_correct.rollout_correction.rollout_is_threshold) == ("token", 3.0)
    assert build(actor={"old_logprob": "bypass"}).policy_loss_mode == "bypass_mode"
    assert build(actor={"policy_loss": {"loss_mode": "gspo"}}).policy_loss_mode == "gspo"
    assert not build().rollout_correction.enabled
    rc = build(algorithm={"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": "0.5_2.0",
                                                 "rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "0.5_2,0.01"}})
    assert rc.rollout_correction.rollout_is_threshold == "0.5_2.0" and not rc.bypass_old_logprobs
    # verl's examples/rollout_correction/run_with_rollout_corr.sh: bypass, REINFORCE, batch-normalised weights
    rloo = build(algorithm={"rollout_correction": {"rollout_is": "sequence", "rollout_is_batch_normalize": True,
                                                   "bypass_mode": True, "loss_type": "reinforce"}})
    assert rloo.bypass_old_logprobs and rloo.policy_loss_mode == "bypass_mode"
    # YAML 1.1 would read 0.5_5 as the number 0.55: megappo's loader keeps numbers with '_' as strings
    icepop = load_config(None, ["model.path=m", "algorithm.rollout_correction.rollout_is=token",
                                "algorithm.rollout_correction.rollout_is_threshold=0.5_5"])
    assert icepop.algorithm.rollout_correction.rollout_is_threshold == "0.5_5"
    with pytest.raises(ConfigError, match=r"actor\.ppo_epochs: expected int"):
        load_config(None, ["model.path=m", "actor.ppo_epochs=1_0"])
    gdpo = build(algorithm={"adv_estimator": "gdpo"}, rollout={"n": 2}, reward={"functions": ["gsm8k", "math"]})
    assert gdpo.gdpo_components == ["gsm8k", "math"] and gdpo.algorithm.grouped
    for sections, message in [
        ({"actor": {"old_logprob": "is_correct"}, "algorithm": {"rollout_correction": {"rollout_is": "token"}}},
         r"actor\.old_logprob=is_correct is a preset of algorithm\.rollout_correction.*Fix: remove actor\.old_logprob"),
        ({"actor": {"policy_loss": {"loss_mode": "bypass_mode"}}},
         r"loss_mode=bypass_mode takes the engine's log-probs.*Fix: set algorithm\.rollout_correction\.bypass_mode=true"),
        ({"actor": {"policy_loss": {"loss_mode": "gspo"}}, "algorithm": {"rollout_correction": {"bypass_mode": True}}},
         r"bypass_mode=true trains with verl's bypass loss.*not actor\.policy_loss\.loss_mode=gspo"),
        ({"actor": {"policy_loss": {"loss_mode": "dro"}}}, r"actor\.policy_loss\.loss_mode=dro needs actor\.policy_loss\.dro_beta"),
        ({"actor": {"policy_loss": {"loss_mode": "gspoo"}}}, r"'gspoo' is not one of .*Did you mean 'gspo'"),
        ({"actor": {"policy_loss": {"clip_cov_ratio": 0}}}, r"actor\.policy_loss\.clip_cov_ratio=0.* must be > 0"),
        ({"actor": {"tau_neg": 0}}, r"actor\.tau_pos=1\.0 and actor\.tau_neg=0.* must be > 0"),
        ({"algorithm": {"rollout_correction": {"rollout_rs": "token_k4"}}},
         r"algorithm\.rollout_correction\.rollout_rs: unknown option 'token_k4'\. Fix: choose from"),
        ({"algorithm": {"rollout_correction": {"rollout_rs": "token_k1"}}},
         r"algorithm\.rollout_correction\.rollout_rs_threshold is required when algorithm\.rollout_correction\.rollout_rs"),
        ({"algorithm": {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "2_0.5"}}},
         r"rollout_is_threshold='2_0\.5': the lower bound exceeds the upper bound\. Fix"),
        ({"algorithm": {"rollout_correction": {"rollout_is": "tokens"}}}, r"'tokens' is not one of \['token', 'sequence'\]"),
        ({"algorithm": {"rollout_correction": {"loss_type": "reinforce"}}},
         r"loss_type=reinforce applies in bypass mode only"),
        ({**grpo, "algorithm": {"adv_estimator": "optimal_token_baseline"}, "actor": {"old_logprob": "bypass"}},
         r"adv_estimator=optimal_token_baseline needs the trainer's old log-probs"),
        ({"algorithm": {"adv_estimator": "gdpo"}, "rollout": {"n": 2}},
         r"adv_estimator=gdpo normalises each reward component apart, but reward\.functions is empty"),
        ({"algorithm": {"adv_estimator": "gdpo", "gdpo_reward_keys": ["acc"]}, "rollout": {"n": 2},
          "reward": {"functions": ["gsm8k"]}}, r"gdpo_reward_keys: \['acc'\] are not in reward\.functions"),
        ({"algorithm": {"adv_estimator": "gdpo", "gdpo_reward_weights": [1.0, 2.0]}, "rollout": {"n": 2},
          "reward": {"functions": ["gsm8k"]}}, r"gdpo_reward_weights has 2 entries for 1 components"),
        ({"algorithm": {"adv_estimator": "opo"}}, r"adv_estimator=opo compares samples of the same prompt"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build(**sections)


def test_the_old_recipe_module_still_imports_with_a_deprecation_warning(monkeypatch):
    monkeypatch.delitem(sys.modules, "megappo.recipe", raising=False)
    with pytest.warns(DeprecationWarning, match="import load_config, .* from megappo.config"):
        import megappo.recipe as old
    assert (old.load_config, old.config_from_dict, old.dump_config, old.apply_override) == (
        config_module.load_config, config_module.config_from_dict, config_module.dump_config,
        config_module.apply_override)


def test_routing_replay_and_lora_roles_are_derived_values():
    """megappo.trainer.setup's RoleBuild reads these rather than deciding them again."""
    cfg = build(actor={"moe_routing": "replay", "lora": {"rank": 8}}, critic={"lora": {"rank": 4}})
    assert cfg.routing_replay and cfg.lora_roles == ("actor", "critic")
    assert not build().routing_replay and build().lora_roles == ()
