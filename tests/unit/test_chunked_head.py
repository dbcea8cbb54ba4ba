"""The chunked LM head (megappo.parallel.chunked_head) at TP=1 against today's path: the full
logits h @ W^T, PolicyWorker._scaled's temperature and padding mask, megappo.parallel.vocab_parallel.
Values and gradients (of a weighted sum of log-probs and entropy) wrt the hidden states and the
weight: float32 within 1e-5 (the tolerance the TP=2 checks state too), bfloat16 within
COMPARE_TOL["bfloat16"] for values and relative to the largest gradient for gradients; chunk sizes
that do not divide the token count, one chunk, one token per chunk; vocabulary padding rows."""

import pytest
import torch

from megappo.models.precision import COMPARE_TOL
from megappo.parallel.chunked_head import chunked_head_log_probs_and_entropy, chunked_head_sum_pi_squared
from megappo.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy, vocab_parallel_sum_pi_squared

N, H, V_PAD, V = 23, 16, 40, 37  # 3 padding rows


def today(h, w, labels, temperature, vocab_size):
    logits = torch.matmul(h, w.t())[None]
    if temperature != 1.0:
        logits = logits.float() / temperature
    pad = torch.arange(w.shape[0]) >= vocab_size
    if pad.any():
        logits = logits.masked_fill(pad, float("-inf"))
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels[None])
    return lp[0], ent[0]


def inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=gen) * 2).to(dtype)
    w = torch.randn(V_PAD, H, generator=gen).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    w_lp, w_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    return h, w, labels, w_lp, w_ent


def run(fn, h, w, *args, w_lp, w_ent, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fn(h, w, *args, **kw)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 8, N, 100])
def test_chunked_head_equals_output_layer_and_vocab_parallel(dtype, temperature, chunk):
    dt = getattr(torch, dtype)
    h, w, labels, w_lp, w_ent = inputs(dt)
    ref = run(today, h, w, labels, temperature, V, w_lp=w_lp, w_ent=w_ent)
    got = run(lambda h_, w_: chunked_head_log_probs_and_entropy(h_, w_, labels, temperature=temperature,
                                                                vocab_size=V, chunk_tokens=chunk),
              h, w, w_lp=w_lp, w_ent=w_ent)
    tol = 1e-5 if dtype == "float32" else COMPARE_TOL["bfloat16"]
    for name, a, b in zip(("log-probs", "entropy"), got[:2], ref[:2]):
        assert a.dtype == b.dtype and (a - b).abs().max() <= tol, (name, (a - b).abs().max())
    for name, a, b in zip(("grad h", "grad W"), got[2:], ref[2:]):
        assert a.dtype == b.dtype == dt, (name, a.dtype, b.dtype)
        scale = max(1.0, b.abs().max().item())
        assert (a.float() - b.float()).abs().max() <= tol * scale, (name, (a.float() - b.float()).abs().max())
    assert ref[3][V:].abs().max() == 0 and got[3][V:].abs().max() == 0  # padding rows get no gradient


def test_chunked_head_float32_log_probs_alone_and_sum_pi_squared():
    h, w, labels, w_lp, _ = inputs(torch.float32, seed=1)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    (today(hr, wr, labels, 0.7, V)[0] * w_lp).sum().backward()
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = chunked_head_log_probs_and_entropy(hc, wc, labels, temperature=0.7, vocab_size=V, with_entropy=False,
                                                 chunk_tokens=6)
    (lp * w_lp).sum().backward()
    assert ent.numel() == 0 and (lp - today(h, w, labels, 0.7, V)[0]).abs().max() <= 1e-5
    assert (hc.grad - hr.grad).abs().max() <= 1e-5 and (wc.grad - wr.grad).abs().max() <= 1e-5
    x = torch.matmul(h, w.t()).float() / 0.7
    x = x.masked_fill(torch.arange(V_PAD) >= V, float("-inf"))
    sps_ref = vocab_parallel_sum_pi_squared(x[None])[0]
    sps = chunked_head_sum_pi_squared(h, w, temperature=0.7, vocab_size=V, chunk_tokens=7)
    assert (sps - sps_ref).abs().max() <= 1e-6


def test_chunked_head_frozen_weight_and_unused_entropy():
    """A frozen output layer (LoRA without modules_to_save) gets no gradient; an entropy that the
    loss does not use is skipped as in vocab_parallel."""
    h, w, labels, w_lp, _ = inputs(torch.float32, seed=2)
    hh = h.clone().requires_grad_()
    lp, ent = chunked_head_log_probs_and_entropy(hh, w, labels, chunk_tokens=4)
    (lp * w_lp).sum().backward()
    ref_h = h.clone().requires_grad_()
    (today(ref_h, w, labels, 1.0, V_PAD)[0] * w_lp).sum().backward()
    assert w.grad is None and (hh.grad - ref_h.grad).abs().max() <= 1e-5


def test_chunk_tokens_must_be_positive():
    h, w, labels, _, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_head_log_probs_and_entropy(h, w, labels, chunk_tokens=0)


def trainer_weight(w: torch.Tensor) -> torch.nn.Parameter:
    """A weight as megappo's trainer holds it: Megatron DDP's float32 `main_grad` buffer beside it and
    a hook moving each autograd gradient into it (today's path; the chunked head adds into it itself)."""
    w = torch.nn.Parameter(w.clone())
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)

    def hook(param):  # as Megatron's DDP hook: autograd may call it without a gradient
        if param.grad is not None:
            param.main_grad.add_(param.grad)
        param.grad = None

    w.register_post_accumulate_grad_hook(hook)
    return w


def head_pass(path: str, h, w, labels, w_lp, w_ent, chunk: int):
    """One loss pass of the LM head (forward + backward) from a fresh hidden leaf and the trainer's
    weight `w`: (log-probs, entropy, dh, dW in float32)."""
    h = h.clone().requires_grad_()
    if path == "today":
        lp, ent = today(h, w, labels, 1.0, w.shape[0])
    else:
        lp, ent = chunked_head_log_probs_and_entropy(h, w, labels, chunk_tokens=chunk)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.main_grad


@pytest.mark.gpu
def test_chunked_head_on_cuda_bf16_at_qwen_vocabulary():
    """On a GPU, bf16, Qwen2.5's vocabulary (152064) and hidden 1536, 16384 tokens in chunks of 1024:
    the same results as today's path within COMPARE_TOL["bfloat16"], and the pass's peak CUDA memory
    above its inputs (the trainer's weight with its main_grad buffer) at least 4x lower (today: 5 GB of
    logits and 5 GB of their gradient)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev, tokens, vocab, hidden = torch.device("cuda"), 16384, 152064, 1536
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen, device=dev, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, generator=gen, device=dev, dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=dev)
    w_lp, w_ent = torch.randn(tokens, generator=gen, device=dev), torch.randn(tokens, generator=gen, device=dev)
    peaks, outs = {}, {}
    for path in ("today", "chunked"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        weight = trainer_weight(w)
        base = torch.cuda.memory_allocated()
        outs[path] = head_pass(path, h, weight, labels, w_lp, w_ent, 1024)
        torch.cuda.synchronize()
        peaks[path] = torch.cuda.max_memory_allocated() - base
    tol = COMPARE_TOL["bfloat16"]
    for name, a, b in zip(("log-probs", "entropy", "dh", "dW"), outs["chunked"], outs["today"]):
        diff = (a.float() - b.float()).abs().max().item() / (1.0 if name in ("log-probs", "entropy")
                                                            else max(1.0, b.float().abs().max().item()))
        assert diff <= tol, (name, diff)
    assert peaks["today"] >= 4 * peaks["chunked"], peaks
