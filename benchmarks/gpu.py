#!/usr/bin/env python
"""GPU measurements for megappo: actor MFU, rollout generation, weight sync (one process).

    python benchmarks/gpu.py [--sections mfu,gen,sync] [--sizes 1b,8b] [--json PATH] [--smoke]

Runs on one GPU (NCCL, cuda) as a world of one process (TP=PP=DP=1); without CUDA it runs
on cpu with gloo and megappo's CPU compatibility layer. Every section measures a baseline
in the same run and prints a table; `--json PATH` gets the config and every row (rewritten
after each section, so a run cut short keeps what it finished). Rows that need a package
that is not installed (Transformer Engine, SGLang) or CUDA say `skipped: <why>`; a row
that fails says `error: <why>` (traceback on stderr) and the run goes on.

Sections (sizes: Llama-architecture configs with random weights, `SIZES` below):

mfu   The actor on Megatron-Core (megappo's `build_model`, local layer spec, and the
      Transformer Engine spec when transformer_engine imports), `--micro-batches` sequences of
      `--seq-len` tokens per call, after `--warmup` calls, median of `--steps`. The forward and update
      rows run the workers as the trainer does by default: packed micro-batches of at most
      `--pack-tokens` tokens (THD; on CUDA in bf16 attention is one fused varlen call per micro-batch,
      megappo.models.attention_dispatch); `--pack-tokens 0`: one padded sequence per micro-batch
      (Megatron's unfused DotProductAttention, the [heads, T, T] scores), as measured before 2026-11-26:
        forward      PolicyWorker.log_probs (the old-log-prob pass: log-probs + entropy)
        fwd+bwd      megappo's forward path (models.forward.run_micro_batches) with the actor's
                     loss (vocab-parallel log-probs + entropy, clipped policy loss), gradients
                     only, no optimizer; one padded sequence per micro-batch whatever --pack-tokens
        update       PolicyWorker.update: the same plus Megatron DDP (fp32 grad buffer) and
                     Megatron's Adam with fp32 main params; skipped when those 16 bytes per
                     parameter do not fit in free memory (8B on 80 GB)
        ..., LM head in chunks of C   the forward and update rows again with model.lm_head_chunk_tokens=C
                     (`--head-chunk`, default 1024; 0 leaves them out): the LM head, log-probs and entropy
                     over chunks of C tokens, never the [T, V] logits (megappo.parallel.chunked_head);
                     compare their `peak GB` and speed with the rows above
      A row that runs out of memory is retried at half the sequence length, down to
      `--min-seq-len`; the row shows the length it ran at. `--profile-dir DIR`: one more call of each
      update row under torch.profiler: DIR/<size>-<spec>-update[-chunked-head].txt (the operators by
      device and by host time) and the row's `device_busy`, the kernels' time over the call's wall time
      (under 1: the host sets the pace).
      Model FLOPs are megappo's own count (megappo.models.flops.pass_flops, the one the trainer's
      `perf/tflops/...` metrics use): 6 N T + 6 N_head K + 6 L A sum(s^2) for training, a third of
      it forward only, with the head on the K response positions, causal attention counted half.
      TFLOP/s = FLOPs / seconds. MFU = TFLOP/s / peak, against the device's dense peak in the run's
      dtype (megappo.metrics.perf.PEAK_TFLOPS, or `--peak-tflops`) and against the baseline: a plain torch
      matmul of 8192^3 measured in this run (what the device achieves).
gen   Rollout generation with random weights, one batch (temperature 1, no top-k/top-p, no early stop:
      every call runs `--gen-new-tokens` decode steps), `--gen-repeats` timed calls per row after a
      warm-up call: megappo's hf engine on each decode path (rollout.hf_decode): dynamic (today's
      loop, the baseline), static (fixed-shape bucketed steps, uncaptured), graphs (CUDA only; the
      one-time capture cost in its own column), and the peer, transformers' `model.generate` with its
      static cache and torch.compile (CUDA only, not in --smoke; the first call's extra time, compile
      and capture, in the capture column); graphs again with every step attending over the whole cache
      (no attention windows: what the windows save); SGLangEngine when sglang imports. Per row: the median call,
      ms per decode step, max/min over the calls, tokens/s, vs the baseline and vs the peer.
sync  The weight bridge (`WeightBridge`) from the Megatron actor into the hf engine on the
      same device (colocated), with and without fingerprint verification, vs the baseline: a
      device-to-device `copy_` of the same bytes into the same engine tensors; SGLangEngine
      (sync_mode=tensor) when sglang imports. Timed with a device synchronize on both sides.

e2e   Whole runs of `megappo train` (a subprocess each) on the recipes in benchmarks/gpu_e2e/: GRPO on a
      1.7B-shaped and PPO with a critic on a 360M-shaped Llama (random init, bf16, the hf engine on
      the GPU), `--e2e-steps` steps each, read back from the run's metrics.jsonl (`summarize_metrics`):
      medians over the steps after the first (warm-up) of the step, each stage's time and
      perf/throughput (tokens/s per GPU); the spread of the generation time (slowest / fastest step);
      the peak of perf/max_memory_allocated_gb against `megappo plan`'s total for the same recipe
      (megappo.plan.planner.make_plan); perf/mfu/actor. A run that fails is an error row with its log's tail;
      a run that passes `--e2e-timeout` (or what is left of `--time-limit`) is killed (its whole
      process group) and its row holds the steps it finished (`timed_out` set, `steps` below
      `--e2e-steps`), an error row if none.

`--smoke`: tiny sizes, fp32, short lengths; every section end to end in well under a minute
on a CPU (tests/e2e/test_gpu_bench_smoke.py), or as a first check on a GPU machine.
benchmarks/GPU.md has the commands for a GPU session.

This script does not know about PPO's algorithm or configs: it times megappo's pieces.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                 max_positions: int = 8192) -> dict[str, Any]:
    """HF config.json content of a Llama-architecture model (untied embeddings)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02}


SIZES = {
    "1b": llama_config(2048, 16, 16, 8, 8192, 128256),
    "8b": llama_config(4096, 32, 32, 8, 14336, 128256),  # Llama-3.1-8B's dims (RoPE scaling left out)
    "1p7b": llama_config(2048, 24, 32, 32, 8192, 49152),  # gpu_e2e/grpo-1p7b.yaml's model (SmolLM2-1.7B's dims)
    "tiny": llama_config(64, 2, 4, 2, 128, 512, max_positions=256),
}

#: settings of a full run and of --smoke; a flag given on the command line wins over both
E2E_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_e2e")

DEFAULTS = dict(e2e_recipes="grpo-1p7b,ppo-360m", e2e_steps=6, e2e_timeout=240, sizes="1b,8b", gen_size="1b", dtype="bfloat16", seq_len=4096, min_seq_len=1024, prompt_len=512,
                micro_batches=4, warmup=2, steps=5, repeats=3, matmul_n=8192, gen_batch=64, gen_prompt_len=128,
                gen_new_tokens=256, gen_repeats=5, bucket_mb=512, head_chunk=1024, profile_dir="", pack_tokens=4096)
SMOKE = dict(e2e_recipes="tiny", e2e_steps=2, e2e_timeout=180, sizes="tiny", gen_size="tiny", dtype="float32", seq_len=64, min_seq_len=64, prompt_len=16,
             micro_batches=2, warmup=1, steps=2, repeats=2, matmul_n=256, gen_batch=4, gen_prompt_len=8,
             gen_new_tokens=8, gen_repeats=2, bucket_mb=1, head_chunk=16, profile_dir="", pack_tokens=64)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass
class Row:
    """One line of a section's table (and of the JSON)."""

    section: str
    what: str
    status: str = "ok"  # "ok", "skipped: <why>" or "error: <why>"
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    gpu_only: bool = False  # needs CUDA and a GPU package (TE, SGLang): skipped on CPU
    baseline: bool = False


@dataclasses.dataclass
class Bench:
    """What every section reads: the resolved settings, the device, the parallel state."""

    settings: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    ps: Any = None  # megappo ParallelState (world of one), for the sections that build Megatron models
    peak_tflops: float | None = None
    matmul_tflops: float | None = None  # the mfu section's baseline, once measured
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def seconds_left(self) -> float:
        """Of `--time-limit` (infinite without one)."""
        limit = self.settings.time_limit
        return float("inf") if not limit else limit - (time.perf_counter() - self.start)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype_name(self) -> str:
        return {v: k for k, v in DTYPES.items()}[self.dtype]


# --------------------------------------------------------------------------- helpers

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def median_seconds(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls after `warmup`, synchronized on both sides."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed_runs(fn, device, repeats))


def unavailable(package: str, device: torch.device) -> str | None:
    """Why a GPU-only row cannot run here, or None when it can."""
    if importlib.util.find_spec(package) is None:
        return f"skipped: {package} not installed"
    if device.type != "cuda":
        return "skipped: needs CUDA"
    return None


def guarded(section: str, what: str, measure: Callable[[], dict[str, Any]], **row_fields) -> Row:
    """Row(values=measure()), or an error row (traceback on stderr) when it raises."""
    try:
        return Row(section, what, values=measure(), **row_fields)
    except Exception as e:  # one failed row must not cost the rest of a timed GPU session
        traceback.print_exc()
        message = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return Row(section, what, status=f"error: {type(e).__name__}: {message}", **row_fields)
    finally:
        free_memory()


def hf_model(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised HF CausalLM built directly on `device` (no host copy of 8B weights)."""
    from transformers import AutoModelForCausalLM

    from megappo.models.hf_reference import hf_config_object

    cfg = hf_config_object(config)
    cfg.dtype = dtype
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype).eval()


# --------------------------------------------------------------------------- mfu

def matmul_row(b: Bench) -> Row:
    """The achievable peak: a plain torch matmul of matmul_n^3 in the run's dtype."""
    n = b.settings.matmul_n

    def measure():
        x = torch.randn(n, n, device=b.device, dtype=b.dtype)
        y = torch.randn(n, n, device=b.device, dtype=b.dtype)
        calls = 20

        def run():
            for _ in range(calls):
                torch.mm(x, y)

        seconds = median_seconds(run, b.device, warmup=1, repeats=b.settings.steps) / calls
        b.matmul_tflops = 2 * n**3 / seconds / 1e12
        return {"seconds": seconds, "tflops": b.matmul_tflops,
                "mfu_vs_spec": b.matmul_tflops / b.peak_tflops if b.peak_tflops else None, "mfu_vs_matmul": 1.0}

    return guarded("mfu", f"torch.mm {n}^3 {b.dtype_name} (baseline)", measure, baseline=True)


def ppo_experience(b: Bench, dims, seq_len: int):
    """`micro_batches` random sequences [n, T] (prompt + response, no padding) and an
    Experience with random old log-probs and advantages, on the host, as the orchestrator
    builds them (run_micro_batches moves each micro-batch to the device)."""
    from megappo.trainer.roles import Experience, SeqBatch

    n, prompt = b.settings.micro_batches, min(b.settings.prompt_len, seq_len // 4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, dims.vocab_size, (n, seq_len), generator=gen)
    response = seq_len - prompt
    seqs = SeqBatch(input_ids=ids, attention_mask=torch.ones_like(ids),
                    response_mask=torch.ones(n, response, dtype=torch.long), prompt_len=prompt)
    return Experience(seqs=seqs, old_log_probs=-2 * torch.rand(n, response, generator=gen),
                      advantages=torch.randn(n, response, generator=gen))


def fwd_bwd_call(model, exp) -> Callable[[], None]:
    """One pass of megappo's forward path with the actor's loss (as PolicyWorker.update builds
    it, without the KL and entropy-bonus terms, which are off by default) and its backward."""
    from megappo.models.forward import run_micro_batches
    from megappo.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy
    from megappo.ppo.losses import LossInputs, global_counts, policy_loss

    seqs, prompt = exp.seqs, exp.seqs.prompt_len
    counts = global_counts(seqs.response_mask)
    micro_batches = [{"input_ids": seqs.input_ids[i:i + 1], "attention_mask": seqs.attention_mask[i:i + 1],
                      "response_mask": seqs.response_mask[i:i + 1], "old": exp.old_log_probs[i:i + 1],
                      "adv": exp.advantages[i:i + 1]} for i in range(seqs.size)]

    def on_output(logits, mb):  # [1, T, V_pad] (TP=1; these vocabularies need no padding rows)
        log_probs, _entropy = vocab_parallel_log_probs_and_entropy(
            logits[:, prompt - 1:-1].float(), mb["input_ids"][:, prompt:], model.ps.tp_group)
        loss, _ = policy_loss(LossInputs(old_log_prob=mb["old"], log_prob=log_probs, advantages=mb["adv"],
                                         response_mask=mb["response_mask"], **counts))
        return loss, None

    def call():
        for chunk in model.chunks:
            chunk.zero_grad(set_to_none=True)
        run_micro_batches(model, micro_batches, on_output, forward_only=False)

    return call


def throughput_row(b: Bench, what: str, dims, make_call, *, training: bool, profile: str = "", **row_fields) -> Row:
    """Tokens/s, TFLOP/s and MFU of `make_call(experience)()`; halves the sequence on OOM. `profile`: a
    file name for one profiled call after the timed ones (with --profile-dir)."""
    from megappo.models.flops import pass_flops

    def measure():
        seq_len = b.settings.seq_len
        while True:
            reset_peak(b.device)
            try:
                call = make_call(ppo_experience(b, dims, seq_len))
                seconds = median_seconds(call, b.device, warmup=b.settings.warmup, repeats=b.settings.steps)
                break
            except torch.OutOfMemoryError:
                if seq_len // 2 < b.settings.min_seq_len:
                    raise
            call = None
            free_memory()
            print(f"  {what}: out of memory at seq {seq_len}, retrying at {seq_len // 2}", flush=True)
            seq_len //= 2
        n, prompt = b.settings.micro_batches, min(b.settings.prompt_len, seq_len // 4)  # as ppo_experience
        tokens = n * seq_len
        tflops = pass_flops(dims, [seq_len] * n, n * (seq_len - prompt), training=training) / seconds / 1e12
        values = {"seq_len": seq_len, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                  "tflops": tflops, "mfu_vs_spec": tflops / b.peak_tflops if b.peak_tflops else None,
                  "mfu_vs_matmul": tflops / b.matmul_tflops if b.matmul_tflops else None,
                  "peak_mem_gb": peak_gb(b.device)}
        if profile and b.settings.profile_dir:
            try:  # the timed row stands whatever the profiler does
                values.update(profile_call(call, b, profile))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                values["profile"] = f"error: {type(e).__name__}: {e}"[:160]
        return values

    return guarded("mfu", what, measure, **row_fields)


def profile_call(call: Callable[[], Any], b: Bench, name: str) -> dict[str, Any]:
    """One more call of `call` under torch.profiler: its operator table (the top 30 by device time, then by
    host time) in `--profile-dir`/NAME.txt, and `device_busy`: the kernels' summed time over the call's wall
    time (CUDA; None on a CPU), the fraction of the call the GPU computed: well under 1 means the host
    (launches, Python) sets the pace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.cuda else [])
    synchronize(b.device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        call()
        synchronize(b.device)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    busy = None
    if b.cuda:  # kernels only: their self device time; the operators above them would count it again
        kernels = [getattr(e, "self_device_time_total", 0) for e in averages
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        busy = sum(kernels) / 1e6 / wall if kernels else None  # None: this torch's profiler named no kernel
    os.makedirs(b.settings.profile_dir, exist_ok=True)
    path = os.path.join(b.settings.profile_dir, f"{name}.txt")
    with open(path, "w") as f:
        f.write(f"{name}: wall {wall:.3f} s, device busy {busy if busy is None else f'{busy:.1%}'}\n\n")
        for key in (("device_time_total", "cpu_time_total") if b.cuda else ("cpu_time_total",)):
            f.write(averages.table(sort_by=key, row_limit=30) + "\n\n")
    print(f"  profile: {path} (device busy {busy if busy is None else f'{busy:.1%}'})", flush=True)
    return {"profile": path, "device_busy": busy}


def update_memory_check(b: Bench, n_total: int) -> str | None:
    """A skip reason when Megatron's fp32 grad buffer, main params and Adam states (16 bytes
    per parameter on top of the bf16 weights) would not fit in the free device memory."""
    if not b.cuda:
        return None
    need = 16 * n_total
    free, _total = torch.cuda.mem_get_info(b.device)
    if need > 0.8 * free:
        return (f"skipped: fp32 grads + main params + Adam need {need / 1e9:.0f} GB, "
                f"{free / 1e9:.0f} GB free")
    return None


def actor_rows(b: Bench, size: str, spec: str) -> list[Row]:
    from megappo.models.builders import build_model
    from megappo.models.hf_config import dims_from_hf
    from megappo.models.training import OptimSettings, make_trainable
    from megappo.parallel.packing import MicroBatching
    from megappo.trainer.roles import PolicyWorker

    dims = dims_from_hf(SIZES[size])
    label, gpu_only = f"{size} {spec}", spec == "te"
    holder = {}

    def build():
        holder["model"] = build_model(dims, b.ps, dtype=b.dtype_name, layer_spec=spec)
        return {}

    built = guarded("mfu", f"{label} build", build, gpu_only=gpu_only)
    if built.status != "ok":
        return [built]
    model = holder.pop("model")
    n_total = sum(p.numel() for _n, _r, p in model.named_parameters())
    print(f"  {label}: {n_total:,} parameters", flush=True)
    head_chunk, pack = b.settings.head_chunk, b.settings.pack_tokens
    # the trainer's default: packed by a token budget (one sequence always fits); or padded, one sequence each
    batching = (MicroBatching(packed=True, max_tokens=max(pack, b.settings.seq_len)) if pack
                else MicroBatching(packed=False, micro_batch_size=1))
    mode = f"packed {pack}" if pack else "padded"
    reader = PolicyWorker(model, batching=batching)
    chunked_reader = PolicyWorker(model, batching=batching, lm_head_chunk_tokens=head_chunk) if head_chunk else None
    rows = [
        throughput_row(b, f"{label} {mode} forward (PolicyWorker.log_probs)", dims,
                       lambda exp: lambda: reader.log_probs(exp.seqs, with_entropy=True),
                       training=False, gpu_only=gpu_only),
        *([throughput_row(b, f"{label} {mode} forward, LM head in chunks of {head_chunk}", dims,
                          lambda exp: lambda: chunked_reader.log_probs(exp.seqs, with_entropy=True),
                          training=False, gpu_only=gpu_only)] if head_chunk else []),
        throughput_row(b, f"{label} padded fwd+bwd (actor loss, no optimizer)", dims,
                       lambda exp: fwd_bwd_call(model, exp), training=True, gpu_only=gpu_only),
    ]
    update = f"{label} {mode} update (PolicyWorker.update, DDP + Adam)"
    why = update_memory_check(b, n_total)
    if why:
        rows.append(Row("mfu", update, status=why, gpu_only=gpu_only))
        return rows
    for chunk in model.chunks:
        chunk.zero_grad(set_to_none=True)
    holder = {}

    def wrap():  # Megatron DDP around the chunks and Megatron's optimizer: once, after the rows above
        holder["actor"] = PolicyWorker(model, batching=batching,
                                       trainable=make_trainable(model, OptimSettings(lr=1e-7, total_steps=1000)))
        return {}

    wrapped = guarded("mfu", f"{update}: setup", wrap, gpu_only=gpu_only)
    if wrapped.status != "ok":
        rows.append(wrapped)
        return rows
    actor = holder.pop("actor")
    update_args = dict(mini_batch_size=b.settings.micro_batches, epochs=1, loss_mode="vanilla",
                       loss_knobs=dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0),
                       loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False,
                       kl_loss_coef=0.0, kl_loss_type="low_var_kl", seed=0)
    rows.append(throughput_row(b, update, dims, lambda exp: lambda: actor.update(exp, **update_args),
                               training=True, profile=f"{size}-{spec}-update", gpu_only=gpu_only))
    if head_chunk:  # the same model, DDP buffers and optimizer; the passes compute the LM head chunk by chunk
        chunked = PolicyWorker(model, batching=batching, trainable=actor.trainable, lm_head_chunk_tokens=head_chunk)
        rows.append(throughput_row(b, f"{update}, LM head in chunks of {head_chunk}", dims,
                                   lambda exp: lambda: chunked.update(exp, **update_args), training=True,
                                   profile=f"{size}-{spec}-update-chunked-head", gpu_only=gpu_only))
    return rows


def bench_mfu(b: Bench) -> list[Row]:
    rows = [matmul_row(b)]
    for size in b.settings.sizes:
        for spec in ("local", "te"):
            why = None if spec == "local" else unavailable("transformer_engine", b.device)
            if why:
                rows.append(Row("mfu", f"{size} te (all rows)", status=why, gpu_only=True))
                continue
            rows.extend(actor_rows(b, size, spec))
            free_memory()
    return rows


# --------------------------------------------------------------------------- gen

def timed_runs(fn: Callable[[], Any], device: torch.device, repeats: int) -> list[float]:
    """Wall times of `repeats` calls of `fn()`, each synchronized on both sides."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def gen_values(times: list[float], tokens: int, steps: int) -> dict[str, Any]:
    """A gen row's numbers from per-call times: the median call, tokens/s, ms per decode step, and the
    spread (slowest / fastest call) over the repeats."""
    seconds = statistics.median(times)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "repeats": len(times),
            "ms_per_step": 1000 * seconds / steps, "spread": max(times) / min(times), "times": times}


def bench_gen(b: Bench) -> list[Row]:
    """The hf engine's decode paths (rollout.hf_decode: dynamic = today's loop, the baseline; static
    uncaptured; graphs, CUDA only, with the one-time capture cost) and the peer, transformers' generate
    with its static cache and torch.compile (CUDA only; the first call compiles and is timed apart),
    on one batch with random weights, sampling at temperature 1 without EOS (every call runs
    gen_new_tokens decode steps), `--gen-repeats` timed calls each after one warm-up call."""
    from megappo.parallel import cpu_compat
    from megappo.rollout.hf.engine import HFEngine
    from megappo.rollout.hf.static_decode import WHOLE_CACHE
    from megappo.types import SamplingParams

    s = b.settings
    config = SIZES[s.gen_size]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, config["vocab_size"], (s.gen_batch, s.gen_prompt_len), generator=gen)
    params = SamplingParams(temperature=1.0, max_new_tokens=s.gen_new_tokens, seed=0)
    warm = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0)
    label = f"{s.gen_size}, {s.gen_batch} x {s.gen_prompt_len} prompt + {s.gen_new_tokens} new"
    model = hf_model(config, b.device, b.dtype)
    ids = prompts.to(b.device)
    count = s.gen_batch * s.gen_new_tokens

    def engine_row(path: str, what: str, whole_cache: bool = False, **row_fields) -> Row:
        def measure():
            engine = HFEngine(model, pad_token_id=0, device=b.device, decode=path,
                              max_tokens=s.gen_prompt_len + s.gen_new_tokens)
            if whole_cache:
                engine._static.window = WHOLE_CACHE
            last = {}

            def run():
                last["batch"] = engine.generate(prompts.tolist(), params)

            with cpu_compat.suspended():  # on CPU: the engine names no CUDA device (as the orchestrator does)
                engine.generate(prompts.tolist(), warm)  # the full batch: graphs captures its bucket here
                times = timed_runs(run, b.device, s.gen_repeats)
            values = gen_values(times, int(last["batch"].response_mask.sum()), s.gen_new_tokens)
            if path == "graphs":
                if not engine._static.capture:
                    raise RuntimeError("capture failed: the engine fell back to uncaptured steps (log above)")
                values["capture_s"] = engine._static.capture_seconds
                values["graphs"] = engine._static.graphs_captured
            engine.release_memory()
            return values

        return guarded("gen", what, measure, **row_fields)

    def peer():
        from transformers import CompileConfig

        def run():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=s.gen_new_tokens, min_new_tokens=s.gen_new_tokens,
                           pad_token_id=0, cache_implementation="static", compile_config=CompileConfig())

        first = timed_runs(run, b.device, 1)[0]  # compiles (and captures its graphs)
        values = gen_values(timed_runs(run, b.device, s.gen_repeats), count, s.gen_new_tokens)
        values["capture_s"] = first - values["seconds"]  # the first call's extra time: compile + capture
        torch._dynamo.reset()
        return values

    rows = [engine_row("dynamic", f"hf engine dynamic (today's path), {label} (baseline)", baseline=True),
            engine_row("static", f"hf engine static, uncaptured, {label}")]
    why = None if b.cuda else "skipped: needs CUDA"
    graphs = f"hf engine graphs (CUDA-graph decode), {label}"
    rows.append(Row("gen", graphs, status=why, gpu_only=True) if why else engine_row("graphs", graphs, gpu_only=True))
    what = f"transformers generate, static cache + torch.compile, {label} (peer)"
    why = why or ("skipped: --smoke (the full gen section measures the peer: its compile takes a minute)"
                  if s.smoke else None)
    rows.append(Row("gen", what, status=why, gpu_only=True) if why else guarded("gen", what, peer, gpu_only=True))
    why = None if b.cuda else "skipped: needs CUDA"
    what = f"hf engine graphs, every step attending over the whole cache (no windows), {label}"
    rows.append(Row("gen", what, status=why, gpu_only=True) if why
                else engine_row("graphs", what, whole_cache=True, gpu_only=True))
    why = unavailable("sglang", b.device)
    if why:
        rows.append(Row("gen", f"sglang engine (megappo), {label}", status=why, gpu_only=True))
    else:
        with tempfile.TemporaryDirectory(prefix="megappo-gpu-bench-") as tmp:
            model.save_pretrained(tmp)
            del model
            free_memory()
            rows.append(guarded("gen", f"sglang engine (megappo), {label}",
                                lambda: sglang_generate(b, tmp, prompts, params), gpu_only=True))
    baseline = rows[0].values.get("tokens_per_s")
    peer_rate = rows[3].values.get("tokens_per_s")
    for row in rows:
        if row.status == "ok" and baseline:
            row.values["vs_baseline"] = row.values["tokens_per_s"] / baseline
        if row.status == "ok" and peer_rate:
            row.values["vs_peer"] = row.values["tokens_per_s"] / peer_rate
    return rows


def sglang_generate(b: Bench, path: str, prompts: torch.Tensor, params) -> dict[str, Any]:
    from megappo.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(path, pad_token_id=0, dtype=b.dtype_name, mem_fraction_static=0.6)
    last = {}

    def run():
        last["batch"] = engine.generate(prompts.tolist(), params)

    try:
        seconds = median_seconds(run, b.device, warmup=1, repeats=b.settings.repeats)
    finally:
        engine.shutdown()
    tokens = int(last["batch"].response_mask.sum())
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


# --------------------------------------------------------------------------- sync

def sync_rows(b: Bench, size: str) -> list[Row]:
    from megappo.models.builders import build_model
    from megappo.models.hf_config import dims_from_hf
    from megappo.rollout.bridge import WeightBridge
    from megappo.rollout.hf.engine import HFEngine

    s, config = b.settings, SIZES[size]
    holder = {}

    def build():
        reset_peak(b.device)
        # bf16 straight onto the device on both sides: no fp32 master copy, no host copy
        holder["actor"] = build_model(dims_from_hf(config), b.ps, dtype=b.dtype_name)
        holder["engine"] = HFEngine(hf_model(config, b.device, b.dtype), pad_token_id=0, device=b.device)
        return {"peak_mem_gb": peak_gb(b.device)}

    built = guarded("sync", f"{size} build actor + hf engine", build)
    if built.status != "ok":
        return [built]
    actor, engine = holder.pop("actor"), holder.pop("engine")
    spec = type(actor.chunks[0].decoder.layers[0].self_attention.core_attention).__name__
    nbytes = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())

    def copy_baseline():
        targets = dict(engine.model.named_parameters())
        sources = {n: t.detach().clone() for n, t in targets.items()}

        @torch.no_grad()
        def copy():
            for name, target in targets.items():
                target.copy_(sources[name])

        seconds = median_seconds(copy, b.device, warmup=1, repeats=s.repeats)
        copied = sum(t.numel() * t.element_size() for t in sources.values())
        return {"seconds": seconds, "gb": copied / 1e9, "gb_per_s": copied / 1e9 / seconds}

    def bridge_sync(target, verify: bool):
        def measure():
            reset_peak(b.device)
            bridge = WeightBridge(actor, target, bucket_bytes=s.bucket_mb << 20, verify_every=1 if verify else 0)
            last = {}

            def sync():
                last["stats"] = bridge.sync()

            seconds = median_seconds(sync, b.device, warmup=1, repeats=s.repeats)
            delivered = last["stats"].bytes
            return {"seconds": seconds, "gb": delivered / 1e9, "gb_per_s": delivered / 1e9 / seconds,
                    "tensors": last["stats"].tensors, "buckets": last["stats"].buckets,
                    "peak_mem_gb": peak_gb(b.device)}

        return measure

    print(f"  {size}: {nbytes / 1e9:.2f} GB of HF tensors, actor core attention {spec}", flush=True)
    rows = [
        guarded("sync", f"{size} copy_ of the same bytes (baseline)", copy_baseline, baseline=True),
        guarded("sync", f"{size} bridge -> hf engine", bridge_sync(engine, verify=False)),
        guarded("sync", f"{size} bridge -> hf engine + verify", bridge_sync(engine, verify=True)),
    ]
    what = f"{size} bridge -> sglang engine (tensor) + verify"
    why = unavailable("sglang", b.device)
    if why:
        rows.append(Row("sync", what, status=why, gpu_only=True))
    else:
        with tempfile.TemporaryDirectory(prefix="megappo-gpu-bench-") as tmp:
            engine.model.save_pretrained(tmp)
            engine.shutdown()
            del engine
            free_memory()
            rows.append(guarded("sync", what, lambda: sglang_sync(b, tmp, bridge_sync), gpu_only=True))
    baseline = rows[0].values.get("seconds")
    for row in rows:
        if row.status == "ok" and baseline:
            row.values["vs_baseline"] = baseline / row.values["seconds"]
    return rows


def sglang_sync(b: Bench, path: str, bridge_sync) -> dict[str, Any]:
    from megappo.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(path, pad_token_id=0, dtype=b.dtype_name, sync_mode="tensor", mem_fraction_static=0.4)
    try:
        return bridge_sync(engine, verify=True)()
    finally:
        engine.shutdown()


def bench_sync(b: Bench) -> list[Row]:
    rows = []
    for size in b.settings.sizes:
        rows.extend(sync_rows(b, size))
        free_memory()
    return rows


# --------------------------------------------------------------------------- e2e

def summarize_metrics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.jsonl records (one per step) -> the e2e row's values: medians over the steady steps
    (all after the first, or the only one), the generation time's spread, the peak memory."""
    steps = sorted((r for r in records if "step" in r), key=lambda r: r["step"])
    if not steps:
        raise ValueError("metrics.jsonl has no step records")
    steady = steps[1:] or steps

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    gen = [r["timing_s/gen"] for r in steady if "timing_s/gen" in r]
    peaks = [r["perf/max_memory_allocated_gb"] for r in steps if "perf/max_memory_allocated_gb" in r]
    stages = sorted({k for r in steady for k in r if k.startswith("timing_s/")})
    return {"steps": len(steps), "steady_steps": len(steady), "step_s": median("timing_s/step"),
            "gen_s": median("timing_s/gen"), "gen_spread": max(gen) / min(gen) if gen and min(gen) > 0 else None,
            "tokens_per_s": median("perf/throughput"), "mfu_actor": median("perf/mfu/actor"),
            "peak_mem_gib": max(peaks) if peaks else None,
            "peak_by_stage_gib": {k.rsplit("/", 1)[1]: max(r[k] for r in steps if k in r) for k in sorted(
                {k for r in steps for k in r if k.startswith("perf/max_memory_allocated_gb/")})},
            "stages_s": {k.split("/", 1)[1]: median(k) for k in stages}}


def run_until(argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None) -> tuple[int | None, str]:
    """Run `argv` in a new session with stdout and stderr together; past `timeout` seconds, kill it with
    every process below it (SIGKILL: a stopped run would save a checkpoint first) and return (None, the
    output so far); else (exit code, output). Its process group alone would not do: a launched world's
    ranks (torchrun) and a part's own `run_until` children start sessions of their own."""
    import signal
    import subprocess

    import psutil

    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        try:
            below = psutil.Process(proc.pid).children(recursive=True)  # before the kill reparents them
        except psutil.NoSuchProcess:
            below = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for child in below:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        out, _ = proc.communicate()
        return None, out


def e2e_row(b: Bench, name: str, out_dir: str) -> Row:
    from megappo.config import load_config
    from megappo.plan.planner import GIB, make_plan

    s = b.settings
    timeout = min(s.e2e_timeout, b.seconds_left() - 10)  # 10 s to write the row and the JSON
    recipe = os.path.join(E2E_DIR, f"{name}.yaml")
    run_dir = os.path.join(out_dir, name)
    overrides = [f"hardware.device={'gpu' if b.cuda else 'cpu'}", f"run.output_dir={run_dir}",
                 f"run.total_steps={s.e2e_steps}", "checkpoint.keep_last=1"]

    def measure():
        plan = make_plan(load_config(recipe, overrides))
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                               "MASTER_ADDR", "MASTER_PORT")}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        start = time.perf_counter()
        if timeout < 20:
            raise RuntimeError(f"no time left for a run: {b.seconds_left():.0f} s of --time-limit {s.time_limit}")
        rc, output = run_until([sys.executable, "-m", "megappo.cli", "train", recipe, *overrides], env, timeout)
        wall = time.perf_counter() - start
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "e2e.log"), "w") as f:
            f.write(output)
        metrics = os.path.join(run_dir, "metrics.jsonl")
        records = []
        if os.path.isfile(metrics):
            with open(metrics) as f:
                for line in f:
                    with contextlib.suppress(ValueError):  # a last line cut by the stop
                        records.append(json.loads(line))
        if rc != 0 and not (rc is None and any("step" in r for r in records)):
            print(output[-3000:], file=sys.stderr)
            if rc is None:
                raise RuntimeError(f"megappo train passed its {timeout:.0f} s (--e2e-timeout, --time-limit) "
                                   "before its first step")
            last = [line for line in output.strip().splitlines() if line.strip()]
            raise RuntimeError(f"megappo train exited {rc}: {last[-1][:200] if last else ''}")
        values = summarize_metrics(records)
        if rc is None:  # stopped at the timeout: the steps it finished
            values["timed_out"] = True
            print(f"gpu.py: e2e {name}: stopped after {timeout:.0f} s (--e2e-timeout, --time-limit), {values['steps']} "
                  f"of {s.e2e_steps} steps done; the row holds those", file=sys.stderr)
        values.update(wall_s=wall, plan_gib=plan.total / GIB)
        if values["peak_mem_gib"] is not None:
            values["peak_vs_plan"] = values["peak_mem_gib"] / values["plan_gib"]
        return values

    return guarded("e2e", f"{name} (megappo train, {s.e2e_steps} steps)", measure)


def bench_e2e(b: Bench) -> list[Row]:
    import shutil

    free_memory()
    out_dir = b.settings.e2e_dir or tempfile.mkdtemp(prefix="megappo-gpu-e2e-")
    rows = []
    for name in b.settings.e2e_recipes:
        rows.append(e2e_row(b, name, out_dir))
        if not b.settings.e2e_dir:  # checkpoints of a 1.7B run are tens of GB
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    if not b.settings.e2e_dir:
        shutil.rmtree(out_dir, ignore_errors=True)
    return rows


# --------------------------------------------------------------------------- tables, config, main

#: section -> (function, columns: (values key, header, format))
SECTIONS = {
    "mfu": (bench_mfu, (("seq_len", "seq", "{:d}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                        ("seconds", "s/call", "{:.4f}"), ("tflops", "TFLOP/s", "{:.4g}"),
                        ("mfu_vs_spec", "MFU spec", "{:.1%}"), ("mfu_vs_matmul", "vs matmul", "{:.1%}"),
                        ("peak_mem_gb", "peak GB", "{:.1f}"), ("device_busy", "GPU busy", "{:.1%}"))),
    "gen": (bench_gen, (("tokens", "tokens", "{:d}"), ("seconds", "seconds", "{:.3f}"),
                        ("ms_per_step", "ms/step", "{:.2f}"), ("spread", "max/min", "{:.2f}"),
                        ("tokens_per_s", "tokens/s", "{:.0f}"), ("capture_s", "capture s", "{:.2f}"),
                        ("vs_baseline", "vs base", "{:.2f}x"), ("vs_peer", "vs peer", "{:.2f}x"))),
    "sync": (bench_sync, (("gb", "GB", "{:.4g}"), ("seconds", "seconds", "{:.4f}"), ("gb_per_s", "GB/s", "{:.4g}"),
                          ("vs_baseline", "vs copy_", "{:.3f}x"), ("peak_mem_gb", "peak GB", "{:.1f}"))),
    "e2e": (bench_e2e, (("steps", "steps", "{:d}"), ("step_s", "s/step", "{:.2f}"), ("gen_s", "gen s", "{:.2f}"),
                        ("gen_spread", "gen spread", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                        ("peak_mem_gib", "peak GiB", "{:.1f}"), ("plan_gib", "plan GiB", "{:.1f}"),
                        ("peak_vs_plan", "peak/plan", "{:.2f}"), ("mfu_actor", "MFU actor", "{:.1%}"))),
}


def print_table(section: str, rows: list[Row]) -> None:
    columns = SECTIONS[section][1]
    width = max(len(r.what) for r in rows) + 2
    print(f"\n== {section}")
    print(f"{'what':{width}s}" + "".join(f"{header:>11s}" for _key, header, _fmt in columns))
    for row in rows:
        if row.status != "ok":
            print(f"{row.what:{width}s}  {row.status}")
            continue
        cells = []
        for key, _header, fmt in columns:
            value = row.values.get(key)
            cells.append(f"{fmt.format(value) if value is not None else '-':>11s}")
        print(f"{row.what:{width}s}" + "".join(cells))


def device_peak(device: torch.device, dtype: str, override: float | None) -> tuple[float | None, str]:
    """The peak MFU divides by (megappo.metrics.perf, the trainer's own table) and where it came from."""
    from megappo.metrics.perf import device_peak_tflops

    peak = device_peak_tflops(device, dtype, override)
    if override:
        return peak, "--peak-tflops"
    if device.type != "cuda":
        return None, "none (no GPU)"
    if peak is None:
        return None, f"unknown device '{torch.cuda.get_device_name(device)}': pass --peak-tflops"
    return peak, "megappo.metrics.perf.PEAK_TFLOPS"


def run_config(b: Bench, peak_source: str) -> dict[str, Any]:
    import transformers

    try:
        from importlib.metadata import version

        megatron = version("megatron-core")
    except Exception:
        megatron = None
    device = {"type": b.device.type}
    if b.cuda:
        props = torch.cuda.get_device_properties(b.device)
        device.update(name=props.name, memory_gb=props.total_memory / 1e9, cuda=torch.version.cuda,
                      capability=f"{props.major}.{props.minor}")
    else:
        device.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return {"argv": sys.argv[1:], "settings": {k: v for k, v in vars(b.settings).items()},
            "device": device, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "megatron_core": megatron,
            "dtype": b.dtype_name, "peak_tflops": b.peak_tflops, "peak_source": peak_source,
            "backend": b.ps.backend if b.ps is not None else None,
            "sizes": {name: SIZES[name] for name in sorted(set(b.settings.sizes) | {b.settings.gen_size})}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default="mfu,gen,sync,e2e", help=f"comma-separated, of {list(SECTIONS)}")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, fp32, short lengths (CI)")
    p.add_argument("--json", help="write the config and every row here")
    p.add_argument("--e2e-dir", help="e2e: keep the runs (metrics.jsonl, e2e.log) here (default: a temporary directory)")
    p.add_argument("--peak-tflops", type=float, help="the device's dense peak, when not in megappo.metrics.perf.PEAK_TFLOPS")
    p.add_argument("--time-limit", type=float, help="seconds this run may take (e2e runs end in time to report)")
    p.add_argument("--sizes", help=f"mfu and sync sizes, of {list(SIZES)} (default {DEFAULTS['sizes']})")
    p.add_argument("--gen-size", choices=list(SIZES), help=f"gen's size (default {DEFAULTS['gen_size']})")
    p.add_argument("--dtype", choices=list(DTYPES), help="parameters and engine (default bfloat16; fp32 in --smoke)")
    for name, kind, text in (
            ("seq-len", int, "mfu: tokens per sequence"), ("min-seq-len", int, "mfu: halve on OOM down to this"),
            ("prompt-len", int, "mfu: prompt part of a sequence (loss on the rest)"),
            ("micro-batches", int, "mfu: sequences per call"),
            ("pack-tokens", int, "mfu: token budget of the packed micro-batches (0: one padded sequence each)"),
            ("warmup", int, "mfu: untimed calls"), ("steps", int, "mfu: timed calls"),
            ("repeats", int, "sync: timed repetitions"), ("gen-repeats", int, "gen: timed calls per row"), ("matmul-n", int, "mfu baseline matmul size"),
            ("gen-batch", int, "gen: prompts"), ("gen-prompt-len", int, "gen: prompt tokens"),
            ("gen-new-tokens", int, "gen: new tokens"), ("bucket-mb", int, "sync: bridge bucket size"),
            ("e2e-recipes", str, "e2e: recipes of benchmarks/gpu_e2e/"), ("e2e-steps", int, "e2e: steps per run"),
            ("e2e-timeout", int, "e2e: seconds per run"),
            ("head-chunk", int, "mfu: model.lm_head_chunk_tokens of the chunked-head rows (0: no such rows)"),
            ("profile-dir", str, "mfu: profile one call of each update row into this directory ('': none)")):
        key = name.replace("-", "_")
        p.add_argument(f"--{name}", type=kind, help=f"{text} (default {DEFAULTS[key]}; smoke {SMOKE[key]})")
    args = p.parse_args(argv)
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sections = [s for s in args.sections.split(",") if s]
    args.e2e_recipes = [s for s in args.e2e_recipes.split(",") if s]
    missing = [r for r in args.e2e_recipes if not os.path.exists(os.path.join(E2E_DIR, f"{r}.yaml"))]
    if missing:
        p.error(f"--e2e-recipes: no {missing} in {E2E_DIR}")
    args.sizes = [s for s in args.sizes.split(",") if s]
    for given, valid, flag in ((args.sections, SECTIONS, "--sections"), (args.sizes, SIZES, "--sizes")):
        unknown = [x for x in given if x not in valid]
        if unknown or not given:
            p.error(f"{flag}: {f'unknown {unknown}' if unknown else 'none given'}; choose from {list(valid)}")
    if args.prompt_len < 1 or args.min_seq_len < 2:
        p.error("--prompt-len must be >= 1 and --min-seq-len >= 2")
    return args


def main(argv=None) -> int:
    s = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    b = Bench(settings=s, device=device, dtype=DTYPES[s.dtype])
    b.peak_tflops, peak_source = device_peak(device, s.dtype, s.peak_tflops)
    if {"mfu", "sync"} & set(s.sections):
        from megappo.parallel.launch import ensure_ranks
        from megappo.parallel.state import init_parallel

        ensure_ranks(1)
        b.ps = init_parallel(1, 1)  # NCCL + cuda on a GPU; gloo + the CPU compatibility layer otherwise
        b.device = b.ps.device
    results: dict[str, Any] = {"config": run_config(b, peak_source), "sections": {}, "section_seconds": {}}
    print(json.dumps(results["config"], indent=1), flush=True)
    for section in s.sections:
        start = time.perf_counter()
        print(f"\nrunning {section} ...", flush=True)
        rows = SECTIONS[section][0](b)
        elapsed = time.perf_counter() - start
        print_table(section, rows)
        print(f"({section}: {elapsed:.0f} s)", flush=True)
        results["sections"][section] = [dataclasses.asdict(r) for r in rows]
        results["section_seconds"][section] = elapsed
        if s.json:
            with open(s.json, "w") as f:
                json.dump(results, f, indent=1)
    if b.ps is not None:
        from megappo.parallel.state import destroy_parallel

        destroy_parallel()
    failed = [r["what"] for rows in results["sections"].values() for r in rows if r["status"].startswith("error")]
    if failed:
        print(f"\n{len(failed)} row(s) failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
