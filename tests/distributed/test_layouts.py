"""Several TP/PP layouts over the same ranks (per-role layouts): models built in each match
transformers and train like a plain-torch reference, with the layouts interleaved; in each,
full tensors stream to several receiving ranks as to rank 0 (workers/receivers_check.py)."""

from tests.distributed._launch import run_torchrun


def test_layouts_side_by_side():
    out = run_torchrun("layouts_worker.py", 2)
    assert "OK llama training tp=1 pp=2" in out and "OK llama training tp=1 pp=1 dp=2 dist_opt=True" in out
    assert "OK llama training tp=2 pp=1" in out and "ALL OK" in out
    for layout in ("tp=2 pp=1 dp=1", "tp=1 pp=2 dp=1", "tp=1 pp=1 dp=2"):
        assert f"OK receivers llama {layout} ep=1" in out, layout
