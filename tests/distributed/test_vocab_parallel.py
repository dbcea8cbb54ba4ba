"""Vocab-parallel log-probs and entropy at TP=2 (torchrun, gloo) vs the full vocabulary."""

from tests.distributed._launch import run_torchrun


def test_vocab_parallel_log_probs_and_entropy_match_full_vocab_at_tp2():
    out = run_torchrun("vocab_parallel_worker.py", 2, timeout=120)
    for rank in (0, 1):
        assert out.count(f"OK rank {rank}") == 9, out
