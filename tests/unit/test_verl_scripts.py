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
from megappo.recipe import _is_key, _key_value, _yaml, read_config

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
