"""A role's starting weights from a Megatron dist checkpoint saved at TP=2, loaded at PP=2, PP=2 x VPP=2 and
DP=2 (actor and critic, untied and tied embeddings): workers/dist_weights_worker.py."""

from tests.distributed._launch import run_torchrun


def test_a_dist_checkpoint_loads_at_another_layout_as_the_hf_weights_do(tmp_path):
    out = run_torchrun("dist_weights_worker.py", 2, str(tmp_path))
    for family in ("llama", "qwen2"):
        for layout in ("pp2", "pp2xvpp2", "dp2"):
            assert f"OK {family} {layout} actor" in out and f"OK {family} {layout} critic" in out, out[-3000:]
    assert "ALL OK" in out
