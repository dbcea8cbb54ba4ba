"""Rollout engine replicas: generation spread over the job's ranks (`rollout.replicas`).

R replicas, each an engine of its own (the one `megappo.rollout.registry.engine_for` builds) held
by a *leader* rank; the leaders are spread evenly over the job (`leaders`: replica i on global rank
i * world // R, so replica 0 is rank 0's and two nodes of equal size get R / 2 each). An engine is
colocated on its leader's GPUs, or (SGLang, sync_mode=distributed) disaggregated: on GPUs of the
leader's node the trainer does not use, one block of engine GPUs per replica of that node (`node_slot`);
either way its leader's process drives it, and nothing below depends on where it runs.

Rank 0 holds a `ReplicaSet`, which is a RolloutEngine: the orchestrator, the rollout schedule, the
bridge, multi-turn episodes, dynamic sampling and validation call it exactly as they call one
engine. `generate` splits the call's prompts into R contiguous chunks of whole prompts (a prompt's
n samples stay together: a GRPO group is never split), balanced by expected tokens (prompt length +
max_new_tokens), sends each chunk to its replica at once, generates rank 0's own chunk meanwhile,
and concatenates the parts in order (`megappo.rollout.batches.concat`): the batch is the one a
single engine gives, prompt for prompt. Each chunk carries its `sample_window` (its first sample's
index in the whole call, the call's sample count), so a seeded sample draws the same uniforms, and
so the same tokens, whatever the number of replicas (the hf engine; SGLang does not honour seeds).
The batch's `gen_metrics` get `perf/replica_prompts_min`: the fewest prompts any replica generated in
that call (0 when there were fewer prompts than replicas).

Another leader runs a `ReplicaServer`: a thread that serves rank 0's requests to its engine over
one authenticated TCP connection (multiprocessing.connection), strictly in the order rank 0 sends
them, while the rank's main thread trains. Requests: generate, apply (a weight update), enable
adapters, free / release / resume memory, close.

Weights: the bridge (megappo.rollout.bridge) gathers the actor's full tensors on every leader from
the trainer's shards (megappo.models.weights: each leader from the ranks of its own pipeline; no
traffic through rank 0). Rank 0 streams them into its engine as before; another leader *stages* its
copy (`ReplicaServer.stage`, under the sync's id) and applies it only when rank 0's ReplicaSet says
so: `update_weights` receives the sync id as the stream's first bucket (`SYNC_ID`, put there by the
bridge and kept through the schedule's staging), loads rank 0's engine and asks every replica to
apply that sync (older staged syncs are dropped: the async schedule may skip a version no generation
needs). So every replica changes weights at the same point of rank 0's sequence of engine calls, and
the rollout schedule's version rules (megappo.rollout.schedule) hold for all of them in every mode.
A replica verifies what it applied against fingerprints of what it staged (when the bridge verifies
that sync) and reports the names that differ; rank 0 says which replica in one line and leaves those
names out of `fingerprints`, so the bridge's (or the async schedule's) verification raises
WeightSyncError as for one engine.

A replica that fails (its engine's error, or its rank gone: the connection closes) raises on rank 0
with the replica and its rank named; EngineCrashed stays EngineCrashed, so the run ends as it does
when its one engine dies.

This module does not know about Megatron, PPO, configs or how the bridge gathers weights.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import os
import pickle
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Client, Listener
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from megappo.errors import ConfigError
from megappo.rollout.batches import concat
from megappo.rollout.engine import (
    Bucket, EngineCrashed, RolloutEngine, WeightSyncError, compare_fingerprints, iter_buckets, on_daemon_thread,
)
from megappo.types import RolloutBatch, SamplingParams

#: the name of the first bucket's one entry in a weight update sent to a ReplicaSet: the sync's id
SYNC_ID = "megappo.sync_id"


def leaders(world_size: int, replicas: int) -> tuple[int, ...]:
    """The global ranks that hold the replicas' engines: replica i on rank i * world_size // replicas."""
    if not 1 <= replicas <= world_size:
        raise ConfigError(f"rollout.replicas={replicas} needs 1 <= replicas <= the job's {world_size} rank(s). "
                         f"Fix: set rollout.replicas between 1 and {world_size}.")
    return tuple(i * world_size // replicas for i in range(replicas))


def node_slot(rank: int, local_rank: int, leader_ranks: Sequence[int]) -> int:
    """How many replicas lead from ranks of this rank's node below it (a node's ranks are contiguous): where
    its engine goes among the node's GPUs for engines of their own (rollout.sync_mode=distributed)."""
    return sum(1 for r in leader_ranks if rank - local_rank <= r < rank)


def split_prompts(prompts: Sequence[Sequence[int]], parts: int, max_new_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) of at most `parts` contiguous, non-empty chunks of `prompts`, balanced by expected
    tokens (len(prompt) + max_new_tokens each): chunk k ends at the prompt nearest to k / parts of the total."""
    count = len(prompts)
    parts = min(parts, count)
    cum = list(itertools.accumulate(len(p) + max_new_tokens for p in prompts))
    cuts = [0]
    for k in range(1, parts):
        target = cum[-1] * k / parts
        j = bisect.bisect_left(cum, target)  # prompts [0, j] reach the target
        end = j + 1 if j + 1 < count and cum[j] - target <= target - (cum[j - 1] if j else 0) else j
        cuts.append(min(max(end, cuts[-1] + 1), count - (parts - k)))
    cuts.append(count)
    return list(zip(cuts[:-1], cuts[1:]))


class ReplicaError(RuntimeError):
    """A replica's request failed (its engine raised something other than the engine errors)."""


def _remote_error(kind: str, message: str, where: str) -> Exception:
    text = f"{where}: {message}"
    if kind == "EngineCrashed":
        return EngineCrashed(text)
    if kind == "WeightSyncError":
        return WeightSyncError(text)
    return ReplicaError(f"{where}: {kind}: {message}")


class _Client:
    """Rank 0's connection to one remote replica: a request, then its reply, one at a time."""

    def __init__(self, index: int, rank: int, address: tuple[str, int], authkey: bytes):
        self.index, self.rank = index, rank
        self.where = f"rollout replica {index} (global rank {rank})"
        self._conn = _no_delay(Client(address, authkey=authkey))
        self._lock = threading.Lock()

    def call(self, op: str, *args) -> Any:
        with self._lock:
            try:
                _send(self._conn, (op, args))
                status, value = _recv(self._conn)
            except (EOFError, OSError) as e:
                raise EngineCrashed(f"{self.where} is gone ({type(e).__name__}): its rank or its engine died; the "
                                    "run cannot go on without it. Fix: see that rank's error above.") from None
        if status == "error":
            raise _remote_error(*value, self.where)
        return value

    def close(self) -> None:
        with contextlib.suppress(EngineCrashed, ReplicaError):  # already gone: nothing to close
            self.call("close")
        self._conn.close()


class ReplicaSet:
    """Rank 0's engine when the run has several replicas: replica 0 is `local` (rank 0's engine), the
    others are reached through `clients` (module docstring)."""

    def __init__(self, local: RolloutEngine, clients: list[_Client], pad_token_id: int):
        self.local, self.clients, self.pad_token_id = local, clients, pad_token_id
        self._differ: set[str] = set()  # names another replica holds differently since the last update

    @property
    def replicas(self) -> int:
        return 1 + len(self.clients)

    def _each_remote(self, op: str, *args) -> list:
        futures = [on_daemon_thread(c.call, op, *args, name="megappo-replica-call") for c in self.clients]
        return [f.result() for f in futures]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        spans = split_prompts(prompts, self.replicas, params.max_new_tokens)
        total = len(prompts) * params.n

        def part(span):
            return [list(p) for p in prompts[span[0]:span[1]]], dataclasses.replace(
                params, sample_window=(span[0] * params.n, total))

        futures = [on_daemon_thread(c.call, "generate", *part(span), name="megappo-replica-call") for c, span in zip(self.clients, spans[1:])]
        parts = [_on_host(self.local.generate(*part(spans[0])))] + [f.result() for f in futures]
        batch = concat(parts, self.pad_token_id)
        # every part came back: each replica generated its span's prompts (one without a span, none)
        fewest = min(stop - start for start, stop in spans) if len(spans) == self.replicas else 0
        batch.gen_metrics = {**(batch.gen_metrics or {}), "perf/replica_prompts_min": float(fewest)}
        return batch

    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        buckets = iter(buckets)
        first = next(buckets, None)
        if not first or first[0][0] != SYNC_ID:
            raise ValueError("a weight update for several rollout replicas starts with the sync's id "
                             f"(a bucket [('{SYNC_ID}', id)], megappo.rollout.bridge)")
        sync_id = int(first[0][1])
        self.local.update_weights(buckets)
        self._differ = set()
        for client, bad in zip(self.clients, self._each_remote("apply", sync_id)):
            if bad:
                print(f"{client.where}: {len(bad)} tensor(s) differ from what the trainer sent after sync {sync_id}, "
                      f"e.g. {bad[:3]}", file=sys.stderr, flush=True)
                self._differ.update(bad)

    def enable_adapters(self, scale: float) -> None:
        self.local.enable_adapters(scale)
        self._each_remote("enable_adapters", scale)

    def fingerprint_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.local.fingerprint_of(name, tensor)

    def fingerprints(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Rank 0's engine's, without the names another replica found different when it applied the last
        update (each checks its own): the bridge's or the schedule's verification then fails for them."""
        return {n: fp for n, fp in self.local.fingerprints(names).items() if n not in self._differ}

    def free_cache(self) -> None:
        self.local.free_cache()
        self._each_remote("free_cache")

    def release_memory(self) -> None:
        self.local.release_memory()
        self._each_remote("release_memory")

    def resume_memory(self) -> None:
        self.local.resume_memory()
        self._each_remote("resume_memory")

    def shutdown(self) -> None:
        for client in self.clients:
            client.close()
        self.local.shutdown()

    def __getattr__(self, name):  # anything else (kv_cache_bytes, ...): rank 0's engine's
        return getattr(self.local, name)


class ReplicaServer:
    """A non-zero leader's engine, served to rank 0 from a thread of this rank (module docstring)."""

    def __init__(self, engine: RolloutEngine, listener: Listener, index: int, bucket_bytes: int):
        self.engine, self.index, self.bucket_bytes = engine, index, bucket_bytes
        self._listener = listener
        self._staged: dict[int, tuple[list[tuple[str, torch.Tensor]], bool]] = {}
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name=f"megappo-replica-{index}", daemon=True)
        self._thread.start()

    def stage(self, sync_id: int, tensors: list[tuple[str, torch.Tensor]], verify: bool) -> None:
        """The trainer side (this rank's main thread): sync `sync_id`'s full tensors, owned copies."""
        with self._cond:
            self._staged[sync_id] = (tensors, verify)
            self._cond.notify_all()

    def _apply(self, sync_id: int) -> list[str]:
        """Load sync `sync_id` once the main thread has staged it; the names whose fingerprints then differ
        from what was staged (when that sync is verified)."""
        with self._cond:
            self._cond.wait_for(lambda: sync_id in self._staged)
            tensors, verify = self._staged.pop(sync_id)
            for older in [s for s in self._staged if s < sync_id]:
                del self._staged[older]
        self.engine.update_weights(iter_buckets(iter(tensors), self.bucket_bytes))
        if not verify:
            return []
        expected = {name: self.engine.fingerprint_of(name, t) for name, t in tensors}
        return compare_fingerprints(expected, self.engine.fingerprints(expected.keys()))

    def _handle(self, op: str, args: tuple) -> Any:
        if op == "generate":
            return _on_host(self.engine.generate(*args))
        if op == "apply":
            return self._apply(*args)
        if op in ("enable_adapters", "free_cache", "release_memory", "resume_memory"):
            return getattr(self.engine, op)(*args)
        raise ValueError(f"unknown replica request {op!r}")

    def _serve(self) -> None:
        try:
            conn = _no_delay(self._listener.accept())
        finally:
            self._listener.close()
        with conn:
            while True:
                try:
                    op, args = _recv(conn)
                except (EOFError, OSError):  # rank 0 is gone: its error ends the run
                    return
                if op == "close":
                    self.engine.shutdown()
                    _send(conn, ("ok", None))
                    return
                try:
                    reply = ("ok", self._handle(op, args))
                except Exception as e:  # noqa: BLE001 - rank 0 raises it, naming this replica
                    traceback.print_exc()  # where, on this rank's stderr
                    reply = ("error", (type(e).__name__, str(e)))
                _send(conn, reply)


def _no_delay(conn):
    """The connection with Nagle's algorithm off: a large message goes as its length, then its bytes, and
    the bytes would otherwise wait for the peer's delayed ACK of the length (40 ms a request)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _send(conn, obj) -> None:
    """Plain pickle, tensors by value (a Connection's own pickler would pass CPU tensors as file
    descriptors of shared memory, which a process of another rank or node cannot open)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _on_host(batch: RolloutBatch) -> RolloutBatch:
    """The batch with every tensor on the CPU (what crosses the connection)."""
    moved = {f.name: getattr(batch, f.name).cpu() for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **moved)


def _listen_host() -> str:
    """Where a replica listens: loopback for a job on one machine, else the address this node reaches
    rank 0's store from (the interface the job's own traffic uses)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
        return probe.getsockname()[0]
    finally:
        probe.close()


def connect(rank: int, leader_ranks: Sequence[int], engine: RolloutEngine | None, *, pad_token_id: int,
            bucket_bytes: int) -> tuple[RolloutEngine | None, ReplicaServer | None]:
    """Collective over the default group: (rank 0's engine, this rank's server). Rank 0 gets a ReplicaSet
    over every leader's engine (its own `engine` when there is one replica); another leader serves its
    `engine` and gets its ReplicaServer; other ranks get (None, None)."""
    if len(leader_ranks) == 1:
        return (engine if rank == 0 else None), None
    box = [os.urandom(32) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    authkey = box[0]
    listener = server = None
    if rank in leader_ranks and rank != 0:
        listener = Listener((_listen_host(), 0), authkey=authkey)
    addresses: list = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, listener.address if listener else None)
    if listener is not None:
        server = ReplicaServer(engine, listener, leader_ranks.index(rank), bucket_bytes)
        return None, server
    if rank != 0:
        return None, None
    clients = [_Client(i, r, addresses[r], authkey) for i, r in enumerate(leader_ranks) if r != 0]
    return ReplicaSet(engine, clients, pad_token_id), None
