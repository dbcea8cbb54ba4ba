"""Real SGLang on CPU: the engine called from threads other than the one that created it, as
rollout.mode=one_step_off (a generation thread) and async (the generation thread also updates
weights; validation from the main thread) call it; one call at a time.

Its own engine, started after test_engine.py's module engine is gone (one engine per process).
"""

import concurrent.futures
import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from megappo.rollout.engine import compare_fingerprints
from megappo.types import SamplingParams
from tests.sglang.test_engine import PROMPTS, assert_close_logprobs, full_state, hf_model, start  # noqa: F401


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = start(tiny_llama_dir)
    yield eng
    eng.shutdown()


def on_thread(fn, *args):
    """fn(*args) on a fresh thread, as a schedule's generation thread calls the engine."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=300)


def test_calls_from_other_threads_equal_calls_from_the_creating_thread(engine, hf_model):
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    here = engine.generate(PROMPTS, greedy)
    there = on_thread(engine.generate, PROMPTS, greedy)
    assert torch.equal(here.response_ids, there.response_ids)
    assert torch.allclose(here.rollout_log_probs, there.rollout_log_probs, atol=1e-6)
    # a weight update and its verification from a generation thread, then from the main thread again
    new = full_state(seed=5)
    on_thread(engine.update_weights, [list(new.items())[:10], list(new.items())[10:]])
    expected = {name: engine.fingerprint_of(name, t) for name, t in new.items()}
    assert compare_fingerprints(expected, on_thread(engine.fingerprints, expected)) == []
    assert compare_fingerprints(expected, engine.fingerprints(expected)) == []
    hf_model.load_state_dict(new)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    assert_close_logprobs(on_thread(engine.generate, PROMPTS, sampled), hf_model, 1.0)
    assert_close_logprobs(engine.generate(PROMPTS, sampled), hf_model, 1.0)
    on_thread(engine.release_memory)
    on_thread(engine.resume_memory)
    after = on_thread(engine.generate, PROMPTS, greedy)
    assert torch.equal(after.response_ids, engine.generate(PROMPTS, greedy).response_ids)


def test_simultaneous_calls_from_two_threads_are_made_one_after_the_other(engine):
    """The schedules never call the engine from two threads at once; if two threads did, the
    engine's thread makes the calls in turn (SGLang's loop cannot run twice at the same time)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    alone = engine.generate(PROMPTS, greedy).response_ids
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(engine.generate, PROMPTS, greedy) for _ in range(2)]
        for call in calls:
            assert torch.equal(call.result(timeout=300).response_ids, alone)


CRASH = textwrap.dedent("""
    import concurrent.futures, sys, threading, time, psutil
    from megappo.rollout.sglang_engine import EngineCrashed, SGLangEngine
    from megappo.types import SamplingParams

    if __name__ == "__main__":
        eng = SGLangEngine(sys.argv[1], pad_token_id=0, dtype="float32", engine_args={"max_total_tokens": 4096})
        eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        pool = concurrent.futures.ThreadPoolExecutor(1)  # rollout.mode=one_step_off's generation thread
        long = SamplingParams(n=8, max_new_tokens=250)  # 16 x 8 x 250 tokens: a minute or more on CPU
        future = pool.submit(eng.generate, [[1, 2, 3 + i] for i in range(16)], long)
        time.sleep(3)
        assert not future.done(), future.result()
        for child in psutil.Process().children(recursive=True):
            if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
                child.kill()
        killed = time.monotonic()
        try:
            future.result(timeout=120)
            print("NO ERROR", flush=True)
        except EngineCrashed as e:
            print(f"RAISED after {time.monotonic() - killed:.1f} s:", e, flush=True)
        except BaseException as e:
            print("OTHER", type(e).__name__, e, flush=True)
        try:
            eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
            print("NEXT CALL NO ERROR", flush=True)
        except EngineCrashed as e:
            print("NEXT CALL RAISED", flush=True)
        eng.shutdown()
        pool.shutdown()
        time.sleep(1)
        left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
        print("LEFT", len(left), flush=True)
""")


def test_crash_during_a_background_generation_raises_in_the_caller(tiny_llama_dir, tmp_path):
    """A scheduler killed while a generation thread waits on the engine: EngineCrashed reaches the
    thread that waits for that generation within seconds, and the next call raises it too."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    proc = subprocess.run([sys.executable, str(script), tiny_llama_dir], capture_output=True, text=True,
                          timeout=400, env=dict(os.environ))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]  # SGLang's own handler would SIGKILL this process (-9)
    raised = [line for line in out.splitlines() if line.startswith("RAISED after")]
    assert raised and "the sglang rollout engine crashed" in raised[0], out[-4000:]
    assert float(raised[0].split()[2]) < 10, raised[0]
    assert "NEXT CALL RAISED" in out and "LEFT 0" in out, out[-4000:]


SIGNALS = textwrap.dedent("""
    import os, signal, sys, threading, psutil
    from megappo.parallel import interrupts
    from megappo.rollout.sglang_engine import SGLangEngine
    from megappo.types import SamplingParams

    if __name__ == "__main__":
        interrupts.install(announce=True)  # what `megappo train` does on every rank
        eng = SGLangEngine(sys.argv[1], pad_token_id=0, dtype="float32", engine_args={"max_total_tokens": 4096})
        eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        print("CHILDREN", *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
        for delay in (2, 4):  # SIGTERM twice, REPEAT_WINDOW_S apart, during a long generation
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
        eng.generate([[1, 2, 3 + i] for i in range(16)], SamplingParams(n=8, max_new_tokens=250))
        print("GENERATION ENDED", flush=True)
        eng.shutdown()
""")


def test_sigterm_during_an_engine_call_reaches_megappos_handling(tiny_llama_dir, tmp_path):
    """megappo.parallel.interrupts during a generation of the main thread (rollout.mode=sync): the first
    SIGTERM is acknowledged, the second stops the process at once (143). Its watcher thread wakes
    on the signal wakeup fd, which uvloop took while SGLang's event loop ran in the main thread:
    both went unheard until the generation ended."""
    script = tmp_path / "signals.py"
    script.write_text(SIGNALS)
    proc = subprocess.run([sys.executable, str(script), tiny_llama_dir], capture_output=True, text=True,
                          timeout=400, env=dict(os.environ))
    out = proc.stdout + proc.stderr
    children = [int(pid) for line in out.splitlines() if line.startswith("CHILDREN") for pid in line.split()[1:]]
    for pid in children:  # os._exit left the engine's processes behind: end them
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert "megappo: SIGTERM received: stopping after the step in progress" in out, out[-4000:]
    assert "megappo: interrupted again (SIGTERM): stopped at once" in out, out[-4000:]
    assert proc.returncode == 143 and "GENERATION ENDED" not in out, (proc.returncode, out[-4000:])
