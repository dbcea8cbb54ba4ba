"""verl's DAPO script's command line given to `megappo train` as written, its Hydra flags included
(tests/data/verl/dapo_qwen2.5_32b.txt, sized for the CPU demo): `python3 -m verl.trainer.main_ppo
--config-path=config --config-name=ppo_megatron_trainer ...` with only the launcher swapped. The run says it
runs on verl 0.9.1's defaults (recipes/verl/), which verl keys it read as which megappo keys, which it does
not use and its dtype (verl's bf16), trains 2 steps and exits 0. The model is the demo's (written as an HF
directory with its tokenizer builtin:digits) and the prompts the demo's task as verl-layout JSONL files. verl's
GSPO script runs the same way on `--config-name=ppo_trainer`."""

import json
import os
import pathlib
import sys

import yaml

from megappo.data.prompts import digit_successor_rows
from megappo.models.hf_reference import build_hf_model, save_hf_dir
from megappo.data.tokenizer import builtin_tokenizer_files, load_tokenizer
from tests import prefork
from tests.unit.test_verl_scripts import script_overrides

REPO = pathlib.Path(__file__).resolve().parents[2]


def demo_script(tmp_path, script: str) -> list[str]:
    """The overrides of tests/data/verl/`script` on the demo's model (an HF directory with its tokenizer) and the
    demo's task as verl-layout JSONL files; its checkpoint directory (the run's) is tmp_path/run."""
    hf_config = yaml.safe_load(open(REPO / "recipes/demo-cpu.yaml"))["model"]["hf_config"]
    model = tmp_path / "model"
    save_hf_dir(str(model), build_hf_model(hf_config, seed=0).state_dict(), hf_config)
    for name, content in builtin_tokenizer_files(load_tokenizer("builtin:digits")).items():
        (model / name).write_bytes(content)
    for name, rows in (("train.jsonl", digit_successor_rows(64, seed=1)), ("val.jsonl", digit_successor_rows(8, 2))):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return script_overrides(REPO / "tests/data/verl" / script, str(model), str(tmp_path / "train.jsonl"),
                            str(tmp_path / "val.jsonl"), str(tmp_path / "run"))


def megappo_train(*args) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    proc = prefork.run([sys.executable, "-m", "megappo.cli", "train", *args],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def test_megappo_train_runs_verls_dapo_command_line(tmp_path):
    run = tmp_path / "run"
    overrides = demo_script(tmp_path, "dapo_qwen2.5_32b.txt")
    # after the script's: the run's length, no W&B (the script logs to W&B, which needs an account),
    # the demo task's reward (a verl script names its reward file) and reward workers sized for 2 CPU cores: the
    # same spelling later wins, as in verl
    extra = ["run.total_steps=2", "trainer.logger=[console]", "reward.num_workers=0",
             "reward.functions=[digit_successor]", "logging.progress_bar=false",
             "actor_rollout_ref.rollout.val_kwargs.n=4",
             f"trainer.rollout_data_dir={run / 'rollouts'}", f"trainer.validation_data_dir={run / 'validation'}"]
    hydra = ["--config-path=config", "--config-name=ppo_megatron_trainer"]  # verl's own config directory: not here
    out = megappo_train(*hydra, *overrides, *extra)
    said = [line[len("megappo: "):] for line in out.splitlines() if line.startswith("megappo: ")]
    assert said[0] == ("--config-name=ppo_megatron_trainer: verl 0.9.1's defaults (recipes/verl/ppo_megatron_trainer"
                       ".yaml) wherever megappo has the key; config has no ppo_megatron_trainer.yaml"), said
    dtype = f"this verl command line computes in model.dtype=bfloat16 ({REPO}/recipes/verl/ppo_megatron_trainer.yaml's"
    assert said[3].startswith(dtype) and said.count(said[3]) == 1, said
    read = [line for line in out.splitlines() if line.startswith("megappo: verl keys read as megappo's: ")]
    unused = [line for line in out.splitlines() if line.startswith("megappo: verl keys megappo does not use: ")]
    assert len(read) == 1 and len(unused) == 1, out[-6000:]  # once, by rank 0
    assert "actor_rollout_ref.actor.clip_ratio_high -> actor.clip_ratio_high" in read[0]
    assert "algorithm.filter_groups" not in read[0]  # megappo's own names: nothing to read
    assert "trainer.logger=[console] -> logging.sinks=[console,jsonl]" in read[0]  # the later one only
    assert read[0].count("trainer.logger") == 1
    assert "reward_model.reward_manager (megappo's reward path does what verl's dapo manager does" in unused[0]
    assert (run / "verl_keys.log").read_text().splitlines() == said[:4]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2
    # validation before training, 4 samples of each of the 8 prompts: verl's per-source statistics, its core
    # variable acc (DAPO's overlong shaping keeps the unshaped correctness), grouped by prompt
    val = next(r for r in rows if r["step"] == 0)
    assert {"val-core/digit_successor/acc/mean@4", "val-core/digit_successor/acc/best@4/mean",
            "val-aux/digit_successor/acc/std@4", "val-aux/digit_successor/reward/worst@2/mean"} <= val.keys()
    assert 0 <= val["val-core/digit_successor/acc/mean@4"] <= val["val-core/digit_successor/acc/best@4/mean"] <= 1
    assert abs(val["val-aux/digit_successor/reward/mean@4"] - val["val/score/mean"]) < 1e-6  # 8 prompts x 4
    # every generation: the trained batches (16 groups of 4, kept by dynamic sampling, with their acc) and the
    # validation's, one file a step
    assert sorted(os.listdir(run / "rollouts")) == ["1.jsonl", "2.jsonl"]
    assert sorted(os.listdir(run / "validation")) == ["0.jsonl", "2.jsonl"]  # before training and at the last step
    for step in (1, 2):
        records = [json.loads(line) for line in (run / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        assert len(records) == 64 and sorted({r["group"] for r in records}) == list(range(16))
        assert all(r["step"] == step and "acc" in r["fields"] and r["data_source"] == "digit_successor" for r in records)
    records = [json.loads(line) for line in (run / "validation" / "0.jsonl").read_text().splitlines()]
    assert len(records) == 32
    assert sum(r["fields"]["acc"] for r in records) / 32 == val["val-core/digit_successor/acc/mean@4"]
    config = json.loads((run / "config.json").read_text())
    assert config["algorithm"]["filter_groups"]["enable"] and config["reward"]["overlong_buffer"]["len"] == 1
    # verl's defaults where the script says nothing (recipes/verl/ppo_megatron_trainer.yaml)
    assert (config["model"]["dtype"], config["rollout"]["seed"], config["checkpoint"]["keep_last"]) == ("bfloat16", 42, 0)


def test_megappo_train_runs_verls_gspo_command_line(tmp_path):
    """verl's GSPO script (an FSDP one: --config-name=ppo_trainer) as written but for its sizes, 2 steps: GSPO's
    sequence-level loss at its tiny clip ratios, on verl's defaults."""
    overrides = demo_script(tmp_path, "gspo_3b_math.txt")
    extra = ["trainer.total_training_steps=2", "trainer.logger=[console]", "reward.num_workers=0",
             "reward.functions=[digit_successor]", "logging.progress_bar=false"]
    out = megappo_train("--config-path", "config", "--config-name", "ppo_trainer", *overrides, *extra)
    assert "megappo: --config-name=ppo_trainer: verl 0.9.1's defaults (recipes/verl/ppo_trainer.yaml)" in out
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("actor/pg_loss" in r for r in rows)
    config = json.loads((run / "config.json").read_text())
    assert (config["actor"]["policy_loss"]["loss_mode"], config["actor"]["clip_ratio_low"], config["model"]["dtype"]) \
        == ("gspo", 0.0003, "bfloat16")
    assert os.path.isdir(run / "checkpoints" / "step_00000002")  # trainer.default_local_dir: the run's directory
