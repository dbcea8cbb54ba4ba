"""The precision policy: what `model.dtype` means for a Megatron model, decided in one place.

megappo trains in float32 or bfloat16 the way Megatron-Core's own training does:
  - every floating-point parameter of the model is in the model dtype, the RMSNorm weights
    (and Qwen3's q/k norms) and the value head included. This is what Megatron's
    `Float16Module` does to a bf16 model (`module.bfloat16()`); torch's `rms_norm` then runs
    its fused kernel (it falls back to an unfused one, with a warning, when input and weight
    dtypes differ) and computes the normalisation in float32 internally either way;
  - Megatron's mixed-precision optimizer keeps a float32 master copy of every bf16 parameter
    and float32 Adam moments; gradients are accumulated and reduced in float32
    (`grad_reduce_in_fp32`), and the bf16 parameters are rounded copies of the masters after
    each step. A trainer checkpoint holds both (the bf16 weights and the float32 masters), so a
    resumed run continues bit for bit;
  - exported HF weights are the model's parameters in the model dtype (the bf16 weights the
    rollout engine and the trainer computed with), and config.json says that dtype.

float16 is refused for training: Megatron's fp16 path needs dynamic loss scaling wired into
the schedule (`grad_scale_func`) and skipped-step handling that megappo does not do, and bf16
has float32's range, so nothing needs fp16's. float16 is accepted for weights-only use
(conversion, forward passes).

`COMPARE_TOL` states how closely a dtype's log-probs / values agree with a float32 reference
(transformers, another layout, the padded path); the tests use it and docs/precision.md
explains it.

This module does not know about roles, layouts, data or the rollout engine.
"""

from __future__ import annotations

import dataclasses

import torch

from megappo.errors import ModelConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRAINABLE = ("float32", "bfloat16")

FP16_REFUSED = ("model.dtype=float16 cannot train in megappo: Megatron's fp16 path needs dynamic loss scaling "
                "and skipped-step handling that megappo does not wire. Fix: set model.dtype=bfloat16 (float32's "
                "range, what every GPU recipe trains in) or float32.")

# Largest |difference| accepted between a pass in this dtype and the exact values of the same
# weights (float32 compute), per token: log-probs, entropies, values. bf16 keeps 8 bits of
# mantissa (a relative rounding of 2^-9 per operation). Measured on the tiny test models (random
# init, log-probs near -log V): 2.4e-3 to 3.7e-3 for Megatron in bf16 at TP2 and PP2, packed
# and padded, and 3.0e-3 to 3.2e-3 for transformers in bf16 (tests/distributed/test_packing.py).
COMPARE_TOL = {"float32": 1e-5, "bfloat16": 1e-2}
# Logits (conversion `--verify`), relative to the largest |logit| when above 1: a few bf16
# roundings of the largest logit.
LOGIT_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


@dataclasses.dataclass(frozen=True)
class Precision:
    """One model dtype and what follows from it."""

    name: str = "float32"

    def __post_init__(self):
        if self.name not in DTYPES:
            raise ModelConfigError(f"unknown model dtype '{self.name}'; choose one of {sorted(DTYPES)}.")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def trainable(self) -> bool:
        return self.name in TRAINABLE

    def check_trainable(self) -> None:
        if not self.trainable:
            raise ModelConfigError(FP16_REFUSED)

    def transformer_config_kwargs(self) -> dict:
        """The TransformerConfig fields this dtype sets."""
        return dict(params_dtype=self.dtype, pipeline_dtype=self.dtype,
                    bf16=self.name == "bfloat16", fp16=self.name == "float16")

    def optimizer_kwargs(self) -> dict:
        """The OptimizerConfig fields this dtype sets (bf16: float32 master weights and moments)."""
        return dict(bf16=self.name == "bfloat16", fp16=self.name == "float16", params_dtype=self.dtype)

    def cast_(self, module: torch.nn.Module) -> torch.nn.Module:
        """Every floating-point parameter of `module` in this dtype (in place, before DDP wraps
        it: Megatron's grad buffers and optimizer groups follow the parameters' dtypes).
        Buffers are left alone (routing state such as an expert bias stays float32)."""
        for param in module.parameters():
            if param.is_floating_point() and param.dtype != self.dtype:
                param.data = param.data.to(self.dtype)
        return module

    def hf_config(self, hf_config: dict) -> dict:
        """`hf_config` saying this dtype (transformers >= 5 reads `dtype`, older ones `torch_dtype`).
        A config that names no dtype means float32 to transformers, so float32 leaves it as it is."""
        out = dict(hf_config)
        keys = [k for k in ("dtype", "torch_dtype") if k in out]
        if self.name != "float32" and not keys:
            keys = ["dtype"]
        for key in keys:
            out[key] = self.name
        return out


def precision_of(dtype: str | torch.dtype) -> Precision:
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in DTYPES.items()}
        if dtype not in names:
            raise ModelConfigError(f"unsupported model dtype {dtype}; choose one of {sorted(DTYPES)}.")
        dtype = names[dtype]
    return Precision(dtype)
