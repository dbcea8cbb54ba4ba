"""megappo.rollout.batches against the hf engine: the parts of a split generation call, each generated
with its sample window (SamplingParams.sample_window) and joined by `concat`, are the batch of the one
call, field by field, in shape and padding. concat and take on hand-made batches (routes, multi-turn
fields, renumbering): tests/unit/test_dynamic_sampling.py."""

import dataclasses

import pytest
import torch

from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.batches import concat
from megappo.rollout.hf.engine import HFEngine
from megappo.types import RolloutBatch
from tests.unit.test_hf_engine import MIXED, PAD, SPLIT_LOG_PROB_ATOL, mixed_length_params, split_generate


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return build_hf_model(TINY_CONFIGS[request.param], seed=3)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_concat_of_a_split_calls_parts_is_the_one_call_batch(model, decode, greedy):
    """MIXED's first prompt is the longest and its samples end first (EOS within 2 tokens of its first
    sample): its part is wider in prompt columns and narrower in response columns than the others, so
    concat's left padding of prompts and right padding of responses decide whether the join is the
    one call's batch. Every field equal (tensors in dtype and value), log-probs within SPLIT_LOG_PROB_ATOL."""
    params = mixed_length_params(model, greedy)
    engine = HFEngine(model, pad_token_id=PAD, decode=decode)
    whole = engine.generate(MIXED, params)
    for sizes in ([1, 3], [1, 1, 2]):
        parts = split_generate(engine, MIXED, params, sizes)
        assert len({p.prompt_ids.shape[1] for p in parts}) > 1 and len({p.response_ids.shape[1] for p in parts}) > 1
        joined = concat(parts, PAD)
        for field in dataclasses.fields(RolloutBatch):
            got, want = getattr(joined, field.name), getattr(whole, field.name)
            if field.name == "rollout_log_probs":
                assert got.shape == want.shape and got.dtype == want.dtype
                assert (got - want).abs().max() <= SPLIT_LOG_PROB_ATOL
                assert torch.all(got[whole.response_mask == 0] == 0)  # padding is exactly 0, as the engine's
            elif isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want), field.name
            else:
                assert got == want, field.name
