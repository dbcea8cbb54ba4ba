"""The attention dispatch (megappo.models.attention_dispatch): which kernel each device/dtype gets
(availability faked with monkeypatch, results never), the per-sequence SDPA path against a naive
masked-softmax reference on CPU, and, on a GPU, torch's varlen kernel against that path in bf16."""

import dataclasses
import math

import pytest
import torch

from megappo.models import attention_dispatch as ad


def _kernel(*args, **kwargs):  # stands in for an importable kernel; never called by the choice tests
    raise AssertionError("the choice tests do not run kernels")


VARLEN = ad.Kernels(varlen=_kernel, varlen_gqa=True)
VARLEN_NO_GQA = ad.Kernels(varlen=_kernel, varlen_gqa=False)
FLASH = ad.Kernels(flash_attn=_kernel)
BOTH_NO_GQA = ad.Kernels(varlen=_kernel, varlen_gqa=False, flash_attn=_kernel)
NONE = ad.Kernels()


@pytest.mark.parametrize("device, dtype, head_dim, gqa, dropout, kernels, expected", [
    ("cpu", torch.float32, 64, False, 0.0, VARLEN, "sdpa"),  # CPU: always per-sequence SDPA
    ("cpu", torch.bfloat16, 64, True, 0.0, BOTH_NO_GQA, "sdpa"),
    ("cuda", torch.float32, 64, False, 0.0, VARLEN, "sdpa"),  # fused kernels are bf16/fp16 only
    ("cuda", torch.bfloat16, 64, False, 0.0, VARLEN, "varlen"),
    ("cuda", torch.float16, 128, True, 0.0, VARLEN, "varlen"),  # native GQA
    ("cuda", torch.bfloat16, 64, True, 0.0, VARLEN_NO_GQA, "varlen"),  # K/V expanded for it
    ("cuda", torch.bfloat16, 64, True, 0.0, BOTH_NO_GQA, "flash_attn"),  # GQA native there
    ("cuda", torch.bfloat16, 64, False, 0.0, BOTH_NO_GQA, "varlen"),
    ("cuda", torch.bfloat16, 64, False, 0.1, VARLEN, "sdpa"),  # varlen has no dropout
    ("cuda", torch.bfloat16, 64, False, 0.1, BOTH_NO_GQA, "flash_attn"),
    ("cuda", torch.bfloat16, 64, True, 0.0, FLASH, "flash_attn"),  # torch without varlen_attn
    ("cuda", torch.bfloat16, 64, False, 0.0, NONE, "sdpa"),
    ("cuda", torch.bfloat16, 72, False, 0.0, VARLEN, "varlen"),
    ("cuda", torch.bfloat16, 60, False, 0.0, VARLEN, "sdpa"),  # head dim not a multiple of 8
    ("cuda", torch.bfloat16, 512, False, 0.0, VARLEN, "sdpa"),  # over 256
])
def test_choose_backend(device, dtype, head_dim, gqa, dropout, kernels, expected):
    assert ad.choose_backend(device, dtype, head_dim, gqa=gqa, dropout=dropout, kernels=kernels) == expected


def test_available_kernels_reads_this_torch():
    k = ad.available_kernels()
    if k.varlen is not None:  # torch >= 2.13: GQA native, causal as a window
        import torch.nn.attention.varlen as v

        assert k.varlen is v.varlen_attn


def test_dispatch_on_cpu_runs_sdpa_whatever_is_importable(monkeypatch):
    """A CPU call never reaches a fused kernel, even when both are 'importable'."""
    monkeypatch.setattr(ad, "available_kernels", lambda: BOTH_NO_GQA)
    q, k, v, bounds = _packed(torch.float32, hq=4, hkv=2, lengths=(5, 3, 7))
    out = ad.packed_causal_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32), 7, scale=None)
    assert torch.equal(out, ad.per_sequence_sdpa(q, k, v, bounds, scale=None))


def test_unknown_backend_names_the_choices():
    q, k, v, bounds = _packed(torch.float32, hq=2, hkv=2, lengths=(3,))
    with pytest.raises(ValueError, match="choose one of"):
        ad.packed_causal_attention(q, k, v, torch.tensor(bounds), 3, scale=None, backend="xformers")


def _packed(dtype, *, hq, hkv, lengths, d=16, device="cpu", seed=0):
    """Random q [t, hq, d], k/v [t, hkv, d] of packed sequences of `lengths`, and their bounds."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(device=device, dtype=dtype) for h in (hq, hkv, hkv))
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return q, k, v, bounds


def naive_packed_attention(q, k, v, bounds, scale):
    """The obvious reference, in float64: per sequence, per query head, softmax over the keys at
    or before the query (key/value head h // (hq / hkv))."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q, dtype=torch.float64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for h in range(q.shape[1]):
            qh, kh, vh = (x[a:b, hh].double() for x, hh in ((q, h), (k, h // groups), (v, h // groups)))
            scores = (qh @ kh.T * scale).masked_fill(~causal, -math.inf)
            out[a:b, h] = scores.softmax(-1) @ vh
    return out


@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2)])
def test_per_sequence_sdpa_equals_naive_reference(hq, hkv):
    q, k, v, bounds = _packed(torch.float32, hq=hq, hkv=hkv, lengths=(7, 1, 12, 4))
    scale = 0.3
    out = ad.per_sequence_sdpa(q, k, v, bounds, scale=scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), naive_packed_attention(q, k, v, bounds, scale), atol=1e-5, rtol=1e-5)


#: bf16 keeps 8 bits of mantissa; two kernels that sum in different orders (flash tiles vs the
#: per-sequence SDPA) differ by a few bf16 roundings of outputs of size ~1
BF16_ATTN_TOL = 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv, native_gqa", [(8, 8, True), (15, 5, True), (15, 5, False)])
def test_varlen_kernel_equals_per_sequence_sdpa_in_bf16(monkeypatch, hq, hkv, native_gqa):
    """native_gqa False: the path for a torch whose varlen_attn lacks enable_gqa (K/V expanded)."""
    kernels = ad.available_kernels()
    if kernels.varlen is None:
        pytest.skip("this torch has no torch.nn.attention.varlen.varlen_attn")
    if not native_gqa:
        kernels = dataclasses.replace(kernels, varlen_gqa=False, flash_attn=None)
        monkeypatch.setattr(ad, "available_kernels", lambda: kernels)
    q, k, v, bounds = _packed(torch.bfloat16, hq=hq, hkv=hkv, lengths=(37, 5, 128, 64, 1), d=64, device="cuda")
    for x in (q, k, v):
        x.requires_grad_(True)
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    fused = ad.packed_causal_attention(q, k, v, cu, 128, scale=0.125)
    assert ad.choose_backend("cuda", q.dtype, 64, gqa=hq != hkv, dropout=0.0, kernels=kernels) == "varlen"
    ref = ad.per_sequence_sdpa(q, k, v, bounds, scale=0.125)
    torch.testing.assert_close(fused.float(), ref.float(), atol=BF16_ATTN_TOL, rtol=BF16_ATTN_TOL)
    grads = torch.autograd.grad(fused.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), atol=5 * BF16_ATTN_TOL, rtol=5 * BF16_ATTN_TOL)


def one_call_per_sequence(q, k, v, bounds, scale):
    """The CPU path as it was: one 3-D SDPA call per sequence, the outputs concatenated."""
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("lengths", [(5, 3, 5, 7, 3, 3, 1, 5), (9,), (4, 0, 4, 2), (2,) * 33, (1, 64, 17, 64, 1)])
def test_cpu_sdpa_by_length_is_the_call_per_sequence_bit_for_bit(monkeypatch, dtype, hq, hkv, lengths):
    """The CPU path stacks the sequences of one length into one call: outputs and the gradients of
    q, k and v equal one call per sequence exactly (fp32 and bf16, GQA, empty and single sequences,
    lengths interleaved)."""
    q, k, v, bounds = _packed(dtype, hq=hq, hkv=hkv, lengths=lengths)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = ad.per_sequence_sdpa(q, k, v, bounds, scale=0.3)
    ref = one_call_per_sequence(q, k, v, bounds, 0.3)
    assert out.dtype == dtype and torch.equal(out, ref)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    ad.per_sequence_sdpa(q, k, v, bounds, scale=0.3)
    assert len(calls) == len({n for n in lengths if n})  # one call per distinct length
