"""Model + optimizer + LR-scheduler checkpoints: exact resume and resharded resume (2 ranks).

Both tests read one launch of workers/checkpoint_worker.py that runs the float32 checks, then the bf16 ones."""

import pytest

from tests.distributed._launch import run_torchrun


@pytest.fixture(scope="module")
def fp32_and_bf16(tmp_path_factory):
    return run_torchrun("checkpoint_worker.py", 2, str(tmp_path_factory.mktemp("checkpoints")), "fp32", "bf16",
                        timeout=600)


def test_trainable_checkpoint_resumes_exactly_and_reshards(fp32_and_bf16):
    out = fp32_and_bf16
    assert "OK dist_opt=False" in out and "OK dist_opt=True" in out and "ALL OK" in out


def test_bf16_checkpoint_resumes_exactly_and_exports_bf16(fp32_and_bf16):
    """bf16 (every GPU recipe's dtype): actor and critic, plain and distributed optimizer, TP2/PP2/DP2/EP2,
    tied and untied embeddings. Before megappo.models.precision, the save itself raised."""
    out = fp32_and_bf16
    assert out.count("OK bf16 ") == 9 and "ALL OK" in out, out[-3000:]
