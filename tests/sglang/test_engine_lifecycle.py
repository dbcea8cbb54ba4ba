"""Real SGLang on CPU: tests that start an engine of their own, one at a time.

SGLang's Engine.shutdown() kills every child process of the calling process, so two engines
cannot overlap in one process: these run after test_engine.py's module engine is gone.
"""

import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.engine import WeightSyncError, compare_fingerprints
from megappo.types import SamplingParams
from tests.sglang.test_engine import PROMPTS, assert_close_logprobs, hf_model, start  # noqa: F401


def test_untempered_logprobs(tiny_llama_dir, hf_model):
    eng = start(tiny_llama_dir, logprob_mode="untempered")
    try:
        batch = eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.6, max_new_tokens=8, logprob_mode="untempered"))
        assert batch.logprob_mode == "untempered"
        assert_close_logprobs(batch, hf_model, 1.0)
    finally:
        eng.shutdown()


def test_engine_tp2_generates_and_verifies(tiny_llama_dir, hf_model):
    """rollout.sglang.tp_size=2 on CPU (one core per engine rank): greedy tokens equal
    transformers', and verification passes although SGLang reads column-parallel weights back
    from its first rank's shard."""
    eng = start(tiny_llama_dir, engine_args={"tp_size": 2})
    try:
        batch = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))
        assert_close_logprobs(batch, hf_model, 1.0)
        new = build_hf_model(TINY_CONFIGS["llama"], seed=11).state_dict()
        eng.update_weights([list(new.items())])
        expected = {name: eng.fingerprint_of(name, t) for name, t in new.items()}
        assert compare_fingerprints(expected, eng.fingerprints(expected)) == []
    finally:
        eng.shutdown()


def test_qwen2_readback_is_a_weight_sync_error(tmp_path):
    """Defect B: SGLang 0.5.23 cannot read Qwen2 weights back; the error names the fix."""
    build_hf_model(TINY_CONFIGS["qwen2"], seed=0).save_pretrained(tmp_path)
    eng = start(str(tmp_path))
    try:
        with pytest.raises(WeightSyncError, match="rollout.verify_every=0"):
            eng.fingerprints(["model.layers.0.self_attn.q_proj.weight"])
    finally:
        eng.shutdown()


def test_shutdown_leaves_no_process(tiny_llama_dir):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    eng = start(tiny_llama_dir)
    started = {p.pid for p in me.children(recursive=True)} - before
    assert started, "SGLang started no process?"
    eng.shutdown()
    alive = [p for p in map(lambda pid: psutil.Process(pid) if psutil.pid_exists(pid) else None, started)
             if p is not None and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive


CRASH = textwrap.dedent("""
    import os, signal, sys, time, psutil
    from megappo.rollout.sglang_engine import EngineCrashed, SGLangEngine
    from megappo.types import SamplingParams

    if __name__ == "__main__":
        eng = SGLangEngine(sys.argv[1], pad_token_id=0, dtype="float32", engine_args={"max_total_tokens": 2048})
        eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        print("GENERATED", flush=True)
        for child in psutil.Process().children(recursive=True):
            if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
                child.kill()
        try:
            for _ in range(100):
                eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
                time.sleep(0.1)
        except EngineCrashed as e:
            print("RAISED", e, flush=True)
        eng.shutdown()
        time.sleep(1)
        left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
        print("LEFT", len(left), flush=True)
""")


def test_engine_crash_is_an_error_not_a_hang_or_a_killed_trainer(tiny_llama_dir, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    proc = subprocess.run([sys.executable, str(script), tiny_llama_dir], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]  # SGLang's own handler would SIGKILL this process (-9)
    assert "RAISED the sglang rollout engine crashed" in out, out[-4000:]
    assert "LEFT 0" in out, out[-4000:]
