"""The hf rollout engine against transformers: greedy, sampled log-probs, EOS and padding."""

import pytest
import torch

from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.engine import iter_buckets, tensor_fingerprint, tensor_fingerprint_reference
from megappo.rollout.hf_engine import HFEngine, filter_logits
from megappo.types import SamplingParams

PAD = 0
PROMPTS = [[5, 17, 42, 9, 100], [7, 3], [250, 251, 252]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return build_hf_model(TINY_CONFIGS[request.param], seed=3)


def test_greedy_equals_transformers_generate(model):
    engine = HFEngine(model, pad_token_id=PAD)
    batch = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    for i, prompt in enumerate(PROMPTS):  # one prompt at a time: no padding on the reference side
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)
        assert batch.response_ids[i].tolist() == ref[0, len(prompt):].tolist()
    assert batch.response_mask.all() and batch.finish_reasons == ["length"] * 3


@pytest.mark.parametrize("mode", ["tempered", "untempered"])
def test_sampled_log_probs_equal_a_separate_forward(model, mode):
    engine = HFEngine(model, pad_token_id=PAD)
    params = SamplingParams(n=2, temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=8, seed=1, logprob_mode=mode)
    batch = engine.generate(PROMPTS, params)
    assert batch.num_samples == 6 and batch.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    ids, mask = batch.sequences()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    P = batch.prompt_ids.shape[1]
    logits = logits[:, P - 1:-1].float()
    if mode == "tempered":
        logits = logits / 0.7
    ref = logits.log_softmax(-1).gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask
    assert (ref - batch.rollout_log_probs).abs().max() < 1e-5


def test_same_seed_same_samples(model):
    engine = HFEngine(model, pad_token_id=PAD)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=42)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert torch.equal(a.response_ids, b.response_ids)


def test_eos_stops_a_row_and_pads_the_rest(model):
    engine = HFEngine(model, pad_token_id=PAD)
    free = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    eos = int(free.response_ids[0, 3])  # the 4th greedy token of prompt 0 becomes EOS
    batch = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, eos_token_ids=(eos,)))
    first = free.response_ids[0].tolist().index(eos)
    assert batch.response_mask[0].tolist() == [1] * (first + 1) + [0] * (batch.response_ids.shape[1] - first - 1)
    assert batch.finish_reasons[0] == "stop"
    assert torch.all(batch.response_ids[0, first + 1:] == PAD)
    assert torch.all(batch.rollout_log_probs[0, first + 1:] == 0)


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    # nucleus 0.7: 0.5 alone < 0.7, 0.5 + 0.3 covers it -> keep two
    assert torch.isinf(filter_logits(logits, -1, 0.7)).tolist() == [[False, False, True, True]]


def test_update_weights_in_place_and_fingerprints(model):
    engine = HFEngine(build_hf_model(TINY_CONFIGS["llama"], seed=3), pad_token_id=PAD)
    new = {k: v + 1 for k, v in engine.model.state_dict().items()}
    engine.update_weights(iter_buckets(iter(new.items()), bucket_bytes=10_000))
    fps = engine.fingerprints(new)
    assert all(torch.equal(fps[k], tensor_fingerprint(v)) for k, v in new.items())
    with pytest.raises(KeyError, match="no tensor 'model.bogus'"):
        engine.update_weights([[("model.bogus", torch.zeros(1))]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fingerprint_equals_its_reference(dtype):
    """The one-pass fingerprint (sums per position of the weight period) equals the
    one-weight-per-element definition bit for bit, including int64 wrap-around."""
    gen = torch.Generator().manual_seed(0)
    for n in (0, 1, 300, 65520, 65521, 65522, 3 * 65521 + 17):
        t = torch.randn(n, generator=gen).to(dtype)
        assert torch.equal(tensor_fingerprint(t), tensor_fingerprint_reference(t)), n
    big = torch.full((200_000,), -1.7e308, dtype=torch.float64).to(dtype)  # sums wrap around in int64
    assert torch.equal(tensor_fingerprint(big), tensor_fingerprint_reference(big))
    moved = torch.randn(70_000, generator=gen).to(dtype)
    swapped = moved.clone()
    swapped[[3, 65520]] = swapped[[65520, 3]]
    assert not torch.equal(tensor_fingerprint(moved), tensor_fingerprint(swapped))
