"""Trainer-checkpoint bookkeeping without models: `latest`, resume modes, config-change rules,
pruning. (Saving and loading real models: tests/distributed/test_checkpoint.py and
tests/e2e/test_resume.py.)"""

import json
import os
import shutil
import warnings

import numpy as np
import pytest

from megappo.trainer import checkpointing
from megappo.config import ConfigError, config_from_dict
from megappo.errors import CheckpointError

MIN = {"model": {"hf_config": {"architectures": ["LlamaForCausalLM"]}}}


def cfg_at(tmp_path, **sections):
    return config_from_dict({**MIN, "run": {"output_dir": str(tmp_path)}, **sections})


def fake_checkpoint(root, step, config, complete=True, digests=True, branch=None):
    """A step directory with just the trainer state (what find_resume reads) and its digests
    (`digests=False`: as an older megappo wrote it); `branch`: saved by a run that went back to it."""
    path = os.path.join(root, checkpointing.step_dir_name(step) + ("" if complete else ".partial"))
    os.makedirs(path)
    state = {"format": checkpointing.FORMAT, "step": step, "sampler": None, "kl_coef": 0.1, "nan_skips": 0,
             "branch": branch, "config": config.to_dict()}
    with open(os.path.join(path, checkpointing.STATE_FILE), "w") as f:
        json.dump(state, f)
    if digests:
        checkpointing.write_digests(path, 0, world=1)
    if complete:
        with open(os.path.join(root, checkpointing.LATEST), "w") as f:
            f.write(checkpointing.step_dir_name(step))
    return path


def test_fresh_directory_starts_fresh_unless_resume_must(tmp_path):
    assert checkpointing.find_resume(cfg_at(tmp_path)) is None
    assert checkpointing.find_resume(cfg_at(tmp_path, checkpoint={"resume": "off"})) is None
    with pytest.raises(ConfigError, match="checkpoint.resume=must, but .* has no complete checkpoint. Fix"):
        checkpointing.find_resume(cfg_at(tmp_path, checkpoint={"resume": "must"}))


def test_auto_resumes_from_latest_and_ignores_partial_saves(tmp_path):
    cfg = cfg_at(tmp_path)
    root = cfg.checkpoint_dir
    fake_checkpoint(root, 2, cfg)
    fake_checkpoint(root, 4, cfg, complete=False)  # a save that was killed
    with pytest.warns(UserWarning, match=r"step_00000004.partial is a save that did not finish \(the run was stopped "
                                         r"during it\), so it cannot be resumed: resuming from .*step_00000002 \(step 2\)"):
        state = checkpointing.find_resume(cfg)
    assert state["step"] == 2 and state["path"].endswith("step_00000002")
    assert checkpointing.resolve_checkpoint(str(tmp_path)) == state["path"]  # run dir -> latest step dir
    assert checkpointing.resolve_checkpoint(state["path"]) == state["path"]


def test_resume_off_starts_fresh_beside_existing_checkpoints(tmp_path):
    cfg = cfg_at(tmp_path, checkpoint={"resume": "off"})
    fake_checkpoint(cfg.checkpoint_dir, 2, cfg)
    assert checkpointing.find_resume(cfg) is None  # megappo.trainer.earlier_runs moves them aside before the run writes
    assert checkpointing.find_resume(cfg_at(tmp_path))["step"] == 2


def test_broken_latest_pointer_is_an_error_that_names_the_fix(tmp_path):
    cfg = cfg_at(tmp_path)
    os.makedirs(cfg.checkpoint_dir)
    with open(os.path.join(cfg.checkpoint_dir, "latest"), "w") as f:
        f.write("step_00000009")
    with pytest.raises(ConfigError, match="not a complete checkpoint. Fix: point it at a step_NNNNNNNN directory"):
        checkpointing.find_resume(cfg)
    with pytest.raises(ConfigError, match="no megappo trainer checkpoint at"):
        checkpointing.resolve_checkpoint(str(tmp_path / "elsewhere"))


@pytest.mark.parametrize("change, needle", [
    ({"algorithm": {"adv_estimator": "reinforce_plus_plus"}}, "algorithm.adv_estimator: checkpoint 'gae' vs now"),
    ({"data": {"train_batch_size": 512}}, "data.train_batch_size: checkpoint 1024 vs now 512"),
    ({"data": {"seed": 7}}, "data.seed"),
    ({"model": {"hf_config": {"architectures": ["Qwen2ForCausalLM"]}}}, "model.hf_config"),
    ({"parallel": {"use_distributed_optimizer": True}}, "parallel.use_distributed_optimizer"),
])
def test_changes_the_checkpoint_depends_on_are_refused(tmp_path, change, needle):
    fake_checkpoint(cfg_at(tmp_path).checkpoint_dir, 2, cfg_at(tmp_path))
    with pytest.raises(ConfigError, match=f"cannot resume from .*{needle}.*Fix: restore those settings"):
        checkpointing.find_resume(cfg_at(tmp_path, **change))


def test_a_run_stopped_during_its_first_save_says_it_starts_from_step_0(tmp_path):
    """A double Ctrl-C during the first save leaves only step_N.partial: the rerun says it starts over."""
    cfg = cfg_at(tmp_path)
    fake_checkpoint(cfg.checkpoint_dir, 3, cfg, complete=False)
    with pytest.warns(UserWarning, match=r"step_00000003.partial is a save that did not finish .*: starting from "
                                         r"step 0\."):
        assert checkpointing.find_resume(cfg) is None


def test_other_algorithm_changes_warn_and_layout_changes_are_silent(tmp_path):
    fake_checkpoint(cfg_at(tmp_path).checkpoint_dir, 2, cfg_at(tmp_path))
    with pytest.warns(UserWarning, match=r"changed settings: actor.optim.lr: 1e-06 -> 5e-07"):
        checkpointing.find_resume(cfg_at(tmp_path, actor={"optim": {"lr": 5e-7}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resharding, a longer run, other logging: no warning
        state = checkpointing.find_resume(cfg_at(tmp_path, parallel={"tp": 2, "pp": 2}, run={
            "output_dir": str(tmp_path), "total_steps": 99}, logging={"sinks": ["console"]}))
    assert state["step"] == 2


def test_prune_keeps_the_newest(tmp_path):
    for step in (2, 4, 6, 8):
        os.makedirs(tmp_path / checkpointing.step_dir_name(step))
    os.makedirs(tmp_path / "step_00000010.partial")
    checkpointing._prune(str(tmp_path), keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000006", "step_00000008", "step_00000010.partial"]
    checkpointing._prune(str(tmp_path), keep_last=0)  # 0 keeps all
    assert len(os.listdir(tmp_path)) == 3


def test_rollout_buffer_of_an_earlier_megappo_one_batch_still_loads(tmp_path):
    """Before rollout.mode=async a checkpoint buffered one batch as {"step", "batch"}; now a list
    under "batches". Both load as [(step, RolloutBatch)] with the prompt records rebuilt."""
    import torch

    from megappo.data.prompts import PromptExample
    from megappo.types import RolloutBatch

    batch = RolloutBatch(prompt_ids=torch.tensor([[3, 4]]), prompt_mask=torch.ones(1, 2), response_ids=torch.tensor([[5]]),
                         response_mask=torch.ones(1, 1), rollout_log_probs=torch.tensor([[-0.5]]),
                         finish_reasons=["stop"], prompt_index=torch.zeros(1, dtype=torch.long),
                         examples=[PromptExample([3, 4], "demo", "7", {"k": 1}, 0)], policy_version=2)
    torch.save({"step": 5, "batch": checkpointing._plain_batch(batch)}, tmp_path / checkpointing.ROLLOUT_BUFFER)
    [(step, loaded)] = checkpointing.load_rollout_buffer(str(tmp_path))
    assert step == 5 and loaded.policy_version == 2 and loaded.examples == batch.examples
    assert torch.equal(loaded.rollout_log_probs, batch.rollout_log_probs)
    assert checkpointing.load_rollout_buffer(str(tmp_path / "nothing")) == []


def test_a_buffered_batch_keeps_each_rows_origin(tmp_path):
    """A buffered batch's prompt records keep where their row came from (file and line, validation), so
    a reward function failing on it after a resume still names it; a buffer saved before origins loads
    with None."""
    import torch

    from megappo.data.prompts import PromptExample, RowOrigin
    from megappo.types import RolloutBatch

    origin = RowOrigin("val.jsonl", 3, "jsonl", "validation")
    batch = RolloutBatch(prompt_ids=torch.tensor([[3, 4]]), prompt_mask=torch.ones(1, 2), response_ids=torch.tensor([[5]]),
                         response_mask=torch.ones(1, 1), rollout_log_probs=torch.tensor([[-0.5]]),
                         finish_reasons=["stop"], prompt_index=torch.zeros(1, dtype=torch.long),
                         examples=[PromptExample([3, 4], "demo", "7", {"k": 1}, 0, origin)],
                         score_fields=[{"acc": np.bool_(True), "pred": "7", "f": np.float32(0.5), "t": torch.tensor(2)}])
    plain = checkpointing._plain_batch(batch)
    torch.save({"batches": [{"step": 5, "batch": plain}]}, tmp_path / checkpointing.ROLLOUT_BUFFER)
    [(_, loaded)] = checkpointing.load_rollout_buffer(str(tmp_path))  # weights_only: Python's types only
    assert loaded.examples[0].origin == origin and str(loaded.examples[0].origin) == "val.jsonl:3"
    assert loaded.score_fields == [{"acc": True, "pred": "7", "f": 0.5, "t": 2}]
    assert [type(v) for v in loaded.score_fields[0].values()] == [bool, str, float, int]
    del plain["examples"][0]["origin"]
    torch.save({"batches": [{"step": 5, "batch": plain}]}, tmp_path / checkpointing.ROLLOUT_BUFFER)
    assert checkpointing.load_rollout_buffer(str(tmp_path))[0][1].examples[0].origin is None


def digested_checkpoint(root, step, config, nan_skips=0, shard=b"\0" * 4096, branch=None):
    """A fake checkpoint with a weight shard, an rng file and the digests a save records (2 ranks)."""
    path = fake_checkpoint(root, step, config, branch=branch)
    state_file = os.path.join(path, checkpointing.STATE_FILE)
    state = json.load(open(state_file))
    with open(state_file, "w") as f:
        json.dump(dict(state, nan_skips=nan_skips), f)
    os.makedirs(os.path.join(path, "actor"))
    os.makedirs(os.path.join(path, "rng"))
    for rel, data in [("actor/__0_0.distcp", shard), ("actor/__1_0.distcp", shard[::-1]), ("actor/.metadata", b"m" * 64),
                      ("rng/rank_00001.pt", b"r" * 32)]:
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
    for rank in (0, 1):
        checkpointing.write_digests(path, rank, world=2)
    return path


def test_digests_are_recorded_by_the_rank_that_wrote_each_file(tmp_path):
    path = digested_checkpoint(str(tmp_path), 2, cfg_at(tmp_path))
    rank0 = json.load(open(os.path.join(path, "digests", "rank_00000.json")))
    rank1 = json.load(open(os.path.join(path, "digests", "rank_00001.json")))
    assert rank0["hash"] == checkpointing.HASH
    assert sorted(rank0["files"]) == ["actor/.metadata", "actor/__0_0.distcp", checkpointing.STATE_FILE]
    assert sorted(rank1["files"]) == ["actor/__1_0.distcp", "rng/rank_00001.pt"]
    assert checkpointing.check_files(path) is None
    assert checkpointing.check_files(path, share=(1, 2)) is None


@pytest.mark.parametrize("damage, reason", [
    ("flip", r"actor/__0_0.distcp: its bytes differ from the blake2b-128 digest recorded at save \(corrupted\)"),
    ("truncate", r"actor/__0_0.distcp: 2048 bytes, the save wrote 4096 \(truncated or overwritten\)"),
    ("delete", r"actor/__0_0.distcp: missing"),
])
def test_a_damaged_file_is_named_with_the_reason(tmp_path, damage, reason):
    path = digested_checkpoint(str(tmp_path), 2, cfg_at(tmp_path))
    shard = os.path.join(path, "actor", "__0_0.distcp")
    if damage == "flip":  # one byte in the middle, same size
        with open(shard, "r+b") as f:
            f.seek(2000)
            f.write(b"\xff")
    elif damage == "truncate":
        os.truncate(shard, 2048)
    else:
        os.remove(shard)
    import re
    assert re.fullmatch(".*" + reason, checkpointing.check_files(path))
    if damage == "flip":
        assert checkpointing.check_files(path, full=False) is None  # the launcher's quick look reads no shard
        shares = [checkpointing.check_files(path, share=(rank, 2)) for rank in (0, 1)]
        assert shares.count(None) == 1  # one of 2 ranks hashes the file (the other checks its size)


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    cfg = cfg_at(tmp_path)
    root = cfg.checkpoint_dir
    digested_checkpoint(root, 2, cfg)
    digested_checkpoint(root, 4, cfg)
    newest = digested_checkpoint(root, 6, cfg)
    with open(os.path.join(newest, checkpointing.STATE_FILE), "a") as f:
        f.write(" ")  # one byte more
    os.truncate(os.path.join(root, "step_00000004", "actor", ".metadata"), 10)
    with pytest.warns(UserWarning) as caught:
        state = checkpointing.find_resume(cfg, verify="full")
    assert state["step"] == 2 and state["path"].endswith("step_00000002")
    lines = [str(w.message) for w in caught]
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert "step_00000006 is damaged: " in lines[0] and "trainer_state.json: " in lines[0]
    assert "step_00000004 is damaged: " in lines[1] and "actor/.metadata: 10 bytes" in lines[1]
    assert lines[2] == f"falling back to {os.path.join(root, 'step_00000002')} (step 2), the newest intact checkpoint."
    os.truncate(os.path.join(root, "step_00000002", "rng", "rank_00001.pt"), 0)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match=r"^no intact checkpoint in .*: 3 damaged "
                                                                          r"\(newest: .*step_00000006.*\)\. Fix: "):
        checkpointing.find_resume(cfg, verify="full")


def test_a_truncated_trainer_state_of_an_old_checkpoint_falls_back_too(tmp_path):
    """Checkpoints of an older megappo (no digests) load with a one-line warning; one whose
    trainer_state.json is cut short is skipped like a damaged one."""
    cfg = cfg_at(tmp_path)
    fake_checkpoint(cfg.checkpoint_dir, 2, cfg, digests=False)
    with pytest.warns(UserWarning, match=r"step_00000002 is not verified \(no digests: written by an older megappo\)\."):
        assert checkpointing.find_resume(cfg, verify="full")["step"] == 2
    newest = fake_checkpoint(cfg.checkpoint_dir, 4, cfg, digests=False)
    os.truncate(os.path.join(newest, checkpointing.STATE_FILE), 20)
    with pytest.warns(UserWarning) as caught:
        assert checkpointing.find_resume(cfg)["step"] == 2
    assert "trainer_state.json: cannot be read (JSONDecodeError" in str(caught[0].message)


def test_export_refuses_a_damaged_model_dir_and_warns_for_an_old_one(tmp_path):
    path = digested_checkpoint(str(tmp_path), 2, cfg_at(tmp_path))
    checkpointing.check_model_dir(os.path.join(path, "actor"))  # intact: silent
    os.truncate(os.path.join(path, "rng", "rank_00001.pt"), 1)
    checkpointing.check_model_dir(os.path.join(path, "actor"))  # export reads actor/ only
    os.truncate(os.path.join(path, "actor", "__1_0.distcp"), 1)
    with pytest.raises(CheckpointError, match=r"step_00000002 is damaged: .*actor/__1_0.distcp: 1 bytes.*Fix: export "
                                              r"an earlier step_NNNNNNNN"):
        checkpointing.check_model_dir(os.path.join(path, "actor"))
    old = fake_checkpoint(str(tmp_path / "old"), 2, cfg_at(tmp_path), digests=False)
    with pytest.warns(UserWarning, match="not verified"):
        checkpointing.check_model_dir(os.path.join(old, "actor"))
    checkpointing.check_model_dir(str(tmp_path / "converted"))  # not inside a trainer checkpoint: not checked


def test_prune_keeps_the_checkpoint_before_skipped_steps_and_ignores_a_discarded_future(tmp_path):
    root, cfg = str(tmp_path), cfg_at(tmp_path)
    digested_checkpoint(root, 2, cfg, nan_skips=0)
    digested_checkpoint(root, 4, cfg, nan_skips=0)
    digested_checkpoint(root, 6, cfg, nan_skips=3)  # steps 5-6 were skipped
    digested_checkpoint(root, 8, cfg, nan_skips=3)
    checkpointing._prune(root, keep_last=2, upto_step=8)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000004", "step_00000006",
                                                                           "step_00000008"]
    # a resume fell back from damaged step 8 to step 4 and saved step 5: step 8 is not counted (nor deleted)
    digested_checkpoint(root, 5, cfg, nan_skips=0)
    checkpointing._prune(root, keep_last=2, upto_step=5)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000004", "step_00000005",
                                                                           "step_00000006", "step_00000008"]


def test_a_full_disk_during_a_save_is_one_line_and_latest_is_kept(tmp_path, monkeypatch):
    import errno

    from megappo.models import checkpoint as model_checkpoint

    cfg = cfg_at(tmp_path)
    root = cfg.checkpoint_dir
    fake_checkpoint(root, 2, cfg)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointing.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(checkpointing.dist, "barrier", lambda: None)
    monkeypatch.setattr(model_checkpoint, "save_trainable", full_disk)
    with pytest.raises(CheckpointError) as caught:
        checkpointing.save(root, 4, {"actor": None}, None, cfg, hf_config={}, hf_files=None, critic_hf_config=None,
                           rank=0, keep_last=2)
    message = str(caught.value)
    assert "\n" not in message and not caught.value.every_rank
    assert message.startswith(f"no space left on the device of {root} while saving step 4 (traceback in "
                              f"{os.path.join(str(tmp_path), 'errors.log')}). Fix: free space there")
    assert message.endswith(f"it resumes from {os.path.join(root, 'step_00000002')} ('latest' still names it).")
    assert "OSError: [Errno 28]" in open(os.path.join(str(tmp_path), "errors.log")).read()
    assert open(os.path.join(root, "latest")).read() == "step_00000002"


def test_a_save_removes_only_its_own_unfinished_directory(tmp_path, monkeypatch):
    from megappo.models import checkpoint as model_checkpoint

    cfg = cfg_at(tmp_path)
    root = cfg.checkpoint_dir
    for name in ("step_00000004.partial", "step_00000009.partial", "other.partial"):
        os.makedirs(os.path.join(root, name, "stale"))
    monkeypatch.setattr(checkpointing.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(checkpointing.dist, "barrier", lambda: None)
    monkeypatch.setattr(model_checkpoint, "save_trainable", lambda *a: None)
    monkeypatch.setattr(checkpointing, "_rng_state", lambda: {})
    trainer = checkpointing.TrainerState(step=4, sampler=None, kl_coef=0.1, nan_skips=0)
    path = checkpointing.save(root, 4, {"actor": None}, trainer, cfg, hf_config={}, hf_files=None,
                              critic_hf_config=None, rank=0, keep_last=2)
    assert sorted(os.listdir(root)) == ["latest", "other.partial", "step_00000004", "step_00000009.partial"]
    assert not os.path.exists(os.path.join(path, "stale")) and checkpointing.check_files(path) is None


def test_a_checkpoint_that_cannot_be_read_is_one_line_with_the_traceback_in_errors_log(tmp_path, monkeypatch):
    """An older checkpoint (no digests) whose .metadata is cut short: Megatron's AssertionError
    becomes one line naming the checkpoint and the fix."""
    from megappo.models import checkpoint as model_checkpoint

    cfg = cfg_at(tmp_path)
    path = fake_checkpoint(cfg.checkpoint_dir, 2, cfg, digests=False)

    def unreadable(trainable, ckpt_dir):
        assert None, "metadata is None"

    monkeypatch.setattr(model_checkpoint, "load_trainable", unreadable)
    with pytest.raises(CheckpointError) as caught:
        checkpointing.load(path, {"actor": None}, rank=0)
    message = str(caught.value)
    log = os.path.join(cfg.checkpoint_dir, "errors.log")
    assert "\n" not in message
    assert message == (f"cannot read checkpoint {path} (it is not verified (no digests: written by an older megappo)): "
                       f"AssertionError: metadata is None (traceback in {log}). Fix: write an earlier step_NNNNNNNN "
                       f"into {os.path.join(cfg.checkpoint_dir, 'latest')} to resume from it, or restore the files "
                       "from a copy.")
    assert "in unreadable" in open(log).read()


def test_resume_from_goes_back_and_a_rerun_continues_the_branch(tmp_path):
    """checkpoint.resume_from=4 with steps 2, 4, 6 saved: the run starts from step 4, step 6 and an unfinished
    save of step 8 are moved aside with the metric logs (nothing deleted), `latest` names step 4; once the
    branch saved step 5, the same command continues from it instead of going back to 4 again."""
    cfg = cfg_at(tmp_path)
    root = cfg.checkpoint_dir
    for step in (2, 4, 6):
        fake_checkpoint(root, step, cfg)
    fake_checkpoint(root, 8, cfg, complete=False)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(7)))
    back = cfg_at(tmp_path, checkpoint={"resume_from": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unfinished save of step 8
        state = checkpointing.find_resume(back, verify="full")
    named = os.path.join(root, "step_00000004")
    assert state["step"] == 4 and state["path"] == named and state["branch"] == {"from": os.path.realpath(named)}
    aside = checkpointing.set_aside_later(back, state)
    assert os.path.dirname(aside) == os.path.join(root, checkpointing.SUPERSEDED)
    assert os.path.basename(aside).startswith("from_step_00000004_")
    assert sorted(os.listdir(aside)) == ["metrics.jsonl", "step_00000006", "step_00000008.partial"]
    assert (tmp_path / "metrics.jsonl").read_text() == open(os.path.join(aside, "metrics.jsonl")).read()
    assert sorted(os.listdir(root)) == ["latest", "step_00000002", "step_00000004", "superseded"]
    assert open(os.path.join(root, "latest")).read() == "step_00000004"
    assert checkpointing.find_resume(cfg)["step"] == 4  # a run without resume_from resumes there too

    fake_checkpoint(root, 5, cfg, branch=state["branch"])  # the branch's first save
    again = checkpointing.find_resume(back, verify="full")
    assert again["step"] == 5 and again["branch"] == state["branch"]
    assert checkpointing.set_aside_later(back, again) is None  # continuing: nothing moves
    assert checkpointing.find_resume(cfg)["branch"] == state["branch"]  # a plain resume keeps the branch
    shutil.rmtree(named)  # keep_last pruned the checkpoint the branch started from: the rerun still continues
    assert checkpointing.find_resume(back, verify="full")["step"] == 5


@pytest.mark.parametrize("spelling", ["4", "step_00000004", "path", "run dir"])
def test_resume_from_takes_a_step_a_step_name_or_a_path(tmp_path, spelling):
    other = cfg_at(tmp_path / "other")
    fake_checkpoint(other.checkpoint_dir, 2, other)
    named = fake_checkpoint(other.checkpoint_dir, 4, other)
    cfg = cfg_at(tmp_path / "run")
    if spelling in ("4", "step_00000004"):
        cfg = cfg_at(tmp_path / "other", checkpoint={"resume_from": spelling})
    else:
        cfg = cfg_at(tmp_path / "run", checkpoint={"resume_from": named if spelling == "path" else str(tmp_path / "other")})
    state = checkpointing.find_resume(cfg)
    assert state["path"] == named and state["branch"]["from"] == os.path.realpath(named)
    assert checkpointing.set_aside_later(cfg, state) is None  # nothing after step 4 in checkpoint.dir


def test_resume_from_refuses_a_missing_or_damaged_checkpoint_without_taking_another(tmp_path):
    cfg = cfg_at(tmp_path)
    root = cfg.checkpoint_dir
    digested_checkpoint(root, 2, cfg)
    named = digested_checkpoint(root, 4, cfg)
    with pytest.raises(ConfigError, match=r"^checkpoint.resume_from=3: .* has no complete checkpoint of step 3 \(its "
                                          r"steps: \[2, 4\]\)\. Fix: name one of those steps"):
        checkpointing.find_resume(cfg_at(tmp_path, checkpoint={"resume_from": 3}))
    with pytest.raises(ConfigError, match=r"^checkpoint.resume_from=/no/such: no megappo trainer checkpoint there "
                                          r"\(no trainer_state.json\)\. Fix: "):
        checkpointing.find_resume(cfg_at(tmp_path, checkpoint={"resume_from": "/no/such"}))
    os.truncate(os.path.join(named, "actor", ".metadata"), 10)
    with pytest.warns(UserWarning, match="step_00000004 is damaged"), \
            pytest.raises(CheckpointError, match=r"^checkpoint.resume_from names .*step_00000004, which is damaged: "
                                                 r".*actor/.metadata: 10 bytes.*Fix: restore it from a copy, or name "
                                                 r"another checkpoint\.$"):
        checkpointing.find_resume(cfg_at(tmp_path, checkpoint={"resume_from": 4}), verify="full")


def test_a_damaged_checkpoint_of_the_branch_falls_back_to_the_named_one(tmp_path):
    cfg = cfg_at(tmp_path, checkpoint={"resume_from": 2})
    root = cfg.checkpoint_dir
    named = digested_checkpoint(root, 2, cfg)
    branch = {"from": os.path.realpath(named)}
    later = digested_checkpoint(root, 3, cfg, branch=branch)
    os.truncate(os.path.join(later, "actor", "__1_0.distcp"), 7)
    with pytest.warns(UserWarning) as caught:
        state = checkpointing.find_resume(cfg, verify="full")
    assert state["path"] == named and state["branch"] == branch
    assert "step_00000003 is damaged: " in str(caught[0].message)
    assert str(caught[1].message) == f"falling back to {named} (step 2), the newest intact checkpoint."
    assert os.listdir(checkpointing.set_aside_later(cfg, state)) == ["step_00000003"]  # the branch starts again
