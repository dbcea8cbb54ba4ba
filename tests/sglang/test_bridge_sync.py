"""The real bridge from a Megatron actor (torchrun, gloo) into real SGLang on CPU, in the three
sync modes, at actor TP=1 and PP=2 in float32, and at TP=2 in bf16, every GPU recipe's dtype,
through the tensor and distributed modes (tests/sglang/workers/sglang_bridge_worker.py). (TP=2 in
float32 left CI, for time: its gather is bf16's, its dtype TP=1's and PP=2's.)"""

import pytest

from tests.distributed._launch import run_torchrun
from tests.sglang.conftest import LANE

WORKER = f"{LANE}/workers/sglang_bridge_worker.py"


@pytest.mark.parametrize("nproc,tp,pp,modes,dtype", [
    (1, 1, 1, "tensor,disk,distributed", "float32"),
    (2, 1, 2, "disk,tensor", "float32"),
    (2, 2, 1, "tensor,distributed", "bfloat16"),
])
def test_bridge_into_sglang(tiny_llama_dir, nproc, tp, pp, modes, dtype):
    out = run_torchrun(WORKER, nproc, tp, pp, modes, tiny_llama_dir, dtype, timeout=900)
    for mode in modes.split(","):
        assert f"OK {mode} tp={tp} pp={pp} {dtype} verified sync x2" in out, out[-4000:]
    assert out.count("OK corrupted bucket detected") == nproc, out[-4000:]
    assert "ALL OK" in out
