"""Megatron DDP + optimizer + LR schedule: 3 AdamW steps at several TP/PP/DP layouts equal
a plain-torch reference (HF model + torch.optim.AdamW on the whole batch), Llama and Qwen2."""

import pytest

from tests.distributed._launch import run_torchrun

LAYOUTS = [
    pytest.param(2, ("1", "2"), id="pp2"),
    pytest.param(2, ("1", "1", "dist_opt"), id="dp2-distributed-optimizer"),
    pytest.param(4, ("2", "2"), id="tp2xpp2"),
    pytest.param(4, ("2", "1"), id="tp2xdp2"),
]


@pytest.mark.parametrize("nproc,args", LAYOUTS)
def test_training_steps_match_reference(nproc, args):
    out = run_torchrun("training_worker.py", nproc, *args)
    assert "ALL OK" in out
    assert "OK llama training" in out and "OK qwen2 training" in out
