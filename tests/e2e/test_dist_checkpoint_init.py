"""Initial weights from a Megatron dist checkpoint: verl's `*.megatron.use_dist_checkpointing=True` with
`*.megatron.dist_checkpointing_path` (megappo's `actor.dist_checkpoint`, `ref.dist_checkpoint`,
`critic.dist_checkpoint`). The checkpoint is written as verl's converter writes one (GPTModel at TP=1,
`dist_checkpointing.save(model.sharded_state_dict(), DIR)`: tests/e2e/_verl_dist_checkpoint.py) from weights
other than model.path's (another seed); the demo trains one step on it at TP=2 with learning rates too small to
move a weight, so the step's checkpoint holds the weights the roles started from."""

import json
import os
import pathlib
import sys

import torch
import yaml

from megappo.models.hf_reference import build_hf_model, save_hf_dir
from megappo.data.tokenizer import builtin_tokenizer_files, load_tokenizer
from tests import prefork
from tests.e2e._runs import hf_weights

REPO = pathlib.Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def run(*args, timeout=600) -> tuple[int, str]:
    proc = prefork.run([sys.executable, *args], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def hf_dir(path, hf_config, seed):
    save_hf_dir(str(path), build_hf_model(hf_config, seed=seed).state_dict(), hf_config)
    for name, content in builtin_tokenizer_files(load_tokenizer("builtin:digits")).items():
        (path / name).write_bytes(content)
    return path


def test_verls_dist_checkpoint_keys_start_actor_ref_critic_and_engine_from_the_checkpoint(tmp_path):
    hf_config = yaml.safe_load(open(REPO / "recipes/demo-cpu.yaml"))["model"]["hf_config"]
    model, other = hf_dir(tmp_path / "model", hf_config, 0), hf_dir(tmp_path / "other", hf_config, 1)
    ckpt = tmp_path / "mcore"
    code, out = run("tests/e2e/_verl_dist_checkpoint.py", "save", str(other), str(ckpt))
    assert code == 0 and not (ckpt / "megappo_model.json").exists(), out[-3000:]
    verl = [f"{role}.{key}" for role in ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron",
                                         "critic.megatron")
            for key in ("use_dist_checkpointing=True", f"dist_checkpointing_path={ckpt}")]
    code, out = run("-m", "megappo.cli", "train", "recipes/demo-cpu.yaml", f"actor_rollout_ref.model.path={model}",
                    "model.hf_config=null", "model.tokenizer=null", *verl,
                    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.optim.lr=1e-30",
                    "critic.optim.lr=1e-30", "run.total_steps=1", "run.val_before_train=false", "run.val_every=0",
                    "logging.progress_bar=false", f"run.output_dir={tmp_path / 'run'}")
    assert code == 0, out[-6000:]
    read = next(line for line in out.splitlines() if line.startswith("megappo: verl keys read as megappo's: "))
    assert "actor_rollout_ref.actor.megatron.dist_checkpointing_path -> actor.dist_checkpoint" in read, read
    config = json.loads((tmp_path / "run/config.json").read_text())
    assert config["actor"]["dist_checkpoint"] == config["critic"]["dist_checkpoint"] == str(ckpt)
    assert config["parallel"]["tp"] == 2
    step = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[-1])
    # the reference started from the checkpoint too: it gives the actor's log-probs (the actor did not move)
    assert step["actor/kl_loss"] == 0.0, step
    # the engine generated with the actor's weights: the bridge synced (and verified) them before generating
    assert config["model"]["dtype"] == "float32" and step["rollout/logprob_diff_max"] < 1e-4, step
    started = {k: v for k, v in hf_weights(other).items()}
    for role in ("actor", "critic"):
        code, out = run("-m", "megappo.cli", "export", str(tmp_path / "run"), str(tmp_path / role), "--role", role,
                        timeout=300)
        assert code == 0, out[-3000:]
        exported = hf_weights(tmp_path / role)
        trunk = [k for k in exported if k.startswith("model.")]  # the critic's value head is new, as verl's
        assert len(trunk) == len([k for k in started if k.startswith("model.")]), sorted(exported)
        for k in trunk:
            assert torch.equal(exported[k], started[k].to(exported[k].dtype)), (role, k)
        if role == "actor":
            assert torch.equal(exported["lm_head.weight"], started["lm_head.weight"].to(exported["lm_head.weight"].dtype))
    assert not torch.equal(hf_weights(model)["model.embed_tokens.weight"], started["model.embed_tokens.weight"])


def test_a_checkpoint_of_another_model_is_refused_before_training_with_the_fix(tmp_path):
    hf_config = yaml.safe_load(open(REPO / "recipes/demo-cpu.yaml"))["model"]["hf_config"]
    model = hf_dir(tmp_path / "model", hf_config, 0)
    smaller = hf_dir(tmp_path / "smaller", dict(hf_config, num_hidden_layers=1), 1)
    ckpt = tmp_path / "mcore"
    code, out = run("tests/e2e/_verl_dist_checkpoint.py", "save", str(smaller), str(ckpt))
    assert code == 0, out[-3000:]
    code, out = run("tests/e2e/_verl_dist_checkpoint.py", "load", str(model), str(ckpt), "actor")
    assert code == 0, out[-3000:]
    said = next(line for line in out.splitlines() if line.startswith("error: "))
    assert said.startswith(f"error: actor.dist_checkpoint={ckpt} does not fit the actor model (")
    assert "(6 tensor(s): decoder.layers.mlp.linear_fc1.layer_norm_weight: checkpoint (1, 64) vs model (2, 64); " \
           in said and said.count(" vs model (2, ") == 4, said  # the layers, stacked; the first four named
    assert said.endswith("Fix: point it at a checkpoint of the model that model.path's config.json describes (same "
                         "layers, sizes and vocabulary), or unset it to load model.path's HF weights.")
    code, out = run("tests/e2e/_verl_dist_checkpoint.py", "load", str(model), str(model), "critic")
    said = next(line for line in out.splitlines() if line.startswith("error: "))
    assert said.startswith(f"error: critic.dist_checkpoint={model} is not a Megatron-Core dist checkpoint"), said
    code, out = run("tests/e2e/_verl_dist_checkpoint.py", "load", str(model), str(ckpt.parent / "smaller_mcore"),
                    "critic")
    assert "is not a Megatron-Core dist checkpoint (no such directory). Fix: " in out, out[-3000:]
