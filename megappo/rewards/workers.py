"""Reward workers (`reward.num_workers`): processes that call the reward functions on a batch's responses.

Rank 0 otherwise calls the functions itself, one response after another, after the step's model passes.
With N workers, `RewardWorkers.start(...)` hands the responses out in order-preserving chunks (about four
a worker) and returns at once; `Scoring.outcomes()` yields each response's outcomes in the batch's order
as the chunks finish. A training step starts the scoring as soon as the batch is generated, so the
functions run while the old-log-prob, reference and value passes do, and waits for it where it needs
the scores. Each worker calls the functions exactly as rank 0 would (`megappo.rewards.call_functions`:
your own functions under reward.timeout_s), so the scores, the checks rank 0 applies to them
(`score_records`: numbers, NaN/inf policy, warnings) and the errors are the same; what your function
raised comes back with its frames (`remote_frames`, printed by the CLI as its traceback). The workers
are spawned processes (no copy of the trainer's memory, CUDA context or process groups), started once
per run; each loads the functions (your file runs once per worker). A worker that dies (a crash in C
code, os._exit) ends the run with a UserCodeError saying so.

This module does not know about tokenizers, batches, models or process groups.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle
import traceback
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Iterator, Sequence

from megappo.rewards import code_reward, judge
from megappo.rewards.functions import Outcome, call_functions, get_reward_fn, prefetch
from megappo.user_code import UserCodeError

CHUNKS_PER_WORKER = 4


class RewardWorkers:
    """`num_workers` spawned processes calling `names` (reward.functions) under `timeout_s`; `sandbox`: the
    recipe's reward.sandbox, where each worker's `code` function runs programs, `judge_cfg`: its reward.judge,
    which each worker's `judge` function asks (None: not configured)."""

    def __init__(self, names: Sequence[str], num_workers: int, timeout_s: float, sandbox=None, judge_cfg=None):
        self.names, self.num_workers, self.timeout_s = tuple(names), num_workers, timeout_s
        self._pool = concurrent.futures.ProcessPoolExecutor(
            num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_configure,
            initargs=(sandbox, judge_cfg))

    def start(self, responses: Sequence[str], ground_truths: Sequence[Any], extras: Sequence[dict],
              data_sources: Sequence[str] | None = None) -> "Scoring":
        """Hand the responses to the workers; returns at once."""
        sources = data_sources if data_sources is not None else [None] * len(responses)
        items = list(zip(responses, ground_truths, extras, sources))
        size = max(1, -(-len(items) // (self.num_workers * CHUNKS_PER_WORKER)))
        return Scoring([self._pool.submit(_call_chunk, self.names, self.timeout_s, items[i:i + size])
                        for i in range(0, len(items), size)])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Scoring:
    """The workers' outcomes of one batch, in progress."""

    def __init__(self, chunks: list[concurrent.futures.Future]):
        self._chunks = chunks

    def outcomes(self) -> Iterator[list[Outcome]]:
        """Each response's outcomes, in the batch's order, waiting for each chunk in turn."""
        for chunk in self._chunks:
            try:
                yield from chunk.result()
            except BrokenProcessPool:
                raise UserCodeError("reward functions", "a reward worker process died while scoring (a crash in "
                                    "native code, os._exit, or the out-of-memory killer)",
                                    fix="run with reward.num_workers=0 to see the error in the trainer's "
                                        "process") from None


def _configure(sandbox, judge_cfg) -> None:
    """A worker's start: where its `code` function runs programs, which judge its `judge` function asks."""
    if sandbox is not None:
        code_reward.configure(sandbox)
    if judge_cfg is not None:
        judge.configure(judge_cfg)


def _call_chunk(names: tuple[str, ...], timeout_s: float, items: list[tuple]) -> list[list[Outcome]]:
    """In a worker: the outcomes of each item (the functions' batch hooks called first with the chunk); what a
    function raised travels back with its frames."""
    responses, ground_truths, extras, _ = zip(*items) if items else ((), (), (), ())
    prefetch([get_reward_fn(n) for n in names], responses, ground_truths, extras)
    return [[_portable(o) for o in call_functions(names, *item, timeout_s)] for item in items]


class RemoteError(Exception):
    """What a function raised in a worker, where its own class cannot travel (a class of your file, which
    the trainer's process has not imported under that name): `remote_type` is that class's name."""

    def __init__(self, message: str, remote_type: str):
        super().__init__(message)
        self.remote_type = remote_type

    def __reduce__(self):
        return type(self), (str(self), self.remote_type), self.__dict__


def _portable(outcome: Outcome) -> Outcome:
    """An outcome the trainer's process can unpickle: Python's own exceptions as they are, others as a
    RemoteError; either with the frames of the call (`remote_frames`: file, line, function, text). A
    value that does not pickle (a lambda in the dict) is an "unsendable" outcome saying so."""
    kind, value = outcome
    if kind == "ok":
        try:
            pickle.dumps(value)
        except Exception as e:
            return "unsendable", f"{type(value).__name__} ({type(e).__name__}: {e})"
    if kind != "error":
        return outcome
    frames = [tuple(f) for f in traceback.extract_tb(value.__traceback__)]
    try:
        if type(value).__module__ != "builtins":
            raise TypeError
        pickle.dumps(value)  # a builtin exception holding something that does not pickle
    except Exception:
        value = RemoteError(str(value), type(value).__name__)
    value.remote_frames = frames
    return kind, value
