"""Model + optimizer + LR-scheduler checkpoints: exact resume and resharded resume (2 ranks)."""

from tests.distributed._launch import run_torchrun


def test_trainable_checkpoint_resumes_exactly_and_reshards(tmp_path):
    out = run_torchrun("checkpoint_worker.py", 2, str(tmp_path))
    assert "OK dist_opt=False" in out and "OK dist_opt=True" in out and "ALL OK" in out
