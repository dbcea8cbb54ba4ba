"""verl's own DAPO and GSPO scripts' command lines (tests/data/verl/*.txt: the file and commit each comes
from, its bash variables sized for the CPU demo) and five of its examples at their own sizes
(tests/data/verl/examples/) read by megappo as written: no key refused, every key either megappo's own,
read as megappo's or named as unused, and each value read lands in the Config. `megappo plan` takes them
too. (tests/e2e/test_verl_cli.py trains the DAPO one.)"""

import json
import pathlib

import pytest
import yaml

from megappo.cli import main
from megappo.config.loading import _is_key, _key_value, _yaml, read_config

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = str(REPO / "recipes/demo-cpu.yaml")
SCRIPTS = sorted((REPO / "tests/data/verl").glob("*.txt"))
#: the demo builds its model from model.hf_config; a script's model.path (the demo's model written out) replaces it
DEMO_MODEL = "model.hf_config=null"


def script_overrides(path: pathlib.Path, model: str, train: str, test: str, ckpts: str) -> list[str]:
    """The overrides of a tests/data/verl file with its placeholders filled."""
    fill = {"{MODEL_PATH}": model, "{TRAIN_FILE}": train, "{TEST_FILE}": test, "{CKPTS_DIR}": ckpts}
    out = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            for name, value in fill.items():
                line = line.replace(name, value)
            out.append(line.strip())
    return out


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def _same(got, want) -> bool:
    if isinstance(got, float) and isinstance(want, (str, int)) and not isinstance(want, bool):
        want = float(want)  # PyYAML reads 1e-6 as a string; the field's type converts it
    if isinstance(got, tuple):
        got = list(got)
    return got == want


def _assert_every_override_lands(cfg, reading, overrides):
    """Each override is megappo's own (its value in the Config), read as megappo's (that value in the Config)
    or named as unused; none twice."""
    read = {verl.split("=")[0]: ours for verl, ours in reading.read}
    unused = dict(reading.unused)
    for override in overrides:
        key, raw = _key_value(override)
        assert (key in read) + (key in unused) <= 1, key
        if key in unused:
            continue
        if key not in read:  # megappo's own name: the value as written
            assert _is_key(key), f"{key}: neither megappo's, read as megappo's, nor named as unused"
            assert _same(_get(cfg, key), _yaml(raw)), (key, _get(cfg, key), raw)
            continue
        ours, _, value = read[key].partition("=")
        value = value.split(" (")[0]  # a ratio's count is followed by how it was counted
        assert _same(_get(cfg, ours), _yaml(value) if value else _yaml(raw)), (key, ours, _get(cfg, ours), raw)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_verl_script_is_read_as_written(script, tmp_path):
    overrides = script_overrides(script, "/models/demo", "/data/train.jsonl", "/data/val.jsonl", str(tmp_path))
    cfg, reading = read_config(DEMO, [*overrides, DEMO_MODEL])
    cfg.validate_world(cfg.hardware_world_size)
    _assert_every_override_lands(cfg, reading, overrides)
    lines = reading.lines()
    assert len(lines) == 2 and lines[0].startswith("verl keys read as megappo's: ")
    assert lines[1].startswith("verl keys megappo does not use: ")
    assert "actor_rollout_ref.actor.clip_ratio_high -> actor.clip_ratio_high" in lines[0]
    assert "reward_model.reward_manager (megappo's reward path does what verl's dapo manager does" in lines[1]
    whys = [why for _, why in reading.unused]
    assert all(lines[1].count(f"({why})") == 1 for why in whys)  # keys with one reason share it


#: verl's example scripts at their own sizes (tests/data/verl/examples/) -> what megappo reads them as
EXAMPLES = {
    "ppo_deepseek7b_llm": {"algorithm.adv_estimator": "gae", "critic.path": "deepseek-ai/deepseek-llm-7b-chat",
                           "critic.packing": True, "hardware.gpus_per_node": 8},
    "grpo_qwen3moe_30b_megatron": {"actor.parallel.ep": 8, "ref.parallel.ep": 8, "actor.parallel.tp": 1,
                                   "reward.overlong_buffer.len": 4096, "rollout.max_new_tokens": 8192},
    "cispo_qwen2_5_0_5b_gsm8k": {"actor.policy_loss.loss_mode": "cispo", "actor.clip_ratio_low": 10.0,
                                 "actor.clip_ratio_high": 0.2},  # eps_low = 10: CISPO's weight has no lower bound
    "grpo_qwen2_7b_megatron_lora": {"actor.lora.rank": 256, "actor.parallel.tp": 4, "ref_is_actor_base": True},
    "otb_qwen2_5_7b": {"algorithm.adv_estimator": "optimal_token_baseline"},
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_verls_example_scripts_are_read_at_their_own_sizes(name):
    """verl's examples for PPO with a critic, Megatron MoE with expert parallelism and DAPO's reward shaping,
    CISPO, Megatron LoRA and the optimal token baseline, read on megappo's defaults (no recipe) for the GPUs
    they name."""
    overrides = script_overrides(REPO / f"tests/data/verl/examples/{name}.txt", "", "", "", "")
    cfg, reading = read_config(None, overrides)
    cfg.validate_world(cfg.hardware_world_size)
    _assert_every_override_lands(cfg, reading, overrides)
    for key, value in EXAMPLES[name].items():
        assert _get(cfg, key) == value, key


def test_the_dapo_scripts_set_dapos_keys():
    dapo = script_overrides(REPO / "tests/data/verl/dapo_qwen2.5_32b.txt", "/m", "/t.jsonl", "/v.jsonl", "/c")
    cfg, _ = read_config(DEMO, [*dapo, DEMO_MODEL])
    fg = cfg.algorithm.filter_groups
    assert (fg.enable, fg.metric, fg.max_num_gen_batches, cfg.data.gen_batch_size) == (True, "acc", 10, 48)
    assert (cfg.reward.overlong_buffer.enable, cfg.reward.overlong_buffer.len) == (True, 1)
    assert (cfg.actor.clip_low, cfg.actor.clip_high, cfg.actor.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert (cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.rollout.max_new_tokens) == ("grpo", 4, 2)
    assert (cfg.data.long_prompt_policy, cfg.logging.sinks) == ("truncate", ["console", "wandb", "jsonl"])
    megatron = script_overrides(REPO / "tests/data/verl/dapo_7b_math_megatron.txt", "/m", "/t", "/v", "/c")
    cfg, _ = read_config(DEMO, [*megatron, DEMO_MODEL])
    ob = cfg.reward.overlong_buffer  # Hydra's '+reward_model.reward_kwargs.overlong_buffer_cfg.*'
    assert (ob.enable, ob.len, ob.penalty_factor, ob.log) == (True, 1, 1.0, False)
    assert (cfg.layout("actor"), cfg.layout("ref"), cfg.actor.optim.warmup_steps) == ((2, 1, None), (2, 1, None), 10)
    gspo = script_overrides(REPO / "tests/data/verl/gspo_3b_math.txt", "/m", "/t", "/v", "/c")
    cfg, _ = read_config(DEMO, [*gspo, DEMO_MODEL])
    assert (cfg.actor.policy_loss.loss_mode, cfg.actor.loss_agg_mode) == ("gspo", "seq-mean-token-mean")
    assert (cfg.actor.clip_low, cfg.actor.clip_high, cfg.actor.optim.warmup_for(cfg.run.total_steps)) == (0.0003, 0.0004, 1)


def test_megappo_plan_takes_a_verl_script_and_says_what_it_read(tmp_path, capsys):
    hf_config = yaml.safe_load(open(DEMO))["model"]["hf_config"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    dapo = script_overrides(REPO / "tests/data/verl/dapo_qwen2.5_32b.txt", str(tmp_path), "/t.jsonl", "/v.jsonl",
                            str(tmp_path / "ckpts"))
    assert main(["plan", DEMO, *dapo, DEMO_MODEL]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("megappo: verl keys read as megappo's: ")
    assert out[1].startswith("megappo: verl keys megappo does not use: ")
    assert any(line.startswith("fits: ") for line in out)


# --- verl's Hydra flags: `megappo train --config-path=DIR --config-name=ppo_megatron_trainer OVERRIDES...` ---

VERL_RECIPE = str(REPO / "recipes/verl/ppo_megatron_trainer.yaml")


@pytest.mark.parametrize("name", ["ppo_megatron_trainer", "ppo_trainer"])
def test_the_recipes_of_verls_defaults_hold_verls_values(name):
    """recipes/verl/NAME.yaml is a megappo recipe of verl 0.9.1's defaults (values from its
    verl/trainer/config/_generated_NAME.yaml) for the keys megappo has."""
    cfg, _ = read_config(str(REPO / f"recipes/verl/{name}.yaml"), ["model.path=/m", "data.val_files=[/v.jsonl]"])
    assert (cfg.run.total_epochs, cfg.run.val_before_train, cfg.run.val_every) == (30, True, 0)  # trainer.*: 30, true, -1
    assert (cfg.checkpoint.save_every, cfg.checkpoint.keep_last) == (-1, 0)  # save_freq -1, max_actor_ckpt_to_keep null
    assert (cfg.model.dtype, cfg.rollout.seed, cfg.data.long_prompt_policy) == ("bfloat16", 42, "error")
    assert (cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.actor.clip_ratio, cfg.actor.optim.lr) == ("gae", 1, 0.2, 1e-6)
    assert cfg.actor.lora.alpha == (32 if name == "ppo_megatron_trainer" else 16)  # Megatron's LoRA section: 32


def _plan(argv, capsys):
    code = main(["plan", *argv])
    return code, capsys.readouterr()


@pytest.mark.parametrize("flags", [["--config-path=./config", "--config-name=ppo_megatron_trainer"],
                                   ["--config-path", "./config", "--config-name", "ppo_megatron_trainer"],
                                   ["--config-name=ppo_megatron_trainer"]])
def test_verls_hydra_flags_run_on_verls_defaults(flags, tmp_path, capsys, monkeypatch):
    """A verl script's command line with only the launcher swapped: its config directory is verl's (not on this
    machine), so megappo runs on its recipe of verl's defaults and says so first; the recipe is optional."""
    monkeypatch.chdir(tmp_path)
    hf_config = yaml.safe_load(open(DEMO))["model"]["hf_config"]
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text(json.dumps(hf_config))
    gspo = script_overrides(REPO / "tests/data/verl/gspo_3b_math.txt", str(tmp_path / "model"), "/t.jsonl",
                            "/v.jsonl", "/c")
    code, out = _plan([*flags, *gspo], capsys)
    lines = out.out.splitlines()
    where = "; ./config has no ppo_megatron_trainer.yaml" if len(flags) > 1 else ""
    assert lines[0] == ("megappo: --config-name=ppo_megatron_trainer: verl 0.9.1's defaults "
                        f"(recipes/verl/ppo_megatron_trainer.yaml) wherever megappo has the key{where}"), out
    assert lines[1].startswith("megappo: verl keys read as megappo's: ")
    assert any(line.startswith("megappo: this verl command line computes in model.dtype=bfloat16 "
                               f"({VERL_RECIPE}'s; verl computes in bf16)") for line in lines), lines


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_verl_scripts_are_read_on_verls_defaults(script, tmp_path):
    """Each script (sized for the CPU demo) on the recipe of verl's defaults: every override lands, and verl's
    defaults fill what the script leaves out."""
    overrides = script_overrides(script, "/models/demo", "/data/train.jsonl", "/data/val.jsonl", str(tmp_path))
    cfg, reading = read_config(VERL_RECIPE, overrides)
    _assert_every_override_lands(cfg, reading, overrides)
    assert (cfg.model.dtype, cfg.rollout.seed, cfg.model.path) == ("bfloat16", 42, "/models/demo")


def test_a_config_directory_holding_the_named_yaml(tmp_path, capsys):
    """--config-path's NAME.yaml: a megappo recipe is used; verl's own config directory (its _generated_ files)
    gives verl's defaults; a config in verl's layout is refused, saying what to do."""
    megappo_dir, verl_dir, theirs = tmp_path / "mine", tmp_path / "verl_config", tmp_path / "theirs"
    for d in (megappo_dir, verl_dir, theirs):
        d.mkdir()
    (megappo_dir / "my_run.yaml").write_text(open(DEMO).read())
    code, out = _plan([f"--config-path={megappo_dir}", "--config-name=my_run", "trainer.total_epochs=2"], capsys)
    assert out.out.splitlines()[0] == f"megappo: --config-name=my_run (--config-path={megappo_dir}): the megappo " \
                                      f"recipe {megappo_dir}/my_run.yaml"
    (verl_dir / "ppo_trainer.yaml").write_text("defaults:\n  - actor@actor_rollout_ref.actor: dp_actor\n")
    (verl_dir / "_generated_ppo_trainer.yaml").write_text("trainer: {total_epochs: 30}\n")
    code, out = _plan([f"--config-path={verl_dir}", "--config-name=ppo_trainer", "actor_rollout_ref.model.path=/m"],
                      capsys)
    assert out.out.splitlines()[0].endswith(f"(recipes/verl/ppo_trainer.yaml) wherever megappo has the key; "
                                            f"{verl_dir} is verl's own config directory")
    (theirs / "dapo.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\ntrainer: {total_epochs: 3}\n")
    code, out = _plan([f"--config-path={theirs}", "--config-name=dapo"], capsys)
    assert code == 2 and out.err.startswith(f"megappo: error: --config-name=dapo (--config-path={theirs}): "
                                            f"{theirs}/dapo.yaml is not a megappo recipe (a config in verl's layout")
    assert "Fix: give its settings as KEY=VALUE overrides after --config-name=ppo_megatron_trainer" in out.err


@pytest.mark.parametrize("argv, error", [
    (["--config-name=sft_trainer", "a.b=1"], "megappo: error: --config-name=sft_trainer: no --config-path names its "
                                             "directory, and megappo has verl 0.9.1's defaults for "
                                             "ppo_megatron_trainer, ppo_trainer only. Fix: "),
    ([DEMO, "--config-name=ppo_trainer"], f"megappo: error: both the recipe {DEMO} and --config-name=ppo_trainer "
                                          "name the defaults. Fix: give one of them."),
    (["--config-path=./config", "run.total_steps=1"], "--config-path=./config names the directory of a --config-name. "
                                                      "Fix: add --config-name=ppo_megatron_trainer"),
])
def test_hydra_flags_megappo_cannot_follow_are_errors_with_the_fix(argv, error, capsys):
    code, out = _plan(argv, capsys)
    assert code == 2 and error in out.err, out.err


def test_a_recipe_or_config_name_is_required(capsys):
    with pytest.raises(SystemExit):
        main(["plan"])
    assert "megappo plan needs a recipe: megappo plan RECIPE.yaml [key=value ...], or a verl script's " \
           "--config-name={ppo_megatron_trainer,ppo_trainer}" in capsys.readouterr().err


def test_the_node_count_error_names_the_override_that_set_it(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", DEMO, "trainer.nnodes=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("megappo: error: trainer.nnodes=16 sizes this run for 16 nodes x 2 ranks") and DEMO not in err
    assert main(["train", DEMO, "hardware.nodes=4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "megappo: error: hardware.nodes=4 sizes this run for 4 nodes")
