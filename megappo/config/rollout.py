"""Generation: `rollout` (the engine and where it runs, sampling, validation sampling, weight sync,
multi-turn episodes, replicas, and when a step's batch is generated: rollout.mode).

Cross-section rules beside this section: `check_rollout_mode` (stale samples need recomputed old
log-probs) and `check_lora_sync` (adapter-only sync needs adapters). They read the root `Config`
(megappo.config.root, which imports this module).

Owns: this section, its defaults and checks. Does not know the engines (megappo.rollout) or the
environments (megappo.envs): `env` is a name here, resolved at start-up.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from megappo.config.schema import _at_least, _default, _require, _Section
from megappo.errors import P


@dataclasses.dataclass(frozen=True)
class PartialRolloutConfig(_Section):
    """Partial rollouts (verl's async_training.partial_rollout, slime's --partial-rollout): docs/partial-rollouts.md."""

    enable: bool = False
    """Generate more groups than a step trains on, stop once `data.train_batch_size` groups are complete, and keep
    the unfinished samples (tokens, engine log-probs, each token's policy version) to resume in a later step under
    the weights of then ([partial-rollouts.md](partial-rollouts.md)); multi-turn episodes keep their environments."""
    over_sample: float = 2.0
    """Groups in generation per step, as a multiple of `data.train_batch_size` (unfinished ones carried over count;
    slime's `--over-sampling-batch-size` over the batch size); >= 1."""
    chunk_tokens: Optional[int] = None
    """Tokens each sample generates between two checks for complete groups (one engine call each); must divide
    `rollout.max_new_tokens`. `null`: a quarter of it (or all of it when it is not divisible by 4)."""
    max_token_staleness: int = 2
    """A sample whose oldest token is more policy versions behind the trainer than this (AReaL's eta) is handled by
    `on_stale` before it generates again."""
    on_stale: Literal["restart", "drop"] = "restart"
    """A stale sample: `restart` generates it again from its prompt; `drop` drops its whole group."""

    def check(self) -> None:
        _at_least(self, max_token_staleness=0)
        _require(self.over_sample >= 1, f"{P}over_sample={self.over_sample} must be >= 1 (groups in generation per "
                 "step over data.train_batch_size). Fix: set it to 1.5 or 2.")
        _require(self.chunk_tokens is None or self.chunk_tokens >= 1,
                 f"{P}chunk_tokens={self.chunk_tokens} must be >= 1. Fix: set it to null (a quarter of "
                 "rollout.max_new_tokens).")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(_Section):
    engine: Literal["hf", "sglang"] = "hf"
    """`hf` (transformers; the CPU default) or `sglang` (GPU; CPU too, [engines.md](engines.md))."""
    hf_decode: Literal["auto", "dynamic", "static", "graphs"] = "auto"
    """The `hf` engine's decode loop ([engines.md](engines.md#the-hf-engines-decode-paths)): `dynamic` (shapes
    shrink as rows finish), `static` (fixed-shape batch-size buckets, same tokens), `graphs` (`static` captured as
    CUDA graphs; CUDA only); `auto`: `graphs` on CUDA for dense Llama / Qwen2 / Qwen3, else `dynamic`. The start-up
    prints the choice."""
    hf_eos_check_every: int = 8
    """`static`/`graphs`: decode steps between checks for finished samples; results do not depend on it."""
    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1: off."""
    max_new_tokens: int = 512
    """Response length limit."""
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Token ids that end a response besides the tokenizer's EOS."""
    seed: int = 0
    """Sampling seed; step k uses `seed + k`."""
    logprob_mode: Literal["untempered", "tempered"] = "tempered"
    """Rollout log-probs of `logits / temperature` (`tempered`) or of the raw logits (`untempered`)."""
    update_bucket_mb: int = 512
    """Weight-sync bucket size in MiB."""
    verify_every: int = 1
    """Fingerprint-verify the engine's weights every k-th sync; 0: never."""
    sync_mode: Literal["tensor", "distributed", "disk"] = "tensor"
    """How weights reach the engine: `tensor` (in-process tensors), `distributed` (NCCL group), `disk`; the last two
    need `engine=sglang`."""
    lora_sync: Literal["merged", "adapters"] = "merged"
    """With `actor.lora`: `merged` sends W + s B A (any engine); `adapters` the base once, then only the adapters
    and `modules_to_save` (hf engine, colocated; [lora.md](lora.md))."""
    sglang: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Passed through to `sglang.Engine` (e.g. `mem_fraction_static`, `chunked_prefill_size`,
    `max_total_tokens`)."""
    val_temperature: float = 0.0
    """Validation sampling temperature."""
    val_n: int = 1
    """Validation samples per prompt."""
    val_top_p: Optional[float] = None
    """Validation's nucleus sampling (with `val_temperature` > 0); `null`: `top_p` (verl's `val_kwargs.top_p`; DAPO
    evaluates at top_p 0.7)."""
    val_top_k: Optional[int] = None
    """Validation's top-k sampling (with `val_temperature` > 0); `null`: `top_k` (verl's `val_kwargs.top_k`)."""
    env: str = "single_turn"
    """The environment ([environments.md](environments.md)): `single_turn`, `tools`, `lookup`, or `pkg.module:Class`
    / `path/to/file.py:Class`."""
    env_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the environment class (checked at start-up)."""
    max_turns: int = 8
    """Multi-turn: actions per episode at most (`max_new_tokens` stays the episode's whole token budget)."""
    max_turn_tokens: Optional[int] = None
    """Multi-turn: tokens per action; `null`: `max_new_tokens` (which stays the episode's whole budget)."""
    bad_observation_policy: Literal["error", "warn"] = "error"
    """Multi-turn, an observation with characters the tokenizer lacks: `error` stops with the fix; `warn` warns once
    and counts `env/unknown_char_observations`."""
    placement: Literal["colocated", "separate"] = "colocated"
    """`separate`: the `hf` engine runs in a child process of rank 0 ([async.md](async.md))."""
    engine_cores: list[int] = dataclasses.field(default_factory=list)
    """`placement=separate`: pin the engine's process to these CPU cores."""
    replicas: int = 1
    """Rollout engines across the job's ranks (replica i on global rank i x world / replicas, its node's GPU; an
    SGLang replica spans `sglang.tp_size` GPUs from there, so replicas x tp_size <= the GPUs, each replica within
    one node: `megappo plan` checks it and counts each engine on its GPUs,
    [gpu.md](gpu.md#how-generation-scales-with-gpus)); rank 0 splits every generation's prompts, whole groups, over
    them and gathers the batch in order: the same tokens as one engine, generated on every replica
    ([engines.md](engines.md#replicas)). `1`: rank 0's engine only. With `sync_mode=distributed` each SGLang replica
    runs on `sglang.tp_size` GPUs of its own after the trainer's on its leader's node instead; not with
    `sync_mode=disk`."""
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """`one_step_off` (step k+1 generates while step k trains) or `async` (up to `max_staleness` steps ahead); both
    need `actor.old_logprob` `is_correct` or `recompute` ([async.md](async.md))."""
    max_staleness: Optional[int] = None
    """`mode=async` only: policy versions behind at most; `null`: 2."""
    partial: PartialRolloutConfig = _default(PartialRolloutConfig)
    """Partial rollouts: long generations stopped when the batch is full and resumed later."""

    @property
    def partial_chunk_tokens(self) -> int:
        """Tokens per sample between checks for complete groups (rollout.partial.chunk_tokens)."""
        if self.partial.chunk_tokens is not None:
            return self.partial.chunk_tokens
        return self.max_new_tokens // 4 if self.max_new_tokens % 4 == 0 else self.max_new_tokens

    @property
    def staleness_limit(self) -> int:
        """Policy versions a training sample lags the trainer at most (rollout.mode)."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness or 2)

    def check(self) -> None:
        _at_least(self, n=1, max_new_tokens=1, update_bucket_mb=1, verify_every=0, val_n=1, max_turns=1,
                  hf_eos_check_every=1, replicas=1)
        _require(self.replicas == 1 or self.sync_mode != "disk",
                 f"{P}replicas={self.replicas} with {P}sync_mode=disk: the disk fallback is for one engine. Fix: set "
                 f"{P}sync_mode=tensor (replicas on the trainer's GPUs) or distributed (replicas on GPUs of their "
                 f"own), or {P}replicas=1.")
        _require(self.max_turn_tokens is None or self.max_turn_tokens >= 1,
                 f"{P}max_turn_tokens={self.max_turn_tokens} must be >= 1. Fix: set it to null (max_new_tokens) "
                 "or to the longest action you expect.")
        _require(bool(self.env.strip()), f"{P}env is empty. Fix: set {P}env=single_turn or {P}env=pkg.module:Class.")
        _require(self.placement == "colocated" or self.engine == "hf",
                 f"{P}placement={self.placement} needs {P}engine=hf (sglang already runs in its own processes). "
                 f"Fix: set {P}placement=colocated.")
        _require(self.hf_decode in ("auto", "dynamic") or (self.engine == "hf" and self.placement == "colocated"),
                 f"{P}hf_decode={self.hf_decode} applies to the hf engine in the trainer's process (engine=hf, "
                 f"placement=colocated); here engine={self.engine}, placement={self.placement}. Fix: set {P}hf_decode=auto.")
        _require(not self.engine_cores or self.placement == "separate",
                 f"{P}engine_cores={self.engine_cores} pins the engine's own process, which only "
                 f"{P}placement=separate has. Fix: set {P}placement=separate or {P}engine_cores=[].")
        _require(self.max_staleness is None or self.mode == "async",
                 f"{P}max_staleness={self.max_staleness} applies to {P}mode=async only ({self.mode}: staleness "
                 f"{self.staleness_limit}). Fix: set {P}mode=async, or remove {P}max_staleness.")
        _at_least(self, max_staleness=1)
        _require(self.temperature >= 0 and self.val_temperature >= 0,
                 f"{P}temperature / {P}val_temperature must be >= 0. Fix: use 0 for greedy decoding.")
        for key in ("top_p", "val_top_p"):
            value = getattr(self, key)
            _require(value is None or 0 < value <= 1, f"{P}{key}={value} must be in (0, 1]. Fix: use 1.0 to disable.")
        for key in ("top_k", "val_top_k"):
            value = getattr(self, key)
            _require(value is None or value == -1 or value >= 1, f"{P}{key}={value} must be -1 (off) or >= 1.")
        _require(self.engine == "sglang" or self.sync_mode == "tensor",
                 f"{P}sync_mode={self.sync_mode} needs {P}engine=sglang. Fix: set {P}sync_mode=tensor.")
        _require(self.lora_sync == "merged" or self.engine == "hf",
                 f"{P}lora_sync=adapters needs {P}engine=hf: loading LoRA adapters into SGLang is not wired in "
                 f"megappo. Fix: set {P}lora_sync=merged (every engine takes the merged weights).")
        _require(self.lora_sync == "merged" or self.placement == "colocated",
                 f"{P}lora_sync=adapters needs {P}placement=colocated: the separate engine process does not take "
                 f"adapters. Fix: set {P}lora_sync=merged or {P}placement=colocated.")


# -- rules across sections ----------------------------------------------------------------------

def check_rollout_mode(cfg: "Config") -> None:
    """Samples generated ahead of the trainer need the old log-probs recomputed."""
    _require(cfg.rollout.mode == "sync" or cfg.actor.old_logprob in ("recompute", "is_correct"),
             f"rollout.mode={cfg.rollout.mode} trains on samples of the previous policy version, but "
             f"actor.old_logprob={cfg.actor.old_logprob} would take the stale engine's log-probs as the "
             "old policy's. Fix: set actor.old_logprob=is_correct (recommended: recomputes them and weights "
             "each token by the truncated importance ratio) or actor.old_logprob=recompute.")


def check_partial_rollouts(cfg: "Config") -> None:
    """Partial rollouts: chunks that end at the response budget."""
    part, r = cfg.rollout.partial, cfg.rollout
    if not part.enable:
        return
    _require(r.max_new_tokens % r.partial_chunk_tokens == 0,
             f"rollout.partial.chunk_tokens={r.partial_chunk_tokens} does not divide rollout.max_new_tokens="
             f"{r.max_new_tokens}: a resumed sample must stop at a chunk's end. Fix: set rollout.partial.chunk_tokens "
             f"to a divisor of {r.max_new_tokens}, or null.")


def check_lora_sync(cfg: "Config") -> None:
    """Adapter-only weight sync needs the actor's adapters."""
    _require(cfg.rollout.lora_sync == "merged" or cfg.actor.lora.enabled,
             "rollout.lora_sync=adapters syncs the actor's LoRA adapters, but actor.lora is off (rank 0). Fix: "
             "set actor.lora.rank (e.g. 8) or rollout.lora_sync=merged.")
