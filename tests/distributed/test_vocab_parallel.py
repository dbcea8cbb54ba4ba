"""Vocab-parallel log-probs and entropy at TP=2 equal the full-vocabulary versions
(values and gradients, with -inf padding logits)."""

from tests.distributed._launch import run_torchrun


def test_vocab_parallel_matches_full_vocab():
    out = run_torchrun("vocab_parallel_worker.py", 2)
    assert out.count("values and grads match full vocab") == 2
