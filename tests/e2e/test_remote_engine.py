"""rollout.placement=separate: the hf engine in a child process (megappo.rollout.hf.remote) gives the
colocated engine's tokens and log-probs, serves requests in order (an update sent while a
generation runs applies after it), verifies weights by fingerprint, and a dead child raises
EngineCrashed with its exit code instead of hanging. (Spawns one child process per test module.)"""

import os
import signal
import time

import pytest
import torch

from megappo.models.hf_reference import TINY_CONFIGS
from megappo.rollout.engine import EngineCrashed, compare_fingerprints, tensor_fingerprint
from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.hf.remote import HFModelSource, RemoteEngine
from megappo.types import SamplingParams
from tests import prefork

pytestmark = pytest.mark.alone  # a crash is noticed within seconds (tests/conftest.py)

PAD = 0
PROMPTS = [[5, 17, 42, 9, 100], [7, 3], [250, 251, 252]]
SOURCE = HFModelSource(hf_config=TINY_CONFIGS["llama"], seed=3)
PARAMS = SamplingParams(n=2, temperature=0.9, top_k=50, top_p=0.95, max_new_tokens=8, seed=11)


@pytest.fixture(scope="module")
def remote():
    engine = RemoteEngine(SOURCE, pad_token_id=PAD, cores=sorted(os.sched_getaffinity(0))[:1])
    yield engine
    engine.shutdown()


#: The child runs pinned to one core with one thread; this process with as many as OMP_NUM_THREADS (or
#: torch's default) gives it. The same float32 math summed in another order differs in the last bits
#: (1e-6 seen on 2 cores), so log-probs are compared within this tolerance and the tokens exactly.
LOGPROB_ATOL = 1e-5


def assert_same(a, b):
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.rollout_log_probs, b.rollout_log_probs, rtol=0, atol=LOGPROB_ATOL)
    assert a.finish_reasons == b.finish_reasons and torch.equal(a.prompt_index, b.prompt_index)


def perturbed(model, scale: float):
    """Every weight of `model` plus `scale` x a seeded perturbation, as one bucket."""
    gen = torch.Generator().manual_seed(int(scale * 1000))
    return [(n, p.detach() + scale * torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]


def test_separate_equals_colocated(remote):
    local = HFEngine(SOURCE(), pad_token_id=PAD)
    assert_same(remote.generate(PROMPTS, PARAMS), local.generate(PROMPTS, PARAMS))
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    assert_same(remote.generate(PROMPTS, greedy), local.generate(PROMPTS, greedy))


def test_update_sent_during_a_generation_applies_after_it(remote):
    local = HFEngine(SOURCE(), pad_token_id=PAD)
    before = local.generate(PROMPTS, PARAMS)
    bucket = perturbed(local.model, 0.05)
    handle = remote.submit(PROMPTS, PARAMS)  # in flight while the update is sent
    remote.update_weights([bucket[:3], bucket[3:]])
    local.update_weights([bucket])
    after = local.generate(PROMPTS, PARAMS)
    assert not torch.equal(before.response_ids, after.response_ids)  # the update changes the samples
    assert_same(handle.result(), before)  # the generation ran on the weights it was submitted with
    assert_same(remote.generate(PROMPTS, PARAMS), after)
    expected = {n: remote.fingerprint_of(n, t) for n, t in bucket}
    assert compare_fingerprints(expected, remote.fingerprints(expected)) == []
    got = remote.fingerprints(expected)
    assert all(torch.equal(got[n], tensor_fingerprint(t)) for n, t in bucket)


def test_a_bad_request_raises_in_the_caller_and_the_engine_stays_usable(remote):
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        remote.update_weights([[("nope", torch.zeros(2))]])
    assert remote.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=2)).num_samples == 3


def test_a_dead_child_raises_engine_crashed_with_its_exit_code():
    engine = RemoteEngine(SOURCE, pad_token_id=PAD)
    try:
        long = SamplingParams(n=8, temperature=1.0, max_new_tokens=2000, seed=0)
        handle = engine.submit(PROMPTS * 8, long)  # still running when the child is killed
        time.sleep(0.5)
        os.kill(engine.pid, signal.SIGKILL)
        start = time.perf_counter()
        with pytest.raises(EngineCrashed, match="killed by signal 9"):
            handle.result()
        assert time.perf_counter() - start < 10
        with pytest.raises(EngineCrashed, match="killed by signal 9"):  # and every later call
            engine.generate(PROMPTS, PARAMS)
    finally:
        engine.shutdown()


def test_the_child_ends_when_the_trainer_is_killed(tmp_path):
    """SIGKILL of the process that owns the engine (no cleanup runs): the child sees its pipe
    close and exits, so no engine process outlives a killed run."""
    import subprocess
    import sys

    import psutil

    script = ("import os, signal\n"
              "from megappo.models.hf_reference import TINY_CONFIGS\n"
              "from megappo.rollout.hf.remote import HFModelSource, RemoteEngine\n"
              "if __name__ == '__main__':\n"
              "    e = RemoteEngine(HFModelSource(hf_config=TINY_CONFIGS['llama'], seed=3), pad_token_id=0)\n"
              "    print(e.pid, flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    path = tmp_path / "owner.py"
    path.write_text(script)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = prefork.popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"))
    line = proc.stdout.readline()  # not read to the end: a surviving child would hold the pipe open
    assert proc.wait(timeout=300) == -signal.SIGKILL and line.strip().isdigit(), line
    child = psutil.Process(int(line))
    try:
        child.wait(timeout=30)
    except psutil.TimeoutExpired:
        child.kill()
        pytest.fail("the engine's process outlived its killed owner")


def test_a_bucket_crosses_as_one_shared_buffer_not_through_the_pipe():
    """update_weights puts each bucket's tensors in one shared-memory buffer (64-byte aligned, any
    dtype and shape); the request that crosses the pipe carries a file descriptor and the layout,
    not the bytes; the child's views equal what was sent."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from megappo.rollout.hf.remote import _cut, _shared_bucket

    bucket = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.arange(3)),
              ("d", torch.tensor(2.5)), ("e", torch.randn(256, 1024))]  # 1 MiB
    flat, layout = _shared_bucket(bucket)
    assert flat.is_shared() and all(offset % 64 == 0 for *_, offset, _ in layout)
    assert len(ForkingPickler.dumps(("update", (flat, layout)), pickle.HIGHEST_PROTOCOL)) < 4096
    for (name, sent), (got_name, got) in zip(bucket, _cut(flat, layout)):
        assert got_name == name and got.dtype == sent.dtype and torch.equal(got, sent)
