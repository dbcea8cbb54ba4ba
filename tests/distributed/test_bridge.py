"""The weight-sync bridge at TP2, PP2 and TP2xPP2 (tiny Llama and Qwen2, gloo ranks).

Checks of workers/bridge_worker.py: bit-exact engine weights after a sync of perturbed
actor weights, fingerprints, a corrupted bucket detected on every rank, and the engine's
log-probs equal to the Megatron actor's (<= 1e-4).
"""

import pytest

from tests.distributed._launch import run_torchrun


@pytest.mark.parametrize("nproc,tp,pp", [(2, 2, 1), (2, 1, 2), (4, 2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_bridge_sync(nproc, tp, pp):
    out = run_torchrun("bridge_worker.py", nproc, tp, pp)
    assert "ALL OK" in out
    for family in ("llama", "qwen2"):
        assert f"OK {family} sync bit-exact" in out and f"OK {family} logprob agreement" in out
        assert out.count(f"OK {family} corrupted bucket detected") == nproc
