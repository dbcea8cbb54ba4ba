"""Packed passes (token-budget micro-batches, no padding) equal padded ones and transformers run
on each sequence alone, for every role's forward pass and for actor and critic updates under
every loss_agg_mode, at TP2, PP2, DP2 and PP2xVPP2 (workers/packing_worker.py); at TP2 and PP2 the
bf16 forward passes too, against the exact values of the bf16 weights. Every policy loss of the registry
through the packed trainer equals the loss function on the whole batch, single rank (fp32 at every
layout, bf16 at TP2 and PP2)."""

import pytest

from tests.distributed._launch import run_torchrun

LAYOUTS = [
    pytest.param(("2", "1", "bf16"), id="tp2"),
    pytest.param(("1", "2", "bf16"), id="pp2"),
    pytest.param(("1", "1"), id="dp2"),
    pytest.param(("1", "2", "2"), id="pp2xvpp2"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_padded_and_transformers(layout):
    out = run_torchrun("packing_worker.py", 2, *layout, timeout=600)
    assert "ALL OK" in out
    for family in ("llama", "qwen2"):
        for kind in ("packed", "padded"):
            assert f"OK {family} {kind} forward = transformers per sequence" in out
        assert f"OK {family} updates packed = padded, every loss_agg_mode" in out
        if "bf16" in layout:
            for kind in ("packed", "padded"):
                assert f"OK {family} bf16 {kind} forward = exact values" in out
    for dtype in ("float32", "bfloat16") if "bf16" in layout else ("float32",):
        assert f"OK llama {dtype} policy losses through the trainer = whole batch, single rank" in out
