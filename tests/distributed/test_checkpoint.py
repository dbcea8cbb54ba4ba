"""Model + optimizer + LR-scheduler checkpoints: exact resume and resharded resume (2 ranks)."""

from tests.distributed._launch import run_torchrun


def test_trainable_checkpoint_resumes_exactly_and_reshards(tmp_path):
    out = run_torchrun("checkpoint_worker.py", 2, str(tmp_path))
    assert "OK dist_opt=False" in out and "OK dist_opt=True" in out and "ALL OK" in out


def test_bf16_checkpoint_resumes_exactly_and_exports_bf16(tmp_path):
    """bf16 (every GPU recipe's dtype): actor and critic, plain and distributed optimizer, TP2/PP2/DP2/EP2,
    tied and untied embeddings. Before megappo.models.precision, the save itself raised."""
    out = run_torchrun("checkpoint_worker.py", 2, str(tmp_path), "bf16", timeout=600)
    assert out.count("OK bf16 ") == 9 and "ALL OK" in out, out[-3000:]
