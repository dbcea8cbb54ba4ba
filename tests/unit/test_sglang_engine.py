"""SGLang engine: GPU-only checks (skipped on CPU), and the CPU-side error for a missing SGLang."""

import concurrent.futures
import importlib.util
import threading
import time

import pytest
import torch

from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.registry import build_engine
from megappo.types import SamplingParams


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_missing_sglang_names_the_fix():
    with pytest.raises(ImportError, match="rollout.engine=hf"):
        build_engine("sglang", model_path="x", pad_token_id=0)


#: the GPU tests need SGLang itself: the GPU machines measured so far could not install it (benchmarks/GPU.md)
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="sglang is not installed: pip install -e '.[gpu]' on a GPU machine")


def test_unknown_engine():
    with pytest.raises(ValueError, match="choose one of \\['hf', 'sglang'\\]"):
        build_engine("vllm")


@pytest.mark.gpu
@needs_sglang
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
        assert torch.equal(fps["model.embed_tokens.weight"],
                           engine.fingerprint_of("model.embed_tokens.weight", new["model.embed_tokens.weight"]))
    finally:
        engine.shutdown()


@pytest.mark.gpu
@needs_sglang
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
                assert torch.equal(fp, engine.fingerprint_of(name, new[name].cpu())), name
        batch = engine.generate([[5, 6, 7]], SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=0))
        assert batch.response_ids.shape == (1, 4)
    finally:
        engine.shutdown()


def test_distributed_sync_needs_engine_gpus_and_one_replica(monkeypatch):
    """Both refusals come before SGLang is imported, so they hold on any machine."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ValueError, match=r"SGLang on GPUs 8..9, after the trainer's, but this node has 8 GPU\(s\). "
                                         r"Fix: start fewer trainer ranks per node"):
        build_engine("sglang", model_path="x", pad_token_id=0, sync_mode="distributed", engine_args={"tp_size": 2})
    with pytest.raises(ValueError, match="Fix: leave rollout.sglang.dp_size and pp_size at 1"):
        build_engine("sglang", model_path="x", pad_token_id=0, sync_mode="distributed", engine_args={"dp_size": 2})


class ReadbackOnly:
    """An object with sglang.Engine's read-back method, answering as SGLang 0.5.23 does: the
    first `truncate_size` rows as nested float lists, or None for a model class without it."""

    def __init__(self, weights):
        self.weights = weights

    def get_weights_by_name(self, name, truncate_size=100):
        w = self.weights.get(name)
        return None if w is None else w.float().numpy().tolist()[:truncate_size]


def test_fingerprints_cover_the_rows_sglang_reads_back():
    """Defect A: SGLang returns rows, not elements; a [64, 64] weight is read back whole and a
    [300, 64] one as its first 100 rows, and both sides must fingerprint the same prefix."""
    from megappo.rollout.engine import compare_fingerprints
    from megappo.rollout.sglang_engine import SGLangEngine

    weights = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
               "model.embed_tokens.weight": torch.randn(300, 64), "model.norm.weight": torch.randn(64)}
    eng = SGLangEngine(None, pad_token_id=0, dtype="float32", engine=ReadbackOnly(weights))
    expected = {n: eng.fingerprint_of(n, t) for n, t in weights.items()}
    assert compare_fingerprints(expected, eng.fingerprints(weights)) == []
    changed = dict(weights, **{"model.embed_tokens.weight": weights["model.embed_tokens.weight"].clone()})
    changed["model.embed_tokens.weight"][99, 0] += 1  # inside the first 100 rows: seen
    assert compare_fingerprints(expected, SGLangEngine(None, pad_token_id=0, dtype="float32",
                                engine=ReadbackOnly(changed)).fingerprints(weights)) == ["model.embed_tokens.weight"]


def test_engine_tp_readback_rows(tmp_path):
    """At engine TP=2 SGLang reads a column-parallel weight back from its first shard only."""
    import json

    from megappo.rollout.sglang_engine import SGLangEngine

    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS["llama"]))
    eng = SGLangEngine(str(tmp_path), pad_token_id=0, engine=object(), engine_args={"tp_size": 2})
    assert eng.readback_rows("model.layers.0.self_attn.q_proj.weight", 64) == 32
    assert eng.readback_rows("model.layers.0.self_attn.k_proj.weight", 32) == 16  # 2 KV heads over 2 ranks
    assert eng.readback_rows("model.layers.0.mlp.gate_proj.weight", 128) == 64
    assert eng.readback_rows("model.layers.0.self_attn.o_proj.weight", 64) == 64  # gathered by SGLang
    assert eng.readback_rows("model.embed_tokens.weight", 300) == 100
    assert eng.readback_rows("model.norm.weight", 64) == 64


def test_unreadable_weight_is_a_weight_sync_error_naming_the_fix():
    """Defect B: get_weights_by_name answers None (Qwen2 in SGLang 0.5.23)."""
    from megappo.rollout.engine import WeightSyncError
    from megappo.rollout.sglang_engine import SGLangEngine

    eng = SGLangEngine(None, pad_token_id=0, engine=ReadbackOnly({}))
    with pytest.raises(WeightSyncError, match="Fix: set rollout.verify_every=0"):
        eng.fingerprints(["model.layers.0.self_attn.q_proj.weight"])


def test_engine_args_per_device():
    """Defects C and E: no base_gpu_id and a gloo update group without GPUs; the memory saver on
    GPUs for the colocated mode (release_memory frees nothing without it), refused on CPU."""
    from megappo.rollout.sglang_engine import SGLangEngine, sglang_engine_args

    kw = dict(tp_size=1, mem_fraction_static=0.5, dtype="float32", user_args={}, local_world_size=6)
    gpu_tensor = sglang_engine_args("m", sync_mode="tensor", cuda=True, **kw)
    assert gpu_tensor["enable_memory_saver"] is True and "device" not in gpu_tensor
    gpu_dist = sglang_engine_args("m", sync_mode="distributed", cuda=True, **kw)
    assert gpu_dist["base_gpu_id"] == 6 and "enable_memory_saver" not in gpu_dist
    # a node's further disaggregated replicas: each tp_size GPUs after the one before, from rollout.sglang's base too
    tp2 = dict(kw, tp_size=2)
    assert [sglang_engine_args("m", sync_mode="distributed", cuda=True, replica_slot=k, **tp2)["base_gpu_id"]
            for k in range(3)] == [6, 8, 10]
    assert sglang_engine_args("m", sync_mode="distributed", cuda=True, replica_slot=1,
                              **dict(tp2, user_args={"base_gpu_id": 4, "tp_size": 1}))["base_gpu_id"] == 5
    assert "base_gpu_id" not in sglang_engine_args("m", sync_mode="distributed", cuda=False, replica_slot=1, **kw)
    cpu_dist = sglang_engine_args("m", sync_mode="distributed", cuda=False, **kw)
    assert "base_gpu_id" not in cpu_dist and "enable_memory_saver" not in cpu_dist and cpu_dist["device"] == "cpu"
    assert cpu_dist["max_total_tokens"] == 32768 and "max_total_tokens" not in gpu_dist  # not GBs of host RAM
    assert sglang_engine_args("m", sync_mode="tensor", cuda=False,
                              **dict(kw, user_args={"max_total_tokens": 4096}))["max_total_tokens"] == 4096
    assert sglang_engine_args("m", sync_mode="tensor", cuda=True, **dict(kw, user_args={"enable_memory_saver": False}))[
        "enable_memory_saver"] is False  # rollout.sglang wins
    with pytest.raises(ValueError, match="enable_memory_saver needs CUDA"):
        sglang_engine_args("m", sync_mode="tensor", cuda=False, **dict(kw, user_args={"enable_memory_saver": True}))
    if not torch.cuda.is_available():
        eng = SGLangEngine(None, pad_token_id=0, sync_mode="distributed", engine=object())
        assert eng.update_backend == "gloo"


class Stuck:
    """sglang.Engine's methods, recording the thread each runs on; `generate` never returns (a call
    stuck where stopping SGLang's event loop cannot reach it)."""

    def __init__(self):
        self.threads, self.release = [], threading.Event()

    def get_weights_by_name(self, name, truncate_size=100):
        self.threads.append(threading.current_thread().name)
        return [[0.0]]

    def generate(self, **kwargs):
        self.release.wait()

    def shutdown(self):
        self.release.set()


def test_engine_calls_run_on_the_engine_thread_and_a_crash_frees_a_waiting_caller():
    """Every call into sglang.Engine is made by the engine's own thread, whichever thread asks
    (docs/engines.md, threads); a crash noted while a generation thread waits raises EngineCrashed
    there within CRASH_POLL_S, even if the call itself never returns; the next call raises at once."""
    from megappo.rollout.engine import EngineCrashed
    from megappo.rollout.sglang_engine import CRASH_POLL_S, SGLangEngine

    fake = Stuck()
    eng = SGLangEngine(None, pad_token_id=0, dtype="float32", engine=fake)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            eng.fingerprints(["model.norm.weight"])
            pool.submit(eng.fingerprints, ["model.norm.weight"]).result(timeout=10)
            assert fake.threads == ["megappo-sglang-engine"] * 2
            call = pool.submit(eng.generate, [[1, 2]], SamplingParams(max_new_tokens=1))
            time.sleep(2 * CRASH_POLL_S)
            assert not call.done()
            eng._note_death()  # what the engine's watcher does when one of its processes ends
            with pytest.raises(EngineCrashed, match="the sglang rollout engine crashed"):
                call.result(timeout=5 * CRASH_POLL_S)
        with pytest.raises(EngineCrashed):
            eng.fingerprints(["model.norm.weight"])
    finally:
        eng.shutdown()
