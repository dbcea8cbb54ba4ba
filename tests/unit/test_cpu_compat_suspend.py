"""cpu_compat.suspended(): the device-remapping mode is off inside the block and back after,
and generation gives the same tokens and log-probs either way (a fresh process: enabling the
compatibility layer is process-wide)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = r"""
import torch
from megappo.parallel import cpu_compat
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.registry import build_engine
from megappo.types import SamplingParams

engine = build_engine("hf", model=build_hf_model(TINY_CONFIGS["llama"], seed=0), pad_token_id=0)
params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3, eos_token_ids=())
prompts = [[1, 2, 3, 4], [5, 6, 7]]
assert cpu_compat.enable()
with_mode = engine.generate(prompts, params)
with cpu_compat.suspended():
    try:
        torch.zeros(1, device="cuda")
        raise SystemExit("the mode was still active inside suspended()")
    except (RuntimeError, AssertionError):
        pass  # a CPU build of torch refuses CUDA: the remapping is off
    without = engine.generate(prompts, params)
assert torch.zeros(1, device="cuda").device.type == "cpu"  # back on after the block
assert torch.equal(with_mode.response_ids, without.response_ids)
assert torch.equal(with_mode.rollout_log_probs, without.rollout_log_probs)
print("OK")
"""


def test_suspended_mode_is_off_inside_and_results_are_equal():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
