"""When the batch of a step is generated relative to training (`rollout.mode`), on rank 0.

`Synchronous` (`sync`): step k's batch is generated at the start of step k by the weights
the trainer synced at the end of step k-1 (policy version k-1): staleness 0.

`OneStepOff` (`one_step_off`): at step k the trainer takes the batch generated while step
k-1 trained, then starts step k+1's generation in a background thread and trains. That
generation runs on the weights the engine holds (policy version k-1, one behind the
trainer's k at step k+1): staleness 1 (0 at the first step, generated up front). A
generation holds the engine's *gate* from its submission to its end; the engine the bridge
syncs is wrapped (`gated`) so that a weight update waits for the gate: the whole generation
(every engine call inside it, several for ReMax or multi-turn) sees one policy version, and
the same one however the threads are scheduled, so a seeded run is reproducible.

`Async` (`async`, `rollout.max_staleness` = N): a generation thread of its own runs ahead of
the trainer, generating step j's batch with policy version v(j) = max(v0, j - 1 - N) (v0: the
version the run started from), so staleness reaches N and never exceeds it; N = 1 gives
exactly one_step_off's versions. The trainer does not wait for the engine to take a weight
update: `gated(engine)` *stages* it (a host copy of the HF tensors the bridge streams) and the
generation thread applies it before the first generation that needs it. The generator can
therefore be up to N steps ahead, and a generation slower than a training step is absorbed
by the batches already buffered, instead of stalling the trainer. One staged version is kept
at a time: a weight update waits while the previous one is still needed and not yet applied
(the trainer then blocks until the generation of step k + N - 1 ended, at step k's sync).
Which version each generation sees is fixed by v(j), not by thread timing: a seeded run is
reproducible and resumes bit for bit. Verification (`rollout.verify_every`) moves with the
update: the bridge checks the staged copy, and the generation thread checks the engine after
applying it (a `WeightSyncError` then surfaces at the trainer's next batch).

Every batch carries the policy version that produced it (`RolloutBatch.policy_version`);
`metrics()` gives `rollout/staleness` (trainer version - sample version), `timing_s/gen_wait`
(time the trainer was blocked on generation this step: waiting for the batch, for the weight
sync, for a checkpoint's or validation's settling) and, in async mode, `perf/rollout_batches_ahead`
(batches already generated for later steps when this step took its own).

Checkpoints and validation: `settle()` waits for every generation the synced weights allow
(one_step_off: the one in flight; async: up to step k + 1 + N after step k) and returns the
buffered batches [(step, batch)]; a checkpoint stores them, and `restore()` puts them back so
that a resumed run trains on the same batches as an uninterrupted one (megappo.trainer.checkpointing).
`at_latest()` (around validation) settles and makes the engine hold the trainer's weights.

This module does not know what a generation does (the orchestrator passes `generate(step)`),
nor PPO, nor how weights reach the engine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from typing import Callable, Iterable

import torch

from megappo.rollout.engine import Bucket, WeightSyncError, compare_fingerprints
from megappo.types import RolloutBatch

Generate = Callable[[int], RolloutBatch]
Buffered = list[tuple[int, RolloutBatch]]  # (step, batch) generated ahead of the training


class Synchronous:
    """Generate each step's batch when the step asks for it."""

    def __init__(self):
        self.engine_version = 0  # the policy version of the weights the engine holds
        self._restored: dict[int, RolloutBatch] = {}  # a checkpoint's buffered batches, by step
        self._wait = 0.0
        self._staleness = 0

    def gated(self, engine):
        return engine

    def synced(self, version: int) -> None:
        """Step `version` ended: the bridge just synced the weights of that policy version, or (a step
        that did not update the actor: run.critic_warmup) sent nothing, the weights being the same as
        the version before."""
        self.engine_version = version

    def next_batch(self, step: int, generate: Generate) -> RolloutBatch:
        start = time.perf_counter()
        batch = self._restored.pop(step) if step in self._restored else _stamped(generate(step), self.engine_version)
        self._took(step, batch, time.perf_counter() - start)
        return batch

    def _took(self, step: int, batch: RolloutBatch, wait: float) -> None:
        self._staleness = (step - 1) - batch.policy_version  # the trainer holds policy version step - 1
        self._wait = wait

    def metrics(self) -> dict[str, float]:
        return {"rollout/staleness": float(self._staleness), "timing_s/gen_wait": self._wait}

    def settle(self) -> Buffered:
        """The batches generated for later steps, waited for ([]: nothing generated ahead)."""
        return sorted(self._restored.items())

    def restore(self, buffered: Buffered) -> None:
        """A checkpoint's buffered batches: each later step trains on its own."""
        self._restored = dict(buffered)

    def at_latest(self):
        """Around engine calls of the trainer's own (validation): the engine holds the weights
        synced last and no generation runs."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class OneStepOff(Synchronous):
    """Step k+1's generation runs while step k trains (`last_step`: none is started beyond it)."""

    def __init__(self, last_step: int):
        super().__init__()
        self.last_step = last_step
        self._gate = threading.Lock()  # held by the generation in flight
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megappo-rollout")
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        self._gate_wait = 0.0

    def gated(self, engine):
        return _GatedEngine(engine, self)

    def next_batch(self, step: int, generate: Generate) -> RolloutBatch:
        start = time.perf_counter()
        if self._pending is not None and self._pending[0] == step:
            batch = self._pending[1].result()
        elif step in self._restored:
            batch = self._restored.pop(step)
        else:  # the first step (or after a resume with nothing buffered): nothing was generated ahead
            batch = _stamped(generate(step), self.engine_version)
        self._pending = None
        wait = time.perf_counter() - start
        if step < self.last_step and step + 1 not in self._restored:
            self._submit(step + 1, generate)
        self._took(step, batch, wait)
        self._gate_wait = 0.0
        return batch

    def metrics(self) -> dict[str, float]:
        return {"rollout/staleness": float(self._staleness), "timing_s/gen_wait": self._wait + self._gate_wait}

    def _submit(self, step: int, generate: Generate) -> None:
        self._gate.acquire()  # here, not in the thread: an update sent after this returns waits for it
        version = self.engine_version

        def run() -> RolloutBatch:
            try:
                return _stamped(generate(step), version)
            finally:
                self._gate.release()

        try:
            self._pending = (step, self._pool.submit(run))
        except BaseException:
            self._gate.release()
            raise

    def wait_for_gate(self) -> None:
        """Block until no generation is in flight (what a weight update does first); re-raises
        the generation's error, if it failed."""
        start = time.perf_counter()
        with self._gate:
            pass
        self._gate_wait += time.perf_counter() - start
        if self._pending is not None and self._pending[1].done():
            self._pending[1].result()

    def settle(self) -> Buffered:
        pending = [(self._pending[0], self._pending[1].result())] if self._pending is not None else []
        return sorted(self._restored.items()) + pending

    def close(self) -> None:
        if self._pending is not None:
            concurrent.futures.wait([self._pending[1]])
        self._pool.shutdown(wait=True)


class _GatedEngine:
    """The engine as the weight bridge sees it: an update first waits for the generation in flight."""

    def __init__(self, engine, schedule: OneStepOff):
        self._engine, self._schedule = engine, schedule

    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        self._schedule.wait_for_gate()
        self._engine.update_weights(buckets)

    def __getattr__(self, name):  # fingerprint_of, fingerprints, ...: the engine's own
        return getattr(self._engine, name)


@dataclasses.dataclass
class _Staged:
    """One weight update, copied on the host: applied to the engine by the generation thread."""

    buckets: list[Bucket]
    expected: dict[str, torch.Tensor]  # the bridge's fingerprints, when it verifies this sync ({} otherwise)
    version: int | None = None  # set when published (Async.synced)


class Async(Synchronous):
    """A generation thread up to `max_staleness` steps ahead of the trainer (module docstring)."""

    def __init__(self, last_step: int, max_staleness: int):
        super().__init__()
        assert max_staleness >= 1
        self.last_step, self.max_staleness = last_step, max_staleness
        self._engine = None
        self._cond = threading.Condition()
        self._incoming: _Staged | None = None  # staged by update_weights, published by synced
        self._staged: _Staged | None = None  # published, not applied yet
        self._base: int | None = None  # the first version published: the run's start
        self._published: int | None = None
        self._same_as: dict[int, int] = {}  # a version published without an update -> the one whose weights it holds
        self._applied: int | None = None  # the version the engine holds
        self._batches: dict[int, RolloutBatch] = {}  # generated, not taken yet
        self._next = 0  # the next step the thread generates (0: not started)
        self._running = False  # a generation (or an update before it) is under way
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._blocked = 0.0
        self._ahead = 0

    def version_for(self, step: int) -> int:
        """v(step): the policy version that generates step's batch."""
        return max(self._base, step - 1 - self.max_staleness)

    # ---- trainer side ---------------------------------------------------------------------
    def gated(self, engine):
        self._engine = engine
        return _StagingEngine(engine, self)

    def stage(self, buckets: Iterable[Bucket], expected: dict[str, torch.Tensor]) -> None:
        """Copy one weight update (the bridge's buckets) to the host once the slot is free;
        `expected` fills with the bridge's fingerprints of it while the buckets stream."""
        with self._waiting() as cond:
            cond.wait_for(lambda: self._failed() or self._staged is None or not self._needed(self._staged.version))
            self._raise_if_failed()
        copied = [[(name, tensor.detach().clone()) for name, tensor in bucket] for bucket in buckets]
        self._incoming = _Staged(copied, expected)

    def staged_fingerprints(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        held = {name: tensor for bucket in self._incoming.buckets for name, tensor in bucket}
        return {name: self._engine.fingerprint_of(name, held[name]) for name in names}

    def synced(self, version: int) -> None:
        super().synced(version)
        with self._cond:
            if self._incoming is None and self._published is not None:  # nothing sent: the weights did not change
                self._same_as[version] = self._held(self._published)
            elif self._incoming is not None:
                self._incoming.version = version
                self._staged, self._incoming = self._incoming, None
            if self._base is None:
                self._base = version
            self._published = version
            self._cond.notify_all()

    def next_batch(self, step: int, generate: Generate) -> RolloutBatch:
        self._blocked = 0.0
        if self._thread is None:
            self._start(step, generate)
        with self._waiting() as cond:
            cond.wait_for(lambda: step in self._batches or self._failed())
            if step not in self._batches:  # a later generation's failure waits for its own step
                self._raise_if_failed()
            batch = self._batches.pop(step)
            self._ahead = sum(s > step for s in self._batches)
        self._took(step, batch, 0.0)
        return batch

    def metrics(self) -> dict[str, float]:
        """gen_wait: blocked since this step asked for its batch (the batch, the weight sync, settling)."""
        return {"rollout/staleness": float(self._staleness), "timing_s/gen_wait": self._blocked,
                "perf/rollout_batches_ahead": float(self._ahead)}

    def settle(self) -> Buffered:
        if self._thread is None:
            return super().settle()
        last = min(self.last_step, self._published + 1 + self.max_staleness)
        with self._waiting() as cond:  # closed: the thread has ended, nothing more will come
            cond.wait_for(lambda: self._error is not None or self._closed or (self._next > last and not self._running))
            if self._error is not None:
                raise self._error
            return sorted(self._batches.items())

    @contextlib.contextmanager
    def at_latest(self):
        self.settle()
        with self._cond:  # the thread now waits for a later version (or has ended): the engine is ours
            staged, self._staged = self._staged, None
        if staged is not None:
            self._apply(staged)
        yield

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    @contextlib.contextmanager
    def _waiting(self):
        start = time.perf_counter()
        with self._cond:
            yield self._cond
        self._blocked += time.perf_counter() - start

    def _failed(self) -> bool:
        return self._error is not None or self._closed

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the rollout schedule was closed")

    def _needed(self, version: int) -> bool:
        """Will a generation not started yet be the first to use `version`? (under the lock)"""
        if self._next == 0:  # not started: the first generation uses the base version
            return True
        return self._next <= self.last_step and self._held(self.version_for(self._next)) <= version

    def _held(self, version: int) -> int:
        """The version whose weights `version` has (itself, unless it was published without an update)."""
        return self._same_as.get(version, version)

    def _start(self, step: int, generate: Generate) -> None:
        self._batches = self._restored
        self._restored = {}
        self._next = max([step - 1, *self._batches]) + 1
        self._thread = threading.Thread(target=self._generate_ahead, args=(generate,), name="megappo-rollout",
                                        daemon=True)
        self._thread.start()

    # ---- generation thread ----------------------------------------------------------------
    def _generate_ahead(self, generate: Generate) -> None:
        try:
            while True:
                with self._cond:
                    step = self._next
                    if step > self.last_step:
                        return
                    version = self.version_for(step)
                    # (the weights of a version published without an update are those of an earlier one)
                    self._cond.wait_for(lambda: self._closed or self._applied == self._held(version) or (
                        self._staged is not None and self._staged.version == self._held(version)))
                    if self._closed:
                        return
                    staged = None
                    if self._applied != self._held(version):
                        staged, self._staged = self._staged, None
                    self._next, self._running = step + 1, True
                if staged is not None:
                    self._apply(staged)
                batch = _stamped(generate(step), version)
                with self._cond:
                    self._batches[step] = batch
                    self._running = False
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer's thread
            with self._cond:
                self._error, self._running = e, False
                self._cond.notify_all()

    def _apply(self, staged: _Staged) -> None:
        self._engine.update_weights(staged.buckets)
        if staged.expected:
            bad = compare_fingerprints(staged.expected, self._engine.fingerprints(staged.expected.keys()))
            if bad:
                raise WeightSyncError(
                    f"weight sync verification failed for {len(bad)} tensor(s), e.g. {bad[:3]}, when the generation "
                    f"thread applied policy version {staged.version}: the engine holds different weights than the "
                    "trainer sent. Fix: report it with these tensor names; rollout.verify_every=0 turns the check off.")
        with self._cond:
            self._applied = staged.version
            self._cond.notify_all()


class _StagingEngine:
    """The engine as the weight bridge sees it in async mode: an update is staged, not applied."""

    def __init__(self, engine, schedule: Async):
        self._engine, self._schedule = engine, schedule
        self._expected: dict[str, torch.Tensor] = {}

    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        self._expected = {}
        self._schedule.stage(buckets, self._expected)

    def fingerprint_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        fingerprint = self._expected[name] = self._engine.fingerprint_of(name, tensor)
        return fingerprint

    def fingerprints(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The staged copy's (the engine is checked against the same when it takes the copy)."""
        return self._schedule.staged_fingerprints(names)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _stamped(batch: RolloutBatch, version: int) -> RolloutBatch:
    """The batch with the policy version that generated it (and its tokens generated now: partial rollouts'
    `token_versions`, megappo.rollout.partial, where earlier tokens keep their own)."""
    batch.policy_version = version
    if batch.token_versions is not None:
        batch.token_versions[batch.token_versions < 0] = version
    return batch


#: rollout.mode -> its schedule, given the last step of the run and rollout.max_staleness
SCHEDULES: dict[str, Callable[[int, int], Synchronous]] = {
    "sync": lambda last_step, max_staleness: Synchronous(),
    "one_step_off": lambda last_step, max_staleness: OneStepOff(last_step),
    "async": Async,
}
