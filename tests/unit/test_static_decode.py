"""The hf engine's fixed-shape decode paths (megappo.rollout.hf.static_decode) against today's dynamic one.

CPU, fp32: the static path without capture samples the same tokens as the dynamic path (greedy and
seeded sampling, n > 1, EOS and stop tokens mid-response, different prompt lengths, top-k / top-p,
both log-prob modes, the EOS check every 1, 3 or 100 steps) and reports log-probs within 1e-6 (measured:
<= 4.8e-7; the attention sums over the fixed-capacity cache with masked columns, not over the grown one,
so the last bits may differ). bf16: both paths' log-probs equal a separate bf16 forward pass within
bf16's tolerance, and the first tokens (the shared prefill's) agree exactly; later tokens of a random
tiny model may part where two logits tie within a bf16 rounding (attention sums over a different
number of columns round differently in bf16). GPU-marked (skipped on CPU): the captured
path against the uncaptured one, and a weight sync between two captured generations.
What a capture needs, checked on the host: the step reads nothing back from the device (meta device),
reads the same memory at every step of a bucket, and, replayed as a graph replays (`RecordedStep`: the
step's ATen ops recorded once per bucket with their arguments frozen, then run again on the same
tensors), gives the dynamic path's tokens across calls and a weight sync. The step's kernels against transformers'
own: tests/unit/test_decode_kernels.py.
"""

import copy

import pytest
import torch

from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.hf.engine import HFEngine, cache_keyword
from megappo.rollout.hf.decode_paths import DECODE_PATHS, choose_decode
from megappo.rollout.hf import decode_kernels
from megappo.rollout.hf.decode_kernels import grouped_decode_attention
from megappo.rollout.hf.static_decode import StaticDecoder, decode_buckets, window_step
from megappo.types import SamplingParams
from tests.unit.test_hf_engine import MIXED, PAD, PROMPTS, mixed_length_params

LOG_PROB_ATOL_FP32 = 1e-6
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return build_hf_model(TINY_CONFIGS[request.param], seed=3)


def engines(model, check_every=8, **kwargs):
    return (HFEngine(model, pad_token_id=PAD, decode="dynamic", **kwargs),
            HFEngine(model, pad_token_id=PAD, decode="static", eos_check_every=check_every, **kwargs))


def assert_same(got, want, atol=LOG_PROB_ATOL_FP32):
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.response_mask, want.response_mask)
    assert got.finish_reasons == want.finish_reasons
    assert (got.rollout_log_probs - want.rollout_log_probs).abs().max() <= atol
    assert torch.equal(got.prompt_ids, want.prompt_ids) and torch.equal(got.prompt_index, want.prompt_index)


def test_the_path_is_chosen_in_one_place():
    dense, moe = build_hf_model(TINY_CONFIGS["llama"], seed=1), build_hf_model(TINY_CONFIGS["qwen3_moe"], seed=1)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_decode("auto", cpu, dense)[0] == "dynamic"
    assert choose_decode("auto", cuda, dense) == ("graphs", "auto: CUDA and a supported model")
    assert choose_decode("auto", cuda, moe)[0] == "dynamic" and "qwen3_moe" in choose_decode("auto", cuda, moe)[1]
    assert choose_decode("static", cpu, dense)[0] == "static" and choose_decode("dynamic", cuda, moe)[0] == "dynamic"
    with pytest.raises(ValueError, match="needs CUDA.*Fix: set rollout.hf_decode=static"):
        choose_decode("graphs", cpu, dense)
    with pytest.raises(ValueError, match="qwen3_moe.*Fix: set rollout.hf_decode=dynamic"):
        choose_decode("static", cpu, moe)
    with pytest.raises(ValueError, match="unknown hf decode path 'paged'"):
        choose_decode("paged", cpu, dense)
    assert DECODE_PATHS == ("auto", "dynamic", "static", "graphs")


def test_the_engine_says_which_path_it_runs(capsys):
    HFEngine(build_hf_model(TINY_CONFIGS["llama"], seed=1), pad_token_id=PAD)
    HFEngine(build_hf_model(TINY_CONFIGS["llama"], seed=1), pad_token_id=PAD, decode="static")
    assert capsys.readouterr().out.splitlines() == [
        "megappo: hf engine decode path: dynamic (auto: CUDA graphs need CUDA, the engine is on cpu)",
        "megappo: hf engine decode path: static (asked for)"]


def test_buckets():
    assert decode_buckets(12) == [12, 8, 4, 2, 1]
    assert decode_buckets(16) == [16, 8, 4, 2, 1]
    assert decode_buckets(1) == [1]


@pytest.mark.parametrize("check_every", [1, 3, 100])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_static_equals_dynamic_with_eos_mid_response(model, greedy, check_every):
    """Mixed lengths (EOS after 1-2 tokens for the longest prompt, later for others, never for some),
    n = 2 with top-k / top-p when sampled: the same tokens, ends and log-probs, whether the EOS check
    runs every step or once at the end (100 > the 9 steps: every sample runs to the last step)."""
    params = mixed_length_params(model, greedy)
    dynamic, static = engines(model, check_every)
    want, got = dynamic.generate(MIXED, params), static.generate(MIXED, params)
    lengths = want.response_mask.sum(1).tolist()
    assert len(set(lengths)) >= 3 and "stop" in want.finish_reasons and "length" in want.finish_reasons
    assert_same(got, want)


@pytest.mark.parametrize("sampling", [
    dict(n=3, temperature=1.0, max_new_tokens=12, seed=5),
    dict(n=2, temperature=0.6, top_k=20, max_new_tokens=10, seed=11, logprob_mode="untempered"),
    dict(n=4, temperature=1.3, top_p=0.8, max_new_tokens=10, seed=2),
    dict(n=1, temperature=0, max_new_tokens=10),
], ids=["t1", "topk-untempered", "topp", "greedy"])
def test_static_equals_dynamic_over_sampling_settings(model, sampling):
    """Stop tokens besides EOS, different prompt lengths, several samples per prompt."""
    dynamic, static = engines(model, check_every=2)
    free = dynamic.generate(PROMPTS + MIXED, SamplingParams(**sampling))
    stop = (int(free.response_ids[0, 2]), int(free.response_ids[-1, 5]))  # ends two samples early, maybe more
    params = SamplingParams(**sampling, stop_token_ids=stop[:1], eos_token_ids=stop[1:])
    want, got = dynamic.generate(PROMPTS + MIXED, params), static.generate(PROMPTS + MIXED, params)
    assert "stop" in want.finish_reasons
    assert_same(got, want)


def test_finished_samples_move_to_smaller_buckets(model):
    """Every decode step runs at a bucket size; the batch shrinks as samples finish (compaction), and
    the cache is the same storage across calls until free_cache."""
    sampling = dict(n=2, temperature=1.0, max_new_tokens=9, seed=7)
    dynamic, static = engines(model, check_every=1)
    free = dynamic.generate(MIXED, SamplingParams(**sampling)).response_ids
    # EOS: the second token of every sample but sample 0, and none of sample 0's: most end at step 1
    eos = tuple(sorted(set(free[1:, 1].tolist()) - set(free[0].tolist())))
    params = SamplingParams(**sampling, eos_token_ids=eos)
    sizes = []
    hook = static.model.register_forward_pre_hook(lambda _m, _a, kw: sizes.append(kw["input_ids"].shape),
                                                  with_kwargs=True)
    try:
        batch = static.generate(MIXED, params)
    finally:
        hook.remove()
    num = batch.num_samples
    assert_same(batch, dynamic.generate(MIXED, params))
    assert (batch.response_mask.sum(1) > 2).sum() <= num // 2
    decode = [s[0] for s in sizes[1:]]
    assert all(s[1] == 1 for s in sizes[1:]) and set(decode) <= set(decode_buckets(num))
    assert decode[0] == num and decode[-1] < num and decode == sorted(decode, reverse=True)
    kv = static._static.kv
    assert static.kv_cache_bytes() == kv.numel() * kv.element_size() > 0
    again = static.generate(MIXED[1:], params)  # fewer, shorter prompts: the same buffers serve
    assert static._static.kv is kv and again.num_samples < num
    static.free_cache()
    assert static.kv_cache_bytes() == 0 and static._static.kv is None


def test_capacity_hint_allocates_once(model):
    """max_tokens (data.max_prompt_length + rollout.max_new_tokens): the cache is sized for it at the first
    call (in multiples of 64 positions), and a longer prompt later grows it (the larger need wins)."""
    engine = HFEngine(model, pad_token_id=PAD, decode="static", max_tokens=70)
    engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4))
    kv = engine._static.kv
    assert kv.shape[4] == 128
    engine.generate([list(range(3, 100))], SamplingParams(temperature=0, max_new_tokens=31))
    assert engine._static.kv is kv  # 97 + 31 = 128 fits
    engine.generate([list(range(3, 100))], SamplingParams(temperature=0, max_new_tokens=32))
    assert engine._static.kv.shape[4] == 192


def test_a_weight_update_between_generations_changes_the_tokens_as_on_the_dynamic_path(model):
    """update_weights copies into the parameters in place (no parameter is replaced: what captured graphs
    need), and the static path's next generation follows the new weights exactly as the dynamic path's."""
    dynamic, static = engines(copy.deepcopy(model))[0], engines(copy.deepcopy(model))[1]
    params = SamplingParams(n=2, temperature=0.9, top_k=30, max_new_tokens=8, seed=3)
    before = static.generate(PROMPTS, params)
    assert_same(before, dynamic.generate(PROMPTS, params))
    gen = torch.Generator().manual_seed(0)
    new = {k: v.detach() + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.named_parameters()}
    pointers = {n: p.data_ptr() for n, p in static.model.named_parameters()}
    for engine in (dynamic, static):
        engine.update_weights([list(new.items())])
    assert {n: p.data_ptr() for n, p in static.model.named_parameters()} == pointers
    after = static.generate(PROMPTS, params)
    assert not torch.equal(after.response_ids, before.response_ids)
    assert_same(after, dynamic.generate(PROMPTS, params))


def test_lora_adapters_are_written_in_place_after_the_first_sync(model):
    """A captured graph reads the adapter tensors: a second sync of the same shapes copies into them
    (LinearAdapters.version unchanged); the static path with adapters equals the dynamic one."""
    rank, gen = 2, torch.Generator().manual_seed(1)
    name = "model.layers.0.self_attn.q_proj"
    linear = model.get_submodule(name)
    bucket = [(f"{name}.lora_A.weight", 0.1 * torch.randn(rank, linear.in_features, generator=gen)),
              (f"{name}.lora_B.weight", 0.1 * torch.randn(linear.out_features, rank, generator=gen))]
    dynamic, static = engines(copy.deepcopy(model))[0], engines(copy.deepcopy(model))[1]
    for engine in (dynamic, static):
        engine.enable_adapters(2.0)
        engine.update_weights([bucket])
    held = dict(static.adapters.tensors)
    version = static.adapters.version
    bucket = [(n, t * 1.5) for n, t in bucket]
    for engine in (dynamic, static):
        engine.update_weights([bucket])
    assert static.adapters.version == version and all(static.adapters.tensors[n] is t for n, t in held.items())
    assert torch.equal(static.adapters.tensors[bucket[0][0]], bucket[0][1])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=4)
    assert_same(static.generate(PROMPTS, params), dynamic.generate(PROMPTS, params))


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_bf16_static_path(model, greedy):
    """bf16 on the host: the first token (the shared prefill's) agrees exactly with the dynamic path; every
    reported log-prob equals a separate bf16 forward pass over the sampled sequences within
    bf16's tolerance (2e-2; both paths measure <= 5e-3), as the dynamic path's do."""
    params = mixed_length_params(model, greedy)
    dynamic, static = engines(copy.deepcopy(model), dtype="bfloat16")  # the engine casts its model in place
    want, got = dynamic.generate(MIXED, params), static.generate(MIXED, params)
    assert torch.equal(got.response_ids[:, 0], want.response_ids[:, 0])
    for batch in (want, got):
        ids, mask = batch.sequences()
        with torch.no_grad():
            logits = static.model(input_ids=ids, attention_mask=mask,
                                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        width = batch.prompt_ids.shape[1]
        logits = logits[:, width - 1:-1].float() / (1.0 if greedy else params.temperature)
        ref = logits.log_softmax(-1).gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask
        assert (ref - batch.rollout_log_probs).abs().max() < 2e-2


def test_routes_and_unsupported_models_take_the_dynamic_loop():
    """A MoE model under auto runs the dynamic loop (CUDA or not); asking for static on it is refused."""
    moe = build_hf_model(TINY_CONFIGS["qwen3_moe"], seed=1)
    assert HFEngine(moe, pad_token_id=PAD)._static is None
    with pytest.raises(ValueError, match="rollout.hf_decode=static"):
        HFEngine(moe, pad_token_id=PAD, decode="static")
    with pytest.raises(ValueError, match="eos_check_every=0"):
        HFEngine(build_hf_model(TINY_CONFIGS["llama"], seed=1), pad_token_id=PAD, decode="static", eos_check_every=0)


# --------------------------------------------------------------------------- GPU

def cuda_engines(path_a, path_b, family="llama"):
    model = build_hf_model(TINY_CONFIGS[family], seed=3)
    return [HFEngine(copy.deepcopy(model), pad_token_id=PAD, device="cuda", dtype="bfloat16", decode=path,
                     eos_check_every=2) for path in (path_a, path_b)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_captured_equals_uncaptured_on_cuda(greedy):
    """bf16 on the GPU: graphs (captured once per bucket, replayed) against the same steps uncaptured:
    the same tokens and ends; log-probs within bf16's tolerance (the same kernels: expected equal)."""
    captured, plain = cuda_engines("graphs", "static")
    assert captured.decode_path == "graphs" and plain.decode_path == "static"
    params = mixed_length_params(build_hf_model(TINY_CONFIGS["llama"], seed=3), greedy)
    for _ in range(2):  # the second call replays the graphs the first captured
        got, want = captured.generate(MIXED, params), plain.generate(MIXED, params)
        assert torch.equal(got.response_ids, want.response_ids) and got.finish_reasons == want.finish_reasons
        assert (got.rollout_log_probs - want.rollout_log_probs).abs().max() <= 1e-2
    assert captured._static.graphs_captured > 0 and captured._static.capture_seconds > 0


@pytest.mark.gpu
@needs_cuda
def test_a_sync_between_captured_generations_on_cuda():
    """A weight sync between two captured generations: no graph is captured again, and the tokens change
    exactly as on the uncaptured path after the same sync."""
    captured, plain = cuda_engines("graphs", "static")
    params = SamplingParams(n=2, temperature=0.9, top_k=30, max_new_tokens=12, seed=3)
    before = captured.generate(PROMPTS, params)
    count = captured._static.graphs_captured
    gen = torch.Generator().manual_seed(0)
    new = {k: (v.detach().float().cpu() + 0.05 * torch.randn(v.shape, generator=gen)).to(v.dtype).cuda()
           for k, v in captured.model.named_parameters()}
    for engine in (captured, plain):
        engine.update_weights([list(new.items())])
    after, want = captured.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert captured._static.graphs_captured == count  # replayed, not captured again
    assert not torch.equal(after.response_ids, before.response_ids)
    assert torch.equal(after.response_ids, want.response_ids)
    assert (after.rollout_log_probs - want.rollout_log_probs).abs().max() <= 1e-2
    captured.free_cache()  # graphs keep their cache through free_cache; release_memory drops both
    assert captured.kv_cache_bytes() > 0
    captured.release_memory()
    assert captured.kv_cache_bytes() == 0


def test_config_reaches_the_engine(tmp_path):
    """rollout.hf_decode / hf_eos_check_every / the cache capacity go from the recipe to the hf engine;
    a static path asked for where the trainer's hf engine does not run is refused with the fix."""
    from megappo.config import ConfigError
    from megappo.config import config_from_dict
    from megappo.rollout.registry import engine_for
    from tests.unit.test_config import MIN

    cfg = config_from_dict({**MIN, "rollout": {"hf_decode": "static", "hf_eos_check_every": 3, "max_new_tokens": 7},
                            "data": {"max_prompt_length": 20}})
    tokenizer = type("Tok", (), {"pad_token_id": PAD})()
    engine = engine_for(cfg, build_hf_model(TINY_CONFIGS["llama"], seed=1), tokenizer, return_routes=False,
                        device=torch.device("cpu"))
    assert engine.decode_path == "static" and engine._static.eos_check_every == 3 and engine.max_tokens == 27
    with pytest.raises(ConfigError, match="hf_decode=graphs applies to the hf engine.*Fix: set rollout.hf_decode=auto"):
        config_from_dict({**MIN, "rollout": {"hf_decode": "graphs", "placement": "separate"}})
    with pytest.raises(ConfigError, match="hf_eos_check_every"):
        config_from_dict({**MIN, "rollout": {"hf_eos_check_every": 0}})


@pytest.mark.parametrize("family", ["qwen3"])
def test_static_equals_dynamic_for_the_other_supported_types(family):
    """Every STATIC_MODEL_TYPES entry runs the static path (llama and qwen2 above): sampled, n = 3, a stop id."""
    model = build_hf_model(TINY_CONFIGS[family], seed=3)
    dynamic, static = engines(model, check_every=2)
    sampling = dict(n=3, temperature=1.0, top_p=0.95, max_new_tokens=10, seed=9)
    free = dynamic.generate(MIXED, SamplingParams(**sampling))
    params = SamplingParams(**sampling, stop_token_ids=(int(free.response_ids[1, 3]),))
    want, got = dynamic.generate(MIXED, params), static.generate(MIXED, params)
    assert "stop" in want.finish_reasons
    assert_same(got, want)


def test_edge_shapes(model):
    """One new token, one sample, and a later call with more samples than the buffers hold (they grow)."""
    dynamic, static = engines(model, check_every=1)
    for prompts, sampling in (([PROMPTS[0]], dict(n=1, temperature=1.0, max_new_tokens=1, seed=1)),
                              (PROMPTS, dict(n=1, temperature=0, max_new_tokens=1)),
                              ([PROMPTS[1]], dict(n=1, temperature=0.7, max_new_tokens=6, seed=2)),
                              (MIXED, dict(n=5, temperature=0.7, max_new_tokens=6, seed=2))):
        params = SamplingParams(**sampling)
        assert_same(static.generate(prompts, params), dynamic.generate(prompts, params))
    assert static._static.kv.shape[2] == 20


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_step_reads_nothing_back_from_the_device(family):
    """What a CUDA graph captures must not read a device value on the host (item, tolist, nonzero, the
    truth of a tensor, a data-dependent shape). On the meta device such a read fails, so the step
    (transformers' forward over the fixed cache, sampling, bookkeeping) running there at two buckets,
    greedy and with top-k / top-p and 12 stop ids, is the CPU check of what the GPU test captures. It
    does not see a CUDA kernel that syncs inside (torch.isin sorts for many stop ids on CUDA, so the step
    compares instead): the GPU tests do."""
    model = build_hf_model(TINY_CONFIGS[family], seed=1).to("meta")
    decoder = StaticDecoder(model, cache_keyword(model), capture=False, eos_check_every=4)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    decoder._ensure(8, 20, torch.empty(4, cfg.num_key_value_heads, 5, head_dim, device="meta"))
    stop = torch.empty(12, dtype=torch.long, device="meta")
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)):
        with torch.no_grad():
            decoder._step(8, 64, params, stop)
            decoder._step(4, 32, params, stop)
    assert decoder.tok.device.type == "meta"


class StorageReads:
    """A dispatch mode that collects the storages an op reads that no earlier op under it made: what a
    replayed CUDA graph reads from outside itself, at the addresses of its capture."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        reads = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                inputs = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
                reads.read |= {t.untyped_storage().data_ptr() for t in inputs} - reads.made
                out = func(*args, **(kwargs or {}))
                outputs = {t.untyped_storage().data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
                reads.made |= outputs - reads.read
                return out

        self.mode, self.read, self.made = Mode(), set(), set()


def test_every_step_of_a_bucket_reads_the_same_memory(model):
    """A CUDA graph replays its capture's kernels on the capture's addresses, so every tensor a step reads
    from outside itself (cache, buffers, parameters, stop ids) must live at the same address at every
    step of its bucket, in this call and the next: checked on the host by recording the storages each
    uncaptured step reads. (The stop ids were once a new tensor per call: a replay would have read freed
    memory.)"""
    engine = HFEngine(copy.deepcopy(model), pad_token_id=PAD, decode="static", eos_check_every=2)
    decoder, seen = engine._static, {}
    step = decoder._step

    def recorded(b, w, params, stop):
        reads = StorageReads()
        with reads.mode:
            step(b, w, params, stop)
        seen.setdefault((b, w), []).append(frozenset(reads.read))

    decoder._step = recorded
    sampling = dict(n=2, temperature=1.0, max_new_tokens=9, seed=7)
    free = engines(model)[0].generate(MIXED, SamplingParams(**sampling)).response_ids
    eos = tuple(sorted(set(free[1:, 1].tolist()) - set(free[0].tolist())))  # most samples end at step 1
    params = SamplingParams(**sampling, eos_token_ids=eos)
    for _ in range(2):
        engine.generate(MIXED, params)
        engine.update_weights([[(name, p.detach() * 1.01) for name, p in engine.model.named_parameters()]])
    assert len(seen) >= 2, seen.keys()  # steps ran at two buckets or more
    assert all(len(set(steps)) == 1 for steps in seen.values()), {b: len(set(s)) for b, s in seen.items()}
    params_read = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    assert all(params_read <= steps[0] for steps in seen.values())


class RecordedStep:
    """What a CUDA graph keeps of a captured step, emulated on the host: the ATen ops the step ran, in
    order, each with the tensors it read from outside the step (by object: the same memory at every
    replay), the outputs of earlier ops it read (by position) and every other argument as the constant
    it was at capture (Python numbers, shapes, dtypes). `replay()` runs those ops again on the same
    outside tensors, as `graph.replay()` runs the same kernels on the same addresses: a step that
    depends on a host value which changes between steps (a Python int column, a list of sizes) would
    replay it frozen at its capture value, as a real graph would, and part from the eager steps."""

    def __init__(self, step):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        ops, made, keep = [], {}, []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                leaves, spec = tree_flatten((args, kwargs or {}))
                template = [("made", *made[id(x)]) if isinstance(x, torch.Tensor) and id(x) in made
                            else ("outside", x) if isinstance(x, torch.Tensor) else ("constant", x) for x in leaves]
                out = func(*args, **(kwargs or {}))
                for j, x in enumerate(tree_flatten(out)[0]):
                    if isinstance(x, torch.Tensor):
                        made[id(x)] = (len(ops), j)
                        keep.append(x)  # alive until recording ends, so no later tensor reuses its id
                ops.append((func, spec, template))
                return out

        with torch.no_grad(), Mode():
            step()  # the warm-up step runs for real (as before a capture); it is also what gets recorded
        self.ops = ops

    def replay(self) -> None:
        from torch.utils._pytree import tree_flatten, tree_unflatten

        outputs = []
        with torch.no_grad():
            for func, spec, template in self.ops:
                leaves = [outputs[x[1]][x[2]] if x[0] == "made" else x[1] for x in template]
                args, kwargs = tree_unflatten(leaves, spec)
                outputs.append(tree_flatten(func(*args, **kwargs))[0])


def test_the_replay_emulation_catches_a_host_value_baked_into_a_step():
    """The emulation is strict where a graph is: a step writing at a Python-int column replays at the
    column of its capture, a step writing at a device-tensor column moves on."""
    host_buf, device_buf, col, state = torch.zeros(4), torch.zeros(4), torch.zeros(1, dtype=torch.long), {"col": 0}

    def host_step():
        host_buf[state["col"]] += 1
        state["col"] += 1

    def device_step():
        device_buf.index_add_(0, col, torch.ones(1))
        col.add_(1)

    for step in (host_step, device_step):
        recorded = RecordedStep(step)
        for _ in range(3):
            recorded.replay()
    assert host_buf.tolist() == [4, 0, 0, 0] and device_buf.tolist() == [1, 1, 1, 1]


def replay_steps(decoder: StaticDecoder) -> tuple[dict, list[int]]:
    """Make `decoder` record each bucket's step once (per sampling setting: the capture key) and replay it for
    every later step, as the graphs path does: ({key: RecordedStep}, the bucket of every replayed step)."""
    recorded, replays = {}, []

    def run_step(b, w, params, stop, key):
        if key in recorded:
            recorded[key].replay()
            replays.append(b)
        else:
            recorded[key] = RecordedStep(lambda: decoder._step(b, w, params, stop))

    decoder._run_step = run_step
    return recorded, replays


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_replayed_steps_equal_the_dynamic_path(model, greedy):
    """Each bucket's step recorded once (per sampling setting) and replayed for every later step, in this
    call and the next, across a weight sync: the tokens, ends and log-probs of the dynamic path. The CPU
    stand-in for the GPU test of captured against uncaptured steps: it shows the step carries all of its
    step-to-step state on the device (the column, the positions, the response step, the buckets' rows)."""
    engine = HFEngine(copy.deepcopy(model), pad_token_id=PAD, decode="static", eos_check_every=2)
    dynamic = HFEngine(copy.deepcopy(model), pad_token_id=PAD, decode="dynamic")
    recorded, replays = replay_steps(engine._static)
    sampling = dict(n=1, temperature=0, max_new_tokens=9) if greedy else dict(n=2, temperature=1.0, top_k=40,
                                                                               max_new_tokens=9, seed=7)
    free = dynamic.generate(MIXED, SamplingParams(**sampling)).response_ids
    # EOS: the second token of every sample but sample 0, and none of sample 0's: most end at step 1, so the
    # steps move down the buckets
    params = SamplingParams(**sampling, eos_token_ids=tuple(sorted(set(free[1:, 1].tolist()) - set(free[0].tolist()))))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        assert_same(engine.generate(MIXED, params), dynamic.generate(MIXED, params))
        new = [(name, p.detach() + 0.03 * torch.randn(p.shape, generator=gen)) for name, p in model.named_parameters()]
        for e in (engine, dynamic):
            e.update_weights([new])
    assert_same(engine.generate(MIXED, params), dynamic.generate(MIXED, params))
    assert len(recorded) >= 2 and len(set(replays)) >= 2 and len(replays) > 10, (list(recorded), replays)


def test_window_steps():
    """Windows grow by 64 columns up to 1024 columns of capacity, then by multiples of 16 that keep them
    to 16 per capacity."""
    assert [window_step(c) for c in (64, 576, 1024, 1088, 8192, 32768)] == [64, 64, 64, 80, 512, 2048]
    assert all(-(-c // window_step(c)) <= 16 and window_step(c) % 16 == 0 for c in range(64, 40000, 64))
    with pytest.raises(ValueError, match="multiple of 16"):
        StaticDecoder(None, "past_key_values", capture=False, eos_check_every=1, window=24)


def test_steps_attend_over_the_written_columns_only(model):
    """Each step attends over the written columns rounded up to the window step (16 here), not over the
    whole cache: the windows grow with the column, a replayed step is recorded per (bucket, window), and
    tokens, ends and log-probs are the dynamic path's."""
    engine = HFEngine(copy.deepcopy(model), pad_token_id=PAD, decode="static", eos_check_every=2, max_tokens=200)
    engine._static.window = 16
    dynamic = HFEngine(copy.deepcopy(model), pad_token_id=PAD, decode="dynamic")
    widths = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["attention_mask"].shape[-1]), with_kwargs=True)
    recorded, replays = replay_steps(engine._static)
    try:
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=5)
        got = engine.generate(MIXED, params)
    finally:
        hook.remove()
    assert_same(got, dynamic.generate(MIXED, params))
    prompt_width = got.prompt_ids.shape[1]
    assert engine._static.kv.shape[4] == 256  # max_tokens 200, in multiples of 64
    # the recorded (warm-up) steps' masks, the prefill's first: one per window, each the written columns
    # rounded up to 16 (a replayed step runs below the hook, on the recorded ops)
    windows = sorted({key[1] for key in recorded})
    assert widths[1:] == windows and len(windows) >= 3, (widths, windows)
    # step t writes column P + t - 1 (t = 1 ... 39): windows from ceil((P + 1) / 16) to ceil((P + 39) / 16) x 16
    assert windows[0] == -(-(prompt_width + 1) // 16) * 16 and windows[-1] == -(-(prompt_width + 39) // 16) * 16
    assert all(b - a == 16 for a, b in zip(windows, windows[1:])) and len(replays) > 30


def test_replayed_steps_equal_the_uncaptured_static_path_bit_for_bit_in_bf16(model):
    """bf16, as the GPU test runs it: the replayed steps (RecordedStep) against the same steps run eagerly,
    sampled with a stop id, over two calls: the same ops on the same inputs, so tokens and log-probs are
    equal bit for bit (the GPU test allows 1e-2 for its kernels)."""
    replayed, plain = (HFEngine(copy.deepcopy(model), pad_token_id=PAD, decode="static", eos_check_every=2,
                                dtype="bfloat16") for _ in range(2))
    recorded, _replays = replay_steps(replayed._static)
    params = mixed_length_params(model, greedy=False)
    for _ in range(2):
        got, want = replayed.generate(MIXED, params), plain.generate(MIXED, params)
        assert torch.equal(got.response_ids, want.response_ids) and got.finish_reasons == want.finish_reasons
        assert torch.equal(got.rollout_log_probs, want.rollout_log_probs)
    assert recorded and "stop" in want.finish_reasons


def test_the_step_attends_through_the_grouped_function(model, monkeypatch):
    """Every decode step's attention layers call `grouped_decode_attention` (registered in transformers'
    attention interface and set on the model only during a step); the prefill and the model's own
    setting stay transformers' SDPA."""
    from transformers import AttentionInterface

    calls = []

    def spy(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return grouped_decode_attention(module, query, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, decode_kernels.GROUPED_DECODE, spy)
    static = engines(model)[1]
    out = static.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))
    steps = 5  # the first token comes from the prefill
    assert calls == [1] * (steps * model.config.num_hidden_layers), calls
    assert model.config._attn_implementation == "sdpa" and out.response_ids.shape[1] == 6
