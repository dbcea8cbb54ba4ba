"""`megappo export --init RECIPE OUT`: a recipe's initial model (built from model.hf_config, seeded by
model.seed_init) as an HF directory with its tokenizer, for verl's actor_rollout_ref.model.path. The
directory loads in transformers and in megappo (model.path) with exactly the weights, config and tokenizer
the recipe's own run starts from."""

import os
import pathlib
import sys

import pytest
import torch

from megappo.models.weights import HFWeights
from megappo.config import load_config
from megappo.trainer.setup import model_source
from tests import prefork

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = str(REPO / "recipes/demo-cpu.yaml")
pytestmark = pytest.mark.one_process  # `megappo export --init` is one process (tests/conftest.py)


def export_init(*args) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = prefork.run([sys.executable, "-m", "megappo.cli", "export", "--init", *args], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_exported_initial_model_is_the_one_the_recipe_run_starts_from(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "init"
    code, said = export_init(DEMO, str(out))
    assert code == 0, said
    assert f"actor_rollout_ref.model.path={out}" in said
    run_start = model_source(load_config(DEMO, []))  # what `megappo train recipes/demo-cpu.yaml` loads
    # transformers reads it as the model the run builds, bit for bit, and its tokenizer as the built-in one
    hf = AutoModelForCausalLM.from_pretrained(out).state_dict()
    built = run_start.hf_model.state_dict()
    assert hf.keys() == built.keys() and all(torch.equal(hf[k], built[k]) for k in built)
    text = "3>4"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == run_start.tokenizer(text).input_ids
    # megappo's run from the directory (model.path) starts from the same tensors, config and token ids
    from_dir = model_source(load_config(DEMO, [f"model.path={out}", "model.hf_config=null", "model.tokenizer=null"]))
    saved = HFWeights(from_dir.weights)
    assert saved.names() == set(run_start.weights)
    assert all(torch.equal(saved.get(k), v) for k, v in run_start.weights.items())
    assert from_dir.hf_config == run_start.hf_config and from_dir.dims == run_start.dims
    assert from_dir.tokenizer(text).input_ids == run_start.tokenizer(text).input_ids


def test_overrides_seed_and_refusals(tmp_path):
    other = tmp_path / "seed7"
    code, said = export_init(DEMO, str(other), "model.seed_init=7")
    assert code == 0, said
    seven = HFWeights(str(other))
    default = model_source(load_config(DEMO, [])).weights
    assert not torch.equal(seven.get("model.embed_tokens.weight"), default["model.embed_tokens.weight"])
    code, said = export_init(DEMO, str(other))  # not into a directory with files
    assert code == 2 and "exists and is not empty; pass --overwrite" in said, said
    code, said = export_init(DEMO, str(tmp_path / "x"), f"model.path={other}", "model.hf_config=null",
                             "model.tokenizer=null")
    assert code == 2 and f"model.path={other}); --init writes a model built from model.hf_config. Fix:" in said, said
    assert not (tmp_path / "x").exists()
    code, said = export_init(DEMO, str(tmp_path / "x"), f"actor.dist_checkpoint={other}")
    assert code == 2 and f"actor starts from actor.dist_checkpoint={other}, not from the model --init" in said, said
    assert not (tmp_path / "x").exists()
