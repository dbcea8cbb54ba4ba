"""The decode step's kernels (megappo.rollout.hf.decode_kernels) against transformers' own pieces: RoPE bit for
bit (fp32 and bf16, GQA, one and several positions, each supported model family's function); RMSNorm bit for
bit in fp32 and within one bf16 rounding in bf16, equal to the trainer's torch.nn.RMSNorm; the grouped
attention against attention over K and V repeated per query head; and `StepKernels` reaching every norm and
RoPE call of each supported model during a step, undoing it all after one (also one that raised), and
steps in two threads taking turns.
"""

import importlib

import pytest
import torch

from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.hf import decode_kernels
from megappo.rollout.hf.decode_kernels import (GROUPED_DECODE, StepKernels, grouped_decode_attention, rms_norm,
                                            rope)
from megappo.rollout.hf.decode_paths import STATIC_MODEL_TYPES

FAMILIES = sorted(STATIC_MODEL_TYPES)  # llama, qwen2, qwen3


def modeling(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_rope_is_transformers_rope_bit_for_bit(family, dtype):
    gen = torch.Generator().manual_seed(1)
    for heads, kv_heads, positions, dim in ((4, 2, 1, 16), (3, 3, 5, 8), (8, 1, 1, 64)):
        q = torch.randn(2, heads, positions, dim, generator=gen).to(dtype)
        k = torch.randn(2, kv_heads, positions, dim, generator=gen).to(dtype)
        angles = torch.rand(2, positions, dim // 2, generator=gen) * 50
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
        want = modeling(family).apply_rotary_pos_emb(q, k, cos, sin)
        got = rope(q, k, cos, sin)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # [b, s, heads, d]: unsqueeze_dim=2
        for g, w in zip(rope(qt, kt, cos, sin, 2), modeling(family).apply_rotary_pos_emb(qt, kt, cos, sin, 2)):
            assert torch.equal(g, w)
    # sin with halves that differ (rope variants): still transformers' function
    sin = torch.randn(2, 1, 16, generator=gen).to(dtype)
    q, k = torch.randn(2, 4, 1, 16, generator=gen).to(dtype), torch.randn(2, 2, 1, 16, generator=gen).to(dtype)
    assert all(torch.equal(g, w) for g, w in zip(rope(q, k, sin.cos(), sin),
                                                 modeling(family).apply_rotary_pos_emb(q, k, sin.cos(), sin)))


@pytest.mark.parametrize("family", FAMILIES)
def test_rms_norm_is_transformers_norm_in_fp32_and_the_trainers_in_bf16(family):
    gen = torch.Generator().manual_seed(2)
    norm = getattr(modeling(family), f"{family.capitalize()}RMSNorm")(32, eps=1e-6)
    torch.nn.init.normal_(norm.weight, generator=gen)
    hidden = torch.randn(3, 5, 32, generator=gen) * 4
    assert torch.equal(rms_norm(norm, hidden), norm(hidden))
    trainer = torch.nn.RMSNorm(32, eps=1e-6)
    norm, trainer = norm.to(torch.bfloat16), trainer.to(torch.bfloat16)
    with torch.no_grad():
        trainer.weight.copy_(norm.weight)
    hidden = hidden.to(torch.bfloat16)
    got, hf = rms_norm(norm, hidden), norm(hidden)
    assert got.dtype == torch.bfloat16 and torch.equal(got, trainer(hidden))
    # one bf16 rounding apart: the weight's product rounded once, not twice
    assert ((got.float() - hf.float()).abs() <= 2 ** -7 * hf.float().abs() + 1e-6).all()
    assert not torch.equal(got, hf)  # the inputs are chosen so that the order shows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_attention_equals_attention_over_repeated_heads(dtype):
    """The step's attention: one query token per row, query heads grouped by their KV head (g = 1, 2, 4), over a
    window of a longer cache (keys / values not contiguous) with a per-row mask (boolean and additive), against
    softmax(q k^T) v in float64 with K and V repeated per query head as transformers' `repeat_kv` does: within
    1e-6 in fp32, one bf16 rounding (8e-3) in bf16. More than one query token goes to transformers' SDPA."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    for groups in (1, 2, 4):
        b, kv_heads, cache, window, dim = 3, 2, 96, 64, 16
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = groups, True
        query = torch.randn(b, kv_heads * groups, 1, dim, generator=gen).to(dtype)
        keys, values = (torch.randn(b, kv_heads, cache, dim, generator=gen).to(dtype) for _ in range(2))
        mask = torch.rand(b, 1, 1, window, generator=gen) < 0.7
        mask[..., 0] = True
        k, v = (repeat_kv(x[:, :, :window].double(), groups) for x in (keys, values))
        scores = (query.double() @ k.transpose(-1, -2) * dim ** -0.5).masked_fill(~mask, float("-inf"))
        want = (scores.softmax(-1) @ v).transpose(1, 2)
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
        results = [grouped_decode_attention(module, query, keys[:, :, :window], values[:, :, :window], m,
                                            scaling=dim ** -0.5) for m in (mask, additive)]
        for got, weights in results:
            assert got.shape == (b, 1, kv_heads * groups, dim) and got.dtype == dtype and weights is None
            assert (got.double() - want).abs().max() <= (1e-6 if dtype == torch.float32 else 8e-3)
        assert torch.equal(results[0][0], results[1][0])  # SDPA makes a boolean mask this additive one
    prompt = torch.randn(b, kv_heads * groups, 5, dim, generator=gen).to(dtype)
    k5, v5 = keys[:, :, :5], values[:, :, :5]
    assert torch.equal(grouped_decode_attention(module, prompt, k5, v5, None, scaling=0.25)[0],
                       sdpa_attention_forward(module, prompt, k5, v5, None, scaling=0.25)[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_step_kernels_reach_every_norm_and_rope_call_and_undo_them(family, monkeypatch):
    model = build_hf_model(TINY_CONFIGS[family], seed=1)
    kernels, module = StepKernels(model), modeling(family)
    names = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(kernels.norms) == len(names) >= 2 * model.config.num_hidden_layers + 1  # qwen3: q/k norms too
    assert kernels.modeling == [module]
    original, attention = module.apply_rotary_pos_emb, model.config._attn_implementation
    calls = []
    monkeypatch.setattr("megappo.rollout.hf.decode_kernels.rope", lambda *a: calls.append(1) or rope(*a))
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with kernels:
            assert model.config._attn_implementation == GROUPED_DECODE
            assert all("forward" in vars(m) for m in kernels.norms)
            got = model(input_ids=ids).logits
        assert torch.equal(got, want)  # fp32: every piece is transformers' own bit for bit
        assert len(calls) == model.config.num_hidden_layers
        with pytest.raises(RuntimeError, match="inside a step"):
            with kernels:
                raise RuntimeError("inside a step")
    assert module.apply_rotary_pos_emb is original and model.config._attn_implementation == attention
    assert not any("forward" in vars(m) for m in kernels.norms)
    assert not decode_kernels._STEP.locked()  # released after a step, also after one that raised


def test_steps_in_two_threads_take_turns():
    """Two engines' eager steps in two threads: the second waits for the first to undo its replacements,
    so neither restores the other's (the modeling module's RoPE is shared state)."""
    import threading

    first, second = (StepKernels(build_hf_model(TINY_CONFIGS["llama"], seed=s)) for s in (1, 2))
    original, order = modeling("llama").apply_rotary_pos_emb, []

    def step_in_thread():
        with second:
            order.append("second")

    with first:
        thread = threading.Thread(target=step_in_thread)
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive() and order == []  # waiting for the first step
        order.append("first")
    thread.join(timeout=30)
    assert order == ["first", "second"] and modeling("llama").apply_rotary_pos_emb is original
