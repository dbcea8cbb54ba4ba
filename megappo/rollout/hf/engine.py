"""The `hf` rollout engine: a transformers model with a KV cache (CPU default; on a GPU trainer's
device, in the model dtype, where SGLang is absent; SGLang stays the recommended GPU engine).

Batched sampling over left-padded prompts with positions counted from the attention mask
(as transformers' `generate` does), temperature / top-k / top-p, EOS and stop tokens, and
the log-prob of every sampled token under the tempered or untempered distribution
(`SamplingParams.logprob_mode`). Weights are updated in place from the bridge's buckets of
HF-named tensors; tied embeddings are updated once through `model.embed_tokens.weight`.
MoE models take per-expert checkpoint names, written into transformers' fused expert tensors.
LoRA adapters (`rollout.lora_sync=adapters`): after `enable_adapters(scale)`, tensors named
`<module>.lora_A.weight` / `<module>.lora_B.weight` (peft's names) go into `LinearAdapters`, which
adds their update to those nn.Linear outputs; the base weights stay as the bridge last sent them.
The KV cache goes in and comes out under the name the model's forward declares (`cache_keyword`):
`cache` in transformers 5.24 (which deprecates `past_key_values` and warns on it), `past_key_values`
in earlier releases such as the SGLang lane's 5.19.

No compute after EOS: each prompt is prefilled once, not once per sample (its n samples
share the cache rows); a finished sample leaves the decode batch (its KV-cache rows are
dropped) and left-padding columns no running sample needs are cut. Sampling is per row:
sample i draws its step-t token by inverse CDF at u[t, i] from one seeded [R, N] uniform
draw, so with a seed every sample's tokens are fixed whatever else is in the batch; a call that is
one part of a split call (`SamplingParams.sample_window`) takes its columns of the whole call's draw.

KV cache (`kv_cache`): on CUDA each generation's cache is preallocated ([N, H_kv, P + R, d] per
layer, `PreallocatedLayer`), written in place, compacted in place as samples leave, and kept for the
next call until `free_cache()` (the orchestrator calls it after each step's generation, so the
trainer's passes get the memory back). transformers' dynamic cache instead concatenates every
layer's K and V into new, one-column-longer tensors at every step; on a GPU that is 2 x layers
allocations of a new size per step, and the caching allocator's fragmentation decided whether 128 x
512 tokens took 10 s or 31-46 s (benchmarks/GPU.md). On the host the dynamic cache stays the
default. One device sync per decode step remains (the EOS check).

Decode paths (`decode`, rollout.hf_decode; chosen once, in `decode_paths.choose_decode`, and printed
in one line): `dynamic` is the loop above; `static` and `graphs` run the prefill the same way, then
`megappo.rollout.hf.static_decode.StaticDecoder`: fixed-shape steps at a few batch-size buckets over a
fixed-capacity cache kept across calls, sampling inside the step with the same per-row uniforms
(so the same tokens), the EOS check every `eos_check_every` steps, and with `graphs` each bucket's
step a CUDA graph. `auto` is graphs on CUDA for a supported model, dynamic elsewhere. A call asking
for MoE routes (`return_routes`) runs the dynamic loop. Weight syncs copy into the parameters in
place (and LoRA adapters into their tensors once held), so captured graphs stay valid.

Shape legend: B prompts, N = B x n samples, b samples still decoding, P prompt length,
T cached length, R new tokens, V vocab.

This module does not know about Megatron or the bridge's gathering.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from megappo.models.hf_experts import checkpoint_views
from megappo.models.precision import precision_of
from megappo.rollout.engine import Bucket, left_pad, tensor_fingerprint
from megappo.rollout.routes import UNKNOWN, RouteRecorder
from megappo.rollout.hf.sampling import filter_logits, sample_tokens, sampling_uniforms  # noqa: F401 (re-exported)
from megappo.rollout.hf.decode_paths import choose_decode
from megappo.rollout.hf.static_decode import StaticDecoder
from megappo.types import RolloutBatch, SamplingParams


class PreallocatedLayer(DynamicLayer):
    """One layer's KV cache in buffers allocated once per generation ("static" cache): keys and values
    of [rows, H_kv, capacity, d], of which the view [:b, :, start:end] is the cache of the b samples
    still decoding. A decode step writes its column in place; a sample leaving compacts the rows, and
    cutting shared padding moves `start`: nothing grows. The dynamic layer instead concatenates a
    new [b, H_kv, T + 1, d] tensor every step for every layer and frees the old one, so the caching
    allocator sees a new size per step per layer and its state decides the speed (benchmarks/GPU.md).
    `store` is the engine's [keys, values] pair, kept between generations and reused when large enough."""

    def __init__(self, store: list, rows: int, capacity: int):
        super().__init__()
        self.store, self.rows, self.capacity = store, rows, capacity
        self.batch = self.start = self.end = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _b, heads, _t, dim = key_states.shape
        keys = self.store[0]
        if (keys is None or keys.dtype != key_states.dtype or keys.device != key_states.device
                or keys.shape[1] != heads or keys.shape[3] != dim or keys.shape[0] < self.rows
                or keys.shape[2] < self.capacity):
            self.store[:] = [None, None]  # the old pair goes before the new one is allocated
            self.store[:] = [key_states.new_empty(self.rows, heads, self.capacity, dim),
                             value_states.new_empty(self.rows, heads, self.capacity, dim)]
        self.device, self.is_initialized = key_states.device, True

    def _views(self) -> None:
        self.keys = self.store[0][:self.batch, :, self.start:self.end]
        self.values = self.store[1][:self.batch, :, self.start:self.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, _h, t, _d = key_states.shape
        assert self.batch in (0, b) and self.end + t <= self.store[0].shape[2], (self.batch, b, self.end, t)
        self.store[0][:b, :, self.end:self.end + t] = key_states
        self.store[1][:b, :, self.end:self.end + t] = value_states
        self.batch, self.end = b, self.end + t
        self._views()
        return self.keys, self.values

    def get_max_length(self) -> int:
        return self.capacity

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Row i -> rows [i * repeats, (i + 1) * repeats), in place: from the last row down, so no
        source row is overwritten before it is copied."""
        for store in self.store:
            span = store[:, :, self.start:self.end]
            for i in reversed(range(self.batch)):
                first = i * repeats + (1 if i == 0 else 0)  # row 0 is its own first copy
                span[first:(i + 1) * repeats] = span[i:i + 1]
        self.batch *= repeats
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (ascending), moved to the front."""
        for store in self.store:
            span = store[:, :, self.start:self.end]
            span[:indices.numel()] = span[indices]
        self.batch = indices.numel()
        self._views()

    def drop_leading(self, columns: int) -> None:
        self.start += columns
        self._views()


def _rollout_batch(prompt_ids, prompt_mask, prompt_index, response_ids, log_probs, lengths, finished,
                   params: SamplingParams, routes) -> RolloutBatch:
    """The batch from the decode loop's device buffers: responses [N, R] cut to the longest one's length."""
    width = int(lengths.max())
    response_mask = (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids[:, :width].cpu(),
        response_mask=response_mask.cpu(),
        rollout_log_probs=log_probs[:, :width].cpu(),
        finish_reasons=["stop" if f else "length" for f in finished.tolist()],
        prompt_index=prompt_index,
        logprob_mode="untempered" if params.greedy else params.logprob_mode,
        routes=routes,
    )


def _drop_shared_padding(mask: torch.Tensor, past) -> torch.Tensor:
    """[b, T] mask -> [b, T'] without the leading columns that are padding for every row,
    cutting the same columns out of `past` (a cache of plain dynamic layers or of preallocated
    ones; another cache is left whole, and so is the mask)."""
    lead = int(mask.any(0).long().argmax())
    layers = getattr(past, "layers", None)
    if lead == 0 or not layers or any(type(layer) not in (DynamicLayer, PreallocatedLayer) for layer in layers):
        return mask
    for layer in layers:
        assert layer.keys.shape[-2] == mask.shape[1], (layer.keys.shape, mask.shape)
        if isinstance(layer, PreallocatedLayer):
            layer.drop_leading(lead)
        else:
            layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
    return mask[:, lead:]


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model.forward` takes the KV cache under, which is also the name of its output's
    field: `cache` where the forward declares it (transformers 5.24), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


#: `kv_cache` values: "static" preallocates each generation's cache (PreallocatedLayer), "dynamic" lets
#: transformers grow it by concatenation, "auto" is static on CUDA and dynamic on the host (where the
#: host allocator does not suffer from it, and the tested CPU results stay as they were)
KV_CACHES = ("auto", "static", "dynamic")


def gpu_placement(device: torch.device, model_dtype: str) -> dict:
    """The engine's device and dtype beside a trainer on `device`: the trainer's GPU in the model dtype
    (colocated: the planner counts its weights and KV cache there), or nothing on the host, where the
    engine keeps the float32 model it was given (what the CPU demo and tests compare against)."""
    if device.type != "cuda":
        return {}
    return {"device": device, "dtype": model_dtype}


class LinearAdapters:
    """LoRA adapters applied by the hf engine: y = W x + scale * B (A x) on the named nn.Linear
    modules of `model` (HF names like `model.layers.0.self_attn.q_proj`), through forward hooks,
    so generation runs the model's own forward unchanged. A [r, in] and B [out, r] per module,
    held in `dtype` on the module's device (q/k/v and gate/up arrive with the same A, one copy
    each: what peft's adapter files hold). A module gets its hook when its first tensor arrives;
    until both its tensors did, it adds nothing.

    This class does not know about Megatron or the bridge."""

    SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}

    def __init__(self, model: torch.nn.Module, scale: float, dtype: torch.dtype):
        self.model, self.scale, self.dtype = model, scale, dtype
        self.tensors: dict[str, torch.Tensor] = {}  # by full name (<module>.lora_A.weight)
        self._pairs: dict[str, list] = {}  # module name -> [A, B]
        #: +1 whenever a tensor object is added or replaced (a later sync of the same shapes copies into the
        #: held ones): captured decode graphs read these tensors and depend on it
        self.version = 0

    @classmethod
    def split(cls, name: str) -> tuple[str, int] | None:
        """(module name, 0 for A | 1 for B) of an adapter tensor's name; None for another name."""
        for suffix, which in cls.SUFFIXES.items():
            if name.endswith(suffix):
                return name.removesuffix(suffix), which
        return None

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        module_name, which = self.split(name)
        try:
            linear = self.model.get_submodule(module_name)
        except AttributeError:
            linear = None
        if not isinstance(linear, torch.nn.Linear):
            raise KeyError(f"the hf engine's model has no linear layer '{module_name}' for adapter '{name}'")
        rank_dim = 0 if which == 0 else 1
        expected = linear.in_features if which == 0 else linear.out_features
        if tensor.dim() != 2 or tensor.shape[1 - rank_dim] != expected:
            raise ValueError(f"'{name}': shape {tuple(tensor.shape)} does not fit {module_name} "
                             f"({linear.in_features} -> {linear.out_features})")
        held = self.tensors.get(name)
        if held is not None and held.shape == tensor.shape:
            held.copy_(tensor)  # in place: what a captured decode graph reads
        else:
            held = self.tensors[name] = tensor.to(device=linear.weight.device, dtype=self.dtype, copy=True).contiguous()
            self.version += 1
        if module_name not in self._pairs:
            self._pairs[module_name] = [None, None]
            linear.register_forward_hook(self._hook(self._pairs[module_name]))
        self._pairs[module_name][which] = held

    def _hook(self, pair: list):
        def add_update(module, args, out):
            a, b = pair
            if a is None or b is None:
                return out
            return out + self.scale * F.linear(F.linear(args[0], a), b)
        return add_update


class HFEngine:
    """transformers-backed engine; `model` is an HF *ForCausalLM in eval mode. `dtype`: a model dtype
    name (megappo.models.precision) to cast the model to, None to keep its own; `kv_cache`: KV_CACHES
    (the dynamic decode path's cache); `decode`: decode_paths.DECODE_PATHS; `eos_check_every`: decode
    steps between the static paths' EOS checks; `max_tokens`: prompt + response positions the static
    paths' cache is allocated for at least (the longest call's need when larger, or None); `log`: where
    the line naming the decode path (and the static paths' capture lines) go."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, device: str | torch.device = "cpu",
                 dtype: str | None = None, kv_cache: str = "auto", decode: str = "auto", eos_check_every: int = 8,
                 max_tokens: int | None = None, log: Callable[[str], None] | None = None):
        if kv_cache not in KV_CACHES:
            raise ValueError(f"unknown kv_cache '{kv_cache}' for the hf engine; choose one of {list(KV_CACHES)}")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=precision_of(dtype).dtype if dtype else None).eval()
        self.pad_token_id = pad_token_id
        self.dtype = next(self.model.parameters()).dtype
        self.static_cache = kv_cache == "static" or (kv_cache == "auto" and self.device.type == "cuda")
        self._kv_store: list[list] = []  # per layer [keys, values] buffers, kept between generations
        self._cache_keyword = cache_keyword(self.model)
        params = dict(self.model.named_parameters())
        params.update({n: b for n, b in self.model.named_buffers() if n in self.model.state_dict()})
        # by checkpoint name: a MoE model's fused experts are per-expert views (megappo.models.hf_experts)
        self._params = checkpoint_views(params, getattr(self.model.config, "model_type", ""))
        self.adapters: LinearAdapters | None = None  # LoRA adapters, after enable_adapters
        self.decode_path, why = choose_decode(decode, self.device, self.model)
        log = log or (lambda line: print(line, flush=True))
        log(f"megappo: hf engine decode path: {self.decode_path} ({why})")
        self.max_tokens = max_tokens or 0
        self._static = None if self.decode_path == "dynamic" else StaticDecoder(
            self.model, self._cache_keyword, capture=self.decode_path == "graphs", eos_check_every=eos_check_every,
            log=log)

    def enable_adapters(self, scale: float) -> None:
        """Take LoRA adapters (`<module>.lora_A.weight` / `.lora_B.weight`) in later updates and add
        scale * B (A x) to those modules' outputs (scale = alpha / rank). Called once, before the first
        update that carries adapters; the base weights keep coming by their own names."""
        if self.adapters is None:
            self.adapters = LinearAdapters(self.model, scale, self.dtype)
        assert self.adapters.scale == scale, (self.adapters.scale, scale)

    def _new_cache(self, rows: int, capacity: int) -> dict:
        """The cache keyword argument of the prefill: a preallocated cache of `rows` samples and
        `capacity` positions (static), or none (transformers starts a dynamic one)."""
        if not self.static_cache:
            return {}
        layers = self.model.config.num_hidden_layers
        if len(self._kv_store) != layers:
            self._kv_store = [[None, None] for _ in range(layers)]
        return {self._cache_keyword: Cache(layers=[PreallocatedLayer(store, rows, capacity) for store in self._kv_store])}

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV-cache buffers the engine holds now (static cache or the static decode paths'
        cache; 0 after free_cache, except under graphs: 0 after release_memory)."""
        held = sum(t.numel() * t.element_size() for store in self._kv_store for t in store if t is not None)
        return held + (self._static.kv_cache_bytes() if self._static is not None else 0)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """Each prompt is prefilled once, left-padded to the longest prompt (its `n` samples
        share the prefill's cache rows); a sample leaves the decode batch (its cache rows,
        mask and position) at the step it samples an EOS / stop token, and cache columns that
        are padding for every sample still running are dropped."""
        unique_ids, unique_mask = left_pad([list(p) for p in prompts], self.pad_token_id)  # [B, P]
        n, dev = params.n, self.device
        prompt_ids, prompt_mask = unique_ids.repeat_interleave(n, 0), unique_mask.repeat_interleave(n, 0)  # [N, P]
        prompt_index = torch.arange(len(prompts)).repeat_interleave(n)
        num, width = prompt_ids.shape[0], params.max_new_tokens
        stop = torch.tensor(sorted(set(params.eos_token_ids) | set(params.stop_token_ids)) or [-1], device=dev)
        uniforms = sampling_uniforms(params, num, dev)  # [R, N] or None (greedy)

        ids, mask = unique_ids.to(dev), unique_mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if self._static is not None and not params.return_routes:
            return self._generate_static(ids, mask, positions, params, uniforms, stop, prompt_ids, prompt_mask,
                                         prompt_index)
        recorder = self._route_recorder() if params.return_routes else contextlib.nullcontext()
        with recorder:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **self._new_cache(num, ids.shape[1] + width))
        if params.return_routes:  # [N, P + R, L, k]: the prompt's, then one position per fed token
            prompt_routes = recorder.take(*ids.shape).repeat_interleave(n, 0)
            prompt_routes[~prompt_mask.bool()] = UNKNOWN
            routes = torch.cat([prompt_routes, torch.full((num, width) + prompt_routes.shape[2:], UNKNOWN,
                                                          dtype=prompt_routes.dtype)], dim=1)
        past, logits = getattr(out, self._cache_keyword), out.logits[:, -1].float()  # [B, V]
        next_pos = positions[:, -1:] + 1  # [B, 1]
        if n > 1:
            past.batch_repeat_interleave(n)
            logits, mask, next_pos = (t.repeat_interleave(n, 0) for t in (logits, mask, next_pos))
        active = torch.arange(num, device=dev)  # [b] the samples in the decode batch
        response_ids = torch.full((num, width), self.pad_token_id, dtype=torch.long, device=dev)
        log_probs = torch.zeros((num, width), dtype=torch.float32, device=dev)
        lengths = torch.zeros(num, dtype=torch.long, device=dev)
        finished = torch.zeros(num, dtype=torch.bool, device=dev)
        for step in range(width):
            tok, lp = sample_tokens(logits, params, None if uniforms is None else uniforms[step, active])
            response_ids[active, step] = tok
            log_probs[active, step] = lp.float()
            lengths[active] = step + 1
            done = torch.isin(tok, stop)
            num_done = int(done.sum())
            finished[active[done]] = True
            if num_done == active.numel() or step == width - 1:
                break
            if num_done:
                keep = (~done).nonzero().squeeze(-1)
                active, tok, mask, next_pos = active[keep], tok[keep], mask[keep], next_pos[keep]
                past.batch_select_indices(keep)
                mask = _drop_shared_padding(mask, past)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            with recorder:
                out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                                 use_cache=True, **{self._cache_keyword: past})
            if params.return_routes:  # the route of response token `step`, fed now
                routes[active.cpu(), unique_ids.shape[1] + step] = recorder.take(active.numel(), 1)[:, 0]
            past, logits = getattr(out, self._cache_keyword), out.logits[:, -1].float()
            next_pos = next_pos + 1
        width = int(lengths.max())
        return _rollout_batch(prompt_ids, prompt_mask, prompt_index, response_ids, log_probs, lengths, finished, params,
                              routes[:, :unique_ids.shape[1] + width] if params.return_routes else None)

    def _generate_static(self, ids, mask, positions, params, uniforms, stop, prompt_ids, prompt_mask, prompt_index):
        """The static / graphs decode paths: the same prefill of the B unique prompts [B, P] (transformers'
        dynamic cache, once), then StaticDecoder's fixed-shape steps."""
        n = params.n
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # [N, V]
        next_pos = (positions[:, -1] + 1).repeat_interleave(n, 0)  # [N]
        adapters = self.adapters.version if self.adapters else -1  # captured graphs read the adapter tensors
        response_ids, log_probs, lengths, finished = self._static.decode(
            getattr(out, self._cache_keyword), logits, mask.repeat_interleave(n, 0), next_pos, params, uniforms, stop,
            repeats=n, capacity=self.max_tokens, pad_token_id=self.pad_token_id, extra_key=(adapters,))
        return _rollout_batch(prompt_ids, prompt_mask, prompt_index, response_ids, log_probs, lengths, finished,
                              params, None)

    def _route_recorder(self) -> RouteRecorder:
        return RouteRecorder(self.model, type(self.model).__name__, getattr(self.model.config, "num_experts_per_tok", 0))

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        for bucket in buckets:
            for name, tensor in bucket:
                if self.adapters is not None and LinearAdapters.split(name):
                    self.adapters.load(name, tensor)
                    continue
                target = self._params.get(name)
                if target is None:
                    raise KeyError(f"the hf engine's model has no tensor '{name}'")
                if target.shape != tensor.shape:
                    raise ValueError(f"'{name}': engine shape {tuple(target.shape)} != sent {tuple(tensor.shape)}")
                target.copy_(tensor)

    def fingerprint_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor_fingerprint(tensor.to(self.dtype))

    @torch.no_grad()
    def fingerprints(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        held = {**self._params, **(self.adapters.tensors if self.adapters is not None else {})}
        return {n: tensor_fingerprint(held[n]) for n in names if n in held}

    def free_cache(self) -> None:
        """Drop the KV-cache buffers kept between generations (the next generation allocates them again).
        Under `graphs` the decoder's cache stays: the captured graphs read it, and capturing again every
        step would cost what they save; release_memory drops both."""
        self._kv_store = []
        if self._static is not None and not self._static.capture:
            self._static.free()

    def release_memory(self) -> None:  # the weights stay
        self.free_cache()
        if self._static is not None:
            self._static.free()

    def resume_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        self.model = None
