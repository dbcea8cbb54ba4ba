"""The `sglang` rollout engine (GPU): SGLang's offline Engine in the orchestrator process.

sglang is imported lazily, so CPU installs never need it. Generation asks SGLang for the
log-probs of the sampled tokens (`return_logprob=True`). SGLang returns them under the
temperature-scaled distribution ("tempered", megappo's default and what the trainer
recomputes) unless the server starts with SGLANG_RETURN_ORIGINAL_LOGPROB=1 ("untempered");
the engine sets that variable from `logprob_mode` before SGLang starts and records the
mode in every RolloutBatch, so both conventions are handled explicitly.

Weight updates (`sync_mode`):
  tensor: colocated; each bucket goes through `update_weights_from_tensor`, the KV cache is
          flushed once at the end. SGLang >= 0.5.23 requires `begin_weight_update()` /
          `end_weight_update()` around tensor and distributed updates; they are called
          when the installed SGLang has them.
  disk:   fallback; the buckets are written as an HF directory and loaded with
          `update_weights_from_disk`.
  (distributed, over an NCCL group to engines on other GPUs, is not implemented yet.)
Verification reads weights back with `get_weights_by_name` (which returns the first
`truncate` elements), so fingerprints on both sides cover that prefix.

This module does not know about Megatron or PPO.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Iterable, Sequence

import torch

from megappo.rollout.engine import Bucket, WeightSyncError, tensor_fingerprint
from megappo.types import RolloutBatch, SamplingParams

FINGERPRINT_PREFIX = 100  # SGLang's get_weights_by_name truncate_size default


def _import_sglang():
    try:
        import sglang
    except ImportError as e:
        raise ImportError(
            "rollout.engine=sglang needs SGLang on a GPU machine: pip install -e '.[gpu]'. "
            "On CPU use rollout.engine=hf."
        ) from e
    return sglang


class SGLangEngine:
    def __init__(self, model_path: str, *, pad_token_id: int, tp_size: int = 1, mem_fraction_static: float = 0.5,
                 dtype: str = "bfloat16", sync_mode: str = "tensor", logprob_mode: str = "tempered",
                 engine_args: dict[str, Any] | None = None):
        if sync_mode not in ("tensor", "disk"):
            raise NotImplementedError(
                f"rollout.sync_mode={sync_mode} is not implemented for sglang yet; use 'tensor' (colocated) or 'disk'."
            )
        if logprob_mode == "untempered":
            os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        else:
            os.environ.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        sgl = _import_sglang()
        self.pad_token_id, self.sync_mode, self.logprob_mode = pad_token_id, sync_mode, logprob_mode
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
        args = dict(model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                    dtype=dtype, skip_tokenizer_init=True)
        args.update(engine_args or {})
        self.engine = sgl.Engine(**args)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        from megappo.rollout.engine import left_pad

        flat = [list(p) for p in prompts for _ in range(params.n)]
        sampling = []
        for i in range(len(flat)):
            sp = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                  "max_new_tokens": params.max_new_tokens,
                  "stop_token_ids": sorted(set(params.stop_token_ids) | set(params.eos_token_ids)) or None}
            if params.seed is not None:
                sp["sampling_seed"] = params.seed + i
            sampling.append(sp)
        outputs = self.engine.generate(input_ids=flat, sampling_params=sampling, return_logprob=True)
        width = max(len(o["output_ids"]) for o in outputs)
        n = len(flat)
        response = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        logps = torch.zeros((n, width), dtype=torch.float32)
        reasons = []
        for i, out in enumerate(outputs):
            ids = out["output_ids"]
            lps = [lp for lp, _tok, _ in out["meta_info"]["output_token_logprobs"]]
            response[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
            logps[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
            reason = out["meta_info"].get("finish_reason") or {}
            reasons.append("length" if reason.get("type") == "length" else "stop")
        prompt_ids, prompt_mask = left_pad(flat, self.pad_token_id)
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response,
                            response_mask=mask, rollout_log_probs=logps, finish_reasons=reasons,
                            prompt_index=torch.arange(len(prompts)).repeat_interleave(params.n),
                            logprob_mode="untempered" if params.greedy else self.logprob_mode)

    def _call(self, method: str, *args, **kwargs):
        result = getattr(self.engine, method)(*args, **kwargs)
        if isinstance(result, tuple) and len(result) >= 2 and result[0] is False:
            raise WeightSyncError(f"sglang {method} failed: {result[1]}")
        return result

    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        if self.sync_mode == "disk":
            self._update_from_disk(buckets)
            return
        staged = hasattr(self.engine, "begin_weight_update")
        if staged:
            self._call("begin_weight_update")
        try:
            for bucket in buckets:
                self._call("update_weights_from_tensor", named_tensors=[(n, t.to(self.dtype)) for n, t in bucket],
                           flush_cache=False)
        finally:
            if staged:
                self._call("end_weight_update")
        self.engine.flush_cache()

    def _update_from_disk(self, buckets: Iterable[Bucket]) -> None:
        from megappo.models.hf_reference import ShardedSafetensorsWriter

        with tempfile.TemporaryDirectory(prefix="megappo-sync-") as tmp:
            writer = ShardedSafetensorsWriter(tmp)
            for bucket in buckets:
                for name, tensor in bucket:
                    writer.add(name, tensor.to(self.dtype))
            writer.close()
            self._call("update_weights_from_disk", model_path=tmp)

    def fingerprint_of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor_fingerprint(tensor.to(self.dtype).reshape(-1)[:FINGERPRINT_PREFIX])

    def fingerprints(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            try:
                values = self.engine.get_weights_by_name(name, truncate_size=FINGERPRINT_PREFIX)
            except Exception as e:  # SGLang cannot read back every architecture's weights
                raise WeightSyncError(
                    f"sglang cannot read back '{name}' for verification ({e}); set rollout.verify_every=0 "
                    "to sync without verification for this model."
                ) from e
            out[name] = tensor_fingerprint(torch.as_tensor(values, dtype=self.dtype).reshape(-1))
        return out

    def release_memory(self) -> None:
        self.engine.release_memory_occupation()

    def resume_memory(self) -> None:
        self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        self.engine.shutdown()
