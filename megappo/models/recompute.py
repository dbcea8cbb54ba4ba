"""Activation recomputation of a trained role, decided in one place: what `actor.recompute` /
`critic.recompute` mean for Megatron-Core and for a model at a layout.

`Recompute` is a frozen record of the settings (granularity none | full | selective, full's method
and layers per checkpoint, selective's modules) with Megatron's defaults filled in. It enters
`build_model` as one argument; `check(dims, pp=, vpp=, cpu=)` refuses what Megatron-Core 0.16.1
cannot do for that model and layout (naming the config key and the fix), and
`transformer_config_kwargs()` gives the TransformerConfig fields.

What each granularity keeps for backward (per transformer layer and micro-batch; the planner,
megappo.plan.planner, turns this into bytes):
  none       every layer's activations.
  full       uniform, n layers per checkpoint: only the input [s, b, h] of every group of n layers
             of a model chunk; the group's activations are rebuilt by one more forward of those n
             layers during backward (so n layers' activations exist at once then).
             block, n: the inputs of the chunk's first n layers; its other layers keep everything.
  selective  everything except the chosen modules' insides, rebuilt during backward:
             core_attn  the attention core (Q K^T scores, softmax, dropout: the [b, a, s, s] terms of
                        unfused attention; fused / per-sequence SDPA attention stores none anyway)
             mlp        a dense MLP's gate/up outputs and SwiGLU output (MoE layers: not affected)
             moe        a MoE layer's expert activations (MoE models)

Checked against Megatron-Core 0.16.1 with the local layer spec on CPU (tests/distributed/
test_recompute.py: gradients of a train step bit-equal with and without it at TP2 and PP2):
full uniform and block, selective core_attn and mlp. Refused (`REFUSED_MODULES` says why):
layernorm (Megatron's CheckpointWithoutOutput needs Transformer Engine), moe_act (grouped-GEMM
experts only), mla_up_proj (no MLA model in megappo), shared_experts (no shared experts). On CPU,
MoE layers cannot be recomputed (full, or selective moe): the token dispatcher, re-run inside
backward, allocates on CUDA.

Forward-only roles (ref, reward) keep no activations for backward, so they take no recompute.

This module does not know about process groups, weights, data or the config file: it is given the
settings and the key they came from.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from megappo.config import RECOMPUTE_MODULES, RECOMPUTE_REFUSED
from megappo.models.hf_config import ModelConfigError, ModelDims

GRANULARITIES = ("none", "full", "selective")
METHODS = ("uniform", "block")
#: selective modules megappo passes to Megatron (recompute_modules), and Megatron's others with why megappo
#: refuses them: the config schema's tables (checked there at load time, here for direct API use)
MODULES, REFUSED_MODULES = RECOMPUTE_MODULES, RECOMPUTE_REFUSED
DEFAULT_MODULES = ("core_attn",)  # Megatron's default for selective


@dataclasses.dataclass(frozen=True)
class Recompute:
    """One trained role's activation recomputation, Megatron's defaults filled in."""

    granularity: str = "none"  # none | full | selective
    method: Optional[str] = None  # full: uniform (groups of num_layers) | block (the first num_layers)
    num_layers: Optional[int] = None  # full: layers per checkpoint (uniform) / per chunk (block)
    modules: tuple[str, ...] = ()  # selective: the modules whose insides are recomputed
    key: str = "recompute"  # the config key these came from, for error messages (e.g. 'actor.recompute')

    def __post_init__(self):
        object.__setattr__(self, "modules", tuple(self.modules))
        k = self.key
        if self.granularity not in GRANULARITIES:
            raise ModelConfigError(f"{k}.granularity={self.granularity!r} is not one of {list(GRANULARITIES)}. "
                                   f"Fix: set {k}.granularity=full (or selective, none).")
        if self.granularity == "full":
            object.__setattr__(self, "method", "uniform" if self.method is None else self.method)
            object.__setattr__(self, "num_layers", 1 if self.num_layers is None else self.num_layers)
            if self.method not in METHODS:
                raise ModelConfigError(f"{k}.method={self.method!r} is not one of {list(METHODS)}. Fix: set "
                                       f"{k}.method=uniform.")
            if self.num_layers < 1:
                raise ModelConfigError(f"{k}.num_layers={self.num_layers} must be >= 1. Fix: set {k}.num_layers=1.")
            if self.modules:
                raise ModelConfigError(f"{k}.modules applies to granularity=selective; full recomputes whole "
                                       f"layers. Fix: remove {k}.modules, or set {k}.granularity=selective.")
        elif self.method is not None or self.num_layers is not None:
            raise ModelConfigError(f"{k}.method / {k}.num_layers apply to granularity=full (now "
                                   f"{self.granularity}). Fix: remove them, or set {k}.granularity=full.")
        if self.granularity == "selective":
            object.__setattr__(self, "modules", self.modules or DEFAULT_MODULES)
            for m in self.modules:
                if m in REFUSED_MODULES:
                    raise ModelConfigError(f"{k}.modules: '{m}' is not supported: {REFUSED_MODULES[m]}. Fix: "
                                           f"choose from {list(MODULES)}, or set {k}.granularity=full.")
                if m not in MODULES:
                    raise ModelConfigError(f"{k}.modules: '{m}' is not a module megappo recomputes. Fix: choose "
                                           f"from {list(MODULES)}.")
        elif self.granularity == "none" and self.modules:
            raise ModelConfigError(f"{k}.modules applies to granularity=selective (now none). Fix: set "
                                   f"{k}.granularity=selective, or remove {k}.modules.")

    @classmethod
    def of(cls, section: Any, key: str) -> Recompute:
        """From a config section with granularity, method, num_layers and modules (megappo.config's
        RecomputeConfig); `key` is its dotted name."""
        return cls(granularity=section.granularity, method=section.method, num_layers=section.num_layers,
                   modules=tuple(section.modules or ()), key=key)

    @property
    def enabled(self) -> bool:
        return self.granularity != "none"

    def check(self, dims: ModelDims, *, pp: int, vpp: Optional[int] = None, cpu: bool = False) -> None:
        """Refuse settings this model and layout cannot use (ModelConfigError naming the fix)."""
        k = self.key
        chunk = dims.num_layers // (pp * (vpp or 1))  # layers of one model chunk (Megatron's per-rank layers)
        if self.granularity == "full" and self.num_layers > chunk:
            raise ModelConfigError(f"{k}.num_layers={self.num_layers} is more than the {chunk} layers of one "
                                   f"pipeline chunk ({dims.num_layers} layers / pp={pp}"
                                   + (f" / vpp={vpp}" if vpp else "") + f"). Fix: set {k}.num_layers <= {chunk}.")
        if self.granularity == "full" and self.method == "uniform" and chunk % self.num_layers:
            raise ModelConfigError(f"{k}.num_layers={self.num_layers} does not divide the {chunk} layers of one "
                                   f"pipeline chunk (method=uniform checkpoints groups of num_layers layers). Fix: "
                                   f"set {k}.num_layers to a divisor of {chunk} (1 keeps the least), or "
                                   f"{k}.method=block.")
        if "moe" in self.modules and not dims.is_moe:
            raise ModelConfigError(f"{k}.modules: 'moe' recomputes mixture-of-experts layers; {dims.arch} is dense. "
                                   f"Fix: use core_attn / mlp.")
        moe_recomputed = self.granularity == "full" or "moe" in self.modules
        if cpu and dims.is_moe and moe_recomputed:
            raise ModelConfigError(f"{k}: recomputing mixture-of-experts layers ({self._describe()}) does not run on "
                                   "CPU: Megatron-Core's token dispatcher, re-run inside backward, allocates on "
                                   f"CUDA. Fix: on CPU set {k}.granularity=selective with modules core_attn / mlp "
                                   f"(or none).")

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """The TransformerConfig fields these settings set (none: Megatron's defaults, nothing)."""
        if self.granularity == "full":
            return dict(recompute_granularity="full", recompute_method=self.method,
                        recompute_num_layers=self.num_layers)
        if self.granularity == "selective":
            return dict(recompute_granularity="selective", recompute_modules=list(self.modules))
        return {}

    # -- what is kept, for the planner (megappo.plan.planner turns these into bytes) --------------------------

    def kept_per_chunk(self, layers: int) -> tuple[int, int]:
        """(layer inputs kept, layers kept whole) for backward, per micro-batch, of a model chunk of
        `layers` layers. Selective and none keep every layer (selective's savings are per layer)."""
        if self.granularity != "full":
            return 0, layers
        if self.method == "uniform":
            return math.ceil(layers / self.num_layers), 0
        n = min(self.num_layers, layers)
        return n, layers - n

    @property
    def rebuilt_at_once(self) -> int:
        """Layers whose full activations exist at once while one checkpoint is recomputed in backward."""
        if self.granularity != "full":
            return 0
        return self.num_layers if self.method == "uniform" else 1

    def _describe(self) -> str:
        if self.granularity == "full":
            return f"granularity=full, method={self.method}, num_layers={self.num_layers}"
        return f"granularity={self.granularity}" + (f", modules={list(self.modules)}" if self.modules else "")


NO_RECOMPUTE = Recompute()
