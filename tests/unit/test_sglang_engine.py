"""SGLang engine: GPU-only checks (skipped on CPU), and the CPU-side error for a missing SGLang."""

import importlib.util

import pytest
import torch

from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.engine import build_engine
from megappo.types import SamplingParams


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_missing_sglang_names_the_fix():
    with pytest.raises(ImportError, match="rollout.engine=hf"):
        build_engine("sglang", model_path="x", pad_token_id=0)


def test_unknown_engine():
    with pytest.raises(ValueError, match="choose one of \\['hf', 'sglang'\\]"):
        build_engine("vllm")


@pytest.mark.gpu
def test_sglang_generates_and_syncs_weights(tmp_path):
    model = build_hf_model(TINY_CONFIGS["llama"], seed=0)
    model.save_pretrained(tmp_path)
    engine = build_engine("sglang", model_path=str(tmp_path), pad_token_id=0, dtype="float32",
                          engine_args={"max_total_tokens": 4096})
    try:
        batch = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0))
        assert batch.response_ids.shape[0] == 4
        new = {k: v + 0.01 for k, v in model.state_dict().items() if k != "lm_head.weight"}
        engine.update_weights([list(new.items())])
        fps = engine.fingerprints(["model.embed_tokens.weight"])
        assert torch.equal(fps["model.embed_tokens.weight"], engine.fingerprint_of(new["model.embed_tokens.weight"]))
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="sync_mode=distributed needs a trainer GPU and an engine GPU")
def test_sglang_distributed_sync(tmp_path):
    """The trainer on GPU 0 broadcasts over NCCL to SGLang on GPU 1 (rollout.sync_mode=distributed)."""
    model = build_hf_model(TINY_CONFIGS["llama"], seed=0)
    model.save_pretrained(tmp_path)
    torch.cuda.set_device(0)
    engine = build_engine("sglang", model_path=str(tmp_path), pad_token_id=0, dtype="float32",
                          sync_mode="distributed", engine_args={"max_total_tokens": 4096, "base_gpu_id": 1})
    try:
        for shift in (0.01, 0.02):  # the second update reuses the group
            new = {k: (v + shift).cuda() for k, v in model.state_dict().items() if k != "lm_head.weight"}
            engine.update_weights([list(new.items())[:5], list(new.items())[5:]])
            fps = engine.fingerprints(["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"])
            for name, fp in fps.items():
                assert torch.equal(fp, engine.fingerprint_of(new[name].cpu())), name
        batch = engine.generate([[5, 6, 7]], SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=0))
        assert batch.response_ids.shape == (1, 4)
    finally:
        engine.shutdown()


def test_distributed_sync_needs_engine_gpus_and_one_replica(monkeypatch):
    """Both refusals come before SGLang is imported, so they hold on any machine."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ValueError, match=r"SGLang on GPUs 8..9, after the trainer's, but this node has 8 GPU\(s\). "
                                         r"Fix: start fewer trainer ranks per node"):
        build_engine("sglang", model_path="x", pad_token_id=0, sync_mode="distributed", engine_args={"tp_size": 2})
    with pytest.raises(ValueError, match="Fix: leave rollout.sglang.dp_size and pp_size at 1"):
        build_engine("sglang", model_path="x", pad_token_id=0, sync_mode="distributed", engine_args={"dp_size": 2})
