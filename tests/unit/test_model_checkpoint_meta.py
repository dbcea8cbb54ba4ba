"""A model checkpoint from another model or role is refused before any tensor is read; a LoRA actor's
checkpoint says where its exported peft adapter finds the base model."""

import dataclasses
import json
import os
import types

import pytest

from megappo.models.checkpoint import META_FILE, check_compatible, read_metadata
from megappo.models.hf_config import ModelConfigError, dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS


def _ckpt(tmp_path, dims, role="actor"):
    (tmp_path / META_FILE).write_text(json.dumps({"role": role, "dims": dataclasses.asdict(dims)}))
    return read_metadata(str(tmp_path))


def test_other_model_is_refused_with_the_differences(tmp_path):
    dims = dims_from_hf(TINY_CONFIGS["llama"])
    meta = _ckpt(tmp_path, dims_from_hf(dict(TINY_CONFIGS["llama"], num_hidden_layers=2)))
    model = types.SimpleNamespace(dims=dims, has_value_head=False, role="actor")
    with pytest.raises(ModelConfigError, match="from another model \\(num_layers: checkpoint 2 vs model 4\\)"):
        check_compatible(model, meta, str(tmp_path))


def test_other_architecture_and_role(tmp_path):
    model = types.SimpleNamespace(dims=dims_from_hf(TINY_CONFIGS["llama"]), has_value_head=False, role="actor")
    with pytest.raises(ModelConfigError, match="arch: checkpoint 'Qwen2ForCausalLM'"):
        check_compatible(model, _ckpt(tmp_path, dims_from_hf(TINY_CONFIGS["qwen2"])), str(tmp_path))
    with pytest.raises(ModelConfigError, match="holds a critic model, which cannot load into the actor model"):
        check_compatible(model, _ckpt(tmp_path, model.dims, role="critic"), str(tmp_path))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ModelConfigError, match="not a megappo model checkpoint"):
        read_metadata(str(tmp_path))


def test_weights_only_checkpoint_cannot_resume_training(tmp_path):
    """load_trainable refuses a save_model checkpoint (no optimizer state) before reading tensors."""
    import contextlib

    from megappo.models.checkpoint import load_trainable

    dims = dims_from_hf(TINY_CONFIGS["llama"])
    _ckpt(tmp_path, dims)  # what save_model writes: no "with_optimizer"
    model = types.SimpleNamespace(dims=dims, has_value_head=False, role="actor",
                                  ps=types.SimpleNamespace(active=contextlib.nullcontext))
    with pytest.raises(ModelConfigError, match="holds weights only, no optimizer state to resume from. Fix: resume "
                                               "from a trainer checkpoint"):
        load_trainable(types.SimpleNamespace(model=model), str(tmp_path))


def test_a_lora_actor_checkpoint_names_where_its_peft_base_is(tmp_path, monkeypatch):
    """`megappo export` of a LoRA actor (megappo.cli.adapter_base_of, from the trainer checkpoint's
    saved config): a run from model.path names that directory, by its absolute path when it exists
    from the working directory, else as saved (and the note says to pass the base yourself); a run
    from model.hf_config gets its base written (its starting values: tests/e2e/test_lora.py)."""
    from megappo.trainer.checkpointing import STATE_FILE
    from megappo.cli import adapter_base_of, peft_note

    step = tmp_path / "step_00000002"

    def checkpoint(model: dict, role="actor", lora=True) -> str:
        (step / role).mkdir(parents=True, exist_ok=True)
        (step / role / META_FILE).write_text(json.dumps({"role": role, "lora": {"rank": 8} if lora else None}))
        (step / STATE_FILE).write_text(json.dumps({"config": {"model": model}}))
        return str(step / role)

    (tmp_path / "models" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    base = adapter_base_of(checkpoint({"path": "models/base", "hf_config": None}))
    assert base.path == str(tmp_path / "models" / "base") and not base.start
    assert "its base model is " + str(tmp_path / "models" / "base") in peft_note("out", base.path)
    base = adapter_base_of(checkpoint({"path": "elsewhere/base", "hf_config": None}))
    assert base.path == "elsewhere/base"
    assert "not a directory from here: pass the base model to PeftModel.from_pretrained" in peft_note("out", base.path)
    assert adapter_base_of(checkpoint({"path": "models/base"}, role="critic")) is None  # merged only
    assert adapter_base_of(checkpoint({"path": "models/base"}, lora=False)) is None
    assert "its base model in " + os.path.join("out", "base") in peft_note("out", None)
