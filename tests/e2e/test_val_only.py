"""run.val_only on a checkpoint validates with the checkpoint's own settings (its trainer_state.json's
config): a command line that also carries other training settings (verl's script with its
algorithm.adv_estimator and rollout.n) is not refused; those settings are named as unused in one start-up
line, and only the validation keys (here rollout.val_n) are taken from it. The training run also shows
validation at the last step (3, with run.val_every=2), as verl's test_freq."""

import json
import os
import sys

from tests import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = ["run.total_steps=3", "checkpoint.save_every=2", "logging.progress_bar=false", "run.val_before_train=false",
        "run.val_every=2", "data.train_batch_size=16",
        *(f"{role}.{key}=16" for role in ("actor", "critic") for key in ("ppo_mini_batch_size", "micro_batch_size"))]


def train(out, *extra) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    proc = prefork.run([sys.executable, "-m", "megappo.cli", "train", "--world-size", "2", "recipes/demo-cpu.yaml",
                           f"run.output_dir={out}", *FAST, *extra], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def rows(path):
    return [json.loads(line) for line in open(path)]


def test_val_only_uses_the_checkpoints_settings_and_the_command_lines_validation_keys(tmp_path):
    out = str(tmp_path / "run")
    code, log = train(out)
    assert code == 0, log[-4000:]
    trained = [r for r in rows(os.path.join(out, "metrics.jsonl")) if "val/score/mean" in r]
    assert [r["step"] for r in trained] == [2, 3]  # every run.val_every=2 steps, and the last step (as verl)
    # the validation of a verl script's command line: other training settings than the checkpoint's
    code, log = train(out, "run.val_only=true", "algorithm.adv_estimator=grpo", "rollout.n=4", "rollout.val_n=2")
    assert code == 0, log[-4000:]
    said = [line for line in log.splitlines() if line.startswith("megappo: run.val_only: validating ")]
    assert len(said) == 2, log[-4000:]  # the settings line, then the announce line
    assert "with the checkpoint's own settings" in said[0] and "step_00000003" in said[0]  # the latest
    assert 'not used from this command line: algorithm.adv_estimator="grpo" (the checkpoint\'s: "gae"), ' \
           "rollout.n=4 (the checkpoint's: 1)" in said[0]
    assert "rollout.val_n" not in said[0].split("not used")[1]  # a validation key: taken
    used = json.load(open(os.path.join(out, "val_only", "config.json")))
    assert (used["algorithm"]["adv_estimator"], used["rollout"]["n"], used["rollout"]["val_n"]) == ("gae", 1, 2)
    (val,) = rows(os.path.join(out, "val_only", "metrics.jsonl"))
    assert val["step"] == 3 and "val-core/digit_successor/reward/mean@2" in val  # 2 samples per prompt
    assert "estimator=gae" in log and "critic=on" in log  # the checkpoint's algorithm: GAE with its critic
