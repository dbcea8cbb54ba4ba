"""rollout.mode (megappo.rollout.schedule): which policy version generates each step's batch,
when a weight update may reach the engine, staleness, and the batch a checkpoint buffers.

A fake engine records the version it holds when each generation reads it, twice per
generation (start and end), with a sleep between: a weight update that slipped into a
generation would show as two different versions."""

import threading
import time

import pytest
import torch

from megappo.config import ConfigError, load_config
from megappo.rollout.schedule import SCHEDULES, OneStepOff, Synchronous
from megappo.types import RolloutBatch


class FakeEngine:
    def __init__(self):
        self.version = 0
        self.log = []  # (step, version at start, version at end) of each generation

    def update_weights(self, buckets):
        for bucket in buckets:
            for _name, tensor in bucket:
                self.version = int(tensor.item())

    def fingerprints(self, names):
        return {"w": torch.tensor([self.version])}

    def generate(self, step):
        first = self.version
        time.sleep(0.05)
        self.log.append((step, first, self.version))
        return RolloutBatch(prompt_ids=torch.full((1, 1), step), prompt_mask=torch.ones(1, 1),
                            response_ids=torch.zeros(1, 1), response_mask=torch.ones(1, 1),
                            rollout_log_probs=torch.zeros(1, 1), finish_reasons=["stop"],
                            prompt_index=torch.zeros(1, dtype=torch.long))


def train(schedule, engine, first: int, last: int, train_seconds: float = 0.01):
    """The orchestrator's loop with its order: batch, train, sync (the bridge's update), synced."""
    synced = schedule.gated(engine)
    synced.update_weights([[("w", torch.tensor(first - 1))]])  # train()'s sync before the first step
    schedule.synced(first - 1)
    out = []
    for step in range(first, last + 1):
        batch = schedule.next_batch(step, engine.generate)
        time.sleep(train_seconds)  # training
        synced.update_weights([[("w", torch.tensor(step))]])
        schedule.synced(step)
        out.append((step, int(batch.prompt_ids.item()), batch.policy_version, schedule.metrics()))
    return out


def test_sync_generates_each_batch_with_the_latest_weights():
    engine = FakeEngine()
    out = train(Synchronous(), engine, 1, 4)
    assert [(s, b, v) for s, b, v, _ in out] == [(1, 1, 0), (2, 2, 1), (3, 3, 2), (4, 4, 3)]
    assert all(m["rollout/staleness"] == 0 for *_, m in out)
    assert engine.log == [(1, 0, 0), (2, 1, 1), (3, 2, 2), (4, 3, 3)]


@pytest.mark.parametrize("train_seconds", [0.0, 0.2])  # generation slower, then faster, than training
def test_one_step_off_generates_the_next_batch_one_version_behind(train_seconds):
    engine = FakeEngine()
    schedule = OneStepOff(last_step=5)
    out = train(schedule, engine, 1, 5, train_seconds)
    assert [(s, b, v) for s, b, v, _ in out] == [(1, 1, 0), (2, 2, 0), (3, 3, 1), (4, 4, 2), (5, 5, 3)]
    assert [m["rollout/staleness"] for *_, m in out] == [0, 1, 1, 1, 1]
    # every generation saw one version from start to end: updates waited for it
    assert engine.log == [(1, 0, 0), (2, 0, 0), (3, 1, 1), (4, 2, 2), (5, 3, 3)]
    assert schedule.settle() is None  # nothing generated beyond the last step
    schedule.close()


def test_a_generation_overlaps_training_and_a_checkpoint_buffers_it():
    engine = FakeEngine()
    schedule = OneStepOff(last_step=10)
    out = train(schedule, engine, 1, 3, train_seconds=0.2)
    assert out[-1][3]["timing_s/gen_wait"] < 0.05  # the 0.05 s generation ran while training slept
    step, batch = schedule.settle()  # what Run.save_checkpoint stores after step 3
    assert step == 4 and int(batch.prompt_ids.item()) == 4 and batch.policy_version == 2
    schedule.close()

    # a resumed run: the buffered batch, then the same versions as an uninterrupted run
    resumed, engine2 = OneStepOff(last_step=6), FakeEngine()
    resumed.restore(step, batch)
    got = train(resumed, engine2, 4, 6)
    straight = train(OneStepOff(last_step=6), FakeEngine(), 1, 6)
    assert [(s, b, v) for s, b, v, _ in got] == [(s, b, v) for s, b, v, _ in straight[3:]]
    assert engine2.log[0][0] == 5  # step 4 was not generated again


def test_a_failed_generation_raises_in_the_trainer():
    schedule, engine = OneStepOff(last_step=3), FakeEngine()

    def generate(step):
        if step == 2:
            raise ValueError("reward function broke")
        return engine.generate(step)

    schedule.next_batch(1, generate)
    with pytest.raises(ValueError, match="reward function broke"):  # at the sync that waits for it
        schedule.gated(engine).update_weights([[("w", torch.tensor(1))]])
    assert not schedule._gate.locked()
    schedule.close()


def test_schedules_by_name():
    assert type(SCHEDULES["sync"](3)) is Synchronous and type(SCHEDULES["one_step_off"](3)) is OneStepOff


DEMO = "recipes/demo-cpu.yaml"


@pytest.mark.parametrize("overrides, message", [
    (["rollout.mode=one_step_off", "actor.old_logprob=bypass"], "Fix: set actor.old_logprob=is_correct"),
    (["rollout.placement=separate", "rollout.engine=sglang"], "Fix: set rollout.placement=colocated"),
    (["rollout.engine_cores=[0]"], "Fix: set rollout.placement=separate or rollout.engine_cores=[]"),
])
def test_config_refuses_what_async_cannot_do(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, overrides)
    assert message in str(err.value)


def test_config_accepts_the_recommended_async_setting():
    cfg = load_config(DEMO, ["rollout.mode=one_step_off", "rollout.placement=separate", "rollout.engine_cores=[1]",
                             "actor.old_logprob=is_correct"])
    assert (cfg.rollout.mode, cfg.rollout.placement, cfg.rollout.engine_cores) == ("one_step_off", "separate", [1])


def test_config_accepts_one_step_off_with_sglang():
    """SGLangEngine takes calls from any thread (the generation thread): tests/sglang/test_engine_threads.py."""
    cfg = load_config(DEMO, ["rollout.mode=one_step_off", "rollout.engine=sglang", "actor.old_logprob=is_correct"])
    assert (cfg.rollout.mode, cfg.rollout.engine, cfg.rollout.placement) == ("one_step_off", "sglang", "colocated")
