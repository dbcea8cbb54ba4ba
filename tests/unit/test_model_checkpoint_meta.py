"""A model checkpoint from another model or role is refused before any tensor is read."""

import dataclasses
import json
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
