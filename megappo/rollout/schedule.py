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

Every batch carries the policy version that produced it (`RolloutBatch.policy_version`);
`metrics()` gives `rollout/staleness` (trainer version - sample version) and
`timing_s/gen_wait` (time the trainer was blocked on generation this step: waiting for the
batch, and in the weight sync waiting for the in-flight generation to end).

Checkpoints: `settle()` waits for the in-flight generation and returns it (step, batch): a
checkpoint stores it, and `restore()` puts it back so that a resumed run trains on the same
batch as an uninterrupted one (megappo.checkpointing).

This module does not know what a generation does (the orchestrator passes `generate(step)`),
nor PPO, nor how weights reach the engine.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, Iterable

from megappo.rollout.engine import Bucket
from megappo.types import RolloutBatch

Generate = Callable[[int], RolloutBatch]


class Synchronous:
    """Generate each step's batch when the step asks for it."""

    def __init__(self):
        self.engine_version = 0  # the policy version of the weights the engine holds
        self._restored: tuple[int, RolloutBatch] | None = None
        self._wait = 0.0
        self._staleness = 0

    def gated(self, engine):
        return engine

    def synced(self, version: int) -> None:
        """The engine now holds the weights after `version` optimizer steps."""
        self.engine_version = version

    def next_batch(self, step: int, generate: Generate) -> RolloutBatch:
        start = time.perf_counter()
        if self._restored is not None and self._restored[0] == step:  # a checkpoint's buffered batch
            batch = self._restored[1]
        else:
            batch = _stamped(generate(step), self.engine_version)
        self._restored = None
        self._staleness = (step - 1) - batch.policy_version  # the trainer holds policy version step - 1
        self._wait = time.perf_counter() - start
        return batch

    def metrics(self) -> dict[str, float]:
        return {"rollout/staleness": float(self._staleness), "timing_s/gen_wait": self._wait}

    def settle(self) -> tuple[int, RolloutBatch] | None:
        """The generated batch of a later step, waited for (None: nothing generated ahead)."""
        return self._restored

    def restore(self, step: int, batch: RolloutBatch) -> None:
        """A checkpoint's buffered batch: step `step` trains on it."""
        self._restored = (step, batch)

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
        elif self._restored is not None and self._restored[0] == step:
            batch = self._restored[1]
        else:  # the first step (or after a resume with nothing buffered): nothing was generated ahead
            batch = _stamped(generate(step), self.engine_version)
        self._pending = self._restored = None
        wait = time.perf_counter() - start
        if step < self.last_step:
            self._submit(step + 1, generate)
        self._staleness = (step - 1) - batch.policy_version
        self._wait, self._gate_wait = wait, 0.0
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

    def settle(self) -> tuple[int, RolloutBatch] | None:
        if self._pending is not None:
            return self._pending[0], self._pending[1].result()
        return self._restored

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


def _stamped(batch: RolloutBatch, version: int) -> RolloutBatch:
    batch.policy_version = version
    return batch


#: rollout.mode -> its schedule, given the last step of the run
SCHEDULES: dict[str, Callable[[int], Synchronous]] = {"sync": lambda last_step: Synchronous(),
                                                      "one_step_off": OneStepOff}
