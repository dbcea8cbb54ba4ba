"""Trainer-checkpoint bookkeeping without models: `latest`, resume modes, config-change rules,
pruning. (Saving and loading real models: tests/distributed/test_checkpoint.py and
tests/e2e/test_resume.py.)"""

import json
import os
import warnings

import pytest

from megappo import checkpointing
from megappo.config import ConfigError
from megappo.recipe import config_from_dict

MIN = {"model": {"hf_config": {"architectures": ["LlamaForCausalLM"]}}}


def cfg_at(tmp_path, **sections):
    return config_from_dict({**MIN, "run": {"output_dir": str(tmp_path)}, **sections})


def fake_checkpoint(root, step, config, complete=True):
    """A step directory with just the trainer state (what find_resume reads)."""
    path = os.path.join(root, checkpointing.step_dir_name(step) + ("" if complete else ".partial"))
    os.makedirs(path)
    state = {"format": checkpointing.FORMAT, "step": step, "sampler": None, "kl_coef": 0.1, "nan_skips": 0,
             "config": config.to_dict()}
    with open(os.path.join(path, checkpointing.STATE_FILE), "w") as f:
        json.dump(state, f)
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


def test_resume_off_refuses_to_mix_with_existing_checkpoints(tmp_path):
    cfg = cfg_at(tmp_path, checkpoint={"resume": "off"})
    fake_checkpoint(cfg.checkpoint_dir, 2, cfg)
    with pytest.raises(ConfigError, match="already holds checkpoints .* Fix: resume with checkpoint.resume=auto"):
        checkpointing.find_resume(cfg)


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

    from megappo.data import PromptExample
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
