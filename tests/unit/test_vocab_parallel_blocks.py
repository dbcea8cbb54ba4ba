"""Log-probs and entropy in blocks (megappo.parallel.vocab_parallel, one rank): any block size
gives the values and gradients of one pass over the whole tensor bit for bit, and the
backward keeps no tensor of the logits' size besides the logits."""

import pytest
import torch

from megappo.parallel.vocab_parallel import (
    vocab_parallel_entropy, vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy,
    vocab_parallel_sum_pi_squared,
)
from megappo.ppo.losses import entropy_from_logits, log_probs_from_logits

B, P, R, V = 3, 5, 9, 64
WHOLE = 1 << 40  # one block: the whole tensor in one pass


def logits_and_labels(kind: str, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(B, P + R, V, generator=gen) * 3
    labels = torch.randint(0, V, (B, R), generator=gen)
    if kind == "padding":  # vocabulary padding: -inf logits, never a label
        full[..., -5:] = float("-inf")
        labels = labels % (V - 5)
    if kind == "peaked":  # probabilities that underflow to 0 at finite logits
        full = full * 60
    return full.to(dtype), labels


def run(full, labels, block_elements, w_lp=1.0, w_ent=1.0):
    """Log-probs, entropy and the gradient of a weighted sum, over the response positions of
    [B, P + R, V] logits (a strided view, as the actor passes them)."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(B, R, generator=gen), torch.randn(B, R, generator=gen)
    x = full.clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs_and_entropy(x[:, P - 1:-1], labels, block_elements=block_elements)
    ((lp * a).sum() * w_lp + (ent * b).sum() * w_ent).backward()
    return lp, ent, x.grad


@pytest.mark.parametrize("kind", ["random", "padding", "peaked"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 0.0), (0.0, 1.0)])
def test_any_block_size_gives_the_whole_pass_bit_for_bit(kind, weights):
    full, labels = logits_and_labels(kind)
    whole = run(full, labels, WHOLE, *weights)
    assert all(torch.isfinite(t).all() for t in whole)
    for block in (1, V, 2 * V + 3, R * V, 2 * R * V, None):  # one token ... whole sequences, the default
        got = run(full, labels, block, *weights)
        for name, w, g in zip(("log-probs", "entropy", "gradient"), whole, got):
            assert torch.equal(w, g), f"{kind}, block {block}: {name} differs by {(w - g).abs().max()}"


def test_bf16_logits_get_float32_outputs_and_a_bf16_gradient_in_any_block_size():
    full, labels = logits_and_labels("random", torch.bfloat16)
    whole, blocked = run(full, labels, WHOLE), run(full, labels, V)
    assert whole[0].dtype == torch.float32 and whole[2].dtype == torch.bfloat16
    assert all(torch.equal(w, g) for w, g in zip(whole, blocked))


def test_blocks_match_the_full_vocabulary_references():
    full, labels = logits_and_labels("padding")
    x = full[:, P - 1:-1]
    lp, ent = vocab_parallel_log_probs_and_entropy(x, labels, block_elements=V)
    torch.testing.assert_close(lp, log_probs_from_logits(x, labels), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, entropy_from_logits(x), rtol=0, atol=1e-5)
    torch.testing.assert_close(vocab_parallel_log_probs(x, labels, block_elements=V), lp, rtol=0, atol=0)
    torch.testing.assert_close(vocab_parallel_entropy(x, block_elements=V), ent, rtol=0, atol=0)


def test_backward_keeps_only_the_logits_and_per_token_statistics():
    """The softmax is recomputed block by block in the backward: no [B, R, V] tensor is saved
    besides the logits (a one-pass version keeps two: the probabilities and centred logits)."""
    full, labels = logits_and_labels("random")
    x = full.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_log_probs_and_entropy(x[:, P - 1:-1] * 1.0, labels)
    big = [t for t in saved if t.numel() >= B * R * V]
    assert len(big) == 1 and big[0].shape == (B, R, V), [tuple(t.shape) for t in saved]
    assert sum(t.numel() for t in saved if t.numel() < B * R * V) <= 4 * B * R


def test_a_block_size_below_one_is_refused():
    full, labels = logits_and_labels("random")
    with pytest.raises(ValueError, match="block_elements must be >= 1"):
        vocab_parallel_log_probs(full[:, P - 1:-1], labels, block_elements=0)


@pytest.mark.parametrize("kind", ["plain", "padding", "peaked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_pi_squared_equals_the_softmax_reference_in_any_block_size(kind, dtype):
    """sum_v p_v^2 (the optimal-token-baseline estimators' input) against softmax(logits)^2 summed in
    float64, -inf padding included; the block size changes no bit."""
    full, _ = logits_and_labels(kind, dtype)
    want = torch.softmax(full.double(), -1).square().sum(-1)
    whole = vocab_parallel_sum_pi_squared(full, block_elements=WHOLE)
    assert (whole - want).abs().max() < 1e-6
    for block in (V, 3 * V, 7):
        assert torch.equal(vocab_parallel_sum_pi_squared(full, block_elements=block), whole)
