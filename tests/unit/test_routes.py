"""Routing replay, engine side: the hf engine's recorded routes are the routes a teacher-forced
forward pass over the finished sequences takes (the slow, obviously-correct reference)."""

import base64

import numpy as np
import pytest
import torch

from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.routes import UNKNOWN, RouteRecorder, decode_sglang_routes, fill_unknown
from megappo.types import SamplingParams


def tiny_moe(arch: str):
    torch.manual_seed(0)
    if arch == "Qwen3MoeForCausalLM":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(vocab_size=50, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True)
        return Qwen3MoeForCausalLM(cfg).eval()
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=50, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(cfg).eval()


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_engine_routes_equal_a_teacher_forced_pass(arch):
    model = tiny_moe(arch)
    engine = HFEngine(model, pad_token_id=0)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]]  # unequal lengths: left padding
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, eos_token_ids=(3,), seed=1,
                            return_routes=True)
    batch = engine.generate(prompts, params)
    ids, mask = batch.sequences()
    n, t = ids.shape
    layers = model.config.num_hidden_layers
    assert batch.routes.shape == (n, t, layers, 2) and batch.routes.dtype == torch.int16
    recorder = RouteRecorder(model, arch, 2)
    for i in range(n):
        real = ids[i][mask[i].bool()]
        with torch.no_grad(), recorder:
            model(input_ids=real[None])
        reference = recorder.take(1, real.numel())[0]  # [len, L, k]
        got = batch.routes[i][mask[i].bool()]
        # every position but the last (the engine never feeds the last sampled token)
        assert torch.equal(got[:-1], reference[:-1]), (i, got[:-1], reference[:-1])
        assert (got[-1] == UNKNOWN).all()
        assert (batch.routes[i][~mask[i].bool()] == UNKNOWN).all()
    if arch == "Qwen3MoeForCausalLM":  # mlp_only_layers=[1]: a dense layer has no route
        assert (batch.routes[:, :, 1] == UNKNOWN).all()
        assert (batch.routes[:, :, 0] >= 0).any()


def test_routes_are_off_by_default():
    batch = HFEngine(tiny_moe("MixtralForCausalLM"), pad_token_id=0).generate(
        [[5, 6]], SamplingParams(max_new_tokens=2, seed=0))
    assert batch.routes is None


def test_a_dense_model_refuses_to_record():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="actor.moe_routing=recompute"):
        HFEngine(model, pad_token_id=0).generate([[5, 6]], SamplingParams(max_new_tokens=2, return_routes=True))


def test_fill_unknown_and_sglang_decoding():
    routes = torch.tensor([[[1, 3], [UNKNOWN, UNKNOWN]], [[2, 0], [3, 1]]], dtype=torch.int16)  # [T=2, L=2, k=2]
    filled, known = fill_unknown(routes)
    assert known.tolist() == [[True, False], [True, True]]
    assert filled[0, 1].tolist() == [0, 1] and torch.equal(filled[1], routes[1])
    raw = np.arange(3 * 2 * 2, dtype=np.int32)
    decoded = decode_sglang_routes(base64.b64encode(raw.tobytes()).decode(), num_layers=2, top_k=2)
    assert decoded.shape == (3, 2, 2) and decoded.flatten().tolist() == raw.tolist()
