"""The chunked LM head at TP=2 (torchrun, gloo), with and without sequence parallelism, against
Megatron's output layer + vocab-parallel log-probs (float32 and bfloat16), and the actor's PPO
update with `model.lm_head_chunk_tokens` on against off."""

import pytest

from tests.distributed._launch import run_torchrun

CASES = 2 * 2 * 2 * 3  # dtypes x sequence parallel x temperatures x chunk sizes


def test_chunked_head_equals_output_layer_and_vocab_parallel_at_tp2():
    out = run_torchrun("chunked_head_worker.py", 2, timeout=300)
    for rank in (0, 1):
        assert out.count(f"OK rank {rank} ") == CASES, out


@pytest.mark.parametrize("layout", [pytest.param(("2", "1"), id="tp2"), pytest.param(("1", "2"), id="pp2")])
def test_actor_with_chunked_head_equals_full_logits(layout):
    """token_stats and two PPO updates of the actor, lm_head_chunk_tokens on vs off, llama (untied)
    and qwen2 (tied embeddings), float32 and bfloat16, and a LoRA actor training its LM head
    (workers/chunked_head_update_worker.py)."""
    out = run_torchrun("chunked_head_update_worker.py", 2, *layout, "bf16", timeout=600)
    assert f"ALL OK tp={layout[0]} pp={layout[1]}" in out, out
    for family in ("llama", "qwen2"):
        for dtype in ("float32", "bfloat16"):
            assert f"OK {family} {dtype} token stats chunked = full logits" in out, out
            assert f"OK {family} {dtype} updates chunked = full logits" in out, out
    assert "OK llama float32 lora updates chunked = full logits" in out, out  # the LM head in modules_to_save
