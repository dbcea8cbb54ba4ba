"""The chunked LM head at TP=2 (torchrun, gloo), with and without sequence parallelism, against
Megatron's output layer + vocab-parallel log-probs (float32 and bfloat16), and the actor's PPO
update with `model.lm_head_chunk_tokens` on against off."""

from tests.distributed._launch import run_torchrun

CASES = 2 * 2 * 2 * 3  # dtypes x sequence parallel x temperatures x chunk sizes


def test_chunked_head_equals_output_layer_and_vocab_parallel_at_tp2():
    out = run_torchrun("chunked_head_worker.py", 2, timeout=300)
    for rank in (0, 1):
        assert out.count(f"OK rank {rank} ") == CASES, out
