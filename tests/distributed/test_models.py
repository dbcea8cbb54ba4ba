"""Megatron models at TP1, TP2, PP2, TP2xPP2 and PP2xVPP2 against transformers (gloo ranks).

Each launch runs every check of workers/model_worker.py for tiny Llama and Qwen2:
logits (fp32, <= 1e-4), gradients through the name map, bit-exact gather back to HF
tensors, and the critic's [B, T] values. At TP2 and PP2 the same launch also checks Qwen3
(`QWEN3`), which the second test reads.
"""

import pytest

from tests.distributed._launch import run_torchrun

LAYOUTS = [
    pytest.param(1, (1, 1), id="tp1"),
    pytest.param(2, (2, 1), id="tp2"),
    pytest.param(2, (1, 2), id="pp2"),
    pytest.param(4, (2, 2), id="tp2xpp2"),
    pytest.param(2, (1, 2, 2), id="pp2xvpp2"),
]
#: the layouts whose launch also checks Qwen3: q/k RMSNorm over head_dim, head_dim (32) != hidden / heads (16),
#: no qkv bias
QWEN3 = {(2, 1): "tp2", (1, 2): "pp2"}


@pytest.fixture(scope="module")
def model_worker():
    """workers/model_worker.py's output at a layout, launched once for the module (both tests read it)."""
    outputs = {}

    def at(nproc: int, layout: tuple) -> str:
        if layout not in outputs:
            families = "llama,qwen2,qwen3" if layout in QWEN3 else "llama,qwen2"
            outputs[layout] = run_torchrun("model_worker.py", nproc, *layout, f"families={families}")
        return outputs[layout]

    return at


@pytest.mark.parametrize("nproc,layout", LAYOUTS)
def test_megatron_matches_transformers(model_worker, nproc, layout):
    out = model_worker(nproc, layout)
    assert "ALL OK" in out
    for family in ("llama", "qwen2"):
        assert f"OK {family} grads" in out and f"OK {family} gather bit-exact" in out
        assert f"OK {family} critic values" in out


@pytest.mark.parametrize("nproc,layout", [pytest.param(2, layout, id=name) for layout, name in QWEN3.items()])
def test_qwen3_matches_transformers(model_worker, nproc, layout):
    out = model_worker(nproc, layout)
    assert "ALL OK" in out
    assert "OK qwen3 grads" in out and "OK qwen3 gather bit-exact" in out and "OK qwen3 critic values" in out
