"""The weight-sync bridge: the actor's Megatron shards -> full HF tensors -> the engine.

`WeightBridge(model, engine).sync(step)` is a collective over the actor's ranks. Each
pipeline stage gathers its TP shards one tensor at a time, sends it to global rank 0
(`megappo.models.weights.iter_full_params`), where the name map undoes fusions and vocab
padding and the tensors are cast to the engine's dtype and grouped into buckets of at most
`bucket_bytes`; the engine loads each bucket as it arrives. Rank 0 therefore holds one
bucket at a time, never the whole model.

LoRA actors sync one of two ways (`lora_sync`). `merged` (any engine): W + s B A per weight,
the same tensors as a model without adapters. `adapters` (an engine with `enable_adapters`, the hf
engine): the first sync sends the base weights as they are (unmerged) and the adapters in peft's
form (`<module>.lora_A.weight`, `<module>.lora_B.weight`; `iter_adapter_tensors`), every later one
only the adapters and the fully trained `modules_to_save`: r x (in + out) numbers per adapted
projection instead of its in x out. Both are the same collective on every rank.

Verification (every `verify_every` syncs; 0 = never): the trainer side fingerprints each
tensor as it is sent, the engine fingerprints what it holds afterwards, and any difference
raises `WeightSyncError` on every rank (an error, not a warning).

Several rollout replicas (megappo.rollout.replicas; `receivers`: the replicas' leader ranks): every
leader gets the full tensors from its own pipeline's ranks (megappo.models.weights), not through rank
0. Rank 0 streams its copy into its ReplicaSet, led by the sync's id (`SYNC_ID`); another leader hands
a copy in host memory (not a second model on its GPU) to its `ReplicaServer`, which applies it when
rank 0's ReplicaSet asks for that sync and verifies it there. The other ranks only take part in the
gathers.

`logprob_mismatch` measures the engine's rollout log-probs against the trainer's
recomputed ones for the same tokens; the trainer logs it every step.

This module does not know about PPO losses, data or configs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import torch
import torch.distributed as dist

from megappo.models.builders import MegatronModel
from megappo.models.weights import iter_adapter_tensors, iter_hf_tensors
from megappo.rollout.engine import (
    Bucket, RolloutEngine, WeightSyncError, compare_fingerprints, iter_buckets,
)
from megappo.rollout.replicas import SYNC_ID, ReplicaServer


@dataclasses.dataclass
class SyncStats:
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    verified: bool = False

    def metrics(self) -> dict[str, float]:
        return {"timing_s/weight_sync": self.seconds, "perf/weight_sync_gb": self.bytes / 1e9,
                "perf/weight_sync_gbps": self.bytes / 1e9 / max(self.seconds, 1e-9)}


#: how a LoRA actor's weights reach the engine (module docstring)
LORA_SYNCS = ("merged", "adapters")


class WeightBridge:
    """Streams the actor's weights into the rollout engine(s): rank 0's, and every replica's whose leader
    is in `receivers` (with `replica`, this rank's ReplicaServer, on those leaders)."""

    def __init__(self, model: MegatronModel, engine: RolloutEngine | None, *, bucket_bytes: int = 512 << 20,
                 verify_every: int = 1, engine_dtype: torch.dtype | None = None, lora_sync: str = "merged",
                 receivers: tuple[int, ...] = (0,), replica: ReplicaServer | None = None):
        if model.ps.rank == 0 and engine is None:
            raise ValueError("global rank 0 owns the rollout engine; pass it to the bridge there")
        assert lora_sync in LORA_SYNCS, lora_sync
        assert lora_sync == "merged" or model.lora.enabled, "adapter-only sync of a model without adapters"
        assert receivers[0] == 0 and (replica is not None) == (model.ps.rank in receivers[1:]), (receivers, replica)
        self.model, self.engine = model, engine
        self.receivers, self.replica = tuple(receivers), replica
        self.bucket_bytes, self.verify_every = bucket_bytes, verify_every
        self.engine_dtype = engine_dtype
        self.adapters_only = lora_sync == "adapters"
        self.syncs = 0

    def _hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: this sync's (HF name, tensor) pairs on rank 0 (every rank must drain it)."""
        if not self.adapters_only:
            yield from iter_hf_tensors(self.model, self.receivers)
            return
        if self.syncs == 1:  # the engine's base becomes exactly the trainer's
            yield from iter_hf_tensors(self.model, self.receivers, merged=False)
        else:
            saved = self.model.lora.trained_prefixes(self.model.dims.tie_word_embeddings)
            if saved:
                yield from iter_hf_tensors(self.model, self.receivers, only=saved)
        for module, which, tensor in iter_adapter_tensors(self.model, self.receivers):
            yield f"{module}.{which}.weight", tensor

    def _stream(self, stats: SyncStats, fingerprints: dict[str, torch.Tensor] | None) -> Iterator[Bucket]:
        def tensors():
            for name, tensor in self._hf_tensors():
                if self.engine_dtype is not None:
                    tensor = tensor.to(self.engine_dtype)
                if fingerprints is not None:
                    fingerprints[name] = self.engine.fingerprint_of(name, tensor)
                stats.tensors += 1
                stats.bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        if len(self.receivers) > 1:  # which sync this is, for the other replicas (megappo.rollout.replicas)
            yield [(SYNC_ID, torch.tensor(self.syncs))]
        for bucket in iter_buckets(tensors(), self.bucket_bytes):
            stats.buckets += 1
            yield bucket

    @torch.no_grad()
    def sync(self) -> SyncStats:
        """Collective: push the current actor weights into the engine (and verify)."""
        ps = self.model.ps
        self.syncs += 1
        verify = self.verify_every > 0 and (self.syncs - 1) % self.verify_every == 0
        stats = SyncStats(verified=verify)
        start = time.perf_counter()
        expected: dict[str, torch.Tensor] | None = {} if verify else None
        if ps.rank == 0:
            if self.adapters_only and self.syncs == 1:
                self.engine.enable_adapters(self.model.lora.scale)
            self.engine.update_weights(self._stream(stats, expected))
        elif self.replica is not None:  # host copies: the replica applies them when rank 0 says so
            self.replica.stage(self.syncs, [(name, tensor.to("cpu", self.engine_dtype or tensor.dtype, copy=True))
                                            for name, tensor in self._hf_tensors()], verify)
        else:
            for _ in self._hf_tensors():
                pass
        bad: list[str] = []
        if verify and ps.rank == 0:
            bad = compare_fingerprints(expected, self.engine.fingerprints(expected.keys()))
        if verify:
            box = [bad]
            dist.broadcast_object_list(box, src=0)
            bad = box[0]
            if bad:
                raise WeightSyncError(
                    f"weight sync verification failed for {len(bad)} tensor(s), e.g. {bad[:3]}: the engine "
                    "holds different weights than the trainer sent (corrupted transfer or a name-map bug). Fix: report "
                    "it with these tensor names; rollout.verify_every=0 turns the check off, at the risk of "
                    "sampling from weights other than the ones being trained."
                )
        stats.seconds = time.perf_counter() - start
        return stats


def logprob_mismatch(rollout_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """[N, R] log-probs of the same sampled tokens from the engine and the trainer.

    Returns mean/max absolute difference and two estimates of KL(rollout || trainer) over
    the masked tokens (k1: mean of the log-ratio; k3: mean of r - 1 - log r, r = p_train/p_rollout).
    """
    m = mask.bool()
    if not m.any():
        return {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0,
                "rollout/kl_k1": 0.0, "rollout/kl_k3": 0.0}
    diff = (rollout_lp.float() - trainer_lp.float())[m]
    log_ratio = -diff  # log p_train - log p_rollout
    return {
        "rollout/logprob_diff_mean": diff.abs().mean().item(),
        "rollout/logprob_diff_max": diff.abs().max().item(),
        "rollout/kl_k1": diff.mean().item(),
        "rollout/kl_k3": (log_ratio.exp() - 1 - log_ratio).mean().item(),
    }
