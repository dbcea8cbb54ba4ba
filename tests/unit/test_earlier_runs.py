"""A fresh run moves an earlier run's files aside (megappo.trainer.earlier_runs); nothing is deleted."""

import os

from megappo.trainer import checkpointing
from megappo.trainer.earlier_runs import earlier_files, set_aside_earlier
from megappo.config import config_from_dict
from megappo.trainer.runlock import LOCK_FILE

MIN = {"model": {"hf_config": {"architectures": ["LlamaForCausalLM"]}}}


def cfg_at(out, **sections):
    return config_from_dict({**MIN, "run": {"output_dir": str(out)}, **sections})


def write(path, text="x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def tree(root):
    """Every file under root, relative, with its content."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(d, name)) as f:
                out[os.path.relpath(os.path.join(d, name), root)] = f.read()
    return out


def earlier_run(out, ckpt):
    """What a finished run leaves: logs in `out`, two checkpoints and a branch set aside in `ckpt`."""
    for name in ("metrics.jsonl", "samples.jsonl", "config.json", "curves.png", "verl_keys.log"):
        write(os.path.join(out, name), f"earlier {name}")
    write(os.path.join(out, "tensorboard", "events"), "tb")
    for step in (50, 100):
        write(os.path.join(ckpt, checkpointing.step_dir_name(step), checkpointing.STATE_FILE), f"step {step}")
    write(os.path.join(ckpt, "step_00000110.partial", "shard"), "killed save")
    write(os.path.join(ckpt, checkpointing.LATEST), "step_00000100")
    write(os.path.join(ckpt, checkpointing.SUPERSEDED, "from_step_00000050_T", "step_00000060", "s"), "branch")


def test_a_fresh_run_moves_the_earlier_runs_files_aside_keeping_their_layout(tmp_path):
    out = tmp_path / "run"
    cfg = cfg_at(out)
    earlier_run(str(out), cfg.checkpoint_dir)
    write(str(out / "my_notes.txt"), "mine")  # not megappo's: stays
    write(str(out / LOCK_FILE), "{}")  # the live run's lock: stays
    before = tree(str(out))
    line = set_aside_earlier(cfg)
    left = sorted(os.listdir(out))
    assert left == ["checkpoints", LOCK_FILE, "my_notes.txt", "superseded"], left
    assert os.listdir(cfg.checkpoint_dir) == []
    (aside,) = os.listdir(out / "superseded")
    assert aside.startswith("run_")
    after = tree(str(out))
    moved = {k: v for k, v in before.items() if k not in ("my_notes.txt", LOCK_FILE)}
    assert {os.path.join("superseded", aside, k): v for k, v in moved.items()} == \
        {k: v for k, v in after.items() if k.startswith("superseded")}  # every byte kept, same relative paths
    assert line.startswith("an earlier run's files (config.json, curves.png, metrics.jsonl, samples.jsonl, ")
    assert f"are now in {out / 'superseded' / aside}: this run starts fresh (no checkpoint to resume); " \
           "nothing was deleted." in line
    assert set_aside_earlier(cfg) is None  # nothing left to move


def test_checkpoint_dir_elsewhere_keeps_its_entries_on_its_own_filesystem(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "ckpts"
    cfg = cfg_at(out, checkpoint={"dir": str(ckpt), "resume": "off"})
    earlier_run(str(out), str(ckpt))
    write(str(ckpt / LOCK_FILE), "{}")
    line = set_aside_earlier(cfg)
    (aside,) = os.listdir(out / "superseded")
    assert sorted(os.listdir(ckpt)) == [LOCK_FILE, "superseded"]
    assert sorted(os.listdir(ckpt / "superseded")) == ["from_step_00000050_T", aside]  # the branch stays put
    assert sorted(os.listdir(ckpt / "superseded" / aside)) == [
        "latest", "step_00000050", "step_00000100", "step_00000110.partial"]
    assert f"now in {out / 'superseded' / aside} and {ckpt / 'superseded' / aside}" in line
    assert "(checkpoint.resume=off)" in line


def test_checkpoint_dir_equal_to_the_output_dir(tmp_path):
    cfg = cfg_at(tmp_path, checkpoint={"dir": str(tmp_path)})
    earlier_run(str(tmp_path), str(tmp_path))
    outputs, checkpoints = earlier_files(cfg)
    assert "superseded" not in checkpoints and not set(outputs) & set(checkpoints)
    set_aside_earlier(cfg)
    assert sorted(os.listdir(tmp_path)) == ["superseded"]
    aside = tmp_path / "superseded" / next(n for n in os.listdir(tmp_path / "superseded") if n.startswith("run_"))
    assert "step_00000100" in os.listdir(aside) and "metrics.jsonl" in os.listdir(aside)


def test_two_fresh_runs_in_one_second_get_two_directories(tmp_path):
    cfg = cfg_at(tmp_path)
    for _ in range(3):
        write(str(tmp_path / "metrics.jsonl"))
        assert set_aside_earlier(cfg)
    assert len(os.listdir(tmp_path / "superseded")) == 3

