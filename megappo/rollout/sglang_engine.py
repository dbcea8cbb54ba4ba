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
  distributed: the engine runs on GPUs of its own (`base_gpu_id`, default: the node's
          local world size, i.e. the GPUs after the trainer's); the first update opens a
          process group of rank 0 (this process, the sender) and the engine's TP workers
          (`init_weights_update_group`, NCCL by default; `megappo/rollout/update_group.py`),
          then each bucket is broadcast as one flat buffer while the engine's
          `update_weights_from_distributed(load_format="flattened_bucket")` receives it
          (tensor by tensor on an SGLang without `load_format`). Also inside
          begin/end_weight_update.
  disk:   fallback; the buckets are written as an HF directory and loaded with
          `update_weights_from_disk`.
Verification reads weights back with `get_weights_by_name` (which returns the first
`truncate` elements), so fingerprints on both sides cover that prefix.

This module does not know about Megatron or PPO.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import os
import tempfile
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from megappo.rollout.engine import Bucket, WeightSyncError, tensor_fingerprint
from megappo.rollout.update_group import (
    dtype_name, flatten_bucket, free_port, open_update_group, outside_torchrun_store,
)
from megappo.types import RolloutBatch, SamplingParams

FINGERPRINT_PREFIX = 100  # SGLang's get_weights_by_name truncate_size default
UPDATE_GROUP = "megappo_weight_update"


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
    """`engine`: an already started `sglang.Engine` (or an object with its methods) instead of starting one.
    `update_backend` / `update_address`: the weight-update group's backend and the address its
    store listens on (sync_mode=distributed; the engine's workers run on this node)."""

    def __init__(self, model_path: str | None, *, pad_token_id: int, tp_size: int = 1,
                 mem_fraction_static: float = 0.5, dtype: str = "bfloat16", sync_mode: str = "tensor",
                 logprob_mode: str = "tempered", engine_args: dict[str, Any] | None = None, engine: Any = None,
                 update_backend: str = "nccl", update_address: str = "127.0.0.1"):
        if sync_mode not in ("tensor", "distributed", "disk"):
            raise ValueError(f"rollout.sync_mode={sync_mode}: choose tensor, distributed or disk")
        engine_args = dict(engine_args or {})
        if sync_mode == "distributed" and (engine_args.get("dp_size", 1) != 1 or engine_args.get("pp_size", 1) != 1):
            raise ValueError("rollout.sync_mode=distributed sends weights to one engine replica over its TP workers. "
                             "Fix: leave rollout.sglang.dp_size and pp_size at 1, or use sync_mode=tensor.")
        self.pad_token_id, self.sync_mode, self.logprob_mode = pad_token_id, sync_mode, logprob_mode
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
        self.tp_size = engine_args.get("tp_size", tp_size)
        self.update_backend, self.update_address = update_backend, update_address
        self._group: dist.ProcessGroup | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._flat = True  # flattened buckets, when the engine's update_weights_from_distributed takes load_format
        if engine is not None:
            self.engine = engine
            return
        if logprob_mode == "untempered":
            os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        else:
            os.environ.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        args = dict(model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                    dtype=dtype, skip_tokenizer_init=True)
        if sync_mode == "distributed":
            # the trainer's ranks on this node hold GPUs [0, local world size); the engine takes the next ones
            args["base_gpu_id"] = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        args.update(engine_args)
        first, gpus = args.get("base_gpu_id", 0), torch.cuda.device_count()
        if sync_mode == "distributed" and first + self.tp_size > gpus:
            raise ValueError(
                f"rollout.sync_mode=distributed puts SGLang on GPUs {first}..{first + self.tp_size - 1}, after the "
                f"trainer's, but this node has {gpus} GPU(s). Fix: start fewer trainer ranks per node (torchrun "
                f"--nproc-per-node), lower rollout.sglang.tp_size, or use rollout.sync_mode=tensor (colocated).")
        sgl = _import_sglang()
        with outside_torchrun_store():
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
        if self.sync_mode == "distributed" and self._group is None:
            self._open_update_group()
        staged = hasattr(self.engine, "begin_weight_update")
        if staged:
            self._call("begin_weight_update")
        try:
            for bucket in buckets:
                if self.sync_mode == "distributed":
                    self._broadcast_bucket(bucket)
                else:
                    self._call("update_weights_from_tensor", named_tensors=[(n, t.to(self.dtype)) for n, t in bucket],
                               flush_cache=False)
        finally:
            if staged:
                self._call("end_weight_update")
        self.engine.flush_cache()

    def _while_engine_calls(self, method: str, send, **kwargs):
        """Call the engine's blocking receive method while a thread sends this side's half;
        returns what `send` returns.

        The engine call stays on this thread (sglang.Engine drives its asyncio loop from the
        thread that created it); the broadcast runs on the helper thread."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="megappo-sync")
        sending = self._pool.submit(send)
        self._call(method, **kwargs)
        try:
            return sending.result()
        except Exception as e:
            raise WeightSyncError(f"sending weights to the sglang engine failed in {method}: {e}") from e

    def _open_update_group(self) -> None:
        port, world_size = free_port(), 1 + self.tp_size
        self._group = self._while_engine_calls(
            "init_weights_update_group",
            lambda: open_update_group(master_address=self.update_address, master_port=port, world_size=world_size,
                                      rank=0, group_name=UPDATE_GROUP, backend=self.update_backend),
            master_address=self.update_address, master_port=port, rank_offset=1, world_size=world_size,
            group_name=UPDATE_GROUP, backend=self.update_backend)
        self._flat = "load_format" in inspect.signature(self.engine.update_weights_from_distributed).parameters

    def _broadcast_bucket(self, bucket: Bucket) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if self.update_backend == "nccl" else "cpu"
        if self._flat:
            flat, meta = flatten_bucket(bucket, self.dtype, device)
            self._while_engine_calls(
                "update_weights_from_distributed", lambda: dist.broadcast(flat, group_src=0, group=self._group),
                **meta, group_name=UPDATE_GROUP, flush_cache=False, load_format="flattened_bucket")
            return
        tensors = [t.to(device=device, dtype=self.dtype).contiguous() for _, t in bucket]

        def send():
            for t in tensors:
                dist.broadcast(t, group_src=0, group=self._group)

        self._while_engine_calls("update_weights_from_distributed", send, names=[n for n, _ in bucket],
                                 dtypes=[dtype_name(self.dtype)] * len(bucket), shapes=[list(t.shape) for t in tensors],
                                 group_name=UPDATE_GROUP, flush_cache=False)

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
        try:
            if self._group is not None:
                self._call("destroy_weights_update_group", group_name=UPDATE_GROUP)
                dist.destroy_process_group(self._group)
        finally:
            self._group = None
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self.engine.shutdown()
