"""The value head (critic, reward model) under sequence parallelism at TP=2 (torchrun, gloo)
against the head on the whole sequence. The full critic under sequence parallelism needs GPU
norms (Transformer Engine or apex), so this is the part of it that runs on CPU."""

from tests.distributed._launch import run_torchrun


def test_value_head_gathers_the_sequence_parallel_split():
    out = run_torchrun("value_head_sp_worker.py", 2, timeout=120)
    assert "OK rank 0" in out and "OK rank 1" in out, out
