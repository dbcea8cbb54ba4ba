"""The hf rollout engine in a child process of rank 0 (`rollout.placement: separate`).

`RemoteEngine` is a RolloutEngine (generate, update_weights, fingerprint_of, fingerprints,
shutdown) whose HFEngine lives in a process spawned by rank 0 (torch.multiprocessing,
`spawn`). The child builds the model itself from a picklable factory (`HFModelSource`), so
nothing but requests and results crosses the pipe; it can be pinned to CPU cores
(os.sched_setaffinity, torch.set_num_threads(len(cores))) so that generation and training do
not fight over the same cores.

Protocol: every request (`generate`, one per weight bucket, `fingerprints`, ...) gets an id
and is pickled down one pipe (a weight bucket as one flat buffer in shared memory, of which
the pipe carries a file descriptor and the layout: torch.multiprocessing's reductions); a
thread in the child drains the pipe into a queue (so a sender never blocks on a busy child)
and the child's main thread serves the queue strictly in order, one reply per request.
`submit(prompts, params)` returns a `Handle` at once; `handle.result()` waits for that reply.
Because service is in order, a weight update sent while a generation runs applies after it,
and a fingerprint request sent after an update sees the updated weights. Several threads
may send and wait at the same time.

A child that dies (killed, out of memory, a crash in C code) makes the call waiting on it,
and every later call, raise EngineCrashed with the child's exit code: waits poll the child's
liveness, they never hang. An exception raised by a request inside the child (a wrong
tensor name in an update, ...) is re-raised in the caller and the engine stays usable.

This module does not know about Megatron, PPO, configs or how the bridge gathers weights.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterable, Sequence

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions with ForkingPickler

from megappo.rollout.engine import Bucket, EngineCrashed, tensor_fingerprint
from megappo.types import RolloutBatch, SamplingParams


@dataclasses.dataclass(frozen=True)
class HFModelSource:
    """Picklable recipe for the engine's transformers model: an HF directory (`path`), or a
    model built from `hf_config` with `seed` (megappo.models.hf_reference.build_hf_model)."""

    path: str | None = None
    hf_config: dict | None = None
    seed: int = 0

    def __call__(self) -> torch.nn.Module:
        if self.path:
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32, use_safetensors=True)
        from megappo.models.hf_reference import build_hf_model

        return build_hf_model(self.hf_config, seed=self.seed)


class Handle:
    """A submitted request; `result()` waits for its reply (EngineCrashed if the child died)."""

    def __init__(self, engine: "RemoteEngine", rid: int):
        self._engine, self._rid = engine, rid

    def result(self) -> Any:
        return self._engine._wait(self._rid)


class RemoteEngine:
    """An HFEngine in a spawned child process; same results as the colocated HFEngine built
    from the same model (the child runs the very same code on the same weights)."""

    def __init__(self, model_source, *, pad_token_id: int, cores: Sequence[int] = ()):
        _quiet_lost_handshakes()
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child_conn, model_source, pad_token_id, tuple(cores)),
                                 name="megappo-rollout-engine", daemon=True)
        self._proc.start()
        child_conn.close()
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._reading = False  # a waiter is reading the pipe; the others wait on _cond
        self._replies: dict[int, tuple[bool, Any]] = {}
        self._crash: str | None = None
        self.dtype: torch.dtype = self._call("dtype")  # also waits until the child's model is built

    # -- RolloutEngine --------------------------------------------------------------------------
    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Handle:
        """Queue a generation; returns at once. Served after every request sent before it."""
        return Handle(self, self._request("generate", [list(p) for p in prompts], params))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        return self.submit(prompts, params).result()

    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        """Sends every bucket (the child buffers them while it finishes earlier requests), then
        waits until all are loaded; the first error a bucket met is raised. A bucket crosses as
        one flat buffer in shared memory (`_shared_bucket`): the pipe carries its layout and a
        file descriptor, not the bytes."""
        shared = []  # referenced until the child has loaded them
        rids = []
        for bucket in buckets:
            shared.append(_shared_bucket(bucket))
            rids.append(self._request("update", *shared[-1]))
        errors = []
        for rid in rids:
            try:
                self._wait(rid)
            except EngineCrashed:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised below, after every reply is collected
                errors.append(e)
        if errors:
            raise errors[0]

    def fingerprint_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor_fingerprint(tensor.to(self.dtype))

    def fingerprints(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return self._call("fingerprints", list(names))

    def free_cache(self) -> None:  # the child's cache lives in the child
        pass

    def release_memory(self) -> None:  # the child keeps its memory; nothing to give back on CPU
        pass

    def resume_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        """Stop the child (after the requests already sent); idempotent."""
        if self._proc.is_alive() and not self._crash:
            try:
                self._call("shutdown")
            except (EngineCrashed, OSError):
                pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    # -- the pipe ---------------------------------------------------------------------------------
    def _call(self, method: str, *args) -> Any:
        return self._wait(self._request(method, *args))

    def _request(self, method: str, *args) -> int:
        # torch.multiprocessing's reductions: a CPU tensor goes as a shared-memory file descriptor
        data = ForkingPickler.dumps((method, args), pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._check_alive()
            rid = next(self._ids)
            try:
                self._conn.send_bytes(pickle.dumps(rid) + data)
            except OSError:
                self._died()
        return rid

    def _wait(self, rid: int) -> Any:
        with self._cond:
            while rid not in self._replies:
                if self._reading:
                    self._cond.wait()
                    continue
                self._reading = True
                self._cond.release()
                try:
                    got, ok, payload = self._receive()
                finally:
                    self._cond.acquire()
                    self._reading = False
                    self._cond.notify_all()
                self._replies[got] = (ok, payload)
            ok, payload = self._replies.pop(rid)
        if not ok:
            raise payload
        return payload

    def _receive(self) -> tuple[int, bool, Any]:
        while True:
            self._check_alive(allow_pending=True)
            try:
                if self._conn.poll(0.2):
                    return pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                self._died()
            if not self._proc.is_alive() and not self._conn.poll(0):
                self._died()

    def _check_alive(self, allow_pending: bool = False) -> None:
        if self._crash:
            raise EngineCrashed(self._crash)
        if not allow_pending and not self._proc.is_alive():
            self._died()

    def _died(self) -> None:
        self._proc.join(timeout=5)
        code = self._proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        self._crash = (f"the rollout engine's process (rollout.placement=separate, pid {self._proc.pid}) {how}; its "
                       "log above may say why (out of memory: a smaller rollout batch or max_new_tokens). The engine "
                       "cannot be used any more; rerun to resume from the last checkpoint.")
        raise EngineCrashed(self._crash)


def _quiet_lost_handshakes() -> None:
    """Keep a dead child's half-done file-descriptor handshake off the screen. The weight buckets'
    shared memory crosses by fd: multiprocessing's resource_sharer thread in this process hands each
    fd over a socket, and when the child dies in the middle (killed, out of memory) that thread
    prints a ConnectionResetError traceback through sys.excepthook and serves on. The death itself
    is reported by the waiting call (EngineCrashed, one line naming the process and the signal)."""
    previous = sys.excepthook
    if getattr(previous, "megappo_quiet_handshakes", False):
        return

    def hook(kind, value, tb):
        frames = traceback.extract_tb(tb) if tb else []
        if issubclass(kind, (OSError, EOFError)) and any("resource_sharer" in f.filename for f in frames):
            return
        previous(kind, value, tb)

    hook.megappo_quiet_handshakes = True
    sys.excepthook = hook


def _serve(conn, model_source, pad_token_id: int, cores: tuple[int, ...]) -> None:
    """The child: build the HFEngine, then serve requests in order until `shutdown` or EOF."""
    from megappo.rollout.hf.engine import HFEngine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it shuts us down
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    inbox: queue.Queue = queue.Queue()

    def drain():  # keeps the pipe empty so that the trainer's sends never wait on a busy child
        while True:
            try:
                inbox.put(conn.recv_bytes())
            except (EOFError, OSError):  # the trainer died or closed the pipe
                inbox.put(None)
                return

    threading.Thread(target=drain, name="megappo-engine-inbox", daemon=True).start()
    engine = None
    try:
        # stderr: the child shares its owner's stdout, whose lines are the trainer's
        engine = HFEngine(model_source(), pad_token_id=pad_token_id,
                          log=lambda line: print(line, file=sys.stderr, flush=True))
        startup_error = None
    except Exception as e:  # noqa: BLE001 - reported on the first request
        startup_error = _portable(e)
    while True:
        data = inbox.get()
        if data is None:
            return
        unpickler = pickle.Unpickler(io.BytesIO(data))
        rid = unpickler.load()
        method, args = unpickler.load()
        try:
            if startup_error is not None and method != "shutdown":
                raise startup_error
            result = _dispatch(engine, method, args)
            reply = (rid, True, result)
        except Exception as e:  # noqa: BLE001 - the caller re-raises it
            reply = (rid, False, _portable(e))
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        if method == "shutdown":
            return


def _dispatch(engine, method: str, args: tuple):
    if method == "dtype":
        return engine.dtype
    if method == "generate":
        return engine.generate(*args)
    if method == "update":
        return engine.update_weights([_cut(*args)])
    if method == "fingerprints":
        return engine.fingerprints(*args)
    if method == "shutdown":
        return engine.shutdown() if engine is not None else None
    raise ValueError(f"unknown rollout engine request '{method}'")


def _shared_bucket(bucket: Bucket) -> tuple[torch.Tensor, list]:
    """The bucket's tensors back to back in one uint8 buffer in shared memory (each at a 64-byte
    aligned offset), and the layout the child cuts them out with: [(name, dtype, shape, offset,
    bytes)]. One copy, instead of pickling every tensor into the pipe and out again."""
    layout, offset = [], 0
    for name, tensor in bucket:
        size = tensor.numel() * tensor.element_size()
        layout.append((name, tensor.dtype, tuple(tensor.shape), offset, size))
        offset += -(-size // 64) * 64
    flat = torch.empty(offset, dtype=torch.uint8).share_memory_()
    for (name, tensor), (_, _, _, start, size) in zip(bucket, layout):
        flat[start:start + size].copy_(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    return flat, layout


def _cut(flat: torch.Tensor, layout: list) -> Bucket:
    """The child's side of `_shared_bucket`: the bucket's tensors as views of the shared buffer."""
    return [(name, flat[offset:offset + size].view(dtype).view(shape)) for name, dtype, shape, offset, size in layout]


def _portable(e: Exception) -> Exception:
    """The exception itself when it pickles, else a RuntimeError carrying its traceback."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError("".join(traceback.format_exception(e)))
