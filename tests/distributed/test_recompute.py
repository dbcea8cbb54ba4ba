"""Activation recomputation (megappo.models.recompute) changes no gradient: one actor and one critic
PPO update, packed and padded, with full (uniform, block) and selective recomputation, bit-equal to
the update without it at TP2 and PP2, float32 and bf16 (packed) (workers/recompute_worker.py)."""

import pytest

from tests.distributed._launch import run_torchrun


@pytest.mark.parametrize("layout", [pytest.param(("2", "1"), id="tp2"), pytest.param(("1", "2"), id="pp2")])
def test_recomputation_gives_bit_equal_gradients(layout):
    out = run_torchrun("recompute_worker.py", 2, *layout)
    assert "ALL OK" in out
    for dtype, names in (("float32", ("full uniform 1", "full uniform 2", "full block 1", "selective core_attn+mlp")),
                         ("bfloat16", ("full uniform 1", "selective core_attn+mlp"))):
        for kind in ("packed", "padded") if dtype == "float32" else ("packed",):
            for name in names:
                assert f"OK {dtype} {kind} {name}: " in out, (dtype, kind, name)
