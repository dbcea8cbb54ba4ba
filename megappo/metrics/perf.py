"""Hardware metrics of a step's stages: peak GPU memory per stage, model FLOP rates and MFU.

- `peak_memory(metrics, stage)` wraps a timed stage (the orchestrator's `timed`). On CUDA it
  resets torch's peak-memory counters when the stage starts and records, when it ends,
  `perf/max_memory_allocated_gb/<stage>` and `perf/max_memory_reserved_gb/<stage>` (GiB, this
  process's device: rank 0's on a multi-GPU run) and the step's maxima over its stages,
  `perf/max_memory_allocated_gb` and `perf/max_memory_reserved_gb` (verl's names). A stage
  nested in another (`reward` inside `adv`) counts in the outer one's peak too. On CPU (or before
  anything used CUDA) it records nothing: host memory is not what these names mean.
- `flop_rate_metrics` turns the model FLOPs of a stage's passes (`megappo.models.flops`) and
  its time into `perf/tflops/<name>` (achieved TFLOP/s per GPU: all ranks' FLOPs / seconds /
  world size; every role lives on every rank) and, where the device's peak is known,
  `perf/mfu/<name>` = that / peak.
- `PEAK_TFLOPS` / `device_peak_tflops`: the dense peak of a known GPU in the model dtype,
  or `hardware.peak_tflops`; None on CPU and on GPUs not in the table.

This module does not know about models, roles, PPO or process groups.
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch

GIB = 1024**3

#: dense peak TFLOP/s (no sparsity) by device name, (bf16/fp16 tensor cores, fp32 without TF32:
#: torch's default matmul precision); the first name contained in the device's name wins, so
#: the specific names come before the family name. Vendor datasheet figures.
PEAK_TFLOPS = (
    ("H100 PCIe", {"bfloat16": 756.0, "float32": 51.0}),
    ("H100 NVL", {"bfloat16": 835.0, "float32": 60.0}),
    ("H200 NVL", {"bfloat16": 835.0, "float32": 60.0}),
    ("H100", {"bfloat16": 989.0, "float32": 67.0}),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    ("H200", {"bfloat16": 989.0, "float32": 67.0}),
    ("A100", {"bfloat16": 312.0, "float32": 19.5}),
)


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The table's peak for a device name and a model dtype ('bfloat16', 'float16', 'float32'); None
    when the name is not in the table."""
    key = "bfloat16" if dtype == "float16" else dtype
    for name, peaks in PEAK_TFLOPS:
        if name in device_name:
            return peaks.get(key)
    return None


def device_peak_tflops(device: torch.device, dtype: str, override: float | None = None) -> float | None:
    """`override` (hardware.peak_tflops) if given, else the table's peak for this CUDA device; None on CPU."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device), dtype)


def flop_rate_metrics(stages: Mapping[str, tuple[float, float]], *, world_size: int,
                      peak: float | None) -> dict[str, float]:
    """{name: (FLOPs of all ranks, seconds)} -> `perf/tflops/<name>` per GPU and `perf/mfu/<name>`
    (with a peak). Stages that did no work or took no time are left out."""
    out = {}
    for name, (flops, seconds) in stages.items():
        if flops <= 0 or seconds <= 0:
            continue
        tflops = flops / seconds / world_size / 1e12
        out[f"perf/tflops/{name}"] = tflops
        if peak:
            out[f"perf/mfu/{name}"] = tflops / peak
    return out


#: (allocated, reserved) peaks of the stages open now, outermost first (the orchestrator's stages
#: run one after another on the main thread; a nested stage's reset must not lose the outer's peak)
_open_stages: list[tuple[int, int]] = []


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _peaks() -> tuple[int, int]:
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _larger(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return max(a[0], b[0]), max(a[1], b[1])


@contextlib.contextmanager
def peak_memory(metrics: dict, stage: str):
    """Peak CUDA memory of the code inside, as `perf/max_memory_*_gb/<stage>` (see the module doc)."""
    if not _cuda_in_use():
        yield
        return
    if _open_stages:  # the enclosing stage's peak so far: the reset below clears torch's counter
        _open_stages[-1] = _larger(_open_stages[-1], _peaks())
    _open_stages.append((0, 0))
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        peak = _larger(_open_stages.pop(), _peaks())
        if _open_stages:
            _open_stages[-1] = _larger(_open_stages[-1], peak)
    for kind, value in zip(("allocated", "reserved"), peak):
        metrics[f"perf/max_memory_{kind}_gb/{stage}"] = value / GIB
        step_key = f"perf/max_memory_{kind}_gb"
        metrics[step_key] = max(metrics.get(step_key, 0.0), value / GIB)
