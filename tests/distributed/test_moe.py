"""Mixture-of-experts models (tiny Qwen3-MoE and Mixtral) with expert parallelism, gloo ranks.

workers/moe_worker.py: logits equal transformers' (<= 1e-4), gradients equal transformers'
(the EP=1 reference) after Megatron's data / expert-data-parallel sums, and the gather back
to per-expert HF checkpoint names is bit-exact, and the router metrics (aux loss, expert load,
tokens dropped) equal those of transformers' routers, at EP2 (2 ranks) and PP2xEP2 (4 ranks; TP>1
with MoE needs sequence parallelism, which is GPU-only); full tensors stream to several receiving
ranks as to rank 0 (workers/receivers_check.py), at 4 ranks also at DP4xEP2 (two EP groups) and
for a dense model at TP2xPP2. workers/bridge_worker.py at EP2:
a sync into the hf engine (transformers' fused experts) is bit-exact, fingerprints compare
per checkpoint name, and the engine's log-probs equal the Megatron actor's.
workers/checkpoint_worker.py with `moe` at EP2: exact resume, weights resharded to EP1 bit for bit,
optimizer state refused across the EP1 / EP>1 boundary; and LoRA adapters on every linear, the
experts' included: every expert's adapter trains on both EP ranks while the base (experts included)
stays frozen and out of the optimizer, a LoRA trainer checkpoint resumes bit-exactly, and the
merged weights reshard to EP1 bit for bit.
"""

import pytest

from tests.distributed._launch import run_torchrun

FAMILIES = ("qwen3_moe", "mixtral")


@pytest.mark.parametrize("nproc,layout", [pytest.param(2, (1, 1, 2), id="ep2"),
                                          pytest.param(4, (1, 2, 2), id="pp2xep2")])
def test_moe_matches_transformers(nproc, layout):
    out = run_torchrun("moe_worker.py", nproc, *layout)
    assert "ALL OK" in out
    for family in FAMILIES:
        assert f"OK {family} logits left-padded" in out and f"OK {family} gather bit-exact" in out
        assert out.count(f"OK {family} grads") == nproc and f"OK {family} router metrics" in out
    tp, pp, ep = layout
    assert f"OK receivers qwen3_moe tp={tp} pp={pp} dp={nproc // (tp * pp)} ep={ep}" in out
    if nproc == 4:
        assert "OK receivers qwen3_moe tp=1 pp=1 dp=4 ep=2" in out and "OK receivers llama tp=2 pp=2 dp=1 ep=1" in out


def test_moe_bridge_sync_at_ep2():
    out = run_torchrun("bridge_worker.py", 2, 1, 1, 2, "families=" + ",".join(FAMILIES))
    assert "ALL OK" in out
    for family in FAMILIES:
        assert f"OK {family} sync bit-exact" in out and f"OK {family} logprob agreement" in out
        assert out.count(f"OK {family} corrupted bucket detected") == 2


def test_moe_checkpoint_at_ep2(tmp_path):
    # exact resume at EP2 (chained expert optimizer), weights resharded to EP1 bit for bit,
    # and optimizer state across the EP1 / EP>1 boundary refused with the fix named; then the same
    # with LoRA adapters on the experts (rank 4, all linears): they train, resume and reshard exactly
    out = run_torchrun("checkpoint_worker.py", 2, str(tmp_path), "moe")
    assert "OK moe: exact resume at ep=2; weights resharded to ep=1 bit-exact" in out and "ALL OK" in out
    assert "OK moe lora: 24 expert adapters B trained at ep=2" in out  # 3 MoE layers x 4 experts x fc1, fc2
    assert "exact resume" in out.split("OK moe lora:")[1] and "merged weights resharded to ep=1 bit-exact" in out
