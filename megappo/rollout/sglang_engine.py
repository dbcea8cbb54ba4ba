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
          local world size, i.e. the GPUs after the trainer's; a node's further replicas
          after the first's); the first update opens a
          process group of rank 0 (this process, the sender) and the engine's TP workers
          (`init_weights_update_group`, NCCL by default; `megappo/rollout/update_group.py`),
          then each bucket is broadcast as one flat buffer while the engine's
          `update_weights_from_distributed(load_format="flattened_bucket")` receives it
          (tensor by tensor on an SGLang without `load_format`). Also inside
          begin/end_weight_update.
  disk:   fallback; the buckets are written as an HF directory and loaded with
          `update_weights_from_disk`.
Verification reads weights back with `get_weights_by_name`, which returns the first
`truncate_size` ROWS of a weight (elements of a 1-D one) as floats, from the engine's first TP
rank (a column-parallel weight's first shard), so the trainer side fingerprints the same row
prefix (`readback_rows`). A model class without `get_weights_by_name` (Qwen2 in SGLang 0.5.23)
answers None: that is a `WeightSyncError` naming `rollout.verify_every=0`.

CPU: without CUDA the engine runs SGLang's CPU platform (`SGLANG_USE_CPU_ENGINE=1`, set here:
torch_native attention, pytorch sampler), the weight-update group uses gloo, and
`base_gpu_id` is not set. What differs from a GPU (docs/engines.md): `release_memory` only
flushes the KV cache (SGLang's memory saver needs CUDA; on GPUs it is on by default for the
colocated `tensor` mode), and `SamplingParams.seed` is not honoured (SGLang seeds a request
only under deterministic inference, which its CPU attention backend refuses): sampling is not
seed-reproducible, and the engine warns once. `SamplingParams.sample_window` (which uniforms a part
of a split call draws) is therefore ignored too.

Threads: any thread may call the engine's methods, one call at a time (rollout.mode=one_step_off
generates in a thread of its own while the main thread syncs weights). Every call into the
`sglang.Engine` is made by one daemon thread of the engine's own (`_EngineThread`), which runs
SGLang's asyncio loop (`Engine.loop.run_until_complete`, SGLang's offline API unchanged); the
caller waits for it, checking for a crash. The loop therefore never runs in the main thread:
uvloop, run in the main thread, takes the process's signal wakeup fd for the length of the call,
so megappo.parallel.interrupts' watcher missed a SIGINT/SIGTERM sent during an engine call (no
acknowledgement, no stop at once on the second one); and the tokenizer manager's handle loop,
started in the main thread, adds loop handlers for SIGTERM (a graceful engine shutdown behind the
trainer's back) and SIGQUIT (kills the process tree). Started in the engine's thread, it adds none.

Crashes: SGLang's subprocess watchdog SIGQUITs this process when a scheduler or detokenizer
dies, and SGLang's own handler then kills the whole process tree, the trainer included. The
engine replaces it (SGLang's `custom_sigquit_handler` while starting, megappo's SIGQUIT handler
once running; SIGINT/SIGTERM and the wakeup fd are given back to megappo.parallel.interrupts after the
start) and watches the engine's processes itself: a death stops the engine's event loop, and
the call in flight (or the next one) raises `EngineCrashed` in the thread that made it, an
error `megappo train` reports in one line.

This module does not know about Megatron or PPO.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import os
import queue
import signal
import tempfile
import threading
import warnings
from typing import Any, Iterable, Sequence

import psutil
import torch
import torch.distributed as dist

from megappo.rollout.engine import (
    Bucket, EngineCrashed, WeightSyncError, left_pad, on_daemon_thread, tensor_fingerprint,
)
from megappo.rollout.routes import UNKNOWN, decode_sglang_routes
from megappo.rollout.update_group import (
    dtype_name, flatten_bucket, free_port, open_update_group, outside_torchrun_store,
)
from megappo.types import RolloutBatch, SamplingParams

FINGERPRINT_PREFIX = 100  # rows; SGLang's get_weights_by_name truncate_size default
UPDATE_GROUP = "megappo_weight_update"
CPU_MAX_TOTAL_TOKENS = 32768  # the KV cache's size on CPU unless rollout.sglang.max_total_tokens is set
CRASH_POLL_S = 0.5  # a caller waiting on the engine thread checks this often for a crash
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")


def sglang_engine_args(model_path: str | None, *, tp_size: int, mem_fraction_static: float, dtype: str,
                       sync_mode: str, user_args: dict[str, Any], cuda: bool, local_world_size: int,
                       replica_slot: int = 0) -> dict[str, Any]:
    """The arguments megappo starts `sglang.Engine` with; `user_args` (rollout.sglang) win.

    `enable_memory_saver`: on GPUs for the colocated `tensor` mode, so that release_memory()
    frees the weights and KV cache during training (SGLang frees nothing without it).
    `base_gpu_id`: for `distributed` on GPUs, the GPUs after the trainer's ranks on this node
    (from rollout.sglang.base_gpu_id when set); the node's `replica_slot`-th engine replica
    (megappo.rollout.replicas) starts `replica_slot` x tp_size GPUs further.
    CPU: `device=cpu` and a KV cache of `CPU_MAX_TOTAL_TOKENS` tokens unless
    rollout.sglang.max_total_tokens says otherwise."""
    args: dict[str, Any] = dict(model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                                dtype=dtype, skip_tokenizer_init=True)
    if cuda and sync_mode == "tensor":
        args["enable_memory_saver"] = True
    if cuda and sync_mode == "distributed":
        args["base_gpu_id"] = local_world_size
    if not cuda:  # mem_fraction_static would size the KV cache from host RAM (GBs for a tiny model)
        args.update(device="cpu", max_total_tokens=CPU_MAX_TOTAL_TOKENS)
    args.update(user_args)
    if cuda and sync_mode == "distributed":
        args["base_gpu_id"] += replica_slot * args["tp_size"]
    if not cuda and args.get("enable_memory_saver"):
        raise ValueError("rollout.sglang.enable_memory_saver needs CUDA (SGLang's memory saver pins GPU memory). "
                         "Fix: drop it on CPU; release_memory() then flushes the KV cache only.")
    return args


def _cpu_environment(tp_size: int) -> None:
    """SGLang's CPU platform: its own switch, and one core per engine TP rank."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    if tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = os.cpu_count() or 1
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp_size))


def _import_sglang():
    try:
        import sglang
    except ImportError as e:
        raise ImportError(
            "rollout.engine=sglang needs SGLang: pip install -e '.[gpu]' on a GPU machine. On CPU, run in the "
            "virtualenv tests/sglang/setup_venv.sh builds (SGLang's CPU platform; docs/engines.md), or use "
            "rollout.engine=hf."
        ) from e
    return sglang


class SGLangEngine:
    """`engine`: an already started `sglang.Engine` (or an object with its methods) instead of starting one.
    `update_backend` / `update_address`: the weight-update group's backend (default nccl with
    CUDA, gloo without) and the address its store listens on (sync_mode=distributed; the
    engine's workers run on this node). `replica_slot`: sync_mode=distributed, the engine is this
    node's replica_slot-th replica (`sglang_engine_args`)."""

    def __init__(self, model_path: str | None, *, pad_token_id: int, tp_size: int = 1,
                 mem_fraction_static: float = 0.5, dtype: str = "bfloat16", sync_mode: str = "tensor",
                 logprob_mode: str = "tempered", engine_args: dict[str, Any] | None = None, engine: Any = None,
                 update_backend: str | None = None, update_address: str = "127.0.0.1", replica_slot: int = 0):
        if sync_mode not in ("tensor", "distributed", "disk"):
            raise ValueError(f"rollout.sync_mode={sync_mode}: choose tensor, distributed or disk")
        engine_args = dict(engine_args or {})
        if sync_mode == "distributed" and (engine_args.get("dp_size", 1) != 1 or engine_args.get("pp_size", 1) != 1):
            raise ValueError("rollout.sync_mode=distributed sends weights to one engine replica over its TP workers. "
                             "Fix: leave rollout.sglang.dp_size and pp_size at 1, or use sync_mode=tensor.")
        self.pad_token_id, self.sync_mode, self.logprob_mode = pad_token_id, sync_mode, logprob_mode
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
        self.tp_size = engine_args.get("tp_size", tp_size)
        cuda = torch.cuda.is_available()
        self.update_backend = update_backend or ("nccl" if cuda else "gloo")
        self.update_address = update_address
        self._group: dist.ProcessGroup | None = None
        self._flat = True  # flattened buckets, when the engine's update_weights_from_distributed takes load_format
        self._crash: str | None = None
        self._starting = False
        self._seed_warned = False
        self._dims = _read_dims(model_path)
        # made once the engine runs: SGLang deep-copies its arguments, this object among them (the crash handler)
        self._thread: _EngineThread | None = None
        if engine is not None:
            self.engine, self._thread, self._stop_watching = engine, _EngineThread(), threading.Event()
            return
        if logprob_mode == "untempered":
            os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        else:
            os.environ.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        args = sglang_engine_args(
            model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static, dtype=dtype, sync_mode=sync_mode,
            user_args=engine_args, cuda=cuda, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            replica_slot=replica_slot)
        if cuda:
            first, gpus = args.get("base_gpu_id", 0), torch.cuda.device_count()
            if sync_mode == "distributed" and first + self.tp_size > gpus:
                raise ValueError(
                    f"rollout.sync_mode=distributed puts SGLang on GPUs {first}..{first + self.tp_size - 1}, after the "
                    f"trainer's{f' and {replica_slot} other engine replica(s) of this node' if replica_slot else ''}, "
                    f"but this node has {gpus} GPU(s). Fix: start fewer trainer ranks per node (torchrun "
                    f"--nproc-per-node), lower rollout.sglang.tp_size or rollout.replicas, or use "
                    f"rollout.sync_mode=tensor (colocated).")
        else:
            _cpu_environment(self.tp_size)
        args.setdefault("custom_sigquit_handler", self._on_death_while_starting)
        sgl = _import_sglang()
        main_thread = threading.current_thread() is threading.main_thread()
        saved = _signal_state() if main_thread else None
        started_before = {p.pid for p in psutil.Process().children()}
        with outside_torchrun_store():
            self._starting = True
            try:
                self.engine = sgl.Engine(**args)
            finally:
                self._starting = False
        self._processes = [p for p in psutil.Process().children() if p.pid not in started_before]
        self._thread = _EngineThread()
        self._stop_watching = threading.Event()
        if main_thread:
            self._take_back_signals(saved)
        self._start_handle_loop()
        threading.Thread(target=self._watch, name="megappo-sglang-watch", daemon=True).start()

    _CRASHED = ("the sglang rollout engine crashed: one of its processes (scheduler or detokenizer) died; its log "
                "above says why. The engine cannot be used any more; rerun to resume from the last checkpoint.")

    def _on_death_while_starting(self, signum, frame) -> None:
        """SIGQUIT from an SGLang process that failed during start-up (SGLang's own handler
        would kill this whole process tree)."""
        self._crash = self._CRASHED
        if self._starting:
            raise EngineCrashed(self._crash)

    def _take_back_signals(self, saved) -> None:
        """SGLang's start-up takes SIGQUIT (its handler kills the whole process tree) and may
        change SIGINT/SIGTERM and the signal wakeup fd: give SIGINT/SIGTERM and the wakeup fd back
        to what they were (megappo.parallel.interrupts), and SIGQUIT to the engine's crash handling."""
        handlers, wakeup_fd = saved
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(wakeup_fd)
        signal.signal(signal.SIGQUIT, lambda signum, frame: self._note_death())

    def _start_handle_loop(self) -> None:
        """Start the tokenizer manager's handle loop inside the engine's event loop, on the engine's
        thread: the manager then adopts that loop, and adds no SIGTERM/SIGQUIT loop handlers
        (`auto_create_handle_loop` adds them only when it runs in the main thread)."""
        manager, loop = getattr(self.engine, "tokenizer_manager", None), getattr(self.engine, "loop", None)
        if manager is None or loop is None:
            return

        async def start_handle_loop():
            manager.auto_create_handle_loop()

        self._on_engine_thread(lambda: loop.run_until_complete(start_handle_loop()))

    def _watch(self) -> None:
        """Poll the engine's processes: one that ends while the engine runs is a crash."""
        while not self._stop_watching.wait(0.5):
            if any(_ended(p) for p in self._processes):
                self._note_death()
                return

    def _note_death(self) -> None:
        """A process of the engine died: the call in flight (its event loop is stopped) or the
        next one raises EngineCrashed. Safe from any thread and from a signal handler."""
        if self._crash or self._stop_watching.is_set():
            return
        self._crash = self._CRASHED
        loop = getattr(self.engine, "loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)

    def _engine_call(self, method: str, *args, **kwargs):
        """Call the sglang.Engine's `method` (on the engine's thread); a crash of its processes
        raises EngineCrashed in the caller, never hangs."""
        return self._on_engine_thread(getattr(self.engine, method), *args, **kwargs)

    def _on_engine_thread(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the engine's thread, waited for from the calling thread."""
        if self._crash:
            raise EngineCrashed(self._crash)
        call = self._thread.submit(fn, *args, **kwargs)
        while not concurrent.futures.wait([call], timeout=CRASH_POLL_S).done:
            if self._crash:  # the call may be stuck outside the loop _note_death stopped: do not wait for it
                raise EngineCrashed(self._crash)
        try:
            return call.result()
        except Exception as e:  # e.g. the event loop _note_death stopped
            if self._crash:
                raise EngineCrashed(self._crash) from e
            raise

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        flat = [list(p) for p in prompts for _ in range(params.n)]
        # sample_window is not passed: it only says which seeded draws a part takes, and SGLang draws its own
        sp = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
              "max_new_tokens": params.max_new_tokens,
              "stop_token_ids": sorted(set(params.stop_token_ids) | set(params.eos_token_ids)) or None}
        sampling = [dict(sp) for _ in flat]
        if params.seed is not None and not params.greedy and not self._seed_warned:
            self._seed_warned = True
            warnings.warn("rollout.engine=sglang does not honour the sampling seed (SGLang seeds a request only "
                          "under deterministic inference, which needs a GPU attention backend): sampled rollouts "
                          "are not reproducible run to run. Use rollout.engine=hf where that matters.", stacklevel=2)
        extra = {"return_routed_experts": True} if params.return_routes else {}
        outputs = self._engine_call("generate", input_ids=flat, sampling_params=sampling, return_logprob=True, **extra)
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
                            logprob_mode="untempered" if params.greedy else self.logprob_mode,
                            routes=self._routes(outputs, flat, width) if params.return_routes else None)

    def _routes(self, outputs: list[dict], flat: list[list[int]], width: int) -> torch.Tensor:
        """[N, P + R, L, k] from each output's `routed_experts` (positions 0 .. len - 2 of prompt +
        output; the last token is never run), the prompt left-aligned as in `left_pad`."""
        layers, top_k = self._dims.get("num_hidden_layers"), self._dims.get("num_experts_per_tok")
        if not layers or not top_k:
            raise ValueError("routing replay needs num_hidden_layers and num_experts_per_tok in the model's "
                             "config.json (an MoE model). Fix: set actor.moe_routing=recompute.")
        longest = max(len(p) for p in flat)
        routes = torch.full((len(flat), longest + width, layers, top_k), UNKNOWN, dtype=torch.int16)
        for i, (out, prompt) in enumerate(zip(outputs, flat)):
            encoded = out["meta_info"].get("routed_experts")
            if encoded is None:
                raise ValueError("SGLang returned no routed experts: the engine was started without "
                                 "enable_return_routed_experts. Fix: set rollout.sglang.enable_return_routed_experts=true "
                                 "(actor.moe_routing=replay sets it) or actor.moe_routing=recompute.")
            ids = decode_sglang_routes(encoded, layers, top_k)
            start = longest - len(prompt)
            routes[i, start:start + ids.shape[0]] = ids
        return routes

    def _call(self, method: str, *args, **kwargs):
        result = self._engine_call(method, *args, **kwargs)
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
        self._engine_call("flush_cache")

    def _while_engine_calls(self, method: str, send, **kwargs):
        """Call the engine's blocking receive method (on the engine's thread) while a daemon
        thread sends this side's half; returns what `send` returns."""
        sending = on_daemon_thread(send, name="megappo-sync")
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

    def readback_rows(self, name: str, rows: int) -> int:
        """How many leading rows of HF weight `name` (with `rows` rows) get_weights_by_name returns:
        at engine TP > 1 a column-parallel weight comes from the first rank's shard only."""
        if self.tp_size > 1 and any(part in name for part in _COLUMN_PARALLEL):
            rows = _first_shard_rows(name, rows, self.tp_size, self._dims)
        return min(FINGERPRINT_PREFIX, rows)

    def fingerprint_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor_fingerprint(tensor.to(self.dtype)[: self.readback_rows(name, tensor.shape[0])])

    def fingerprints(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            try:
                values = self._engine_call("get_weights_by_name", name, truncate_size=FINGERPRINT_PREFIX)
                failure = "its get_weights_by_name returned nothing for this model class" if values is None else None
            except EngineCrashed:
                raise
            except Exception as e:  # an SGLang version or model class that raises instead
                values, failure = None, f"its get_weights_by_name failed: {e}"
            if values is None:  # SGLang logs why; e.g. Qwen2 has no get_weights_by_name in 0.5.23
                raise WeightSyncError(
                    f"sglang cannot read back '{name}' to verify the weight sync ({failure}). Fix: set "
                    "rollout.verify_every=0 to sync without verification for this model; the per-step "
                    "rollout/logprob_diff_max metric still compares engine and trainer.")
            out[name] = tensor_fingerprint(torch.as_tensor(values, dtype=torch.float32).to(self.dtype))
        return out

    def free_cache(self) -> None:  # the KV cache is SGLang's static pool, planned as held (megappo.plan.planner)
        pass

    def release_memory(self) -> None:
        """GPU: frees the weights and KV cache (memory saver). CPU: flushes the KV cache only."""
        self._engine_call("release_memory_occupation")

    def resume_memory(self) -> None:
        self._engine_call("resume_memory_occupation")

    def close_update_group(self) -> None:
        """Destroy the weight-update group (sync_mode=distributed) on both sides, if open."""
        try:
            if self._group is not None:
                self._call("destroy_weights_update_group", group_name=UPDATE_GROUP)
                dist.destroy_process_group(self._group)
        finally:
            self._group = None

    def shutdown(self) -> None:
        """Stop the engine and every process it started, also after a crash."""
        stop = getattr(self, "_stop_watching", None)
        if stop is not None:
            stop.set()  # its processes end now: no crash
        try:
            self.close_update_group()
        finally:
            try:
                self.engine.shutdown()  # kills the engine's processes; no event loop involved
            finally:
                if self._thread is not None:
                    self._thread.stop()


class _EngineThread:
    """The one thread that calls into the sglang.Engine: calls are queued and made one at a time,
    whichever threads submit them. A daemon thread: a call stuck after a crash never holds up
    the interpreter's exit."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        threading.Thread(target=self._serve, name="megappo-sglang-engine", daemon=True).start()

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        if self._stopped:
            raise RuntimeError("the sglang engine was shut down; start a new SGLangEngine to generate again")
        call: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((call, fn, args, kwargs))
        return call

    def stop(self) -> None:
        """End the thread after the calls already queued."""
        self._stopped = True
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, fn, args, kwargs = item
            if not call.set_running_or_notify_cancel():
                continue
            try:
                call.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the caller
                call.set_exception(e)


def _ended(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _signal_state():
    """The SIGINT/SIGTERM/SIGQUIT handlers and the signal wakeup fd, to restore after SGLang starts."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)}
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    return {sig: (h if h is not None else signal.SIG_DFL) for sig, h in handlers.items()}, wakeup_fd


def _read_dims(model_path: str | None) -> dict[str, int]:
    """The HF config numbers that decide the engine's first TP shard's rows."""
    path = os.path.join(model_path or "", "config.json")
    if not model_path or not os.path.exists(path):
        return {}
    with open(path) as f:
        cfg = json.load(f)
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim", "vocab_size",
            "num_hidden_layers", "num_experts_per_tok")
    return {k: cfg[k] for k in keys if isinstance(cfg.get(k), int)}


def _first_shard_rows(name: str, rows: int, tp: int, dims: dict[str, int]) -> int:
    """Rows of column-parallel weight `name` on SGLang's first TP rank (replicated KV heads when
    there are fewer KV heads than ranks; the vocabulary padded to a multiple of 64 and split)."""
    heads = dims.get("num_attention_heads", 1)
    head_dim = dims.get("head_dim") or dims.get("hidden_size", rows) // heads
    if "k_proj" in name or "v_proj" in name:
        return max(1, dims.get("num_key_value_heads", heads) // tp) * head_dim
    if "embed_tokens" in name or "lm_head" in name:
        return min(rows, -(-rows // 64) * 64 // tp)
    return rows // tp
