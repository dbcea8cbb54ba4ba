"""The hf engine's fixed-shape decode: a KV cache of fixed capacity kept across calls, decode steps at
a few batch-size buckets, sampling inside the step, the EOS check every k steps, and on CUDA each
bucket's step captured once as a CUDA graph and replayed (`rollout.hf_decode`, docs/engines.md).

What it owns:
- (which path runs, and for which models, is megappo.rollout.hf.decode_paths's `choose_decode`)
- `StaticDecoder`: the decode loop after the engine's prefill. Its state lives in buffers allocated once for
  [N_max samples, C positions] and reused by every call while they are large enough: the KV cache `kv`
  [L, 2, N_max, H_kv, C, d] (all layers in one tensor, so compaction is one copy), the attention mask
  `valid` [N_max, C], each row's last token, position and sample id, the [R, N] uniforms, and the outputs
  (tokens, log-probs, the step of each sample's first stop token). A step feeds every row of its bucket one
  token at the shared cache column P + t - 1 (static cache positions, like transformers' StaticCache; rows
  differ only in their left padding, which the mask hides), attends over the cache's first W columns only
  (the window: the written columns rounded up to a multiple of the window step, so a step reads the KV it
  needs, not all C columns), samples row i's token with u[t, sample_i] from the engine's seeded [R, N] draw
  (the same `sample_tokens` as the dynamic path), and records it. Nothing reads a device value back inside a
  step. Every `eos_check_every` steps the host reads which samples still run: when none do the loop ends;
  when they fit a smaller bucket, they are moved (with their cache rows) to the first rows and the loop
  continues at that bucket. Finished samples left inside a bucket keep being computed and are masked out of
  the results afterwards (tokens after a sample's first stop token are dropped), so the steps run after the
  last sample finished cost time but change nothing.
- Buckets: the call's N, then the powers of two below it; every step runs at one of them.
- Windows: W grows with the column written, in steps of `window_step` columns (at most MAX_WINDOWS windows
  over the capacity, at least WINDOW_MIN columns each, multiples of 16 for SDPA's masks); a step runs at one
  (bucket, window) pair, and the host knows both without reading the device (the column is the prompt width
  plus the step). At 128 x (32 + 512) tokens of a 1.7B MHA model the full cache is 4x the weights' bytes; a
  step that reads only the written columns reads about half of it on average.
- CUDA graphs (`capture=True`): the first step at a bucket, window and sampling setting runs eagerly
  (warm-up, a real step), then is captured into a graph that later steps replay; all graphs share one memory
  pool. Graphs read the model's parameters where they are: weight syncs must copy into them in place (the hf
  engine's `update_weights` does). The cache and the graphs stay until `free()`.
- The step's kernels (megappo.rollout.hf.decode_kernels.StepKernels, around each step's forward): attention
  with the query heads grouped by their KV head, RMSNorm as torch's rms_norm, RoPE in fewer kernels; and the
  attention mask made additive once a step (SDPA would convert a boolean one at every layer).

Why not transformers' StaticCache: its layers hold one batch size each and count their own length;
the buckets here are views of one storage at several batch sizes, and the column is one device
scalar shared by every layer.

Shape legend: N samples (N_max the buffers' rows), b rows of the current bucket, P prompt width
(left-padded), C cache capacity (>= P + R), W the current attention window (<= C), R new tokens,
V vocab, L layers, H_kv KV heads, d head dim.

This module does not know about Megatron, the bridge, configs, LoRA or MoE routing; it runs the
model the hf engine hands it and samples with megappo.rollout.hf.sampling, as the dynamic path does.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer

from megappo.rollout.hf.decode_kernels import StepKernels
from megappo.rollout.hf.sampling import sample_tokens
from megappo.types import SamplingParams


def decode_buckets(num: int) -> list[int]:
    """[num, then the powers of two below it], descending: the batch sizes decode steps run at."""
    out, size = [num], 1
    while size < num:
        out.append(size)
        size *= 2
    return sorted(set(out), reverse=True)


CAPACITY_MULTIPLE = 64  # cache positions are allocated in these (SDPA's kernels want masks aligned to 16)
WINDOW_MIN = 64  # the columns of the smallest attention window (module docstring, "Windows")
MAX_WINDOWS = 16  # a long cache gets wider window steps: at most this many windows, so graphs per bucket
WHOLE_CACHE = 1 << 30  # a window step past any capacity: every step attends over all C columns (a baseline)
RUNNING = 2**62  # first_stop of a sample that has sampled no stop token yet (any step is smaller)


def window_step(capacity: int) -> int:
    """The columns by which the attention window grows for a cache of `capacity` columns (a multiple
    of 16: SDPA's memory-efficient kernel wants its mask's rows aligned)."""
    return max(WINDOW_MIN, -(-capacity // (MAX_WINDOWS * 16)) * 16)


class FixedLayer(DynamicLayer):
    """One layer's view of the decoder's cache at bucket b and window W: keys / values [b, H_kv, C, d]
    (views of the shared storage); a decode step writes its one column at the shared device column `col`
    (< W) in place and attends over the first W columns (the mask hides the unwritten ones)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, col: torch.Tensor, window: int):
        super().__init__()
        self.keys, self.values, self.col, self.window = keys, values, col, window
        self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        assert key_states.shape[0] == self.keys.shape[0] and key_states.shape[2] == 1, \
            (key_states.shape, self.keys.shape)
        self.keys.index_copy_(2, self.col, key_states)
        self.values.index_copy_(2, self.col, value_states)
        return self.keys[:, :, :self.window], self.values[:, :, :self.window]

    def get_seq_length(self, *args, **kwargs) -> int:  # positions come as position_ids: the length is unused
        return self.window

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class StaticDecoder:
    """The fixed-shape decode loop (module docstring). `model`: the engine's HF causal LM; `cache_keyword`:
    the name its forward takes the cache under; `capture`: CUDA graphs; `eos_check_every`: steps between
    the host's reads of which samples still run (>= 1); `log`: where the one line per new capture goes;
    `window`: the window step in columns (a multiple of 16; default: `window_step` of the capacity)."""

    def __init__(self, model: torch.nn.Module, cache_keyword: str, *, capture: bool, eos_check_every: int,
                 log: Callable[[str], None] = print, window: int | None = None):
        if eos_check_every < 1:
            raise ValueError(f"eos_check_every={eos_check_every} must be >= 1 (rollout.hf_eos_check_every)")
        if window is not None and (window < 16 or window % 16):
            raise ValueError(f"window={window}: the attention window step must be a positive multiple of 16")
        self.model, self.cache_keyword, self.capture = model, cache_keyword, capture
        self.eos_check_every, self.log, self.window = eos_check_every, log, window
        self.kv: torch.Tensor | None = None
        self._kernels = StepKernels(model)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._caches: dict[tuple[int, int], Cache] = {}  # (bucket, window) -> the layers' views
        self._stops: dict[tuple, torch.Tensor] = {}  # stop ids -> the device tensor steps compare with
        self._pool = None
        self.capture_seconds = 0.0  # all captures so far (warm-up step + capture)
        self.graphs_captured = 0

    # ---------------------------------------------------------------- buffers

    def _ensure(self, rows: int, capacity: int, like: torch.Tensor) -> None:
        """Buffers for at least `rows` samples and `capacity` positions (prompt + response, so also >= the
        new tokens), with the prefill's KV shape / dtype / device (`like`: [B, H_kv, P, d]); kept when
        they already fit."""
        layers = self.model.config.num_hidden_layers
        _b, heads, _p, dim = like.shape
        kv = self.kv
        if (kv is not None and kv.dtype == like.dtype and kv.device == like.device and kv.shape[0] == layers
                and kv.shape[3] == heads and kv.shape[5] == dim and kv.shape[2] >= rows and kv.shape[4] >= capacity):
            return
        if kv is not None:
            rows, capacity = max(rows, kv.shape[2]), max(capacity, kv.shape[4])
        capacity = -(-capacity // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
        self.free()  # graphs read the old buffers' addresses: they go with them
        dev = like.device
        # zeros: masked columns are multiplied by 0 in attention, and 0 * garbage may be NaN
        self.kv = torch.zeros((layers, 2, rows, heads, capacity, dim), dtype=like.dtype, device=dev)
        self.valid = torch.zeros((rows, capacity), dtype=torch.bool, device=dev)  # [N_max, C] attend here
        #: what a step adds to its attention scores where `valid` is True / False (the additive mask's values)
        self.attend = torch.zeros((), dtype=like.dtype, device=dev)
        self.skip = torch.full((), float("-inf"), dtype=like.dtype, device=dev)
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)  # [N_max] the token fed next
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)  # [N_max] its position
        self.sample = torch.arange(rows, device=dev)  # [N_max] which sample each row is
        self.col = torch.zeros(1, dtype=torch.long, device=dev)  # the cache column written next
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # the response position sampled next
        self.uniforms = torch.zeros((capacity, rows), dtype=torch.float32, device=dev)  # [R <= C, N_max]
        self.ids = torch.zeros((rows, capacity), dtype=torch.long, device=dev)  # [N_max, R <= C] by sample
        self.log_probs = torch.zeros((rows, capacity), dtype=torch.float32, device=dev)
        #: [N_max] the step of each sample's first stop token; RUNNING while it has none
        self.first_stop = torch.zeros(rows, dtype=torch.long, device=dev)

    def kv_cache_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def free(self) -> None:
        """Drop the graphs, then the buffers they read."""
        self._graphs, self._caches, self._stops, self._pool, self.kv = {}, {}, {}, None, None

    def _cache(self, b: int, w: int) -> Cache:
        if (b, w) not in self._caches:
            self._caches[b, w] = Cache(layers=[FixedLayer(self.kv[i, 0, :b], self.kv[i, 1, :b], self.col, w)
                                               for i in range(self.kv.shape[0])])
        return self._caches[b, w]

    def _window(self, col: int) -> int:
        """The columns a step writing column `col` attends over: col + 1 rounded up to the window step."""
        capacity = self.kv.shape[4]
        step = self.window or window_step(capacity)
        return min(capacity, -(-(col + 1) // step) * step)

    # ---------------------------------------------------------------- one step

    def _record(self, b: int, tok: torch.Tensor, lp: torch.Tensor, stop: torch.Tensor) -> None:
        """Rows [0, b) sampled `tok` [b] with log-probs `lp` [b] at response position `step`."""
        rows = self.sample[:b]
        at = (rows, self.step.expand(b))
        self.ids.index_put_(at, tok)
        self.log_probs.index_put_(at, lp.float())
        first = self.first_stop[rows]
        # torch.isin would sort (and sync) on CUDA for 10+ stop ids: a comparison never does
        hit = (tok[:, None] == stop[None, :]).any(-1) & (first == RUNNING)
        self.first_stop[rows] = torch.where(hit, self.step.expand(b), first)
        self.tok[:b] = tok

    def _step(self, b: int, w: int, params: SamplingParams, stop: torch.Tensor) -> None:
        """Feed rows [0, b) their last token at column `col` (< w), attending over columns [0, w), sample
        response position `step`, advance. Only device work on fixed buffers: what a CUDA graph captures."""
        self.valid[:b].index_fill_(1, self.col, True)
        # additive, made once a step: SDPA would turn a boolean mask into this at every layer (3-4 kernels)
        mask = torch.where(self.valid[:b, None, None, :w], self.attend, self.skip)  # [b, 1, 1, w]
        with self._kernels:
            out = self.model(input_ids=self.tok[:b, None], attention_mask=mask, position_ids=self.pos[:b, None],
                             use_cache=True, **{self.cache_keyword: self._cache(b, w)})
        logits = out.logits[:, -1].float()  # [b, V]
        uniforms = None if params.greedy else self.uniforms[self.step, self.sample[:b]]
        tok, lp = sample_tokens(logits, params, uniforms)
        self._record(b, tok, lp, stop)
        self.pos[:b] += 1
        self.col += 1
        self.step += 1

    def _run_step(self, b: int, w: int, params: SamplingParams, stop: torch.Tensor, key: tuple) -> None:
        if not self.capture:
            self._step(b, w, params, stop)
            return
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up is this step, run for real
            self._step(b, w, params, stop)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:  # thread_local: a trainer thread's CUDA work (rollout.mode=async) does not break the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._step(b, w, params, stop)  # recorded, not run
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the same steps run uncaptured; say so once
            self.capture = False
            self._graphs, self._pool = {}, None
            first = (str(e).strip().splitlines() or [""])[0][:200]
            self.log(f"megappo: warning: hf engine: capturing a decode step failed ({type(e).__name__}: {first}); "
                     "decoding without CUDA graphs (rollout.hf_decode=static) from here on")
            return
        self._graphs[key] = graph
        self.capture_seconds += time.perf_counter() - start
        self.graphs_captured += 1

    # ---------------------------------------------------------------- the loop

    @torch.no_grad()
    def decode(self, prefill_cache: Cache, logits: torch.Tensor, prompt_mask: torch.Tensor, next_pos: torch.Tensor,
               params: SamplingParams, uniforms: torch.Tensor | None, stop: torch.Tensor, *, repeats: int,
               capacity: int, pad_token_id: int, extra_key: tuple = ()
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """After the engine's prefill of B unique prompts: `prefill_cache` (each layer's keys [B, H_kv, P, d]),
        `logits` [N, V] float32 of each sample's first token (prompt rows repeated `repeats` times),
        `prompt_mask` [N, P] (device), `next_pos` [N] (each sample's first response position), `uniforms`
        [R, N] or None (greedy), `stop` the stop ids (device). `capacity`: cache positions to allocate at least
        (>= P + R); `extra_key`: anything else a captured graph depends on (the engine's adapter layout).
        Returns (response ids [N, R] with `pad_token_id` after each sample's end, log-probs [N, R] with 0 there,
        lengths [N], finished [N] bool: ended by a stop token), on the device."""
        num, width, prompt_width = logits.shape[0], params.max_new_tokens, prompt_mask.shape[1]
        layers = prefill_cache.layers
        self._ensure(num, max(capacity, prompt_width + width), layers[0].keys)
        kv = self.kv
        for i, layer in enumerate(layers):  # sample j of prompt i gets row i * repeats + j
            kv[i, 0, :num, :, :prompt_width] = layer.keys.repeat_interleave(repeats, 0)
            kv[i, 1, :num, :, :prompt_width] = layer.values.repeat_interleave(repeats, 0)
        self.valid[:num] = False
        self.valid[:num, :prompt_width] = prompt_mask.bool()
        self.pos[:num] = next_pos
        self.sample[:num] = torch.arange(num, device=kv.device)
        self.first_stop[:num] = RUNNING
        self.ids[:num] = 0
        self.log_probs[:num] = 0
        if uniforms is not None:
            self.uniforms[:width, :num] = uniforms
        self.step.fill_(0)
        self.col.fill_(prompt_width)

        stop_ids = tuple(stop.tolist())
        # the decoder's own copy: a captured graph reads this address on every replay, in later calls too
        stop = self._stops.setdefault(stop_ids, stop.clone())
        tok, lp = sample_tokens(logits, params, None if uniforms is None else uniforms[0])  # step 0: the prefill's
        self._record(num, tok, lp, stop)
        self.step += 1
        setting = (params.greedy, params.temperature, params.top_k, params.top_p, params.logprob_mode,
                   stop_ids, *extra_key)
        buckets, b, captured = decode_buckets(num), num, self.graphs_captured
        for t in range(1, width):
            if (t - 1) % self.eos_check_every == 0:  # the host's only reads: every k steps
                running = (self.first_stop[self.sample[:b]] == RUNNING).cpu()
                count = int(running.sum())
                if count == 0:
                    break
                smaller = min(size for size in buckets if size >= count)
                if smaller < b:
                    self._compact(b, running, used=prompt_width + t - 1)
                    b = smaller
            w = self._window(prompt_width + t - 1)  # the column this step writes: P + t - 1
            self._run_step(b, w, params, stop, (b, w, *setting))
        if self.graphs_captured > captured:
            self.log(f"megappo: hf engine: captured {self.graphs_captured - captured} decode graph(s) "
                     f"(batch buckets x attention windows, {num} samples) in {self.capture_seconds:.2f} s so far")
        first = self.first_stop[:num]
        lengths = torch.where(first < width, first + 1, width)  # RUNNING > width
        keep = torch.arange(width, device=kv.device)[None, :] < lengths[:, None]
        ids = self.ids[:num, :width].masked_fill(~keep, pad_token_id)
        log_probs = self.log_probs[:num, :width].masked_fill(~keep, 0.0)
        return ids, log_probs, lengths, first < width

    def _compact(self, b: int, running: torch.Tensor, used: int) -> None:
        """Rows [0, b): the running samples first (in row order), then the finished ones, each with its
        cache rows (the first `used` columns, all that were written), mask, token, position and sample id."""
        order = torch.cat([running.nonzero().squeeze(-1), (~running).nonzero().squeeze(-1)]).to(self.kv.device)
        self.kv[:, :, :b, :, :used] = self.kv[:, :, order, :, :used]
        for buffer in (self.valid, self.tok, self.pos, self.sample):
            buffer[:b] = buffer[order]
