"""The CPU SGLang lane (`make test-sglang`): real SGLang 0.5.23 on CPU in its own virtualenv.

Runs in the venv that tests/sglang/setup_venv.sh builds (the main environment has no SGLang;
tests/conftest.py leaves this folder out there). Every test goes through megappo's own
classes. The stand-ins for CUDA-only pieces record any call in MEGAPPO_STANDIN_LOG; the session
fails if that file is not empty at the end, whichever process made the call.
"""

import os
import tempfile

import pytest

LANE = os.path.dirname(os.path.abspath(__file__))
STANDIN_LOG = os.path.join(tempfile.mkdtemp(prefix="megappo-standins-"), "calls.log")
os.environ["MEGAPPO_STANDIN_LOG"] = STANDIN_LOG  # inherited by SGLang's subprocesses and torchrun ranks


def pytest_sessionfinish(session, exitstatus):
    if os.path.exists(STANDIN_LOG) and os.path.getsize(STANDIN_LOG):
        with open(STANDIN_LOG) as f:
            print(f"\nCPU SGLang lane: a CUDA-only stand-in was called:\n{f.read()[:4000]}")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model

    path = tmp_path_factory.mktemp("tiny-llama")
    model = build_hf_model(TINY_CONFIGS["llama"], seed=0)
    # SGLang also stops at the model's own EOS ids (config.json, generation_config.json): none here,
    # so that the tests' SamplingParams alone decide where a response ends, as with the hf engine
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return str(path)
