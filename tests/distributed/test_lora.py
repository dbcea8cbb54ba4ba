"""LoRA adapters in Megatron's tensor-parallel layers (megappo.models.lora) equal a plain-torch
LoRA on the HF model after 3 AdamW steps, at TP2 and PP2; the base view (adapters off) gives the
base model's log-probs bit-exactly; a LoRA trainer checkpoint resumes bit-identically in
float32 and bf16; full recomputation gives the adapters bit-equal gradients; an hf engine synced with
adapters only (rollout.lora_sync=adapters) holds the same model as one synced merged, float32 and bf16,
its second sync moving only the adapters' and lm_head's bytes (workers/lora_worker.py)."""

import pytest

from tests.distributed._launch import run_torchrun


@pytest.mark.parametrize("layout", [pytest.param(("2", "1"), id="tp2"), pytest.param(("1", "2"), id="pp2")])
def test_lora_equals_plain_torch_reference(layout):
    out = run_torchrun("lora_worker.py", 2, *layout)
    assert "ALL OK" in out
    for family in ("llama", "qwen2"):
        assert f"OK {family} lora tp={layout[0]} pp={layout[1]}" in out, family
    for dtype in ("float32", "bfloat16"):
        assert f"OK lora resume {dtype} tp={layout[0]} pp={layout[1]}" in out, dtype
    assert f"OK lora recompute tp={layout[0]} pp={layout[1]}" in out
    for dtype in ("float32", "bfloat16"):
        assert f"OK lora adapter sync {dtype} tp={layout[0]} pp={layout[1]}" in out, dtype
