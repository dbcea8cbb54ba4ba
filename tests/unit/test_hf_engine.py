"""The hf rollout engine against transformers: greedy, sampled log-probs, EOS and padding."""

import dataclasses
import itertools
import types
import warnings

import pytest
import torch

from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.engine import iter_buckets, tensor_fingerprint, tensor_fingerprint_reference
from megappo.rollout.hf.engine import HFEngine, cache_keyword, filter_logits, sample_tokens, sampling_uniforms
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


MIXED = [[5, 17, 42, 9, 100, 3, 8], [7, 3], [250, 251, 252], [11, 12, 13, 14]]  # the longest prompt first


def slow_reference(model, prompts, params):
    """Each sample alone, no KV cache, no padding: the whole sequence through the model at
    every step, the token drawn with the sample's own uniforms (`sampling_uniforms`)."""
    samples = [list(p) for p in prompts for _ in range(params.n)]
    uniforms = sampling_uniforms(params, len(samples), torch.device("cpu"))
    stop = set(params.eos_token_ids) | set(params.stop_token_ids)
    out = []
    for i, prompt in enumerate(samples):
        seq, tokens, log_probs = list(prompt), [], []
        for step in range(params.max_new_tokens):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq])).logits[:, -1].float()
            tok, lp = sample_tokens(logits, params, None if uniforms is None else uniforms[step, i:i + 1])
            tokens.append(int(tok))
            log_probs.append(float(lp))
            seq.append(int(tok))
            if tokens[-1] in stop:
                break
        out.append((tokens, log_probs, "stop" if tokens[-1] in stop else "length"))
    return out


def mixed_length_params(model, greedy):
    """Sampling params whose EOS ids end the first sample (of the longest prompt) within 2
    tokens, others later, and at least one never: found in a run without EOS (a sample's
    tokens up to its EOS do not change)."""
    params = dict(n=1, temperature=0, max_new_tokens=9) if greedy else dict(
        n=2, temperature=0.8, top_k=40, top_p=0.95, max_new_tokens=9, seed=7)
    rows = HFEngine(model, pad_token_id=PAD).generate(MIXED, SamplingParams(**params)).response_ids.tolist()
    width = params["max_new_tokens"]

    def lengths(eos):
        return [min((row.index(t) + 1 for t in eos if t in row), default=width) for row in rows]

    candidates = sorted({t for row in rows for t in row})
    for size in (1, 2, 3):
        for eos in itertools.combinations(candidates, size):
            found = lengths(eos)
            if found[0] <= 2 and len(set(found)) >= 3 and max(found) == width:
                return SamplingParams(**params, eos_token_ids=eos)
    raise AssertionError(f"no EOS ids give mixed lengths for {rows}")


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_mixed_lengths_equal_each_sample_generated_alone(model, greedy):
    """The batched engine (rows leaving at EOS, shared padding cut, one prefill per prompt)
    against every sample generated alone without a cache: same tokens, log-probs within 1e-5."""
    params = mixed_length_params(model, greedy)
    batch = HFEngine(model, pad_token_id=PAD).generate(MIXED, params)
    ref = slow_reference(model, MIXED, params)
    lengths = batch.response_mask.sum(1).tolist()
    assert len(set(lengths)) >= 3 and "stop" in batch.finish_reasons and "length" in batch.finish_reasons
    assert lengths[0] <= 2  # the longest prompt's first sample ends first: its padding gets cut
    for i, (tokens, log_probs, reason) in enumerate(ref):
        assert batch.response_ids[i, :lengths[i]].tolist() == tokens, i
        assert torch.allclose(batch.rollout_log_probs[i, :lengths[i]], torch.tensor(log_probs), atol=1e-5, rtol=0)
        assert batch.finish_reasons[i] == reason
        assert torch.all(batch.response_ids[i, lengths[i]:] == PAD) and torch.all(batch.rollout_log_probs[i, lengths[i]:] == 0)
    assert batch.response_ids.shape[1] == max(lengths)


#: a sample's log-probs generated in a part of a split call against the whole call, fp32 on the host
#: (measured: <= 4.8e-7, both models and decode paths; the parts' batches are padded and bucketed differently)
SPLIT_LOG_PROB_ATOL = 1e-5


def split_generate(engine, prompts, params: SamplingParams, sizes: list[int]) -> list:
    """The call cut into contiguous parts of `sizes` prompts (each with its n samples), each generated
    alone with its sample window (first sample, the whole call's samples), as replicas would."""
    parts, first = [], 0
    for size in sizes:
        window = (first * params.n, len(prompts) * params.n)
        parts.append(engine.generate(prompts[first:first + size], dataclasses.replace(params, sample_window=window)))
        first += size
    assert first == len(prompts)
    return parts


def assert_parts_sample_the_whole_call(parts, whole, atol=SPLIT_LOG_PROB_ATOL) -> float:
    """Each part's samples are the whole call's, in order: tokens and ends equal, log-probs within `atol`
    (a part's responses are cut to its longest one: the whole call's further columns are padding there).
    Returns the largest log-prob difference."""
    rows, worst = 0, 0.0
    for part in parts:
        want, width = slice(rows, rows + part.num_samples), part.response_ids.shape[1]
        assert torch.equal(part.response_mask.sum(1), whole.response_mask[want].sum(1))
        assert torch.equal(part.response_ids, whole.response_ids[want, :width])
        assert part.finish_reasons == whole.finish_reasons[want]
        worst = max(worst, float((part.rollout_log_probs - whole.rollout_log_probs[want, :width]).abs().max()))
        rows += part.num_samples
    assert rows == whole.num_samples and worst <= atol, worst
    return worst


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_a_split_call_samples_what_the_whole_call_samples(model, decode, greedy):
    """B = 7 prompts (different lengths, EOS mid-response), n = 2 with top-k / top-p when sampled, split
    into 2 and 3 contiguous parts, each generated alone with its `sample_window`: every sample's tokens
    and finish reason are the whole call's bit for bit, log-probs within SPLIT_LOG_PROB_ATOL. Greedy
    ignores the window. Without windows the sampled parts' tokens differ (the test can fail)."""
    prompts = MIXED + PROMPTS
    params = mixed_length_params(model, greedy)
    engine = HFEngine(model, pad_token_id=PAD, decode=decode)
    whole = engine.generate(prompts, params)
    assert "stop" in whole.finish_reasons and "length" in whole.finish_reasons
    for sizes in ([3, 4], [1, 4, 2]):
        assert_parts_sample_the_whole_call(split_generate(engine, prompts, params, sizes), whole)
    if not greedy:
        unwindowed = [engine.generate(prompts[:3], params), engine.generate(prompts[3:], params)]
        with pytest.raises(AssertionError):
            assert_parts_sample_the_whole_call(unwindowed, whole)


def test_a_sample_window_takes_the_whole_calls_columns():
    """sampling_uniforms with (first, total): columns [first, first + N) of the whole call's seeded
    [R, total] draw; no window is the plain [R, N] draw; a window past the whole call, or not
    (first, total) with 0 <= first < total, is refused; greedy draws nothing."""
    cpu = torch.device("cpu")
    params = SamplingParams(temperature=0.9, max_new_tokens=5, seed=11)
    whole = sampling_uniforms(params, 8, cpu)
    assert torch.equal(whole, torch.rand(5, 8, generator=torch.Generator().manual_seed(11)))
    for first, num in [(0, 8), (0, 3), (3, 2), (5, 3)]:
        part = sampling_uniforms(dataclasses.replace(params, sample_window=(first, 8)), num, cpu)
        assert torch.equal(part, whole[:, first:first + num])
    with pytest.raises(ValueError, match=r"sample_window=\(6, 8\): 3 samples from sample 6 run past the whole "
                                         r"call's 8\. Fix:"):
        sampling_uniforms(dataclasses.replace(params, sample_window=(6, 8)), 3, cpu)
    engine = HFEngine(build_hf_model(TINY_CONFIGS["llama"], seed=3), pad_token_id=PAD)
    with pytest.raises(ValueError, match="run past"):  # the engine's call: 3 prompts x n = 2 from sample 2 of 6
        engine.generate(PROMPTS, dataclasses.replace(params, n=2, sample_window=(2, 6)))
    for bad in [(8, 8), (-1, 8), (0, 0), (1,)]:
        with pytest.raises(ValueError, match="sample_window"):
            SamplingParams(sample_window=bad)
    assert sampling_uniforms(SamplingParams(temperature=0, sample_window=(6, 8)), 3, cpu) is None


def test_decode_batch_shrinks_as_samples_finish(model):
    """Forward calls seen by the model: the prefill takes each prompt once (not n times),
    decode step k takes only the samples still running after it, and the cache is as wide
    as the longest running sample's prompt + k + 1 (padding no running sample needs is cut)."""
    params = mixed_length_params(model, greedy=False)
    calls = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append((kw["input_ids"].shape, kw["attention_mask"].shape)), with_kwargs=True)
    try:
        batch = HFEngine(model, pad_token_id=PAD).generate(MIXED, params)
    finally:
        hook.remove()
    lengths = batch.response_mask.sum(1)
    prompt_lengths = batch.prompt_mask.sum(1)
    assert calls[0] == ((len(MIXED), 7), (len(MIXED), 7))
    decode = calls[1:]
    assert len(decode) == int(lengths.max()) - 1
    for k, (ids_shape, mask_shape) in enumerate(decode):
        running = lengths >= k + 2  # sampled a token at step k that was not EOS, and step k + 1 follows
        assert ids_shape == (int(running.sum()), 1), k
        assert mask_shape == (int(running.sum()), int(prompt_lengths[running].max()) + k + 1), k
    assert sum(shape[0] for shape, _ in decode) == int((lengths - 1).sum())  # no token fed after a sample's end
    assert sum(shape[0] for shape, _ in decode) < (len(decode)) * batch.num_samples


def test_inverse_cdf_sampling_follows_the_filtered_distribution():
    """K evenly spread uniforms on one row pick each token about probability x K times;
    tokens removed by top-k never."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))[None].repeat(1000, 1)
    params = SamplingParams(temperature=1.0, top_k=3)
    tokens, log_probs = sample_tokens(logits, params, (torch.arange(1000) + 0.5) / 1000)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts == [444, 334, 222, 0]  # uniforms below the CDF steps 0.4/0.9, 0.7/0.9, 1: 444, 778, 1000
    assert torch.allclose(log_probs, torch.log(torch.tensor([0.4, 0.3, 0.2]))[tokens])  # tempered, before top-k
    edge, _ = sample_tokens(logits[:2], params, torch.tensor([0.0, 1.0 - 2 ** -24]))
    assert edge.tolist() == [0, 2]


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


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_engine_takes_per_expert_checkpoint_names(family):
    # transformers holds experts fused ([E, 2F, H] gate|up, [E, H, F]); the bridge sends one
    # tensor per expert under the checkpoint names save_pretrained writes
    from megappo.models.hf_experts import checkpoint_state

    source = checkpoint_state(build_hf_model(TINY_CONFIGS[family], seed=1))
    engine = HFEngine(build_hf_model(TINY_CONFIGS[family], seed=2), pad_token_id=PAD)
    engine.update_weights([list(source.items())])
    held = checkpoint_state(engine.model)
    assert set(held) == set(source) and all(torch.equal(held[k], source[k]) for k in source)
    reference = build_hf_model(TINY_CONFIGS[family], seed=1)  # the same weights, never synced
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, reference.state_dict()[name]), name
    expert = next(n for n in source if ".experts.3." in n)
    prints = engine.fingerprints([expert])
    assert torch.equal(prints[expert], engine.fingerprint_of(expert, source[expert]))


class PastKeyValuesModel(torch.nn.Module):
    """A model with the KV-cache API of transformers before 5.24 (the SGLang lane's 5.19): the cache
    goes in as `past_key_values` and comes out as `out.past_key_values`."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
        keyword = cache_keyword(self.inner)
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=use_cache, **({keyword: past_key_values} if past_key_values is not None else {}))
        return types.SimpleNamespace(logits=out.logits, past_key_values=getattr(out, keyword))


def test_the_kv_cache_goes_by_the_name_the_installed_transformers_asks_for(model):
    # transformers 5.24 deprecates past_key_values for `cache` and warns on every call that uses it
    # (the console shows the warning: tests/e2e/test_console.py)
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=6, seed=5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values")
        batch = HFEngine(model, pad_token_id=PAD).generate(PROMPTS, params)
    old = PastKeyValuesModel(model)
    assert cache_keyword(old) == "past_key_values"
    again = HFEngine(old, pad_token_id=PAD).generate(PROMPTS, params)
    assert torch.equal(again.response_ids, batch.response_ids)
    assert torch.equal(again.rollout_log_probs, batch.rollout_log_probs)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_static_kv_cache_equals_the_dynamic_one(model, greedy):
    """The preallocated cache (the default on CUDA) against transformers' growing one, with rows
    leaving at EOS (compaction) and shared padding cut (the start moves): the same tokens and
    log-probs bit for bit; its buffers are allocated once and reused by the next generation,
    and free_cache gives them up."""
    params = mixed_length_params(model, greedy)
    dynamic = HFEngine(model, pad_token_id=PAD, kv_cache="dynamic")
    static = HFEngine(model, pad_token_id=PAD, kv_cache="static")
    assert not dynamic.static_cache and static.static_cache
    want, got = dynamic.generate(MIXED, params), static.generate(MIXED, params)
    lengths = want.response_mask.sum(1).tolist()
    assert len(set(lengths)) >= 3 and lengths[0] <= 2  # rows left early, the longest prompt's first
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.rollout_log_probs, want.rollout_log_probs)
    assert dynamic.kv_cache_bytes() == 0
    cfg = model.config
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    samples, capacity = want.num_samples, want.prompt_ids.shape[1] + params.max_new_tokens
    assert static.kv_cache_bytes() == samples * capacity * per_position
    first = [t.data_ptr() for store in static._kv_store for t in store]
    again = static.generate(MIXED[1:], params)  # fewer, shorter prompts: the same buffers serve
    assert [t.data_ptr() for store in static._kv_store for t in store] == first
    assert torch.equal(again.response_ids, dynamic.generate(MIXED[1:], params).response_ids)
    static.free_cache()
    assert static.kv_cache_bytes() == 0


def test_engine_dtype_and_cache_choice():
    """`dtype` casts the engine's model (the model dtype on a GPU, megappo.models.precision); the
    static cache is the default on CUDA only; a GPU trainer puts the engine on its device."""
    from megappo.rollout.hf.engine import gpu_placement

    engine = HFEngine(build_hf_model(TINY_CONFIGS["llama"], seed=3), pad_token_id=PAD, dtype="bfloat16")
    assert engine.dtype == torch.bfloat16 and not engine.static_cache
    batch = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=3))
    assert batch.rollout_log_probs.dtype == torch.float32 and batch.response_mask.all()
    with pytest.raises(ValueError, match="kv_cache"):
        HFEngine(build_hf_model(TINY_CONFIGS["llama"], seed=3), pad_token_id=PAD, kv_cache="paged")
    assert gpu_placement(torch.device("cpu"), "bfloat16") == {}
    assert gpu_placement(torch.device("cuda", 1), "bfloat16") == {"device": torch.device("cuda", 1), "dtype": "bfloat16"}


@pytest.mark.gpu
def test_static_kv_cache_on_cuda_equals_the_dynamic_one():
    """On the GPU, in bf16, on the dynamic decode path (rollout.hf_decode=dynamic; the CUDA-graph decode is
    tests/unit/test_static_decode.py's): the engine picks the static cache and samples what the dynamic one
    does."""
    model = build_hf_model(TINY_CONFIGS["llama"], seed=3)
    params = mixed_length_params(model, greedy=True)
    engines = [HFEngine(build_hf_model(TINY_CONFIGS["llama"], seed=3), pad_token_id=PAD, device="cuda",
                        dtype="bfloat16", kv_cache=kind, decode="dynamic") for kind in ("auto", "dynamic")]
    assert engines[0].static_cache and not engines[1].static_cache
    static, dynamic = (e.generate(MIXED, params) for e in engines)
    assert torch.equal(static.response_ids, dynamic.response_ids)
    assert torch.allclose(static.rollout_log_probs, dynamic.rollout_log_probs, atol=1e-2, rtol=0)
    assert engines[0].kv_cache_bytes() > 0


def test_the_orchestrator_frees_the_kv_cache_after_each_generation(model):
    """orchestrator.generate (the step's gen stage) leaves no KV-cache buffers on the engine for
    the trainer's passes."""
    from megappo.trainer.step import generate
    from megappo.ppo.specs import ESTIMATOR_SPECS

    engine = HFEngine(model, pad_token_id=PAD, kv_cache="static")
    rollout_cfg = types.SimpleNamespace(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, stop_token_ids=[],
                                        seed=0, logprob_mode="tempered", env="single_turn")
    cfg = types.SimpleNamespace(rollout=rollout_cfg,
                                algorithm=types.SimpleNamespace(adv_estimator="grpo", estimator=ESTIMATOR_SPECS["grpo"],
                                                                filter_groups=types.SimpleNamespace(enable=False)))
    examples = [types.SimpleNamespace(prompt_ids=p) for p in PROMPTS]
    run = types.SimpleNamespace(cfg=cfg, build=types.SimpleNamespace(routing_replay=False), engine=engine,
                                partial=None, train_examples=examples, eos_ids=(),
                                sampler=types.SimpleNamespace(next_batch=lambda: [0, 2]))
    calls = []
    real_generate = engine.generate

    def generate_and_look(*args):
        out = real_generate(*args)
        calls.append(engine.kv_cache_bytes())
        return out

    engine.generate = generate_and_look
    batch = generate(run, step=1)
    assert batch.num_samples == 4 and len(calls) == 1 and calls[0] > 0  # the engine held its cache after the call
    assert engine._kv_store == [] and engine.kv_cache_bytes() == 0


def test_lora_adapters_equal_the_merged_weights(model):
    """rollout.lora_sync=adapters: adapters loaded by peft's names (q/k/v sharing one A) give the log-probs
    of an engine holding the merged weights W + s B A, their fingerprints resolve, and a wrong name or
    shape is refused."""
    import copy

    rank, scale, gen = 4, 2.0, torch.Generator().manual_seed(0)
    merged_model = copy.deepcopy(model)
    adapted = HFEngine(copy.deepcopy(model), pad_token_id=PAD)
    adapted.enable_adapters(scale)
    merged, bucket = {}, []
    attn = "model.layers.0.self_attn"
    a = torch.randn(rank, model.config.hidden_size, generator=gen) * 0.1
    for proj in ("q_proj", "k_proj", "v_proj"):
        linear = merged_model.get_submodule(f"{attn}.{proj}")
        b = torch.randn(linear.out_features, rank, generator=gen) * 0.1
        bucket += [(f"{attn}.{proj}.lora_A.weight", a), (f"{attn}.{proj}.lora_B.weight", b)]
        merged[f"{attn}.{proj}.weight"] = linear.weight.detach() + scale * b @ a
    adapted.update_weights([bucket])
    reference = HFEngine(merged_model, pad_token_id=PAD)
    reference.update_weights([list(merged.items())])
    params = SamplingParams(temperature=0, max_new_tokens=6)
    got, want = adapted.generate(PROMPTS, params), reference.generate(PROMPTS, params)
    assert torch.equal(got.response_ids, want.response_ids)
    assert (got.rollout_log_probs - want.rollout_log_probs).abs().max() < 1e-5
    names = [n for n, _ in bucket] + [f"{attn}.o_proj.weight"]
    fps = adapted.fingerprints(names)
    assert set(fps) == set(names)
    assert all(torch.equal(fps[n], adapted.fingerprint_of(n, t)) for n, t in bucket)
    with pytest.raises(KeyError, match="no linear layer 'model.layers.0.self_attn.nope'"):
        adapted.update_weights([[(f"{attn}.nope.lora_A.weight", a)]])
    with pytest.raises(ValueError, match="does not fit"):
        adapted.update_weights([[(f"{attn}.q_proj.lora_A.weight", a.T)]])
