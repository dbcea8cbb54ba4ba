"""The rollout-engine interface, and fingerprints for verifying weight syncs.

An engine lives in the orchestrator process (global rank 0). It generates from prompt
token ids and receives the actor's weights as HF-named tensors, bucket by bucket, from
the bridge (`megappo.rollout.bridge`). Implementations: `hf` (transformers, CPU default)
and `sglang` (GPU); `megappo.rollout.registry` builds them (this module imports none of them).

An engine that applies LoRA adapters itself (the hf engine) also has `enable_adapters(scale)`:
the bridge calls it once before its first adapter-only sync (`rollout.lora_sync=adapters`), after
which updates may carry `<module>.lora_A.weight` / `<module>.lora_B.weight` and `fingerprints`
resolves those names too. Engines without it take merged weights only.

Fingerprints: `tensor_fingerprint(t)` is an exact integer function of a tensor's bits,
computed on the tensor's own device; the trainer side and the engine side compute it on
the same dtype, so equal weights give equal fingerprints and a changed bit changes them.

This module does not know about Megatron, PPO, configs or the engine implementations.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Iterable, Iterator, Protocol, Sequence

import torch

from megappo.types import RolloutBatch, SamplingParams

Bucket = list[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """The engine's weights do not match what the trainer sent."""


class EngineCrashed(RuntimeError):
    """A process of the rollout engine died; the engine cannot be used any more."""


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """Sample `params.n` responses per prompt (token ids, no padding)."""

    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        """Load full HF-named tensors, bucket by bucket, into the engine's model."""

    def fingerprint_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The fingerprint the engine would report for weight `name` holding `tensor` (trainer side)."""

    def fingerprints(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Fingerprints of the engine's current weights, by HF name."""

    def free_cache(self) -> None:
        """Drop what the engine keeps between generations only to reuse it (the hf engine's KV-cache
        buffers); called after each step's generation, before the trainer's passes. Weights stay.
        A no-op where the memory is a planned static pool (SGLang) or in another process."""

    def release_memory(self) -> None:
        """Free accelerator memory (KV cache, weights) while the trainer runs."""

    def resume_memory(self) -> None:
        """Take it back before the next generation."""

    def shutdown(self) -> None: ...


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_PERIOD = 65521  # the position weights of a fingerprint repeat with this period
_PERIOD_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def tensor_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """[2] int64 on the tensor's device, a function of the tensor's bits only.

    The elements' bit patterns as integers, summed plain and weighted by a position-
    dependent factor, in wrap-around int64 arithmetic: exact and independent of summation
    order (so CPU and GPU agree); any changed bit, or a swapped pair less than 65521
    positions apart, changes it. Equal bit for bit to `tensor_fingerprint_reference`, in
    one pass over the tensor: the weight of position i is (i + 1) % 65521 + 1, so the
    elements are first summed per position within the period ([k, 65521] -> [65521]) and
    weighted once.
    """
    flat = t.detach().contiguous().reshape(-1)
    ints = flat.view(_INT_OF_SIZE[flat.element_size()])
    n = ints.numel()
    full = n - n % _PERIOD
    weights = _PERIOD_WEIGHTS.get(ints.device)
    if weights is None:
        weights = _PERIOD_WEIGHTS[ints.device] = torch.arange(
            1, _PERIOD + 1, dtype=torch.int64, device=ints.device) % _PERIOD + 1
    columns = ints[:full].view(-1, _PERIOD).sum(0, dtype=torch.int64)  # [65521]
    tail = ints[full:].to(torch.int64)
    return torch.stack([columns.sum() + tail.sum(), (columns * weights).sum() + (tail * weights[:n - full]).sum()])


def tensor_fingerprint_reference(t: torch.Tensor) -> torch.Tensor:
    """The definition `tensor_fingerprint` is tested against (one weight per element)."""
    flat = t.detach().contiguous().reshape(-1)
    ints = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, ints.numel() + 1, dtype=torch.int64, device=ints.device) % _PERIOD + 1
    return torch.stack([ints.sum(), (ints * weights).sum()])


def compare_fingerprints(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names whose fingerprints differ (or are missing on the engine side)."""
    bad = []
    for name, fp in expected.items():
        other = got.get(name)
        if other is None or not torch.equal(fp.cpu(), other.cpu()):
            bad.append(name)
    return bad


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> ([B, P] ids, [B, P] mask), left-padded."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def iter_buckets(tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group (name, tensor) pairs into buckets of at most `bucket_bytes` (a tensor larger
    than the bound travels alone)."""
    bucket: Bucket = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def on_daemon_thread(fn, *args, name: str = "megappo-engine-call") -> concurrent.futures.Future:
    """fn(*args) on a daemon thread of its own; its result (or exception) in the returned Future. Not a
    pool: a rank's exit joins every non-daemon thread (megappo.parallel.launch.exit_rank), and an idle
    pool's workers end only once the pool is shut down or collected, which never happens while a kept frame
    holds it (SGLang, first imported during the run's set-up, keeps one, and with it every caller's frame up
    to megappo.trainer.setup.create_run): a run with such a pool never exited."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - raised again by the caller's result()
            future.set_exception(e)

    threading.Thread(target=work, name=name, daemon=True).start()
    return future
